//! A run's `invoke_agent` span ends once the run is over as far as the
//! store and its hooks go, not once a slow `Run` client has read its last
//! events: those may wait for that client past a drain's grace, until the
//! process exits, and the span would go with them.
//!
//! A test binary of its own: the subscriber that exports to the in-test
//! collector is process-global.

mod support;

#[path = "support/otlp.rs"]
mod otlp;

use std::time::Duration;

use hookwire::agent::events::RunEvent;
use hookwire::agent::outcome::RunOutcome;
use hookwire::telemetry::{attrs, build, LogFormat, TelemetryOptions};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_span_is_exported_before_its_slow_client_reads_the_runs_end() {
    let collector = otlp::Collector::start().await;
    let mut opts = TelemetryOptions::new(LogFormat::Text);
    opts.otlp_endpoint = Some(collector.endpoint());
    opts.batch_delay = Some(Duration::from_millis(20));
    let logs = otlp::LogCapture::default();
    let (dispatch, _telemetry) = build(&opts, logs.writer()).unwrap();
    tracing::dispatcher::set_global_default(dispatch).unwrap();

    let unread = UnreadEnd::start().await;
    let mut h = unread.run;
    let session = unread.session_id.clone();
    collector
        .wait_until(Duration::from_secs(20), |spans| {
            spans.iter().any(|x| {
                x.name.starts_with("invoke_agent")
                    && x.attr(attrs::GEN_AI_CONVERSATION_ID) == Some(session.as_str())
            })
        })
        .await;
    assert!(
        !h.task.is_finished(),
        "the run's last events still wait for the client"
    );
    let mut events = Vec::new();
    while let Some(ev) = h.events.recv().await.map(|e| *e) {
        events.push(ev);
    }
    let report = h.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    assert!(matches!(events.last(), Some(RunEvent::Finished(r)) if *r == report));
}
