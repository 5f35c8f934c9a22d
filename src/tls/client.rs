//! TLS to one hook server: a rustls client configuration rebuilt when its
//! files change (CA bundle, client certificate and key), and a connector
//! for tonic's `Endpoint::connect_with_connector_lazy` that takes the
//! current configuration for every new connection.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::describe::describe_tls_error;
use super::pem::{load_certs, load_key, load_roots};
use super::reload::{ReloadError, Reloading};
use crate::config;

/// A TLS handshake with a hook server failed; the message says what did
/// not match. Classified as failure class `tls`.
#[derive(Debug, thiserror::Error)]
#[error("TLS handshake with {server}: {message}")]
pub struct HookTlsError {
    pub server: String,
    pub message: String,
    #[source]
    pub source: Option<rustls::Error>,
}

/// TLS settings of one hook, ready to connect with.
#[derive(Clone)]
pub struct HookTls {
    config: Arc<Reloading<Arc<ClientConfig>>>,
    server_name: Option<String>,
}

impl HookTls {
    /// Reads the files named in `tls` (start-up errors name `owner`, e.g.
    /// `hooks[0] (py-guard)`).
    pub fn new(
        owner: &str,
        tls: &config::HookTls,
        reload_interval: Duration,
    ) -> Result<HookTls, ReloadError> {
        let mut files: Vec<PathBuf> = Vec::new();
        let ca = tls.ca_file.clone();
        let pair = tls.cert_file.clone().zip(tls.key_file.clone());
        files.extend(ca.iter().cloned());
        if let Some((c, k)) = &pair {
            files.push(c.clone());
            files.push(k.clone());
        }
        let build = move |bytes: &[Vec<u8>]| -> Result<Arc<ClientConfig>, String> {
            let mut i = 0;
            let roots = match &ca {
                Some(f) => {
                    i += 1;
                    load_roots(f, &bytes[0]).map_err(|e| e.to_string())?
                }
                None => rustls::RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                },
            };
            let builder = ClientConfig::builder_with_provider(super::provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots);
            let mut cfg = match &pair {
                Some((cf, kf)) => {
                    let certs = load_certs(cf, &bytes[i]).map_err(|e| e.to_string())?;
                    let key = load_key(kf, &bytes[i + 1]).map_err(|e| e.to_string())?;
                    builder.with_client_auth_cert(certs, key).map_err(|e| {
                        format!(
                            "client certificate {} and key {} do not go together: {e}",
                            cf.display(),
                            kf.display()
                        )
                    })?
                }
                None => builder.with_no_client_auth(),
            };
            cfg.alpn_protocols = vec![b"h2".to_vec()];
            Ok(Arc::new(cfg))
        };
        let owner = format!("{owner} tls");
        Ok(HookTls {
            config: Arc::new(Reloading::new(
                "hook_tls",
                owner,
                files,
                reload_interval,
                build,
            )?),
            server_name: tls.server_name.clone(),
        })
    }

    /// The name the certificate is checked against (and sent as SNI).
    pub fn server_name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }

    pub fn connector(&self) -> HookConnector {
        HookConnector { tls: self.clone() }
    }
}

/// `tower::Service<Uri>` making TCP + TLS connections for a hook channel.
#[derive(Clone)]
pub struct HookConnector {
    tls: HookTls,
}

type Io = TokioIo<TlsStream<TcpStream>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl tower::Service<Uri> for HookConnector {
    type Response = Io;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Io, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let tls = self.tls.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| format!("endpoint `{uri}` has no host"))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let name_str = tls.server_name.clone().unwrap_or_else(|| host.clone());
            let name = ServerName::try_from(name_str.clone())
                .map_err(|e| format!("`{name_str}` is not a valid TLS server name: {e}"))?;
            let connector = TlsConnector::from(tls.config.current().as_ref().clone());
            match connector.connect(name, tcp).await {
                Ok(s) => Ok(TokioIo::new(s)),
                Err(io) => {
                    let rustls_err = io
                        .get_ref()
                        .and_then(|e| e.downcast_ref::<rustls::Error>())
                        .cloned();
                    let message = match &rustls_err {
                        Some(e) => describe_tls_error(e),
                        None => io.to_string(),
                    };
                    Err(Box::new(HookTlsError {
                        server: format!("{name_str}:{port}"),
                        message,
                        source: rustls_err,
                    }) as BoxError)
                }
            }
        })
    }
}
