//! Approval requests raised by `ask` verdicts. The store records them and
//! their answers (ResolveApproval may reach any replica); this is the
//! replica-local side: the runs of this replica waiting for an answer.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::oneshot;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub approve: bool,
    pub note: String,
}

type Key = (String, String);

#[derive(Default)]
pub struct Approvals {
    waiting: Mutex<HashMap<Key, oneshot::Sender<Decision>>>,
}

/// A registered wait; dropping it (answered, timed out, or abandoned because
/// the run was cancelled or ran out of time: its future is then dropped
/// mid-wait) forgets the waiter.
pub struct Waiter<'a> {
    approvals: &'a Approvals,
    key: Key,
    pub answer: oneshot::Receiver<Decision>,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.approvals
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

impl Approvals {
    pub fn register(&self, run_id: &str, call_id: &str) -> Waiter<'_> {
        let (tx, rx) = oneshot::channel();
        let key = (run_id.to_string(), call_id.to_string());
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone(), tx);
        Waiter {
            approvals: self,
            key,
            answer: rx,
        }
    }

    /// Approvals this replica's runs wait for, over all runs.
    pub fn pending(&self) -> usize {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Hands a recorded decision to the run waiting for it on this replica,
    /// if any; whether one was waiting.
    pub fn deliver(&self, run_id: &str, call_id: &str, d: Decision) -> bool {
        let tx = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(run_id.to_string(), call_id.to_string()));
        tx.is_some_and(|tx| tx.send(d).is_ok())
    }
}
