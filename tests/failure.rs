//! Fail closed with no holes: every failure class x every blocking run event
//! x {closed, open}, against real misbehaving hook servers.
//!
//! The matrix is [`CLASSES`] x [`EVENTS`]; docs/failure-matrix.md is
//! rendered from the outcomes this test observed and must equal the
//! published file, so the table cannot drift from what runs. To add a row,
//! add it to `CLASSES` and regenerate the docs:
//! `HOOKWIRE_WRITE_MATRIX=1 cargo test --test failure`.

mod support;

#[path = "support/otlp.rs"]
mod otlp;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use hookwire::hook_server::Reply;
use hookwire::pb;
use pb::EventKind as K;
use support::fault::{FaultHook, Misbehave};
use support::*;

const EVENTS: [K; 7] = [
    K::RunStart,
    K::ModelRequest,
    K::ModelResponse,
    K::InvalidToolCall,
    K::ToolCall,
    K::ToolResult,
    K::TurnEnd,
];

#[derive(Clone, Copy, Debug)]
enum Case {
    Fault(Misbehave),
    Connect,
    /// https:// to a plaintext hook server: the TLS handshake fails.
    Tls,
}

/// The matrix's rows, in published order: the row's label, and the case.
const CLASSES: &[(&str, Case)] = &[
    ("connect", Case::Connect),
    ("tls", Case::Tls),
    ("stream_refused", Case::Fault(Misbehave::RefuseStream)),
    ("deadline (no verdict)", Case::Fault(Misbehave::Hang)),
    (
        "late (verdict after deadline)",
        Case::Fault(Misbehave::Late(Duration::from_millis(600))),
    ),
    ("stream_reset", Case::Fault(Misbehave::CloseStream)),
    ("status", Case::Fault(Misbehave::Status)),
    ("wrong_kind", Case::Fault(Misbehave::WrongKind)),
    ("invalid_verdict", Case::Fault(Misbehave::Invalid)),
    ("duplicate", Case::Fault(Misbehave::Duplicate)),
    ("spurious", Case::Fault(Misbehave::Spurious)),
    ("unsubscribed", Case::Fault(Misbehave::Unsubscribed)),
];

const MATRIX_DOC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/failure-matrix.md");

impl Case {
    fn class(self) -> &'static str {
        match self {
            Case::Fault(m) => m.class(),
            Case::Connect => "connect",
            Case::Tls => "tls",
        }
    }
    /// Classes that need a short per-call timeout to happen at all.
    fn timing(self) -> bool {
        matches!(self, Case::Fault(Misbehave::Hang | Misbehave::Late(_)))
    }
}

fn name(k: K) -> String {
    k.as_str_name()
        .trim_start_matches("EVENT_KIND_")
        .to_lowercase()
}

struct Cell {
    row: &'static str,
    case: Case,
    event: K,
    closed: bool,
    outcome: pb::RunOutcome,
    detail: String,
    session: String,
    surfaced: K,
}

