//! The in-process engine (`store: memory`): the same rules as the SQL
//! engines, nothing survives the process. For tests and throwaway runs.

use crate::lock::LockExt;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;

use super::{
    close_pending_turn, closes_staged_turn, not_asked_or_done, page_token, parse_page_token,
    ClaimedRun, NewSession, OwnerUsage, RunEnd, RunLease, SessionFilter, SessionPage, SessionStore,
    Signal, StoreError, StoreOptions,
};
use crate::agent::approvals::Decision;
use crate::agent::outcome::RunOutcome;
use crate::auth::quota;
use crate::message::Message;
use crate::session::Session;

struct Stored {
    session: Session,
    transcript: Vec<Message>,
    bytes: u64,
    last_active: Instant,
    /// The session's runs, so that removing it forgets them without a
    /// scan of every run.
    runs: Vec<String>,
}

struct MemRun {
    session_id: String,
    /// The session's owner (quotas).
    owner: String,
    replica: String,
    epoch: i64,
    lease_expires: Instant,
    ended: bool,
    /// The outcome and reason it ended with under `epoch`: the same end
    /// again is that end, repeated (see `SessionStore::end_run`).
    end: Option<(RunOutcome, String)>,
    cancel_reason: Option<String>,
    pending_turn: Option<Message>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Approval {
    Pending,
    Answered,
    Expired,
}

/// A run's approvals, by call id.
type Approvals = HashMap<String, (Approval, Option<Decision>)>;

#[derive(Default)]
struct Inner {
    sessions: HashMap<String, Stored>,
    /// Every run until its session is deleted or expires (a run still in
    /// flight stays even then): an end repeated is recognised by them.
    runs: HashMap<String, MemRun>,
    /// The runs not ended: what the replicas' periodic work (signals, the
    /// lease reaper) reads, so that it costs what is in flight, not every
    /// run since the process started (the SQL engines' partial indexes on
    /// `ended_ms IS NULL` do the same).
    live: HashSet<String>,
    /// The runs not ended with a cancel recorded: what the signal poll
    /// reads for cancels, so that every replica's poll (each 500 ms) costs
    /// the cancels pending, not every run in flight (the SQL engines'
    /// partial index `runs_cancelled` does the same).
    cancelling: HashSet<String>,
    /// By run id, so a run's approvals are found without a scan.
    approvals: HashMap<String, Approvals>,
    /// What each owner holds (quotas), kept as sessions and runs come and
    /// go, so that a quota check costs what that owner holds, not every
    /// session and run in the store.
    owners: HashMap<String, Owned>,
}

/// An owner's share of the store: what [`SessionStore::owner_usage`] counts.
#[derive(Default)]
struct Owned {
    sessions: u64,
    /// The owner's runs not ended, of sessions that still exist.
    live: HashSet<String>,
    /// When the owner's runs started, oldest first, deleted sessions'
    /// runs included (deleting sessions does not lower the run rate):
    /// starts older than [`quota::WINDOW`] are dropped as runs start and
    /// sessions go.
    started: VecDeque<Instant>,
}

impl Owned {
    /// Drops the starts no quota counts any more.
    fn prune(&mut self, now: Instant) {
        while self
            .started
            .front()
            .is_some_and(|t| now.duration_since(*t) >= quota::WINDOW)
        {
            self.started.pop_front();
        }
    }

    /// Whether nothing is left for a quota to count.
    fn is_empty(&self) -> bool {
        self.sessions == 0 && self.live.is_empty() && self.started.is_empty()
    }

