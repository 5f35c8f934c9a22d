//! Reads a hook server's concurrent-stream limit off the wire: the first
//! frame a server sends on an HTTP/2 connection is its SETTINGS (RFC 9113
//! §3.4), which carries SETTINGS_MAX_CONCURRENT_STREAMS when it has a limit.
//! hyper and h2 act on it but do not expose it to their caller, so the
//! connector wraps each connection and looks at those first bytes (then gets
//! out of the way: later reads go straight through).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use hyper::rt::{Read, ReadBuf, ReadBufCursor};
use hyper::Uri;

/// What a connection's first frame said about concurrent streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advertised {
    /// SETTINGS_MAX_CONCURRENT_STREAMS.
    Limit(usize),
    /// A SETTINGS frame without it: no limit.
    NoLimit,
    /// Not a SETTINGS frame (a peer that does not speak HTTP/2 first, or
    /// bytes from below a TLS layer), or the connection ended first. The
    /// hook connector reads above its TLS, so https hooks are read too.
    Unreadable,
}

/// Called once per connection.
pub type Report = Arc<dyn Fn(Advertised) + Send + Sync>;

const FRAME_HEADER: usize = 9;
const SETTINGS: u8 = 0x4;
const ACK: u8 = 0x1;
const MAX_CONCURRENT_STREAMS: u16 = 0x3;
/// The largest SETTINGS payload accepted (the default max frame size).
const MAX_PAYLOAD: usize = 16_384;

/// Wraps connector `C`; every connection it makes reports the server's
/// limit to `report`.
#[derive(Clone)]
pub struct SettingsWatch<C> {
    inner: C,
    report: Report,
}

impl<C> SettingsWatch<C> {
    pub fn new(inner: C, report: Report) -> Self {
        SettingsWatch { inner, report }
    }
}

impl<C> tower::Service<Uri> for SettingsWatch<C>
where
    C: tower::Service<Uri>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = Watched<C::Response>;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let report = self.report.clone();
        Box::pin(async move {
            Ok(Watched {
                io: connecting.await?,
                preface: Some(Preface::new(report)),
            })
        })
    }
}

/// The server's first frame, as far as it has arrived.
struct Preface {
    header: [u8; FRAME_HEADER],
    header_len: usize,
    /// Payload length, once the header is complete and valid.
    payload_len: Option<usize>,
    payload: Vec<u8>,
    report: Option<Report>,
}

enum Fed {
    More,
    Done,
}

impl Preface {
    fn new(report: Report) -> Self {
        Preface {
            header: [0; FRAME_HEADER],
            header_len: 0,
            payload_len: None,
            payload: Vec::new(),
            report: Some(report),
        }
    }

    /// Bytes still needed to complete the frame.
    fn wanted(&self) -> usize {
        match self.payload_len {
            None => FRAME_HEADER - self.header_len,
            Some(n) => n - self.payload.len(),
        }
    }

    fn finish(&mut self, limit: Advertised) -> Fed {
        if let Some(report) = self.report.take() {
            report(limit);
        }
        Fed::Done
    }

    fn feed(&mut self, mut bytes: &[u8]) -> Fed {
        if self.payload_len.is_none() {
            let take = bytes.len().min(FRAME_HEADER - self.header_len);
            self.header[self.header_len..self.header_len + take].copy_from_slice(&bytes[..take]);
            self.header_len += take;
            bytes = &bytes[take..];
            if self.header_len < FRAME_HEADER {
                return Fed::More;
            }
            let h = &self.header;
            let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let settings = h[3] == SETTINGS && h[4] & ACK == 0 && stream == 0;
            if !settings || len % 6 != 0 || len > MAX_PAYLOAD {
                return self.finish(Advertised::Unreadable);
            }
            self.payload_len = Some(len);
        }
        let want = self.wanted();
        self.payload
            .extend_from_slice(&bytes[..bytes.len().min(want)]);
        if self.wanted() > 0 {
            return Fed::More;
        }
        let limit = self
            .payload
            .chunks_exact(6)
            // The last value of a setting is the one that counts.
            .rfind(|s| u16::from_be_bytes([s[0], s[1]]) == MAX_CONCURRENT_STREAMS)
            .map(|s| u32::from_be_bytes([s[2], s[3], s[4], s[5]]))
            .map(|n| Advertised::Limit(usize::try_from(n).unwrap_or(usize::MAX)))
            .unwrap_or(Advertised::NoLimit);
        self.finish(limit)
    }
}

