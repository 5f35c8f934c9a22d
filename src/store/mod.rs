//! Where sessions, transcripts, runs, approvals and cancels live.
//!
//! One async trait, three engines chosen by the `store:` setting: `memory`
//! (tests, nothing survives the process), SQLite (the default: one replica,
//! survives restarts) and PostgreSQL (several replicas serve one service).
//! The tables hold the truth; the wake-ups sent through [`SessionStore::subscribe`]
//! are only hints that something changed for a replica (Postgres
//! LISTEN/NOTIFY, in-process for the others), and replicas poll as well.
//!
//! Writes of a run are fenced by its lease: every one names the lease's
//! epoch, and a write whose epoch is no longer the run's (another replica
//! claimed the run after the lease expired) changes nothing and answers
//! [`StoreError::LeaseLost`].

mod cache;
mod error;
mod memory;
mod migrations;
mod sql;
mod sqlite_conn;
mod waits;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;

pub use cache::{TranscriptCache, DEFAULT_CACHE_BYTES};
pub use error::StoreError;
pub use memory::MemoryStore;

use crate::agent::approvals::Decision;
use crate::agent::outcome::RunOutcome;
use crate::config::StoreSetting;
use crate::message::{Message, Usage};
use crate::session::Session;

/// What every engine needs beyond its location.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// How long a run's lease lasts without renewal (`server.run_lease`).
    pub lease: Duration,
    /// Largest transcript per session, in bytes of stored messages
    /// (`server.max_transcript_bytes`).
    pub max_transcript_bytes: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            lease: crate::config::DEFAULT_RUN_LEASE,
            max_transcript_bytes: crate::config::DEFAULT_MAX_TRANSCRIPT_BYTES,
        }
    }
}

/// The right to write for one run. `epoch` changes whenever another
/// replica claims the run, which fences out the previous holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunLease {
    pub run_id: String,
    pub session_id: String,
    pub epoch: i64,
}

impl RunLease {
    /// The lease [`SessionStore::begin_run`] hands out (every store starts
    /// a run at epoch 1), known before its answer arrives.
    pub fn first(session_id: &str, run_id: &str) -> RunLease {
        RunLease {
            run_id: run_id.to_string(),
            session_id: session_id.to_string(),
            epoch: 1,
        }
    }
}

/// How a run ended, as recorded.
#[derive(Clone, Debug, PartialEq)]
pub struct RunEnd {
    pub outcome: RunOutcome,
    pub reason: String,
    pub usage: Usage,
    pub turns: u32,
}

/// Which sessions to list, and which page.
#[derive(Clone, Debug, Default)]
pub struct SessionFilter {
    /// Only sessions of this principal.
    pub owner: Option<String>,
    /// Only sessions of this agent.
    pub agent: Option<String>,
    /// At most this many (clamped to 1..=[`MAX_PAGE_SIZE`]; 0 means
    /// [`DEFAULT_PAGE_SIZE`]).
    pub page_size: u32,
    /// A previous page's `next_page_token`; empty for the first page.
    pub page_token: String,
}

pub const DEFAULT_PAGE_SIZE: u32 = 100;
pub const MAX_PAGE_SIZE: u32 = 1000;

impl SessionFilter {
    pub fn limit(&self) -> u32 {
        match self.page_size {
            0 => DEFAULT_PAGE_SIZE,
            n => n.min(MAX_PAGE_SIZE),
        }
    }
}

/// One page of sessions (without transcripts), oldest first.
#[derive(Clone, Debug, Default)]
pub struct SessionPage {
    pub sessions: Vec<Session>,
    /// Empty on the last page.
    pub next_page_token: String,
}

/// Where a page ends: the (created, id) of its last session. Opaque to
/// clients.
pub(crate) fn page_token(s: &Session) -> String {
    format!("{}.{}", s.created_at_unix_ms, s.id)
}

pub(crate) fn parse_page_token(t: &str) -> Result<Option<(i64, String)>, StoreError> {
    if t.is_empty() {
        return Ok(None);
    }
    let (ms, id) = t.split_once('.').ok_or(StoreError::BadPageToken)?;
    let ms = ms.parse::<i64>().map_err(|_| StoreError::BadPageToken)?;
    if id.is_empty() {
        return Err(StoreError::BadPageToken);
    }
    Ok(Some((ms, id.to_string())))
}

/// Something a replica must act on for a run it executes, recorded by
/// whichever replica received the call.
#[derive(Clone, Debug, PartialEq)]
pub enum Signal {
    Cancel {
        run_id: String,
        reason: String,
    },
    Approval {
        run_id: String,
        call_id: String,
        decision: Decision,
    },
}