    /// Runs started within `window` of `now` (at most [`quota::WINDOW`]:
    /// older starts are not kept).
    fn started_within(&self, now: Instant, window: Duration) -> usize {
        // Oldest first, so the ones within the window are a suffix.
        let older = self
            .started
            .partition_point(|t| now.duration_since(*t) >= window);
        self.started.len() - older
    }
}

pub struct MemoryStore {
    inner: Mutex<Inner>,
    options: StoreOptions,
    wake: broadcast::Sender<String>,
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn size(messages: &[Message]) -> Result<u64, StoreError> {
    let mut n = 0u64;
    for m in messages {
        n += serde_json::to_string(m)?.len() as u64;
    }
    Ok(n)
}

impl MemoryStore {
    pub fn new(options: StoreOptions) -> MemoryStore {
        MemoryStore {
            inner: Mutex::new(Inner::default()),
            options,
            wake: broadcast::channel(256).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent maps (every
        // operation checks before it mutates).
        self.inner.locked()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new(StoreOptions::default())
    }
}

impl Inner {
    /// The run, if `lease` still holds it.
    fn fenced(&mut self, lease: &RunLease) -> Result<&mut MemRun, StoreError> {
        match self.runs.get_mut(&lease.run_id) {
            Some(r) if r.epoch == lease.epoch && !r.ended => Ok(r),
            _ => Err(StoreError::LeaseLost(lease.run_id.clone())),
        }
    }

    /// The run, if `lease` still holds it and it may start work: no cancel
    /// recorded for it and its session still there (see
    /// [`SessionStore::check_run`]).
    fn may_start(&mut self, lease: &RunLease) -> Result<&mut MemRun, StoreError> {
        let session_gone = !self.sessions.contains_key(&lease.session_id);
        let r = self.fenced(lease)?;
        if let Some(reason) = &r.cancel_reason {
            return Err(StoreError::RunCancelled {
                run: lease.run_id.clone(),
                reason: reason.clone(),
            });
        }
        if session_gone {
            return Err(StoreError::SessionNotFound(lease.session_id.clone()));
        }
        Ok(r)
    }

    /// Forgets a removed session: its ended runs and their approvals, and
    /// its share of its owner's usage (a run still in flight stays until it
    /// ends, but no longer counts for the owner, as in the SQL engines).
    fn forget(&mut self, s: &Stored) {
        for id in &s.runs {
            if self.runs.get(id).is_some_and(|r| r.ended) {
                self.runs.remove(id);
                self.approvals.remove(id);
            }
        }
        let owner = &s.session.owner;
        let Some(o) = self.owners.get_mut(owner) else {
            return;
        };
        o.sessions = o.sessions.saturating_sub(1);
        for id in &s.runs {
            o.live.remove(id);
        }
        o.prune(Instant::now());
        if o.is_empty() {
            self.owners.remove(owner);
        }
    }
}

#[async_trait::async_trait]
impl SessionStore for MemoryStore {
    fn engine(&self) -> &'static str {
        "memory"
    }

    async fn create_session(&self, s: &NewSession) -> Result<Session, StoreError> {
        let now = now_ms();
        let session = Session {
            id: s.id.clone(),
            agent: s.agent.clone(),
            owner: s.owner.clone(),
            extra_hooks: s.extra_hooks.clone(),
            metadata: s.metadata.clone(),
            created_at_unix_ms: now,
            last_active_unix_ms: now,
            transcript: Vec::new(),
            run_count: 0,
            active_run: None,
        };
        let mut g = self.lock();
        let stored = Stored {
            session: session.clone(),
            transcript: Vec::new(),
            bytes: 0,
            last_active: Instant::now(),
            runs: Vec::new(),
        };
        if let Some(old) = g.sessions.insert(s.id.clone(), stored) {
            // Ids are fresh; should one repeat, the old session's share goes.
            g.forget(&old);
        }
        g.owners.entry(s.owner.clone()).or_default().sessions += 1;
        Ok(session)
    }

    async fn get_session(&self, id: &str) -> Result<Session, StoreError> {
        self.lock()
            .sessions
            .get(id)
            .map(|s| s.session.clone())
            .ok_or_else(|| StoreError::SessionNotFound(id.to_string()))
    }

    async fn list_sessions(&self, f: &SessionFilter) -> Result<SessionPage, StoreError> {
        let after = parse_page_token(&f.page_token)?;
        let limit = f.limit() as usize;
        let mut all: Vec<Session> = self
            .lock()
            .sessions
            .values()
            .map(|s| &s.session)
            .filter(|s| f.owner.as_ref().is_none_or(|o| &s.owner == o))
            .filter(|s| f.agent.as_ref().is_none_or(|a| &s.agent == a))
            .filter(|s| match &after {
                None => true,
                Some((ms, id)) => (s.created_at_unix_ms, &s.id) > (*ms, id),
            })
            .cloned()
            .collect();
        all.sort_by(|a, b| (a.created_at_unix_ms, &a.id).cmp(&(b.created_at_unix_ms, &b.id)));
        let mut next_page_token = String::new();
        if all.len() > limit {
            all.truncate(limit);
            if let Some(last) = all.last() {
                next_page_token = page_token(last);
            }
        }
        Ok(SessionPage {
            sessions: all,
            next_page_token,
        })
    }

    async fn run_session(&self, run_id: &str) -> Result<Session, StoreError> {
        let g = self.lock();
        g.runs
            .get(run_id)
            .filter(|r| !r.ended)
            .and_then(|r| g.sessions.get(&r.session_id))
            .map(|s| s.session.clone())
            .ok_or_else(|| StoreError::RunNotFound(run_id.to_string()))
    }

    async fn owner_usage(
        &self,
        owner: &str,
        window: Duration,
        cap: u64,
    ) -> Result<OwnerUsage, StoreError> {
        let mut g = self.lock();
        let Some(o) = g.owners.get_mut(owner) else {
            return Ok(OwnerUsage::default());
        };
        // An owner whose sessions are all gone is kept only for its recent
        // starts; the check that finds them expired lets it go.
        let now = Instant::now();
        o.prune(now);
        if o.is_empty() {
            g.owners.remove(owner);
            return Ok(OwnerUsage::default());
        }
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX).min(cap);
        Ok(OwnerUsage {
            sessions: o.sessions.min(cap),
            active_runs: count(o.live.len()),
            recent_runs: count(o.started_within(now, window)),
        })
    }

