//! A run's handle on the store: everything it records goes through its
//! lease, so a replica that lost the lease cannot write.

use crate::lock::LockExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::agent::approvals::Decision;
use crate::agent::machine::Stop;
use crate::agent::store_warnings::StoreWarnings;
use crate::config::DEFAULT_RUN_LEASE;
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
    /// Fired once the run's attempt to record its end is over: recorded,
    /// or refused for good (another replica took the lease) or unanswered
    /// for a whole retry window (a reaper ends it). Either way nothing of
    /// the run is left for this replica to record, and it must not try to
    /// end it again.
    settled: CancellationToken,
    /// When the store last extended the lease, at the latest: the moment
    /// the call that did it was sent (the store counts the lease from when
    /// it ran, which is later). The replica stops the run before a lease
    /// from then can expire (`Engine::fence_runs`).
    confirmed: Arc<Mutex<Instant>>,
    /// How long [`Ledger::end`] retries a store that is unavailable.
    end_retry: Duration,
    warnings: StoreWarnings,
}

/// The first pause before the end is written again, doubled up to
/// [`END_RETRY_MAX_PAUSE`].
const END_RETRY_FIRST_PAUSE: Duration = Duration::from_millis(100);
const END_RETRY_MAX_PAUSE: Duration = Duration::from_secs(2);

impl Ledger {
    /// A ledger whose end is retried for [`DEFAULT_RUN_LEASE`]; the engine
    /// sets the configured lease with [`Ledger::retrying_end_for`].
    pub fn new(store: Arc<dyn SessionStore>, lease: RunLease) -> Ledger {
        Ledger {
            store,
            lease,
            ending: Arc::default(),
            settled: CancellationToken::new(),
            confirmed: Arc::new(Mutex::new(Instant::now())),
            end_retry: DEFAULT_RUN_LEASE,
            warnings: StoreWarnings::default(),
        }
    }

    /// Warn of failed writes through `warnings` (the engine's, shared by
    /// all its runs) rather than a log of the run's own.
    pub fn warning_through(mut self, warnings: StoreWarnings) -> Ledger {
        self.warnings = warnings;
        self
    }

    /// `what` failed for this run with `error` (thinned, see
    /// [`StoreWarnings`]).
    pub fn warn(&self, what: &'static str, error: &StoreError) {
        self.warnings.warn(what, &self.lease.run_id, error);
    }

    /// Retry an unavailable store for `window` when recording the end.
    pub fn retrying_end_for(mut self, window: Duration) -> Ledger {
        self.end_retry = window;
        self
    }

    /// The lease was granted by a `begin_run` sent at `asked`.
    pub fn leased_at(self, asked: Instant) -> Ledger {
        *self.confirmed.locked() = asked;
        self
    }

    /// A renewal sent at `asked` extended the lease.
    pub fn confirm(&self, asked: Instant) {
        let mut c = self.confirmed.locked();
        // Renewals may answer out of order; the latest one counts.
        *c = (*c).max(asked);
    }

    /// How long ago the lease was last known to be extended.
    pub fn unconfirmed_for(&self) -> Duration {
        self.confirmed.locked().elapsed()
    }

    /// Whether the run has started recording its end.
    pub fn is_ending(&self) -> bool {
        self.ending.load(Ordering::SeqCst)
    }

    /// Whether the run's end is settled: recorded, or beyond this
    /// replica's reach (see `settled`).
    pub fn end_settled(&self) -> bool {
        self.settled.is_cancelled()
    }

    /// Resolves once the run's end is settled.
    pub async fn until_end_settled(&self) {
        self.settled.cancelled().await
    }

    // The run's own writes below extend its lease in the store (each
    // starts with the lease's fence), so one that succeeded confirms it
    // too: a run whose store calls wait long under load (SQLite, a burst
    // of starts) is not stopped for want of a renewal it did not need.

    pub async fn append(&self, messages: &[Message]) -> Result<(), Stop> {
        let asked = Instant::now();
        self.store
            .append(&self.lease, messages)
            .await
            .map_err(|e| stop_for(&e))?;
        if !messages.is_empty() {
            self.confirm(asked);
        }
        Ok(())
    }

    pub async fn stage_turn(&self, turn: Option<&Message>) -> Result<(), Stop> {
        let asked = Instant::now();
        self.store
            .stage_turn(&self.lease, turn)
            .await
            .map_err(|e| stop_for(&e))?;
        self.confirm(asked);
        Ok(())
    }

    pub async fn request_approval(&self, call_id: &str) -> Result<(), Stop> {
        let asked = Instant::now();
        self.store
            .request_approval(&self.lease, call_id)
            .await
            .map_err(|e| stop_for(&e))?;
        self.confirm(asked);
        Ok(())
    }

    /// Why the run must stop before it starts anything, as the store has
    /// it: a cancel recorded (on any replica), its session deleted, or its
    /// lease lost. A store that cannot answer now stops nothing: the write
    /// before any tool starts (`stage_turn`) checks the same again.
    pub async fn recorded_stop(&self) -> Option<Stop> {
        match self.store.check_run(&self.lease).await {
            Ok(()) => None,
            Err(
                e @ (StoreError::RunCancelled { .. }
                | StoreError::SessionNotFound(_)
                | StoreError::LeaseLost(_)),
            ) => Some(stop_for(&e)),
            Err(e) => {
                self.warn(
                    "cannot read whether the run was cancelled as it started",
                    &e,
                );
                None
            }
        }
    }

