//! `store:`: where sessions live. Either a URL string or a map with the URL
//! and its options:
//!
//! ```yaml
//! store: memory                                  # nothing survives the process
//! store: sqlite:///var/lib/hookwire/hookwire.db  # one replica (the default, in --data-dir)
//! store:
//!   url: postgres://hookwire@db:5432/hookwire    # several replicas
//!   password_env: HOOKWIRE_DB_PASSWORD           # else PGPASSWORD
//!   max_connections: 10
//! ```
//!
//! A password never goes in the file: a Postgres URL that carries one is
//! refused; it comes from the environment.

use std::fmt;
use std::path::PathBuf;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;

pub const DEFAULT_PG_MAX_CONNECTIONS: u32 = 10;

/// The store, resolved from its URL.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreSetting {
    Memory,
    Sqlite {
        path: PathBuf,
    },
    Postgres {
        /// Without a password.
        url: String,
        /// The variable holding the password (else `PGPASSWORD`).
        password_env: Option<String>,
        max_connections: u32,
    },
}

// Debug and Display never show a password (an environment URL may hold one).
impl fmt::Debug for StoreSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for StoreSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreSetting::Memory => f.write_str("memory"),
            StoreSetting::Sqlite { path } => write!(f, "sqlite://{}", path.display()),
            StoreSetting::Postgres { url, .. } => f.write_str(&redact(url)),
        }
    }
}

impl StoreSetting {
    /// Parses a store URL. `password_allowed`: only a URL taken from the
    /// environment may carry a password.
    pub fn parse(url: &str, password_allowed: bool) -> Result<StoreSetting, String> {
        let url = url.trim();
        if url == "memory" {
            return Ok(StoreSetting::Memory);
        }
        if let Some(path) = url.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err("`sqlite://` needs a file path, e.g. sqlite:///var/lib/hookwire/hookwire.db (three slashes: absolute)".into());
            }
            return Ok(StoreSetting::Sqlite {
                path: PathBuf::from(path),
            });
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            if !password_allowed && url_has_password(url) {
                return Err("the URL carries a password; remove it and set PGPASSWORD, or name the variable that holds it in store.password_env (secrets never go in the file)".into());
            }
            return Ok(StoreSetting::Postgres {
                url: url.to_string(),
                password_env: None,
                max_connections: DEFAULT_PG_MAX_CONNECTIONS,
            });
        }
        Err(format!(
            "unknown store `{}`: use memory, sqlite:///path/to/hookwire.db or postgres://user@host:5432/db",
            redact(url)
        ))
    }
}

/// Whether `postgres://user:secret@host/...` has a password part.
fn url_has_password(url: &str) -> bool {
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    match authority.rsplit_once('@') {
        Some((userinfo, _)) => userinfo.contains(':'),
        None => false,
    }
}

/// The URL with any password replaced, for messages.
fn redact(url: &str) -> String {
    if url_has_password(url) {
        if let Some((scheme, rest)) = url.split_once("://") {
            if let Some((userinfo, host)) = rest.split_once('@') {
                let user = userinfo.split(':').next().unwrap_or("");
                return format!("{scheme}://{user}:***@{host}");
            }
        }
    }
    url.to_string()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StoreMap {
    url: String,
    password_env: Option<String>,
    max_connections: Option<u32>,
}

impl<'de> Deserialize<'de> for StoreSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StoreSetting;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a store URL (memory, sqlite:///path, postgres://user@host/db) or a map with `url`, `password_env`, `max_connections`")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StoreSetting, E> {
                StoreSetting::parse(v, false).map_err(E::custom)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<StoreSetting, A::Error> {
                let m = StoreMap::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let mut s = StoreSetting::parse(&m.url, false).map_err(de::Error::custom)?;
                match &mut s {
                    StoreSetting::Postgres {
                        password_env,
                        max_connections,
                        ..
                    } => {
                        if let Some(var) = m.password_env {
                            if var.is_empty() || var.contains(char::is_whitespace) {
                                return Err(de::Error::custom(
                                    "password_env must name an environment variable (the password itself never goes in the file)",
                                ));
                            }
                            *password_env = Some(var);
                        }
                        if let Some(n) = m.max_connections {
                            if n == 0 {
                                return Err(de::Error::custom(
                                    "max_connections must be at least 1",
                                ));
                            }
                            *max_connections = n;
                        }
                    }
                    _ => {
                        if m.password_env.is_some() || m.max_connections.is_some() {
                            return Err(de::Error::custom(
                                "password_env and max_connections only apply to postgres:// stores",
                            ));
                        }
                    }
                }
                Ok(s)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            StoreSetting::parse("memory", false),
            Ok(StoreSetting::Memory)
        );
        assert_eq!(
            StoreSetting::parse("sqlite:///var/lib/h.db", false),
            Ok(StoreSetting::Sqlite {
                path: "/var/lib/h.db".into()
            })
        );
        assert!(matches!(
            StoreSetting::parse("postgres://u@db:5432/h", false),
            Ok(StoreSetting::Postgres { .. })
        ));
        let e = StoreSetting::parse("postgres://u:hunter2@db/h", false).unwrap_err();
        assert!(e.contains("PGPASSWORD") && !e.contains("hunter2"), "{e}");
        assert!(StoreSetting::parse("postgres://u:hunter2@db/h", true).is_ok());
        let e = StoreSetting::parse("mysql://u:hunter2@db/h", false).unwrap_err();
        assert!(e.contains("unknown store") && !e.contains("hunter2"), "{e}");
    }

    #[test]
    fn debug_never_shows_a_password() {
        let s = StoreSetting::parse("postgres://u:hunter2@db/h", true).unwrap();
        assert_eq!(format!("{s}"), "postgres://u:***@db/h");
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