    async fn delete_session(&self, id: &str) -> Result<Session, StoreError> {
        let mut g = self.lock();
        let s = g
            .sessions
            .remove(id)
            .ok_or_else(|| StoreError::SessionNotFound(id.to_string()))?;
        g.forget(&s);
        Ok(s.session)
    }

    async fn transcript(&self, session_id: &str) -> Result<Vec<Message>, StoreError> {
        self.lock()
            .sessions
            .get(session_id)
            .map(|s| s.transcript.clone())
            .ok_or_else(|| StoreError::SessionNotFound(session_id.to_string()))
    }

    async fn transcript_after(
        &self,
        session_id: &str,
        from: u64,
    ) -> Result<Vec<Message>, StoreError> {
        let from = usize::try_from(from).unwrap_or(usize::MAX);
        self.lock()
            .sessions
            .get(session_id)
            .map(|s| s.transcript.get(from..).unwrap_or_default().to_vec())
            .ok_or_else(|| StoreError::SessionNotFound(session_id.to_string()))
    }

    async fn begin_run(
        &self,
        session_id: &str,
        run_id: &str,
        replica: &str,
    ) -> Result<RunLease, StoreError> {
        let mut g = self.lock();
        let limit = self.options.max_transcript_bytes;
        let s = g
            .sessions
            .get_mut(session_id)
            .ok_or_else(|| StoreError::SessionNotFound(session_id.to_string()))?;
        if let Some(run) = &s.session.active_run {
            return Err(StoreError::Busy {
                session: session_id.to_string(),
                run: run.clone(),
            });
        }
        if s.bytes >= limit {
            return Err(StoreError::TranscriptFull {
                session: session_id.to_string(),
                bytes: s.bytes,
                limit,
            });
        }
        s.session.active_run = Some(run_id.to_string());
        let owner = s.session.owner.clone();
        s.session.run_count += 1;
        s.session.last_active_unix_ms = now_ms();
        s.last_active = Instant::now();
        s.runs.push(run_id.to_string());
        let now = Instant::now();
        let o = match g.owners.get_mut(&owner) {
            Some(o) => o,
            None => g.owners.entry(owner.clone()).or_default(),
        };
        o.prune(now);
        o.started.push_back(now);
        o.live.insert(run_id.to_string());
        g.runs.insert(
            run_id.to_string(),
            MemRun {
                session_id: session_id.to_string(),
                owner,
                replica: replica.to_string(),
                epoch: 1,
                lease_expires: Instant::now() + self.options.lease,
                ended: false,
                end: None,
                cancel_reason: None,
                pending_turn: None,
            },
        );
        g.live.insert(run_id.to_string());
        Ok(RunLease {
            run_id: run_id.to_string(),
            session_id: session_id.to_string(),
            epoch: 1,
        })
    }

