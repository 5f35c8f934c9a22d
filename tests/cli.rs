//! `hookwire run` (the real binary) against a real server: the timeline a
//! user reads, in order, and its exit status.

mod support;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use pb::EventKind as K;
use support::*;

async fn hookwire_run(addr: &str, prompt: &str) -> (bool, String) {
    hookwire_run_with(addr, &[], prompt).await
}

async fn hookwire_run_with(addr: &str, flags: &[&str], prompt: &str) -> (bool, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .args(["run", "--addr", addr, "--agent", "a"])
        .args(flags)
        .arg(prompt)
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
            "agent a",
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

#[tokio::test]
async fn a_failed_run_start_keeps_the_header_and_says_the_cause_once() {
    // Bind then drop: nothing listens there.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let server = TestServer::start(&config(&[("guard", &dead, "events: [run_start]")], "")).await;

    let (ok, out) = hookwire_run(&server.addr, "hello").await;
    assert!(!ok, "{out}");
    ordered(
        &out,
        &[
            "▶ run ",
            "agent a",
            "■ hook_failed · 0 turn(s)",
            "reason: hook `guard` failed on run_start: connect: ",
        ],
    );
    assert_eq!(out.matches("tcp connect error").count(), 1, "{out}");
    assert!(!out.contains("transport error"), "{out}");
    server.stop().await;
}

#[tokio::test]
async fn a_rewrite_that_changes_nothing_is_not_reported() {
    // Answers rewrite_input on every run, whether or not it found anything.
    let redactor = FnHook::new("redactor", &[K::RunStart])
        .on_run_start(|_, ev| async move {
            Reply::new(hook_server::rewrite_input(
                ev.input.replace("hunter2", "[REDACTED]"),
            ))
            .reason("redactor ran")
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("redactor", &redactor.addr, "")], "")).await;

    let (ok, out) = hookwire_run(&server.addr, "nothing secret here").await;
    assert!(ok, "{out}");
    assert!(!out.contains("⚑"), "no verdict changed anything:\n{out}");
    assert!(!out.contains("✎"), "the input stands as typed:\n{out}");

    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "nothing secret here").await;
    assert!(verdicts(&events).is_empty(), "{events:?}");
    assert!(result_of(&events).hook_verdicts.is_empty());
    // A real change still is.
    let events = run_events(&mut c, &s, "my password is hunter2").await;
    let v = verdicts(&events);
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(v[0].verdict_kind(), pb::VerdictKind::RewriteInput);
    assert_eq!(v[0].fields_changed, ["input"]);
    server.stop().await;
}

#[tokio::test]
async fn started_is_the_first_event_and_the_committed_input_follows_the_verdicts() {
    let redactor = FnHook::new("redactor", &[K::RunStart])
        .on_run_start(|_, ev| async move {
            Reply::new(hook_server::rewrite_input(
                ev.input.replace("hunter2", "[REDACTED]"),
            ))
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("redactor", &redactor.addr, "")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "my password is hunter2").await;
    use pb::run_event::Event as E;
    let kinds: Vec<&str> = events
        .iter()
        .take(4)
        .map(|e| match &e.event {
            Some(E::Started(_)) => "started",
            Some(E::HookVerdict(_)) => "hook_verdict",
            Some(E::InputCommitted(_)) => "input_committed",
            Some(E::TurnStarted(_)) => "turn_started",
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        ["started", "hook_verdict", "input_committed", "turn_started"]
    );
    let Some(E::Started(st)) = &events[0].event else {
        panic!()
    };
    assert_eq!(
        (st.session_id.as_str(), st.agent.as_str()),
        (s.as_str(), "a")
    );
    let Some(E::InputCommitted(ic)) = &events[2].event else {
        panic!()
    };
    assert_eq!(ic.input, "my password is [REDACTED]");
    assert!(ic.rewritten);
    server.stop().await;
}

#[tokio::test]
async fn json_lines_use_the_canonical_protobuf_json_mapping() {
    let redactor = FnHook::new("redactor", &[K::RunStart])
        .on_run_start(|_, ev| async move {
            Reply::new(hook_server::rewrite_input(
                ev.input.replace("hunter2", "[REDACTED]"),
            ))
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("redactor", &redactor.addr, "")], "")).await;
    let (ok, out) = hookwire_run_with(&server.addr, &["--json"], "my password is hunter2").await;
    assert!(ok, "{out}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .take_while(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    // As grpcurl / buf curl print them: lowerCamelCase names, the oneof's
    // field by its own name, enum names, 64-bit integers as strings.
    assert_eq!(lines[0]["seq"], "1");
    assert!(lines[0]["runId"].is_string(), "{}", lines[0]);
    assert_eq!(lines[0]["started"]["agent"], "a");
    let verdict = &lines[1]["hookVerdict"];
    assert_eq!(verdict["event"], "EVENT_KIND_RUN_START");
    assert_eq!(verdict["verdictKind"], "VERDICT_KIND_REWRITE_INPUT");
    assert_eq!(verdict["fieldsChanged"], serde_json::json!(["input"]));
    assert_eq!(lines[2]["inputCommitted"]["rewritten"], true);
    let last = lines.last().unwrap();
    let result = &last["finished"]["result"];
    assert_eq!(result["outcome"], "RUN_OUTCOME_COMPLETED");
    assert!(result["usage"]["inputTokens"].is_string(), "{result}");
    assert_eq!(result["finishReason"], "stop");
    assert!(
        !out.contains("\"event\":{"),
        "no wrapper object around the oneof:\n{out}"
    );
    server.stop().await;
}

/// `hookwire sessions list | head -1`: the reader leaves before the list is
/// written. println! panicked on the closed pipe (exit 101, a panic
/// message); the command ends quietly, as `run --json | head` does.
#[tokio::test]
async fn a_listing_whose_reader_left_ends_quietly() {
    let server = TestServer::start(&config(&[], "")).await;
    let mut c = server.client().await;
    session(&mut c, "a").await;
    for args in [
        vec!["sessions", "list", "--addr", &server.addr],
        vec!["hooks", "list", "--addr", &server.addr],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        // The reader is gone before the command has connected.
        drop(reader);
        // spawn, not output(): output() would capture stdout itself.
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("hookwire runs")
            .wait_with_output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?}\n{stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    server.stop().await;
}
