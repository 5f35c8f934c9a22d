//! JWTs signed in the test (ES256 keys made with rcgen) and the JWKS that
//! publishes their public keys.

use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey, Header};

pub const ISSUER: &str = "https://issuer.test";
pub const AUDIENCE: &str = "hookwire";

pub struct Signer {
    pub kid: String,
    key: EncodingKey,
    x: String,
    y: String,
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

impl Signer {
    pub fn new(kid: &str) -> Signer {
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let raw = kp.public_key_raw(); // 0x04 || x || y
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        Signer {
            kid: kid.into(),
            key: EncodingKey::from_ec_der(&kp.serialize_der()),
            x: b64.encode(&raw[1..33]),
            y: b64.encode(&raw[33..65]),
        }
    }

    pub fn jwk(&self) -> serde_json::Value {
        serde_json::json!({"kty": "EC", "crv": "P-256", "x": self.x, "y": self.y,
                           "kid": self.kid, "alg": "ES256", "use": "sig"})
    }

    /// A token for `sub` with `roles`, valid for an hour; `edit` may change
    /// the claims; `kid` decides whether the header names the key.
    pub fn token(
        &self,
        sub: &str,
        roles: &[&str],
        kid: bool,
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> String {
        let mut claims = serde_json::json!({
            "iss": ISSUER, "aud": AUDIENCE, "sub": sub, "roles": roles,
            "iat": now(), "exp": now() + 3600, "tenant": "acme",
        });
        edit(&mut claims);
        let mut h = Header::new(Algorithm::ES256);
        if kid {
            h.kid = Some(self.kid.clone());
        }
        jsonwebtoken::encode(&h, &claims, &self.key).unwrap()
    }
}

/// The JWKS of `signers`, plus an encryption key, as issuers publish them
/// (it must be ignored, not break the set).
pub fn jwks(signers: &[&Signer]) -> String {
    let mut keys: Vec<serde_json::Value> = signers.iter().map(|s| s.jwk()).collect();
    keys.push(serde_json::json!({"kty": "RSA", "use": "enc", "alg": "RSA-OAEP", "kid": "enc-1",
                                 "n": "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw",
                                 "e": "AQAB"}));
    serde_json::json!({"keys": keys}).to_string()
}

/// A token signed with a shared secret (HS256): never accepted.
pub fn hs256_token(sub: &str) -> String {
    let claims =
        serde_json::json!({"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "exp": now() + 3600});
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(b"shared"),
    )
    .unwrap()
}

/// `auth:` for jwt mode with `jwks_file`.
pub fn auth_yaml(jwks_file: &std::path::Path) -> String {
    format!(
        "auth:\n  mode: jwt\n  jwks_file: {}\n  issuer: {ISSUER}\n  audience: {AUDIENCE}\n  leeway: 5s\n  forward_claims: [roles, tenant]\nserver: {{reload_interval: 0s}}\n",
        jwks_file.display()
    )
}