    async fn renew(&self, lease: &RunLease) -> Result<(), StoreError> {
        let mut g = self.lock();
        g.fenced(lease)?.lease_expires = Instant::now() + self.options.lease;
        Ok(())
    }

    async fn renew_all(&self, leases: &[RunLease]) -> Result<Vec<bool>, StoreError> {
        let mut g = self.lock();
        let until = Instant::now() + self.options.lease;
        Ok(leases
            .iter()
            .map(|l| g.fenced(l).map(|r| r.lease_expires = until).is_ok())
            .collect())
    }

    async fn append(&self, lease: &RunLease, messages: &[Message]) -> Result<(), StoreError> {
        if messages.is_empty() {
            return Ok(());
        }
        let adding = size(messages)?;
        let limit = self.options.max_transcript_bytes;
        let mut g = self.lock();
        g.fenced(lease)?;
        let s = g
            .sessions
            .get(&lease.session_id)
            .ok_or_else(|| StoreError::SessionNotFound(lease.session_id.clone()))?;
        if s.session.active_run.as_deref() != Some(lease.run_id.as_str()) {
            return Err(StoreError::LeaseLost(lease.run_id.clone()));
        }
        if s.bytes + adding > limit {
            return Err(StoreError::TranscriptFull {
                session: lease.session_id.clone(),
                bytes: s.bytes,
                limit,
            });
        }
        let r = g.fenced(lease)?;
        r.lease_expires = Instant::now() + self.options.lease;
        // The staged turn (if any) is now part of these messages.
        r.pending_turn = None;
        let Some(s) = g.sessions.get_mut(&lease.session_id) else {
            return Err(StoreError::SessionNotFound(lease.session_id.clone()));
        };
        s.bytes += adding;
        s.transcript.extend_from_slice(messages);
        s.session.last_active_unix_ms = now_ms();
        s.last_active = Instant::now();
        Ok(())
    }

    async fn stage_turn(&self, lease: &RunLease, turn: Option<&Message>) -> Result<(), StoreError> {
        let mut g = self.lock();
        let r = g.may_start(lease)?;
        r.pending_turn = turn.cloned();
        r.lease_expires = Instant::now() + self.options.lease;
        Ok(())
    }

    async fn check_run(&self, lease: &RunLease) -> Result<(), StoreError> {
        self.lock().may_start(lease).map(|_| ())
    }

    async fn end_run(
        &self,
        lease: &RunLease,
        messages: &[Message],
        end: &RunEnd,
    ) -> Result<(), StoreError> {
        let adding = size(messages)?;
        let mut g = self.lock();
        if g.runs.get(&lease.run_id).is_some_and(|r| {
            r.epoch == lease.epoch
                && r.end
                    .as_ref()
                    .is_some_and(|(o, why)| *o == end.outcome && *why == end.reason)
        }) {
            return Ok(());
        }
        if !g.runs.contains_key(&lease.run_id) && !g.sessions.contains_key(&lease.session_id) {
            // Neither the run nor its session is left: the session was
            // deleted and the run's end recorded (and the run forgotten
            // with it, below) already.
            return Ok(());
        }
        let staged = &g.fenced(lease)?.pending_turn;
        let closing = if closes_staged_turn(end.outcome) {
            close_pending_turn(staged.clone())
        } else {
            Vec::new()
        };
        let adding = adding + size(&closing)?;
        let Inner {
            runs,
            live,
            cancelling,
            owners,
            ..
        } = &mut *g;
        if let Some(r) = runs.get_mut(&lease.run_id) {
            r.ended = true;
            r.end = Some((end.outcome, end.reason.clone()));
            r.pending_turn = None;
            if let Some(o) = owners.get_mut(&r.owner) {
                o.live.remove(&lease.run_id);
            }
        }
        live.remove(&lease.run_id);
        cancelling.remove(&lease.run_id);
        for (state, _) in g
            .approvals
            .get_mut(&lease.run_id)
            .into_iter()
            .flat_map(|a| a.values_mut())
        {
            if *state == Approval::Pending {
                *state = Approval::Expired;
            }
        }
        match g.sessions.get_mut(&lease.session_id) {
            Some(s) => {
                if s.session.active_run.as_deref() == Some(lease.run_id.as_str()) {
                    s.session.active_run = None;
                    s.bytes += adding;
                    s.transcript.extend_from_slice(messages);
                    s.transcript.extend(closing);
                    s.session.last_active_unix_ms = now_ms();
                    s.last_active = Instant::now();
                }
            }
            // Deleted meanwhile: the run goes as its session's ended runs
            // went, instead of staying behind for good.
            None => {
                g.runs.remove(&lease.run_id);
                g.approvals.remove(&lease.run_id);
            }
        }
        Ok(())
    }

