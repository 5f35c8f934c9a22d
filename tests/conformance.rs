//! `hookwire hooks check`: the example hook servers (Python and Go, as real
//! processes) pass; deliberately broken in-process servers fail with the
//! precise reason, and nothing else fails.

mod support;

use std::time::Duration;

use hookwire::conformance::{self, Options, Report, Status};
use hookwire::pb;
use hookwire::pb::EventKind as K;
use support::fault::{FaultHook, Misbehave};
use support::go::GoHook;
use support::node::NodeHook;
use support::python::PythonHook;
use support::*;

async fn check(endpoint: &str, timeout: Duration) -> Report {
    let mut opts = Options::new(endpoint);
    opts.timeout = timeout;
    conformance::check(&opts).await.expect("valid options")
}

/// Deadline for checks whose point is not timing: a well-behaved answer
/// comes in milliseconds, so no load makes one miss it, and exact failure
/// counts stay exact.
const RELAXED: Duration = Duration::from_secs(30);

fn failures(r: &Report) -> Vec<(String, String, String)> {
    r.failures()
        .map(|f| (f.subject.clone(), f.check.clone(), f.reason.clone()))
        .collect()
}

/// Exactly one check failed: `subject`/`check`, with a reason starting so.
fn fails_only(r: &Report, subject: &str, check: &str, reason: &str) {
    let f = failures(r);
    assert_eq!(f.len(), 1, "{}", r.table());
    assert_eq!(
        (f[0].0.as_str(), f[0].1.as_str()),
        (subject, check),
        "{}",
        r.table()
    );
    assert!(f[0].2.starts_with(reason), "{}", r.table());
}

/// Every stand-in tool's tool_call failed `check` with a reason starting so,
/// and nothing else failed (a fault on tool_call hits each call).
fn fails_on_every_tool_call(r: &Report, check: &str, reason: &str) {
    let f = failures(r);
    let subjects: Vec<String> = conformance::script::STAND_INS
        .iter()
        .map(|t| format!("tool_call {t}"))
        .collect();
    assert_eq!(
        f.iter().map(|f| f.0.clone()).collect::<Vec<_>>(),
        subjects,
        "{}",
        r.table()
    );
    for (_, c, why) in &f {
        assert_eq!(c, check, "{}", r.table());
        assert!(why.starts_with(reason), "{}", r.table());
    }
}

/// Runs the real binary, as a hook author would.
async fn cli(args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .args(args)
        .output()
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn the_python_example_passes() {
    let py = PythonHook::start(&[]).await;
    let r = check(&py.addr, RELAXED).await;
    assert!(r.passed(), "{}", r.table());
    assert_eq!(r.count(Status::Skip), 0, "{}", r.table());
    // Its redactor acted on the scripted input and on the customer record,
    // and both owned tools were called with arguments from their schemas.
    assert!(r
        .row("run_start", "verdict")
        .unwrap()
        .reason
        .starts_with("rewrite_input"));
    assert!(r
        .row("tool_result lookup_customer", "verdict")
        .unwrap()
        .reason
        .starts_with("rewrite_result"));
    assert!(r
        .row("tool lookup_customer", "arguments")
        .unwrap()
        .reason
        .contains("C-1001"));
    assert!(r
        .row("tool get_weather", "CallTool")
        .unwrap()
        .reason
        .contains("in Paris"));
    assert_eq!(
        r.row("run stream", "closes cleanly").unwrap().status,
        Status::Pass
    );

    // The command line: a table, exit status 0; --json for scripts.
    let (ok, out, err) = cli(&["hooks", "check", &py.addr]).await;
    assert!(ok, "{out}{err}");
    assert!(out.contains("hookwire-example-python"), "{out}");
    assert!(out.contains(" 0 failed"), "{out}");
    let (ok, out, _) = cli(&[
        "hooks",
        "check",
        &py.addr,
        "--json",
        "--events",
        "run_start",
    ])
    .await;
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["passed"], true);
    assert_eq!(v["server"]["events"], serde_json::json!(["run_start"]));
}

