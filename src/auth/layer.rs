//! The tower layer in front of every gRPC service: authenticates each call
//! and puts the caller's [`Principal`] in the request extensions, or answers
//! UNAUTHENTICATED without reaching the service.
//!
//! Exempt, by exact path, are only the health checks: Kubernetes probes and
//! load balancers cannot present credentials, and health reveals nothing
//! but SERVING/NOT_SERVING. Reflection is *not* exempt: it is only useful to
//! someone about to call the API (who needs credentials anyway), and an
//! unauthenticated caller learns nothing about what this server runs.

use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};

use futures::future::{Either, Ready};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use super::{AuthError, Authenticator};

const EXEMPT: [&str; 2] = [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthFailureLabels {
    /// `missing_token`, `invalid`, `missing_certificate`.
    pub reason: &'static str,
}

static FAILURES: LazyLock<Family<AuthFailureLabels, Counter>> = LazyLock::new(Family::default);

/// Refused calls by reason (registered by telemetry).
pub fn auth_failures() -> Family<AuthFailureLabels, Counter> {
    FAILURES.clone()
}

#[derive(Clone)]
pub struct AuthLayer {
    auth: Arc<Authenticator>,
}

impl AuthLayer {
    pub fn new(auth: Arc<Authenticator>) -> AuthLayer {
        AuthLayer { auth }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService {
            inner,
            auth: self.auth.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Arc<Authenticator>,
}

/// The token of an `authorization: Bearer <token>` header.
fn bearer<B>(req: &http::Request<B>) -> Option<&str> {
    let v = req
        .headers()
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

impl<S, B> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<S::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if EXEMPT.contains(&req.uri().path()) {
            return Either::Left(self.inner.call(req));
        }
        let peer = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|t| t.peer_certs());
        match self
            .auth
            .authenticate(bearer(&req), peer.as_ref().map(|c| c.as_slice()))
        {
            Ok(p) => {
                req.extensions_mut().insert(p);
                Either::Left(self.inner.call(req))
            }
            Err(e) => {
                let reason = match &e {
                    AuthError::MissingToken => "missing_token",
                    AuthError::Invalid(_) => "invalid",
                    AuthError::MissingCertificate => "missing_certificate",
                };
                FAILURES.get_or_create(&AuthFailureLabels { reason }).inc();
                // The reason, never the credential.
                tracing::debug!(path = req.uri().path(), reason = %e, "call refused: not authenticated");
                Either::Right(futures::future::ready(Ok(crate::server::unauthenticated(
                    &e,
                )
                .into_http())))
            }
        }
    }
}
