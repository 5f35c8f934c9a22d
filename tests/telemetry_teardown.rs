//! Dropping a telemetry pipeline's subscriber never deadlocks tracing.
//!
//! tracing-core can drop a subscriber while it holds its global dispatcher
//! lock: a `Dispatch::new` on another thread briefly upgrades every
//! registered subscriber and may end up holding the last reference. The
//! OpenTelemetry provider's `Drop` emits SDK log events; the first use of an
//! event's callsite takes that same lock. Seen as a unit test that hung at
//! 0 % CPU (telemetry::spans::tests::second_record_of_a_key_panics_in_debug_builds
//! waiting on the lock held by a thread stuck in `TracerProviderInner::drop`).
//!
//! Deterministic here: a subscriber whose registration callback (which
//! tracing-core runs under the write lock) drops the last reference to a
//! pipeline built by `hookwire::telemetry::build`. A test binary of its own,
//! so the SDK's drop event is at its first use in the process.

use std::sync::{mpsc, Mutex};
use std::time::Duration;

use hookwire::telemetry::{build, LogFormat, TelemetryOptions};
use tracing::span::{Attributes, Id, Record};
use tracing::{Dispatch, Event, Metadata, Subscriber};
use tracing_subscriber::fmt::writer::BoxMakeWriter;

static PARKED: Mutex<Option<Dispatch>> = Mutex::new(None);

/// Drops the parked pipeline while tracing-core registers this subscriber.
struct DropsParkedOnRegistration;

impl Subscriber for DropsParkedOnRegistration {
    fn on_register_dispatch(&self, _: &Dispatch) {
        drop(PARKED.lock().unwrap().take());
    }
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        false
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn a_pipeline_dropped_under_tracings_dispatcher_lock_does_not_deadlock() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut opts = TelemetryOptions::new(LogFormat::Text);
    // Never connected: the channel is lazy and nothing is exported.
    opts.otlp_endpoint = Some("http://127.0.0.1:1".into());
    let (dispatch, telemetry) = rt
        .block_on(async { build(&opts, BoxMakeWriter::new(std::io::sink)) })
        .unwrap();
    rt.block_on(telemetry.shutdown());
    *PARKED.lock().unwrap() = Some(dispatch);

    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let registering = Dispatch::new(DropsParkedOnRegistration);
        done.send(()).unwrap();
        drop(registering);
    });
    // A bound on a deadlock, not a timing margin: this takes microseconds.
    finished.recv_timeout(Duration::from_secs(30)).expect(
        "Dispatch::new deadlocked: the pipeline's subscriber, dropped under \
         tracing-core's dispatcher lock, dropped the tracer provider there",
    );
}
