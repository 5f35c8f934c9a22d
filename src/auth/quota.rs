//! Limits per principal: sessions owned, runs in flight, runs started per
//! minute. The counts come from the session store, so they hold across
//! replicas that share it (the engine reads them before each creation or
//! start); this ledger adds what is in progress on this replica between
//! that read and the store's record, so two concurrent creations or starts
//! here cannot both take the last slot, and what was recorded here after
//! that read (which then missed it) counts as well. Two replicas starting
//! at the very same moment can each take it once (the read and the record
//! are not one transaction). Refusals name the limit.

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
    /// [`Reading`]s taken and not yet used: the counts below must outlive
    /// them.
    reading: u64,
    /// The sessions whose runs are among `starting`.
    starting_in: Vec<String>,
    /// Sessions and runs this replica recorded since the entry was made:
    /// a store count read before one of them was recorded misses it.
    sessions_recorded: u64,
    runs_recorded: u64,
}

/// Taken just before the store's counts are read; tells the check how many
/// creations or starts were recorded here since, which that read may have
/// missed. Without it, a creation whose slot was given back between
/// another's read and its check was counted nowhere, and both were let
/// through past the limit.
#[derive(Debug, Default)]
pub struct Reading {
    ledger: Option<(Arc<QuotaLedger>, String)>,
    sessions_recorded: u64,
    runs_recorded: u64,
}

impl Drop for Reading {
    fn drop(&mut self) {
        if let Some((l, who)) = self.ledger.take() {
            l.with(&who, |u| u.reading = u.reading.saturating_sub(1));
        }
    }
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
    /// The ledger, the owner and the session.
    ledger: Option<(Arc<QuotaLedger>, String, String)>,
}