/// A run whose lease expired, now claimed by this replica so it can end it.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimedRun {
    pub lease: RunLease,
    /// The replica that held the lease before.
    pub lost_replica: String,
    /// The session's agent and extra hooks (for run_end), when the session
    /// still exists.
    pub session: Option<Session>,
    /// The model turn whose tool batch had not settled: ending the run
    /// `interrupted` gives its calls synthetic results (the store does,
    /// see [`SessionStore::end_run`]).
    pub pending_turn: Option<Message>,
}

/// What one principal holds, counted over every replica (quotas).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerUsage {
    /// Sessions it owns.
    pub sessions: u64,
    /// Active runs in its sessions (a deleted session's run, cancelled
    /// and ending, no longer counts).
    pub active_runs: u64,
    /// Runs it started within the window asked for, in sessions deleted
    /// since too: deleting sessions does not lower a principal's run
    /// rate. A deleted session's starts are kept for [`quota::WINDOW`]
    /// only, so a longer window counts those no further back.
    ///
    /// [`quota::WINDOW`]: crate::auth::quota::WINDOW
    pub recent_runs: u64,
}

/// A new session's record.
#[derive(Clone, Debug)]
pub struct NewSession {
    pub id: String,
    pub agent: String,
    pub owner: String,
    pub extra_hooks: Vec<String>,
    pub metadata: BTreeMap<String, String>,
}

