//! The SQLite store's one connection, held behind an async mutex rather
//! than in a one-connection `sqlx` pool.
//!
//! sqlx runs each SQLite connection on a worker thread, so every command is
//! a round trip between threads (on a 2-vCPU machine, a wake-up of the
//! other core: tens of µs). Its pool adds two such round trips to every
//! store call, a ping when the connection is taken and another when it is
//! given back, and nothing can use the connection until the second
//! finishes. With one connection those pings are the longest part of a
//! short call and they serialize every run's start. A local file cannot
//! "hang up"; what the pings guard against is handled here instead:
//!
//! - A transaction dropped mid-way (its run was cancelled) queues its
//!   rollback on the worker, ahead of the next caller's commands.
//! - After an error from the database or the driver (I/O, a full disk, a
//!   crashed worker), the next call opens a new one: see [`Entry::settle`].
//! - A call that cannot get the connection within [`ACQUIRE_TIMEOUT`]
//!   (sqlx's default) fails `Unavailable` rather than wait behind a stuck
//!   statement forever.
//!
//! Lease renewals do not queue with the runs' calls ([`SqliteConn::lock_first`]):
//! under a burst of run starts the queue grows to seconds (7 s measured at
//! 10 000 starts), and a renewal that waits past what is left of its leases
//! stops every run it renews. PostgreSQL gives renewals a connection of
//! their own; SQLite cannot (a second connection's commit between another
//! transaction's read and write fails that transaction with
//! `SQLITE_BUSY_SNAPSHOT`), so they go first on this one instead.

use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sqlx::Connection as _;
use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard};

use super::StoreError;

/// How long a call waits for the connection before it gives up.
pub const ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

pub(super) struct SqliteConn {
    /// `None` once closed.
    slot: Mutex<Option<Entry>>,
    /// Where ordinary calls wait, in order: only the first of them waits on
    /// `slot`, so a call that goes first waits behind at most the call that
    /// holds the connection and that one.
    line: Mutex<()>,
    options: SqliteConnectOptions,
}

pub(super) struct Entry {
    conn: SqliteConnection,
    /// Set after an error that may mean the connection is gone; the next
    /// caller opens a new one.
    broken: bool,
}

/// The connection, held by one store call until it is dropped.
pub(super) type Held<'a> = MappedMutexGuard<'a, Entry>;

impl SqliteConn {
    pub fn new(conn: SqliteConnection, options: SqliteConnectOptions) -> SqliteConn {
        SqliteConn {
            slot: Mutex::new(Some(Entry {
                conn,
                broken: false,
            })),
            line: Mutex::new(()),
            options,
        }
    }

    /// Waits for the connection (callers queue in order), reopening it if
    /// an earlier call broke it.
    pub async fn lock(&self) -> Result<Held<'_>, StoreError> {
        let slot = tokio::time::timeout(ACQUIRE_TIMEOUT, async {
            let _first_in_line = self.line.lock().await;
            self.slot.lock().await
        })
        .await
        .map_err(|_| Self::timed_out())?;
        self.settled(slot).await
    }

    /// [`SqliteConn::lock`] ahead of every call still in line: the wait is
    /// at most the call that holds the connection and the next one.
    pub async fn lock_first(&self) -> Result<Held<'_>, StoreError> {
        let slot = tokio::time::timeout(ACQUIRE_TIMEOUT, self.slot.lock())
            .await
            .map_err(|_| Self::timed_out())?;
        self.settled(slot).await
    }

    fn timed_out() -> StoreError {
        StoreError::Unavailable(format!(
            "no SQLite connection within {}s: every store call waits for the one before it, and one is stuck or the queue is too long",
            ACQUIRE_TIMEOUT.as_secs()
        ))
    }

    async fn settled<'a>(
        &'a self,
        slot: MutexGuard<'a, Option<Entry>>,
    ) -> Result<Held<'a>, StoreError> {
        let mut entry = MutexGuard::try_map(slot, Option::as_mut)
            .map_err(|_| StoreError::from(sqlx::Error::PoolClosed))?;
        if entry.broken {
            entry.conn = SqliteConnection::connect_with(&self.options).await?;
            entry.broken = false;
        }
        Ok(entry)
    }

    /// Closes the connection; later calls fail as `Unavailable`.
    pub async fn close(&self) {
        if let Some(e) = self.slot.lock().await.take() {
            if let Err(e) = e.conn.close().await {
                tracing::warn!(error = %e, "closing the SQLite connection");
            }
        }
    }
}

impl Entry {
    pub fn conn(&mut self) -> &mut SqliteConnection {
        &mut self.conn
    }

