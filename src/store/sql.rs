//! The SQL engines: SQLite and PostgreSQL share every statement; where the
//! dialects differ (the clock, row locks) the text is filled in per engine.
//!
//! Each operation is one transaction. Fenced writes start with the update
//! of the run row that names the lease's epoch: on Postgres it takes the
//! row lock, so a claim by the reaper (which bumps the epoch) and a write
//! by the old holder are serialized and exactly one of them wins. On
//! PostgreSQL a run's start, commits and end first try one statement that
//! does the whole write when nothing is in its way (`pg`), and fall back
//! to the transaction here otherwise.

use crate::lock::LockExt;
use std::collections::HashSet;
use std::path::Path;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::Connection as _;
use tokio::sync::broadcast;

use super::sqlite_conn::SqliteConn;
use super::waits::Waits;

mod pg;

use super::{
    close_pending_turn, closes_staged_turn, migrations, not_asked_or_done, page_token,
    parse_page_token, ClaimedRun, NewSession, OwnerUsage, RunEnd, RunLease, SessionFilter,
    SessionPage, SessionStore, Signal, StoreError, StoreOptions, REREAD_ALL,
};
use crate::agent::approvals::Decision;
use crate::auth::quota;
use crate::message::Message;
use crate::session::Session;

/// `items` as JSON arrays of at most [`JSON_CHUNK`] each: the parameters
/// of [`SqlStore::json_pairs`], one statement each.
fn json_lists<T: serde::Serialize>(items: &[T]) -> Result<Vec<String>, StoreError> {
    items
        .chunks(JSON_CHUNK)
        .map(|chunk| serde_json::to_string(chunk).map_err(StoreError::from))
        .collect()
}

/// The NOTIFY channel whose payload is the id of a replica to wake
/// ([`REREAD_ALL`]: every replica), or an [`super::asked_hint`].
const WAKE_CHANNEL: &str = "hookwire_wake";

/// How long start-up keeps trying to reach Postgres (a database starting
/// next to hookwire, as in the Kubernetes overlay).
const CONNECT_PATIENCE: Duration = Duration::from_secs(20);

/// Leases renewed per statement by `renew_all`, and approvals looked up per
/// statement by `signals`: a few tens of KiB of JSON.
const JSON_CHUNK: usize = 500;

enum Pool {
    /// Boxed: it holds the connect options (to reopen), a pool is a handle.
    Sqlite(Box<SqliteConn>),
    Postgres(PgPool),
}

/// Runs `$body` with `$p` bound to a connection of whichever engine this
/// store has (`&mut SqliteConnection` or `&mut PgConnection`); the body is
/// compiled once per engine. A `?` or `return Err(..)` in the body returns
/// the error from the calling function, as if the body were written there;
/// a `return Ok(v)` ends the body with `v` (on SQLite the body is an async
/// block, so the lock is settled first), and the function goes on after
/// the macro.
macro_rules! with_pool {
    ($self:ident, $p:ident => $body:expr) => {
        with_pool!(lock: $self, $p => $body)
    };
    // `lock_first`: SQLite's connection ahead of the calls in line (lease
    // renewals; see `sqlite_conn`).
    ($lock:ident: $self:ident, $p:ident => $body:expr) => {
        match &$self.pool {
            Pool::Sqlite(one) => {
                let asked = std::time::Instant::now();
                let mut held = one.$lock().await?;
                $self.waits.record("sqlite", asked.elapsed());
                let done: Result<_, StoreError> = async {
                    let $p = held.conn();
                    Ok($body)
                }
                .await;
                held.settle(&done);
                done?
            }
            Pool::Postgres(pool) => {
                let asked = std::time::Instant::now();
                let mut conn = pool.acquire().await?;
                $self.waits.record("postgres", asked.elapsed());
                let $p = &mut *conn;
                $body
            }
        }
    };
}

/// In the open transaction `$tx`, what deleting session `$id` (owned by
/// `$owner`) does to its runs: the start times of those within the quota
/// window are kept for the owner's run rate (`deleted_run_starts`, see
/// migration 4), and the ended ones go (their approvals cascade). A run
/// in flight stays until it ends; see `delete_session`.
macro_rules! forget_runs {
    ($self:ident, $tx:expr, $id:expr, $owner:expr) => {{
        let keep = $self.sql(
            "INSERT INTO deleted_run_starts (owner, started_ms)
             SELECT $2, started_ms FROM runs
             WHERE session_id = $1 AND started_ms > (SELECT {now} - $3)",
        );
        sqlx::query(&keep)
            .bind($id)
            .bind($owner)
            .bind(ms(quota::WINDOW))
            .execute(&mut *$tx)
            .await?;
        sqlx::query("DELETE FROM runs WHERE session_id = $1 AND ended_ms IS NOT NULL")
            .bind($id)
            .execute(&mut *$tx)
            .await?;
    }};
}

/// In the open transaction `$tx`: drops the kept starts no window counts
/// any more (bounded by the index on their age, so each deletion pays for
/// what expired since the last one).
macro_rules! prune_deleted_starts {
    ($self:ident, $tx:expr) => {{
        let prune =
            $self.sql("DELETE FROM deleted_run_starts WHERE started_ms <= (SELECT {now} - $1)");
        sqlx::query(&prune)
            .bind(ms(quota::WINDOW))
            .execute(&mut *$tx)
            .await?;
    }};
}

/// Most messages one INSERT carries: two parameters each and two shared
/// stay far below either engine's limit (SQLite 32 766, PostgreSQL 65 535).
const MESSAGES_PER_INSERT: usize = 200;

/// `INSERT INTO messages` of `n` rows: `$1` the session, `$2` the run,
/// then each message's sequence number and body.
fn messages_insert(n: usize) -> String {
    use std::fmt::Write as _;
    let mut sql = String::from("INSERT INTO messages (session_id, run_id, seq, body) VALUES ");
    for i in 0..n {
        let sep = if i == 0 { "" } else { ", " };
        let _ = write!(sql, "{sep}($1, $2, ${}, ${})", 3 + 2 * i, 4 + 2 * i);
    }
    sql
}

/// In the open transaction `$tx`, appends `$bodies` (JSON) to the session
/// of `$lease` as messages `$first`, `$first + 1`, ...: one statement per
/// [`MESSAGES_PER_INSERT`] messages rather than one per message, since
/// every statement is a round trip (to sqlx's SQLite worker thread, or
/// over the network to PostgreSQL) and a tool turn commits several.
macro_rules! insert_messages {
    ($tx:expr, $lease:expr, $first:expr, $bodies:expr) => {{
        let mut seq: i64 = $first;
        let bodies: &[String] = $bodies;
        for chunk in bodies.chunks(MESSAGES_PER_INSERT) {
            let sql = messages_insert(chunk.len());
            let mut q = sqlx::query(&sql)
                .bind(&$lease.session_id)
                .bind(&$lease.run_id);
            for body in chunk {
                q = q.bind(seq).bind(body);
                seq += 1;
            }
            q.execute(&mut *$tx).await?;
        }
    }};
}