async fn cell(row: &'static str, case: Case, event: K, closed: bool) -> Cell {
    let duplicate = matches!(case, Case::Fault(Misbehave::Duplicate));
    // A duplicate is only detectable once it arrived: it stops the run at
    // the next step, or at the latest at the hook's next blocking event
    // (here: the next model_request), named after the duplicated event.
    let also: Vec<K> = if duplicate && event != K::ModelRequest {
        vec![K::ModelRequest]
    } else {
        vec![]
    };
    let mut _fault_task = None;
    let endpoint = match case {
        Case::Fault(how) => {
            let (addr, task) = FaultHook::new(event, how, &also).start().await;
            _fault_task = Some(task);
            addr
        }
        Case::Connect => "http://127.0.0.1:1".to_string(),
        Case::Tls => {
            let (addr, task) = FaultHook::new(event, Misbehave::WrongKind, &also)
                .start()
                .await;
            _fault_task = Some(task);
            addr.replace("http://", "https://")
        }
    };
    let owner = FnHook::new("owner", &[])
        .with_tool(weather_tool(), |_, _| async {
            pb::CallToolResponse {
                content: "sunny".into(),
                is_error: false,
            }
        })
        .start()
        .await;
    // Forces a second turn after turn_end so a duplicate turn_end verdict has
    // a next event to surface at.
    let continued = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c2 = continued.clone();
    let continuer = FnHook::new("continuer", &[K::TurnEnd])
        .on_turn_end(move |_, _| {
            let first = !c2.swap(true, std::sync::atomic::Ordering::SeqCst);
            async move {
                let action = if first {
                    pb::turn_end_verdict::Action::ContinueRun(pb::ContinueRun {
                        message: "again".into(),
                    })
                } else {
                    pb::turn_end_verdict::Action::Proceed(pb::Continue {})
                };
                Reply::new(pb::TurnEndVerdict {
                    action: Some(action),
                })
            }
        })
        .start()
        .await;
    // The timing cases are late or missing by construction (the late
    // answer comes 600 ms after the event arrived); every other answer comes
    // at once, so 30 s is a margin no load crosses.
    let timeout = if case.timing() { "150ms" } else { "30s" };
    let mut events: Vec<String> = std::iter::once(event)
        .chain(also.iter().copied())
        .map(name)
        .collect();
    events.dedup();
    let policy = if closed { "closed" } else { "open" };
    let mut hooks = vec![
        (
            "fault",
            endpoint.as_str(),
            format!(
                "timeout: {timeout}\nfailure: {policy}\nevents: [{}]\npriority: 5",
                events.join(", ")
            ),
        ),
        ("owner", owner.addr.as_str(), String::new()),
    ];
    if duplicate && event == K::TurnEnd {
        hooks.push(("continuer", continuer.addr.as_str(), String::new()));
    }
    let hooks: Vec<(&str, &str, &str)> =
        hooks.iter().map(|(a, b, c)| (*a, *b, c.as_str())).collect();
    let (server, admin_addr) =
        TestServer::start_with_admin(&config(&hooks, "tools: [get_weather]")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let input = if event == K::InvalidToolCall {
        "bogus"
    } else {
        "weather"
    };
    let r = invoke(&mut c, &s, input).await;
    let outcome = pb::RunOutcome::try_from(r.outcome).unwrap();
    let class = case.class();
    let surfaced = event;
    if closed {
        assert_eq!(
            outcome,
            pb::RunOutcome::HookFailed,
            "{case:?} on {event:?} closed: {}",
            r.reason
        );
        let want = format!("hook `fault` failed on {}: {class}", name(surfaced));
        assert!(
            r.reason.contains(&want),
            "{case:?} on {event:?}: `{}` lacks `{want}`",
            r.reason
        );
        let before_tool = !duplicate
            && matches!(
                event,
                K::RunStart | K::ModelRequest | K::ModelResponse | K::ToolCall | K::InvalidToolCall
            );
        if before_tool {
            assert!(
                owner.hook.tool_calls.lock().unwrap().is_empty(),
                "{case:?} on {event:?}: a tool ran after a closed failure"
            );
        }
    } else {
        assert_eq!(
            outcome,
            pb::RunOutcome::Completed,
            "{case:?} on {event:?} open: {}",
            r.reason
        );
        assert!(
            r.hook_verdicts
                .iter()
                .any(|v| v.hook == "fault" && v.failed_open == class),
            "{case:?} on {event:?}: no failed-open record with class {class}: {:?}",
            r.hook_verdicts
        );
    }
    // The failure is counted per class, and fail-opens separately.
    let metrics = http_get(admin_addr, "/metrics").await;
    let series = format!(
        r#"hookwire_hook_failures_total{{hook="fault",event="{}",class="{class}"}}"#,
        name(surfaced)
    );
    assert!(
        metrics.contains(&series),
        "{case:?} on {event:?}: no {series}"
    );
    let fail_open = format!(
        r#"hookwire_hook_fail_open_total{{hook="fault",event="{}"}}"#,
        name(surfaced)
    );
    assert_eq!(
        metrics.contains(&fail_open),
        !closed,
        "{case:?} on {event:?}: {fail_open}"
    );
    server.stop().await;
    Cell {
        row,
        case,
        event,
        closed,
        outcome,
        detail: r.reason,
        session: s,
        surfaced,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_class_on_every_blocking_event_honours_the_policy() {
    // Spans of every cell go to one in-test OTLP collector; cells are told
    // apart by their run's trace.
    let collector = otlp::Collector::start().await;
    let mut opts = hookwire::telemetry::TelemetryOptions::new(hookwire::telemetry::LogFormat::Text);
    opts.otlp_endpoint = Some(collector.endpoint());
    opts.log_filter = "error".into();
    let (dispatch, telemetry) =
        hookwire::telemetry::build(&opts, otlp::LogCapture::default().writer()).unwrap();
    tracing::dispatcher::set_global_default(dispatch).unwrap();

    // The batch-stop cells run meanwhile on a thread of their own: they
    // synchronise on log lines, which needs a current-thread runtime.
    let batch = std::thread::spawn(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(batch_stop_cells())
    });
    let mut jobs = Vec::new();
    for &(row, case) in CLASSES {
        for event in EVENTS {
            for closed in [true, false] {
                jobs.push((row, case, event, closed));
            }
        }
    }
    let total = jobs.len();
    let cells: Vec<Cell> = futures::stream::iter(jobs)
        .map(|(r, c, e, p)| tokio::spawn(cell(r, c, e, p)))
        .buffer_unordered(8)
        .map(|r| r.expect("cell panicked"))
        .collect()
        .await;
    assert_eq!(cells.len(), total);

    // Every cell's failing hook call has its span with the failure class as
    // error.type, and a fail-open left a `hook.failed_open` span event.
    telemetry.flush().await.unwrap();
    let spans = collector.spans();
    use hookwire::telemetry::attrs;
    for c in &cells {
        let root = spans
            .iter()
            .find(|s| {
                s.name.starts_with("invoke_agent")
                    && s.attr(attrs::GEN_AI_CONVERSATION_ID) == Some(&c.session)
            })
            .unwrap_or_else(|| panic!("{:?} on {:?}: no run span", c.case, c.event));
        let hook_span = format!("hook fault {}", name(c.surfaced));
        // A duplicate noticed while the hook's next event was in flight
        // fails that event's call (its span), still naming the duplicated
        // event in the status and the metric.
        let in_flight = matches!(c.case, Case::Fault(Misbehave::Duplicate))
            .then(|| format!("hook fault {}", name(K::ModelRequest)));
        let failed: Vec<_> = spans
            .iter()
            .filter(|s| {
                s.trace_id == root.trace_id
                    && (s.name == hook_span || Some(&s.name) == in_flight.as_ref())
                    && s.attr(attrs::ERROR_TYPE) == Some(c.case.class())
            })
            .collect();
        assert!(
            !failed.is_empty(),
            "{:?} on {:?}: no `{hook_span}` span with error.type {}",
            c.case,
            c.event,
            c.case.class()
        );
        let marked = failed.iter().any(|s| s.event("hook.failed_open").is_some());
        assert_eq!(
            marked, !c.closed,
            "{:?} on {:?} (closed: {}): hook.failed_open span event",
            c.case, c.event, c.closed
        );
    }
    telemetry.shutdown().await;

    let batch = batch.join().expect("batch-stop cells panicked");
    let md = render(&cells, &batch);
    if std::env::var_os("HOOKWIRE_WRITE_MATRIX").is_some() {
        std::fs::write(MATRIX_DOC, &md).unwrap();
    }
    let published = std::fs::read_to_string(MATRIX_DOC).unwrap_or_default();
    assert!(
        published == md,
        "docs/failure-matrix.md is not what this test observed; regenerate it with \
         `HOOKWIRE_WRITE_MATRIX=1 cargo test --test failure` and review the diff.\n\
         --- observed ---\n{md}"
    );
}

/// docs/failure-matrix.md: the observed outcome of every cell.
fn render(cells: &[Cell], batch: &[(String, [String; 2])]) -> String {
    let mut md = String::from(
        "# Failure matrix\n\nGenerated by `tests/failure.rs`, which renders this file from the outcomes it observes and fails when\n\
         the published file differs (regenerate with `HOOKWIRE_WRITE_MATRIX=1 cargo test --test failure`).\n\
         Each cell is a real run against a misbehaving hook server: the outcome with `failure: closed` / with `failure: open`.\n\
         Closed cells also assert the status names hook, event and class, and that no tool ran after a failure before the tool step;\n\
         open cells assert a failed-open provenance record carrying the class. Every cell also asserts the failure metric\n\
         (`hookwire_hook_failures_total{hook,event,class}`, plus `hookwire_hook_fail_open_total` when open) and the exported\n\
         `hook fault {event}` span with `error.type` = class (plus a `hook.failed_open` span event when open).\n\
         A duplicate verdict stops the run at its next step (at the latest at the hook's next blocking event), and the\n\
         failure names the event that was answered twice.\n\n| class |",
    );
    for e in EVENTS {
        md.push_str(&format!(" {} |", name(e)));
    }
    md.push_str("\n|---|");
    for _ in EVENTS {
        md.push_str("---|");
    }
    md.push('\n');
    let short = |o: pb::RunOutcome| {
        o.as_str_name()
            .trim_start_matches("RUN_OUTCOME_")
            .to_lowercase()
    };
    for &(row, _) in CLASSES {
        md.push_str(&format!("| {row} |"));
        for e in EVENTS {
            let get = |closed: bool| {
                cells
                    .iter()
                    .find(|c| c.event == e && c.closed == closed && c.row == row)
                    .unwrap()
                    .outcome
            };
            md.push_str(&format!(" {} / {} |", short(get(true)), short(get(false))));
        }
        md.push('\n');
    }
    let example = cells
        .iter()
        .find(|c| c.closed && c.row == "wrong_kind" && c.event == K::RunStart)
        .unwrap();
    md.push_str(&format!(
        "\nExample status text (wrong_kind on {}): `{}`\n",
        name(example.event),
        example.detail
    ));
    md.push_str(
        "\n## A stopped tool batch starts nothing new\n\n\
         Each cell is a real run of three tool calls (`tool_concurrency` 2 or 4) where the `tool_call` chain of call 0\n\
         stops the batch (a `terminate`, or a closed hook failing with the class named), while every other started call\n\
         sits in its chain before that hook (held by an earlier hook until the stop happened). Every cell asserts the outcome,\n\
         that the stopping hook was called for call 0 only, that no `CallTool` reached the tool's owner and that no\n\
         `tool_started` event was streamed.\n\n| stopped by | tool_concurrency 2 | tool_concurrency 4 |\n|---|---|---|\n",
    );
    for (row, cells) in batch {
        md.push_str(&format!("| {row} | {} | {} |\n", cells[0], cells[1]));
    }
    md
}

/// Awaits `f`, failing (not hanging) the test if it never ends: a hang
/// detector, not a timing assertion.
async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("never happened: {what}"))
}

