//! Shutdown: refuse new work, then wait for every run this replica took on
//! (registered in `Engine::runs`, or still starting) until its end is
//! recorded, cancelling what is left after the grace.
//!
//! A run is in the store (`begin_run`) before it is in `runs`: its start
//! first reads the session, the owner's quota usage and the transcript.
//! Starts in that window are counted ([`Starting`]), so a drain that
//! begins meanwhile waits for them instead of returning at once and
//! leaving the run open in the store with its session busy.

use crate::lock::LockExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{Engine, EngineError};
use crate::agent::outcome::RunOutcome;
use crate::agent::runner::Run;
use crate::store::RunEnd;

/// How long runs cancelled at the end of the shutdown grace may take to end.
const CANCEL_WIND_DOWN: Duration = Duration::from_secs(5);

/// Why runs are cancelled once the shutdown grace ran out.
const SHUTDOWN_CANCEL: &str = "server shutting down";

/// A run start in progress: past the `accepting` check, not yet in
/// `Engine::runs`. Given up when dropped (the run is registered, or its
/// start failed).
pub(super) struct Starting<'a> {
    engine: &'a Engine,
    /// `Engine::unmatched_cancels` when the start began.
    cancels: u64,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        // Under the runs lock, as `Leaving` and `is_idle` look at both.
        let runs = self.engine.runs.locked();
        let left = self.engine.starting.fetch_sub(1, Ordering::SeqCst) - 1;
        if left == 0 && runs.is_empty() {
            self.engine.idle.notify_waiters();
        }
    }
}

/// A run's place on this replica (`Engine::runs`), given up when dropped.
pub(super) struct Leaving {
    pub(super) engine: Arc<Engine>,
    pub(super) run: Arc<Run>,
}

impl Drop for Leaving {
    fn drop(&mut self) {
        self.run.left.cancel();
        let mut runs = self.engine.runs.locked();
        runs.remove(&self.run.run_id);
        if runs.is_empty() && self.engine.starting.load(Ordering::SeqCst) == 0 {
            self.engine.idle.notify_waiters();
        }
    }
}

