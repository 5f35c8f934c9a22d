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

impl StoreSetting {
    /// Whether other replicas may share this store (and so serve this
    /// replica's sessions, approvals and cancels).
    pub fn is_shared(&self) -> bool {
        matches!(self, StoreSetting::Postgres { .. })
    }
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
            // Read as sqlx reads it when it connects, so what is checked
            // and hidden here is what it would use.
            let parsed = url::Url::parse(url).map_err(|e| {
                format!(
                    "the postgres URL cannot be read ({e}); characters such as / ? # @ in a user name or password must be percent-encoded (better: set the password in PGPASSWORD)"
                )
            })?;
            if !password_allowed && has_password(&parsed) {
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

/// Whether the URL carries a password, where libpq and sqlx take one: in
/// its user info (`user:secret@host`) or as the `password` parameter.
fn has_password(url: &url::Url) -> bool {
    url.password().is_some() || url.query_pairs().any(|(k, _)| k == "password")
}

/// The URL with any password replaced, for messages and logs. One that
/// cannot be read shows its scheme only if it has an `@` (where a password
/// would start in it cannot be told), and as it is otherwise (a typo such
/// as `memroy` has none to hide).
pub(crate) fn redact(url: &str) -> String {
    let Ok(mut u) = url::Url::parse(url) else {
        if !url.contains('@') {
            return url.to_string();
        }
        let scheme = url.split_once("://").map_or("", |(s, _)| s);
        return format!("{scheme}://(the rest is not shown: it is not a valid URL)");
    };
    if u.password().is_some() {
        // Only fails for URLs that cannot have a host, which have no password.
        let _ = u.set_password(Some("***"));
    }
    if u.query_pairs().any(|(k, _)| k == "password") {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if k == "password" {
                    "***".into()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string()
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
                            if let Some(why) = super::secret_env::refused(&var, "password") {
                                return Err(de::Error::custom(format!("password_env {why}")));
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

    /// Wherever a URL puts its password, sqlx would connect with it, so the
    /// file refuses it and messages never show it.
    #[test]
    fn a_password_is_found_and_hidden_wherever_the_url_puts_it() {
        for (url, shown) in [
            ("postgres://u:hunter2@db/h", "postgres://u:***@db/h"),
            (
                "postgres://u@db/h?sslmode=require&password=hunter2",
                "postgres://u@db/h?sslmode=require&password=***",
            ),
            // The last @ ends the user info, as sqlx reads it.
            ("postgres://u:hun@ter2@db/h", "postgres://u:***@db/h"),
            (
                "postgresql://u:hunter2@db:5432/h?password=hunter2",
                "postgresql://u:***@db:5432/h?password=***",
            ),
        ] {
            let e = StoreSetting::parse(url, false).unwrap_err();
            assert!(
                e.contains("PGPASSWORD") && !e.contains("ter2"),
                "{url}: {e}"
            );
            let s = StoreSetting::parse(url, true).unwrap();
            assert_eq!(s.to_string(), shown, "{url}");
            assert_eq!(format!("{s:?}"), shown, "{url}");
        }
        // A URL that cannot be read (an unencoded / in the password) is
        // refused without being quoted; one in an error shows its scheme.
        let e = StoreSetting::parse("postgres://u:hun/ter2@db/h", true).unwrap_err();
        assert!(e.contains("percent-encoded") && !e.contains("ter2"), "{e}");
        let e = StoreSetting::parse("mysql://u:hun/ter2@db/h", true).unwrap_err();
        assert!(e.contains("mysql://") && !e.contains("ter2"), "{e}");
        let e = StoreSetting::parse("memroy", false).unwrap_err();
        assert!(e.contains("`memroy`"), "a typo is shown: {e}");
        // Nothing to hide: shown as given.
        let s = StoreSetting::parse("postgres://u@db:5432/h?sslmode=require", false).unwrap();
        assert_eq!(s.to_string(), "postgres://u@db:5432/h?sslmode=require");
    }

    #[test]
    fn debug_never_shows_a_password() {
        let s = StoreSetting::parse("postgres://u:hunter2@db/h", true).unwrap();
        assert_eq!(format!("{s}"), "postgres://u:***@db/h");
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
