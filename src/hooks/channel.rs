//! One HTTP/2 connection to a hook server, as the service its gRPC clients
//! call: hyper's HTTP/2 client, connected lazily and again after the
//! connection ends.
//!
//! Why not tonic's `Channel`: it puts every call behind a `tower` buffer, a
//! queue to a worker task that owns the connection, and then through three
//! layers (origin, user agent, the `grpc-timeout` timer), so each call, and
//! each run's `Process` stream, costs a task hop and a few boxed futures
//! before hyper sees it (~14k instructions per hooked chat run, ~3k per
//! hook event, callgrind; BENCHMARKS.md, figure 10). The pool
//! ([`super::pool`]) already decides which connection each stream uses, so
//! the buffer's one job, sharing a connection between callers, is done here
//! by cloning hyper's `SendRequest` (an `Arc` and a queue sender) under a
//! short lock.
//!
//! What tonic's channel did and this keeps, so calls behave as before:
//! - connect on the first call (lazy), and again on the first call after
//!   the connection ended;
//! - a connect timeout around the connector (TCP, and TLS when it is one);
//! - connector failures wrapped in [`tonic::ConnectError`], which tonic
//!   answers as `UNAVAILABLE` with the cause as the status' source;
//! - HTTP/2 settings and keepalive from [`Settings`] on hyper's defaults
//!   (tonic's `Endpoint` leaves the window sizes to hyper too);
//! - the request's origin (`:scheme`, `:authority`) and a `user-agent`.
//!
//! What it does that tonic's channel did not: callers queued behind a dial
//! that fails share its error (instead of dialing again one after the
//! other), a connect timeout is a connect failure (not an untyped I/O
//! error), and a request hyper hands back unsent because its connection
//! was closing (GOAWAY from a restarting server) goes once more on a new
//! connection.
//!
//! What it leaves out: tonic's client-side `grpc-timeout` timer. Every
//! unary call here has its own deadline around it, and a run's stream is
//! bounded by its events' deadlines; the `grpc-timeout` header itself is
//! still sent to the server.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http2::{Builder, SendRequest};
use hyper_util::rt::TokioTimer;
use tonic::body::Body;

use super::connector::Explains;
use super::spawner::BoxedSpawner;
use crate::lock::LockExt;
use crate::tls::{EndedBy, TlsFailure};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
/// Makes one connection: connect, handshake, spawn its driver.
type Dial = Box<dyn Fn() -> BoxFuture<Result<Live, BoxError>> + Send + Sync>;

/// A live connection: its sender, and where its IO notes why TLS ended it
/// (`https://` hooks), for the errors of the calls that were on it: h2 and
/// hyper tell those only that the connection closed (or, for a request not
/// sent yet, not even that).
#[derive(Clone)]
struct Live {
    sender: SendRequest<Body>,
    ended_by: Option<EndedBy>,
}

impl Live {
    /// `e`, the error of a call on this connection, with the reason TLS
    /// ended the connection when it did.
    fn explain(&self, e: impl Into<BoxError>) -> BoxError {
        explained(self.ended_by.as_ref(), e.into())
    }
}

/// `e`, met on the connection whose IO notes in `ended_by`, with the
/// reason TLS ended that connection when it did.
fn explained(ended_by: Option<&EndedBy>, e: BoxError) -> BoxError {
    match ended_by.and_then(|w| w.get()) {
        Some(why) => Box::new(TlsFailure {
            why: why.clone(),
            source: Some(e),
        }),
        None => e,
    }
}

/// When the caller of a unary request stops waiting: the request's
/// `grpc-timeout` is set from it as the request goes out, after any wait
/// for its connection (a dial, a TLS handshake, a resend after GOAWAY), so
/// the server's deadline is the caller's and not longer by that wait.
#[derive(Clone, Copy, Debug)]
pub struct SendBy(pub tokio::time::Instant);

/// `grpc-timeout` from the request's [`SendBy`], if it has one: the time
/// left in milliseconds (at least 1; at most 8 digits, as gRPC allows),
/// rounded up: the server's deadline is never before the caller's, so its
/// timeout only ever comes after hookwire gave up.
fn stamp_timeout(req: &mut Request<Body>) {
    let Some(SendBy(at)) = req.extensions().get::<SendBy>().copied() else {
        return;
    };
    let left = at.saturating_duration_since(tokio::time::Instant::now());
    if let Ok(v) = HeaderValue::from_str(&grpc_timeout(left)) {
        req.headers_mut().insert("grpc-timeout", v);
    }
}

