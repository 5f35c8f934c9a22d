//! Connections that send what their HTTP/2 connection wrote once per pass
//! of the scheduler, instead of once per frame.
//!
//! h2's connection task writes as soon as it is woken, and the first
//! stream that queues a frame wakes it: tokio runs a woken task next,
//! before the other streams ready at that moment have queued theirs. With
//! 64 hooked runs in flight the bench made 7.3 `writev` calls per run,
//! each the kernel's whole send path (on loopback, the receiver's too),
//! and system time was 38% of its CPU (BENCHMARKS.md, "One write per
//! frame").
//!
//! A [`Corked`] connection copies what is written into its buffer and, at
//! the flush, waits out the scheduler's pass: the connection task wakes
//! itself and returns, so tokio polls it again after the tasks already in
//! its run queue, whose frames join the same buffer (a task woken while
//! it is queued is not queued twice); then one `write` sends it all.
//! Netty's flush consolidation does the same for the same reason. On an
//! idle runtime the queue is empty, so a lone frame waits one more poll
//! of its connection task, not a timer. A connection polled twice in one
//! turn of its task (hyper's server does, when it accepts several streams
//! at once) sends at the second flush: a smaller batch, never a lost or
//! reordered write. (`tokio::task::yield_now`'s
//! deferred wake-up was tried: it also polls the IO driver before the
//! task runs again, which at 512 runs doubled the `recvfrom` and
//! `epoll_wait` calls and cost more than the writes it saved.) The buffer
//! is bounded ([`LIMIT`]): a pass that writes more sends as it goes, and
//! one large write goes straight through.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most a connection holds back; a pass that writes more sends as it
/// goes.
pub const LIMIT: usize = 64 * 1024;

/// The buffer's capacity kept between passes. A pass that needed more
/// frees it afterwards, so a burst does not pin 64 KiB on every idle
/// client connection.
const KEEP: usize = 16 * 1024;

/// An IO whose writes are sent once per scheduler pass (module docs).
pub struct Corked<IO> {
    io: IO,
    /// Bytes written and not yet sent; `buf[sent..]` is what is left.
    buf: Vec<u8>,
    sent: usize,
    state: State,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    /// Nothing held: the next flush with bytes to send starts a pass.
    Idle,
    /// A pass is being waited out: bytes written now go with the rest.
    Waiting,
    /// The pass is over: sending, until the buffer is empty.
    Sending,
}

impl<IO> Corked<IO> {
    pub fn new(io: IO) -> Self {
        Corked {
            io,
            buf: Vec::new(),
            sent: 0,
            state: State::Idle,
        }
    }

    /// The IO it writes to.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    fn held(&self) -> usize {
        self.buf.len() - self.sent
    }

    /// Ready once the pass that began at the first flush is over: the
    /// task's next poll, which comes after the tasks queued before it.
    fn poll_pass(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self.state {
            State::Idle => {
                self.state = State::Waiting;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            State::Waiting => {
                self.state = State::Sending;
                Poll::Ready(())
            }
            State::Sending => Poll::Ready(()),
        }
    }
}

