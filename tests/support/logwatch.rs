//! hookwire's log lines captured in memory, with a way to await one: tests
//! synchronise on what the server logged instead of sleeping.
//!
//! Install with [`LogWatch::install`] from a current-thread `#[tokio::test]`:
//! the subscriber is the thread's default, and every task of that runtime
//! (the server's included) runs on that thread.

use std::sync::{Arc, Mutex};

use hookwire::telemetry::{LogFormat, TelemetryOptions};
use tokio::sync::Notify;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

#[derive(Clone, Default)]
pub struct LogWatch {
    text: Arc<Mutex<String>>,
    arrived: Arc<Notify>,
}

struct Writer(LogWatch);

impl std::io::Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .text
            .lock()
            .unwrap()
            .push_str(&String::from_utf8_lossy(buf));
        self.0.arrived.notify_waiters();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogWatch {
    /// Captures hookwire's logs filtered by `filter` (`RUST_LOG` syntax) on
    /// this thread until the guard drops.
    pub fn install(filter: &str) -> (LogWatch, tracing::dispatcher::DefaultGuard) {
        // With one dispatcher registered in the process, tracing-core takes
        // a callsite's interest from the default of whichever thread hits
        // it first and caches it: another test's thread (no subscriber)
        // would cache `never`, and this watch would see nothing. With two,
        // every registered one is asked, and registering ours below
        // rebuilds what was cached.
        static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
        SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
        let watch = LogWatch::default();
        let mut opts = TelemetryOptions::new(LogFormat::Text);
        opts.log_filter = filter.into();
        let w = watch.clone();
        let (dispatch, _telemetry) =
            hookwire::telemetry::build(&opts, BoxMakeWriter::new(move || Writer(w.clone())))
                .expect("log pipeline");
        let guard = tracing::dispatcher::set_default(&dispatch);
        (watch, guard)
    }

    pub fn contents(&self) -> String {
        self.text.lock().unwrap().clone()
    }

    /// Lines containing every one of `parts`.
    pub fn lines_with(&self, parts: &[&str]) -> Vec<String> {
        self.contents()
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .map(str::to_owned)
            .collect()
    }

    /// Waits until some line contains every one of `parts`.
    pub async fn wait_for(&self, parts: &[&str]) {
        self.wait_for_count(parts, 1).await;
    }

    /// Waits until `n` lines contain every one of `parts`.
    pub async fn wait_for_count(&self, parts: &[&str], n: usize) {
        loop {
            let arrived = self.arrived.notified();
            if self.lines_with(parts).len() >= n {
                return;
            }
            arrived.await;
        }
    }
}