/// The issue's scenario: a closed guard subscribed only to `run_start`
/// answers it twice. The duplicate arrives while the run goes on (here: once
/// a later hook holds the run at `model_request`, or inside the tool batch
/// at `tool_call`, after that step's own check) and stops the run before its
/// next step or `CallTool`: no tool runs, and the failure names run_start
/// (the event it was seen after), logged and counted once.
#[tokio::test]
async fn a_duplicate_verdict_stops_the_run_at_its_next_step_not_at_its_end() {
    for held_at in [K::ModelRequest, K::ToolCall] {
        let (logs, _guard) =
            support::logwatch::LogWatch::install("info,hookwire::hooks::stream=debug");
        let release = Arc::new(tokio::sync::Notify::new());
        let mut fault = FaultHook::new(K::RunStart, Misbehave::Duplicate, &[]);
        fault.release = Some(release.clone());
        let (fault_addr, _fault_task) = fault.start().await;
        let owner = weather_owner().start().await;
        let (l, r) = (logs.clone(), release.clone());
        let holder = FnHook::new("holder", &[held_at]);
        let holder = match held_at {
            K::ModelRequest => holder.on_model_request(move |_, _| {
                let (l, r) = (l.clone(), r.clone());
                async move {
                    r.notify_one();
                    l.wait_for(&["hook stream fault", "class=duplicate"]).await;
                    Reply::new(pb::ModelRequestVerdict {
                        action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {})),
                    })
                }
            }),
            _ => holder.on_tool_call(move |_, _| {
                let (l, r) = (l.clone(), r.clone());
                async move {
                    r.notify_one();
                    l.wait_for(&["hook stream fault", "class=duplicate"]).await;
                    Reply::new(pb::ToolCallVerdict {
                        action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {})),
                    })
                }
            }),
        };
        let holder = holder.start().await;
        let (server, admin) = TestServer::start_with_admin(&config(
            &[
                ("fault", &fault_addr, "events: [run_start]\npriority: 5"),
                ("owner", &owner.addr, ""),
                ("holder", &holder.addr, "timeout: 60s"),
            ],
            "tools: [get_weather]\nevent_budget: 60s",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let r = bounded("the run ends", invoke(&mut c, &s, "weather")).await;
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::HookFailed,
            "held at {held_at:?}: {}",
            r.reason
        );
        assert!(
            r.reason
                .contains("hook `fault` failed on run_start: duplicate"),
            "held at {held_at:?}: {}",
            r.reason
        );
        assert!(
            owner.hook.tool_calls.lock().unwrap().is_empty(),
            "held at {held_at:?}: a tool ran after the violation"
        );
        let metrics = http_get(admin, "/metrics").await;
        let series =
            r#"hookwire_hook_failures_total{hook="fault",event="run_start",class="duplicate"} 1"#;
        assert!(metrics.contains(series), "held at {held_at:?}: no {series}");
        if held_at == K::ModelRequest {
            assert!(
                !metrics.contains("hookwire_model_call_duration_seconds_count{"),
                "the model was called after the violation"
            );
        }
        let warned = logs.lines_with(&["WARN", "hook failed", "hook=fault"]);
        assert_eq!(warned.len(), 1, "held at {held_at:?}: {warned:?}");
        server.stop().await;
    }
}

