//! Hook servers that cap concurrent HTTP/2 streams per connection (as
//! proxies, grpcio and grpc-go do): every run holds one stream per hook, so
//! hookwire spreads runs over more connections. Real tonic hook servers
//! with `max_concurrent_streams` on port 0, a real hookwire server, and
//! every run held in flight at once by the hook, so the streams really are
//! concurrent.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use pb::EventKind as K;
use support::certs::{write_pem, Ca, Use};
use support::fault::{FaultHook, Misbehave};
use support::python::PythonHook;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::StreamExt;

/// Holds every run_start verdict until released, so every run keeps its
/// stream to the hook open at the same time.
#[derive(Clone, Default)]
struct Hold {
    arrived: Arc<AtomicUsize>,
    /// Signalled at every arrival.
    arrival: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Hold {
    fn hook(&self) -> FnHook {
        let h = self.clone();
        FnHook::new("limited", &[K::RunStart]).on_run_start(move |_, _| {
            let h = h.clone();
            async move {
                let mut release = h.release.subscribe();
                h.arrived.fetch_add(1, Ordering::SeqCst);
                h.arrival.notify_waiters();
                let _ = release.wait_for(|r| *r).await;
                Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
    }

    async fn until_arrived(&self, n: usize) {
        loop {
            let next = self.arrival.notified();
            if self.arrived.load(Ordering::SeqCst) >= n {
                return;
            }
            next.await;
        }
    }
}

/// A hook server that allows `limit` concurrent streams per connection
/// (advertised in its SETTINGS, enforced with REFUSED_STREAM).
async fn limited_server(hook: FnHook, limit: u32) -> (String, tokio::task::JoinHandle<()>) {
    limited_server_with(hook, Some(limit), None).await
}

/// `limited_server` (no limit when `None`), serving TLS with `identity`
/// when given.
async fn limited_server_with(
    hook: FnHook,
    limit: Option<u32>,
    identity: Option<tonic::transport::Identity>,
) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
        if let Ok(s) = &s {
            let _ = s.set_nodelay(true);
        }
        s
    });
    let mut builder = tonic::transport::Server::builder();
    if let Some(identity) = identity {
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .unwrap();
    }
    let task = tokio::spawn(async move {
        builder
            .max_concurrent_streams(limit)
            .add_service(hook_server::service(hook))
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    });
    (format!("127.0.0.1:{}", addr.port()), task)
}

fn gauge(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{hook=\"limited\"}} ")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} for hook limited in\n{metrics}"))
}

const HOOK_LINES: &str = "events: [run_start]\ntimeout: 120s\nconnections: {idle_timeout: 200ms}";

/// `runs` concurrent runs through the hook at `hook_addr`, all held in
/// flight at once. Returns the /metrics text taken while they were held and
/// once idle connections closed after they all completed.
async fn concurrent_runs(hook_addr: &str, runs: usize, hold: &Hold) -> (String, String) {
    concurrent_runs_to(&format!("http://{hook_addr}"), HOOK_LINES, runs, hold).await
}