/// `left` as a `grpc-timeout` value: milliseconds, rounded up.
fn grpc_timeout(left: Duration) -> String {
    let ms = left.as_micros().div_ceil(1000).clamp(1, 99_999_999);
    format!("{ms}m")
}

/// The HTTP/2 settings of a hook connection.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// Around the connector: TCP connect and, for TLS, the handshake.
    pub connect_timeout: Duration,
    pub keep_alive_interval: Duration,
    pub keep_alive_timeout: Duration,
    pub keep_alive_while_idle: bool,
}

/// Cheap to clone; clones share the connection.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
}

struct Inner {
    scheme: Scheme,
    authority: Authority,
    user_agent: HeaderValue,
    dial: Dial,
    /// The live connection, once connected.
    ready: Mutex<Option<Live>>,
    /// One dial at a time: callers that arrive while it runs wait for it
    /// and use its connection, or get its error if it failed (so a server
    /// that does not answer costs its queued callers one connect timeout,
    /// not one each, as with tonic's buffer worker).
    dialing: tokio::sync::Mutex<Option<DialFailed>>,
    /// Dials finished (read before waiting for `dialing`).
    dials: AtomicU64,
}

/// The connector (TCP, and the TLS handshake for `https://` hooks) took
/// longer than the connect timeout. A connect failure like any other: the
/// server could not be reached (tonic's channel reported it as an untyped
/// I/O timeout, which read as a reset stream).
#[derive(Debug, thiserror::Error)]
#[error("could not connect within {0:?} (TCP, then TLS for an https hook)")]
pub struct ConnectTimedOut(pub Duration);

/// A dial's error, shared by the callers that waited for it. Its source is
/// the error itself, so the chain reads (and tonic maps it) as before.
#[derive(Clone, Debug)]
struct DialFailed(Arc<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for DialFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for DialFailed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

impl Channel {
    /// A channel to `target` through `connector`, connected at its first
    /// call. Requests go out with `origin`'s scheme and authority.
    pub fn lazy<C>(connector: C, target: Uri, origin: &Uri, settings: Settings) -> Channel
    where
        C: tower::Service<Uri> + Clone + Send + Sync + 'static,
        C::Response: hyper::rt::Read + hyper::rt::Write + Explains + Unpin + Send + 'static,
        C::Future: Send + 'static,
        C::Error: Into<BoxError>,
    {
        let mut builder = Builder::new(BoxedSpawner);
        builder
            .timer(TokioTimer::new())
            .keep_alive_interval(settings.keep_alive_interval)
            .keep_alive_timeout(settings.keep_alive_timeout)
            .keep_alive_while_idle(settings.keep_alive_while_idle);
        let dial: Dial = Box::new(move || {
            let mut connector = connector.clone();
            let target = target.clone();
            let builder = builder.clone();
            Box::pin(async move {
                let connecting = async {
                    std::future::poll_fn(|cx| connector.poll_ready(cx))
                        .await
                        .map_err(|e| tonic::ConnectError(e.into()))?;
                    connector
                        .call(target)
                        .await
                        .map_err(|e| tonic::ConnectError(e.into()))
                };
                let io = tokio::time::timeout(settings.connect_timeout, connecting)
                    .await
                    .map_err(|_| {
                        tonic::ConnectError(Box::new(ConnectTimedOut(settings.connect_timeout)))
                    })??;
                let ended_by = io.ended_by();
                let (sender, connection) = match builder.handshake(io).await {
                    Ok(handshaken) => handshaken,
                    // The server refused us as soon as we spoke.
                    Err(e) => return Err(explained(ended_by.as_ref(), e.into())),
                };
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(error = %e, "hook connection ended with an error");
                    }
                });
                Ok(Live { sender, ended_by })
            })
        });
        Channel {
            inner: Arc::new(Inner {
                scheme: origin.scheme().cloned().unwrap_or(Scheme::HTTP),
                authority: origin
                    .authority()
                    .cloned()
                    .unwrap_or_else(|| Authority::from_static("localhost")),
                user_agent: HeaderValue::from_static(concat!(
                    "hookwire/",
                    env!("CARGO_PKG_VERSION")
                )),
                dial,
                ready: Mutex::new(None),
                dialing: tokio::sync::Mutex::new(None),
                dials: AtomicU64::new(0),
            }),
        }
    }
}

