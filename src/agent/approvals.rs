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

    /// A guard that withdraws the approval when dropped, however the wait
    /// for it ends: answered, timed out, or abandoned because the run was
    /// cancelled or ran out of time (its future is then dropped mid-wait).
    pub fn withdraw_on_drop<'a>(&'a self, run_id: &'a str, call_id: &'a str) -> Withdraw<'a> {
        Withdraw {
            approvals: self,
            run_id,
            call_id,
        }
    }

    /// Approvals waiting for an answer, over all runs.
    pub fn pending(&self) -> usize {
        self.pending.lock().unwrap().len()
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

/// See [`Approvals::withdraw_on_drop`].
pub struct Withdraw<'a> {
    approvals: &'a Approvals,
    run_id: &'a str,
    call_id: &'a str,
}

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        self.approvals.withdraw(self.run_id, self.call_id);
    }
}
