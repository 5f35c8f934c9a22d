//! Per-hook circuit breaker: after N consecutive failures (across runs) the
//! hook is not called until a cool-down passes; then one probe call decides.
//! Pure: callers pass the clock in.

use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    Call,
    /// The breaker is half-open; this call is the probe.
    Probe,
    Reject,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { probing: bool },
}

#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    cooldown: Duration,
    consecutive: u32,
    state: State,
}

impl Breaker {
    /// `threshold` 0 disables the breaker.
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Breaker {
            threshold,
            cooldown,
            consecutive: 0,
            state: State::Closed,
        }
    }

    pub fn is_open(&self) -> bool {
        !matches!(self.state, State::Closed)
    }

    pub fn admit(&mut self, now: Instant) -> Admit {
        match self.state {
            State::Closed => Admit::Call,
            State::Open { until } if now < until => Admit::Reject,
            State::Open { .. } | State::HalfOpen { probing: false } => {
                self.state = State::HalfOpen { probing: true };
                Admit::Probe
            }
            State::HalfOpen { probing: true } => Admit::Reject,
        }
    }

    pub fn record(&mut self, now: Instant, ok: bool) {
        if ok {
            self.consecutive = 0;
            self.state = State::Closed;
            return;
        }
        self.consecutive += 1;
        let reopen = matches!(self.state, State::HalfOpen { .. });
        if self.threshold > 0 && (reopen || self.consecutive >= self.threshold) {
            self.state = State::Open {
                until: now + self.cooldown,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_probes_after_cooldown() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, Duration::from_secs(10));
        for _ in 0..2 {
            assert_eq!(b.admit(t0), Admit::Call);
            b.record(t0, false);
        }
        assert!(!b.is_open());
        b.record(t0, false);
        assert!(b.is_open());
        assert_eq!(b.admit(t0 + Duration::from_secs(9)), Admit::Reject);
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(b.admit(t1), Admit::Probe);
        assert_eq!(b.admit(t1), Admit::Reject, "one probe at a time");
        b.record(t1, false);
        assert_eq!(
            b.admit(t1 + Duration::from_secs(1)),
            Admit::Reject,
            "failed probe reopens"
        );
        let t2 = t1 + Duration::from_secs(10);
        assert_eq!(b.admit(t2), Admit::Probe);
        b.record(t2, true);
        assert_eq!(b.admit(t2), Admit::Call);
        assert!(!b.is_open());
    }

    #[test]
    fn success_resets_the_count() {
        let t = Instant::now();
        let mut b = Breaker::new(2, Duration::from_secs(1));
        b.record(t, false);
        b.record(t, true);
        b.record(t, false);
        assert_eq!(b.admit(t), Admit::Call);
    }

    #[test]
    fn zero_threshold_never_opens() {
        let t = Instant::now();
        let mut b = Breaker::new(0, Duration::from_secs(1));
        for _ in 0..100 {
            b.record(t, false);
        }
        assert_eq!(b.admit(t), Admit::Call);
    }
}