impl Inner {
    /// The live connection, if there is one.
    fn live(&self) -> Option<Live> {
        let mut ready = self.ready.locked();
        match &*ready {
            Some(s) if !s.sender.is_closed() => Some(s.clone()),
            Some(_) => {
                *ready = None;
                None
            }
            None => None,
        }
    }

    async fn sender(&self) -> Result<Live, BoxError> {
        if let Some(s) = self.live() {
            return Ok(s);
        }
        let seen = self.dials.load(Ordering::SeqCst);
        let mut failed = self.dialing.lock().await;
        // Connected while this call waited for the dial before it.
        if let Some(s) = self.live() {
            return Ok(s);
        }
        // That dial failed: so does this call, without dialing again.
        if let Some(e) = failed.as_ref() {
            if self.dials.load(Ordering::SeqCst) > seen {
                return Err(Box::new(e.clone()));
            }
        }
        let dialed = (self.dial)().await;
        self.dials.fetch_add(1, Ordering::SeqCst);
        match dialed {
            Ok(s) => {
                *failed = None;
                *self.ready.locked() = Some(s.clone());
                Ok(s)
            }
            Err(e) => {
                let e = DialFailed(Arc::from(e));
                *failed = Some(e.clone());
                Err(Box::new(e))
            }
        }
    }

    fn prepare(&self, req: &mut Request<Body>) -> Result<(), BoxError> {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = req.uri().path_and_query().cloned();
        *req.uri_mut() = Uri::from_parts(parts)?;
        req.headers_mut()
            .insert(http::header::USER_AGENT, self.user_agent.clone());
        Ok(())
    }
}

impl tower::Service<Request<Body>> for Channel {
    type Response = Response<Incoming>;
    type Error = BoxError;
    type Future = BoxFuture<Result<Response<Incoming>, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Connecting is part of the call: a lazy channel is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.prepare(&mut req)?;
            let mut live = inner.sender().await?;
            stamp_timeout(&mut req);
            match live.sender.try_send_request(req).await {
                Ok(response) => Ok(response),
                Err(mut e) => match e.take_message() {
                    // Never sent: the connection was closing (its server
                    // drains it with GOAWAY, as a restarting pod does, or it
                    // just ended). Once more, on a new connection.
                    Some(mut req) => {
                        let mut live = inner.sender().await?;
                        stamp_timeout(&mut req);
                        let sent = live.sender.send_request(req).await;
                        sent.map_err(|e| live.explain(e))
                    }
                    None => Err(live.explain(e.into_error())),
                },
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::net::TcpListener;
    use tokio::sync::{oneshot, Notify};
    use tokio_stream::StreamExt;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    use super::*;
    use crate::hooks::client::connect;

    /// A health server on `listener` counting the connections it accepts;
    /// the sender shuts it down (GOAWAY, then its connections close).
    fn serve(listener: TcpListener, accepted: Arc<AtomicUsize>) -> oneshot::Sender<()> {
        let (stop, stopped) = oneshot::channel::<()>();
        let (_, health) = tonic_health::server::health_reporter();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(move |s| {
            accepted.fetch_add(1, Ordering::SeqCst);
            s
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                }),
        );
        stop
    }

    /// A health server on a free port: its address, its accepted
    /// connections, its stop.
    async fn server() -> (std::net::SocketAddr, Arc<AtomicUsize>, oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = serve(listener, accepted.clone());
        (addr, accepted, stop)
    }

    /// hookwire's channel to a plaintext hook server at `addr`.
    fn plain(addr: std::net::SocketAddr) -> Channel {
        connect(
            &format!("http://{addr}"),
            Duration::from_secs(5),
            None,
            Default::default(),
        )
        .unwrap()
    }

    /// `addr` again, once its previous server has let go of it.
    async fn rebind(addr: std::net::SocketAddr) -> TcpListener {
        loop {
            if let Ok(l) = TcpListener::bind(addr).await {
                return l;
            }
            tokio::task::yield_now().await;
        }
    }