    async fn request_approval(&self, lease: &RunLease, call_id: &str) -> Result<(), StoreError> {
        let mut g = self.lock();
        g.may_start(lease)?;
        g.approvals
            .entry(lease.run_id.clone())
            .or_default()
            .insert(call_id.to_string(), (Approval::Pending, None));
        drop(g);
        let _ = self.wake.send(super::asked_hint(&lease.run_id));
        Ok(())
    }

    async fn resolve_approval(
        &self,
        run_id: &str,
        call_id: &str,
        d: &Decision,
    ) -> Result<(), StoreError> {
        let replica = {
            let mut g = self.lock();
            match g.approvals.get_mut(run_id).and_then(|a| a.get_mut(call_id)) {
                Some(a) if a.0 == Approval::Pending => *a = (Approval::Answered, Some(d.clone())),
                Some(_) => {
                    return Err(StoreError::ApprovalNotPending {
                        run_id: run_id.to_string(),
                        call_id: call_id.to_string(),
                    })
                }
                None => {
                    // Only a run that may still ask: not ended, no cancel.
                    let may_ask = g.runs.get(run_id).is_some_and(|r| {
                        !r.ended
                            && r.cancel_reason.is_none()
                            && g.sessions.contains_key(&r.session_id)
                    });
                    return Err(not_asked_or_done(may_ask, run_id, call_id));
                }
            }
            g.runs.get(run_id).map(|r| r.replica.clone())
        };
        if let Some(r) = replica {
            let _ = self.wake.send(r);
        }
        Ok(())
    }

    async fn expire_approval(
        &self,
        lease: &RunLease,
        call_id: &str,
    ) -> Result<Option<Decision>, StoreError> {
        let mut g = self.lock();
        g.fenced(lease)?;
        match g
            .approvals
            .get_mut(&lease.run_id)
            .and_then(|a| a.get_mut(call_id))
        {
            Some(a) if a.0 == Approval::Pending => {
                a.0 = Approval::Expired;
                Ok(None)
            }
            Some(a) => Ok(a.1.clone()),
            None => Ok(None),
        }
    }

    async fn request_cancel(&self, run_id: &str, reason: &str) -> Result<(), StoreError> {
        let replica = {
            let mut g = self.lock();
            let r = match g.runs.get_mut(run_id) {
                Some(r) if !r.ended => r,
                _ => return Err(StoreError::RunNotFound(run_id.to_string())),
            };
            r.cancel_reason.get_or_insert_with(|| reason.to_string());
            let replica = r.replica.clone();
            g.cancelling.insert(run_id.to_string());
            for a in g
                .approvals
                .get_mut(run_id)
                .into_iter()
                .flat_map(|a| a.values_mut())
            {
                if a.0 == Approval::Pending {
                    *a = (
                        Approval::Answered,
                        Some(Decision {
                            approve: false,
                            note: "the run was cancelled".into(),
                        }),
                    );
                }
            }
            replica
        };
        let _ = self.wake.send(replica);
        Ok(())
    }

    async fn signals(
        &self,
        replica: &str,
        waiting: &[(String, String)],
    ) -> Result<Vec<Signal>, StoreError> {
        let g = self.lock();
        let mine = |id: &str| g.runs.get(id).filter(|r| !r.ended && r.replica == replica);
        let mut out = Vec::new();
        for id in &g.cancelling {
            if let Some(reason) = mine(id).and_then(|r| r.cancel_reason.as_ref()) {
                out.push(Signal::Cancel {
                    run_id: id.clone(),
                    reason: reason.clone(),
                });
            }
        }
        // Cancels first, as the SQL engines answer.
        for (run, call) in waiting {
            if mine(run).is_none() {
                continue;
            }
            if let Some((Approval::Answered, Some(d))) =
                g.approvals.get(run).and_then(|a| a.get(call))
            {
                out.push(Signal::Approval {
                    run_id: run.clone(),
                    call_id: call.clone(),
                    decision: d.clone(),
                });
            }
        }
        Ok(out)
    }