/// Late verdicts count whenever they arrive while the connection lives:
/// also after a closed hook's deadline ended the run, and after the run's
/// own deadline dropped the wait.
#[tokio::test]
async fn late_verdicts_are_counted_after_the_run_they_ended() {
    for (hook_timeout, run_timeout, want) in [
        ("150ms", "60s", pb::RunOutcome::HookFailed),
        ("30s", "200ms", pb::RunOutcome::TimedOut),
    ] {
        let (logs, _guard) =
            support::logwatch::LogWatch::install("info,hookwire::hooks::stream=debug");
        let (fault_addr, _t) = FaultHook::new(
            K::RunStart,
            Misbehave::Late(Duration::from_millis(600)),
            &[],
        )
        .start()
        .await;
        let (server, admin) = TestServer::start_with_admin(&config(
            &[("fault", &fault_addr, &format!("timeout: {hook_timeout}"))],
            &format!("run_timeout: {run_timeout}"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let r = invoke(&mut c, &s, "hi").await;
        assert_eq!(outcome(&r), want, "{}", r.reason);
        bounded(
            "the late verdict is counted",
            logs.wait_for(&["late verdict discarded", "hook=fault"]),
        )
        .await;
        let metrics = http_get(admin, "/metrics").await;
        assert!(
            metrics.contains(r#"hookwire_hook_late_verdicts_total{hook="fault"} 1"#),
            "{hook_timeout}/{run_timeout}: {metrics}"
        );
        server.stop().await;
    }
}

/// A duplicate that arrives as the run ends (here after `turn_end`, the
/// hook's only event) is still logged and counted once, naming turn_end:
/// by the run's last check, or after the run by the stream's reader.
#[tokio::test]
async fn a_fault_at_the_end_of_a_run_is_logged_and_counted_once() {
    let (logs, _guard) = support::logwatch::LogWatch::install("info");
    let (fault_addr, _t) = FaultHook::new(K::TurnEnd, Misbehave::Duplicate, &[])
        .start()
        .await;
    let (server, admin) =
        TestServer::start_with_admin(&config(&[("fault", &fault_addr, "")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    bounded(
        "the duplicate is logged",
        logs.wait_for(&["WARN", "hook=fault", "class=duplicate"]),
    )
    .await;
    let warned = logs.lines_with(&["WARN", "hook=fault", "class=duplicate"]);
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("event=turn_end"), "{}", warned[0]);
    let metrics = http_get(admin, "/metrics").await;
    let series =
        r#"hookwire_hook_failures_total{hook="fault",event="turn_end",class="duplicate"} 1"#;
    assert!(metrics.contains(series), "no {series} in {metrics}");
    // Caught before the run ended, it failed the run; after, the run had
    // completed. Either way, not both, and never another event's name.
    match outcome(&r) {
        pb::RunOutcome::HookFailed => assert!(
            r.reason.contains("failed on turn_end: duplicate"),
            "{}",
            r.reason
        ),
        pb::RunOutcome::Completed => {}
        other => panic!("{other:?}: {}", r.reason),
    }
    server.stop().await;
}

/// A hook that answers every run's last event twice, each duplicate arriving
/// after its run ended (so only the stream's reader sees it): every one is
/// counted, but the warnings are thinned like any other hook failure's, in
/// one budget per hook and class, not one line per run.
#[tokio::test]
async fn faults_after_their_run_are_counted_each_and_warned_about_thinly() {
    const RUNS: usize = 6;
    let (logs, _guard) = support::logwatch::LogWatch::install("info,hookwire::hooks::stream=debug");
    let release = Arc::new(tokio::sync::Notify::new());
    let mut fault = FaultHook::new(K::TurnEnd, Misbehave::Duplicate, &[]);
    fault.release = Some(release.clone());
    let (fault_addr, _t) = fault.start().await;
    let (server, admin) =
        TestServer::start_with_admin(&config(&[("fault", &fault_addr, "")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    for run in 1..=RUNS {
        let r = invoke(&mut c, &s, "hi").await;
        assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
        // The run is over: now the second verdict goes out.
        release.notify_one();
        bounded(
            "the stream's reader sees the duplicate",
            logs.wait_for_count(&["hook stream fault", "hook=fault", "class=duplicate"], run),
        )
        .await;
    }
    let metrics = http_get(admin, "/metrics").await;
    let series = format!(
        r#"hookwire_hook_failures_total{{hook="fault",event="turn_end",class="duplicate"}} {RUNS}"#
    );
    assert!(metrics.contains(&series), "no {series} in {metrics}");
    // One line per hook and class per 10 s: one, or two if the runs
    // straddled an interval, never one per run.
    let warned = logs.lines_with(&["WARN", "hook=fault", "class=duplicate"]);
    assert!(
        !warned.is_empty() && warned.len() <= 2,
        "{} warnings for {RUNS} faults: {warned:#?}",
        warned.len()
    );
    assert!(warned[0].contains("event=turn_end"), "{}", warned[0]);
    server.stop().await;
}

/// A hook server redeployed with a Describe that drops an event its config
/// names: the event is not silently skipped. The drift is logged (warning)
/// when hookwire re-describes the hook, shown by ListHooks and `hookwire
/// hooks list`, exported as a gauge, and each time the event comes up the
/// hook fails (class `unsubscribed`) under its failure policy.
#[tokio::test]
async fn a_hook_whose_describe_drops_a_configured_event_fails_there() {
    let (logs, _guard) = support::logwatch::LogWatch::install("info");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let v1 = FnHook::new("drift", &[K::RunStart, K::ToolCall]).start_on(listener);
    let owner = weather_owner().start().await;
    let (server, admin) = TestServer::start_with_admin(&config(
        &[
            ("drift", &v1.addr, "events: [run_start, tool_call]"),
            ("owner", &owner.addr, ""),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(v1.hook.seen_kinds().contains(&"tool_call".to_string()));

    // Redeploy: v1 stops; a run meanwhile fails to connect, and hookwire
    // describes the hook again once it is back, now as v2.
    v1.stop().await;
    let r = invoke(&mut c, &s, "hello").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed, "{}", r.reason);
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let _v2 = FnHook::new("drift", &[K::RunStart]).start_on(listener);
    bounded(
        "hookwire describes the redeployed hook",
        logs.wait_for(&[
            "WARN",
            "hook=drift",
            "does not list events its config names",
        ]),
    )
    .await;
    let warned = logs.lines_with(&["WARN", "hook=drift", "does not list"]);
    assert!(warned[0].contains("events=tool_call"), "{}", warned[0]);

    let hooks = c
        .list_hooks(pb::ListHooksRequest {})
        .await
        .unwrap()
        .into_inner();
    let drift = hooks.hooks.iter().find(|h| h.name == "drift").unwrap();
    assert_eq!(drift.unsubscribed_events, [K::ToolCall as i32]);
    assert_eq!(drift.events, [K::RunStart as i32]);
    let (ok, listed) = command_output(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire")).args([
            "hooks",
            "list",
            "--addr",
            &server.addr,
        ]),
    )
    .await;
    assert!(ok, "{listed}");
    assert!(
        listed.contains("unsubscribed: tool_call") && listed.contains("failure: closed"),
        "{listed}"
    );
    let metrics = http_get(admin, "/metrics").await;
    for series in [
        r#"hookwire_hook_unsubscribed{hook="drift",event="tool_call"} 1"#,
        r#"hookwire_hook_unsubscribed{hook="drift",event="run_start"} 0"#,
    ] {
        assert!(metrics.contains(series), "no {series} in {metrics}");
    }

    // The next run reaches tool_call: a closed failure, no tool runs.
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed, "{}", r.reason);
    assert!(
        r.reason
            .contains("hook `drift` failed on tool_call: unsubscribed"),
        "{}",
        r.reason
    );
    assert_eq!(
        owner.hook.tool_calls.lock().unwrap().len(),
        1,
        "run 1's only"
    );
    let metrics = http_get(admin, "/metrics").await;
    let series =
        r#"hookwire_hook_failures_total{hook="drift",event="tool_call",class="unsubscribed"} 1"#;
    assert!(metrics.contains(series), "no {series}");
    server.stop().await;
}

/// What stops call 0's `tool_call` chain in a batch-stop cell.
#[derive(Clone, Copy, Debug)]
enum Stopper {
    Terminate,
    Failure(Case),
}

/// The batch-stop cells: (row name, [cell at concurrency 2, at 4]).
async fn batch_stop_cells() -> Vec<(String, [String; 2])> {
    let stoppers = [
        Stopper::Terminate,
        Stopper::Failure(Case::Connect),
        Stopper::Failure(Case::Tls),
        Stopper::Failure(Case::Fault(Misbehave::RefuseStream)),
        Stopper::Failure(Case::Fault(Misbehave::Hang)),
        Stopper::Failure(Case::Fault(Misbehave::CloseStream)),
        Stopper::Failure(Case::Fault(Misbehave::Status)),
        Stopper::Failure(Case::Fault(Misbehave::WrongKind)),
        Stopper::Failure(Case::Fault(Misbehave::Invalid)),
        Stopper::Failure(Case::Fault(Misbehave::Spurious)),
        Stopper::Failure(Case::Fault(Misbehave::Unsubscribed)),
    ];
    let mut rows = Vec::new();
    for stopper in stoppers {
        let row = match stopper {
            Stopper::Terminate => "terminate".to_string(),
            Stopper::Failure(c) => format!("closed failure: {}", c.class()),
        };
        let mut cells = [String::new(), String::new()];
        for (i, concurrency) in [2u32, 4].into_iter().enumerate() {
            cells[i] = batch_stop_cell(stopper, concurrency).await;
        }
        rows.push((row, cells));
    }
    rows
}

async fn batch_stop_cell(stopper: Stopper, concurrency: u32) -> String {
    let what = format!("{stopper:?} at concurrency {concurrency}");
    let (logs, _guard) = support::logwatch::LogWatch::install("info");
    let owner = weather_owner().start().await;
    // Holds every call but call 0 in its chain until released.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let entered = Arc::new(tokio::sync::Notify::new());
    let (g, h, e) = (gate.clone(), held.clone(), entered.clone());
    let holder = FnHook::new("holder", &[K::ToolCall])
        .on_tool_call(move |_, ev| {
            let (g, h, e) = (g.clone(), h.clone(), e.clone());
            async move {
                if ev.call_index > 0 {
                    h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    e.notify_waiters();
                    let _permit = g.acquire().await;
                }
                Reply::new(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let terminator = FnHook::new("stopper", &[K::ToolCall])
        .on_tool_call(|_, ev| async move {
            Reply::new(pb::ToolCallVerdict {
                action: Some(if ev.call_index == 0 {
                    pb::tool_call_verdict::Action::Terminate(hookwire::hook_server::terminate(
                        "call 0 stops the batch",
                        None,
                    ))
                } else {
                    pb::tool_call_verdict::Action::Proceed(pb::Continue {})
                }),
            })
        })
        .start()
        .await;
    let mut fault_calls = None;
    let mut _fault_task = None;
    let endpoint = match stopper {
        Stopper::Terminate => terminator.addr.clone(),
        Stopper::Failure(Case::Connect) => "http://127.0.0.1:1".into(),
        Stopper::Failure(case) => {
            let how = match case {
                Case::Fault(how) => how,
                _ => Misbehave::WrongKind,
            };
            let mut f = FaultHook::new(K::ToolCall, how, &[]);
            f.only_index = Some(0);
            fault_calls = Some(f.received.clone());
            let (addr, task) = f.start().await;
            _fault_task = Some(task);
            if matches!(case, Case::Tls) {
                addr.replace("http://", "https://")
            } else {
                addr
            }
        }
    };
    let server = TestServer::start(&config(
        &[
            ("owner", &owner.addr, ""),
            ("holder", &holder.addr, "priority: 10\ntimeout: 60s"),
            (
                "stopper",
                &endpoint,
                "priority: 5\ntimeout: 150ms\nevents: [tool_call]\nbreaker: {failures: 0}",
            ),
        ],
        &format!("tools: [get_weather]\ntool_concurrency: {concurrency}\nevent_budget: 60s"),
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut stream = c
        .run(pb::RunRequest {
            session_id: s,
            input: "three tools".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let arrived = Arc::new(tokio::sync::Notify::new());
    let (ev, ar) = (events.clone(), arrived.clone());
    let reader = tokio::spawn(async move {
        while let Some(e) = stream.message().await.unwrap() {
            ev.lock().unwrap().push(e);
            ar.notify_waiters();
        }
    });
    // Every other started call sits in its chain...
    let others = concurrency.min(3) - 1;
    bounded(&what, async {
        loop {
            let n = entered.notified();
            if held.load(std::sync::atomic::Ordering::SeqCst) >= others {
                return;
            }
            n.await;
        }
    })
    .await;
    // ...when call 0 stops the batch.
    bounded(&what, async {
        match stopper {
            Stopper::Terminate => loop {
                let n = arrived.notified();
                let stopped = events.lock().unwrap().iter().any(|e| {
                    matches!(&e.event, Some(pb::run_event::Event::HookVerdict(v))
                        if v.hook == "stopper" && v.verdict_kind() == pb::VerdictKind::Terminate)
                });
                if stopped {
                    return;
                }
                n.await;
            },
            Stopper::Failure(_) => {
                logs.wait_for(&["WARN", "hook failed", "hook=stopper"])
                    .await
            }
        }
    })
    .await;
    gate.add_permits(8);
    bounded(&what, reader).await.unwrap();
    let events = events.lock().unwrap().clone();
    let r = result_of(&events);
    let (want, reason) = match stopper {
        Stopper::Terminate => (
            pb::RunOutcome::Terminated,
            "call 0 stops the batch".to_string(),
        ),
        Stopper::Failure(case) => (
            pb::RunOutcome::HookFailed,
            format!("hook `stopper` failed on tool_call: {}", case.class()),
        ),
    };
    assert_eq!(outcome(&r), want, "{what}: {}", r.reason);
    assert!(r.reason.contains(&reason), "{what}: {}", r.reason);
    assert!(
        owner.hook.tool_calls.lock().unwrap().is_empty(),
        "{what}: a tool ran after the batch stopped"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.event, Some(pb::run_event::Event::ToolStarted(_)))),
        "{what}: a tool started"
    );
    let stopper_calls = match (stopper, &fault_calls) {
        (Stopper::Terminate, _) => Some(terminator.hook.seen_kinds().len()),
        (Stopper::Failure(Case::Fault(Misbehave::Unsubscribed)), _) => None,
        (_, Some(n)) => Some(n.load(std::sync::atomic::Ordering::SeqCst)),
        (_, None) => None,
    };
    if let Some(n) = stopper_calls {
        assert!(n <= 1, "{what}: the stopping hook was called {n} times");
    }
    server.stop().await;
    let short = want
        .as_str_name()
        .trim_start_matches("RUN_OUTCOME_")
        .to_lowercase();
    format!("{short}, no tool started")
}

/// A hook server (or a proxy in front of it) that ends its connections
/// with a GOAWAY whose debug data is its own text: hookwire names the
/// GOAWAY and its reason, but the debug data, which can quote anything,
/// reaches neither the run's reason, nor `ListHooks`' `last_error`, nor a
/// log line above debug, and does not steer the failure's class (the words
/// "certificate" and "tcp connect" in it do not make it `tls` or
/// `connect`).
#[tokio::test]
async fn a_goaways_debug_data_stays_out_of_reasons_and_logs() {
    const SENTINEL: &str = "SENTINEL-GOAWAY-7731 certificate handshake tcp connect";
    let (logs, _guard) = support::logwatch::LogWatch::install("info,hookwire=debug");
    let addr = support::goaway::start(SENTINEL.as_bytes()).await;
    let server = TestServer::start(&config(&[("calm", &addr, "events: [run_start]")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed, "{}", r.reason);
    assert!(
        r.reason
            .contains("hook `calm` failed on run_start: stream_reset"),
        "{}",
        r.reason
    );
    assert!(
        r.reason.contains("GOAWAY ENHANCE_YOUR_CALM"),
        "the reason names the GOAWAY: {}",
        r.reason
    );
    assert!(
        r.reason
            .contains(&format!("{}-byte debug data", SENTINEL.len())),
        "and says it had debug data: {}",
        r.reason
    );
    assert!(!r.reason.contains("SENTINEL"), "{}", r.reason);

    let hooks = c
        .list_hooks(pb::ListHooksRequest {})
        .await
        .unwrap()
        .into_inner();
    let calm = hooks.hooks.iter().find(|h| h.name == "calm").unwrap();
    assert!(
        calm.last_error.contains("GOAWAY ENHANCE_YOUR_CALM"),
        "{}",
        calm.last_error
    );
    assert!(!calm.last_error.contains("SENTINEL"), "{}", calm.last_error);

    assert!(
        !logs
            .lines_with(&["WARN", "hook=calm", "class=stream_reset"])
            .is_empty(),
        "the failure is logged:\n{}",
        logs.contents()
    );
    let quoting: Vec<String> = logs.lines_with(&["SENTINEL"]);
    assert!(
        quoting.iter().all(|l| l.contains("DEBUG")),
        "the debug data is logged above debug: {quoting:#?}"
    );
    assert!(
        !quoting.is_empty(),
        "the debug data is kept for the debug log:\n{}",
        logs.contents()
    );
    server.stop().await;
}
