//! The connector of a hook channel (plain TCP or TLS), which tells its client when a
//! connection ends. tonic reconnects lazily and silently: without this, a
//! hook server restarted with another `Describe` (new events, new tools)
//! would keep being called with the old subscriptions until some call
//! failed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use std::time::Duration;

use hyper::rt::{Read, ReadBufCursor};
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::sync::Notify;

use crate::cork::Corked;
use crate::hooks::peer_settings::Watched;
use crate::tls::{EndedBy, TlsIo};

/// A connection's IO that may learn, below HTTP/2, why the connection
/// ended ([`EndedBy`]: a TLS refusal after the handshake), for the calls
/// that were on it: the channel reads it when one fails
/// (`hooks::channel`).
pub trait Explains {
    /// The connection's slot, if its IO can fill one.
    fn ended_by(&self) -> Option<EndedBy>;
}

impl Explains for tokio::net::TcpStream {
    fn ended_by(&self) -> Option<EndedBy> {
        None
    }
}

impl Explains for TlsIo {
    fn ended_by(&self) -> Option<EndedBy> {
        Some(TlsIo::ended_by(self))
    }
}

impl<T: Explains> Explains for TokioIo<T> {
    fn ended_by(&self) -> Option<EndedBy> {
        self.inner().ended_by()
    }
}

impl<T: Explains> Explains for Corked<T> {
    fn ended_by(&self) -> Option<EndedBy> {
        self.get_ref().ended_by()
    }
}

impl<T: Explains> Explains for Watched<T> {
    fn ended_by(&self) -> Option<EndedBy> {
        self.get_ref().ended_by()
    }
}

impl<T: Explains> Explains for Connection<T> {
    fn ended_by(&self) -> Option<EndedBy> {
        self.io.ended_by()
    }
}

/// A connector (tonic's plain TCP one, or hookwire's TLS one) whose
/// connections signal `closed` when they are dropped, i.e. when the HTTP/2
/// connection over them is over.
#[derive(Clone)]
pub struct Connector<C> {
    inner: C,
    closed: Arc<Notify>,
}

impl<C> Connector<C> {
    pub fn new(inner: C, closed: Arc<Notify>) -> Self {
        Connector { inner, closed }
    }
}

/// The plain TCP connector, configured as tonic configures its own.
pub fn plain_tcp(connect_timeout: Duration) -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http
}

impl<C> tower::Service<Uri> for Connector<C>
where
    C: tower::Service<Uri>,
    C::Future: Send + 'static,
{
    type Response = Connection<TokioIo<Corked<TokioIo<C::Response>>>>;
    type Error = C::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let closed = self.closed.clone();
        Box::pin(async move {
            Ok(Connection {
                // The frames of a scheduler pass share one write (`cork`).
                io: TokioIo::new(Corked::new(TokioIo::new(connecting.await?))),
                closed,
            })
        })
    }
}

/// One connection to a hook server.
pub struct Connection<IO> {
    io: IO,
    closed: Arc<Notify>,
}

impl<IO> Drop for Connection<IO> {
    fn drop(&mut self) {
        self.closed.notify_one();
    }
}

impl<IO: Read + Unpin> Read for Connection<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

/// `hyper::rt::Write` for an IO wrapper whose field `io` does the writing
/// (the wrappers here only watch reads or drops).
macro_rules! delegate_write {
    ($wrapper:ident) => {
        impl<IO: hyper::rt::Write + Unpin> hyper::rt::Write for $wrapper<IO> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
            }

            fn is_write_vectored(&self) -> bool {
                self.io.is_write_vectored()
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
            }
        }
    };
}
pub(crate) use delegate_write;

delegate_write!(Connection);
