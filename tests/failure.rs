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
    // A duplicate is only detectable once it arrived: it surfaces at the
    // hook's next blocking event (here: the next model_request).
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
    let surfaced = if duplicate { K::ModelRequest } else { event };
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
        let failed: Vec<_> = spans
            .iter()
            .filter(|s| {
                s.trace_id == root.trace_id
                    && s.name == hook_span
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

    let md = render(&cells);
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
fn render(cells: &[Cell]) -> String {
    let mut md = String::from(
        "# Failure matrix\n\nGenerated by `tests/failure.rs`, which renders this file from the outcomes it observes and fails when\n\
         the published file differs (regenerate with `HOOKWIRE_WRITE_MATRIX=1 cargo test --test failure`).\n\
         Each cell is a real run against a misbehaving hook server: the outcome with `failure: closed` / with `failure: open`.\n\
         Closed cells also assert the status names hook, event and class, and that no tool ran after a failure before the tool step;\n\
         open cells assert a failed-open provenance record carrying the class. Every cell also asserts the failure metric\n\
         (`hookwire_hook_failures_total{hook,event,class}`, plus `hookwire_hook_fail_open_total` when open) and the exported\n\
         `hook fault {event}` span with `error.type` = class (plus a `hook.failed_open` span event when open).\n\
         A duplicate verdict surfaces at the hook's next blocking event.\n\n| class |",
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
    md
}