#[tokio::test]
async fn the_go_example_passes_every_event() {
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit.jsonl");
    let go = GoHook::start(&["--audit-log", audit.to_str().unwrap()]).await;
    let r = check(&go.addr, RELAXED).await;
    assert!(r.passed(), "{}", r.table());
    let server = r.server.as_ref().unwrap();
    assert_eq!(server.events.len(), 11, "it audits all eleven events");
    assert_eq!(server.tools, ["word_count"]);
    for subject in ["session_start stream", "run stream", "session_end stream"] {
        assert_eq!(
            r.row(subject, "closes cleanly").map(|r| r.status),
            Some(Status::Pass),
            "{}",
            r.table()
        );
    }
    assert_eq!(
        r.row("text_delta #1", "no verdict").unwrap().status,
        Status::Pass
    );
    assert_eq!(
        r.row("invalid_tool_call no_such_tool", "verdict")
            .unwrap()
            .status,
        Status::Pass
    );
    // The audit log saw the scripted run: one line per event sent.
    let lines = std::fs::read_to_string(&audit).unwrap();
    for kind in [
        "\"session_start\"",
        "\"text_delta\"",
        "\"run_end\"",
        "\"session_end\"",
    ] {
        assert!(
            lines.contains(kind),
            "{kind} missing from the audit log:\n{lines}"
        );
    }
}

#[tokio::test]
async fn the_go_example_without_events_only_owns_a_tool() {
    let go = GoHook::start(&[]).await;
    let r = check(&go.addr, RELAXED).await;
    assert!(r.passed(), "{}", r.table());
    assert_eq!(
        r.row("tool word_count", "CallTool").unwrap().status,
        Status::Pass
    );
    assert_eq!(r.row("run stream", "opens").unwrap().status, Status::Skip);
}

async fn fault(on: K, how: Misbehave, also: &[K]) -> String {
    FaultHook::new(on, how, also).start().await.0
}

#[tokio::test]
async fn a_wrong_kind_verdict_fails() {
    let addr = fault(K::ToolCall, Misbehave::WrongKind, &[K::RunStart]).await;
    let r = check(&addr, RELAXED).await;
    fails_on_every_tool_call(
        &r,
        "verdict",
        "wrong_kind: answered a run_start verdict to a tool_call event",
    );
}

#[tokio::test]
async fn a_late_verdict_fails() {
    // The deadline sent is 2 s; the hook starts its 3 s wait only once it
    // received the event, so its answer is late whatever the load. The
    // checker keeps listening 30 s past the deadline, so it sees it come.
    let addr = fault(K::RunStart, Misbehave::Late(Duration::from_secs(3)), &[]).await;
    let mut opts = Options::new(addr.as_str());
    opts.timeout = Duration::from_secs(2);
    opts.grace = Some(Duration::from_secs(30));
    let r = conformance::check(&opts).await.unwrap();
    fails_only(
        &r,
        "run_start",
        "answered in time",
        "deadline: verdict for seq 1 came after",
    );
    assert!(r
        .row("run_start", "answered in time")
        .unwrap()
        .reason
        .contains("past the 2000 ms deadline"));
}

#[tokio::test]
async fn no_verdict_fails_within_a_bounded_wait() {
    // 2 s deadline, 1 s grace: run_start (answered at once) is in time
    // whatever the load; the hung turn_end is reported after 3 s, far
    // inside the bound only a checker waiting forever crosses.
    let addr = fault(K::TurnEnd, Misbehave::Hang, &[K::RunStart]).await;
    let mut opts = Options::new(addr.as_str());
    opts.timeout = Duration::from_secs(2);
    opts.grace = Some(Duration::from_secs(1));
    let r = tokio::time::timeout(RELAXED, conformance::check(&opts))
        .await
        .expect("the checker gives up on a missing verdict")
        .unwrap();
    fails_only(
        &r,
        "turn_end",
        "answered in time",
        "deadline: no verdict for seq 2",
    );
}

#[tokio::test]
async fn a_duplicate_verdict_fails() {
    // It answers every model_request twice; turn 1's is seq 1 on the run
    // stream, turn 2's seq 2.
    let addr = fault(K::ModelRequest, Misbehave::Duplicate, &[]).await;
    let r = check(&addr, RELAXED).await;
    assert_eq!(
        failures(&r),
        [1, 2].map(|seq| (
            format!("model_request (turn {seq})"),
            "one verdict".to_string(),
            format!("duplicate: 2 verdicts for seq {seq}")
        )),
        "{}",
        r.table()
    );
}

#[tokio::test]
async fn a_verdict_for_a_seq_never_sent_fails() {
    let addr = fault(K::RunStart, Misbehave::Spurious, &[]).await;
    let r = check(&addr, RELAXED).await;
    fails_only(
        &r,
        "run stream",
        "verdict seqs",
        "spurious: verdict for seq 1001, which was never sent",
    );
}

