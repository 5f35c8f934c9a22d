//! `hookwire load` (the real binary) against a real server on port 0 with a
//! real hook: the report matches what the hook saw, concurrency is bounded
//! as asked, and a run that does not complete makes the exit status 1.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use pb::EventKind as K;
use support::*;

async fn hookwire_load(addr: &str, extra: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .args(["load", "--addr", addr, "--agent", "a"])
        .args(extra)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("hookwire runs");
    (
        out.status.success(),
        String::from_utf8(out.stdout).expect("utf-8 report"),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs between their run_start and turn_end verdicts, and the most seen at
/// once. The first `gate` runs are held at run_start until all of them are
/// there, so reaching the asked concurrency does not depend on timing.
#[derive(Default)]
struct InFlight {
    now: AtomicUsize,
    max: AtomicUsize,
    arrivals: AtomicUsize,
    starts: AtomicUsize,
    gate_open: tokio::sync::Notify,
}

fn counting_hook(gate: usize) -> (FnHook, Arc<InFlight>) {
    let seen = Arc::new(InFlight::default());
    let (a, b) = (seen.clone(), seen.clone());
    let hook = FnHook::new("counter", &[K::RunStart, K::TurnEnd])
        .on_run_start(move |_, _| {
            let s = a.clone();
            async move {
                s.starts.fetch_add(1, Ordering::SeqCst);
                let now = s.now.fetch_add(1, Ordering::SeqCst) + 1;
                s.max.fetch_max(now, Ordering::SeqCst);
                let arrived = s.arrivals.fetch_add(1, Ordering::SeqCst) + 1;
                if arrived < gate {
                    let opened = s.gate_open.notified();
                    if s.arrivals.load(Ordering::SeqCst) < gate {
                        opened.await;
                    }
                } else if arrived == gate {
                    s.gate_open.notify_waiters();
                }
                Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .on_turn_end(move |_, _| {
            let s = b.clone();
            async move {
                s.now.fetch_sub(1, Ordering::SeqCst);
                Reply::new(pb::TurnEndVerdict {
                    action: Some(pb::turn_end_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        });
    (hook, seen)
}

#[tokio::test]
async fn load_reports_what_the_hook_saw_and_never_exceeds_its_concurrency() {
    const N: usize = 6;
    let (hook, seen) = counting_hook(N);
    let hook = hook.start().await;
    let server = TestServer::start(&config(&[("counter", &hook.addr, "")], "")).await;
    server.client().await;

    let (ok, stdout, stderr) = hookwire_load(
        &server.addr,
        &[
            "--concurrency",
            &N.to_string(),
            "--duration",
            "400ms",
            "--json",
        ],
    )
    .await;
    assert!(ok, "every run completed, so exit 0:\n{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("one JSON object: {e}\n{stdout}"));
    let runs = report["runs"].as_u64().unwrap();
    assert_eq!(
        runs as usize,
        seen.starts.load(Ordering::SeqCst),
        "one run in the report per run the hook saw: {report}"
    );
    assert!(runs >= N as u64, "{report}");
    assert_eq!(
        report["outcomes"]["completed"].as_u64(),
        Some(runs),
        "{report}"
    );
    assert_eq!(report["errors"], serde_json::json!({}), "{report}");
    assert_eq!(report["concurrency"].as_u64(), Some(N as u64));
    assert!(
        report["runs_per_second"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    // The time until the last run ended, drain included, and the rate over it.
    assert!(
        report["elapsed_s"].as_f64().unwrap() >= report["duration_s"].as_f64().unwrap(),
        "{report}"
    );
    let with_drain = report["runs_per_second_with_drain"].as_f64().unwrap();
    assert!(
        (with_drain - runs as f64 / report["elapsed_s"].as_f64().unwrap()).abs() < 1e-6,
        "{report}"
    );
    let l = &report["latency_ms"];
    let (p50, p99, max) = (
        l["p50"].as_f64().unwrap(),
        l["p99"].as_f64().unwrap(),
        l["max"].as_f64().unwrap(),
    );
    assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{report}");
    assert_eq!(
        seen.max.load(Ordering::SeqCst),
        N,
        "exactly --concurrency runs were in flight at the peak"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_run_that_does_not_complete_is_reported_and_exits_1() {
    let guard = FnHook::new("guard", &[K::RunStart])
        .on_run_start(|_, _| async {
            Reply::new(pb::RunStartVerdict {
                action: Some(pb::run_start_verdict::Action::Terminate(
                    hook_server::terminate("closed today", None),
                )),
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("guard", &guard.addr, "")], "")).await;
    server.client().await;
    let (ok, stdout, stderr) =
        hookwire_load(&server.addr, &["--concurrency", "2", "--duration", "200ms"]).await;
    assert!(!ok, "terminated runs: exit 1\n{stdout}\n{stderr}");
    assert!(stdout.contains("runs/s within the duration"), "{stdout}");
    assert!(stdout.contains("latency ms: p50 "), "{stdout}");
    assert!(stdout.contains("outcomes: terminated "), "{stdout}");
    assert!(stderr.contains("not every run completed"), "{stderr}");
    server.stop().await;
}

/// A run still in flight when the drain limit passes is counted
/// unfinished, and the runs its client finished before still count: they
/// were thrown away with the worker that was cut off.
#[tokio::test]
async fn runs_finished_before_one_that_outlasts_the_drain_are_reported() {
    const K: usize = 3;
    let answered = Arc::new(AtomicUsize::new(0));
    let hook = {
        let answered = answered.clone();
        FnHook::new("slow", &[K::RunStart]).on_run_start(move |_, _| {
            let n = answered.fetch_add(1, Ordering::SeqCst);
            async move {
                if n >= K {
                    // Past the drain limit (the hook's own deadline is 5 s).
                    std::future::pending::<()>().await;
                }
                Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
    }
    .start()
    .await;
    let server = TestServer::start(&config(&[("slow", &hook.addr, "")], "")).await;
    server.client().await;
    let (ok, stdout, stderr) = hookwire_load(
        &server.addr,
        &[
            "--concurrency",
            "1",
            "--duration",
            "1s",
            "--drain",
            "100ms",
            "--json",
        ],
    )
    .await;
    assert!(!ok, "an unfinished run: exit 1\n{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON report");
    assert_eq!(report["runs"], K, "{report}");
    assert_eq!(report["outcomes"]["completed"], K, "{report}");
    assert_eq!(report["unfinished"], 1, "{report}");
    server.stop().await;
}

#[tokio::test]
async fn bad_options_and_an_unreachable_server_are_clear_errors() {
    let (ok, _, stderr) = hookwire_load("http://127.0.0.1:1", &["--concurrency", "0"]).await;
    assert!(!ok);
    assert!(
        stderr.contains("--concurrency must be 1..=100000"),
        "{stderr}"
    );
    let (ok, _, stderr) = hookwire_load("http://127.0.0.1:1", &["--duration", "2h"]).await;
    assert!(!ok);
    assert!(stderr.contains("--duration must be"), "{stderr}");
    let (ok, _, stderr) = hookwire_load("http://127.0.0.1:1", &["--drain", "2h"]).await;
    assert!(!ok);
    assert!(stderr.contains("--drain must be at most 1h"), "{stderr}");
    let (ok, _, stderr) = hookwire_load("http://127.0.0.1:1", &[]).await;
    assert!(!ok);
    assert!(
        stderr.contains("cannot connect to hookwire at http://127.0.0.1:1"),
        "{stderr}"
    );
}

/// Against a server with authentication on, `hookwire load` presents the
/// token the other client commands take (`--token` / HOOKWIRE_TOKEN):
/// without it every call is refused, and the report says so.
#[tokio::test]
async fn load_presents_the_token_a_server_with_authentication_requires() {
    let tokens = support::auth::Tokens::write();
    let mut yaml = config(&[], "");
    yaml.push_str(&tokens.auth_yaml());
    let server = TestServer::start(&yaml).await;
    support::auth::client(&server.addr, Some(support::auth::ALICE)).await;
    let (ok, stdout, stderr) = hookwire_load(
        &server.addr,
        &[
            "--concurrency",
            "2",
            "--duration",
            "200ms",
            "--json",
            "--token",
            support::auth::ALICE,
        ],
    )
    .await;
    assert!(
        ok,
        "with the token every run completes:\n{stdout}\n{stderr}"
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(report["runs"].as_u64().unwrap() > 0, "{stdout}");
    let (ok, stdout, stderr) =
        hookwire_load(&server.addr, &["--concurrency", "1", "--duration", "100ms"]).await;
    assert!(!ok, "without it nothing completes:\n{stdout}\n{stderr}");
    assert!(stdout.contains("Unauthenticated"), "{stdout}\n{stderr}");
    server.stop().await;
}
