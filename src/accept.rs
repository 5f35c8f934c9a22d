//! Accepting connections for a tonic server of our own incoming stream
//! (hookwire's gRPC port, plain or TLS, and the Rust hook server).
//!
//! Two things tonic's serve loop leaves to the stream:
//! - an `accept` that fails (out of file descriptors, mostly) fails again
//!   at once, and tonic just asks for the next connection: the loop here
//!   backs off instead of spinning a core until a descriptor frees;
//! - hyper's HTTP/2 server waits for the client's connection preface with
//!   no deadline, so a client that connects and says nothing (after TLS,
//!   or on the plain port) held a descriptor and a task for good.
//!   [`Preface`] gives the first bytes a deadline, as grpc-go's
//!   `ConnectionTimeout` does.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

use crate::cork::Corked;

/// How long a new connection has to send the HTTP/2 preface (after the TLS
/// handshake, which has a deadline of its own).
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// The client's connection preface (`PRI * HTTP/2.0…`) is 24 bytes: a
/// connection that sent them is past the handshake's silent phase.
const PREFACE_LEN: usize = 24;

/// The pause after a failed `accept` before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The next connection `listener` accepts, with Nagle's algorithm off
/// (tonic ignores its builder's `tcp_nodelay` for an incoming stream of
/// one's own; without it small unary calls waited 40-90 ms). A failed
/// accept is logged and retried after a pause, never returned.
pub async fn next(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => {
                let _ = tcp.set_nodelay(true);
                return (tcp, peer);
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// The plain TCP connections `listener` accepts, as a tonic server takes
/// them: corked ([`crate::cork`]), and with a deadline for the preface.
pub fn plain(listener: TcpListener) -> impl Stream<Item = io::Result<Corked<Preface<TcpStream>>>> {
    futures::stream::unfold(listener, |listener| async move {
        let (tcp, _) = next(&listener).await;
        Some((Ok(Corked::new(Preface::new(tcp))), listener))
    })
}

/// An IO whose first [`PREFACE_LEN`] bytes must arrive within
/// [`PREFACE_TIMEOUT`]; a read still waiting for them then fails with
/// `TimedOut`, and hyper closes the connection.
pub struct Preface<IO> {
    io: IO,
    /// Armed until the preface's bytes arrived.
    deadline: Option<Pin<Box<Sleep>>>,
    received: usize,
}

impl<IO> Preface<IO> {
    pub fn new(io: IO) -> Self {
        Self::with_timeout(io, PREFACE_TIMEOUT)
    }

    pub fn with_timeout(io: IO, timeout: Duration) -> Self {
        Preface {
            io,
            deadline: Some(Box::pin(tokio::time::sleep(timeout))),
            received: 0,
        }
    }

    pub fn get_ref(&self) -> &IO {
        &self.io
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Preface<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        let Some(deadline) = this.deadline.as_mut() else {
            return polled;
        };
        match polled {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                this.received += n;
                // End of stream ends the wait too: hyper closes.
                if this.received >= PREFACE_LEN || n == 0 {
                    this.deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.deadline = None;
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no HTTP/2 connection preface in time",
                    )))
                }
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Preface<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Preface<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    #[test]
    fn the_preface_length_is_http2s() {
        assert_eq!(PREFACE.len(), PREFACE_LEN);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_times_out() {
        let (client, server) = tokio::io::duplex(64);
        let mut conn = Preface::with_timeout(server, Duration::from_secs(10));
        let mut buf = [0u8; 8];
        let e = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn part_of_a_preface_does_not_stop_the_clock() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut conn = Preface::with_timeout(server, Duration::from_secs(10));
        client.write_all(&PREFACE[..5]).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(conn.read(&mut buf).await.unwrap(), 5);
        let e = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn after_the_preface_a_connection_may_idle() {
        let (mut client, server) = tokio::io::duplex(64);
        let mut conn = Preface::with_timeout(server, Duration::from_secs(10));
        client.write_all(PREFACE).await.unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(conn.read(&mut buf).await.unwrap(), PREFACE_LEN);
        // Long past the deadline, the next read still just waits.
        let read = conn.read(&mut buf);
        tokio::pin!(read);
        let idle = tokio::time::timeout(Duration::from_secs(3600), &mut read).await;
        assert!(
            idle.is_err(),
            "an idle read after the preface must not fail"
        );
        client.write_all(b"x").await.unwrap();
        assert_eq!(read.await.unwrap(), 1);
    }
}
