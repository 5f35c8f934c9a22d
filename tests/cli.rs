//! `hookwire run` (the real binary) against a real server: the timeline a
//! user reads, in order, and its exit status.

mod support;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use pb::EventKind as K;
use support::*;

async fn hookwire_run(addr: &str, prompt: &str) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .args(["run", "--addr", addr, "--agent", "a", prompt])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("hookwire runs");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 timeline");
    let stderr = String::from_utf8_lossy(&out.stderr);
    (
        out.status.success(),
        format!("{stdout}\n(stderr: {stderr})"),
    )
}

fn ordered(text: &str, parts: &[&str]) {
    let mut at = 0;
    for p in parts {
        match text[at..].find(p) {
            Some(i) => at += i + p.len(),
            None => panic!("`{p}` missing or out of order in:\n{text}"),
        }
    }
}

#[tokio::test]
async fn timeline_shows_verdicts_after_the_header_and_the_committed_input() {
    let redactor = FnHook::new("redactor", &[K::RunStart])
        .on_run_start(|_, ev| async move {
            Reply::new(hook_server::rewrite_input(
                ev.input.replace("hunter2", "[REDACTED]"),
            ))
            .reason("masked a password")
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("redactor", &redactor.addr, "")], "")).await;

    let (ok, out) = hookwire_run(&server.addr, "my password is hunter2").await;
    assert!(ok, "a completed run exits 0:\n{out}");
    ordered(
        &out,
        &[
            "▶ run ",
            "agent a",
            "⚑ hook redactor · run_start · rewrite_input [input] — masked a password",
            "✎ input as committed: my password is [REDACTED]",
            "── turn 1",
            "user=my password is [REDACTED]",
            "✔ completed · 1 turn(s)",
        ],
    );
    assert!(!out.contains("hunter2"), "{out}");
    server.stop().await;
}

#[tokio::test]
async fn a_run_terminated_before_it_started_still_gets_a_header_and_exits_1() {
    let guard = FnHook::new("guard", &[K::RunStart])
        .on_run_start(|_, _| async {
            Reply::new(pb::RunStartVerdict {
                action: Some(pb::run_start_verdict::Action::Terminate(
                    hook_server::terminate("off-topic", Some("Weather only, please.".into())),
                )),
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("guard", &guard.addr, "")], "")).await;

    let (ok, out) = hookwire_run(&server.addr, "tell me a joke").await;
    assert!(!ok, "a terminated run exits non-zero:\n{out}");
    ordered(
        &out,
        &[
            "▶ run ",
            "⚑ hook guard · run_start · terminate",
            "■ terminated · 0 turn(s)",
            "reply: Weather only, please.",
        ],
    );
    assert!(!out.contains("── turn"), "{out}");
    server.stop().await;
}

#[tokio::test]
async fn without_a_terminal_an_approval_is_denied_at_once() {
    let owner = weather_owner().start().await;
    // Far longer than the test may take: only an immediate answer from the
    // CLI lets the run end in time.
    let asker = asker("check the weather?", 600_000).start().await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]",
    ))
    .await;

    let (ok, out) = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        hookwire_run(&server.addr, "weather please"),
    )
    .await
    .expect("the CLI answers the approval instead of waiting for its deadline");
    assert!(ok, "{out}");
    ordered(
        &out,
        &[
            "→ #0 get_weather",
            "? hook asker asks: check the weather? — get_weather({\"city\":\"Paris\"}) denied: no terminal to ask at",
            "← #0 error:",
            "✔ completed",
        ],
    );
    assert!(
        !out.contains("⚙ #0 executing"),
        "a denied call never runs:\n{out}"
    );
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    server.stop().await;
}
