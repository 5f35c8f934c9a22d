//! The TCP connector of a hook channel, which tells its client when a
//! connection ends. tonic reconnects lazily and silently: without this, a
//! hook server restarted with another `Describe` (new events, new tools)
//! would keep being called with the old subscriptions until some call
//! failed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::rt::{Read, ReadBufCursor, Write};
use hyper::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// `HttpConnector` (configured as tonic configures its own) whose
/// connections signal `closed` when they are dropped, i.e. when the HTTP/2
/// connection over them is over.
#[derive(Clone)]
pub struct Connector {
    http: HttpConnector,
    closed: Arc<Notify>,
}

impl Connector {
    pub fn new(http: HttpConnector, closed: Arc<Notify>) -> Self {
        Connector { http, closed }
    }
}

impl tower::Service<Uri> for Connector {
    type Response = Connection;
    type Error = <HttpConnector as tower::Service<Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Connection, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.http.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.http.call(uri);
        let closed = self.closed.clone();
        Box::pin(async move {
            Ok(Connection {
                io: connecting.await?,
                closed,
            })
        })
    }
}

/// One TCP connection to a hook server.
pub struct Connection {
    io: TokioIo<TcpStream>,
    closed: Arc<Notify>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.closed.notify_one();
    }
}

impl Read for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl Write for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
}