#[tokio::test]
async fn invalid_json_arguments_fail() {
    let addr = fault(K::ToolCall, Misbehave::Invalid, &[]).await;
    let r = check(&addr, RELAXED).await;
    fails_on_every_tool_call(
        &r,
        "verdict",
        "invalid_verdict: rewrite_args.arguments_json is not valid JSON",
    );
}

#[tokio::test]
async fn answering_an_observe_only_event_fails() {
    let addr = fault(K::RunEnd, Misbehave::AnswerObserve, &[K::RunStart]).await;
    let r = check(&addr, RELAXED).await;
    fails_only(
        &r,
        "run_end",
        "no verdict",
        "spurious: answered run_end (seq 2), which expects no verdict",
    );
}

#[tokio::test]
async fn a_refused_stream_fails() {
    let addr = fault(K::RunStart, Misbehave::RefuseStream, &[]).await;
    let r = check(&addr, RELAXED).await;
    fails_only(&r, "run stream", "opens", "stream_refused: Unimplemented");
}

#[tokio::test]
async fn a_tool_that_errors_on_valid_arguments_fails() {
    let hook = FnHook::new("broken-tool", &[])
        .with_tool(weather_tool(), |_, _| async {
            pb::CallToolResponse {
                content: "weather service unavailable".into(),
                is_error: true,
            }
        })
        .start()
        .await;
    let r = check(&hook.addr, RELAXED).await;
    fails_only(
        &r,
        "tool get_weather",
        "CallTool",
        r#"is_error result for valid arguments {"city":"hookwire conformance check"}: weather service unavailable"#,
    );
    // The tool got exactly those arguments.
    let calls = hook.hook.tool_calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        calls[0].arguments_json,
        r#"{"city":"hookwire conformance check"}"#
    );

    // --tool-args replaces the derived arguments.
    let mut opts = Options::new(hook.addr.as_str());
    opts.tool_args
        .insert("get_weather".into(), r#"{"city":"Oslo"}"#.into());
    let r = conformance::check(&opts).await.unwrap();
    assert!(r
        .row("tool get_weather", "arguments")
        .unwrap()
        .reason
        .contains("Oslo"));
}

#[tokio::test]
async fn the_cli_exits_non_zero_and_says_why() {
    let addr = fault(K::ToolCall, Misbehave::WrongKind, &[]).await;
    let (ok, out, err) = cli(&["hooks", "check", &addr, "--timeout", "30s"]).await;
    assert!(!ok);
    assert!(
        out.lines().any(|l| l.contains("FAIL")
            && l.contains("wrong_kind: answered a run_start verdict to a tool_call event")),
        "{out}"
    );
    assert!(err.contains("error: 3 of"), "one per tool_call: {err}");

    // An endpoint nobody listens on (port 1: privileged, and never handed
    // out for port 0): one clear row naming it, no hang.
    let (ok, out, _) = cli(&["hooks", "check", "127.0.0.1:1"]).await;
    assert!(!ok);
    assert!(out.contains("http://127.0.0.1:1: connect:"), "{out}");

    // Bad flags are usage errors with the nearest event name.
    let (ok, _, err) = cli(&["hooks", "check", &addr, "--events", "tool_cal"]).await;
    assert!(!ok);
    assert!(err.contains("did you mean `tool_call`"), "{err}");
}

#[tokio::test]
async fn tools_the_server_does_not_own_are_offered_and_its_policy_exercised() {
    // The Python example's policy denies delete_file and asks approval for
    // send_email; it owns neither, so only offering other tools shows it.
    let py = PythonHook::start(&[]).await;
    let r = check(&py.addr, RELAXED).await;
    assert!(r.passed(), "{}", r.table());
    let reason = |subject: &str, check: &str| {
        r.row(subject, check)
            .unwrap_or_else(|| panic!("no {subject}/{check}:\n{}", r.table()))
            .reason
            .clone()
    };
    assert!(
        reason("model_request (turn 1)", "verdict")
            .starts_with("patch_request — hid denied tools: delete_file"),
        "{}",
        r.table()
    );
    assert!(
        reason("tool_call delete_file", "verdict").starts_with("skip"),
        "{}",
        r.table()
    );
    assert!(
        reason("tool_call send_email", "verdict").starts_with("ask \"")
            && reason("tool_call send_email", "verdict")
                .contains("(approved by the checker, as a client would)"),
        "{}",
        r.table()
    );
    assert!(reason("tool_call lookup_order", "verdict").starts_with("continue"));
    // Skipped: its result came from the hook, so no tool_result event; an
    // approved call goes on to its tool_result.
    assert!(
        r.row("tool_result delete_file", "verdict").is_none(),
        "{}",
        r.table()
    );
    assert!(
        r.row("tool_result send_email", "verdict").is_some(),
        "{}",
        r.table()
    );
    // Five tool calls (two owned, three stand-ins) in flight at once.
    assert_eq!(
        reason("run stream", "concurrent events"),
        "5 tool_call events in flight at once, each answered once by its own seq"
    );
}