/// Extends the lease `$lease` holds, on `$conn` (a connection or an open
/// transaction), or returns [`StoreError::LeaseLost`] from the enclosing
/// call when it no longer holds the run (another replica claimed it, or
/// it ended): the fence a run's writes start with.
macro_rules! fence {
    ($self:ident, $conn:expr, $lease:expr) => {{
        let sql = $self.sql(
            "UPDATE runs SET lease_expires_ms = {now} + $3
             WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL",
        );
        let held = sqlx::query(&sql)
            .bind(&$lease.run_id)
            .bind($lease.epoch)
            .bind(ms($self.options.lease))
            .execute($conn)
            .await?
            .rows_affected();
        if held == 0 {
            return Err(StoreError::LeaseLost($lease.run_id.clone()));
        }
    }};
}

/// On `$conn` (a connection or an open transaction), what stands in the
/// way of the run of `$lease` starting work, if anything: a recorded
/// cancel ([`StoreError::RunCancelled`], first: a deleted session's run
/// has one too), its session gone ([`StoreError::SessionNotFound`]), or
/// the lease no longer held ([`StoreError::LeaseLost`]). `None` when the
/// run may go on.
macro_rules! stopped {
    ($conn:expr, $lease:expr) => {{
        let row: Option<(Option<String>, i64)> = sqlx::query_as(
            "SELECT cancel_reason, (SELECT COUNT(*) FROM sessions s WHERE s.id = runs.session_id)
             FROM runs WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL",
        )
        .bind(&$lease.run_id)
        .bind($lease.epoch)
        .fetch_optional(&mut *$conn)
        .await?;
        match row {
            None => Some(StoreError::LeaseLost($lease.run_id.clone())),
            Some((Some(reason), _)) => Some(StoreError::RunCancelled {
                run: $lease.run_id.clone(),
                reason,
            }),
            Some((None, 0)) => Some(StoreError::SessionNotFound($lease.session_id.clone())),
            Some((None, _)) => None,
        }
    }};
}

/// The condition a write that starts work adds to its fence: no cancel
/// recorded and the session still there ([`stopped!`] tells which one
/// failed when the write is refused).
const MAY_START: &str =
    "cancel_reason IS NULL AND EXISTS (SELECT 1 FROM sessions s WHERE s.id = runs.session_id)";

pub struct SqlStore {
    pool: Pool,
    options: StoreOptions,
    /// The current time in integer ms, as the database sees it.
    now: &'static str,
    /// Row locks for work queues (claims, expiry) where the engine has them.
    skip_locked: &'static str,
    wake: broadcast::Sender<String>,
    listener: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// PostgreSQL: a connection of its own for lease renewals. In the
    /// pool they queued behind the runs' own calls, and under a burst of
    /// run starts (10 000 at once, calls waiting over 20 s for a
    /// connection) a renewal waited past the point where the replica
    /// stops its runs for want of a lease: up to a third of the burst's runs
    /// stopped as if the store were unreachable. The store answered; it
    /// was the queue. SQLite has one connection and no such second one
    /// to give (one writer at a time either way): there renewals go ahead
    /// of the queue instead (`SqliteConn::lock_first`).
    renewals: Option<PgPool>,
    /// Slow waits for a connection, reported in summary.
    waits: Waits,
}

const SESSION_COLS: &str =
    "id, agent, owner, extra_hooks, metadata, created_ms, last_active_ms, run_count, active_run";

type SessionRow = (
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
    i64,
    Option<String>,
);

