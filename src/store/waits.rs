//! Store calls that waited long for a database connection, reported at
//! most once per period.
//!
//! sqlx warns once per slow acquire: under a burst (ten thousand runs
//! starting at once on the one SQLite connection) that was a warning per
//! waiting run, thousands of lines saying the same thing. Here the first
//! slow wait is reported at once; later ones are counted and reported
//! together a period later (then every period while they go on), each line
//! naming how many, the longest wait and what to change.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::lock::LockExt;

/// A wait for the connection longer than this is reported (sqlx's own
/// threshold).
pub const SLOW: Duration = Duration::from_secs(2);
/// At most one report per period.
pub const PERIOD: Duration = Duration::from_secs(30);

#[derive(Default)]
pub(super) struct Waits {
    state: Arc<std::sync::Mutex<State>>,
}

#[derive(Default)]
struct State {
    last_report: Option<Instant>,
    /// Slow waits since the last report, and the longest of them.
    slow: u64,
    longest: Duration,
    /// A task will report what accumulates until the period ends.
    flush_pending: bool,
}

/// What one report says.
#[derive(Debug, PartialEq)]
pub(super) struct Report {
    pub slow: u64,
    pub longest: Duration,
}

impl Waits {
    /// A store call of `engine` got its connection after `waited`.
    pub fn record(&self, engine: &'static str, waited: Duration) {
        if waited < SLOW {
            return;
        }
        tracing::debug!(engine, waited_ms = ?waited.as_millis(), "slow wait for a store connection");
        let report = self.note(waited, Instant::now());
        if let Some(r) = report {
            warn(engine, &r);
        }
        if self.state.locked().take_flush() {
            self.flush_later(engine);
        }
    }

    /// Reports what accumulated, a period after the last report, for as
    /// long as slow waits go on.
    fn flush_later(&self, engine: &'static str) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.state.locked().flush_pending = false;
            return;
        };
        let state = self.state.clone();
        rt.spawn(async move {
            loop {
                tokio::time::sleep(PERIOD).await;
                let r = state.locked().flush(Instant::now());
                match r {
                    Some(r) => warn(engine, &r),
                    None => return,
                }
            }
        });
    }

    /// Counts a slow wait at `now`; a report when one is due.
    fn note(&self, waited: Duration, now: Instant) -> Option<Report> {
        let mut s = self.state.locked();
        s.slow += 1;
        s.longest = s.longest.max(waited);
        let due = s
            .last_report
            .is_none_or(|at| now.saturating_duration_since(at) >= PERIOD);
        due.then(|| s.report(now))
    }
}

impl State {
    fn report(&mut self, now: Instant) -> Report {
        let r = Report {
            slow: self.slow,
            longest: self.longest,
        };
        self.slow = 0;
        self.longest = Duration::ZERO;
        self.last_report = Some(now);
        r
    }

    /// Whether the caller is to start the flush task (none is running).
    fn take_flush(&mut self) -> bool {
        !std::mem::replace(&mut self.flush_pending, true)
    }

    /// At the end of a period: what accumulated, if anything; nothing
    /// also ends the flush task.
    fn flush(&mut self, now: Instant) -> Option<Report> {
        if self.slow == 0 {
            self.flush_pending = false;
            return None;
        }
        Some(self.report(now))
    }
}

fn warn(engine: &'static str, r: &Report) {
    let fix = match engine {
        "sqlite" => "SQLite has one connection and writes one transaction at a time: spread run starts over time, or use PostgreSQL (store: postgres://…)",
        _ => "raise store.max_connections (and the database's own limit), or add replicas",
    };
    tracing::warn!(
        engine,
        slow_calls = r.slow,
        longest_ms = u64::try_from(r.longest.as_millis()).unwrap_or(u64::MAX),
        "store calls waited over {}s for a database connection ({} since the last report, the longest {:.1}s); {fix}",
        SLOW.as_secs(),
        r.slow,
        r.longest.as_secs_f64(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn a_burst_of_slow_waits_is_one_report_per_period_with_their_count_and_longest() {
        let w = Waits::default();
        let t0 = Instant::now();
        assert_eq!(
            w.note(secs(2.5), t0),
            Some(Report {
                slow: 1,
                longest: secs(2.5)
            }),
            "the first is reported at once"
        );
        // A thousand more within the period: nothing.
        for i in 0..1000 {
            let at = t0 + secs(f64::from(i) * 0.029);
            assert_eq!(w.note(secs(2.0 + f64::from(i % 7)), at), None);
        }
        // The next after the period carries them all.
        assert_eq!(
            w.note(secs(3.0), t0 + PERIOD),
            Some(Report {
                slow: 1001,
                longest: secs(8.0)
            })
        );
        assert_eq!(w.note(secs(2.0), t0 + PERIOD + secs(1.0)), None);
    }

    #[test]
    fn what_accumulates_after_a_report_is_flushed_a_period_later_and_the_flush_then_stops() {
        let w = Waits::default();
        let t0 = Instant::now();
        assert!(w.note(secs(2.5), t0).is_some());
        assert!(w.state.locked().take_flush(), "the first starts the flush");
        assert_eq!(w.note(secs(5.0), t0 + secs(1.0)), None);
        assert!(!w.state.locked().take_flush(), "one flush at a time");
        // The burst ended: no later slow wait would report this one.
        assert_eq!(
            w.state.locked().flush(t0 + PERIOD),
            Some(Report {
                slow: 1,
                longest: secs(5.0)
            })
        );
        assert_eq!(w.state.locked().flush(t0 + PERIOD * 2), None);
        assert!(
            w.state.locked().take_flush(),
            "a later burst starts it again"
        );
    }
}