#[tokio::test]
async fn a_server_not_ready_for_concurrent_events_fails() {
    let n = conformance::script::STAND_INS.len();
    let addr = fault(K::ToolCall, Misbehave::LatestSeq(n), &[]).await;
    // Two verdicts never come, so the checker waits out their deadline: a
    // short one. Only the concurrency row is asserted, not a failure count.
    let r = check(&addr, Duration::from_secs(2)).await;
    let row = r.row("run stream", "concurrent events").unwrap();
    assert_eq!(row.status, Status::Fail, "{}", r.table());
    assert!(
        row.reason
            .contains("seq 1 got no verdict, seq 2 got no verdict, seq 3 got 3 verdicts"),
        "{}",
        r.table()
    );
    assert!(
        row.reason.contains("answer each by its own seq"),
        "{}",
        row.reason
    );
}

#[tokio::test]
async fn an_ask_verdict_is_exercised_and_the_call_goes_on() {
    let hook = asker("send it?", 0).start().await;
    let r = check(&hook.addr, RELAXED).await;
    assert!(r.passed(), "{}", r.table());
    for t in conformance::script::STAND_INS {
        let v = r.row(&format!("tool_call {t}"), "verdict").unwrap();
        assert_eq!(
            v.reason,
            "ask \"send it?\" (approved by the checker, as a client would)",
            "{}",
            r.table()
        );
    }
    // The asker saw every stand-in tool's call.
    let seen = hook.hook.seen_kinds();
    assert_eq!(
        seen.iter().filter(|k| *k == "tool_call").count(),
        3,
        "{seen:?}"
    );
}

