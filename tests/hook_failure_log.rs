//! Repeated hook failures do not flood the log, and a hook server's own
//! error text (its gRPC status message, which often quotes request content)
//! and what it sent in a verdict that failed validation stay out of log
//! lines above debug and out of exported spans; metrics still count every
//! failure.
//!
//! One test function: the subscriber is process-global.

mod support;

#[path = "support/otlp.rs"]
mod otlp;

use std::time::Duration;

use hookwire::pb;
use hookwire::telemetry::{build, LogFormat, TelemetryOptions};
use otlp::{Collector, LogCapture};
use support::fault::{FaultHook, Misbehave};
use support::*;

/// What the fault hook puts in its gRPC status message.
const HOOK_TEXT: &str = "injected failure";
const RUNS: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_outage_logs_a_few_lines_without_the_hooks_own_words() {
    let collector = Collector::start().await;
    let mut opts = TelemetryOptions::new(LogFormat::Text);
    opts.otlp_endpoint = Some(collector.endpoint());
    opts.batch_delay = Some(Duration::from_millis(20));
    opts.log_filter = "info".into();
    let logs = LogCapture::default();
    let (dispatch, telemetry) = build(&opts, logs.writer()).unwrap();
    tracing::dispatcher::set_global_default(dispatch).unwrap();

    let (addr, _t) = FaultHook::new(pb::EventKind::RunStart, Misbehave::Status, &[])
        .start()
        .await;
    let (server, admin) = TestServer::start_with_admin(&config(
        &[(
            "flaky",
            &addr,
            // Fails on every run (no breaker), and the runs go on.
            "failure: open\nbreaker: {failures: 0}",
        )],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    for _ in 0..RUNS {
        let r = invoke(&mut c, &s, "hi").await;
        assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
        let v = &r.hook_verdicts[0];
        assert_eq!(v.failed_open, "status");
        assert!(
            v.reason.contains(HOOK_TEXT),
            "the client still sees the hook's message: {}",
            v.reason
        );
    }

    // Metrics count every failure.
    let metrics = http_get(admin, "/metrics").await;
    let want =
        format!("hookwire_hook_failures_total{{hook=\"flaky\",event=\"run_start\",class=\"status\"}} {RUNS}");
    assert!(metrics.contains(&want), "{want} in:\n{metrics}");

    // The log: one line per hook and class per 10 s, not one per run.
    let text = logs.contents();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("hook failed")).collect();
    assert!(
        !lines.is_empty() && lines.len() <= 4,
        "{} warning lines for {RUNS} failures:\n{}",
        lines.len(),
        lines.join("\n")
    );
    assert!(
        lines[0].contains("WARN") && lines[0].contains("class=status"),
        "{}",
        lines[0]
    );
    assert!(
        !text.contains(HOOK_TEXT),
        "the hook's message is logged at debug only:\n{text}"
    );

    // Nor is it exported: every run's spans have arrived by now.
    collector
        .wait_until(Duration::from_secs(20), |spans| {
            spans
                .iter()
                .filter(|s| s.name.starts_with("invoke_agent"))
                .count()
                >= RUNS
        })
        .await;
    assert!(
        !collector.raw_contains(HOOK_TEXT.as_bytes()),
        "the hook's message reached the trace backend"
    );
    server.stop().await;

    // A verdict that fails validation: its fault's story quotes what the
    // hook sent (here a tool name in a patch), which went to the warn line
    // and, as that line's span event, to the trace backend.
    const SENT: &str = "SENTINEL-42";
    let patcher = FnHook::new("patcher", &[pb::EventKind::ModelRequest])
        .on_model_request(|_, _| async {
            hookwire::hook_server::Reply::new(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::PatchRequest(
                    pb::RequestPatch {
                        active_tools: Some(pb::ToolNames {
                            names: vec![SENT.into()],
                        }),
                        ..Default::default()
                    },
                )),
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("patcher", &patcher.addr, "failure: open")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    let v = &r.hook_verdicts[0];
    assert_eq!(v.failed_open, "invalid_verdict");
    assert!(
        v.reason.contains(SENT),
        "its own client sees why: {}",
        v.reason
    );
    let run = r.run_id.clone();
    collector
        .wait_until(Duration::from_secs(20), |spans| {
            spans.iter().any(|s| {
                s.name.starts_with("invoke_agent")
                    && s.attr("hookwire.run.id") == Some(run.as_str())
            })
        })
        .await;
    let text = logs.contents();
    assert!(
        text.contains("class=invalid_verdict"),
        "the failure is logged:\n{text}"
    );
    assert!(
        !text.contains(SENT),
        "what the hook sent is logged:\n{text}"
    );
    assert!(
        !collector.raw_contains(SENT.as_bytes()),
        "what the hook sent reached the trace backend"
    );
    server.stop().await;
    telemetry.shutdown().await;
}