#[async_trait::async_trait]
pub trait SessionStore: Send + Sync + 'static {
    /// `memory`, `sqlite` or `postgres`.
    fn engine(&self) -> &'static str;

    async fn create_session(&self, s: &NewSession) -> Result<Session, StoreError>;
    /// The session without its transcript.
    async fn get_session(&self, id: &str) -> Result<Session, StoreError>;
    async fn list_sessions(&self, filter: &SessionFilter) -> Result<SessionPage, StoreError>;
    /// The session (without its transcript) of an active run, wherever it
    /// executes: what access checks on CancelRun and ResolveApproval read.
    /// [`StoreError::RunNotFound`] when the run is unknown or has ended.
    async fn run_session(&self, run_id: &str) -> Result<Session, StoreError>;
    /// What `owner` holds now: sessions, active runs, and runs started
    /// within `window` (quotas that hold across replicas). Each count stops
    /// at `cap`: a quota only asks whether its limit is reached, and a
    /// count that reads no further than the limit costs no more than it,
    /// however much the principal keeps.
    async fn owner_usage(
        &self,
        owner: &str,
        window: Duration,
        cap: u64,
    ) -> Result<OwnerUsage, StoreError>;
    /// Deletes the session, its transcript and its approvals; returns what
    /// it was. Its runs' starts within [`crate::auth::quota::WINDOW`] stay
    /// counted in the owner's [`OwnerUsage::recent_runs`]. A run still active is left to end (its writes to the
    /// transcript become no-ops, and it goes when it ends); call
    /// [`SessionStore::request_cancel`] for it too, so its replica stops it.
    async fn delete_session(&self, id: &str) -> Result<Session, StoreError>;
    /// The committed transcript, in order; [`StoreError::SessionNotFound`]
    /// for an unknown session.
    async fn transcript(&self, session_id: &str) -> Result<Vec<Message>, StoreError>;
    /// The committed messages from position `from` on (the first message
    /// is 0), in order: what a reader holding the first `from` lacks.
    /// Committed messages never change and are numbered without gaps, so
    /// those first `from` stay valid whatever is appended (see
    /// [`TranscriptCache`]). An unknown session (deleted, perhaps, since
    /// the caller read it) is [`StoreError::SessionNotFound`], never an
    /// empty transcript.
    async fn transcript_after(
        &self,
        session_id: &str,
        from: u64,
    ) -> Result<Vec<Message>, StoreError>;

    /// Starts a run: the one active run of the session (enforced here),
    /// leased to `replica`.
    async fn begin_run(
        &self,
        session_id: &str,
        run_id: &str,
        replica: &str,
    ) -> Result<RunLease, StoreError>;
    /// Extends the lease by `StoreOptions::lease` from now (the database's
    /// clock).
    async fn renew(&self, lease: &RunLease) -> Result<(), StoreError>;
    /// Renews many leases at once (a replica's periodic renewal of its runs
    /// in flight): for each, in order, whether it still held; `false` where
    /// [`SessionStore::renew`] would answer [`StoreError::LeaseLost`] (the
    /// run ended, or another replica took it over). The engines renew them
    /// in a few statements; this default renews one at a time.
    async fn renew_all(&self, leases: &[RunLease]) -> Result<Vec<bool>, StoreError> {
        let mut held = Vec::with_capacity(leases.len());
        for l in leases {
            held.push(match self.renew(l).await {
                Ok(()) => true,
                Err(StoreError::LeaseLost(_)) => false,
                Err(e) => return Err(e),
            });
        }
        Ok(held)
    }
    /// Appends committed messages to the transcript (all or nothing). Like
    /// `stage_turn` and `request_approval`, it extends the lease as
    /// [`SessionStore::renew`] does when it writes (the engine counts such
    /// a write as a renewal).
    async fn append(&self, lease: &RunLease, messages: &[Message]) -> Result<(), StoreError>;
    /// Records (or clears) the model turn whose tool batch is executing:
    /// the last write before its tools start. Refused, like
    /// `request_approval`, for a run that may start nothing more (see
    /// [`SessionStore::check_run`]): its replica may not have heard of a
    /// cancel recorded elsewhere yet, and the store is where it is sure to.
    async fn stage_turn(&self, lease: &RunLease, turn: Option<&Message>) -> Result<(), StoreError>;
    /// Whether the run may still start work: [`StoreError::RunCancelled`]
    /// once a cancel is recorded for it, [`StoreError::SessionNotFound`]
    /// once its session is gone, [`StoreError::LeaseLost`] when `lease` no
    /// longer holds it. Reads only (the lease is not extended).
    async fn check_run(&self, lease: &RunLease) -> Result<(), StoreError>;
    /// Ends the run: appends `messages` (the last committed ones), records
    /// the outcome, denies approvals still pending and frees the session.
    /// The same end again under the same lease (outcome and reason equal)
    /// is `Ok` and changes nothing, so a call whose answer was lost can be
    /// repeated; any other end of an ended run is [`StoreError::LeaseLost`].
    /// A run whose session was deleted meanwhile is deleted as it ends
    /// (with its approvals); after that, any end of it is `Ok`: nothing is
    /// left to record or to refuse.
    ///
    /// A tool batch still staged (see [`SessionStore::stage_turn`]) is
    /// closed by an `interrupted` end, after `messages`: its turn and a
    /// synthetic error result for each call ([`close_pending_turn`]),
    /// whichever replica records the end (see [`closes_staged_turn`]). Any
    /// other end drops it: a batch that failed commits nothing.
    async fn end_run(
        &self,
        lease: &RunLease,
        messages: &[Message],
        end: &RunEnd,
    ) -> Result<(), StoreError>;

    /// A tool call of the run waits for approval. Refused as `stage_turn`
    /// is for a run that may start nothing more.
    async fn request_approval(&self, lease: &RunLease, call_id: &str) -> Result<(), StoreError>;
    /// Answers a pending approval; the first answer wins, later ones get
    /// [`StoreError::ApprovalNotPending`], as does an answer for a run that
    /// ended. An active run that asked nothing for the call yet gets
    /// [`StoreError::ApprovalNotAsked`] (see [`not_asked_or_done`]).
    async fn resolve_approval(
        &self,
        run_id: &str,
        call_id: &str,
        decision: &Decision,
    ) -> Result<(), StoreError>;
    /// The run gives up waiting: a still-pending approval becomes expired
    /// (`None`); one answered meanwhile returns its decision. Fenced like
    /// the run's writes: [`StoreError::LeaseLost`] for a holder that lost
    /// the run, which must then not act on an answer.
    async fn expire_approval(
        &self,
        lease: &RunLease,
        call_id: &str,
    ) -> Result<Option<Decision>, StoreError>;
    /// Records a cancel for an active run and denies its pending approvals.
    async fn request_cancel(&self, run_id: &str, reason: &str) -> Result<(), StoreError>;
    /// Cancels recorded for the active runs leased to `replica`, then the
    /// decisions recorded for `waiting`, the (run, call) approvals its runs
    /// wait for (of those runs only). What a replica polls: it reads what
    /// is cancelled or waited for, not every run in flight nor every
    /// approval ever answered.
    async fn signals(
        &self,
        replica: &str,
        waiting: &[(String, String)],
    ) -> Result<Vec<Signal>, StoreError>;

    /// Claims up to `limit` runs whose lease expired, for `replica` to end
    /// (its own too: one whose end could not be recorded, or whose renewals
    /// failed for a whole lease).
    async fn claim_expired(&self, replica: &str, limit: u32)
        -> Result<Vec<ClaimedRun>, StoreError>;
    /// Deletes up to `limit` sessions idle (no run, no activity) for longer
    /// than `ttl`; returns them. As with [`SessionStore::delete_session`],
    /// their runs' recent starts stay counted.
    async fn expire_sessions(&self, ttl: Duration, limit: u32) -> Result<Vec<Session>, StoreError>;

    /// Wake-up hints: the id of a replica that has something to act on,
    /// [`asked_hint`] once a run's approval request is recorded, or
    /// [`REREAD_ALL`] when hints may have been missed.
    fn subscribe(&self) -> broadcast::Receiver<String>;
    /// Closes connections (after the last write).
    async fn close(&self);
}

/// The hint every replica gets once a request for approval in `run_id` is
/// recorded: an answer that came before it, held on any replica, is tried
/// again at once (see `agent::early_answer`). Not a replica's id: the
/// signal loop ignores it.
pub fn asked_hint(run_id: &str) -> String {
    format!("asked:{run_id}")
}

