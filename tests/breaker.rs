//! The circuit breaker recovers when the hook server does: while it is open
//! hookwire probes the server in the background and closes it as soon as the
//! server answers, instead of failing every run for the whole cool-down.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hookwire::hook_server::{self, Ctx, Hook, Reply};
use hookwire::pb;
use hookwire::pb::agent_service_client::AgentServiceClient;
use support::*;
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// A hook that proceeds on run_start and counts the Describe calls it got.
#[derive(Clone, Default)]
struct Counted {
    describes: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl Hook for Counted {
    fn describe(&self) -> pb::DescribeResponse {
        self.describes.fetch_add(1, Ordering::SeqCst);
        hook_server::describe("flaky", &[pb::EventKind::RunStart])
    }
}

/// A hook server with a runtime of its own on its own thread, so that
/// killing it drops every connection at once, as a killed process would
/// (an in-process server's connection tasks would otherwise outlive it).
struct HookProcess {
    kill: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HookProcess {
    fn start(port: u16, hook: Counted) -> HookProcess {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (kill, killed) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
                    .await
                    .expect("the hook's port is free again");
                ready_tx.send(()).unwrap();
                tokio::select! {
                    _ = hook_server::serve(hook, listener, std::future::pending()) => {}
                    _ = killed => {}
                }
            });
            // Drops every connection task without a goodbye.
            rt.shutdown_background();
        });
        ready_rx.recv().expect("the hook server started");
        HookProcess {
            kill: Some(kill),
            thread: Some(thread),
        }
    }

    fn kill(mut self) {
        let _ = self.kill.take().unwrap().send(());
        self.thread.take().unwrap().join().unwrap();
    }
}

/// Runs `runs` sessions concurrently, each invoking until `done` holds for
/// one of its results; returns how long each took.
async fn until_each(
    c: &AgentServiceClient<Channel>,
    sessions: &[String],
    done: fn(&pb::RunResult) -> bool,
) -> Vec<Duration> {
    let started = Instant::now();
    let runners = sessions.iter().map(|s| {
        let (mut c, s) = (c.clone(), s.clone());
        async move {
            loop {
                let r = invoke(&mut c, &s, "hello").await;
                if done(&r) {
                    return started.elapsed();
                }
                tokio::task::yield_now().await;
            }
        }
    });
    // A safety net only: without background probing nothing recovers
    // before the 60 s cool-down, so this fails instead of hanging.
    tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(runners))
        .await
        .expect("every runner got there")
}

#[tokio::test]
async fn runs_succeed_again_soon_after_a_killed_hook_server_returns() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let hook = Counted::default();
    let first = HookProcess::start(port, hook.clone());
    let server = TestServer::start(&config(
        &[(
            "flaky",
            &format!("http://127.0.0.1:{port}"),
            "events: [run_start]\nfailure: closed\ntimeout: 2s\nbreaker: {failures: 3, cooldown: 60s}",
        )],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let mut sessions = Vec::new();
    for _ in 0..8 {
        sessions.push(session(&mut c, "a").await);
    }
    let r = invoke(&mut c, &sessions[0], "hello").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);

    // Killed: runs fail closed, then the breaker opens and they fail at once.
    first.kill();
    until_each(&c, &sessions, |r| r.reason.contains("circuit_open")).await;
    let hooks = c.list_hooks(pb::ListHooksRequest {}).await.unwrap();
    assert_eq!(hooks.into_inner().hooks[0].state, "circuit_open");

    // Back on the same port: the background probe sees it answer Describe
    // and closes the breaker long before the 60 s cool-down.
    let before = hook.describes.load(Ordering::SeqCst);
    let _second = HookProcess::start(port, hook.clone());
    let recovered = until_each(&c, &sessions, |r| outcome(r) == pb::RunOutcome::Completed).await;
    let slowest = recovered.iter().max().unwrap();
    println!("every runner succeeded within {slowest:?} of the restart: {recovered:?}");
    assert!(
        hook.describes.load(Ordering::SeqCst) > before,
        "recovered through a Describe probe"
    );
    assert!(
        *slowest < Duration::from_secs(2),
        "runs succeed again within 2 s of the restart: {recovered:?}"
    );
    let hooks = c.list_hooks(pb::ListHooksRequest {}).await.unwrap();
    assert_eq!(hooks.into_inner().hooks[0].state, "connected");
    server.stop().await;
}

/// A hook server whose Describe answers while its run_start handler hangs
/// (a stuck policy backend behind a healthy process), counting the
/// run_start calls it got.
#[derive(Clone, Default)]
struct DescribesButHangs {
    calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl Hook for DescribesButHangs {
    fn describe(&self) -> pb::DescribeResponse {
        hook_server::describe("hangs", &[pb::EventKind::RunStart])
    }
    async fn run_start(&self, _: &Ctx, _: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// A Describe answer closes the breaker on probation, where one call at a
/// time goes through; when that call fails too, the breaker stays open for
/// its whole cool-down, whatever Describe says. Closed outright instead,
/// every event during probation called the hook, and the background probe
/// closed it again ~100 ms after each failure: a hook whose Process hangs
/// while Describe answers was called at every probe, its cool-down gone.
#[tokio::test]
async fn a_hook_that_answers_describe_but_hangs_is_called_once_on_probation() {
    let (logs, _guard) = support::logwatch::LogWatch::install("info");
    let hook = DescribesButHangs::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let _hook_server = tokio::spawn(hook_server::serve(
        hook.clone(),
        listener,
        std::future::pending(),
    ));
    let server = TestServer::start(&config(
        &[(
            "hangs",
            &format!("http://{addr}"),
            "events: [run_start]\nfailure: closed\ntimeout: 300ms\nbreaker: {failures: 1, cooldown: 60s}",
        )],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let mut sessions = Vec::new();
    for _ in 0..3 {
        sessions.push(session(&mut c, "a").await);
    }
    let calls = || hook.calls.load(Ordering::SeqCst);

    // The hook hangs: the run fails at its deadline and the breaker opens.
    let r = invoke(&mut c, &sessions[0], "hello").await;
    assert!(r.reason.contains("deadline"), "{}", r.reason);
    assert_eq!(calls(), 1);
    // Describe answers the background probe: closed on probation.
    bounded(
        "the probe to close the breaker",
        logs.wait_for(&["hook server answers again", "hook=hangs"]),
    )
    .await;

    // Three runs at once: one is the call on probation, the others are
    // not let through while it is in flight.
    let runs = sessions.iter().map(|s| {
        let (mut c, s) = (c.clone(), s.clone());
        async move { invoke(&mut c, &s, "hello").await }
    });
    let results = futures::future::join_all(runs).await;
    let reasons: Vec<&str> = results.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(calls(), 2, "one call on probation: {reasons:#?}");
    assert_eq!(
        reasons
            .iter()
            .filter(|r| r.contains("circuit_open"))
            .count(),
        2,
        "{reasons:#?}"
    );

    // That call failed: Describe still answers the next probe, but the
    // breaker stays open for its cool-down.
    bounded(
        "the probe after the failed call",
        logs.wait_for(&["stays open for its cool-down", "hook=hangs"]),
    )
    .await;
    for s in &sessions {
        let r = invoke(&mut c, s, "hello").await;
        assert!(r.reason.contains("circuit_open"), "{}", r.reason);
    }
    assert_eq!(calls(), 2, "not called again before the cool-down ends");
    server.stop().await;
}
