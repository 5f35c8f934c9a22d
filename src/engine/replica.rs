//! What a replica does besides answering calls:
//!
//! - keeps the leases of its runs (renewed every third of `server.run_lease`;
//!   a run whose lease was lost stops, `interrupted`), and stops a run
//!   itself, `interrupted`, when its lease was not confirmed for a lease
//!   minus one renewal period: the store is out of reach, and once the
//!   lease expires another replica may claim the run (fencing);
//! - delivers the cancels and approval answers other replicas recorded for
//!   its runs: woken by the store's hint (Postgres NOTIFY), and polling every
//!   [`POLL`] in case a hint was missed, so a signal arrives within a second;
//! - reaps the runs of lost replicas once their lease expired: ends them
//!   `interrupted`, closing their in-flight tool calls with synthetic
//!   results, and frees their sessions (tools are never replayed);
//! - expires idle sessions (`server.session_ttl`).

use crate::lock::LockExt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Engine;
use crate::agent::contain::contained;
use crate::agent::outcome::RunOutcome;
use crate::event::EventKind;
use crate::hooks::dispatch::RunHooks;
use crate::hooks::payload::{EventContext, Payload};
use crate::store::{ClaimedRun, RunEnd, Signal};

/// Fallback polling for signals recorded by other replicas.
pub const POLL: Duration = Duration::from_millis(500);

/// Runs claimed at a time; a reaper pass claims until a batch comes back
/// short, ending each batch's runs together.
const REAP_BATCH: u32 = 16;

/// Why a run is stopped when its lease could not be renewed in time.
const FENCED: &str = "this replica could not renew the run's lease (the store is unreachable) and stopped the run before the lease could expire and another replica take it over";

/// How often leases are renewed: every third of a lease, so two renewals
/// in a row may fail (or wait for the store) before the lease is at risk.
fn renewal_period(lease: Duration) -> Duration {
    lease / 3
}

/// How long a run's lease may go unconfirmed before the replica stops the
/// run: a lease minus one renewal period (two renewals in a row failed, or
/// still wait for the store). A lease counts from when the store ran the
/// renewal, after it was sent, so it has at least a renewal period left.
fn fence_after(lease: Duration) -> Duration {
    lease - renewal_period(lease)
}

/// How often runs are checked against [`fence_after`]: a quarter renewal
/// period. A run stops at most three quarters of a lease after its lease
/// was last confirmed, a quarter lease (7.5 s by default) before the lease
/// can expire: room for a busy scheduler and clocks that run at slightly
/// different rates.
fn fence_check(lease: Duration) -> Duration {
    renewal_period(lease) / 4
}

/// Sessions expired per store call (one transaction); a sweep goes on
/// until a batch comes back short.
const EXPIRE_BATCH: u32 = 100;

/// A name for this process in the store: the host (the pod's name under
/// Kubernetes) and a random suffix, so a restarted pod is a new replica.
pub fn replica_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "hookwire".into());
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}", &id[..8])
}

/// The background tasks, stopped at the end of the drain.
#[derive(Default)]
pub struct Background {
    stop: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Background {
    pub async fn stop(&self) {
        self.stop.cancel();
        let tasks: Vec<JoinHandle<()>> = std::mem::take(&mut *self.tasks.locked());
        for t in tasks {
            let _ = t.await;
        }
    }
}

impl Engine {
    /// Stops the background work (also done at the end of a drain).
    pub async fn stop_background(&self) {
        self.background.stop().await;
    }

