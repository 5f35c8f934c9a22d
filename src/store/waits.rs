//! Store calls that waited long for a database connection, reported at
//! most once per period.
//!
//! sqlx warns once per slow acquire: under a burst (ten thousand runs
//! starting at once on the one SQLite connection) that was a warning per
//! waiting run, thousands of lines saying the same thing. Here the first
//! slow wait is reported at once, later ones are counted and reported
//! together with the next slow wait after the period, each line naming the
//! longest wait and what to change.

use std::time::{Duration, Instant};

use crate::lock::LockExt;

/// A wait for the connection longer than this is reported (sqlx's own
/// threshold).
pub const SLOW: Duration = Duration::from_secs(2);
/// At most one report per period.
pub const PERIOD: Duration = Duration::from_secs(30);

#[derive(Default)]
pub(super) struct Waits {
    state: std::sync::Mutex<State>,
}

#[derive(Default)]
struct State {
    last_report: Option<Instant>,
    /// Slow waits since the last report, and the longest of them.
    slow: u64,
    longest: Duration,
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
        if let Some(r) = self.note(waited, Instant::now()) {
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
        } else {
            tracing::debug!(engine, waited_ms = ?waited.as_millis(), "slow wait for a store connection");
        }
    }

    /// Counts a slow wait at `now`; a report when one is due.
    fn note(&self, waited: Duration, now: Instant) -> Option<Report> {
        let mut s = self.state.locked();
        s.slow += 1;
        s.longest = s.longest.max(waited);
        let due = s
            .last_report
            .is_none_or(|at| now.saturating_duration_since(at) >= PERIOD);
        if !due {
            return None;
        }
        let report = Report {
            slow: s.slow,
            longest: s.longest,
        };
        *s = State {
            last_report: Some(now),
            ..State::default()
        };
        Some(report)
    }
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
}