#[tokio::test]
async fn tool_call_events_are_in_flight_together_as_with_tool_concurrency() {
    // Each tool_call is answered only once all of them have arrived: a
    // checker that awaited each verdict before sending the next event would
    // never see an answer.
    let n = conformance::script::STAND_INS.len();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let hook = FnHook::new("barrier", &[K::ToolCall])
        .on_tool_call(move |_, _| {
            let barrier = barrier.clone();
            async move {
                barrier.wait().await;
                hookwire::hook_server::Reply::new(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let r = check(&hook.addr, RELAXED).await;
    assert!(r.passed(), "{}", r.table());
    assert_eq!(
        r.row("run stream", "concurrent events").unwrap().reason,
        "3 tool_call events in flight at once, each answered once by its own seq"
    );
}

#[tokio::test]
async fn the_node_example_passes() {
    let node = NodeHook::start().await;
    let r = check(&node.addr, RELAXED).await;
    assert!(r.passed(), "{}", r.table());
    assert_eq!(r.count(Status::Skip), 0, "health is served: {}", r.table());
    let reason = |subject: &str, check: &str| r.row(subject, check).unwrap().reason.clone();
    assert!(reason("run_start", "verdict").starts_with("rewrite_input — redacted 1 email"));
    assert!(reason("tool convert_temperature", "CallTool").contains("21°C is 69.8°F"));
    assert!(reason("tool_call delete_file", "verdict").starts_with("skip"));
    assert!(reason("tool_call send_email", "verdict").starts_with("ask"));
    assert!(reason("run stream", "concurrent events").starts_with("4 tool_call events"));
    assert_eq!(
        r.row("run stream", "closes cleanly").unwrap().status,
        Status::Pass
    );
}

#[tokio::test]
async fn a_node_server_loading_the_proto_with_default_options_is_told_why() {
    // proto-loader's defaults turn field names into camelCase, so a verdict
    // written with the proto's names arrives empty.
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/support/node/default_options.js"
    );
    let node = NodeHook::script(script, &[]).await;
    let r = check(&node.addr, RELAXED).await;
    fails_only(
        &r,
        "run_start",
        "verdict",
        "invalid_verdict: verdict has no typed verdict field set (expected `run_start`)",
    );
    let reason = &r.row("run_start", "verdict").unwrap().reason;
    assert!(reason.contains("keepCase: true"), "{reason}");
    assert!(reason.contains("docs/writing-hooks.md"), "{reason}");
}

/// A patch hookwire accepts alone, but that leaves a request the model
/// cannot be called with (the tool it must call is not offered): hookwire
/// fails every run with it, whatever the hook's `failure:`, so the check
/// fails it too. It used to pass.
#[tokio::test]
async fn a_patch_that_leaves_an_invalid_request_fails() {
    let hook = FnHook::new("chooser", &[K::ModelRequest])
        .on_model_request(|_, _| async {
            hookwire::hook_server::Reply::new(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::PatchRequest(
                    pb::RequestPatch {
                        tool_choice: Some(pb::ToolChoice {
                            mode: pb::tool_choice::Mode::Tool as i32,
                            tool_name: "web_search".into(),
                        }),
                        ..Default::default()
                    },
                )),
            })
        })
        .start()
        .await;
    let r = check(&hook.addr, RELAXED).await;
    let f = failures(&r);
    assert!(!f.is_empty(), "{}", r.table());
    for (subject, check, why) in &f {
        assert!(subject.starts_with("model_request"), "{}", r.table());
        assert_eq!(check, "verdict", "{}", r.table());
        assert!(
            why.contains("the patched request cannot be sent") && why.contains("web_search"),
            "{}",
            r.table()
        );
    }
}

/// Rewritten arguments the tool's schema refuses: hookwire takes the
/// verdict as invalid (the rewritten call would reach CallTool unchecked),
/// so the check fails it. It used to pass.
#[tokio::test]
async fn rewrite_args_the_tools_schema_refuses_fail() {
    let hook = FnHook::new("rewriter", &[K::ToolCall])
        .on_tool_call(|_, _| async {
            hookwire::hook_server::Reply::new(pb::ToolCallVerdict {
                action: Some(pb::tool_call_verdict::Action::RewriteArgs(
                    pb::RewriteArgs {
                        arguments_json: r#"{"file":"x"}"#.into(),
                    },
                )),
            })
        })
        .start()
        .await;
    let r = check(&hook.addr, RELAXED).await;
    fails_on_every_tool_call(&r, "verdict", "invalid_verdict: rewrite_args");
}

/// A server that ends its side of the run's stream right after its last
/// verdict, with run_end still to come: hookwire takes that as a broken
/// stream (run_end is never read). The end sat in the checker's queue
/// until it half-closed, and was taken for a clean one.
#[tokio::test]
async fn a_stream_ended_before_the_run_was_over_does_not_close_cleanly() {
    let addr = fault(K::TurnEnd, Misbehave::AnswerThenEnd, &[K::RunEnd]).await;
    let r = check(&addr, RELAXED).await;
    let row = r.row("run stream", "closes cleanly").unwrap();
    assert_eq!(row.status, Status::Fail, "{}", r.table());
    assert!(
        row.reason.contains("before hookwire half-closed it"),
        "{}",
        r.table()
    );
}

/// Scratchpad updates that each fit, but together overflow the run's
/// scratchpad (1 MiB, keys plus values): hookwire refuses the verdict that
/// overflows it (invalid_verdict), so the check fails it. Each verdict was
/// judged alone before, and passed.
#[tokio::test]
async fn scratchpad_updates_over_the_runs_total_fail() {
    const HALF: usize = 600 * 1024;
    let hook = FnHook::new("hoarder", &[K::RunStart, K::ModelRequest])
        .on_run_start(|_, _| async {
            hookwire::hook_server::Reply::new(pb::RunStartVerdict {
                action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
            })
            .set("first", vec![b'a'; HALF])
        })
        .on_model_request(|_, _| async {
            hookwire::hook_server::Reply::new(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {})),
            })
            .set("second", vec![b'b'; HALF])
        })
        .start()
        .await;
    let r = check(&hook.addr, RELAXED).await;
    let f = failures(&r);
    assert!(!f.is_empty(), "{}", r.table());
    for (subject, check, why) in &f {
        assert!(subject.starts_with("model_request"), "{}", r.table());
        assert_eq!(check, "verdict", "{}", r.table());
        assert!(
            why.starts_with("invalid_verdict: scratchpad updates would make the run's scratchpad")
                && why.contains("over the 1048576 byte limit"),
            "{}",
            r.table()
        );
    }
    assert_eq!(
        r.row("run_start", "verdict").unwrap().status,
        Status::Pass,
        "{}",
        r.table()
    );
}
