//! Thins the warning logged for repeated hook failures, per hook and failure
//! class. During an outage of a hook that every run calls, one line per run
//! floods the log (measured: 30 000 lines in 40 s); the first failure of a
//! class is logged at once, later ones of that class within
//! [`LOG_INTERVAL`] are only counted, and the next line says how many were
//! left out. Metrics still count every failure.
//! Pure: callers pass the clock in.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

use crate::hooks::failure::FailureClass;

/// At most one warning per hook and failure class per interval.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Entry {
    logged_at: Instant,
    suppressed: u64,
}

/// One hook's failure-log state: at most one entry per failure class, so it
/// stays small whatever the failure rate. Keyed by anything else (`K`), the
/// same thinning serves other repeated warnings (the store's, per kind of
/// write that failed).
#[derive(Debug)]
pub struct FailureLog<K = FailureClass> {
    last: HashMap<K, Entry>,
}

impl<K> Default for FailureLog<K> {
    fn default() -> Self {
        FailureLog {
            last: HashMap::new(),
        }
    }
}

impl<K: Hash + Eq> FailureLog<K> {
    /// Whether a failure of `class` seen at `now` gets a log line: `Some(n)`
    /// with `n` failures of that class left unlogged since the previous line,
    /// or `None` to count it silently.
    pub fn admit(&mut self, class: K, now: Instant) -> Option<u64> {
        match self.last.get_mut(&class) {
            Some(e) if now.saturating_duration_since(e.logged_at) < LOG_INTERVAL => {
                e.suppressed = e.suppressed.saturating_add(1);
                None
            }
            Some(e) => {
                let n = e.suppressed;
                e.logged_at = now;
                e.suppressed = 0;
                Some(n)
            }
            None => {
                self.last.insert(
                    class,
                    Entry {
                        logged_at: now,
                        suppressed: 0,
                    },
                );
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_class_and_interval_counting_the_rest() {
        let t0 = Instant::now();
        let mut log = FailureLog::default();
        assert_eq!(log.admit(FailureClass::Connect, t0), Some(0));
        for i in 1..=500u64 {
            let t = t0 + Duration::from_millis(i);
            assert_eq!(log.admit(FailureClass::Connect, t), None);
        }
        // Another class has its own line.
        assert_eq!(log.admit(FailureClass::Deadline, t0), Some(0));
        // After the interval, the next line carries the count left out.
        assert_eq!(
            log.admit(FailureClass::Connect, t0 + LOG_INTERVAL),
            Some(500)
        );
        assert_eq!(
            log.admit(
                FailureClass::Connect,
                t0 + LOG_INTERVAL + Duration::from_secs(1)
            ),
            None
        );
        assert_eq!(
            log.admit(FailureClass::Connect, t0 + LOG_INTERVAL * 2),
            Some(1)
        );
    }

    #[test]
    fn a_clock_going_backwards_does_not_panic() {
        let t0 = Instant::now() + Duration::from_secs(60);
        let mut log = FailureLog::default();
        assert_eq!(log.admit(FailureClass::Status, t0), Some(0));
        assert_eq!(
            log.admit(FailureClass::Status, t0 - Duration::from_secs(30)),
            None
        );
    }
}