    async fn claim_expired(
        &self,
        replica: &str,
        limit: u32,
    ) -> Result<Vec<ClaimedRun>, StoreError> {
        let mut g = self.lock();
        let now = Instant::now();
        let lease = self.options.lease;
        let expired: Vec<String> = g
            .live
            .iter()
            .filter(|id| g.runs.get(*id).is_some_and(|r| r.lease_expires < now))
            .take(limit as usize)
            .cloned()
            .collect();
        let mut out = Vec::new();
        for id in expired {
            let Some(r) = g.runs.get_mut(&id) else {
                continue;
            };
            r.epoch += 1;
            let lost_replica = std::mem::replace(&mut r.replica, replica.to_string());
            r.lease_expires = now + lease;
            let (session_id, epoch, pending_turn) =
                (r.session_id.clone(), r.epoch, r.pending_turn.clone());
            out.push(ClaimedRun {
                session: g.sessions.get(&session_id).map(|s| s.session.clone()),
                lease: RunLease {
                    run_id: id,
                    session_id,
                    epoch,
                },
                lost_replica,
                pending_turn,
            });
        }
        Ok(out)
    }

    async fn expire_sessions(&self, ttl: Duration, limit: u32) -> Result<Vec<Session>, StoreError> {
        let mut g = self.lock();
        let now = Instant::now();
        let idle: Vec<String> = g
            .sessions
            .iter()
            .filter(|(_, s)| {
                s.session.active_run.is_none() && now.duration_since(s.last_active) > ttl
            })
            .map(|(k, _)| k.clone())
            .take(limit as usize)
            .collect();
        let mut out = Vec::new();
        for id in &idle {
            if let Some(s) = g.sessions.remove(id) {
                g.forget(&s);
                out.push(s.session);
            }
        }
        Ok(out)
    }

    fn subscribe(&self) -> broadcast::Receiver<String> {
        self.wake.subscribe()
    }

    async fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(id: &str) -> NewSession {
        NewSession {
            id: id.into(),
            agent: "a".into(),
            owner: "o".into(),
            extra_hooks: Vec::new(),
            metadata: Default::default(),
        }
    }

    fn ended() -> RunEnd {
        RunEnd {
            outcome: RunOutcome::Completed,
            reason: String::new(),
            usage: Default::default(),
            turns: 1,
        }
    }

    /// A run in flight when its session is deleted is forgotten when it
    /// ends, with its approvals, as the SQL engines delete its row.
    #[tokio::test]
    async fn a_deleted_sessions_run_is_forgotten_when_it_ends() {
        let s = MemoryStore::default();
        s.create_session(&session("s")).await.unwrap();
        let l = s.begin_run("s", "r", "A").await.unwrap();
        s.request_approval(&l, "c").await.unwrap();
        s.delete_session("s").await.unwrap();
        assert!(s.lock().runs.contains_key("r"), "in flight, it stays");
        s.end_run(&l, &[], &ended()).await.unwrap();
        let g = s.lock();
        assert!(!g.runs.contains_key("r") && !g.approvals.contains_key("r"));
    }