fn session(r: SessionRow) -> Result<Session, StoreError> {
    Ok(Session {
        id: r.0,
        agent: r.1,
        owner: r.2,
        extra_hooks: serde_json::from_str(&r.3)?,
        metadata: serde_json::from_str(&r.4)?,
        created_at_unix_ms: r.5,
        last_active_unix_ms: r.6,
        transcript: Vec::new(),
        run_count: u32::try_from(r.7).unwrap_or(u32::MAX),
        active_run: r.8,
    })
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn decision(state: &str, note: String) -> Option<Decision> {
    match state {
        "approved" => Some(Decision {
            approve: true,
            note,
        }),
        "denied" => Some(Decision {
            approve: false,
            note,
        }),
        _ => None,
    }
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

/// The connect options of a Postgres store, password included: the URL
/// must parse, and a variable named by `store.password_env` must be set.
/// The least time a PostgreSQL statement may run before the server
/// cancels it (`statement_timeout`; a lease when that is longer).
const MIN_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) fn check_postgres(
    url: &str,
    password_env: Option<&str>,
) -> Result<PgConnectOptions, StoreError> {
    let mut connect = PgConnectOptions::from_str(url)
        .map_err(|e| StoreError::Backend(format!("store: invalid postgres URL: {e}")))?
        .application_name("hookwire");
    if let Some(var) = password_env {
        let pw = std::env::var(var).map_err(|_| {
            StoreError::Unavailable(format!(
                "store.password_env names {}, which is not set in the environment",
                crate::config::secret_env::shown(var)
            ))
        })?;
        connect = connect.password(&pw);
    }
    Ok(connect)
}

/// A SQLite file can be at `path`: not a directory, and its directory
/// exists or can be created (the nearest existing ancestor is a directory).
pub(super) fn check_sqlite_path(path: &Path) -> Result<(), StoreError> {
    let fix = "set --data-dir / HOOKWIRE_DATA_DIR, or store:";
    if path.is_dir() {
        return Err(StoreError::Unavailable(format!(
            "the SQLite store {} is a directory; name a file in it, e.g. {} ({fix})",
            path.display(),
            path.join("hookwire.db").display()
        )));
    }
    let mut dir = path.parent();
    while let Some(d) = dir.filter(|d| !d.as_os_str().is_empty()) {
        if d.exists() {
            if !d.is_dir() {
                return Err(StoreError::Unavailable(format!(
                    "cannot make the data directory for {}: {} is not a directory ({fix})",
                    path.display(),
                    d.display()
                )));
            }
            break;
        }
        dir = d.parent();
    }
    Ok(())
}

impl SqlStore {
    /// Opens (creating if needed) the SQLite file at `path`.
    ///
    /// WAL with `synchronous=NORMAL`: a committed transaction survives a
    /// crash of the process; an OS crash or power loss may lose the last
    /// commits, never corrupt the file. One connection: SQLite serializes
    /// writers anyway, and this way no transaction ever waits on a lock
    /// upgrade (see `sqlite_conn` for why it is not a pool).
    pub async fn sqlite(path: &Path, options: StoreOptions) -> Result<SqlStore, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Unavailable(format!(
                    "cannot create the data directory {}: {e} (set --data-dir / HOOKWIRE_DATA_DIR, or store:)",
                    dir.display()
                ))
            })?;
        }
        let connect = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5))
            .foreign_keys(true);
        let mut conn = sqlx::SqliteConnection::connect_with(&connect)
            .await
            .map_err(|e| {
                StoreError::Unavailable(format!("cannot open SQLite file {}: {e}", path.display()))
            })?;
        migrations::sqlite()
            .await
            .map_err(|e| StoreError::Backend(format!("loading migrations: {e}")))?
            .run_direct(&mut conn)
            .await
            .map_err(|e| {
                StoreError::Backend(format!("migrating SQLite file {}: {e}", path.display()))
            })?;
        Ok(SqlStore {
            pool: Pool::Sqlite(Box::new(SqliteConn::new(conn, connect))),
            options,
            now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
            skip_locked: "",
            wake: broadcast::channel(256).0,
            listener: Mutex::new(None),
            renewals: None,
            waits: Waits::default(),
        })
    }

    /// Connects to Postgres at `url` (no password in it: it comes from
    /// the variable `password_env` names, else `PGPASSWORD`), migrates, and
    /// listens for wake-ups.
    pub async fn postgres(
        url: &str,
        password_env: Option<&str>,
        max_connections: u32,
        options: StoreOptions,
    ) -> Result<SqlStore, StoreError> {
        // No statement waits longer than a lease (at least
        // MIN_STATEMENT_TIMEOUT): a server that stops answering, or a row
        // lock held by a stuck transaction elsewhere, would otherwise hold
        // a run's store call, and the run past its deadline and past
        // CancelRun, for as long as it lasts. A run whose write waited a
        // whole lease may have been claimed by another replica by then.
        let statement_timeout = options.lease.max(MIN_STATEMENT_TIMEOUT);
        // No bitmap scans: every capped read here (a quota's counts, a page
        // of sessions) relies on an index scan stopping at its LIMIT, and a
        // bitmap scan reads every matching entry first. The planner picks
        // one whenever its statistics underrate how many rows an owner has
        // (tables not yet analyzed, or a principal that grew since): a
        // quota check for an owner of 5 000 sessions then read all 5 000
        // (BENCHMARKS.md, "The fixes after efdf4f5"). None of the store's
        // queries needs one.
        let connect = check_postgres(url, password_env)?.options([
            (
                "statement_timeout",
                format!("{}ms", statement_timeout.as_millis()),
            ),
            ("enable_bitmapscan", "off".to_string()),
        ]);
        let started = tokio::time::Instant::now();
        let pool = loop {
            match PgPoolOptions::new()
                .max_connections(max_connections.max(2))
                .acquire_timeout(Duration::from_secs(30))
                // Slow acquires are reported in summary by `waits`, not
                // once per waiting call.
                .acquire_slow_threshold(Duration::MAX)
                .connect_with(connect.clone())
                .await
            {
                Ok(p) => break p,
                Err(e) if started.elapsed() < CONNECT_PATIENCE => {
                    tracing::warn!(error = %e, "cannot reach postgres yet; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => {
                    return Err(StoreError::Unavailable(format!(
                        "cannot connect to postgres (host {:?}, database {:?}) for {}s: {e}",
                        connect.get_host(),
                        connect.get_database().unwrap_or_default(),
                        CONNECT_PATIENCE.as_secs()
                    )))
                }
            }
        };
        // Migrated on a connection of its own, without the pool's
        // statement timeout: the migrator waits in one statement for the
        // advisory lock of a replica migrating at the same time, and sends
        // each migration as one statement, so under the pool's limit a
        // replica starting next to a longer migration failed to start, and
        // a migration longer than the limit could never apply. The pool
        // reached the server, so this connection need not be patient.
        let mut migrating = sqlx::PgConnection::connect_with(
            &check_postgres(url, password_env)?.options([("statement_timeout", "0")]),
        )
        .await?;
        let migrated = migrations::postgres()
            .await
            .map_err(|e| StoreError::Backend(format!("loading migrations: {e}")))?
            .run_direct(&mut migrating)
            .await
            .map_err(|e| StoreError::Backend(format!("migrating postgres: {e}")));
        // Closed either way; a failed close loses nothing (the server ends
        // the session, and the migrator released its lock already).
        let _ = migrating.close().await;
        migrated?;
        let (wake, _) = broadcast::channel(256);
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        let listener = tokio::spawn(listen(pool.clone(), wake.clone(), ready_tx));
        // Opened at the first renewal, and again after a lost connection.
        let renewals = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .acquire_timeout(Duration::from_secs(30))
            .connect_lazy_with(connect);
        // Listening before the first write, so no hint of ours is missed
        // (polling would still find it, a little later).
        if tokio::time::timeout(Duration::from_secs(10), ready)
            .await
            .is_err()
        {
            tracing::warn!("postgres LISTEN not ready after 10s; relying on polling until it is");
        }
        Ok(SqlStore {
            pool: Pool::Postgres(pool),
            options,
            now: "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
            skip_locked: "FOR UPDATE SKIP LOCKED",
            wake,
            listener: Mutex::new(Some(listener)),
            renewals: Some(renewals),
            waits: Waits::default(),
        })
    }

    fn sql(&self, text: &str) -> String {
        text.replace("{now}", self.now)
            .replace("{skip_locked}", self.skip_locked)
            .replace("{session_cols}", SESSION_COLS)
    }

    fn is_postgres(&self) -> bool {
        matches!(self.pool, Pool::Postgres(_))
    }

    /// A table of `[a, b]` pairs sent as one JSON parameter (`$n`, from
    /// [`json_lists`]): how a list of keys goes in one statement on both
    /// engines. `b_type` is the second column's PostgreSQL type.
    fn json_pairs(&self, n: u8, a: &str, b: &str, b_type: &str) -> String {
        if self.is_postgres() {
            format!(
                "SELECT e->>0 AS {a}, (e->>1)::{b_type} AS {b} FROM jsonb_array_elements(${n}::jsonb) AS e"
            )
        } else {
            format!(
                "SELECT json_extract(value, '$[0]') AS {a}, json_extract(value, '$[1]') AS {b}
                 FROM json_each(${n})"
            )
        }
    }

    /// In-process wake-up for the engines without NOTIFY (after commit).
    fn wake_local(&self, replica: &str) {
        if !self.is_postgres() {
            let _ = self.wake.send(replica.to_string());
        }
    }
}

