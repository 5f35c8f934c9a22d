//! PostgreSQL's one-statement paths for a run's three writes (its start,
//! a commit, its end): each the whole write when nothing is in its way.
//!
//! Why: a one-turn run cost the database 18 statements (three
//! transactions, each with its BEGIN and COMMIT, and a fence before each
//! write), ~2.2 ms of its CPU, most of it per statement (the round trip,
//! the portal, the executor's start and end) rather than in any one of
//! them; 10 000 runs started at once on a database with two vCPUs then
//! queued past the pool's acquire timeout. Here each write is one
//! statement of data-modifying CTEs, atomic by itself, so it needs no
//! transaction around it.
//!
//! Each path does its write only when every condition of the write holds,
//! and otherwise changes nothing (every part is gated on the one before
//! it) and answers `false`: the caller then runs the engine-neutral
//! transaction, which finds out what is in the way (and answers the
//! precise error) or, if that cleared meanwhile, does the write. So the
//! refusals, retries and rare paths (a staged batch, a deleted session)
//! have one implementation, and these only the common one.
//!
//! The fence keeps its order: the run row is locked first (`FOR UPDATE`,
//! as the fence's update did), then the session row, as in the
//! transactions (no new lock order, no new deadlock).

use std::time::Instant;

use sqlx::pool::PoolConnection;
use sqlx::Postgres;

use super::{ms, Pool, SqlStore};
use crate::store::{RunEnd, RunLease, StoreError};

/// Whether a run's start, commit or end was written by its one statement.
pub(super) type Written = bool;

/// The insert of a write's messages: the bodies, array parameter `$bodies`,
/// numbered up to the `next_seq` that the CTE named `grown` returned (after
/// adding their count, `$4`); `$1` is the run, `$3` its session.
fn insert_messages(grown: &str, bodies: u8) -> String {
    format!(
        "INSERT INTO messages (session_id, run_id, seq, body)
         SELECT $3, $1, {grown}.next_seq - $4 + m.n - 1, m.body
         FROM {grown}, unnest(${bodies}::text[]) WITH ORDINALITY AS m(body, n)"
    )
}

impl SqlStore {
    /// A pooled connection when the engine is PostgreSQL.
    async fn pg_conn(&self) -> Result<Option<PoolConnection<Postgres>>, StoreError> {
        let Pool::Postgres(pool) = &self.pool else {
            return Ok(None);
        };
        let asked = Instant::now();
        let conn = pool.acquire().await?;
        self.waits.record("postgres", asked.elapsed());
        Ok(Some(conn))
    }

