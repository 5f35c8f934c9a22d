//! Deadlines at three levels, fail-open detach, the circuit breaker, and a
//! hook server killed mid-run (SIGKILL) that comes back.

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use pb::EventKind as K;
use support::fault::{FaultHook, Misbehave};
use support::*;

#[tokio::test]
async fn each_hook_receives_its_remaining_deadline() {
    let hook = FnHook::new("h", &[K::RunStart]).start().await;
    let server = TestServer::start(&config(
        &[("h", &hook.addr, "timeout: 2s")],
        "event_budget: 10s",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    invoke(&mut c, &s, "hi").await;
    let ev = hook.hook.seen.lock().unwrap()[0].clone();
    let ms = ev.context.unwrap().deadline_remaining_ms;
    assert!(
        ms > 0 && ms <= 2000,
        "remaining deadline {ms} ms is bounded by the hook timeout"
    );
    server.stop().await;
}

#[tokio::test]
async fn event_budget_bounds_a_whole_chain() {
    // Hook timeouts of a minute, an event budget of 3 s: the first hook
    // takes 100 ms, the second never answers. Only the budget can end the
    // chain, and the second hook is told only what the first left of it.
    let a = FnHook::new("a1", &[K::RunStart])
        .on_run_start(|_, _| async {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            Reply::new(hook_server::rewrite_input("x"))
        })
        .start()
        .await;
    let b = FnHook::new("b1", &[K::RunStart])
        .on_run_start(|_, _| std::future::pending())
        .start()
        .await;
    let server = TestServer::start(&config(
        &[
            ("a1", &a.addr, "timeout: 60s"),
            ("b1", &b.addr, "timeout: 60s"),
        ],
        "event_budget: 3s",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = tokio::time::timeout(std::time::Duration::from_secs(30), invoke(&mut c, &s, "hi"))
        .await
        .expect("the event budget ended the chain");
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason.contains("hook `b1` failed on run_start: deadline"),
        "{}",
        r.reason
    );
    let told = |h: &TestHook| {
        h.hook.seen.lock().unwrap()[0]
            .context
            .clone()
            .unwrap()
            .deadline_remaining_ms
    };
    assert!(told(&a) <= 3000, "a1 was told the budget ({} ms)", told(&a));
    assert!(
        told(&b) <= 2900,
        "b1 was told only the budget's remainder ({} ms)",
        told(&b)
    );
    server.stop().await;
}

#[tokio::test]
async fn run_timeout_ends_the_run_as_timed_out() {
    let stuck = FnHook::new("stuck", &[K::RunStart])
        .on_run_start(|_, _| async { std::future::pending().await })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("stuck", &stuck.addr, "timeout: 30s")],
        "run_timeout: 300ms",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    // The hook's own deadline (30 s) is clipped to the run's, so both end at
    // the same instant; what expired is the run's deadline, and the runner
    // checks it before the step's own result (a biased select): timed_out,
    // never the hook's deadline failure.
    assert_eq!(outcome(&r), pb::RunOutcome::TimedOut, "{}", r.reason);
    let ms = stuck.hook.seen.lock().unwrap()[0]
        .context
        .clone()
        .unwrap()
        .deadline_remaining_ms;
    assert!(
        ms <= 300,
        "the run deadline bounds the hook deadline ({ms} ms)"
    );
    server.stop().await;
}

#[tokio::test]
async fn fail_open_detaches_by_default_and_keeps_calling_when_told() {
    // None: the documented default (detach).
    for (detach, want_calls) in [(None, 1), (Some(false), 2)] {
        let fault = FaultHook::new(K::ModelRequest, Misbehave::Status, &[]);
        let calls = fault.received.clone();
        let (addr, _task) = fault.start().await;
        let owner = FnHook::new("owner", &[])
            .with_tool(weather_tool(), |_, _| async {
                pb::CallToolResponse {
                    content: "sunny".into(),
                    is_error: false,
                }
            })
            .start()
            .await;
        let server = TestServer::start(&config(
            &[
                (
                    "flaky",
                    &addr,
                    &match detach {
                        Some(d) => format!(
                            "failure: open\ndetach_on_failure: {d}\nbreaker: {{failures: 0}}"
                        ),
                        None => "failure: open\nbreaker: {failures: 0}".to_string(),
                    },
                ),
                ("owner", &owner.addr, ""),
            ],
            "tools: [get_weather]",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        // Two model requests in this run (tool turn, then the answer).
        let r = invoke(&mut c, &s, "weather").await;
        assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            want_calls,
            "detach_on_failure: {detach:?}"
        );
        server.stop().await;
    }
}

/// A fault hook whose `Describe` fails, so the breaker's background probe
/// never sees it answer and only the cool-down ends an open breaker.
struct NoDescribe(FaultHook);

#[tonic::async_trait]
impl pb::hook_service_server::HookService for NoDescribe {
    async fn describe(
        &self,
        _: tonic::Request<pb::DescribeRequest>,
    ) -> Result<tonic::Response<pb::DescribeResponse>, tonic::Status> {
        Err(tonic::Status::unavailable("describe is down"))
    }
    type ProcessStream = <FaultHook as pb::hook_service_server::HookService>::ProcessStream;
    async fn process(
        &self,
        req: tonic::Request<tonic::Streaming<pb::HookEvent>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        self.0.process(req).await
    }
    async fn call_tool(
        &self,
        req: tonic::Request<pb::CallToolRequest>,
    ) -> Result<tonic::Response<pb::CallToolResponse>, tonic::Status> {
        self.0.call_tool(req).await
    }
}

#[tokio::test]
async fn circuit_breaker_opens_after_consecutive_failures_and_probes_after_cooldown() {
    let f = FaultHook::new(K::RunStart, Misbehave::Status, &[]);
    let calls = f.received.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let _t = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::hook_service_server::HookServiceServer::new(NoDescribe(
                f,
            )))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let cooldown = std::time::Duration::from_secs(5);
    let server = TestServer::start(&config(
        &[(
            "flaky",
            &addr,
            "events: [run_start]\nfailure: closed\nbreaker: {failures: 2, cooldown: 5s}",
        )],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert!(r.reason.contains(": status:"), "{}", r.reason);
    // The breaker opens during the second call: no earlier than this.
    let before_open = std::time::Instant::now();
    let r = invoke(&mut c, &s, "hi").await;
    assert!(r.reason.contains(": status:"), "{}", r.reason);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // Open: fails at once without calling the hook (still closed policy).
    // One local call against a 5 s cool-down.
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(r.reason.contains("circuit_open"), "{}", r.reason);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the open breaker did not call the hook"
    );
    let hooks = c
        .list_hooks(pb::ListHooksRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(hooks.hooks[0].state, "circuit_open");
    // Runs keep failing fast until, after the cool-down, one probe reaches
    // the hook (and fails again).
    let probed = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        loop {
            let r = invoke(&mut c, &s, "hi").await;
            if r.reason.contains(": status:") {
                return std::time::Instant::now();
            }
            assert!(r.reason.contains("circuit_open"), "{}", r.reason);
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("a probe after the cool-down");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert!(
        probed.duration_since(before_open) >= cooldown,
        "probed {:?} after opening",
        probed.duration_since(before_open)
    );
    server.stop().await;
}

#[tokio::test]
async fn the_breaker_opens_after_five_consecutive_failures_by_default() {
    let f = FaultHook::new(K::RunStart, Misbehave::Status, &[]);
    let calls = f.received.clone();
    // Describe fails, so the open breaker's background probe cannot close it
    // while the test looks (see the test above).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let _t = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::hook_service_server::HookServiceServer::new(NoDescribe(
                f,
            )))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let server = TestServer::start(&config(&[("flaky", &addr, "events: [run_start]")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    for n in 1..=5 {
        let r = invoke(&mut c, &s, "hi").await;
        assert!(r.reason.contains(": status:"), "failure {n}: {}", r.reason);
    }
    // The sixth comes well within the default 30 s cool-down.
    let r = invoke(&mut c, &s, "hi").await;
    assert!(r.reason.contains("circuit_open"), "{}", r.reason);
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    server.stop().await;
}

#[tokio::test]
async fn observe_mode_failures_never_fail_the_run() {
    // A closed-policy hook in observe mode breaking the protocol on events
    // it gets as observe events: an error status, a dropped stream, and
    // answers to events that expect none (once, twice).
    for how in [
        Misbehave::Status,
        Misbehave::CloseStream,
        Misbehave::WrongKind,
        Misbehave::Duplicate,
    ] {
        let fault = FaultHook::new(K::RunStart, how, &[K::ModelRequest, K::TurnEnd]);
        let (addr, _t) = fault.clone().start().await;
        // Holds each run at its model call until the observer misbehaved
        // on that run's run_start, then takes two more round trips
        // (model_response, turn_end): the fault reaches hookwire while the
        // run is still going. (Timing can only hide a regression here,
        // never fail a correct build: the outcome must be completed.)
        let f = fault.clone();
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let gate = FnHook::new("gate", &[K::ModelRequest, K::ModelResponse, K::TurnEnd])
            .on_model_request(move |_, _| {
                let (f, n) = (f.clone(), runs.fetch_add(1, Ordering::SeqCst) + 1);
                async move {
                    f.wait_faulted(n).await;
                    Reply::new(pb::ModelRequestVerdict {
                        action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {})),
                    })
                }
            });
        let gate = gate.start().await;
        let server = TestServer::start(&config(
            &[
                ("obs", &addr, "mode: observe\nfailure: closed"),
                ("gate", &gate.addr, "timeout: 30s"),
            ],
            "",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        for input in ["hi", "again"] {
            let r = invoke(&mut c, &s, input).await;
            assert_eq!(
                outcome(&r),
                pb::RunOutcome::Completed,
                "{how:?}: {}",
                r.reason
            );
        }
        assert_eq!(fault.faulted.load(Ordering::SeqCst), 2, "{how:?}");
        server.stop().await;
    }
    // Unreachable observer: still never fails the run.
    let server2 = TestServer::start(&config(
        &[(
            "obs",
            "http://127.0.0.1:1",
            "mode: observe\nevents: [run_start]",
        )],
        "",
    ))
    .await;
    let mut c2 = server2.client().await;
    let s2 = session(&mut c2, "a").await;
    assert_eq!(
        outcome(&invoke(&mut c2, &s2, "hi").await),
        pb::RunOutcome::Completed
    );
    server2.stop().await;
}

#[tokio::test]
async fn session_start_failure_and_rejection_refuse_the_session() {
    let (addr, _t) = FaultHook::new(K::SessionStart, Misbehave::Hang, &[])
        .start()
        .await;
    let server = TestServer::start(&config(&[("gate", &addr, "timeout: 100ms")], "")).await;
    let mut c = server.client().await;
    let err = c
        .create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(
        err.message()
            .contains("hook `gate` failed on session_start: deadline"),
        "{}",
        err.message()
    );
    server.stop().await;

    let gate = FnHook::new("gate", &[K::SessionStart])
        .on_session_start(|_, _| async {
            Reply::new(pb::SessionStartVerdict {
                action: Some(pb::session_start_verdict::Action::Terminate(
                    hook_server::terminate("not allowed", None),
                )),
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("gate", &gate.addr, "")], "")).await;
    let mut c = server.client().await;
    let err = c
        .create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    assert!(err.message().contains("not allowed"));
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(list.sessions.is_empty());
    server.stop().await;
}

#[tokio::test]
async fn killed_hook_process_fails_closed_and_recovers_after_restart() {
    let mut py = support::python::PythonHook::start_logged(&[
        "--features",
        "redactor",
        "--simulate-latency-ms",
        "600000",
        "--log-level",
        "DEBUG",
    ])
    .await;
    // Nothing but the kill can end the event: the hook would take ten
    // minutes, its timeout is an hour.
    let server = TestServer::start(&config(
        &[("py", &py.addr, "timeout: 3600s")],
        "event_budget: 3600s\nrun_timeout: 3600s",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut c2 = c.clone();
    let s2 = s.clone();
    let run = tokio::spawn(async move { invoke(&mut c2, &s2, "hello").await });
    // Kill it mid-event: once it logged receiving run_start.
    let log = py.log.as_mut().unwrap();
    while let Some(line) = log.recv().await {
        if line.contains("run_start seq") {
            break;
        }
    }
    py.child.start_kill().unwrap();
    let r = tokio::time::timeout(std::time::Duration::from_secs(60), run)
        .await
        .expect("the killed hook failed the run at once, not at a deadline")
        .unwrap();
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason
            .contains("hook `py` failed on run_start: stream_reset"),
        "{}",
        r.reason
    );
    let _ = py.child.wait().await;
    let state = |c: &mut pb::agent_service_client::AgentServiceClient<_>| {
        let mut c = c.clone();
        async move {
            c.list_hooks(pb::ListHooksRequest {})
                .await
                .unwrap()
                .into_inner()
                .hooks[0]
                .state
                .clone()
        }
    };
    assert_eq!(state(&mut c).await, "unavailable", "the failure was seen");

    // Restart at the address it had (the port the process reported), without
    // latency. hookwire describes it again once it answers; then runs succeed.
    let port = py.addr.rsplit(':').next().unwrap().to_string();
    let _py2 =
        support::python::PythonHook::start_on(&["--port", &port, "--features", "redactor"]).await;
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while state(&mut c).await != "connected" {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("hookwire reconnected to the restarted hook server");
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hello sk-abcdefgh12345").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(
        r.final_text.contains("[REDACTED:api_key]"),
        "{}",
        r.final_text
    );
    server.stop().await;
}

#[tokio::test]
async fn tls_handshake_failure_is_its_own_class() {
    // A plaintext hook server addressed over https: the TLS handshake fails.
    let (addr, _t) = FaultHook::new(K::RunStart, Misbehave::WrongKind, &[])
        .start()
        .await;
    let https = addr.replace("http://", "https://");
    let server =
        TestServer::start(&config(&[("tlshook", &https, "events: [run_start]")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason.contains("hook `tlshook` failed on run_start: tls"),
        "{}",
        r.reason
    );
    server.stop().await;
}

#[tokio::test]
async fn a_hook_that_stops_reading_cannot_hang_a_run_or_grow_its_queue() {
    // ~2500 text deltas of ~150 bytes each: several times the deaf hook's
    // 64 KiB HTTP/2 window.
    let input = "lorem ipsum ".repeat(2_500);

    // Observe: the run never waits on it; what does not fit the bounded
    // queue is dropped and counted.
    let (addr, _t) = FaultHook::new(K::TextDelta, Misbehave::Deaf, &[])
        .start()
        .await;
    let (server, admin) = TestServer::start_with_admin(&config(
        &[("deaf", &addr, "mode: observe\nobserve_queue: 8")],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        invoke(&mut c, &s, &input),
    )
    .await
    .expect("an unread observer must not hold up the run");
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
    let metrics = http_get(admin, "/metrics").await;
    let dropped: f64 = metrics
        .lines()
        .find(|l| l.starts_with("hookwire_observe_dropped_total{") && l.contains("hook=\"deaf\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no drop counter for deaf in\n{metrics}"));
    assert!(dropped > 0.0, "nothing dropped: {dropped}");
    server.stop().await;

    // Blocking: an event larger than the window never gets read; the run
    // fails closed at the hook's deadline instead of waiting for room.
    let (addr, _t) = FaultHook::new(K::ModelRequest, Misbehave::Deaf, &[])
        .start()
        .await;
    let server = TestServer::start(&config(&[("deaf", &addr, "timeout: 300ms")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let big = "x".repeat(200 * 1024);
    let r = tokio::time::timeout(std::time::Duration::from_secs(20), invoke(&mut c, &s, &big))
        .await
        .expect("an unread blocking hook must fail at its deadline, not hang");
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason.contains("model_request") && r.reason.contains("deadline"),
        "{}",
        r.reason
    );
    server.stop().await;
}

/// A TCP proxy to `upstream` that holds every connection but the first for
/// `delay` before it forwards a byte, as a slow network path or a busy
/// load balancer does: for a TLS hook, the handshake of every later
/// connection takes that long.
async fn slow_after_first(upstream: String, delay: std::time::Duration) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((mut client, _)) = listener.accept().await {
            let wait = if std::mem::take(&mut first) {
                std::time::Duration::ZERO
            } else {
                delay
            };
            let upstream = upstream.clone();
            tokio::spawn(async move {
                tokio::time::sleep(wait).await;
                let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    port
}

/// `CallToolRequest.context.deadline_remaining_ms` is what hookwire will
/// still wait when the request goes out, as for events: a `CallTool` that
/// needs a new connection first (here: the tool's owner allows one stream
/// per connection, and its run stream holds the first) waits for that
/// connection's TLS handshake, and the tool is told the time left after
/// it, not the hook's whole timeout.
#[tokio::test]
async fn call_tool_is_told_the_time_left_after_its_connection_was_made() {
    const DIAL: std::time::Duration = std::time::Duration::from_millis(1000);
    let told = Arc::new(std::sync::Mutex::new(Vec::new()));
    let owner = {
        let told = told.clone();
        FnHook::new("owner", &[K::ToolCall]).with_tool(weather_tool(), move |ctx, _| {
            told.lock().unwrap().push(ctx.deadline_remaining_ms);
            async {
                pb::CallToolResponse {
                    content: "sunny".into(),
                    is_error: false,
                }
            }
        })
    };
    let dir = tempfile::tempdir().unwrap();
    let ca = support::certs::Ca::new("hooks CA");
    let leaf = ca.leaf(support::certs::Use::Server, &["localhost"], &[]);
    let ca_file = support::certs::write_pem(dir.path(), "ca.crt", &ca.pem());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap().to_string();
    let identity = tonic::transport::Identity::from_pem(&leaf.cert, &leaf.key);
    let _hook_server = tokio::spawn(
        tonic::transport::Server::builder()
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .unwrap()
            .add_service(hook_server::service(owner))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let port = slow_after_first(upstream, DIAL).await;
    let lines = format!(
        "timeout: 5s\nconnections: {{max_streams_per_connection: 1}}\ntls: {{ca_file: {}}}",
        ca_file.display()
    );
    let server = TestServer::start(&config(
        &[("owner", &format!("https://localhost:{port}"), &lines)],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    let told = told.lock().unwrap().clone();
    assert_eq!(told.len(), 1, "{told:?}");
    assert!(
        told[0] > 0 && told[0] <= 5000 - 500,
        "the tool was told {} ms of a 5 s timeout after a {DIAL:?} handshake",
        told[0]
    );
    server.stop().await;
}