    /// What the replicas read every few hundred milliseconds (signals,
    /// expired leases) is indexed by the runs in flight, and the cancels by
    /// the runs in flight with one recorded; ended runs, and the approvals
    /// of sessions that expired, are not kept there.
    #[tokio::test(start_paused = true)]
    async fn the_periodic_reads_see_only_runs_in_flight() {
        let s = MemoryStore::default();
        for i in 0..3 {
            s.create_session(&session(&format!("s{i}"))).await.unwrap();
        }
        let done = s.begin_run("s0", "r0", "A").await.unwrap();
        s.request_approval(&done, "c").await.unwrap();
        s.end_run(&done, &[], &ended()).await.unwrap();
        let held = s.begin_run("s1", "r1", "A").await.unwrap();
        s.request_approval(&held, "c").await.unwrap();
        s.resolve_approval(
            "r1",
            "c",
            &Decision {
                approve: true,
                note: String::new(),
            },
        )
        .await
        .unwrap();
        s.request_cancel("r1", "stop").await.unwrap();
        assert_eq!(s.lock().live, HashSet::from(["r1".to_string()]));
        assert_eq!(s.lock().cancelling, HashSet::from(["r1".to_string()]));
        let signals = s
            .signals("A", &[("r1".to_string(), "c".to_string())])
            .await
            .unwrap();
        assert!(
            matches!(&signals[..], [Signal::Cancel { run_id, .. }, Signal::Approval { call_id, .. }] if run_id == "r1" && call_id == "c"),
            "{signals:?}"
        );

        // s0 (its run ended) and s2 (never ran) expire; s1 is busy.
        tokio::time::advance(Duration::from_secs(120)).await;
        let gone = s
            .expire_sessions(Duration::from_secs(60), 10)
            .await
            .unwrap();
        assert_eq!(gone.len(), 2);
        {
            let g = s.lock();
            assert!(!g.runs.contains_key("r0") && !g.approvals.contains_key("r0"));
            assert!(g.runs.contains_key("r1") && g.approvals.contains_key("r1"));
        }

        // The cancelled run's end takes it out of both indexes: the poll
        // then reads nothing.
        s.end_run(&held, &[], &ended()).await.unwrap();
        assert!(s.lock().live.is_empty() && s.lock().cancelling.is_empty());
        assert!(s.signals("A", &[]).await.unwrap().is_empty());
    }

    /// A quota check reads the owner's share, kept as runs start and end:
    /// starts older than the quota window are dropped as new ones come,
    /// deleted sessions' starts stay for the window, and an owner whose
    /// sessions are all gone leaves nothing behind once they are older.
    #[tokio::test(start_paused = true)]
    async fn an_owners_usage_is_kept_not_counted() {
        let s = MemoryStore::default();
        s.create_session(&session("s0")).await.unwrap();
        s.create_session(&session("s1")).await.unwrap();
        for i in 0..3 {
            let l = s.begin_run("s0", &format!("r{i}"), "A").await.unwrap();
            s.end_run(&l, &[], &ended()).await.unwrap();
            tokio::time::advance(Duration::from_secs(20)).await;
        }
        let usage = |s: &MemoryStore, window| {
            let g = s.lock();
            let o = &g.owners["o"];
            (
                o.sessions,
                o.live.len(),
                o.started_within(Instant::now(), window),
                o.started.len(),
            )
        };
        // Started 60, 40 and 20 s ago: the window counts the last two.
        assert_eq!(usage(&s, quota::WINDOW), (2, 0, 2, 3));
        assert_eq!(usage(&s, Duration::from_secs(30)), (2, 0, 1, 3));
        // The next start drops the one no window keeps.
        let held = s.begin_run("s1", "r3", "A").await.unwrap();
        assert_eq!(usage(&s, quota::WINDOW), (2, 1, 3, 3));
        assert_eq!(
            s.owner_usage("o", quota::WINDOW, u64::MAX).await.unwrap(),
            OwnerUsage {
                sessions: 2,
                active_runs: 1,
                recent_runs: 3,
            }
        );
        s.end_run(&held, &[], &ended()).await.unwrap();
        // Deleted sessions' starts stay for the window: deleting sessions
        // does not lower the run rate.
        s.delete_session("s0").await.unwrap();
        assert_eq!(usage(&s, quota::WINDOW), (1, 0, 3, 3));
        s.delete_session("s1").await.unwrap();
        assert_eq!(usage(&s, quota::WINDOW), (0, 0, 3, 3));
        assert!(s.lock().runs.is_empty());
        // Once they are older than the window, the next check lets the
        // owner go.
        tokio::time::advance(quota::WINDOW).await;
        assert_eq!(
            s.owner_usage("o", quota::WINDOW, u64::MAX).await.unwrap(),
            OwnerUsage::default()
        );
        assert!(s.lock().owners.is_empty());
    }

    /// What a step of the property below does.
    #[derive(Clone, Debug)]
    enum Op {
        Create { owner: u8 },
        Begin { session: u8 },
        End { run: u8 },
        Delete { session: u8 },
        Expire,
        Wait { secs: u8 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            1 => (0..3u8).prop_map(|owner| Op::Create { owner }),
            3 => any::<u8>().prop_map(|session| Op::Begin { session }),
            2 => any::<u8>().prop_map(|run| Op::End { run }),
            1 => any::<u8>().prop_map(|session| Op::Delete { session }),
            1 => Just(Op::Expire),
            1 => (0..40u8).prop_map(|secs| Op::Wait { secs }),
        ]
    }