    /// `begin_run`'s claim of the session and insert of the run, when the
    /// session has no active run and room in its transcript.
    pub(super) async fn pg_begin_run(
        &self,
        session_id: &str,
        run_id: &str,
        replica: &str,
    ) -> Result<Written, StoreError> {
        let Some(mut conn) = self.pg_conn().await? else {
            return Ok(false);
        };
        let sql = self.sql(
            "WITH claimed AS (
                 UPDATE sessions SET run_count = run_count + 1, active_run = $2,
                     last_active_ms = {now}
                 WHERE id = $1 AND active_run IS NULL AND transcript_bytes < $5
                 RETURNING owner)
             INSERT INTO runs (id, session_id, replica, epoch, lease_expires_ms, started_ms, owner)
             SELECT $2, $1, $3, 1, {now} + $4, {now}, owner FROM claimed
             RETURNING 1",
        );
        let limit = i64::try_from(self.options.max_transcript_bytes).unwrap_or(i64::MAX);
        let row: Result<Option<(i32,)>, sqlx::Error> = sqlx::query_as(&sql)
            .bind(session_id)
            .bind(run_id)
            .bind(replica)
            .bind(ms(self.options.lease))
            .bind(limit)
            .fetch_optional(&mut *conn)
            .await;
        match row {
            Ok(row) => Ok(row.is_some()),
            // Another active run (the unique index backs the session
            // row): the statement changed nothing; the transaction says so.
            Err(e) if super::is_unique_violation(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// `append`'s fence, growth of the session and insert of `bodies`
    /// (the messages' JSON), when the lease holds and the transcript has
    /// room for them.
    pub(super) async fn pg_append(
        &self,
        lease: &RunLease,
        bodies: &[String],
        bytes: i64,
    ) -> Result<Written, StoreError> {
        let Some(mut conn) = self.pg_conn().await? else {
            return Ok(false);
        };
        let sql = self.sql(&format!(
            "WITH fenced AS (
                 SELECT id FROM runs WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL FOR UPDATE),
             grown AS (
                 UPDATE sessions SET next_seq = next_seq + $4,
                     transcript_bytes = transcript_bytes + $5, last_active_ms = {{now}}
                 WHERE id = $3 AND active_run = $1 AND transcript_bytes + $5 <= $6
                     AND EXISTS (SELECT 1 FROM fenced)
                 RETURNING next_seq),
             renewed AS (
                 UPDATE runs SET lease_expires_ms = {{now}} + $7, pending_turn = NULL
                 WHERE id = $1 AND EXISTS (SELECT 1 FROM grown)),
             added AS ({})
             SELECT next_seq FROM grown",
            insert_messages("grown", 8),
        ));
        let count = i64::try_from(bodies.len()).unwrap_or(i64::MAX);
        let limit = i64::try_from(self.options.max_transcript_bytes).unwrap_or(i64::MAX);
        let row: Option<(i64,)> = sqlx::query_as(&sql)
            .bind(&lease.run_id)
            .bind(lease.epoch)
            .bind(&lease.session_id)
            .bind(count)
            .bind(bytes)
            .bind(limit)
            .bind(ms(self.options.lease))
            .bind(bodies)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(row.is_some())
    }

    /// `end_run`'s record of the end, expiry of pending approvals, release
    /// of the session and insert of `bodies`, when the lease holds, no
    /// batch is staged and the session is still there.
    pub(super) async fn pg_end_run(
        &self,
        lease: &RunLease,
        bodies: &[String],
        end: &RunEnd,
    ) -> Result<Written, StoreError> {
        let Some(mut conn) = self.pg_conn().await? else {
            return Ok(false);
        };
        let sql = self.sql(&format!(
            "WITH fenced AS (
                 SELECT id FROM runs
                 WHERE id = $1 AND epoch = $2 AND ended_ms IS NULL AND pending_turn IS NULL
                 FOR UPDATE),
             freed AS (
                 UPDATE sessions SET active_run = NULL, last_active_ms = {{now}},
                     next_seq = next_seq + $4, transcript_bytes = transcript_bytes + $5
                 WHERE id = $3 AND active_run = $1 AND EXISTS (SELECT 1 FROM fenced)
                 RETURNING next_seq),
             finished AS (
                 UPDATE runs SET ended_ms = {{now}}, outcome = $6, reason = $7, input_tokens = $8,
                     output_tokens = $9, turns = $10
                 WHERE id = $1 AND EXISTS (SELECT 1 FROM freed)),
             denied AS (
                 UPDATE approvals SET state = 'expired'
                 WHERE run_id = $1 AND state = 'pending' AND EXISTS (SELECT 1 FROM freed)),
             added AS ({})
             SELECT next_seq FROM freed",
            insert_messages("freed", 11),
        ));
        let to_i64 = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let count = i64::try_from(bodies.len()).unwrap_or(i64::MAX);
        let bytes =
            i64::try_from(bodies.iter().map(String::len).sum::<usize>()).unwrap_or(i64::MAX);
        let row: Option<(i64,)> = sqlx::query_as(&sql)
            .bind(&lease.run_id)
            .bind(lease.epoch)
            .bind(&lease.session_id)
            .bind(count)
            .bind(bytes)
            .bind(end.outcome.name())
            .bind(&end.reason)
            .bind(to_i64(end.usage.input_tokens))
            .bind(to_i64(end.usage.output_tokens))
            .bind(i64::from(end.turns))
            .bind(bodies)
            .fetch_optional(&mut *conn)
            .await?;
        Ok(row.is_some())
    }
}
