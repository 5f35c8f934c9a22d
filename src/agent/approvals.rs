//! Approval requests raised by `ask` verdicts. The store records them and
//! their answers (ResolveApproval may reach any replica); this is the
//! replica-local side: the runs of this replica waiting for an answer.

use crate::lock::LockExt;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// How long a ResolveApproval that came before its question waits for it
/// (the hook's `ask` to be recorded) before it is NOT_FOUND: the hook that
/// asks may tell its approver before hookwire has the `ask`.
pub const EARLY_ANSWER_HOLD: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub approve: bool,
    pub note: String,
}

/// The replica-local refusal (tests and [`Approvals::deliver`]); callers of
/// ResolveApproval get the store's answer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApprovalError {
    #[error("no pending approval for call `{call_id}` in run `{run_id}` (already answered, timed out, or never asked)")]
    NotPending { run_id: String, call_id: String },
}

struct Entry {
    tx: oneshot::Sender<Decision>,
    /// The asking call's batch: once it is stopped, the request is withdrawn
    /// even if the waiting call has not noticed yet.
    stop: Option<CancellationToken>,
}

#[derive(Default)]
pub struct Approvals {
    pending: Mutex<HashMap<(String, String), Entry>>,
}

/// A registered approval request. Dropping it withdraws the request, so
/// however the wait ends (answer, timeout, stopped batch, cancelled or
/// panicked run), a later `ResolveApproval` gets NOT_FOUND.
pub struct PendingApproval<'a> {
    approvals: &'a Approvals,
    run_id: String,
    call_id: String,
    pub answer: oneshot::Receiver<Decision>,
}

impl Drop for PendingApproval<'_> {
    fn drop(&mut self) {
        self.approvals.withdraw(&self.run_id, &self.call_id);
    }
}

impl Approvals {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Entry>> {
        // Entries stay consistent under a panic elsewhere: keep serving them.
        self.pending.locked()
    }

    /// Registers a request; `stop` (the asking call's batch) withdraws it
    /// once fired.
    pub fn register(
        &self,
        run_id: &str,
        call_id: &str,
        stop: Option<CancellationToken>,
    ) -> PendingApproval<'_> {
        let (tx, rx) = oneshot::channel();
        self.entries().insert(
            (run_id.to_string(), call_id.to_string()),
            Entry { tx, stop },
        );
        PendingApproval {
            approvals: self,
            run_id: run_id.to_string(),
            call_id: call_id.to_string(),
            answer: rx,
        }
    }

    pub fn withdraw(&self, run_id: &str, call_id: &str) {
        self.entries()
            .remove(&(run_id.to_string(), call_id.to_string()));
    }

    /// Withdraws every pending approval of a run (its driver panicked, say):
    /// a late `ResolveApproval` then gets NOT_FOUND.
    pub fn withdraw_run(&self, run_id: &str) {
        self.entries().retain(|(run, _), _| run != run_id);
    }

    /// The (run, call) pairs waiting here: what the replica asks the store
    /// for answers to.
    pub fn waiting(&self) -> Vec<(String, String)> {
        self.entries().keys().cloned().collect()
    }

    /// Whether any call of `run_id` waits for an answer here.
    pub fn has_run(&self, run_id: &str) -> bool {
        self.entries().keys().any(|(run, _)| run == run_id)
    }

    /// Approvals this replica's runs wait for, over all runs.
    pub fn pending(&self) -> usize {
        self.entries().len()
    }

    /// Whether a call of a run waits for an answer here (registered, and
    /// its batch not stopped).
    pub fn is_pending(&self, run_id: &str, call_id: &str) -> bool {
        self.entries()
            .get(&(run_id.to_string(), call_id.to_string()))
            .is_some_and(|e| !e.stop.as_ref().is_some_and(CancellationToken::is_cancelled))
    }

    /// Hands a decision the store recorded to the run waiting for it on
    /// this replica, if any (and its batch has not stopped); whether one was
    /// waiting.
    pub fn deliver(&self, run_id: &str, call_id: &str, d: Decision) -> bool {
        self.resolve(run_id, call_id, d).is_ok()
    }

    pub fn resolve(&self, run_id: &str, call_id: &str, d: Decision) -> Result<(), ApprovalError> {
        let entry = self
            .entries()
            .remove(&(run_id.to_string(), call_id.to_string()));
        match entry {
            Some(e) if !e.stop.as_ref().is_some_and(CancellationToken::is_cancelled) => {
                e.tx.send(d).map_err(|_| ApprovalError::NotPending {
                    run_id: run_id.into(),
                    call_id: call_id.into(),
                })
            }
            _ => Err(ApprovalError::NotPending {
                run_id: run_id.into(),
                call_id: call_id.into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yes() -> Decision {
        Decision {
            approve: true,
            note: String::new(),
        }
    }

    #[test]
    fn a_request_is_withdrawn_when_dropped_or_when_its_batch_stops() {
        let a = Approvals::default();
        let stop = CancellationToken::new();
        let p = a.register("r", "c1", Some(stop.clone()));
        drop(p);
        assert!(a.resolve("r", "c1", yes()).is_err(), "dropped: withdrawn");

        let mut p = a.register("r", "c2", Some(stop.clone()));
        stop.cancel();
        assert!(
            a.resolve("r", "c2", yes()).is_err(),
            "refused as soon as the batch stopped, before the call noticed"
        );
        assert!(p.answer.try_recv().is_err());

        let mut p = a.register("r", "c3", None);
        assert_eq!(a.resolve("r", "c3", yes()), Ok(()));
        assert_eq!(p.answer.try_recv(), Ok(yes()));
        assert!(a.resolve("r", "c3", yes()).is_err(), "answered once");
    }
}
