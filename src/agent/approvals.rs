//! Pending approval requests raised by `ask` verdicts, answered through
//! AgentService.ResolveApproval.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::oneshot;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub approve: bool,
    pub note: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApprovalError {
    #[error("no pending approval for call `{call_id}` in run `{run_id}` (already answered, timed out, or never asked)")]
    NotPending { run_id: String, call_id: String },
}

#[derive(Default)]
pub struct Approvals {
    pending: Mutex<HashMap<(String, String), oneshot::Sender<Decision>>>,
}

impl Approvals {
    pub fn register(&self, run_id: &str, call_id: &str) -> oneshot::Receiver<Decision> {
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap()
            .insert((run_id.to_string(), call_id.to_string()), tx);
        rx
    }

    pub fn withdraw(&self, run_id: &str, call_id: &str) {
        self.pending
            .lock()
            .unwrap()
            .remove(&(run_id.to_string(), call_id.to_string()));
    }

    /// Withdraws every pending approval of a run (it ended, or its driver
    /// panicked): a late `ResolveApproval` then gets NOT_FOUND.
    pub fn withdraw_run(&self, run_id: &str) {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|(run, _), _| run != run_id);
    }

    pub fn resolve(&self, run_id: &str, call_id: &str, d: Decision) -> Result<(), ApprovalError> {
        let tx = self
            .pending
            .lock()
            .unwrap()
            .remove(&(run_id.to_string(), call_id.to_string()));
        match tx.map(|tx| tx.send(d)) {
            Some(Ok(())) => Ok(()),
            _ => Err(ApprovalError::NotPending {
                run_id: run_id.into(),
                call_id: call_id.into(),
            }),
        }
    }
}