    /// Records that the run stopped waiting for an approval: `Some` when
    /// an answer was recorded first (the store decides which came first).
    /// Retried while the store is unavailable, as the run's end is; when
    /// it cannot be recorded the run stops (`Err`). Taking it for a denial
    /// left the request pending in the store, where a later
    /// ResolveApproval recorded an approval, answered OK, for a call this
    /// run had denied.
    pub async fn expire_approval(&self, call_id: &str) -> Result<Option<Decision>, Stop> {
        self.retrying("an approval timeout", || {
            self.store.expire_approval(&self.lease, call_id)
        })
        .await
        .map_err(|e| {
            self.warn("cannot record an approval timeout", &e);
            stop_for(&e)
        })
    }

    /// `write` until it answers other than unavailable (no connection
    /// within its wait, a connection lost mid-write), for up to
    /// `end_retry` after its first answer. Counted from the first answer,
    /// not the first attempt: one attempt may wait as long as a lease for
    /// a connection (30 s each), and a window from the start would then
    /// leave no second one. Only for writes the store takes twice as once.
    async fn retrying<T, F, W>(&self, what: &str, write: W) -> Result<T, StoreError>
    where
        W: Fn() -> F,
        F: std::future::Future<Output = Result<T, StoreError>>,
    {
        let mut window: Option<Instant> = None;
        let mut pause = END_RETRY_FIRST_PAUSE;
        loop {
            let answer = write().await;
            let give_up = *window.get_or_insert_with(|| Instant::now() + self.end_retry);
            match answer {
                Err(StoreError::Unavailable(e)) if Instant::now() + pause < give_up => {
                    // Per run, at debug: a store that is down for everyone
                    // is reported by its connection waits and by the
                    // (thinned) warning of the runs that give up.
                    tracing::debug!(run = %self.lease.run_id, error = %e, retry_in = ?pause, "cannot record {what} yet; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(END_RETRY_MAX_PAUSE);
                }
                done => return done,
            }
        }
    }

    /// Records the run's end, retrying while the store is unavailable for
    /// up to a run lease ([`Ledger::retrying`]). The answer the client is
    /// about to get is only in the transcript once this succeeds, and the
    /// lease is about the time the run has before a reaper may end it
    /// `interrupted`. A retry is safe at any time: the store takes the same
    /// end twice as one (its first attempt may have committed), and refuses
    /// it once a reaper ended the run.
    pub async fn end(&self, messages: &[Message], end: &RunEnd) -> Result<(), StoreError> {
        let ended = self
            .retrying("the run's end", || self.end_once(messages, end))
            .await;
        self.settled.cancel();
        ended
    }

    /// [`Ledger::end`] without retries (at shutdown, where every stuck run
    /// gets one attempt within the pod's grace period).
    pub async fn end_once(&self, messages: &[Message], end: &RunEnd) -> Result<(), StoreError> {
        // Before the write: a renewal that reaches the store after it sees
        // an ended run.
        self.ending.store(true, Ordering::SeqCst);
        let ended = self.store.end_run(&self.lease, messages, end).await;
        if ended.is_ok() {
            self.settled.cancel();
        }
        ended
    }
}

/// How a failed write ends the run.
pub fn stop_for(e: &StoreError) -> Stop {
    match e {
        StoreError::LeaseLost(_) => Stop::Interrupted(
            "this replica lost the run's lease (another replica took the run over); it stopped without recording more".into(),
        ),
        StoreError::SessionNotFound(_) => Stop::Cancelled("the session was deleted".into()),
        // Cancelled on another replica (or before this one had the run in
        // hand): the run ends as that cancel would have ended it here.
        StoreError::RunCancelled { reason, .. } => Stop::Cancelled(reason.clone()),
        StoreError::TranscriptFull { .. } => Stop::Failed(e.to_string()),
        _ => Stop::Failed(format!("the run could not be recorded: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemoryStore, NewSession};

    /// The run's own writes extend its lease in the store, so they count
    /// as a renewal: a run whose writes land is not stopped for want of
    /// one (only a write of something: an empty append writes nothing).
    #[tokio::test(start_paused = true)]
    async fn the_runs_own_writes_confirm_its_lease() {
        let store: Arc<dyn SessionStore> = Arc::new(MemoryStore::default());
        store
            .create_session(&NewSession {
                id: "s".into(),
                agent: "a".into(),
                owner: "o".into(),
                extra_hooks: vec![],
                metadata: Default::default(),
            })
            .await
            .unwrap();
        let lease = store.begin_run("s", "r", "A").await.unwrap();
        let ledger = Ledger::new(store, lease).leased_at(Instant::now());
        let later = Duration::from_secs(10);
        tokio::time::advance(later).await;
        assert_eq!(ledger.unconfirmed_for(), later);
        ledger.append(&[]).await.unwrap();
        assert_eq!(ledger.unconfirmed_for(), later, "nothing written");
        ledger.append(&[Message::user("hi")]).await.unwrap();
        assert_eq!(ledger.unconfirmed_for(), Duration::ZERO);
        tokio::time::advance(later).await;
        ledger.stage_turn(None).await.unwrap();
        assert_eq!(ledger.unconfirmed_for(), Duration::ZERO);
        tokio::time::advance(later).await;
        ledger.request_approval("c").await.unwrap();
        assert_eq!(ledger.unconfirmed_for(), Duration::ZERO);
    }
}