/// `concurrent_runs` to `endpoint`, the hook configured with `hook_lines`.
async fn concurrent_runs_to(
    endpoint: &str,
    hook_lines: &str,
    runs: usize,
    hold: &Hold,
) -> (String, String) {
    let yaml = config(&[("limited", endpoint, hook_lines)], "event_budget: 120s");
    let (server, admin) = TestServer::start_with_admin(&yaml).await;
    let client = server.client().await;
    let mut sessions = Vec::with_capacity(runs);
    for _ in 0..runs {
        sessions.push(session(&mut client.clone(), "a").await);
    }
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|s| {
            let mut c = client.clone();
            tokio::spawn(async move { invoke(&mut c, &s, "hello").await })
        })
        .collect();
    // Runs that cannot open their stream never arrive: fail, do not hang.
    if tokio::time::timeout(Duration::from_secs(90), hold.until_arrived(runs))
        .await
        .is_err()
    {
        panic!(
            "only {} of {runs} runs reached the hook; /metrics:\n{}",
            hold.arrived.load(Ordering::SeqCst),
            http_get(admin, "/metrics").await
        );
    }
    let during = http_get(admin, "/metrics").await;
    hold.release.send_replace(true);
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::Completed,
            "every run completes: {}",
            r.reason
        );
    }
    // Idle connections close after connections.idle_timeout (200 ms). A
    // run's hook stream is released a moment after the run's answer (when
    // its reader task sees the server's end of stream), so the last
    // connection can be alone while it still carries one: wait for both.
    let mut after = String::new();
    for _ in 0..400 {
        after = http_get(admin, "/metrics").await;
        if gauge(&after, "hookwire_hook_connections") == 1.0
            && gauge(&after, "hookwire_hook_streams") == 0.0
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    server.stop().await;
    (during, after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_runs_through_a_hook_server_limited_to_100_streams_all_complete() {
    const RUNS: usize = 1000;
    let hold = Hold::default();
    let (addr, _hook_server) = limited_server(hold.hook(), 100).await;
    let (during, after) = concurrent_runs(&addr, RUNS, &hold).await;
    assert_eq!(
        gauge(&during, "hookwire_hook_streams"),
        RUNS as f64,
        "one stream per run in flight:\n{during}"
    );
    // At least ten connections were needed; none was refused a stream,
    // since each connection's limit was read from the server's SETTINGS
    // before streams went on it.
    assert!(
        gauge(&during, "hookwire_hook_connections") >= 10.0,
        "{during}"
    );
    assert_eq!(
        gauge(&during, "hookwire_hook_streams_refused_total"),
        0.0,
        "{during}"
    );
    assert_eq!(gauge(&after, "hookwire_hook_streams"), 0.0, "{after}");
    assert_eq!(
        gauge(&after, "hookwire_hook_connections"),
        1.0,
        "idle surplus connections close:\n{after}"
    );
}

/// A server that sets no stream limit (tonic's default) still gets at most
/// 1 000 streams per connection: an h2 server closes a connection whose
/// unread small DATA frames pass half its connection window (GOAWAY
/// ENHANCE_YOUR_CALM, "too_many_data_frames"), which a burst of ~10 000
/// run starts on one connection did, failing every run on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_beyond_a_thousand_on_a_hook_server_without_a_limit_go_on_another_connection() {
    const RUNS: usize = 1100;
    let hold = Hold::default();
    let (addr, _hook_server) = limited_server_with(hold.hook(), None, None).await;
    let (during, _) = concurrent_runs(&addr, RUNS, &hold).await;
    assert_eq!(
        gauge(&during, "hookwire_hook_streams"),
        RUNS as f64,
        "{during}"
    );
    assert_eq!(
        gauge(&during, "hookwire_hook_connections"),
        2.0,
        "1 000 streams on the first connection, 100 on a second:\n{during}"
    );
}

/// Over TLS the limit is read from the SETTINGS above the TLS layer (TLS
/// is hookwire's own connector, below the point where the limit is read),
/// so a TLS hook server limited to 10 streams gets runs spread over
/// connections of 10 before any stream is refused. Assumed at 100 instead,
/// all 40 streams would go on one connection, h2 would queue the 30 beyond
/// the server's 10, and those runs would never reach the hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_hook_servers_stream_limit_is_read_and_runs_spread_before_any_refusal() {
    const RUNS: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("hooks CA");
    let leaf = ca.leaf(Use::Server, &["localhost"], &[]);
    let ca_file = write_pem(dir.path(), "ca.crt", &ca.pem());
    let hold = Hold::default();
    let identity = tonic::transport::Identity::from_pem(&leaf.cert, &leaf.key);
    let (addr, _hook_server) = limited_server_with(hold.hook(), Some(10), Some(identity)).await;
    let endpoint = format!("https://{}", addr.replace("127.0.0.1", "localhost"));
    let lines = format!("{HOOK_LINES}\ntls: {{ca_file: {}}}", ca_file.display());
    let (during, after) = concurrent_runs_to(&endpoint, &lines, RUNS, &hold).await;
    assert_eq!(
        gauge(&during, "hookwire_hook_streams"),
        RUNS as f64,
        "{during}"
    );
    assert!(
        gauge(&during, "hookwire_hook_connections") >= 4.0,
        "40 streams over connections of 10:\n{during}"
    );
    assert_eq!(
        gauge(&during, "hookwire_hook_streams_refused_total"),
        0.0,
        "the limit was known before streams went on a connection:\n{during}"
    );
    assert_eq!(gauge(&after, "hookwire_hook_connections"), 1.0, "{after}");
}

