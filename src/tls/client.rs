//! TLS to one hook server: a rustls client configuration rebuilt when its
//! files change (CA bundle, client certificate and key), and a connector
//! for the hook channel (`hooks::channel`) that takes the current
//! configuration for every new connection.
//!
//! What a connection learns of its own handshake (whether the server asked
//! for our certificate, why it dropped us) stays with that connection:
//! connections to one hook open and fail at the same time, and one's
//! refusal must not be reported as another's failure. Each connection gets
//! a copy of the configuration whose certificate resolver notes the ask on
//! that connection alone (the copy shares the rest, the session cache
//! included), and its [`TlsIo`] keeps why TLS ended it in a slot of its
//! own ([`TlsIo::ended_by`]), which the hook channel gives to the calls
//! that were on it (`hooks::channel`): h2 tells them only that the
//! connection closed, or, for a call it had not sent yet, not even that.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
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

/// TLS on an established connection to a hook server failed: the server
/// refused us after our side of the handshake was done, or a TLS error
/// ended the connection. In TLS 1.3 a server checks our client
/// certificate only after the client considers the handshake complete, so
/// "certificate required" or "unknown CA" arrives as an alert on the first
/// read, or (grpcio/BoringSSL) as a bare close; the HTTP/2 layer would
/// only report a closed connection.
///
/// It reaches the calls two ways: the hook channel returns it as the error
/// of a call that failed on such a connection (with the error the call met
/// as its source), and a TLS error read off the connection is that read's
/// `io::Error` (kind [`TlsFailure::KIND`]), which h2 hands to every stream
/// of the connection keeping only its kind and text: [`TlsFailure::find`]
/// knows it by either.
#[derive(Debug, thiserror::Error)]
#[error("{prefix}{why}", prefix = TlsFailure::PREFIX)]
pub struct TlsFailure {
    /// What did not match, in words.
    pub why: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl TlsFailure {
    const PREFIX: &'static str = "TLS failed after the handshake: ";
    /// An IO error kind nothing else on a hook connection produces.
    pub const KIND: std::io::ErrorKind = std::io::ErrorKind::PermissionDenied;

    fn io(why: String) -> std::io::Error {
        std::io::Error::new(Self::KIND, TlsFailure { why, source: None })
    }

    /// What did not match, if `io` is (or, past h2, was) a [`TlsFailure`].
    pub fn find(io: &std::io::Error) -> Option<String> {
        if let Some(f) = io.get_ref().and_then(|e| e.downcast_ref::<TlsFailure>()) {
            return Some(f.why.clone());
        }
        if io.kind() != Self::KIND {
            return None;
        }
        io.to_string().strip_prefix(Self::PREFIX).map(str::to_owned)
    }
}

/// Why TLS ended one connection, once it did: set by its [`TlsIo`] before
/// the error (or the end of stream) reaches h2, so whoever sees a call on
/// it fail finds it set.
pub type EndedBy = Arc<OnceLock<String>>;

/// What the files say: the configuration every connection starts from, and
/// our client certificate (if any) for its resolver.
struct Built {
    config: ClientConfig,
    key: Option<Arc<CertifiedKey>>,
}

/// TLS settings of one hook, ready to connect with.
#[derive(Clone)]
pub struct HookTls {
    config: Arc<Reloading<Built>>,
    server_name: Option<String>,
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
        let has_cert = pair.is_some();
        let build = move |bytes: &[Vec<u8>]| -> Result<Built, String> {
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
            // Each connection puts in a resolver of its own (`for_connection`).
            let mut config = builder.with_client_cert_resolver(Arc::new(NoticingResolver {
                key: key.clone(),
                asked: Arc::default(),
            }));
            config.alpn_protocols = vec![b"h2".to_vec()];
            Ok(Built { config, key })
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
            has_cert,
        })
    }

    /// The current configuration for one new connection, with a resolver
    /// that sets `asked` when the server asks that connection for our
    /// certificate. A copy: its parts are shared (`Arc`s), the session
    /// cache included, so resumption works across connections.
    fn for_connection(&self, asked: Arc<AtomicBool>) -> Arc<ClientConfig> {
        let built = self.config.current();
        let mut config = built.config.clone();
        config.client_auth_cert_resolver = Arc::new(NoticingResolver {
            key: built.key.clone(),
            asked,
        });
        Arc::new(config)
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

/// The TLS stream of one connection, which notes why TLS ended it, if it
/// did ([`TlsIo::ended_by`]).
pub struct TlsIo {
    inner: TlsStream<TcpStream>,
    received_any: bool,
    has_cert: bool,
    /// Whether the server asked this connection for our certificate.
    asked: Arc<AtomicBool>,
    ended_by: EndedBy,
}

impl TlsIo {
    /// Why TLS ended this connection, once it did.
    pub fn ended_by(&self) -> EndedBy {
        self.ended_by.clone()
    }

    fn note(&self, why: String) {
        // The first cause is the one: what follows is its consequence.
        let _ = self.ended_by.set(why);
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

    /// An IO error of the connection, noted: a TLS error in words (also in
    /// the error h2 gets), or a close that was a refusal.
    fn failed(&self, e: std::io::Error) -> std::io::Error {
        match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
            Some(t) => {
                let why = describe_tls_error(t);
                self.note(why.clone());
                TlsFailure::io(why)
            }
            None => {
                self.closed_early();
                e
            }
        }
    }

    fn check_write<T>(&self, r: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        match r {
            Poll::Ready(Err(e)) => Poll::Ready(Err(self.failed(e))),
            r => r,
        }
    }
}

impl AsyncRead for TlsIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                // The server accepted us: a close from now on is no refusal.
                self.received_any = true;
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Ok(())) => {
                // End of stream.
                self.closed_early();
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(self.failed(e))),
            Poll::Pending => Poll::Pending,
        }
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
            let asked = Arc::new(AtomicBool::new(false));
            let connector = TlsConnector::from(tls.for_connection(asked.clone()));
            match connector.connect(name, tcp).await {
                Ok(s) => Ok(TokioIo::new(TlsIo {
                    inner: s,
                    received_any: false,
                    has_cert: tls.has_cert,
                    asked,
                    ended_by: EndedBy::default(),
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
