//! TLS for hookwire's own port and for hook servers: PEM loading, whole
//! rustls configurations rebuilt when their files change, a connector for
//! hook channels and an acceptor for the gRPC listener, and messages that
//! say what did not match when a handshake fails. Only this module, the
//! server and the hook client know rustls.

mod client;
mod describe;
mod pem;
mod reload;
mod server;

pub use client::{EndedBy, HookTls, HookTlsError, TlsFailure, TlsIo};
pub use describe::describe_tls_error;
pub use pem::{load_certs, load_key, load_roots, PemError};
pub use reload::{reload_failures, ReloadError, Reloading};
pub use server::{peer_identity, tls_incoming, ServerTlsConfig};

/// rustls' process-wide crypto provider: ring, like the rest of the crate.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