    /// A channel to nowhere in particular through `connector`.
    fn through<C>(connector: C, connect_timeout: Duration) -> Channel
    where
        C: tower::Service<Uri> + Clone + Send + Sync + 'static,
        C::Response: hyper::rt::Read + hyper::rt::Write + Explains + Unpin + Send + 'static,
        C::Future: Send + 'static,
        C::Error: Into<BoxError>,
    {
        let target = Uri::from_static("http://127.0.0.1:9");
        let settings = Settings {
            connect_timeout,
            keep_alive_interval: Duration::from_secs(300),
            keep_alive_timeout: Duration::from_secs(20),
            keep_alive_while_idle: false,
        };
        let connector = crate::hooks::connector::Connector::new(connector, Default::default());
        Channel::lazy(connector, target.clone(), &target, settings)
    }

    async fn check(channel: &Channel) -> Result<(), tonic::Status> {
        HealthClient::new(channel.clone())
            .check(HealthCheckRequest::default())
            .await
            .map(|_| ())
    }

    #[tokio::test]
    async fn connects_at_the_first_call_shares_it_and_reconnects_after_it_ended() {
        let (addr, first, stop) = server().await;
        let closed = Arc::new(Notify::new());
        let channel = connect(
            &format!("http://{addr}"),
            Duration::from_secs(5),
            None,
            closed.clone(),
        )
        .unwrap();
        assert_eq!(
            first.load(Ordering::SeqCst),
            0,
            "lazy: no call, no connection"
        );

        // Concurrent first calls wait for one dial and share its connection.
        let calls: Vec<_> = (0..8).map(|_| check(&channel)).collect();
        for r in futures::future::join_all(calls).await {
            r.unwrap();
        }
        check(&channel).await.unwrap();
        assert_eq!(
            first.load(Ordering::SeqCst),
            1,
            "one connection for all calls"
        );

        // The server goes away and another takes its place: once the old
        // connection ended, the next call dials again.
        let ended = closed.notified();
        stop.send(()).unwrap();
        ended.await;
        let listener = TcpListener::bind(addr).await.unwrap();
        let second = Arc::new(AtomicUsize::new(0));
        let _stop = serve(listener, second.clone());
        check(&channel).await.unwrap();
        assert_eq!(second.load(Ordering::SeqCst), 1, "reconnected");
    }

    #[tokio::test]
    async fn a_server_draining_its_connection_gets_new_calls_on_a_new_one() {
        let (addr, first, stop) = server().await;
        let channel = plain(addr);
        // A long-lived stream (as a run's) keeps the old connection open
        // while its server drains it: GOAWAY, no new streams there.
        let mut watch = HealthClient::new(channel.clone())
            .watch(HealthCheckRequest::default())
            .await
            .unwrap()
            .into_inner();
        watch.message().await.unwrap();
        stop.send(()).unwrap();
        // The replacement server (a restarted pod behind the same address).
        let listener = rebind(addr).await;
        let second = Arc::new(AtomicUsize::new(0));
        let _stop = serve(listener, second.clone());
        // Calls go to the old connection until its GOAWAY arrives, then to
        // a new one; none fails on the way.
        let mut calls = 0;
        while second.load(Ordering::SeqCst) == 0 {
            calls += 1;
            assert!(calls < 10_000, "never reached the new server");
            if let Err(status) = check(&channel).await {
                panic!("call {calls} failed while the old server drained: {status:?}");
            }
        }
        assert_eq!(first.load(Ordering::SeqCst), 1);
        drop(watch);
    }

