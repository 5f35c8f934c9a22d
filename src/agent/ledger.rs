//! A run's handle on the store: everything it records goes through its
//! lease, so a replica that lost the lease cannot write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::agent::approvals::Decision;
use crate::agent::machine::Stop;
use crate::message::Message;
use crate::store::{RunEnd, RunLease, SessionStore, StoreError};

#[derive(Clone)]
pub struct Ledger {
    pub store: Arc<dyn SessionStore>,
    pub lease: RunLease,
    /// Set when the run starts recording its end. A renewal of the lease
    /// refused after that is the end winning the race (the store refuses
    /// to renew an ended run), not another replica taking the run over.
    ending: Arc<AtomicBool>,
}

impl Ledger {
    pub fn new(store: Arc<dyn SessionStore>, lease: RunLease) -> Ledger {
        Ledger {
            store,
            lease,
            ending: Arc::default(),
        }
    }

    /// Whether the run has started recording its end.
    pub fn is_ending(&self) -> bool {
        self.ending.load(Ordering::SeqCst)
    }

    pub async fn append(&self, messages: &[Message]) -> Result<(), Stop> {
        self.store
            .append(&self.lease, messages)
            .await
            .map_err(|e| stop_for(&e))
    }

    pub async fn stage_turn(&self, turn: Option<&Message>) -> Result<(), Stop> {
        self.store
            .stage_turn(&self.lease, turn)
            .await
            .map_err(|e| stop_for(&e))
    }

    pub async fn request_approval(&self, call_id: &str) -> Result<(), Stop> {
        self.store
            .request_approval(&self.lease, call_id)
            .await
            .map_err(|e| stop_for(&e))
    }

    /// Stops waiting: `Some` when an answer was recorded meanwhile.
    pub async fn expire_approval(&self, call_id: &str) -> Option<Decision> {
        match self.store.expire_approval(&self.lease, call_id).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(run = %self.lease.run_id, error = %e, "cannot record an approval timeout");
                None
            }
        }
    }

    pub async fn end(&self, messages: &[Message], end: &RunEnd) -> Result<(), StoreError> {
        // Before the write: a renewal that reaches the store after it sees
        // an ended run.
        self.ending.store(true, Ordering::SeqCst);
        self.store.end_run(&self.lease, messages, end).await
    }
}

/// How a failed write ends the run.
pub fn stop_for(e: &StoreError) -> Stop {
    match e {
        StoreError::LeaseLost(_) => Stop::Interrupted(
            "this replica lost the run's lease (another replica took the run over); it stopped without recording more".into(),
        ),
        StoreError::SessionNotFound(_) => Stop::Cancelled("the session was deleted".into()),
        StoreError::TranscriptFull { .. } => Stop::Failed(e.to_string()),
        _ => Stop::Failed(format!("the run could not be recorded: {e}")),
    }
}