/// Why a run may not start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartRefused {
    Quota(QuotaExceeded),
    /// Another start on the same session is in progress here: only one
    /// can take the session, and the other's answer is busy, not a quota
    /// the first start took.
    Busy,
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
        if u.creating == 0 && u.starting == 0 && u.reading == 0 {
            g.remove(who);
        }
        r
    }

    /// Call just before reading `owner`'s counts from the store, when a
    /// limit needs them.
    pub fn reading(self: &Arc<Self>, owner: &str) -> Reading {
        self.with(owner, |u| {
            u.reading += 1;
            Reading {
                ledger: Some((self.clone(), owner.to_string())),
                sessions_recorded: u.sessions_recorded,
                runs_recorded: u.runs_recorded,
            }
        })
    }

    /// Reserves a session slot, given what `p` holds in the store now.
    pub fn begin_session(
        self: &Arc<Self>,
        p: &Principal,
        read: Reading,
        held: Held,
    ) -> Result<CreatingSlot, QuotaExceeded> {
        let Some(max) = self.limits.max_sessions else {
            return Ok(CreatingSlot { ledger: None });
        };
        self.with(&p.name, |u| {
            let since = u.sessions_recorded.saturating_sub(read.sessions_recorded);
            if over(held.sessions.saturating_add(since), u.creating, max) {
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
        session: &str,
        read: Reading,
        held: Held,
    ) -> Result<StartingSlot, StartRefused> {
        if !self.limits_runs() {
            return Ok(StartingSlot { ledger: None });
        }
        self.with(owner, |u| {
            if u.starting_in.iter().any(|s| s == session) {
                return Err(StartRefused::Busy);
            }
            let since = u.runs_recorded.saturating_sub(read.runs_recorded);
            let held = Held {
                active_runs: held.active_runs.saturating_add(since),
                recent_runs: held.recent_runs.saturating_add(since),
                ..held
            };
            if let Some(max) = self.limits.max_concurrent_runs {
                if over(held.active_runs, u.starting, max) {
                    return Err(StartRefused::Quota(QuotaExceeded {
                        limit: "max_concurrent_runs",
                        max,
                        principal: owner.to_string(),
                        hint: "; wait for a run to finish",
                    }));
                }
            }
            if let Some(max) = self.limits.runs_per_minute {
                if over(held.recent_runs, u.starting, max) {
                    return Err(StartRefused::Quota(QuotaExceeded {
                        limit: "runs_per_minute",
                        max,
                        principal: owner.to_string(),
                        hint: "; retry later",
                    }));
                }
            }
            u.starting += 1;
            u.starting_in.push(session.to_string());
            Ok(StartingSlot {
                ledger: Some((self.clone(), owner.to_string(), session.to_string())),
            })
        })
    }
}

impl CreatingSlot {
    /// The store recorded the session: from now on it counts there.
    pub fn recorded(mut self) {
        if let Some((l, who)) = self.ledger.take() {
            l.with(&who, |u| {
                u.creating = u.creating.saturating_sub(1);
                u.sessions_recorded += 1;
            });
        }
    }
}

impl StartingSlot {
    /// The store recorded the run: from now on it counts there.
    pub fn recorded(mut self) {
        self.release(true);
    }

    fn release(&mut self, recorded: bool) {
        if let Some((l, who, session)) = self.ledger.take() {
            l.with(&who, |u| {
                u.starting = u.starting.saturating_sub(1);
                if let Some(i) = u.starting_in.iter().position(|s| *s == session) {
                    u.starting_in.swap_remove(i);
                }
                if recorded {
                    u.runs_recorded += 1;
                }
            });
        }
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
        self.release(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl StartRefused {
        fn limit(&self) -> &'static str {
            match self {
                StartRefused::Quota(q) => q.limit,
                StartRefused::Busy => "busy",
            }
        }
    }

    /// Two starts on one session at once, when quotas apply: the second is
    /// busy (the store would let only one take the session), not over a
    /// limit the first one's slot reached.
    #[test]
    fn a_second_start_on_a_session_being_started_is_busy() {
        let l = Arc::new(QuotaLedger::new(Quotas {
            max_concurrent_runs: Some(1),
            ..Default::default()
        }));
        let none = Held::default();
        let first = l.begin_run("a", "s", l.reading("a"), none).unwrap();
        assert_eq!(
            l.begin_run("a", "s", l.reading("a"), none).unwrap_err(),
            StartRefused::Busy
        );
        assert_eq!(
            l.begin_run("a", "t", l.reading("a"), none)
                .unwrap_err()
                .limit(),
            "max_concurrent_runs"
        );
        drop(first);
        assert!(l.begin_run("a", "s", l.reading("a"), none).is_ok());
    }

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
        let s = l.begin_session(&a, l.reading("a"), none).unwrap();
        assert_eq!(
            l.begin_session(&a, l.reading("a"), none).unwrap_err().limit,
            "max_sessions"
        );
        assert!(l.begin_session(&b, l.reading("b"), none).is_ok());
        drop(s);
        assert!(l.begin_session(&a, l.reading("a"), none).is_ok());
        // What the store holds counts as well.
        let one_session = Held {
            sessions: 1,
            ..none
        };
        assert_eq!(
            l.begin_session(&a, l.reading("a"), one_session)
                .unwrap_err()
                .limit,
            "max_sessions"
        );
        // Runs: a start in progress, then runs the store counts.
        let r = l.begin_run("a", "s", l.reading("a"), none).unwrap();
        assert_eq!(
            l.begin_run("a", "s2", l.reading("a"), none)
                .unwrap_err()
                .limit(),
            "max_concurrent_runs"
        );
        drop(r);
        let running = Held {
            active_runs: 1,
            recent_runs: 1,
            ..none
        };
        assert_eq!(
            l.begin_run("a", "s", l.reading("a"), running)
                .unwrap_err()
                .limit(),
            "max_concurrent_runs"
        );
        let two_recent = Held {
            recent_runs: 2,
            ..none
        };
        let StartRefused::Quota(e) = l
            .begin_run("a", "s", l.reading("a"), two_recent)
            .unwrap_err()
        else {
            panic!("refused as busy")
        };
        assert_eq!(e.limit, "runs_per_minute");
        assert!(
            e.to_string()
                .contains("quota `runs_per_minute` reached (2)"),
            "{e}"
        );
        assert!(
            l.begin_run("b", "s", l.reading("b"), none).is_ok(),
            "b's own quota"
        );
        assert!(
            l.begin_run("a", "s", l.reading("a"), none).is_ok(),
            "all released"
        );
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
                    l.begin_session(&a, l.reading("a"), h)
                        .map(drop)
                        .map_err(|e| e.limit),
                    l.begin_run("a", "s", l.reading("a"), h)
                        .map(drop)
                        .map_err(|e| e.limit()),
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
        assert!(l.begin_session(&a, l.reading("a"), lots).is_ok());
        assert!(l.begin_run("a", "s", l.reading("a"), lots).is_ok());
    }

    /// A creation whose count was read before another's record, and whose
    /// check came after that one gave its slot back, saw neither: both
    /// took the last session.
    #[test]
    fn what_was_recorded_after_a_read_counts_for_its_check() {
        let l = Arc::new(QuotaLedger::new(Quotas {
            max_sessions: Some(1),
            max_concurrent_runs: Some(1),
            runs_per_minute: None,
        }));
        let a = Principal::new("a", Vec::<String>::new());
        let none = Held::default();
        // B reads the store's count (0) ...
        let b_read = l.reading("a");
        // ... A reads, checks, is recorded and gives its slot back ...
        let a_slot = l.begin_session(&a, l.reading("a"), none).unwrap();
        a_slot.recorded();
        // ... and B's check, on its stale count, still finds the limit.
        assert_eq!(
            l.begin_session(&a, b_read, none).unwrap_err().limit,
            "max_sessions"
        );
        // The same for runs.
        let b_read = l.reading("a");
        l.begin_run("a", "s", l.reading("a"), none)
            .unwrap()
            .recorded();
        assert_eq!(
            l.begin_run("a", "s", b_read, none).unwrap_err().limit(),
            "max_concurrent_runs"
        );
        // A read taken after the record starts from there: the store's
        // count has it (1), and nothing is counted twice.
        let fresh = l.reading("a");
        let one = Held {
            sessions: 1,
            ..none
        };
        assert_eq!(
            l.begin_session(&a, fresh, one).unwrap_err().limit,
            "max_sessions"
        );
        // A failed creation (slot dropped, not recorded) counts nowhere.
        let b_read = l.reading("a");
        drop(l.begin_run("a", "s", l.reading("a"), none).unwrap());
        assert!(l.begin_run("a", "s", b_read, none).is_ok());
        // Nothing in progress or reading: the entry goes.
        assert!(l.usage.lock().unwrap().is_empty());
    }
}