    /// Starts the replica's background work; call once, after `new`.
    pub fn start_background(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let stop = self.background.stop.clone();
        let mut tasks = self.background.tasks.locked();
        tasks.push(tokio::spawn(signal_loop(
            weak.clone(),
            stop.clone(),
            self.store.subscribe(),
            self.replica.clone(),
        )));
        let lease = self.config.server.run_lease;
        tasks.push(tokio::spawn(every(
            weak.clone(),
            stop.clone(),
            renewal_period(lease),
            "lease renewal",
            |e| async move { e.renew_leases().await },
        )));
        // Apart from the renewals: a renewal may wait for the store longer
        // than a lease (a Postgres pool waits 30 s for a connection).
        tasks.push(tokio::spawn(every(
            weak.clone(),
            stop.clone(),
            fence_check(lease),
            "the lease fence",
            move |e| async move { e.fence_runs(fence_after(lease)) },
        )));
        // Expired leases are looked for a few times per lease period: a
        // lost run is ended at most a quarter lease after its expiry.
        let reap = (lease / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
        tasks.push(tokio::spawn(every(
            weak.clone(),
            stop.clone(),
            reap,
            "the reaper",
            |e| async move { e.reap().await },
        )));
        if let Some(ttl) = self.config.server.session_ttl {
            let sweep = (ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
            tasks.push(tokio::spawn(every(
                weak,
                stop,
                sweep,
                "the session TTL sweep",
                move |e| async move { e.expire_sessions(ttl).await },
            )));
        }
    }

    /// Acts on the signals recorded for this replica's runs.
    async fn deliver_signals(&self) {
        if self.active_runs() == 0 {
            return;
        }
        let waiting = self.approvals.waiting();
        let signals = match self.store.signals(&self.replica, &waiting).await {
            Ok(s) => s,
            Err(e) => {
                self.store_warnings
                    .warn_replica("cannot read signals from the store", &e);
                return;
            }
        };
        for s in signals {
            match s {
                Signal::Cancel { run_id, reason } => self.cancel_local(&run_id, &reason),
                Signal::Approval {
                    run_id,
                    call_id,
                    decision,
                } => {
                    self.approvals.deliver(&run_id, &call_id, decision);
                }
            }
        }
    }

    async fn renew_leases(&self) {
        // A run recording its end is renewed too, until that end is
        // settled: the end may wait for the store longer than what is left
        // of the lease (under a burst on PostgreSQL, calls waited over 20 s
        // for a connection), and an end whose lease expired meanwhile was
        // refused and the run reaped as a lost replica's.
        let runs: Vec<_> = self
            .runs_in_flight()
            .into_iter()
            .filter(|r| !r.ledger.end_settled())
            .collect();
        // A few statements for all of them (`renew_all`), not one store
        // call per run: with 10 000 runs in flight that was 10 000 calls
        // every renewal period, queued with the runs' own writes.
        let leases: Vec<_> = runs.iter().map(|r| r.ledger.lease.clone()).collect();
        let asked = Instant::now();
        let held = match self.store.renew_all(&leases).await {
            Ok(held) => held,
            Err(e) => {
                for r in &runs {
                    r.ledger.warn("cannot renew the run's lease", &e);
                }
                return;
            }
        };
        for (r, held) in runs.iter().zip(held) {
            if held {
                r.ledger.confirm(asked);
                continue;
            }
            if r.ledger.is_ending() {
                // The run recorded its end while this renewal waited for
                // the store (under load: seconds, behind other calls).
                tracing::debug!(run = %r.run_id, "the run ended while its lease was renewed");
            } else {
                tracing::warn!(run = %r.run_id, "lost the run's lease; stopping it");
                r.interrupt(
                    "this replica lost the run's lease (another replica took the run over)",
                );
            }
        }
    }

    /// Stops the runs whose lease was not confirmed for `limit`: this
    /// replica cannot reach the store, and once the lease expires another
    /// replica may claim the run, end it and free its session. Stopped here
    /// (cancelled, as a lost lease is), the run starts nothing more, and its
    /// tool calls in flight are given up.
    fn fence_runs(&self, limit: Duration) {
        let mut stopped = 0usize;
        for r in self.runs_in_flight() {
            // Already stopping (or recording its end): nothing starts.
            if r.ledger.is_ending() || r.cancel.is_cancelled() {
                continue;
            }
            let unconfirmed = r.ledger.unconfirmed_for();
            if unconfirmed < limit {
                continue;
            }
            tracing::debug!(run = %r.run_id, ?unconfirmed, "the run's lease was not confirmed in time; stopping it");
            r.interrupt(FENCED);
            stopped += 1;
        }
        // One line per pass, however many runs: in an outage every run of
        // this replica stops at about the same time.
        if stopped > 0 {
            tracing::warn!(
                runs = stopped,
                "could not renew the runs' leases in time (the store is unreachable); stopped them before another replica may take them over"
            );
        }
    }

    /// Ends the runs of lost replicas.
    ///
    /// A batch at a time until none is left: one batch per pass (16 every
    /// 5 s) took the best part of an hour to free the sessions of a lost
    /// replica that held 10 000 runs.
    async fn reap(&self) {
        let mut ended = std::collections::BTreeMap::new();
        loop {
            let claimed = match self.store.claim_expired(&self.replica, REAP_BATCH).await {
                Ok(c) => c,
                Err(e) => {
                    self.store_warnings
                        .warn_replica("cannot look for expired runs", &e);
                    break;
                }
            };
            let more = claimed.len() >= REAP_BATCH as usize;
            // A claimed run holds a fresh lease, so it is not claimed again
            // in this loop even when its end cannot be written.
            let lost =
                futures::future::join_all(claimed.into_iter().map(|c| self.end_lost_run(c))).await;
            for replica in lost.into_iter().flatten() {
                *ended.entry(replica).or_insert(0u64) += 1;
            }
            if !more || self.background.stop.is_cancelled() {
                break;
            }
        }
        // One warning per pass, however many runs a lost replica held (each
        // run is logged at info).
        for (lost, runs) in ended {
            tracing::warn!(lost = %lost, runs, "ended a lost replica's runs as interrupted");
        }
    }

    /// Ends a claimed run; the replica it was lost with, if its end was
    /// recorded.
    async fn end_lost_run(&self, c: ClaimedRun) -> Option<String> {
        // Our own run whose lease we failed to renew: it stops here too (its
        // next write would be refused anyway).
        if let Some(r) = self.local_run(&c.lease.run_id) {
            r.interrupt("this replica could not renew the run's lease in time");
        }
        let reason = format!(
            "the replica running it ({}) was lost; its lease expired",
            c.lost_replica
        );
        let end = RunEnd {
            outcome: RunOutcome::Interrupted,
            reason: reason.clone(),
            usage: Default::default(),
            turns: 0,
        };
        // Ended `interrupted`, the run's staged tool batch is closed by the
        // store (a synthetic result for each call), as on every other path
        // that ends a run its replica could not finish.
        if let Err(e) = self.store.end_run(&c.lease, &[], &end).await {
            self.store_warnings
                .warn("cannot end a lost replica's run", &c.lease.run_id, &e);
            return None;
        }
        tracing::info!(
            run = %c.lease.run_id,
            session = %c.lease.session_id,
            lost = %c.lost_replica,
            "ended a lost replica's run as interrupted"
        );
        let lost = Some(c.lost_replica);
        let Some(session) = c.session else {
            return lost;
        };
        let Ok(agent) = self.agent(&session.agent) else {
            return lost;
        };
        let clients = self.session_hooks(agent, &session.extra_hooks);
        if clients.is_empty() {
            return lost;
        }
        let hooks = RunHooks::new(
            clients,
            EventContext {
                session_id: session.id.clone(),
                run_id: c.lease.run_id.clone(),
                agent: session.agent.clone(),
                ..Default::default()
            },
            Instant::now() + agent.config.event_budget,
            agent.config.event_budget,
            self.inst.clone(),
        );
        hooks.observe(0, EventKind::RunEnd, || Payload::RunEnd {
            outcome: RunOutcome::Interrupted,
            reason,
            final_text: String::new(),
            usage: Default::default(),
            turns: 0,
        });
        hooks.close();
        lost
    }

    /// Deletes the sessions idle past `ttl`, a batch at a time until none is
    /// left: one batch per sweep (100 a minute with a TTL of 4 minutes or
    /// more) fell behind any service that makes more sessions than that.
    async fn expire_sessions(&self, ttl: Duration) {
        loop {
            let gone = match self.store.expire_sessions(ttl, EXPIRE_BATCH).await {
                Ok(gone) => gone,
                Err(e) => {
                    self.store_warnings
                        .warn_replica("cannot expire idle sessions", &e);
                    return;
                }
            };
            let more = gone.len() >= EXPIRE_BATCH as usize;
            for s in gone {
                tracing::info!(session = %s.id, "session expired (server.session_ttl)");
                self.transcripts.forget(&s.id);
                self.session_end(&s, "expired", None);
            }
            if !more || self.background.stop.is_cancelled() {
                return;
            }
        }
    }
}

/// Delivers signals when the store hints that this replica has some, and
/// every [`POLL`] regardless.
async fn signal_loop(
    engine: Weak<Engine>,
    stop: CancellationToken,
    mut hints: tokio::sync::broadcast::Receiver<String>,
    me: String,
) {
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
            h = hints.recv() => match h {
                Ok(r) if r == me || r == crate::store::REREAD_ALL => {}
                Ok(_) => continue,
                // Missed hints: read the tables now.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    stop.cancelled().await;
                    return;
                }
            },
        }
        let Some(e) = engine.upgrade() else { return };
        contained("signal delivery", e.deliver_signals()).await;
    }
}

/// Calls `f` every `period` until stopped or `target` is gone (first call
/// at once); a call that panics is logged, and the next comes on time.
async fn every<T, F, Fut>(
    target: Weak<T>,
    stop: CancellationToken,
    period: Duration,
    what: &'static str,
    f: F,
) where
    F: Fn(Arc<T>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some(t) = target.upgrade() else { return };
        contained(what, f(t)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test(start_paused = true)]
    async fn periodic_work_goes_on_after_a_pass_panicked() {
        let calls = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let task = tokio::spawn(every(
            Arc::downgrade(&calls),
            stop.clone(),
            Duration::from_secs(1),
            "a test's work",
            |c: Arc<AtomicUsize>| async move {
                if c.fetch_add(1, Ordering::SeqCst) == 0 {
                    panic!("the first pass panics");
                }
            },
        ));
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert!(
            calls.load(Ordering::SeqCst) >= 3,
            "passes after the panic: {}",
            calls.load(Ordering::SeqCst)
        );
        stop.cancel();
        task.await
            .expect("the loop ended on its stop, not on the panic");
    }
}
