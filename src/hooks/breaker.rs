//! Per-hook circuit breaker: after N consecutive failures (across runs) the
//! hook is not called until a cool-down passes; then one probe call decides.
//! A background probe that sees the hook server answer again ends the
//! cool-down early ([`Breaker::recover`]); the cool-down is the upper bound.
//! Recovered that way, the breaker is closed on probation: one call at a
//! time goes through until one succeeds, since a server that answers
//! `Describe` may still hang or fail its `Process` calls. If that call
//! fails, the breaker stays open for the whole cool-down: `Describe` is not
//! believed again until a real call succeeds.
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
    /// Calls go through.
    Closed,
    /// Closed by a background probe, not by a successful call yet: one call
    /// at a time (`calling`), and its failure reopens the breaker.
    Probation {
        calling: bool,
    },
    Open {
        until: Instant,
    },
    HalfOpen {
        probing: bool,
    },
}

#[derive(Debug)]
pub struct Breaker {
    threshold: u32,
    cooldown: Duration,
    consecutive: u32,
    state: State,
    /// Whether a background probe's answer may end a cool-down early:
    /// not after a call let through on probation failed, until a call
    /// succeeds (a server whose `Describe` answers while its `Process`
    /// hangs would otherwise be called again at every probe, ~100 ms).
    trust_probe: bool,
}

const CLOSED: State = State::Closed;

impl Breaker {
    /// `threshold` 0 disables the breaker.
    pub fn new(threshold: u32, cooldown: Duration) -> Self {
        Breaker {
            threshold,
            cooldown,
            consecutive: 0,
            state: CLOSED,
            trust_probe: true,
        }
    }

    /// Open or half-open: calls are refused, but for a probe. Closed on
    /// probation counts as closed (the hook is called, one call at a time).
    pub fn is_open(&self) -> bool {
        matches!(self.state, State::Open { .. } | State::HalfOpen { .. })
    }

    pub fn admit(&mut self, now: Instant) -> Admit {
        match self.state {
            State::Closed => Admit::Call,
            State::Probation { calling: false } => {
                self.state = State::Probation { calling: true };
                Admit::Probe
            }
            State::Probation { calling: true } => Admit::Reject,
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
            self.state = CLOSED;
            self.trust_probe = true;
            return;
        }
        self.consecutive = self.consecutive.saturating_add(1);
        if matches!(self.state, State::Probation { .. }) {
            self.trust_probe = false;
        }
        let reopen = matches!(self.state, State::HalfOpen { .. } | State::Probation { .. });
        if self.threshold > 0 && (reopen || self.consecutive >= self.threshold) {
            self.state = State::Open {
                until: now.checked_add(self.cooldown).unwrap_or(now),
            };
        }
    }

    /// The probe admitted by [`admit`](Self::admit) ended without an
    /// outcome (its caller was cancelled or ran out of run time before the
    /// hook answered): that says nothing about the hook, so the next call
    /// probes instead. Without this an abandoned probe would leave the
    /// breaker half-open with a probe "in flight" forever.
    pub fn abandon_probe(&mut self) {
        match self.state {
            State::HalfOpen { probing: true } => self.state = State::HalfOpen { probing: false },
            State::Probation { calling: true } => self.state = State::Probation { calling: false },
            _ => {}
        }
    }

    /// The hook server answered a background probe (Describe): close the
    /// breaker now rather than at the end of the cool-down, on probation.
    /// Returns whether it did: not if it was not open, nor if the last
    /// call let through on probation failed (the cool-down runs out then).
    pub fn recover(&mut self) -> bool {
        if !self.is_open() || !self.trust_probe {
            return false;
        }
        self.consecutive = 0;
        self.state = State::Probation { calling: false };
        true
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
    fn an_abandoned_probe_lets_the_next_call_probe() {
        let t0 = Instant::now();
        let mut b = Breaker::new(1, Duration::from_secs(10));
        b.record(t0, false);
        let t1 = t0 + Duration::from_secs(10);
        assert_eq!(b.admit(t1), Admit::Probe);
        b.abandon_probe();
        assert_eq!(b.admit(t1), Admit::Probe, "not stuck half-open");
        b.record(t1, true);
        assert!(!b.is_open());
        // Abandoning outside a probe changes nothing.
        b.abandon_probe();
        assert_eq!(b.admit(t1), Admit::Call);
    }

    #[test]
    fn recovery_closes_on_probation_and_the_next_failure_reopens() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, Duration::from_secs(30));
        for _ in 0..3 {
            b.record(t0, false);
        }
        assert_eq!(b.admit(t0), Admit::Reject);
        assert!(b.recover(), "was open");
        assert!(!b.is_open(), "closed, on probation");
        assert_eq!(b.admit(t0), Admit::Probe, "before the cool-down ended");
        assert_eq!(b.admit(t0), Admit::Reject, "one call at a time");
        b.record(t0, false);
        assert!(b.is_open(), "one failure on probation reopens");
        assert!(
            !b.recover(),
            "a probe's answer is not believed again until a call succeeds"
        );
        assert_eq!(b.admit(t0 + Duration::from_secs(29)), Admit::Reject);
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(b.admit(t1), Admit::Probe, "the cool-down ran out");
        b.record(t1, true);
        assert_eq!(b.admit(t1), Admit::Call);
        b.record(t1, false);
        assert!(!b.is_open(), "a success ends probation: back to counting");
        assert!(!b.recover(), "already closed");
        for _ in 0..2 {
            b.record(t1, false);
        }
        assert!(b.recover(), "a probe's answer is believed again");
    }

    #[test]
    fn an_abandoned_call_on_probation_lets_the_next_one_through() {
        let t0 = Instant::now();
        let mut b = Breaker::new(1, Duration::from_secs(30));
        b.record(t0, false);
        assert!(b.recover());
        assert_eq!(b.admit(t0), Admit::Probe);
        b.abandon_probe();
        assert_eq!(b.admit(t0), Admit::Probe, "not stuck on probation");
        b.record(t0, true);
        assert_eq!(b.admit(t0), Admit::Call);
        assert_eq!(b.admit(t0), Admit::Call, "closed: every call goes through");
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
