//! Limits per principal: sessions owned, runs in flight, runs started per
//! minute. The counts come from the session store, so they hold across
//! replicas that share it (the engine reads them before each creation or
//! start); this ledger adds what is in progress on this replica between
//! that read and the store's record, so two concurrent creations or starts
//! here cannot both take the last slot. Two replicas starting at the very
//! same moment can each take it once (the read and the record are not one
//! transaction). Refusals name the limit.

use crate::lock::LockExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::Quotas;

use super::principal::Principal;

/// The `runs_per_minute` window.
pub const WINDOW: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("quota `{limit}` reached ({max}) for principal `{principal}`{hint}")]
pub struct QuotaExceeded {
    pub limit: &'static str,
    pub max: u32,
    pub principal: String,
    pub hint: &'static str,
}

/// What a principal holds according to the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub sessions: u64,
    pub active_runs: u64,
    /// Runs started within [`WINDOW`].
    pub recent_runs: u64,
}

/// Creations and starts in progress on this replica, not yet in the store.
#[derive(Default, Debug)]
struct InProgress {
    creating: u64,
    starting: u64,
}

#[derive(Default, Debug)]
pub struct QuotaLedger {
    limits: Quotas,
    usage: Mutex<HashMap<String, InProgress>>,
}

/// Held while a session is being created; releases its slot when dropped
/// (once the store has the session, or the creation failed).
#[derive(Debug)]
pub struct CreatingSlot {
    ledger: Option<(Arc<QuotaLedger>, String)>,
}

/// Held while a run is being started; releases its slot when dropped (once
/// the store has the run, which then counts there, or the start failed).
#[derive(Debug)]
pub struct StartingSlot {
    ledger: Option<(Arc<QuotaLedger>, String)>,
}

fn over(held: u64, in_progress: u64, max: u32) -> bool {
    held.saturating_add(in_progress) >= u64::from(max)
}

impl QuotaLedger {
    pub fn new(limits: Quotas) -> QuotaLedger {
        QuotaLedger {
            limits,
            usage: Mutex::new(HashMap::new()),
        }
    }

    /// Whether creations need the store's count (`max_sessions` is set).
    pub fn limits_sessions(&self) -> bool {
        self.limits.max_sessions.is_some()
    }

    /// How far the store needs to count: to the largest limit set (a held
    /// count capped there decides every limit as the full count would).
    pub fn count_cap(&self) -> u64 {
        let l = &self.limits;
        [l.max_sessions, l.max_concurrent_runs, l.runs_per_minute]
            .into_iter()
            .flatten()
            .map(u64::from)
            .max()
            .unwrap_or(0)
    }

    /// Whether starts need the store's counts.
    pub fn limits_runs(&self) -> bool {
        self.limits.max_concurrent_runs.is_some() || self.limits.runs_per_minute.is_some()
    }

    fn with<R>(&self, who: &str, f: impl FnOnce(&mut InProgress) -> R) -> R {
        let mut g = self.usage.locked();
        let u = g.entry(who.to_string()).or_default();
        let r = f(u);
        if u.creating == 0 && u.starting == 0 {
            g.remove(who);
        }
        r
    }

    /// Reserves a session slot, given what `p` holds in the store now.
    pub fn begin_session(
        self: &Arc<Self>,
        p: &Principal,
        held: Held,
    ) -> Result<CreatingSlot, QuotaExceeded> {
        let Some(max) = self.limits.max_sessions else {
            return Ok(CreatingSlot { ledger: None });
        };
        self.with(&p.name, |u| {
            if over(held.sessions, u.creating, max) {
                return Err(QuotaExceeded {
                    limit: "max_sessions",
                    max,
                    principal: p.name.clone(),
                    hint: "; delete sessions you no longer need",
                });
            }
            u.creating += 1;
            Ok(CreatingSlot {
                ledger: Some((self.clone(), p.name.clone())),
            })
        })
    }

    /// Reserves a run start in a session of `owner`, given what `owner`
    /// holds in the store now. Runs count for their session's owner
    /// (the store charges them there), whoever starts them: an admin's
    /// run in alice's session takes one of alice's slots.
    pub fn begin_run(
        self: &Arc<Self>,
        owner: &str,
        held: Held,
    ) -> Result<StartingSlot, QuotaExceeded> {
        if !self.limits_runs() {
            return Ok(StartingSlot { ledger: None });
        }
        self.with(owner, |u| {
            if let Some(max) = self.limits.max_concurrent_runs {
                if over(held.active_runs, u.starting, max) {
                    return Err(QuotaExceeded {
                        limit: "max_concurrent_runs",
                        max,
                        principal: owner.to_string(),
                        hint: "; wait for a run to finish",
                    });
                }
            }
            if let Some(max) = self.limits.runs_per_minute {
                if over(held.recent_runs, u.starting, max) {
                    return Err(QuotaExceeded {
                        limit: "runs_per_minute",
                        max,
                        principal: owner.to_string(),
                        hint: "; retry later",
                    });
                }
            }
            u.starting += 1;
            Ok(StartingSlot {
                ledger: Some((self.clone(), owner.to_string())),
            })
        })
    }
}