    /// A run as the property's model sees it.
    struct Modeled {
        session: String,
        owner: String,
        started: Duration,
        ended: bool,
        lease: RunLease,
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Whatever sessions and runs come and go, each owner's usage is what
        /// counting the way the SQL engines count gives: sessions that
        /// exist, their runs not ended, and the owner's runs started within
        /// the window, deleted sessions' included (checked at the whole
        /// window and a shorter one).
        #[test]
        fn an_owners_usage_is_what_counting_gives(ops in proptest::collection::vec(op(), 1..80)) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            rt.block_on(async {
                let s = MemoryStore::default();
                let t0 = Instant::now();
                let (mut sessions, mut runs) = (Vec::<(String, String)>::new(), Vec::<Modeled>::new());
                let mut alive = HashSet::<String>::new();
                for op in ops {
                    match op {
                        Op::Create { owner } => {
                            let id = format!("s{}", sessions.len());
                            let owner = format!("o{owner}");
                            let mut n = session(&id);
                            n.owner = owner.clone();
                            s.create_session(&n).await.unwrap();
                            alive.insert(id.clone());
                            sessions.push((id, owner));
                        }
                        Op::Begin { session } if !sessions.is_empty() => {
                            let (id, owner) = &sessions[session as usize % sessions.len()];
                            let run = format!("r{}", runs.len());
                            if let Ok(lease) = s.begin_run(id, &run, "A").await {
                                runs.push(Modeled {
                                    session: id.clone(),
                                    owner: owner.clone(),
                                    started: t0.elapsed(),
                                    ended: false,
                                    lease,
                                });
                            }
                        }
                        Op::End { run } if !runs.is_empty() => {
                            let i = run as usize % runs.len();
                            let r = &mut runs[i];
                            if !r.ended {
                                s.end_run(&r.lease, &[], &ended()).await.unwrap();
                                r.ended = true;
                            }
                        }
                        Op::Delete { session } if !sessions.is_empty() => {
                            let (id, _) = &sessions[session as usize % sessions.len()];
                            let gone = s.delete_session(id).await.is_ok();
                            assert_eq!(gone, alive.remove(id));
                        }
                        Op::Expire => {
                            for x in s.expire_sessions(Duration::from_secs(30), 100).await.unwrap() {
                                assert!(alive.remove(&x.id));
                            }
                        }
                        Op::Wait { secs } => {
                            tokio::time::advance(Duration::from_secs(secs.into())).await;
                        }
                        _ => {}
                    }
                    let now = t0.elapsed();
                    for owner in ["o0", "o1", "o2"] {
                        for window in [quota::WINDOW, Duration::from_secs(25)] {
                            let theirs = || runs.iter().filter(|r| r.owner == owner);
                            let want = OwnerUsage {
                                sessions: sessions
                                    .iter()
                                    .filter(|(id, o)| o == owner && alive.contains(id))
                                    .count() as u64,
                                active_runs: theirs()
                                    .filter(|r| !r.ended && alive.contains(&r.session))
                                    .count() as u64,
                                // Deleted sessions' runs too.
                                recent_runs: theirs().filter(|r| now - r.started < window).count() as u64,
                            };
                            assert_eq!(s.owner_usage(owner, window, u64::MAX).await.unwrap(), want, "{owner} {window:?}");
                            let capped = OwnerUsage {
                                sessions: want.sessions.min(2),
                                active_runs: want.active_runs.min(2),
                                recent_runs: want.recent_runs.min(2),
                            };
                            assert_eq!(s.owner_usage(owner, window, 2).await.unwrap(), capped, "{owner} {window:?} capped");
                        }
                    }
                }
                // Nothing is kept for an owner whose sessions are all gone
                // once its starts are older than the window.
                tokio::time::advance(quota::WINDOW).await;
                for owner in ["o0", "o1", "o2"] {
                    s.owner_usage(owner, quota::WINDOW, u64::MAX).await.unwrap();
                }
                let g = s.lock();
                for o in g.owners.keys() {
                    assert!(sessions.iter().any(|(id, x)| x == o && alive.contains(id)), "{o}");
                }
            });
        }
    }
}