/// A TCP proxy that hides the server's stream limit: the
/// SETTINGS_MAX_CONCURRENT_STREAMS entry of its first frame is turned into
/// an unknown setting (which HTTP/2 peers ignore), as a proxy that
/// advertises more than its backend allows would. Streams beyond the limit
/// are then refused by the server, not queued by the client.
async fn hiding_proxy(upstream: String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let server = TcpStream::connect(&upstream).await.unwrap();
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut cr, &mut sw).await;
                });
                let mut header = [0u8; 9];
                if sr.read_exact(&mut header).await.is_err() {
                    return;
                }
                let len = usize::from(header[0]) << 16
                    | usize::from(header[1]) << 8
                    | usize::from(header[2]);
                let mut payload = vec![0u8; len];
                if sr.read_exact(&mut payload).await.is_err() {
                    return;
                }
                assert_eq!(header[3], 0x4, "the server's first frame is SETTINGS");
                for entry in payload.chunks_exact_mut(6) {
                    if entry[..2] == [0, 3] {
                        entry[..2].copy_from_slice(&[0xf0, 0x03]);
                    }
                }
                if cw.write_all(&header).await.is_err() || cw.write_all(&payload).await.is_err() {
                    return;
                }
                let _ = tokio::io::copy(&mut sr, &mut cw).await;
            });
        }
    });
    format!("127.0.0.1:{}", addr.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_refused_by_a_server_that_hides_its_limit_are_opened_on_other_connections() {
    const RUNS: usize = 40;
    let hold = Hold::default();
    let (addr, _hook_server) = limited_server(hold.hook(), 10).await;
    let proxy = hiding_proxy(addr).await;
    let (during, _) = concurrent_runs(&proxy, RUNS, &hold).await;
    assert!(
        gauge(&during, "hookwire_hook_streams_refused_total") > 0.0,
        "the server refused streams, and none failed a run:\n{during}"
    );
    assert!(
        gauge(&during, "hookwire_hook_connections") >= 4.0,
        "{during}"
    );
}

/// The case measured in issue 18 before the pool: the Python example with
/// `grpc.max_concurrent_streams` 10 and 30 runs at once ended 20 runs
/// `hook_failed` (refused streams and deadlines). Each of its decisions
/// takes 500 ms here, so the runs overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_runs_through_the_python_example_capped_at_10_streams_all_complete() {
    const RUNS: usize = 30;
    let py = PythonHook::start(&[
        "--features",
        "redactor",
        "--max-concurrent-streams",
        "10",
        "--simulate-latency-ms",
        "500",
    ])
    .await;
    let yaml = config(
        &[("limited", &py.addr, "events: [run_start]\ntimeout: 60s")],
        "event_budget: 60s",
    );
    let (server, admin) = TestServer::start_with_admin(&yaml).await;
    let client = server.client().await;
    let mut sessions = Vec::new();
    for _ in 0..RUNS {
        sessions.push(session(&mut client.clone(), "a").await);
    }
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|s| {
            let mut c = client.clone();
            tokio::spawn(async move { invoke(&mut c, &s, "hello").await })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    }
    let metrics = http_get(admin, "/metrics").await;
    assert!(
        gauge(&metrics, "hookwire_hook_connections") >= 3.0,
        "30 runs over connections of 10 streams:\n{metrics}"
    );
    server.stop().await;
}