impl Drop for CreatingSlot {
    fn drop(&mut self) {
        if let Some((l, who)) = self.ledger.take() {
            l.with(&who, |u| u.creating = u.creating.saturating_sub(1));
        }
    }
}

impl Drop for StartingSlot {
    fn drop(&mut self) {
        if let Some((l, who)) = self.ledger.take() {
            l.with(&who, |u| u.starting = u.starting.saturating_sub(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_per_principal_and_count_what_is_in_progress() {
        let l = Arc::new(QuotaLedger::new(Quotas {
            max_sessions: Some(1),
            max_concurrent_runs: Some(1),
            runs_per_minute: Some(2),
        }));
        let a = Principal::new("a", Vec::<String>::new());
        let b = Principal::new("b", Vec::<String>::new());
        let none = Held::default();
        // A creation in progress takes the last slot until it is dropped.
        let s = l.begin_session(&a, none).unwrap();
        assert_eq!(l.begin_session(&a, none).unwrap_err().limit, "max_sessions");
        assert!(l.begin_session(&b, none).is_ok());
        drop(s);
        assert!(l.begin_session(&a, none).is_ok());
        // What the store holds counts as well.
        let one_session = Held {
            sessions: 1,
            ..none
        };
        assert_eq!(
            l.begin_session(&a, one_session).unwrap_err().limit,
            "max_sessions"
        );
        // Runs: a start in progress, then runs the store counts.
        let r = l.begin_run("a", none).unwrap();
        assert_eq!(
            l.begin_run("a", none).unwrap_err().limit,
            "max_concurrent_runs"
        );
        drop(r);
        let running = Held {
            active_runs: 1,
            recent_runs: 1,
            ..none
        };
        assert_eq!(
            l.begin_run("a", running).unwrap_err().limit,
            "max_concurrent_runs"
        );
        let two_recent = Held {
            recent_runs: 2,
            ..none
        };
        let e = l.begin_run("a", two_recent).unwrap_err();
        assert_eq!(e.limit, "runs_per_minute");
        assert!(
            e.to_string()
                .contains("quota `runs_per_minute` reached (2)"),
            "{e}"
        );
        assert!(l.begin_run("b", none).is_ok(), "b's own quota");
        assert!(l.begin_run("a", none).is_ok(), "all released");
    }

    /// Counts capped at the largest limit decide every limit as the full
    /// counts do: at the cap, each limit (all at most the cap) is reached.
    #[test]
    fn counts_capped_at_the_largest_limit_decide_as_full_counts() {
        let l = Arc::new(QuotaLedger::new(Quotas {
            max_sessions: Some(3),
            max_concurrent_runs: Some(2),
            runs_per_minute: Some(5),
        }));
        let cap = l.count_cap();
        assert_eq!(cap, 5);
        let a = Principal::new("a", Vec::<String>::new());
        for n in 0..=12u64 {
            let full = Held {
                sessions: n,
                active_runs: n / 2,
                recent_runs: n,
            };
            let capped = Held {
                sessions: full.sessions.min(cap),
                active_runs: full.active_runs.min(cap),
                recent_runs: full.recent_runs.min(cap),
            };
            let decide = |h: Held| {
                (
                    l.begin_session(&a, h).map(drop).map_err(|e| e.limit),
                    l.begin_run("a", h).map(drop).map_err(|e| e.limit),
                )
            };
            assert_eq!(decide(full), decide(capped), "{n}");
        }
        assert_eq!(QuotaLedger::new(Quotas::default()).count_cap(), 0);
    }

    #[test]
    fn without_limits_nothing_is_counted() {
        let l = Arc::new(QuotaLedger::new(Quotas::default()));
        let a = Principal::new("a", Vec::<String>::new());
        assert!(!l.limits_sessions() && !l.limits_runs());
        let lots = Held {
            sessions: 1_000_000,
            active_runs: 1_000_000,
            recent_runs: 1_000_000,
        };
        assert!(l.begin_session(&a, lots).is_ok());
        assert!(l.begin_run("a", lots).is_ok());
    }
}
