//! Versioned schema migrations, one folder per engine, embedded in the
//! binary (no migration files to ship, no database needed at build time).
//! An applied migration is never edited: a change is a new file.
//!
//! sqlx's migrator records each in `_sqlx_migrations` and, on Postgres,
//! holds an advisory lock while it runs, so replicas starting together
//! apply each migration once (the others wait, then find it applied).

use std::borrow::Cow;

use futures::future::BoxFuture;
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};

/// (version, description, SQL)
type Embedded = &'static [(i64, &'static str, &'static str)];

const SQLITE: Embedded = &[
    (
        1,
        "sessions runs transcript approvals",
        include_str!("migrations/sqlite/0001_sessions.sql"),
    ),
    (
        2,
        "the owner on each run, for quota checks",
        include_str!("migrations/sqlite/0002_run_owner.sql"),
    ),
    (
        3,
        "runs in flight with a cancel, indexed for the signal poll",
        include_str!("migrations/sqlite/0003_cancel_signals.sql"),
    ),
    (
        4,
        "start times of deleted sessions' runs, for the run-rate quota",
        include_str!("migrations/sqlite/0004_deleted_run_starts.sql"),
    ),
];

const POSTGRES: Embedded = &[
    (
        1,
        "sessions runs transcript approvals",
        include_str!("migrations/postgres/0001_sessions.sql"),
    ),
    (
        2,
        "the owner on each run, for quota checks",
        include_str!("migrations/postgres/0002_run_owner.sql"),
    ),
    (
        3,
        "runs in flight with a cancel, indexed for the signal poll",
        include_str!("migrations/postgres/0003_cancel_signals.sql"),
    ),
    (
        4,
        "start times of deleted sessions' runs, for the run-rate quota",
        include_str!("migrations/postgres/0004_deleted_run_starts.sql"),
    ),
];

#[derive(Debug)]
struct Source(Embedded);

impl<'s> MigrationSource<'s> for Source {
    fn resolve(self) -> BoxFuture<'s, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async move {
            Ok(self
                .0
                .iter()
                .map(|(v, d, sql)| {
                    Migration::new(
                        *v,
                        Cow::Borrowed(*d),
                        MigrationType::Simple,
                        Cow::Borrowed(*sql),
                        false,
                    )
                })
                .collect())
        })
    }
}

pub async fn sqlite() -> Result<Migrator, sqlx::migrate::MigrateError> {
    migrator(SQLITE).await
}

pub async fn postgres() -> Result<Migrator, sqlx::migrate::MigrateError> {
    migrator(POSTGRES).await
}

async fn migrator(m: Embedded) -> Result<Migrator, sqlx::migrate::MigrateError> {
    let mut m = Migrator::new(Source(m)).await?;
    // Migrations only add, so a rolled-back binary runs on a database a
    // newer one migrated (it does not know the newer versions).
    m.set_ignore_missing(true);
    Ok(m)
}
