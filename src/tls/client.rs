//! TLS to one hook server: a rustls client configuration rebuilt when its
//! files change (CA bundle, client certificate and key), and a connector
//! for the hook channel (`hooks::channel`) that takes the current
//! configuration for every new connection.

use crate::lock::LockExt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::sign::CertifiedKey;
use rustls::ClientConfig;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
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
    /// A TLS error the server sent after our side of the handshake was
    /// done. In TLS 1.3 a server checks our client certificate only after
    /// the client considers the handshake complete, so "certificate
    /// required" or "unknown CA" arrives as an alert on the first read; the
    /// HTTP/2 layer then only reports a closed connection. Kept here (for
    /// the latest connection attempt: each attempt clears it) so the hook
    /// client can say what happened.
    late_error: Arc<Mutex<Option<String>>>,
    /// Whether the server asked for a client certificate in the latest
    /// handshake, and whether we have one to give.
    asked: Arc<AtomicBool>,
    has_cert: bool,
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
        let asked = Arc::new(AtomicBool::new(false));
        let asked_in_build = asked.clone();
        let has_cert = pair.is_some();
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
            let key = match &pair {
                Some((cf, kf)) => {
                    let certs = load_certs(cf, &bytes[i]).map_err(|e| e.to_string())?;
                    let key = load_key(kf, &bytes[i + 1]).map_err(|e| e.to_string())?;
                    Some(Arc::new(
                        CertifiedKey::from_der(certs, key, &super::provider()).map_err(|e| {
                            format!(
                                "client certificate {} and key {} do not go together: {e}",
                                cf.display(),
                                kf.display()
                            )
                        })?,
                    ))
                }
                None => None,
            };
            let mut cfg = builder.with_client_cert_resolver(Arc::new(NoticingResolver {
                key,
                asked: asked_in_build.clone(),
            }));
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
            late_error: Arc::new(Mutex::new(None)),
            asked,
            has_cert,
        })
    }

    /// Why the server dropped the latest connection right after the
    /// handshake, if it did; cleared once a connection is answered.
    pub fn late_error(&self) -> Option<String> {
        self.late_error.locked().clone()
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

/// The TLS stream, noting why the server dropped it when that happens
/// right after the handshake.
pub struct TlsIo {
    inner: TlsStream<TcpStream>,
    received_any: bool,
    has_cert: bool,
    asked: Arc<AtomicBool>,
    late_error: Arc<Mutex<Option<String>>>,
}

impl TlsIo {
    fn note(&self, why: String) {
        *self.late_error.locked() = Some(why);
    }

    /// The connection ended (EOF, reset, broken pipe) before the server said
    /// anything. If it had asked for our certificate, that is its verdict on
    /// it: it did not take the one we sent, or we sent none. Some servers
    /// (grpcio/BoringSSL) close without a TLS alert, so this is all we learn.
    fn closed_early(&self) {
        if self.received_any || !self.asked.load(Ordering::SeqCst) {
            return;
        }
        let why = if self.has_cert {
            "the server asked for our client certificate and closed the connection: it does not accept ours (check that it chains to the CA the server trusts and is valid now)"
        } else {
            "the server requires a client certificate and none is configured (set tls.cert_file and tls.key_file)"
        };
        self.note(why.into());
    }

    fn check_write<T>(&self, r: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        if let Poll::Ready(Err(e)) = &r {
            match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                Some(t) => self.note(describe_tls_error(t)),
                None => self.closed_early(),
            }
        }
        r
    }
}

impl AsyncRead for TlsIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let eof = match &r {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                if !self.received_any {
                    // The server accepted us: an older refusal is history.
                    self.received_any = true;
                    *self.late_error.locked() = None;
                }
                false
            }
            Poll::Ready(Ok(())) => true,
            Poll::Ready(Err(e)) => {
                if let Some(t) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    self.note(describe_tls_error(t));
                    false
                } else {
                    true
                }
            }
            Poll::Pending => false,
        };
        if eof {
            self.closed_early();
        }
        r
    }
}

impl AsyncWrite for TlsIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.check_write(r)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.check_write(r)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.check_write(r)
    }
}

/// Our client certificate (if any), noting that the server asked for one.
#[derive(Debug)]
struct NoticingResolver {
    key: Option<Arc<CertifiedKey>>,
    asked: Arc<AtomicBool>,
}

impl ResolvesClientCert for NoticingResolver {
    fn resolve(
        &self,
        _hints: &[&[u8]],
        sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.asked.store(true, Ordering::SeqCst);
        let k = self.key.as_ref()?;
        k.key.choose_scheme(sigschemes).is_some().then(|| k.clone())
    }

    fn has_certs(&self) -> bool {
        self.key.is_some()
    }
}

type Io = TokioIo<TlsIo>;
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
        // A refusal noted on an earlier connection says nothing about this
        // one: a later failure (the server gone, say) must not be reported
        // as that refusal.
        *tls.late_error.locked() = None;
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
            tls.asked.store(false, Ordering::SeqCst);
            match connector.connect(name, tcp).await {
                Ok(s) => Ok(TokioIo::new(TlsIo {
                    inner: s,
                    received_any: false,
                    has_cert: tls.has_cert,
                    asked: tls.asked.clone(),
                    late_error: tls.late_error.clone(),
                })),
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
