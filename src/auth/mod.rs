//! Authentication and authorization of AgentService callers.
//!
//! - [`Authenticator`] turns a request's credentials (bearer token or
//!   client certificate) into a [`Principal`] (modes none, tokens, mtls, jwt).
//! - [`layer::AuthLayer`] runs it for every call but health checks and puts
//!   the principal in the request's extensions.
//! - [`access`] decides what a principal may do with a session; the engine
//!   acts on a session only with the pass value it returns.
//! - [`quota`] counts sessions and runs per principal.

pub mod access;
pub mod jwt;
pub mod layer;
pub mod principal;
pub mod quota;
pub mod tokens;

use std::collections::BTreeSet;
use std::net::SocketAddr;

use rustls_pki_types::CertificateDer;

use crate::config::{AuthMode, Config};
use crate::tls::{ReloadError, Reloading};

pub use principal::{Principal, ANONYMOUS};

/// Why a caller was not authenticated. Messages say what to send, never
/// what was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing credentials: send `authorization: Bearer <token>`")]
    MissingToken,
    #[error("invalid credentials: {0}")]
    Invalid(String),
    #[error("missing client certificate: this server identifies callers by their TLS client certificate")]
    MissingCertificate,
}

#[derive(Debug, thiserror::Error)]
pub enum AuthSetupError {
    #[error(
        "auth.mode: none (no authentication) is only allowed when listening on a loopback address, \
         and this server listens on {addr}; set auth.mode to tokens, mtls or jwt, or listen on 127.0.0.1"
    )]
    OpenOnNetwork { addr: SocketAddr },
    #[error(transparent)]
    Files(#[from] ReloadError),
}

enum Method {
    None,
    Tokens(Reloading<tokens::TokenTable>),
    Mtls,
    Jwt(Box<jwt::JwtVerifier>),
}

pub struct Authenticator {
    method: Method,
    config: crate::config::AuthConfig,
    forward: BTreeSet<String>,
}

/// Refuses authentication `none` unless `listening` is loopback, so a
/// mis-configured pod cannot come up open.
pub fn refuse_open(
    auth: &crate::config::AuthConfig,
    listening: SocketAddr,
) -> Result<(), AuthSetupError> {
    if auth.mode == AuthMode::None && !listening.ip().is_loopback() {
        return Err(AuthSetupError::OpenOnNetwork { addr: listening });
    }
    Ok(())
}

impl Authenticator {
    /// Reads the mode's files; refuses `none` unless `listening` is loopback,
    /// so a mis-configured pod cannot come up open.
    pub fn new(config: &Config, listening: SocketAddr) -> Result<Authenticator, AuthSetupError> {
        let a = &config.auth;
        let interval = config.server.reload_interval;
        refuse_open(a, listening)?;
        let method = match a.mode {
            AuthMode::None => Method::None,
            AuthMode::Tokens => {
                let file = a.tokens_file.clone().ok_or_else(|| {
                    ReloadError("auth.tokens_file: required for auth.mode: tokens".into())
                })?;
                Method::Tokens(Reloading::new(
                    "auth_tokens",
                    "auth.tokens_file",
                    vec![file],
                    interval,
                    |b| tokens::TokenTable::parse(&b[0]),
                )?)
            }
            AuthMode::Mtls => Method::Mtls,
            AuthMode::Jwt => Method::Jwt(Box::new(jwt::JwtVerifier::new(a, interval)?)),
        };
        Ok(Authenticator {
            method,
            config: a.clone(),
            forward: a.forwarded_claims().into_iter().collect(),
        })
    }

    pub fn mode(&self) -> AuthMode {
        self.config.mode
    }

    /// The caller behind `bearer` (the token after `Bearer `) or the
    /// verified client certificate chain `peer`.
    pub fn authenticate(
        &self,
        bearer: Option<&str>,
        peer: Option<&[CertificateDer<'static>]>,
    ) -> Result<Principal, AuthError> {
        let mut p = match &self.method {
            Method::None => Principal::anonymous(),
            Method::Tokens(table) => {
                let token = bearer.ok_or(AuthError::MissingToken)?;
                table
                    .current()
                    .lookup(token)
                    .cloned()
                    .ok_or_else(|| AuthError::Invalid("unknown bearer token".into()))?
            }
            Method::Jwt(v) => {
                let token = bearer.ok_or(AuthError::MissingToken)?;
                v.verify(token).map_err(AuthError::Invalid)?
            }
            Method::Mtls => {
                let certs = peer
                    .filter(|c| !c.is_empty())
                    .ok_or(AuthError::MissingCertificate)?;
                let (name, names) = crate::tls::peer_identity(certs).ok_or_else(|| {
                    AuthError::Invalid(
                        "the client certificate has no URI or DNS subject alternative name".into(),
                    )
                })?;
                let mut p = Principal::new(name, std::iter::empty::<String>());
                p.claims.insert("san".into(), names.join(" "));
                p
            }
        };
        if let Some(extra) = self.config.principal_roles.get(&p.name) {
            p.roles.extend(extra.iter().cloned());
        }
        // Only the selected claims travel on; `roles` is the final role set.
        let roles = p.roles.iter().cloned().collect::<Vec<_>>().join(" ");
        p.claims.insert("roles".into(), roles);
        p.claims.retain(|k, _| self.forward.contains(k));
        Ok(p)
    }
}
