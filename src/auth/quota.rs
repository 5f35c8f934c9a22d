//! Limits per principal: sessions owned, runs in flight, runs started per
//! minute. Counted in this replica (sessions are counted from the store,
//! plus creations in progress so two concurrent creates cannot both take
//! the last slot). Refusals name the limit.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// tokio's clock, so the per-minute window can be tested with a paused clock.
use tokio::time::Instant;

use crate::config::Quotas;

use super::principal::Principal;

const WINDOW: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("quota `{limit}` reached ({max}) for principal `{principal}`{hint}")]
pub struct QuotaExceeded {
    pub limit: &'static str,
    pub max: u32,
    pub principal: String,
    pub hint: &'static str,
}

#[derive(Default, Debug)]
struct Usage {
    creating: u32,
    running: u32,
    starts: VecDeque<Instant>,
}

impl Usage {
    fn idle(&self) -> bool {
        self.creating == 0 && self.running == 0 && self.starts.is_empty()
    }
}

#[derive(Default, Debug)]
pub struct QuotaLedger {
    limits: Quotas,
    usage: Mutex<HashMap<String, Usage>>,
}

/// Held while a session is being created; releases its slot when dropped.
#[derive(Debug)]
pub struct CreatingSlot {
    ledger: Option<(Arc<QuotaLedger>, String)>,
}

/// Held for the life of a run; frees the concurrent-run slot when dropped.
#[derive(Debug)]
pub struct RunSlot {
    ledger: Option<(Arc<QuotaLedger>, String)>,
}

impl QuotaLedger {
    pub fn new(limits: Quotas) -> QuotaLedger {
        QuotaLedger {
            limits,
            usage: Mutex::new(HashMap::new()),
        }
    }

    fn with<R>(&self, who: &str, f: impl FnOnce(&mut Usage) -> R) -> R {
        let mut g = self.usage.lock().unwrap_or_else(|p| p.into_inner());
        let u = g.entry(who.to_string()).or_default();
        let now = Instant::now();
        while u
            .starts
            .front()
            .is_some_and(|t| now.duration_since(*t) >= WINDOW)
        {
            u.starts.pop_front();
        }
        let r = f(u);
        if u.idle() {
            g.remove(who);
        }
        r
    }

    /// Reserves a session slot, given how many sessions `p` owns now.
    pub fn begin_session(
        self: &Arc<Self>,
        p: &Principal,
        owned: usize,
    ) -> Result<CreatingSlot, QuotaExceeded> {
        let Some(max) = self.limits.max_sessions else {
            return Ok(CreatingSlot { ledger: None });
        };
        self.with(&p.name, |u| {
            let used = owned.saturating_add(u.creating as usize);
            if used >= max as usize {
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

    /// Takes a concurrent-run slot and a start in the per-minute window.
    pub fn begin_run(self: &Arc<Self>, p: &Principal) -> Result<RunSlot, QuotaExceeded> {
        if self.limits.max_concurrent_runs.is_none() && self.limits.runs_per_minute.is_none() {
            return Ok(RunSlot { ledger: None });
        }
        self.with(&p.name, |u| {
            if let Some(max) = self.limits.max_concurrent_runs {
                if u.running >= max {
                    return Err(QuotaExceeded {
                        limit: "max_concurrent_runs",
                        max,
                        principal: p.name.clone(),
                        hint: "; wait for a run to finish",
                    });
                }
            }
            if let Some(max) = self.limits.runs_per_minute {
                if u.starts.len() >= max as usize {
                    return Err(QuotaExceeded {
                        limit: "runs_per_minute",
                        max,
                        principal: p.name.clone(),
                        hint: "; retry later",
                    });
                }
            }
            u.running += 1;
            if self.limits.runs_per_minute.is_some() {
                u.starts.push_back(Instant::now());
            }
            Ok(RunSlot {
                ledger: Some((self.clone(), p.name.clone())),
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

impl Drop for RunSlot {
    fn drop(&mut self) {
        if let Some((l, who)) = self.ledger.take() {
            l.with(&who, |u| u.running = u.running.saturating_sub(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn limits_are_per_principal_and_released() {
        let l = Arc::new(QuotaLedger::new(Quotas {
            max_sessions: Some(1),
            max_concurrent_runs: Some(1),
            runs_per_minute: Some(2),
        }));
        let a = Principal::new("a", Vec::<String>::new());
        let b = Principal::new("b", Vec::<String>::new());
        let s = l.begin_session(&a, 0).unwrap();
        assert_eq!(l.begin_session(&a, 0).unwrap_err().limit, "max_sessions");
        assert!(l.begin_session(&b, 0).is_ok());
        drop(s);
        assert_eq!(l.begin_session(&a, 1).unwrap_err().limit, "max_sessions");
        let r = l.begin_run(&a).unwrap();
        assert_eq!(l.begin_run(&a).unwrap_err().limit, "max_concurrent_runs");
        drop(r);
        let r = l.begin_run(&a).unwrap();
        drop(r);
        let e = l.begin_run(&a).unwrap_err();
        assert_eq!(e.limit, "runs_per_minute");
        assert!(
            e.to_string()
                .contains("quota `runs_per_minute` reached (2)"),
            "{e}"
        );
        assert!(l.begin_run(&b).is_ok());
        tokio::time::advance(WINDOW).await;
        assert!(l.begin_run(&a).is_ok(), "the window moved on");
    }
}