    #[tokio::test]
    async fn a_failed_connect_is_unavailable_and_the_next_call_dials_again() {
        // Bind then drop: a port nobody listens on.
        let addr = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let channel = plain(addr);
        let status = check(&channel).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        let mut cause = std::error::Error::source(&status);
        while let Some(e) = cause.filter(|e| !e.is::<tonic::ConnectError>()) {
            cause = e.source();
        }
        assert!(cause.is_some(), "the connect error is kept: {status:?}");
        // The server comes up: the same channel connects on its next call.
        let listener = TcpListener::bind(addr).await.unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let _stop = serve(listener, accepted.clone());
        check(&channel).await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn callers_waiting_for_a_dial_that_fails_share_its_error() {
        // A connector that takes until released, then fails: a hook server
        // that does not answer until the connect timeout.
        let dialed = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let connector = tower::service_fn({
            let (dialed, gate) = (dialed.clone(), gate.clone());
            move |_: Uri| {
                let (dialed, gate) = (dialed.clone(), gate.clone());
                async move {
                    dialed.fetch_add(1, Ordering::SeqCst);
                    let _open = gate.acquire().await;
                    Err::<hyper_util::rt::TokioIo<tokio::net::TcpStream>, _>(std::io::Error::from(
                        std::io::ErrorKind::ConnectionRefused,
                    ))
                }
            }
        });
        let channel = through(connector, Duration::from_secs(60));
        let calls: Vec<_> = (0..5)
            .map(|_| {
                let channel = channel.clone();
                tokio::spawn(async move { check(&channel).await })
            })
            .collect();
        // The first call dials; on this one-thread runtime, a yield lets
        // every other call run until it waits behind that dial.
        while dialed.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        tokio::task::yield_now().await;
        gate.add_permits(100);
        for call in calls {
            let status = call.await.unwrap().unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        }
        assert_eq!(dialed.load(Ordering::SeqCst), 1, "one dial for all five");
        // A call after the failure dials again.
        assert!(check(&channel).await.is_err());
        assert_eq!(dialed.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_requests_grpc_timeout_is_what_is_left_once_its_connection_is_there() {
        // A health server that notes each request's grpc-timeout header.
        let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_, health) = tonic_health::server::health_reporter();
        let noted = seen.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .layer(tower::ServiceBuilder::new().map_request(
                    move |req: http::Request<tonic::body::Body>| {
                        if let Some(v) = req.headers().get("grpc-timeout") {
                            noted.lock().unwrap().push(v.to_str().unwrap().to_string());
                        }
                        req
                    },
                ))
                .add_service(health)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        // Its connection takes 300 ms to make.
        const DIAL: Duration = Duration::from_millis(300);
        let connector = tower::service_fn(move |_: Uri| async move {
            tokio::time::sleep(DIAL).await;
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tcp))
        });
        let channel = through(connector, Duration::from_secs(5));
        let mut req = tonic::Request::new(HealthCheckRequest::default());
        req.extensions_mut()
            .insert(SendBy(tokio::time::Instant::now() + Duration::from_secs(2)));
        HealthClient::new(channel).check(req).await.unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "{seen:?}");
        let ms: u64 = seen[0].strip_suffix('m').unwrap().parse().unwrap();
        assert!(
            (1..=2000 - 300).contains(&ms),
            "told {ms} ms of 2 s after a {DIAL:?} dial"
        );
    }

    #[test]
    fn a_grpc_timeout_is_rounded_up_so_the_server_never_gives_up_first() {
        assert_eq!(grpc_timeout(Duration::from_micros(999_600)), "1000m");
        assert_eq!(grpc_timeout(Duration::from_millis(1700)), "1700m");
        assert_eq!(grpc_timeout(Duration::from_micros(1)), "1m");
        assert_eq!(grpc_timeout(Duration::ZERO), "1m");
        assert_eq!(grpc_timeout(Duration::from_secs(200_000)), "99999999m");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_never_completes_is_a_connect_failure_after_the_timeout() {
        // TCP accepted but the TLS handshake never answered, say.
        let connector = tower::service_fn(|_: Uri| {
            std::future::pending::<
                Result<hyper_util::rt::TokioIo<tokio::net::TcpStream>, std::io::Error>,
            >()
        });
        let channel = through(connector, Duration::from_secs(3));
        let status = check(&channel).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        let fault = crate::hooks::stream::classify_status(&status, true);
        assert_eq!(
            fault.class,
            crate::hooks::failure::FailureClass::Connect,
            "{fault:?}"
        );
        assert!(fault.detail.contains("within 3s"), "{}", fault.detail);
    }

    #[tokio::test]
    async fn requests_carry_the_origin_and_hookwires_user_agent() {
        let inner = Arc::new(Inner {
            scheme: Scheme::HTTP,
            authority: Authority::from_static("hooks.example:7443"),
            user_agent: HeaderValue::from_static("hookwire/test"),
            dial: Box::new(|| Box::pin(async { Err("no dial in this test".into()) })),
            ready: Mutex::new(None),
            dialing: tokio::sync::Mutex::new(None),
            dials: AtomicU64::new(0),
        });
        let mut req = Request::new(Body::empty());
        *req.uri_mut() = Uri::from_static("/hookwire.v1.HookService/Process");
        inner.prepare(&mut req).unwrap();
        assert_eq!(
            req.uri().to_string(),
            "http://hooks.example:7443/hookwire.v1.HookService/Process"
        );
        assert_eq!(req.headers()[http::header::USER_AGENT], "hookwire/test");
    }
}