impl<IO: AsyncWrite + Unpin> Corked<IO> {
    /// Sends everything held, however the pass stands.
    fn poll_send(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.buf.len() {
            let n = match Pin::new(&mut self.io).poll_write(cx, &self.buf[self.sent..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            self.sent += n;
        }
        self.sent = 0;
        self.buf.clear();
        if self.buf.capacity() > KEEP {
            self.buf = Vec::new();
        }
        Poll::Ready(Ok(()))
    }

    /// Makes room for `n` more bytes: Ready(true) to hold them, Ready(false)
    /// when they are too many to hold and go straight through.
    fn poll_room(&mut self, cx: &mut Context<'_>, n: usize) -> Poll<io::Result<bool>> {
        if self.held() + n > LIMIT {
            std::task::ready!(self.poll_send(cx))?;
        }
        Poll::Ready(Ok(n < LIMIT))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Corked<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Corked<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if !std::task::ready!(this.poll_room(cx, buf.len()))? {
            return Pin::new(&mut this.io).poll_write(cx, buf);
        }
        this.buf.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let n = bufs.iter().map(|b| b.len()).sum();
        if !std::task::ready!(this.poll_room(cx, n))? {
            return Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        }
        for b in bufs {
            this.buf.extend_from_slice(b);
        }
        Poll::Ready(Ok(n))
    }

    /// Vectored writes are copied like any other: h2 hands over a frame's
    /// header and its payload as two slices.
    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.held() > 0 || this.state == State::Sending {
            std::task::ready!(this.poll_pass(cx));
            std::task::ready!(this.poll_send(cx))?;
        }
        this.state = State::Idle;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        // Closing does not wait for the pass: what is held goes now.
        std::task::ready!(this.poll_send(cx))?;
        this.state = State::Idle;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Corked<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    /// One end of an in-memory pipe that counts the writes reaching it.
    struct Counting {
        io: DuplexStream,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncWrite for Counting {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let r = Pin::new(&mut self.io).poll_write(cx, buf);
            if matches!(r, Poll::Ready(Ok(_))) {
                self.writes.fetch_add(1, Ordering::SeqCst);
            }
            r
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_flush(cx)
        }

        fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_shutdown(cx)
        }
    }

    fn pipe(capacity: usize) -> (Corked<Counting>, DuplexStream, Arc<AtomicUsize>) {
        let (ours, theirs) = tokio::io::duplex(capacity);
        let writes = Arc::new(AtomicUsize::new(0));
        let io = Counting {
            io: ours,
            writes: writes.clone(),
        };
        (Corked::new(io), theirs, writes)
    }

    /// A connection task as h2 runs one: every frame ready is written,
    /// then the connection is flushed; it ends when its streams are gone.
    async fn connection(
        mut io: Corked<Counting>,
        mut frames: tokio::sync::mpsc::UnboundedReceiver<&'static [u8]>,
    ) {
        std::future::poll_fn(|cx| {
            let mut done = false;
            loop {
                match frames.poll_recv(cx) {
                    Poll::Ready(Some(frame)) => {
                        let n = std::task::ready!(Pin::new(&mut io).poll_write(cx, frame)).unwrap();
                        assert_eq!(n, frame.len());
                    }
                    Poll::Ready(None) => {
                        done = true;
                        break;
                    }
                    Poll::Pending => break,
                }
            }
            std::task::ready!(Pin::new(&mut io).poll_flush(cx)).unwrap();
            if done {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }

    #[tokio::test]
    async fn frames_queued_while_a_flush_waits_go_out_in_the_same_write() {
        let (io, mut theirs, writes) = pipe(1024);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let conn = tokio::spawn(connection(io, rx));
        tokio::task::yield_now().await;
        // The connection task is woken by the first frame and queued ahead
        // of the two streams that queue theirs after it.
        tx.send(&b"one "[..]).unwrap();
        for frame in [&b"two "[..], &b"three"[..]] {
            let tx = tx.clone();
            tokio::spawn(async move { tx.send(frame).unwrap() });
        }
        drop(tx);
        conn.await.unwrap();
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"one two three");
        assert_eq!(writes.load(Ordering::SeqCst), 1, "one write for the pass");
    }

    #[tokio::test]
    async fn a_lone_frame_is_sent_with_nothing_else_to_run() {
        let (mut io, mut theirs, writes) = pipe(1024);
        io.write_all(b"ping").await.unwrap();
        assert_eq!(writes.load(Ordering::SeqCst), 0, "held until the flush");
        io.flush().await.unwrap();
        let mut got = [0u8; 4];
        theirs.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        assert_eq!(writes.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_write_as_large_as_the_limit_goes_straight_through() {
        let (mut io, _theirs, writes) = pipe(2 * LIMIT);
        io.write_all(b"small").await.unwrap();
        let large = vec![7u8; LIMIT];
        let n = io.write(&large).await.unwrap();
        assert_eq!(n, LIMIT);
        // What was held went first, then the large write itself.
        assert_eq!(writes.load(Ordering::SeqCst), 2);
        assert_eq!(io.held(), 0);
    }

    #[tokio::test]
    async fn shutdown_sends_what_is_held() {
        let (mut io, mut theirs, _) = pipe(1024);
        io.write_all(b"last words").await.unwrap();
        io.shutdown().await.unwrap();
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last words");
    }

    #[tokio::test]
    async fn a_flush_into_a_full_pipe_sends_everything_in_order() {
        // The pipe takes 7 bytes at a time: the flush sends in pieces,
        // waiting for the reader in between.
        let (mut io, mut theirs, _) = pipe(7);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            theirs.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut sent = Vec::new();
        for i in 0..20u8 {
            let chunk = [i; 5];
            io.write_all(&chunk).await.unwrap();
            sent.extend_from_slice(&chunk);
        }
        io.flush().await.unwrap();
        io.shutdown().await.unwrap();
        assert_eq!(reader.await.unwrap(), sent);
    }
}
