//! TLS on hookwire's gRPC port: our own acceptor over the TcpListener (so
//! the server configuration can be replaced when its files change, which
//! tonic's `ServerTlsConfig` cannot), ALPN h2, optional or required client
//! certificates, and the caller's certificate identity for `auth.mode: mtls`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use rustls_pki_types::CertificateDer;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::describe::describe_tls_error;
use super::pem::{load_certs, load_key, load_roots};
use super::reload::{ReloadError, Reloading};
use crate::config::{ClientAuth, ServerTls};

/// A handshake that has not finished by then is dropped (a client that
/// connects and says nothing must not hold a task forever).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The server's TLS configuration, rebuilt when its files change.
#[derive(Clone)]
pub struct ServerTlsConfig {
    config: Arc<Reloading<Arc<ServerConfig>>>,
}

impl ServerTlsConfig {
    pub fn new(tls: &ServerTls, reload_interval: Duration) -> Result<ServerTlsConfig, ReloadError> {
        let mut files: Vec<PathBuf> = vec![tls.cert_file.clone(), tls.key_file.clone()];
        let client_ca = match tls.client_auth {
            ClientAuth::None => None,
            _ => tls.client_ca_file.clone(),
        };
        files.extend(client_ca.iter().cloned());
        let (cert_file, key_file, mode) =
            (tls.cert_file.clone(), tls.key_file.clone(), tls.client_auth);
        let build = move |bytes: &[Vec<u8>]| -> Result<Arc<ServerConfig>, String> {
            let certs = load_certs(&cert_file, &bytes[0]).map_err(|e| e.to_string())?;
            let key = load_key(&key_file, &bytes[1]).map_err(|e| e.to_string())?;
            let builder = ServerConfig::builder_with_provider(super::provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?;
            let builder = match &client_ca {
                None => builder.with_no_client_auth(),
                Some(f) => {
                    let roots = Arc::new(load_roots(f, &bytes[2]).map_err(|e| e.to_string())?);
                    let v = WebPkiClientVerifier::builder_with_provider(roots, super::provider());
                    let v = if mode == ClientAuth::Optional {
                        v.allow_unauthenticated()
                    } else {
                        v
                    };
                    builder.with_client_cert_verifier(
                        v.build()
                            .map_err(|e| format!("client CA {}: {e}", f.display()))?,
                    )
                }
            };
            let mut cfg = builder.with_single_cert(certs, key).map_err(|e| {
                format!(
                    "certificate {} and key {} do not go together: {e}",
                    cert_file.display(),
                    key_file.display()
                )
            })?;
            cfg.alpn_protocols = vec![b"h2".to_vec()];
            Ok(Arc::new(cfg))
        };
        Ok(ServerTlsConfig {
            config: Arc::new(Reloading::new(
                "server_tls",
                "tls",
                files,
                reload_interval,
                build,
            )?),
        })
    }
}

/// Accepted connections, TLS done. Each handshake runs in a task of its own
/// so a slow or silent client never holds up the next accept; failed
/// handshakes are logged (at debug: scanners make noise) and dropped.
pub fn tls_incoming(
    listener: TcpListener,
    tls: ServerTlsConfig,
) -> impl Stream<Item = Result<TlsStream<TcpStream>, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                a = crate::accept::next(&listener) => a,
                // The server is gone: stop accepting (and free the port).
                () = tx.closed() => return,
            };
            let acceptor = TlsAcceptor::from(tls.config.current().as_ref().clone());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(s)).await;
                    }
                    Ok(Err(e)) => {
                        let why = e
                            .get_ref()
                            .and_then(|i| i.downcast_ref::<rustls::Error>())
                            .map(describe_tls_error)
                            .unwrap_or_else(|| e.to_string());
                        tracing::debug!(%peer, error = %why, "TLS handshake failed");
                    }
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// The names a verified client certificate asserts, in the order they name
/// a principal: URI SANs (SPIFFE IDs) first, then DNS SANs.
pub fn peer_identity(certs: &[CertificateDer<'static>]) -> Option<(String, Vec<String>)> {
    let leaf = certs.first()?;
    let cert = webpki::EndEntityCert::try_from(leaf).ok()?;
    let uris: Vec<String> = cert.valid_uri_names().map(str::to_string).collect();
    let dns: Vec<String> = cert.valid_dns_names().map(str::to_string).collect();
    let all: Vec<String> = uris.iter().chain(dns.iter()).cloned().collect();
    let principal = all.first()?.clone();
    Some((principal, all))
}