impl Engine {
    /// Counts a run start, unless shutdown began: hold the guard until the
    /// run is in `runs` (or failed to start).
    pub(super) fn begin_start(&self) -> Result<Starting<'_>, EngineError> {
        // Counted before `accepting` is read, while `stop_accepting` writes
        // it before a drain reads the count: either this start sees the
        // shutdown, or the drain sees this start.
        self.starting.fetch_add(1, Ordering::SeqCst);
        let start = Starting {
            engine: self,
            cancels: self.unmatched_cancels.load(Ordering::SeqCst),
        };
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(EngineError::ShuttingDown);
        }
        Ok(start)
    }

    /// Puts a started run on this replica. One registered after the drain
    /// cancelled the runs (its start outlasted the grace) is cancelled too.
    /// Returns whether a cancel or a delete found no run here while this
    /// one was starting: it may have been meant for this run, which then
    /// asks the store.
    pub(super) fn register(&self, run: &Arc<Run>, start: Starting<'_>) -> bool {
        let missed = {
            // Under the lock `cancel_local` counts under: a cancel either
            // finds the run or is counted before this reads the count.
            let mut runs = self.runs.locked();
            runs.insert(run.run_id.clone(), run.clone());
            self.unmatched_cancels.load(Ordering::SeqCst) != start.cancels
        };
        if self.cancelling.load(Ordering::SeqCst) {
            run.cancel(SHUTDOWN_CANCEL);
        }
        drop(start);
        missed
    }

    /// Cancels the run `run_id` of this replica, if it has it; otherwise
    /// counts a cancel that found no run (see [`Engine::register`]).
    pub(super) fn cancel_local(&self, run_id: &str, reason: &str) {
        let runs = self.runs.locked();
        match runs.get(run_id).cloned() {
            Some(run) => {
                drop(runs);
                run.cancel(reason);
            }
            None => {
                self.unmatched_cancels.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Refuses new sessions and runs from now on.
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::SeqCst);
    }

    /// Waits for in-flight runs (and runs still starting) up to `grace`,
    /// then cancels the rest and waits for their ends to be recorded (they
    /// end promptly with outcome cancelled). Call after
    /// [`Engine::stop_accepting`].
    ///
    /// Within the grace, a run is waited for until it is gone, its last
    /// events queued for its client included. After it, a run whose end is
    /// settled (recorded, or beyond this replica: its lease taken, or the
    /// store unreachable for the ledger's whole retry window, when a
    /// reaper ends it) is done as far as the store goes (its hooks had
    /// run_end too): only its last events may still wait for room for a
    /// slow client (`server.client_stall_timeout`), and they are
    /// best-effort. It is neither cancelled nor waited for then, and never
    /// ended again.
    pub async fn drain(&self, grace: Duration) {
        if tokio::time::timeout(grace, self.until_idle())
            .await
            .is_err()
        {
            // Before the runs are listed: a start that registers its run
            // after this cancels it itself (`register`).
            self.cancelling.store(true, Ordering::SeqCst);
            let runs = self.unsettled_runs();
            let starting = self.starting.load(Ordering::SeqCst);
            if runs.is_empty() && starting == 0 {
                tracing::info!(
                    "shutdown grace elapsed; every run's end is settled, some of their last events may not reach slow clients"
                );
            } else {
                tracing::warn!(
                    runs = runs.len(),
                    starting,
                    "shutdown grace elapsed; cancelling runs"
                );
            }
            for r in runs {
                r.cancel(SHUTDOWN_CANCEL);
            }
            // Cancelled runs still fire run_end and commit; give them a
            // bounded moment (deploy/ sizes the pod's grace period on it).
            let _ = tokio::time::timeout(CANCEL_WIND_DOWN, self.until_settled()).await;
            // Runs that did not even end then are recorded as interrupted
            // now, so their sessions are free when this replica is gone. A
            // start still waiting for the store has no run to end here: its
            // lease expires and another replica (or this one restarted)
            // ends it.
            let stuck = self.unsettled_runs();
            for r in stuck {
                let end = RunEnd {
                    outcome: RunOutcome::Interrupted,
                    reason: "the replica shut down before the run ended".into(),
                    usage: Default::default(),
                    turns: 0,
                };
                if let Err(e) = r.ledger.end_once(&[], &end).await {
                    r.ledger.warn("cannot record the run's end at shutdown", &e);
                }
            }
        }
        self.background.stop().await;
        self.registry.stop();
    }

    /// No run in flight nor starting.
    fn is_idle(&self) -> bool {
        let runs = self.runs.locked();
        runs.is_empty() && self.starting.load(Ordering::SeqCst) == 0
    }

    /// The runs in flight whose end is not settled yet.
    fn unsettled_runs(&self) -> Vec<Arc<Run>> {
        let mut runs = self.runs_in_flight();
        runs.retain(|r| !r.ledger.end_settled());
        runs
    }

    /// Resolves once every run in flight has its end settled and no run
    /// is starting.
    async fn until_settled(&self) {
        /// How often a start that registered its run meanwhile is looked
        /// for (it is not among the runs waited for below).
        const RECHECK: Duration = Duration::from_millis(50);
        loop {
            let notified = self.idle.notified();
            let runs = self.unsettled_runs();
            let starting = self.starting.load(Ordering::SeqCst) > 0;
            if runs.is_empty() && !starting {
                return;
            }
            let recorded =
                futures::future::join_all(runs.iter().map(|r| r.ledger.until_end_settled()));
            tokio::select! {
                _ = notified => {}
                _ = recorded, if !runs.is_empty() => {}
                _ = tokio::time::sleep(RECHECK), if starting => {}
            }
        }
    }

    /// Resolves once no run is in flight nor starting.
    async fn until_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.is_idle() {
                return;
            }
            notified.await;
        }
    }
}