    /// After a call: an error from the database or the driver marks the
    /// connection, so the next call starts on a new one. Not only for
    /// errors that mean it is gone: when a COMMIT fails (disk full, an I/O
    /// error), SQLite has rolled the transaction back itself, sqlx's
    /// rollback then fails and is ignored, and sqlx still counts the
    /// transaction as open. Kept, the connection ran every later call
    /// inside a savepoint of that phantom transaction, and once any call
    /// rolled back to its savepoint, nothing more was ever committed while
    /// each write reported success. The store's own refusals (busy, lease
    /// lost, not found...) come from statements that worked: those keep it.
    pub fn settle<T>(&mut self, done: &Result<T, StoreError>) {
        if let Err(StoreError::Unavailable(e) | StoreError::Backend(e)) = done {
            tracing::debug!(error = %e, "replacing the SQLite connection after an error");
            self.broken = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn open(dir: &tempfile::TempDir) -> SqliteConn {
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("t.db"))
            .create_if_missing(true);
        let mut conn = SqliteConnection::connect_with(&options).await.unwrap();
        sqlx::query("CREATE TABLE t (v INTEGER)")
            .execute(&mut conn)
            .await
            .unwrap();
        SqliteConn::new(conn, options)
    }

    /// Temp tables named `mark`: they live as long as their connection.
    async fn marks(one: &SqliteConn) -> i64 {
        let mut held = one.lock().await.unwrap();
        let (n,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM temp.sqlite_master WHERE name = 'mark'")
                .fetch_one(held.conn())
                .await
                .unwrap();
        n
    }

    async fn count(one: &SqliteConn) -> i64 {
        let mut held = one.lock().await.unwrap();
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM t")
            .fetch_one(held.conn())
            .await
            .unwrap();
        n
    }

    /// What the pool's ping on release was for: a call dropped inside its
    /// transaction (a cancelled run) leaves nothing behind, and the next
    /// call can begin its own.
    #[tokio::test]
    async fn a_transaction_dropped_midway_is_rolled_back_before_the_next_call() {
        let dir = tempfile::tempdir().unwrap();
        let one = open(&dir).await;
        {
            let mut held = one.lock().await.unwrap();
            let mut tx = held.conn().begin().await.unwrap();
            sqlx::query("INSERT INTO t VALUES (1)")
                .execute(&mut *tx)
                .await
                .unwrap();
            // Dropped without commit, as a cancelled future drops it.
        }
        {
            let mut held = one.lock().await.unwrap();
            let mut tx = held
                .conn()
                .begin()
                .await
                .expect("no transaction is left open");
            sqlx::query("INSERT INTO t VALUES (2)")
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
        assert_eq!(count(&one).await, 1);
    }

    #[tokio::test]
    async fn a_connection_marked_broken_is_replaced_by_the_next_call() {
        let dir = tempfile::tempdir().unwrap();
        let one = open(&dir).await;
        {
            let mut held = one.lock().await.unwrap();
            sqlx::query("CREATE TEMP TABLE mark (v INTEGER)")
                .execute(held.conn())
                .await
                .unwrap();
            held.settle::<()>(&Ok(()));
        }
        assert_eq!(marks(&one).await, 1, "kept after a success");
        one.lock()
            .await
            .unwrap()
            .settle::<()>(&Err(StoreError::Unavailable("disk I/O error".into())));
        assert_eq!(marks(&one).await, 0, "a new connection");
        assert_eq!(count(&one).await, 0, "on the same file");
    }

    #[tokio::test]
    async fn a_call_that_cannot_get_the_connection_in_time_is_unavailable() {
        let dir = tempfile::tempdir().unwrap();
        let one = open(&dir).await;
        let _stuck = one.lock().await.unwrap();
        tokio::time::pause();
        let started = tokio::time::Instant::now();
        let err = tokio::time::timeout(ACQUIRE_TIMEOUT * 2, one.lock())
            .await
            .expect("the call gives up by itself")
            .err();
        assert!(
            matches!(&err, Some(StoreError::Unavailable(m)) if m.contains("30s")),
            "{err:?}"
        );
        let waited = started.elapsed();
        assert!(
            waited >= ACQUIRE_TIMEOUT && waited < ACQUIRE_TIMEOUT * 2,
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn calls_after_close_are_unavailable() {
        let dir = tempfile::tempdir().unwrap();
        let one = open(&dir).await;
        one.close().await;
        assert!(matches!(
            one.lock().await.err(),
            Some(StoreError::Unavailable(_))
        ));
    }
}