/// Postgres LISTEN loop: each notification's payload goes to subscribers.
/// A notification sent while nobody listens is gone for good, so after a
/// lost connection [`REREAD_ALL`] goes out once the listener listens
/// again: a reader woken by it then sees everything committed while the
/// listener was away, and whatever is committed later is notified.
async fn listen(
    pool: PgPool,
    wake: broadcast::Sender<String>,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    let mut listened = false;
    loop {
        match PgListener::connect_with(&pool).await {
            Ok(mut l) => match l.listen(WAKE_CHANNEL).await {
                Ok(()) => {
                    if let Some(r) = ready.take() {
                        let _ = r.send(());
                    }
                    if listened {
                        let _ = wake.send(REREAD_ALL.into());
                    }
                    listened = true;
                    // Until the connection is lost. sqlx's listener would
                    // reconnect by itself after `Ok(None)`, but without
                    // saying when it listens again, which is when
                    // `REREAD_ALL` must go out; so it is reconnected here.
                    let lost = loop {
                        match l.try_recv().await {
                            Ok(Some(n)) => {
                                let _ = wake.send(n.payload().to_string());
                            }
                            Ok(None) => break "connection closed".to_string(),
                            Err(e) => break e.to_string(),
                        };
                    };
                    if pool.is_closed() {
                        return;
                    }
                    tracing::warn!(error = %lost, "postgres listener lost; reconnecting");
                }
                Err(e) => tracing::warn!(error = %e, "postgres LISTEN failed; retrying"),
            },
            Err(e) if pool.is_closed() => {
                tracing::debug!(error = %e, "postgres pool closed; listener stops");
                return;
            }
            Err(e) => tracing::warn!(error = %e, "postgres listener cannot connect; retrying"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[async_trait::async_trait]
impl SessionStore for SqlStore {
    fn engine(&self) -> &'static str {
        if self.is_postgres() {
            "postgres"
        } else {
            "sqlite"
        }
    }

    async fn create_session(&self, s: &NewSession) -> Result<Session, StoreError> {
        let sql = self.sql(
            "INSERT INTO sessions (id, agent, owner, extra_hooks, metadata, created_ms, last_active_ms)
             VALUES ($1, $2, $3, $4, $5, {now}, {now}) RETURNING {session_cols}",
        );
        let hooks = serde_json::to_string(&s.extra_hooks)?;
        let meta = serde_json::to_string(&s.metadata)?;
        let row: SessionRow = with_pool!(self, p => sqlx::query_as(&sql)
            .bind(&s.id)
            .bind(&s.agent)
            .bind(&s.owner)
            .bind(&hooks)
            .bind(&meta)
            .fetch_one(p)
            .await?);
        session(row)
    }

    async fn get_session(&self, id: &str) -> Result<Session, StoreError> {
        let sql = self.sql("SELECT {session_cols} FROM sessions WHERE id = $1");
        let row: Option<SessionRow> =
            with_pool!(self, p => sqlx::query_as(&sql).bind(id).fetch_optional(p).await?);
        match row {
            Some(r) => session(r),
            None => Err(StoreError::SessionNotFound(id.to_string())),
        }
    }

    async fn list_sessions(&self, f: &SessionFilter) -> Result<SessionPage, StoreError> {
        let after = parse_page_token(&f.page_token)?;
        let (after_ms, after_id) = after.unwrap_or((i64::MIN, String::new()));
        let limit = f.limit();
        let sql = self.sql(
            "SELECT {session_cols} FROM sessions
             WHERE ($1 IS NULL OR owner = $1) AND ($2 IS NULL OR agent = $2)
               AND (created_ms > $3 OR (created_ms = $3 AND id > $4))
             ORDER BY created_ms, id LIMIT $5",
        );
        let rows: Vec<SessionRow> = with_pool!(self, p => sqlx::query_as(&sql)
            .bind(f.owner.as_deref())
            .bind(f.agent.as_deref())
            .bind(after_ms)
            .bind(&after_id)
            .bind(i64::from(limit) + 1)
            .fetch_all(p)
            .await?);
        let mut sessions = rows
            .into_iter()
            .map(session)
            .collect::<Result<Vec<_>, _>>()?;
        let mut next_page_token = String::new();
        if sessions.len() > limit as usize {
            sessions.truncate(limit as usize);
            if let Some(last) = sessions.last() {
                next_page_token = page_token(last);
            }
        }
        Ok(SessionPage {
            sessions,
            next_page_token,
        })
    }

    async fn run_session(&self, run_id: &str) -> Result<Session, StoreError> {
        let sql = self.sql(
            "SELECT {session_cols} FROM sessions
             WHERE id = (SELECT session_id FROM runs WHERE id = $1 AND ended_ms IS NULL)",
        );
        let row: Option<SessionRow> =
            with_pool!(self, p => sqlx::query_as(&sql).bind(run_id).fetch_optional(p).await?);
        match row {
            Some(r) => session(r),
            None => Err(StoreError::RunNotFound(run_id.to_string())),
        }
    }

    async fn owner_usage(
        &self,
        owner: &str,
        window: Duration,
        cap: u64,
    ) -> Result<OwnerUsage, StoreError> {
        // Each count reads at most `cap` entries of an index:
        // sessions_owner_page, runs_owner_ended, runs_owner_started. Runs
        // without an owner (see migration 2) are found through the same
        // indexes, only those in flight or in the window, and counted if
        // their session is the owner's; after an upgrade they are few. A
        // run counts only while its session exists (a primary-key probe
        // per run counted): a run in flight keeps its owner when its
        // session is deleted (see `delete_session`), and goes when it ends.
        // Deleting a session kept its runs' recent starts in
        // deleted_run_starts (its own index), so they still count for the
        // run rate, once each. The window's start is a subquery so that PostgreSQL evaluates
        // its volatile clock once and can bound the index scan with it.
        // Each capped count is ordered as its index is, so that the plan
        // that stops at the cap (walking that index) is also the one that
        // needs no sort. Unordered, PostgreSQL with statistics counted the
        // recent runs of a principal owning a fifth of the table by
        // scanning all of it (it expected the cap's rows early in the
        // heap); bitmap scans are off for the same reason (see
        // `SqlStore::postgres`).
        let sql = self.sql(
            "SELECT
               (SELECT COUNT(*) FROM
                 (SELECT 1 FROM sessions WHERE owner = $1
                   ORDER BY created_ms, id LIMIT $3) AS s),
               (SELECT COUNT(*) FROM
                 (SELECT 1 FROM runs WHERE owner = $1 AND ended_ms IS NULL
                   AND EXISTS (SELECT 1 FROM sessions s WHERE s.id = runs.session_id)
                   ORDER BY ended_ms LIMIT $3) AS r),
               (SELECT COUNT(*) FROM runs r WHERE r.owner IS NULL AND r.ended_ms IS NULL
                 AND (SELECT s.owner FROM sessions s WHERE s.id = r.session_id) = $1),
               (SELECT COUNT(*) FROM
                 (SELECT 1 FROM runs WHERE owner = $1 AND started_ms > (SELECT {now} - $2)
                   AND EXISTS (SELECT 1 FROM sessions s WHERE s.id = runs.session_id)
                   ORDER BY started_ms LIMIT $3) AS r),
               (SELECT COUNT(*) FROM runs r WHERE r.owner IS NULL AND r.started_ms > (SELECT {now} - $2)
                 AND (SELECT s.owner FROM sessions s WHERE s.id = r.session_id) = $1),
               (SELECT COUNT(*) FROM
                 (SELECT 1 FROM deleted_run_starts WHERE owner = $1 AND started_ms > (SELECT {now} - $2)
                   ORDER BY started_ms LIMIT $3) AS d)",
        );
        let (sessions, active, active_ownerless, recent, recent_ownerless, recent_deleted): (
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
        ) = with_pool!(self, p => sqlx::query_as(&sql)
            .bind(owner)
            .bind(ms(window))
            .bind(i64::try_from(cap).unwrap_or(i64::MAX))
            .fetch_one(p)
            .await?);
        let n = |a: i64, b: i64| u64::try_from(a.saturating_add(b)).unwrap_or(0).min(cap);
        Ok(OwnerUsage {
            sessions: n(sessions, 0),
            active_runs: n(active, active_ownerless),
            recent_runs: n(recent, recent_ownerless.saturating_add(recent_deleted)),
        })
    }

    async fn delete_session(&self, id: &str) -> Result<Session, StoreError> {
        // The session row first: its lock waits for a run's start, commit
        // or end that holds it, so the runs are read after those
        // committed. Ended runs go with the session (their approvals
        // cascade). A run in flight stays until it ends, which then
        // deletes it, and is not touched here: an end takes its run's lock
        // and then the session's, so a delete holding the session and
        // waiting for the run could deadlock with it; `owner_usage` counts
        // only runs whose session exists instead. (Before, the delete
        // cleared the run's owner before it deleted the session, and on
        // PostgreSQL a run's end that committed in between was left behind
        // for good.)
        let delete = self.sql("DELETE FROM sessions WHERE id = $1 RETURNING {session_cols}");
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let row: Option<SessionRow> =
                sqlx::query_as(&delete).bind(id).fetch_optional(&mut *tx).await?;
            let Some(row) = row else {
                return Err(StoreError::SessionNotFound(id.to_string()));
            };
            forget_runs!(self, tx, id, &row.2);
            prune_deleted_starts!(self, tx);
            tx.commit().await?;
            session(row)
        })
    }

    async fn transcript(&self, session_id: &str) -> Result<Vec<Message>, StoreError> {
        self.transcript_after(session_id, 0).await
    }

    async fn transcript_after(
        &self,
        session_id: &str,
        from: u64,
    ) -> Result<Vec<Message>, StoreError> {
        let from = i64::try_from(from).unwrap_or(i64::MAX);
        // The session's row joined to its messages, in one statement: no
        // row at all when the session is unknown (SessionNotFound, as the
        // other engines answer, rather than an empty transcript), one row
        // without a message when it has none from `from` on. The primary
        // keys serve both: a replica that is up to date reads no message.
        let rows: Vec<(Option<String>,)> = with_pool!(self, p => sqlx::query_as(
            "SELECT m.body FROM sessions s
             LEFT JOIN messages m ON m.session_id = s.id AND m.seq >= $2
             WHERE s.id = $1 ORDER BY m.seq",
        )
        .bind(session_id)
        .bind(from)
        .fetch_all(p)
        .await?);
        if rows.is_empty() {
            return Err(StoreError::SessionNotFound(session_id.to_string()));
        }
        rows.iter()
            .filter_map(|(b,)| b.as_deref())
            .map(|b| serde_json::from_str(b).map_err(StoreError::from))
            .collect()
    }

    async fn begin_run(
        &self,
        session_id: &str,
        run_id: &str,
        replica: &str,
    ) -> Result<RunLease, StoreError> {
        let claim = self.sql(
            "UPDATE sessions SET run_count = run_count + 1, active_run = $2, last_active_ms = {now}
             WHERE id = $1 AND active_run IS NULL RETURNING transcript_bytes, owner",
        );
        let insert = self.sql(
            "INSERT INTO runs (id, session_id, replica, epoch, lease_expires_ms, started_ms, owner)
             VALUES ($1, $2, $3, 1, {now} + $4, {now}, $5)",
        );
        let lease_ms = ms(self.options.lease);
        let limit = self.options.max_transcript_bytes;
        let lease = RunLease {
            run_id: run_id.to_string(),
            session_id: session_id.to_string(),
            epoch: 1,
        };
        if self.pg_begin_run(session_id, run_id, replica).await? {
            return Ok(lease);
        }
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let claimed: Option<(i64, String)> = sqlx::query_as(&claim)
                .bind(session_id)
                .bind(run_id)
                .fetch_optional(&mut *tx)
                .await?;
            let Some((bytes, owner)) = claimed else {
                let active: Option<(Option<String>,)> =
                    sqlx::query_as("SELECT active_run FROM sessions WHERE id = $1")
                        .bind(session_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                return Err(match active {
                    None => StoreError::SessionNotFound(session_id.to_string()),
                    Some((run,)) => StoreError::Busy {
                        session: session_id.to_string(),
                        run: run.unwrap_or_default(),
                    },
                });
            };
            let bytes = u64::try_from(bytes).unwrap_or(0);
            if bytes >= limit {
                return Err(StoreError::TranscriptFull {
                    session: session_id.to_string(),
                    bytes,
                    limit,
                });
            }
            let inserted = sqlx::query(&insert)
                .bind(run_id)
                .bind(session_id)
                .bind(replica)
                .bind(lease_ms)
                .bind(owner)
                .execute(&mut *tx)
                .await;
            match inserted {
                Ok(_) => {}
                // The unique index on active runs backs the session row.
                Err(e) if is_unique_violation(&e) => {
                    return Err(StoreError::Busy {
                        session: session_id.to_string(),
                        run: String::new(),
                    })
                }
                Err(e) => return Err(e.into()),
            }
            tx.commit().await?;
        });
        Ok(lease)
    }

    async fn renew(&self, lease: &RunLease) -> Result<(), StoreError> {
        with_pool!(self, p => fence!(self, p, lease));
        Ok(())
    }

    async fn renew_all(&self, leases: &[RunLease]) -> Result<Vec<bool>, StoreError> {
        // One statement per chunk: the leases as a JSON array of
        // [id, epoch] pairs, joined to the runs by their primary key.
        let pairs = self.json_pairs(1, "id", "epoch", "bigint");
        let sql = self.sql(&format!(
            "UPDATE runs SET lease_expires_ms = {{now}} + $2 FROM ({pairs}) AS l
             WHERE runs.id = l.id AND runs.epoch = l.epoch AND runs.ended_ms IS NULL
             RETURNING runs.id"
        ));
        let keys: Vec<(&str, i64)> = leases
            .iter()
            .map(|l| (l.run_id.as_str(), l.epoch))
            .collect();
        let mut held = Vec::with_capacity(leases.len());
        for (chunk, list) in leases.chunks(JSON_CHUNK).zip(json_lists(&keys)?) {
            let renewed: Vec<(String,)> = match &self.renewals {
                Some(own) => {
                    let mut conn = own.acquire().await?;
                    sqlx::query_as(&sql)
                        .bind(list)
                        .bind(ms(self.options.lease))
                        .fetch_all(&mut *conn)
                        .await?
                }
                // SQLite: ahead of the runs' calls on its one connection.
                None => with_pool!(lock_first: self, p => sqlx::query_as(&sql)
                    .bind(list)
                    .bind(ms(self.options.lease))
                    .fetch_all(p)
                    .await?),
            };
            let renewed: HashSet<String> = renewed.into_iter().map(|(id,)| id).collect();
            held.extend(chunk.iter().map(|l| renewed.contains(&l.run_id)));
        }
        Ok(held)
    }

    async fn append(&self, lease: &RunLease, messages: &[Message]) -> Result<(), StoreError> {
        if messages.is_empty() {
            return Ok(());
        }
        // The staged turn (if any) is now part of these messages.
        let fence = self.sql(
            "UPDATE runs SET lease_expires_ms = {now} + $3, pending_turn = NULL
             WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL",
        );
        let grow = self.sql(
            "UPDATE sessions SET next_seq = next_seq + $2, transcript_bytes = transcript_bytes + $3,
                 last_active_ms = {now}
             WHERE id = $1 AND active_run = $4 AND transcript_bytes + $3 <= $5
             RETURNING next_seq",
        );
        let bodies = messages
            .iter()
            .map(serde_json::to_string)
            .collect::<Result<Vec<_>, _>>()?;
        let bytes: usize = bodies.iter().map(String::len).sum();
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        let count = i64::try_from(bodies.len()).unwrap_or(i64::MAX);
        let limit = i64::try_from(self.options.max_transcript_bytes).unwrap_or(i64::MAX);
        if self.pg_append(lease, &bodies, bytes).await? {
            return Ok(());
        }
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let fenced = sqlx::query(&fence)
                .bind(&lease.run_id)
                .bind(lease.epoch)
                .bind(ms(self.options.lease))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if fenced == 0 {
                return Err(StoreError::LeaseLost(lease.run_id.clone()));
            }
            let next: Option<(i64,)> = sqlx::query_as(&grow)
                .bind(&lease.session_id)
                .bind(count)
                .bind(bytes)
                .bind(&lease.run_id)
                .bind(limit)
                .fetch_optional(&mut *tx)
                .await?;
            let Some((next,)) = next else {
                let s: Option<(i64, Option<String>)> = sqlx::query_as(
                    "SELECT transcript_bytes, active_run FROM sessions WHERE id = $1",
                )
                .bind(&lease.session_id)
                .fetch_optional(&mut *tx)
                .await?;
                return Err(match s {
                    None => StoreError::SessionNotFound(lease.session_id.clone()),
                    Some((_, run)) if run.as_deref() != Some(lease.run_id.as_str()) => {
                        StoreError::LeaseLost(lease.run_id.clone())
                    }
                    Some((have, _)) => StoreError::TranscriptFull {
                        session: lease.session_id.clone(),
                        bytes: u64::try_from(have).unwrap_or(0),
                        limit: self.options.max_transcript_bytes,
                    },
                });
            };
            insert_messages!(tx, lease, next - count, &bodies);
            tx.commit().await?;
        });
        Ok(())
    }

    async fn stage_turn(&self, lease: &RunLease, turn: Option<&Message>) -> Result<(), StoreError> {
        // The last write before the batch's tools start: a cancel recorded
        // by another replica (whose poll has not reached this one yet) or a
        // deleted session stops the batch here. In one statement with the
        // fence, so on Postgres the cancel's update of the run row and this
        // one are serialized: either the cancel is seen here, or the batch
        // was staged before the cancel was recorded (and answered OK).
        let sql = self.sql(&format!(
            "UPDATE runs SET pending_turn = $3, lease_expires_ms = {{now}} + $4
             WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL AND {MAY_START}"
        ));
        let body = turn.map(serde_json::to_string).transpose()?;
        with_pool!(self, p => {
            let n = sqlx::query(&sql)
                .bind(&lease.run_id)
                .bind(lease.epoch)
                .bind(body)
                .bind(ms(self.options.lease))
                .execute(&mut *p)
                .await?
                .rows_affected();
            if n == 0 {
                // Read again, nothing stands in the way: cannot be (a
                // cancel, a delete and a lost lease are all for good), so
                // answered as the fence's own refusal.
                return Err(stopped!(p, lease)
                    .unwrap_or_else(|| StoreError::LeaseLost(lease.run_id.clone())));
            }
        });
        Ok(())
    }

    async fn check_run(&self, lease: &RunLease) -> Result<(), StoreError> {
        match with_pool!(self, p => stopped!(p, lease)) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn end_run(
        &self,
        lease: &RunLease,
        messages: &[Message],
        end: &RunEnd,
    ) -> Result<(), StoreError> {
        // Returns the staged turn, which an interrupted end closes (see
        // `closes_staged_turn`). RETURNING gives the row as updated, so the
        // turn is cleared by a statement of its own, run only when there is
        // one (a batch in flight as the run ends: rare).
        let finish = self.sql(
            "UPDATE runs SET ended_ms = {now}, outcome = $3, reason = $4, input_tokens = $5,
                 output_tokens = $6, turns = $7
             WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL RETURNING pending_turn",
        );
        // The run's last commit is never refused for size: the answer it
        // carries was produced and paid for; the limit stops the next run.
        let free = self.sql(
            "UPDATE sessions SET active_run = NULL, last_active_ms = {now},
                 next_seq = next_seq + $2, transcript_bytes = transcript_bytes + $3
             WHERE id = $1 AND active_run = $4 RETURNING next_seq",
        );
        let mut bodies = messages
            .iter()
            .map(serde_json::to_string)
            .collect::<Result<Vec<_>, _>>()?;
        if self.pg_end_run(lease, &bodies, end).await? {
            return Ok(());
        }
        let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let finished: Option<(Option<String>,)> = sqlx::query_as(&finish)
                .bind(&lease.run_id)
                .bind(lease.epoch)
                .bind(end.outcome.name())
                .bind(&end.reason)
                .bind(to_i64(end.usage.input_tokens))
                .bind(to_i64(end.usage.output_tokens))
                .bind(i64::from(end.turns))
                .fetch_optional(&mut *tx)
                .await?;
            let Some((staged,)) = finished else {
                // The same end under the same epoch already recorded is
                // this end: a retry whose first attempt committed but
                // whose answer was lost with its connection.
                let done: Option<(Option<String>, Option<String>)> = sqlx::query_as(
                    "SELECT outcome, reason FROM runs WHERE id = $1 AND epoch = $2 AND ended_ms IS NOT NULL",
                )
                .bind(&lease.run_id)
                .bind(lease.epoch)
                .fetch_optional(&mut *tx)
                .await?;
                if done.is_some_and(|(o, r)| {
                    o.as_deref() == Some(end.outcome.name()) && r.as_deref() == Some(end.reason.as_str())
                }) {
                    // Ends the body (rolling back nothing written); the
                    // function then answers Ok.
                    return Ok(());
                }
                // Neither the run nor its session is left: the session was
                // deleted and the run's end recorded (then deleted with
                // it, below) by a first attempt or another replica.
                let (run, session): (i64, i64) = sqlx::query_as(
                    "SELECT (SELECT COUNT(*) FROM runs WHERE id = $1),
                            (SELECT COUNT(*) FROM sessions WHERE id = $2)",
                )
                .bind(&lease.run_id)
                .bind(&lease.session_id)
                .fetch_one(&mut *tx)
                .await?;
                if run == 0 && session == 0 {
                    return Ok(());
                }
                return Err(StoreError::LeaseLost(lease.run_id.clone()));
            };
            if let Some(staged) = staged {
                sqlx::query("UPDATE runs SET pending_turn = NULL WHERE id = $1")
                    .bind(&lease.run_id)
                    .execute(&mut *tx)
                    .await?;
                if closes_staged_turn(end.outcome) {
                    let turn: Message = serde_json::from_str(&staged)?;
                    for m in close_pending_turn(Some(turn)) {
                        bodies.push(serde_json::to_string(&m)?);
                    }
                }
            }
            let bytes =
                i64::try_from(bodies.iter().map(String::len).sum::<usize>()).unwrap_or(i64::MAX);
            let count = i64::try_from(bodies.len()).unwrap_or(i64::MAX);
            sqlx::query("UPDATE approvals SET state = 'expired' WHERE run_id = $1 AND state = 'pending'")
                .bind(&lease.run_id)
                .execute(&mut *tx)
                .await?;
            let next: Option<(i64,)> = sqlx::query_as(&free)
                .bind(&lease.session_id)
                .bind(count)
                .bind(bytes)
                .bind(&lease.run_id)
                .fetch_optional(&mut *tx)
                .await?;
            // No row: the session was deleted meanwhile; nothing to append,
            // and the run goes as its session's ended runs went (its
            // approvals cascade), instead of staying behind for good.
            if next.is_none() {
                sqlx::query(
                    "DELETE FROM runs WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM sessions WHERE id = $2)",
                )
                .bind(&lease.run_id)
                .bind(&lease.session_id)
                .execute(&mut *tx)
                .await?;
            }
            if let Some((next,)) = next {
                insert_messages!(tx, lease, next - count, &bodies);
            }
            tx.commit().await?;
        });
        Ok(())
    }

    async fn request_approval(&self, lease: &RunLease, call_id: &str) -> Result<(), StoreError> {
        // Fenced as `stage_turn` is: a request recorded after the run's
        // cancel would reach the client as a question nobody may answer.
        let fence = self.sql(&format!(
            "UPDATE runs SET lease_expires_ms = {{now}} + $3
             WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL AND {MAY_START}"
        ));
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let held = sqlx::query(&fence)
                .bind(&lease.run_id)
                .bind(lease.epoch)
                .bind(ms(self.options.lease))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            if held == 0 {
                return Err(stopped!(tx, lease)
                    .unwrap_or_else(|| StoreError::LeaseLost(lease.run_id.clone())));
            }
            sqlx::query(
                "INSERT INTO approvals (run_id, call_id, state, note) VALUES ($1, $2, 'pending', '')
                 ON CONFLICT (run_id, call_id) DO UPDATE SET state = 'pending', note = ''",
            )
            .bind(&lease.run_id)
            .bind(call_id)
            .execute(&mut *tx)
            .await?;
            if self.is_postgres() {
                // Delivered at commit, to every replica.
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(WAKE_CHANNEL)
                    .bind(super::asked_hint(&lease.run_id))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        self.wake_local(&super::asked_hint(&lease.run_id));
        Ok(())
    }

    async fn resolve_approval(
        &self,
        run_id: &str,
        call_id: &str,
        d: &Decision,
    ) -> Result<(), StoreError> {
        let state = if d.approve { "approved" } else { "denied" };
        let postgres = self.is_postgres();
        let replica = with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let n = sqlx::query(
                "UPDATE approvals SET state = $3, note = $4
                 WHERE run_id = $1 AND call_id = $2 AND state = 'pending'",
            )
            .bind(run_id)
            .bind(call_id)
            .bind(state)
            .bind(&d.note)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if n == 0 {
                // Answered, expired or withdrawn; or not asked yet. Under
                // PostgreSQL's read committed, a request committed after
                // the UPDATE began is seen here: asked just now, so the
                // answer is tried again (as one not asked yet is).
                let state: Option<(String,)> =
                    sqlx::query_as("SELECT state FROM approvals WHERE run_id = $1 AND call_id = $2")
                        .bind(run_id)
                        .bind(call_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                let active = match state {
                    Some((state,)) => state == "pending",
                    // Only a run that may still ask: not ended, no cancel.
                    None => sqlx::query(&format!(
                        "SELECT 1 FROM runs WHERE id = $1 AND ended_ms IS NULL AND {MAY_START}"
                    ))
                    .bind(run_id)
                    .fetch_optional(&mut *tx)
                    .await?
                    .is_some(),
                };
                return Err(not_asked_or_done(active, run_id, call_id));
            }
            let (replica,): (String,) = sqlx::query_as("SELECT replica FROM runs WHERE id = $1")
                .bind(run_id)
                .fetch_one(&mut *tx)
                .await?;
            if postgres {
                // Delivered at commit.
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(WAKE_CHANNEL)
                    .bind(&replica)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            replica
        });
        self.wake_local(&replica);
        Ok(())
    }

    async fn expire_approval(
        &self,
        lease: &RunLease,
        call_id: &str,
    ) -> Result<Option<Decision>, StoreError> {
        // Fenced like every write of the run: a holder that lost the run
        // may neither expire its approvals nor be handed an answer to act
        // on (another replica holds, or has ended, the run).
        with_pool!(self, p => {
            let mut tx = p.begin().await?;
            fence!(self, &mut *tx, lease);
            let n = sqlx::query(
                "UPDATE approvals SET state = 'expired' WHERE run_id = $1 AND call_id = $2 AND state = 'pending'",
            )
            .bind(&lease.run_id)
            .bind(call_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            let answered: Option<(String, String)> = if n == 0 {
                sqlx::query_as("SELECT state, note FROM approvals WHERE run_id = $1 AND call_id = $2")
                    .bind(&lease.run_id)
                    .bind(call_id)
                    .fetch_optional(&mut *tx)
                    .await?
            } else {
                None
            };
            tx.commit().await?;
            Ok(answered.and_then(|(s, note)| decision(&s, note)))
        })
    }

    async fn request_cancel(&self, run_id: &str, reason: &str) -> Result<(), StoreError> {
        let postgres = self.is_postgres();
        let replica = with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let replica: Option<(String,)> = sqlx::query_as(
                "UPDATE runs SET cancel_reason = COALESCE(cancel_reason, $2)
                 WHERE id = $1 AND ended_ms IS NULL RETURNING replica",
            )
            .bind(run_id)
            .bind(reason)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((replica,)) = replica else {
                return Err(StoreError::RunNotFound(run_id.to_string()));
            };
            sqlx::query(
                "UPDATE approvals SET state = 'denied', note = 'the run was cancelled'
                 WHERE run_id = $1 AND state = 'pending'",
            )
            .bind(run_id)
            .execute(&mut *tx)
            .await?;
            if postgres {
                sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(WAKE_CHANNEL)
                    .bind(&replica)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            replica
        });
        self.wake_local(&replica);
        Ok(())
    }

    async fn signals(
        &self,
        replica: &str,
        waiting: &[(String, String)],
    ) -> Result<Vec<Signal>, StoreError> {
        // runs_cancelled (migration 3) holds only runs in flight with a
        // cancel; the answers are looked up by primary key for what the
        // replica's runs wait for, as a JSON list of [run, call] pairs.
        let pairs = self.json_pairs(2, "run_id", "call_id", "text");
        // The run's check is a scalar subquery so that PostgreSQL looks
        // each run up by key; as a join it hashed every run in flight.
        let answers_sql = format!(
            "SELECT a.run_id, a.call_id, a.state, a.note FROM ({pairs}) AS w
             JOIN approvals a ON a.run_id = w.run_id AND a.call_id = w.call_id
             WHERE a.state IN ('approved', 'denied')
               AND (SELECT r.replica FROM runs r WHERE r.id = a.run_id AND r.ended_ms IS NULL) = $1"
        );
        let lists = json_lists(waiting)?;
        let (cancels, approvals): (Vec<(String, String)>, Vec<(String, String, String, String)>) = with_pool!(self, p => {
            let c = sqlx::query_as(
                "SELECT id, cancel_reason FROM runs
                 WHERE replica = $1 AND ended_ms IS NULL AND cancel_reason IS NOT NULL",
            )
            .bind(replica)
            .fetch_all(&mut *p)
            .await?;
            let mut a = Vec::new();
            for list in &lists {
                a.extend(
                    sqlx::query_as(&answers_sql)
                        .bind(replica)
                        .bind(list)
                        .fetch_all(&mut *p)
                        .await?,
                );
            }
            (c, a)
        });
        let mut out: Vec<Signal> = cancels
            .into_iter()
            .map(|(run_id, reason)| Signal::Cancel { run_id, reason })
            .collect();
        for (run_id, call_id, state, note) in approvals {
            if let Some(decision) = decision(&state, note) {
                out.push(Signal::Approval {
                    run_id,
                    call_id,
                    decision,
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
        let select = self.sql(
            "SELECT id, session_id, epoch, replica, pending_turn FROM runs
             WHERE ended_ms IS NULL AND lease_expires_ms < {now}
             ORDER BY lease_expires_ms LIMIT $1 {skip_locked}",
        );
        let claim = self.sql(
            "UPDATE runs SET epoch = epoch + 1, replica = $2, lease_expires_ms = {now} + $3
             WHERE id = $1 AND epoch = $4",
        );
        let get = self.sql("SELECT {session_cols} FROM sessions WHERE id = $1");
        let lease_ms = ms(self.options.lease);
        let claimed: Vec<(RunLease, String, Option<String>, Option<SessionRow>)> = with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let rows: Vec<(String, String, i64, String, Option<String>)> = sqlx::query_as(&select)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
            let mut out = Vec::new();
            for (id, session_id, epoch, lost, pending) in rows {
                let n = sqlx::query(&claim)
                    .bind(&id)
                    .bind(replica)
                    .bind(lease_ms)
                    .bind(epoch)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if n == 0 {
                    continue;
                }
                let s: Option<SessionRow> = sqlx::query_as(&get)
                    .bind(&session_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                out.push((
                    RunLease { run_id: id, session_id, epoch: epoch + 1 },
                    lost,
                    pending,
                    s,
                ));
            }
            tx.commit().await?;
            out
        });
        claimed
            .into_iter()
            .map(|(lease, lost_replica, pending, s)| {
                Ok(ClaimedRun {
                    lease,
                    lost_replica,
                    session: s.map(session).transpose()?,
                    pending_turn: pending
                        .map(|b| serde_json::from_str::<Message>(&b))
                        .transpose()?,
                })
            })
            .collect()
    }

    async fn expire_sessions(&self, ttl: Duration, limit: u32) -> Result<Vec<Session>, StoreError> {
        let select = self.sql(
            "SELECT {session_cols} FROM sessions
             WHERE active_run IS NULL AND last_active_ms < {now} - $1
             ORDER BY last_active_ms LIMIT $2 {skip_locked}",
        );
        let rows: Vec<SessionRow> = with_pool!(self, p => {
            let mut tx = p.begin().await?;
            let rows: Vec<SessionRow> = sqlx::query_as(&select)
                .bind(ms(ttl))
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
            let mut gone = Vec::new();
            for r in rows {
                let n = sqlx::query("DELETE FROM sessions WHERE id = $1 AND active_run IS NULL")
                    .bind(&r.0)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if n == 1 {
                    forget_runs!(self, tx, &r.0, &r.2);
                    gone.push(r);
                }
            }
            if !gone.is_empty() {
                prune_deleted_starts!(self, tx);
            }
            tx.commit().await?;
            gone
        });
        rows.into_iter().map(session).collect()
    }

    fn subscribe(&self) -> broadcast::Receiver<String> {
        self.wake.subscribe()
    }

    async fn close(&self) {
        if let Some(l) = self.listener.locked().take() {
            l.abort();
        }
        match &self.pool {
            Pool::Sqlite(one) => one.close().await,
            Pool::Postgres(pool) => pool.close().await,
        }
        if let Some(own) = &self.renewals {
            own.close().await;
        }
    }
}
