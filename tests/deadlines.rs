//! Deadlines at three levels, fail-open detach, the circuit breaker, and a
//! hook server killed mid-run (SIGKILL) that comes back.

mod support;

use std::sync::atomic::Ordering;

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
    // Two hooks that each take ~300 ms on run_start, within their own 5 s
    // timeout, but the event budget is 400 ms: the second cannot finish.
    let slow = |name: &str| {
        FnHook::new(name, &[K::RunStart]).on_run_start(|_, _| async {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            Reply::new(hook_server::rewrite_input("x"))
        })
    };
    let a = slow("a1").start().await;
    let b = slow("b1").start().await;
    let server = TestServer::start(&config(
        &[("a1", &a.addr, ""), ("b1", &b.addr, "")],
        "event_budget: 400ms",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason.contains("hook `b1` failed on run_start: deadline"),
        "{}",
        r.reason
    );
    let sent = b.hook.seen.lock().unwrap()[0]
        .context
        .clone()
        .unwrap()
        .deadline_remaining_ms;
    assert!(
        sent <= 150,
        "b1 was told only the budget's remainder ({sent} ms)"
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
    // The hook's own deadline is clipped to the run deadline, so the run
    // ends at 300 ms either as timed_out or as the hook's deadline failure.
    let o = outcome(&r);
    assert!(
        o == pb::RunOutcome::TimedOut
            || (o == pb::RunOutcome::HookFailed && r.reason.contains("deadline")),
        "{o:?}: {}",
        r.reason
    );
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
    for (detach, want_calls) in [(true, 1), (false, 2)] {
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
                    &format!(
                        "failure: open\ndetach_on_failure: {detach}\nbreaker: {{failures: 0}}"
                    ),
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
            "detach_on_failure: {detach}"
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
    let server = TestServer::start(&config(
        &[(
            "flaky",
            &addr,
            "events: [run_start]\nfailure: closed\nbreaker: {failures: 2, cooldown: 300ms}",
        )],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    for _ in 0..2 {
        let r = invoke(&mut c, &s, "hi").await;
        assert!(r.reason.contains(": status:"), "{}", r.reason);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // Open: fails at once without calling the hook (still closed policy).
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
    // After the cool-down one probe goes through.
    tokio::time::sleep(std::time::Duration::from_millis(350)).await;
    let r = invoke(&mut c, &s, "hi").await;
    assert!(
        r.reason.contains(": status:"),
        "the probe reached the hook: {}",
        r.reason
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    server.stop().await;
}

#[tokio::test]
async fn observe_mode_failures_never_fail_the_run() {
    let (addr, _t) = FaultHook::new(K::RunStart, Misbehave::Status, &[])
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("obs", &addr, "mode: observe\nfailure: closed")],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
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
    server.stop().await;
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
    // A fixed port so the restarted process is reachable at the same address.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let p = port.to_string();
    let mut py = support::python::PythonHook::start_logged_on(&[
        "--port",
        &p,
        "--features",
        "redactor",
        "--simulate-latency-ms",
        "3000",
        "--log-level",
        "DEBUG",
    ])
    .await;
    let server = TestServer::start(&config(&[("py", &py.addr, "timeout: 5s")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut c2 = c.clone();
    let s2 = s.clone();
    let run = tokio::spawn(async move { invoke(&mut c2, &s2, "hello").await });
    // Kill it mid-event: once it logged receiving run_start (it then takes
    // 3 s to decide).
    let log = py.log.as_mut().unwrap();
    while let Some(line) = log.recv().await {
        if line.contains("run_start seq") {
            break;
        }
    }
    let started = std::time::Instant::now();
    py.child.start_kill().unwrap();
    let r = run.await.unwrap();
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason.contains("hook `py` failed on run_start"),
        "{}",
        r.reason
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(6),
        "failed within timeout + slack"
    );
    let _ = py.child.wait().await;

    // Restart on the same port, without latency: new runs succeed again.
    let _py2 =
        support::python::PythonHook::start_on(&["--port", &p, "--features", "redactor"]).await;
    let s = session(&mut c, "a").await;
    let mut last = None;
    for _ in 0..50 {
        let r = invoke(&mut c, &s, "hello sk-abcdefgh12345").await;
        if outcome(&r) == pb::RunOutcome::Completed {
            last = Some(r);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let r = last.expect("a run succeeds after the hook server restarted");
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