/// The hint that stands for every other: sent when the store may have
/// lost hints (a PostgreSQL listener that lost its connection, once it
/// listens again), so whoever waits for one reads the store instead.
pub const REREAD_ALL: &str = "*";

/// Checks the store setting without touching the database (what `hookwire
/// config check` can say offline): a Postgres URL the driver accepts and a
/// password variable that is set when one is named; a SQLite path whose
/// directory exists or can be made (its nearest existing ancestor is a
/// directory) and that is not itself a directory. [`open`] makes the same
/// checks first.
pub fn check(setting: &StoreSetting) -> Result<(), StoreError> {
    match setting {
        StoreSetting::Memory => Ok(()),
        StoreSetting::Sqlite { path } => sql::check_sqlite_path(path),
        StoreSetting::Postgres {
            url, password_env, ..
        } => sql::check_postgres(url, password_env.as_deref()).map(|_| ()),
    }
}

/// Opens the configured store, creating or migrating its schema.
pub async fn open(
    setting: &StoreSetting,
    options: StoreOptions,
) -> Result<Arc<dyn SessionStore>, StoreError> {
    check(setting)?;
    match setting {
        StoreSetting::Memory => Ok(Arc::new(MemoryStore::new(options))),
        StoreSetting::Sqlite { path } => Ok(Arc::new(sql::SqlStore::sqlite(path, options).await?)),
        StoreSetting::Postgres {
            url,
            password_env,
            max_connections,
        } => Ok(Arc::new(
            sql::SqlStore::postgres(url, password_env.as_deref(), *max_connections, options)
                .await?,
        )),
    }
}

/// The synthetic result of a call whose replica was lost mid-batch. A
/// batch's results are recorded together when it settles, so a call
/// without one may have finished before the loss, or be running still on
/// a replica that is cut off: the model is told the outcome is unknown,
/// never that the call did not run (it might call the tool again).
pub const LOST_REPLICA_RESULT: &str =
    "outcome unknown: the replica running this call was lost before its result was recorded (it may have run; it is not retried)";

/// The refusal of an answer to a call no request is recorded for: the
/// question may still come while the run may start work (`active`: not
/// ended, no cancel recorded, its session there), since the hook that asks
/// tells its approver first; never after.
pub(crate) fn not_asked_or_done(active: bool, run_id: &str, call_id: &str) -> StoreError {
    let (run_id, call_id) = (run_id.to_string(), call_id.to_string());
    if active {
        StoreError::ApprovalNotAsked { run_id, call_id }
    } else {
        StoreError::ApprovalNotPending { run_id, call_id }
    }
}

/// Whether an end with `outcome` closes the run's staged tool batch
/// (records its turn with [`close_pending_turn`]) rather than dropping it.
///
/// `interrupted` is the end of a run its replica could not finish: lost
/// (the reaper ends it), cut off from the store (it stops itself before
/// its lease can expire), or shutting down with a call still executing.
/// The calls in flight were given up, so whether they ran is unknown, and
/// the transcript must say so whichever replica records the end: a turn
/// that vanished would let the model call the tool again, and an end that
/// lands on one path but not another would leave different transcripts
/// for the same loss. Every other outcome ends a batch the run itself
/// failed (a hook's terminate, a cancel, a timeout), and a failed batch
/// commits nothing.
pub(crate) fn closes_staged_turn(outcome: RunOutcome) -> bool {
    outcome == RunOutcome::Interrupted
}

/// The messages that close an interrupted run's staged tool batch: its
/// turn and a synthetic error result for each of its calls, so every call
/// has a result.
pub(crate) fn close_pending_turn(pending: Option<Message>) -> Vec<Message> {
    let Some(turn) = pending else {
        return Vec::new();
    };
    let results: Vec<crate::message::ToolResult> = turn
        .tool_calls()
        .map(|c| crate::message::ToolResult {
            call_id: c.id.clone(),
            name: c.name.clone(),
            content: LOST_REPLICA_RESULT.to_string(),
            is_error: true,
        })
        .collect();
    if results.is_empty() {
        return vec![turn];
    }
    vec![turn, Message::tool_results(results)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_tokens_round_trip_and_reject_garbage() {
        let s = Session {
            id: "abc".into(),
            created_at_unix_ms: 42,
            ..Default::default()
        };
        assert_eq!(
            parse_page_token(&page_token(&s)).unwrap(),
            Some((42, "abc".into()))
        );
        assert_eq!(parse_page_token("").unwrap(), None);
        for bad in ["x", "x.y", "1.", ".a"] {
            assert_eq!(
                parse_page_token(bad),
                Err(StoreError::BadPageToken),
                "{bad}"
            );
        }
    }
}
