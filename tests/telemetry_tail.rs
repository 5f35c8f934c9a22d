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

use std::sync::Arc;
use std::time::Duration;

use hookwire::agent::events::RunEvent;
use hookwire::agent::outcome::RunOutcome;
use hookwire::auth::Principal;
use hookwire::config::Config;
use hookwire::engine::Engine;
use hookwire::pb::EventKind as K;
use hookwire::telemetry::{attrs, build, Instruments, LogFormat, TelemetryOptions};
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

    // A blocking turn_end hook: the answer's ~30 deltas are held, and go
    // with the run's last events, once its end is recorded.
    let accept = FnHook::new("accept", &[K::TurnEnd]).start().await;
    let yaml = format!(
        "{}server:\n  run_event_buffer: 16\n  client_stall_timeout: 60s\n",
        config(&[("accept", &accept.addr, "")], "")
    );
    let config = Config::parse(&yaml, "test config").expect("valid config");
    let models = hookwire::server::build_models(&config).unwrap();
    let inst = Instruments::new(&config.telemetry);
    let store = Arc::new(hookwire::store::MemoryStore::new(Default::default()));
    let e = Arc::new(Engine::new(config, models, inst, store).unwrap());
    e.registry().describe_all(Duration::from_secs(5)).await;
    e.registry().start();
    let s = e
        .create_session(&Principal::anonymous(), "a", vec![], Default::default())
        .await
        .unwrap();
    let mut h = e
        .start_run(
            &Principal::anonymous(),
            &s.id,
            "y".repeat(360),
            true,
            Default::default(),
            None,
        )
        .await
        .unwrap();
    // The client reads nothing: the run's end is recorded, its last events
    // wait for room.
    tokio::time::timeout(Duration::from_secs(20), async {
        while e
            .store()
            .get_session(&s.id)
            .await
            .unwrap()
            .active_run
            .is_some()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the run's end is recorded while its client reads nothing");
    assert_eq!(h.events.len(), 16, "the client's queue is full");
    let session = s.id.clone();
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
