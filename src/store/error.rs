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
    /// The run is active and has asked nothing for this call (yet): an
    /// answer that came before its question.
    #[error("no approval was asked for call `{call_id}` in run `{run_id}` within {held} of the answer (an answer waits that long for its question)", held = humantime_serde::re::humantime::format_duration(crate::agent::approvals::EARLY_ANSWER_HOLD))]
    ApprovalNotAsked { run_id: String, call_id: String },
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
            sqlx::Error::Database(d) => {
                let code = d.code().unwrap_or_default();
                let transient = if d.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                    sqlite_transient(&code)
                } else {
                    postgres_transient(&code)
                };
                if transient {
                    StoreError::Unavailable(e.to_string())
                } else {
                    StoreError::Backend(e.to_string())
                }
            }
            _ => StoreError::Backend(e.to_string()),
        }
    }
}

/// Whether a SQLite result code is worth retrying: busy or locked. sqlx
/// reports the extended code (SQLITE_BUSY_SNAPSHOT is 517, BUSY_TIMEOUT
/// 773, LOCKED_SHAREDCACHE 262, ...), whose low byte is the primary one;
/// matching the primary codes alone took those for permanent errors.
fn sqlite_transient(code: &str) -> bool {
    const SQLITE_BUSY: i32 = 5;
    const SQLITE_LOCKED: i32 = 6;
    code.parse::<i32>()
        .is_ok_and(|c| matches!(c & 0xff, SQLITE_BUSY | SQLITE_LOCKED))
}

/// Whether a PostgreSQL SQLSTATE is worth retrying: the transaction lost a
/// race (serialization failure, deadlock), the statement waited too long
/// (statement timeout), the server is going away or not ready (admin or
/// crash shutdown, starting up, too many connections), or the node is no
/// longer the primary (read-only transaction: a failover left this
/// connection on the demoted node; a new connection reaches the new one).
fn postgres_transient(code: &str) -> bool {
    matches!(
        code,
        "40001" | "40P01" | "57014" | "57P01" | "57P02" | "57P03" | "53300" | "25006"
    )
}

impl From<serde_json::Error> for StoreError {
    fn from(e: serde_json::Error) -> StoreError {
        StoreError::Backend(format!("a stored value cannot be read: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_busy_and_locked_are_transient_in_every_extended_form() {
        // BUSY, BUSY_RECOVERY, BUSY_SNAPSHOT, BUSY_TIMEOUT; LOCKED,
        // LOCKED_SHAREDCACHE, LOCKED_VTAB.
        for code in ["5", "261", "517", "773", "6", "262", "518"] {
            assert!(sqlite_transient(code), "{code}");
        }
        // CONSTRAINT_UNIQUE, FULL, CORRUPT, IOERR_WRITE, READONLY, a
        // SQLSTATE, nothing.
        for code in ["2067", "13", "11", "778", "8", "40001", ""] {
            assert!(!sqlite_transient(code), "{code}");
        }
    }

    #[test]
    fn postgres_failover_and_contention_are_transient() {
        for code in [
            "40001", "40P01", "57014", "57P01", "57P02", "57P03", "53300", "25006",
        ] {
            assert!(postgres_transient(code), "{code}");
        }
        // unique violation, undefined table, syntax error, SQLite's BUSY.
        for code in ["23505", "42P01", "42601", "5", ""] {
            assert!(!postgres_transient(code), "{code}");
        }
    }

    /// A real SQLite error arrives with its extended code: a write in a
    /// read transaction whose snapshot another connection's commit made
    /// stale fails SQLITE_BUSY_SNAPSHOT (517) at once, and a retry (a new
    /// transaction) succeeds, so it is `Unavailable`, not permanent.
    #[tokio::test]
    async fn a_stale_sqlite_snapshot_is_unavailable() {
        use sqlx::{Connection as _, Executor as _};
        let dir = tempfile::tempdir().unwrap();
        let connect = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(dir.path().join("t.db"))
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
        let mut a = sqlx::SqliteConnection::connect_with(&connect)
            .await
            .unwrap();
        let mut b = sqlx::SqliteConnection::connect_with(&connect)
            .await
            .unwrap();
        a.execute("CREATE TABLE t (x INTEGER)").await.unwrap();
        let mut tx = a.begin().await.unwrap();
        tx.execute("SELECT COUNT(*) FROM t").await.unwrap();
        b.execute("INSERT INTO t VALUES (1)").await.unwrap();
        let e = tx.execute("INSERT INTO t VALUES (2)").await.unwrap_err();
        let code = match &e {
            sqlx::Error::Database(d) => d.code().unwrap_or_default().into_owned(),
            other => panic!("{other:?}"),
        };
        assert_eq!(code, "517", "{e}");
        assert!(
            matches!(StoreError::from(e), StoreError::Unavailable(_)),
            "a stale snapshot is worth a retry"
        );
    }
}