/// One run through the hook at `endpoint` (configured as `limited` with
/// `hook_lines`) fails closed, and hookwire then gives the run's stream
/// slot back although the server never ends the stream: a hook that
/// misbehaves on every run would otherwise use up its slots
/// (connections.max × the per-connection limit) and every later run would
/// wait for one.
async fn fails_closed_and_gives_its_slot_back(
    endpoint: &str,
    hook_lines: &str,
    input: &str,
    hook_server: tokio::task::JoinHandle<()>,
) {
    let yaml = config(&[("limited", endpoint, hook_lines)], "");
    let (server, admin) = TestServer::start_with_admin(&yaml).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, input).await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed, "{}", r.reason);
    assert!(r.reason.contains("deadline"), "{}", r.reason);
    // Given back after the stream's close grace (5 s); waited for, at most
    // twice that.
    let mut streams = f64::NAN;
    for _ in 0..400 {
        streams = gauge(&http_get(admin, "/metrics").await, "hookwire_hook_streams");
        if streams == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(streams, 0.0, "the run's stream still holds its slot");
    server.stop().await;
    hook_server.abort();
}

/// `fails_closed_and_gives_its_slot_back` for the hook server at `addr`
/// configured on run_start, failing closed after 200 ms.
async fn run_start_fails_closed_and_gives_its_slot_back(
    addr: impl std::fmt::Display,
    hook_server: tokio::task::JoinHandle<()>,
) {
    let endpoint = format!("http://{addr}");
    let lines = "events: [run_start]\ntimeout: 200ms";
    fails_closed_and_gives_its_slot_back(&endpoint, lines, "hi", hook_server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_never_answers_gives_its_stream_slot_back_once_the_run_ended() {
    // The handler hangs while the server stays up (HTTP/2 pings answered)
    // and never ends its side after hookwire half-closed the stream.
    let hook = FnHook::new("limited", &[K::RunStart])
        .on_run_start(|_, _| async { std::future::pending().await });
    let (addr, server_task) = limited_server_with(hook, None, None).await;
    run_start_fails_closed_and_gives_its_slot_back(addr, server_task).await;
}

/// A hook server whose `Process` handler never returns, so the call's
/// response headers never come (grpcio sends them only with a first reply).
struct NoHeaders;

#[tonic::async_trait]
impl pb::hook_service_server::HookService for NoHeaders {
    async fn describe(
        &self,
        _: tonic::Request<pb::DescribeRequest>,
    ) -> Result<tonic::Response<pb::DescribeResponse>, tonic::Status> {
        Err(tonic::Status::unavailable("describe is down"))
    }
    type ProcessStream = tokio_stream::Pending<Result<pb::HookVerdict, tonic::Status>>;
    async fn process(
        &self,
        _: tonic::Request<tonic::Streaming<pb::HookEvent>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        std::future::pending().await
    }
    async fn call_tool(
        &self,
        _: tonic::Request<pb::CallToolRequest>,
    ) -> Result<tonic::Response<pb::CallToolResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("no tools"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_never_opens_the_stream_gives_its_slot_back_once_the_run_ended() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server_task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(pb::hook_service_server::HookServiceServer::new(NoHeaders))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    run_start_fails_closed_and_gives_its_slot_back(addr, server_task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_that_never_reads_gives_its_stream_slot_back_once_the_run_ended() {
    // An event larger than the server's HTTP/2 window, never read: the
    // stream's request body stays blocked on flow control.
    let (addr, server_task) = FaultHook::new(K::ModelRequest, Misbehave::Deaf, &[])
        .start()
        .await;
    fails_closed_and_gives_its_slot_back(
        &addr,
        "timeout: 200ms",
        &"x".repeat(200 * 1024),
        server_task,
    )
    .await;
}

/// A TCP proxy to `upstream` that, once armed, accepts its next connection
/// and never answers it (nor forwards it, nor closes it), as a stopped
/// hook process or an L4 proxy whose backend is gone does; later
/// connections are forwarded.
struct BlackHole {
    addr: String,
    armed: std::sync::atomic::AtomicBool,
    /// Signalled when a connection fell into the hole.
    held: tokio::sync::Notify,
}

async fn black_hole_proxy(upstream: String) -> Arc<BlackHole> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let hole = Arc::new(BlackHole {
        addr: format!("127.0.0.1:{}", listener.local_addr().unwrap().port()),
        armed: false.into(),
        held: tokio::sync::Notify::new(),
    });
    let h = hole.clone();
    tokio::spawn(async move {
        let mut silent = Vec::new();
        while let Ok((client, _)) = listener.accept().await {
            if h.armed.swap(false, Ordering::SeqCst) {
                // Kept open: a closed connection would tell hookwire.
                silent.push(client);
                h.held.notify_one();
                continue;
            }
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                let mut client = client;
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    hole
}

/// A connection whose server never sends its SETTINGS (TCP accepted, not a
/// byte back) must not stop the pool from opening another: while its limit
/// was unknown, every other stream waited for it, and runs failed with "no
/// free stream" although the hook server was up behind other connections.
/// Here run 0 fills the first connection (one stream per connection), run 1
/// opens a second one into the black hole and hangs there, and run 2 must
/// still complete, on a third connection, once the second has said nothing
/// for the connect timeout (300 ms, the hook's `timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_answers_does_not_stop_the_pool_from_opening_another() {
    let arrived = Arc::new(AtomicUsize::new(0));
    let first_in = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::watch::Sender::new(false));
    let hook = {
        let (arrived, first_in, release) = (arrived.clone(), first_in.clone(), release.clone());
        FnHook::new("limited", &[K::RunStart]).on_run_start(move |_, _| {
            let (arrived, first_in, release) = (arrived.clone(), first_in.clone(), release.clone());
            async move {
                // The first run is held until released: it keeps the
                // first connection full.
                if arrived.fetch_add(1, Ordering::SeqCst) == 0 {
                    first_in.notify_one();
                    let _ = release.subscribe().wait_for(|r| *r).await;
                }
                Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
    };
    let (addr, hook_server) = limited_server_with(hook, None, None).await;
    let hole = black_hole_proxy(addr).await;
    let lines = "events: [run_start]\ntimeout: 300ms\nevent_timeouts: {run_start: 3s}\nconnections: {max_streams_per_connection: 1}";
    let yaml = config(&[("limited", &format!("http://{}", hole.addr), lines)], "");
    let (server, admin) = TestServer::start_with_admin(&yaml).await;
    let client = server.client().await;
    let run = |session: String| {
        let mut c = client.clone();
        tokio::spawn(async move { invoke(&mut c, &session, "hello").await })
    };
    let s0 = session(&mut client.clone(), "a").await;
    let s1 = session(&mut client.clone(), "a").await;
    let s2 = session(&mut client.clone(), "a").await;

    let run0 = run(s0);
    first_in.notified().await;
    hole.armed.store(true, Ordering::SeqCst);
    let run1 = run(s1);
    hole.held.notified().await;
    let r2 = run(s2).await.unwrap();
    assert_eq!(
        outcome(&r2),
        pb::RunOutcome::Completed,
        "{}\n{}",
        r2.reason,
        http_get(admin, "/metrics").await
    );

    release.send_replace(true);
    let r0 = run0.await.unwrap();
    assert_eq!(outcome(&r0), pb::RunOutcome::Completed, "{}", r0.reason);
    // The run whose stream went into the hole ends at its deadline.
    let r1 = run1.await.unwrap();
    assert_eq!(outcome(&r1), pb::RunOutcome::HookFailed, "{}", r1.reason);
    assert!(r1.reason.contains("deadline"), "{}", r1.reason);
    server.stop().await;
    hook_server.abort();
}

/// The scripted model, except that a run whose input is "hold" waits in
/// its model call until released: the run (and its hook stream, which
/// lives as long as the run) stays in flight without a hook call pending.
struct Gated {
    inner: Arc<dyn hookwire::model::ModelProvider>,
    held: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::watch::Sender<bool>>,
}

impl hookwire::model::ModelProvider for Gated {
    fn provider_name(&self) -> &'static str {
        self.inner.provider_name()
    }
    fn model_name(&self) -> &str {
        self.inner.model_name()
    }
    fn complete<'a>(
        &'a self,
        request: &'a hookwire::model::ModelRequest,
        on_delta: hookwire::model::DeltaSink<'a>,
    ) -> hookwire::model::BoxFuture<
        'a,
        Result<hookwire::model::ModelResponse, hookwire::model::ModelError>,
    > {
        let hold = request.history.last().is_some_and(|m| m.text() == "hold");
        Box::pin(async move {
            if hold {
                let mut release = self.release.subscribe();
                self.held.notify_one();
                let _ = release.wait_for(|r| *r).await;
            }
            self.inner.complete(request, on_delta).await
        })
    }
}

/// An event that waited for a free stream slot until its deadline never
/// reached the hook: the run fails under the hook's policy, but the breaker
/// holds nothing against the hook. Counted as the hook's failure, one busy
/// moment of the pool (here: one slot, taken by another run) opened the
/// breaker of a healthy server, and the next run failed `circuit_open`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_free_slot_does_not_open_the_hooks_breaker() {
    let hook = FnHook::new("limited", &[K::RunStart]);
    let seen = hook.seen.clone();
    let (addr, hook_server) = limited_server_with(hook, None, None).await;
    let lines = "events: [run_start]\ntimeout: 300ms\nbreaker: {failures: 1, cooldown: 60s}\nconnections: {max: 1, max_streams_per_connection: 1}";
    let yaml = config(&[("limited", &format!("http://{addr}"), lines)], "");
    let scripted =
        hookwire::server::build_models(&hookwire::config::Config::parse(&yaml, "t").unwrap())
            .unwrap()["m"]
            .clone();
    let held = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::watch::Sender::new(false));
    let gated = Gated {
        inner: scripted,
        held: held.clone(),
        release: release.clone(),
    };
    let (server, admin) = TestServer::start_with_models(&yaml, vec![("m", Arc::new(gated))]).await;
    let client = server.client().await;
    let run = |input: &'static str| {
        let mut c = client.clone();
        tokio::spawn(async move {
            let s = session(&mut c, "a").await;
            invoke(&mut c, &s, input).await
        })
    };

    // Run A holds the pool's only slot.
    let a = run("hold");
    held.notified().await;
    // Run B's run_start waits for it until its deadline.
    let b = run("hello").await.unwrap();
    assert_eq!(outcome(&b), pb::RunOutcome::HookFailed, "{}", b.reason);
    assert!(b.reason.contains("free"), "{}", b.reason);
    let metrics = http_get(admin, "/metrics").await;
    assert_eq!(
        gauge(&metrics, "hookwire_hook_breaker_open"),
        0.0,
        "{metrics}"
    );
    release.send_replace(true);
    let a = a.await.unwrap();
    assert_eq!(outcome(&a), pb::RunOutcome::Completed, "{}", a.reason);

    // The next run calls the hook.
    let c = run("hello").await.unwrap();
    assert_eq!(outcome(&c), pb::RunOutcome::Completed, "{}", c.reason);
    let run_starts = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind == K::RunStart as i32)
        .count();
    assert_eq!(run_starts, 2, "runs A and C called the hook");
    server.stop().await;
    hook_server.abort();
}
