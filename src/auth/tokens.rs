//! Static bearer tokens: a YAML file (typically a mounted Secret) listing
//! each token's SHA-256 with the principal and roles it stands for. The
//! tokens themselves are never stored; a presented token is hashed and
//! compared with every entry in constant time.

use std::collections::BTreeMap;

use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::principal::Principal;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    tokens: Vec<Entry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    principal: String,
    /// Hex SHA-256 of the token (`printf %s TOKEN | sha256sum`).
    sha256: String,
    #[serde(default)]
    roles: Vec<String>,
    /// Extra facts about the principal hooks may be told (e.g. `tenant`),
    /// subject to `auth.forward_claims`.
    #[serde(default)]
    claims: BTreeMap<String, String>,
}

#[derive(Debug)]
struct Known {
    digest: [u8; 32],
    principal: Principal,
}

/// The parsed tokens file.
#[derive(Debug)]
pub struct TokenTable {
    known: Vec<Known>,
}

fn parse_hex(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl TokenTable {
    /// Parses a tokens file; errors name the entry (`tokens[2].sha256`).
    pub fn parse(bytes: &[u8]) -> Result<TokenTable, String> {
        let de = serde_norway::Deserializer::from_slice(bytes);
        let file: File = serde_path_to_error::deserialize(de)
            .map_err(|e| format!("{}: {}", e.path(), e.inner()))?;
        let mut known = Vec::with_capacity(file.tokens.len());
        for (i, e) in file.tokens.into_iter().enumerate() {
            if e.principal.trim().is_empty() {
                return Err(format!("tokens[{i}].principal: must not be empty"));
            }
            let digest = parse_hex(&e.sha256).ok_or_else(|| {
                format!("tokens[{i}].sha256: must be 64 hex digits (printf %s TOKEN | sha256sum), never the token itself")
            })?;
            let mut p = Principal::new(e.principal, e.roles);
            p.claims = e.claims;
            known.push(Known {
                digest,
                principal: p,
            });
        }
        Ok(TokenTable { known })
    }

    /// The principal a token stands for. Every entry is compared (no early
    /// exit), each compare in constant time, so timing says nothing about
    /// which or how many bytes matched.
    pub fn lookup(&self, token: &str) -> Option<&Principal> {
        let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut found = None;
        for k in &self.known {
            if bool::from(k.digest.ct_eq(d.as_ref())) && found.is_none() {
                found = Some(&k.principal);
            }
        }
        found
    }
}

/// Hex SHA-256 of a token, as the tokens file wants it.
pub fn token_sha256(token: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_principal_of_a_token_by_its_hash() {
        let yaml = format!(
            "tokens:\n  - principal: alice\n    sha256: {}\n    roles: [admin]\n    claims: {{tenant: acme}}\n  - principal: bob\n    sha256: {}\n",
            token_sha256("a-secret"),
            token_sha256("b-secret").to_uppercase()
        );
        let t = TokenTable::parse(yaml.as_bytes()).unwrap();
        let a = t.lookup("a-secret").unwrap();
        assert_eq!(a.name, "alice");
        assert!(a.is_admin());
        assert_eq!(a.claims.get("tenant").map(String::as_str), Some("acme"));
        assert_eq!(t.lookup("b-secret").unwrap().name, "bob");
        assert!(t.lookup("a-secreT").is_none());
        assert!(t.lookup("").is_none());
    }

    #[test]
    fn a_bad_entry_names_its_path() {
        let e = TokenTable::parse(b"tokens:\n  - principal: a\n    sha256: plaintext-token\n")
            .unwrap_err();
        assert!(e.starts_with("tokens[0].sha256"), "{e}");
        let e = TokenTable::parse(b"tokens:\n  - principal: a\n    sha: x\n").unwrap_err();
        assert!(e.contains("unknown field `sha`"), "{e}");
    }
}
