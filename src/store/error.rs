//! What can go wrong in the session store, in domain terms: callers never
//! see a driver error type.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    #[error("session `{0}` not found (it may have been deleted or expired)")]
    SessionNotFound(String),
    #[error("session `{session}` already has a run in progress (`{run}`); wait for it or cancel it with CancelRun")]
    Busy { session: String, run: String },
    #[error("run `{0}` not found (it may have finished)")]
    RunNotFound(String),
    #[error("no pending approval for call `{call_id}` in run `{run_id}` (already answered, timed out, cancelled, or never asked)")]
    ApprovalNotPending { run_id: String, call_id: String },
    #[error("session `{session}`'s transcript holds {bytes} bytes and may not pass {limit} (server.max_transcript_bytes); start a new session")]
    TranscriptFull {
        session: String,
        bytes: u64,
        limit: u64,
    },
    /// The run's lease is no longer this holder's: another replica claimed
    /// it (ours expired) or the run was ended. Nothing was written.
    #[error("run `{0}`: this replica no longer holds the run's lease (another replica took it over or ended it); nothing was written")]
    LeaseLost(String),
    /// A cancel is recorded for the run (CancelRun, on any replica, or its
    /// session deleted): a write that would start work for it (a tool
    /// batch, an approval request) is refused, so nothing starts after
    /// the cancel was answered OK. Nothing was written.
    #[error("run `{run}` was cancelled ({reason}); nothing was written")]
    RunCancelled { run: String, reason: String },
    #[error(
        "invalid page token (pass back the next_page_token of a previous response, unchanged)"
    )]
    BadPageToken,
    /// The database cannot be reached or refused the work for a transient
    /// reason; the write did not happen or its outcome is unknown.
    #[error("session store unavailable: {0}")]
    Unavailable(String),
    /// A stored value this version cannot read, or a database error that is
    /// not transient.
    #[error("session store error: {0}")]
    Backend(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> StoreError {
        match &e {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e.to_string()),
            sqlx::Error::Database(d) => match d.code().as_deref() {
                // SQLite busy/locked; Postgres serialization failure,
                // deadlock, statement timeout (query_canceled), admin
                // shutdown, cannot connect now.
                Some("5") | Some("6") | Some("40001") | Some("40P01") | Some("57014")
                | Some("57P01") | Some("57P03") => StoreError::Unavailable(e.to_string()),
                _ => StoreError::Backend(e.to_string()),
            },
            _ => StoreError::Backend(e.to_string()),
        }
    }
}

impl From<serde_json::Error> for StoreError {
    fn from(e: serde_json::Error) -> StoreError {
        StoreError::Backend(format!("a stored value cannot be read: {e}"))
    }
}