impl Drop for Preface {
    fn drop(&mut self) {
        // The connection ended before its SETTINGS: nothing to wait for.
        self.finish(Advertised::Unreadable);
    }
}

/// One connection; reads go through [`Preface`] until the first frame is in.
pub struct Watched<T> {
    io: T,
    preface: Option<Preface>,
}

impl<T> Watched<T> {
    /// The connection it watches.
    pub fn get_ref(&self) -> &T {
        &self.io
    }
}

impl<T: Read + Unpin> Read for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let Some(preface) = &mut this.preface else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        let room = buf.remaining();
        if room == 0 {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        }
        // Read no further than the frame, into a buffer we can look at.
        let mut scratch = [0u8; 64];
        let n = preface.wanted().min(room).min(scratch.len());
        let mut read = ReadBuf::new(&mut scratch[..n]);
        ready!(Pin::new(&mut this.io).poll_read(cx, read.unfilled()))?;
        let got = read.filled();
        buf.put_slice(got);
        let done = got.is_empty() || matches!(preface.feed(got), Fed::Done);
        if done {
            // Dropping it reports "unreadable" if it had not reported yet.
            this.preface = None;
        }
        Poll::Ready(Ok(()))
    }
}

crate::hooks::connector::delegate_write!(Watched);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::LockExt;
    use std::sync::Mutex;

    fn preface() -> (Preface, Arc<Mutex<Vec<Advertised>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        (Preface::new(Arc::new(move |l| s.locked().push(l))), seen)
    }

    fn settings(entries: &[(u16, u32)]) -> Vec<u8> {
        let len = entries.len() * 6;
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            SETTINGS,
            0,
            0,
            0,
            0,
            0,
        ];
        for (id, v) in entries {
            f.extend_from_slice(&id.to_be_bytes());
            f.extend_from_slice(&v.to_be_bytes());
        }
        f
    }

    #[test]
    fn reads_the_limit_one_byte_at_a_time() {
        let (mut p, seen) = preface();
        // SETTINGS_INITIAL_WINDOW_SIZE, then the limit.
        let frame = settings(&[(0x4, 65_535), (MAX_CONCURRENT_STREAMS, 100)]);
        for (i, b) in frame.iter().enumerate() {
            assert!(p.wanted() > 0);
            let fed = p.feed(std::slice::from_ref(b));
            assert_eq!(matches!(fed, Fed::Done), i == frame.len() - 1);
        }
        drop(p);
        assert_eq!(
            *seen.locked(),
            vec![Advertised::Limit(100)],
            "reported once"
        );
    }

    #[test]
    fn no_limit_not_settings_and_nothing_are_told_apart() {
        let (mut p, seen) = preface();
        assert!(matches!(p.feed(&settings(&[(0x4, 65_535)])), Fed::Done));
        let (mut q, seen_q) = preface();
        // A TLS ServerHello record, as seen below a TLS layer.
        assert!(matches!(
            q.feed(&[0x16, 0x03, 0x03, 0x00, 0x7a, 0x02, 0, 0, 0x76]),
            Fed::Done
        ));
        let (r, seen_r) = preface();
        drop((p, q, r));
        assert_eq!(*seen.locked(), vec![Advertised::NoLimit]);
        assert_eq!(*seen_q.locked(), vec![Advertised::Unreadable]);
        assert_eq!(
            *seen_r.locked(),
            vec![Advertised::Unreadable],
            "closed before any frame"
        );
    }
}
