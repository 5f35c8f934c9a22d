//! OIDC/JWT bearer tokens, verified against a JWKS file that is re-read
//! when it changes (an operator or a sidecar keeps it current; hookwire
//! makes no outbound calls on the request path). Algorithms are pinned by
//! config, never taken from the token or the key; `iss`, `aud` and `exp`
//! are required; a token without `kid` is only accepted when the JWKS holds
//! exactly one key.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;
use std::time::Duration;

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};

use crate::config::{AuthConfig, DEFAULT_JWT_LEEWAY};
use crate::tls::{ReloadError, Reloading};

use super::principal::Principal;

struct Key {
    kid: Option<String>,
    /// The JWK's own `alg`, when it names one: the token must match it.
    alg: Option<Algorithm>,
    key: DecodingKey,
}

struct Keys(Vec<Key>);

pub struct JwtVerifier {
    keys: Reloading<Keys>,
    algorithms: Vec<Algorithm>,
    issuer: String,
    audience: String,
    leeway: Duration,
    principal_claim: String,
    roles_claim: String,
}

fn parse_jwks(bytes: &[u8]) -> Result<Keys, String> {
    let set: JwkSet = serde_json::from_slice(bytes)
        .map_err(|e| format!("not a JWKS (`{{\"keys\": [...]}}`): {e}"))?;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        // Issuers publish encryption keys beside signing keys: not ours.
        if matches!(
            jwk.common.public_key_use,
            Some(jsonwebtoken::jwk::PublicKeyUse::Encryption)
        ) {
            continue;
        }
        let alg = match &jwk.common.key_algorithm {
            Some(a) => match Algorithm::from_str(&format!("{a:?}")) {
                Ok(alg) => Some(alg),
                Err(_) => continue, // an encryption algorithm (RSA-OAEP...)
            },
            None => None,
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("keys[{i}]: {e}"))?;
        keys.push(Key {
            kid: jwk.common.key_id.clone(),
            alg,
            key,
        });
    }
    if keys.is_empty() {
        return Err("the JWKS holds no signing keys".into());
    }
    Ok(Keys(keys))
}

impl JwtVerifier {
    pub fn new(a: &AuthConfig, reload_interval: Duration) -> Result<JwtVerifier, ReloadError> {
        let file = a
            .jwks_file
            .clone()
            .ok_or_else(|| ReloadError("auth.jwks_file: required for auth.mode: jwt".into()))?;
        let names: Vec<String> = if a.algorithms.is_empty() {
            vec!["RS256".into(), "ES256".into()]
        } else {
            a.algorithms.clone()
        };
        let algorithms = names
            .iter()
            .map(|n| {
                Algorithm::from_str(n).map_err(|_| ReloadError(format!("auth.algorithms: `{n}`")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(JwtVerifier {
            keys: Reloading::new("jwks", "auth.jwks_file", vec![file], reload_interval, |b| {
                parse_jwks(&b[0])
            })?,
            algorithms,
            issuer: a.issuer.clone().unwrap_or_default(),
            audience: a.audience.clone().unwrap_or_default(),
            leeway: a.leeway.unwrap_or(DEFAULT_JWT_LEEWAY),
            principal_claim: a.principal_claim.clone().unwrap_or_else(|| "sub".into()),
            roles_claim: a.roles_claim.clone().unwrap_or_else(|| "roles".into()),
        })
    }

    /// Verifies a token; the error says why it was refused, never echoing
    /// the token.
    pub fn verify(&self, token: &str) -> Result<Principal, String> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| format!("malformed JWT: {e}"))?;
        if !self.algorithms.contains(&header.alg) {
            return Err(format!("JWT algorithm {:?} is not accepted", header.alg));
        }
        let keys = self.keys.current();
        let key = match &header.kid {
            Some(kid) => keys
                .0
                .iter()
                .find(|k| k.kid.as_deref() == Some(kid.as_str()))
                .ok_or_else(|| "JWT signed by a key (kid) not in the JWKS".to_string())?,
            None if keys.0.len() == 1 => &keys.0[0],
            None => return Err("JWT has no kid and the JWKS holds several keys".into()),
        };
        if key.alg.is_some_and(|a| a != header.alg) {
            return Err("JWT algorithm does not match its key's".into());
        }
        let mut v = Validation::new(header.alg);
        v.algorithms = vec![header.alg];
        v.leeway = self.leeway.as_secs();
        v.validate_exp = true;
        v.validate_nbf = true;
        v.set_issuer(&[self.issuer.as_str()]);
        v.set_audience(&[self.audience.as_str()]);
        v.set_required_spec_claims(&["exp", "iss", "aud"]);
        let data =
            jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, &key.key, &v)
                .map_err(|e| match e.kind() {
                    jsonwebtoken::errors::ErrorKind::ExpiredSignature => "JWT expired".to_string(),
                    jsonwebtoken::errors::ErrorKind::ImmatureSignature => {
                        "JWT not valid yet (nbf)".to_string()
                    }
                    jsonwebtoken::errors::ErrorKind::InvalidIssuer => {
                        "JWT issuer not accepted".to_string()
                    }
                    jsonwebtoken::errors::ErrorKind::InvalidAudience => {
                        "JWT audience not accepted".to_string()
                    }
                    jsonwebtoken::errors::ErrorKind::InvalidSignature => {
                        "JWT signature does not verify".to_string()
                    }
                    jsonwebtoken::errors::ErrorKind::MissingRequiredClaim(c) => {
                        format!("JWT lacks required claim `{c}`")
                    }
                    _ => format!("JWT rejected: {e}"),
                })?;
        let claims = data.claims;
        let name = match claims.get(&self.principal_claim) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
            _ => {
                return Err(format!(
                    "JWT lacks a string `{}` claim naming the principal",
                    self.principal_claim
                ))
            }
        };
        let roles: BTreeSet<String> = match claims.get(&self.roles_claim) {
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            Some(serde_json::Value::String(s)) => {
                s.split_whitespace().map(str::to_string).collect()
            }
            _ => BTreeSet::new(),
        };
        let mut p = Principal::new(name, roles);
        // Scalars only: hooks get strings, not nested JSON.
        p.claims = claims
            .iter()
            .filter_map(|(k, v)| match v {
                serde_json::Value::String(s) => Some((k.clone(), s.clone())),
                serde_json::Value::Number(n) => Some((k.clone(), n.to_string())),
                serde_json::Value::Bool(b) => Some((k.clone(), b.to_string())),
                _ => None,
            })
            .collect::<BTreeMap<_, _>>();
        Ok(p)
    }
}
