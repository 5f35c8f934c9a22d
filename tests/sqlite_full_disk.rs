//! SQLite after a commit fails for want of space: later writes are still
//! committed. SQLite rolls such a transaction back itself; sqlx, unaware,
//! kept counting it as open, and a connection kept after the error ran
//! every later call inside a savepoint of that phantom transaction. Once
//! one call rolled back to its savepoint (any refusal inside a
//! transaction), nothing more was committed while every write reported
//! success, and a restart lost it all.
//!
//! The disk fills through the process's file-size limit (RLIMIT_FSIZE),
//! which is process-wide: this test is alone in its binary, and writes
//! nothing else while the limit is on.

use std::time::Duration;

use hookwire::agent::approvals::Decision;
use hookwire::config::StoreSetting;
use hookwire::message::Message;
use hookwire::store::{self, NewSession, StoreError, StoreOptions};
use rustix::process::{getrlimit, setrlimit, Resource};

/// Lifts the file-size limit when dropped (a failing assertion too).
struct FileSizeLimit(rustix::process::Rlimit);

impl FileSizeLimit {
    fn set(bytes: u64) -> FileSizeLimit {
        let before = getrlimit(Resource::Fsize);
        let mut low = before;
        low.current = Some(bytes);
        setrlimit(Resource::Fsize, low).expect("lower the file-size limit");
        FileSizeLimit(before)
    }
}

impl Drop for FileSizeLimit {
    fn drop(&mut self) {
        setrlimit(Resource::Fsize, self.0).expect("restore the file-size limit");
    }
}

#[tokio::test]
async fn sqlite_writes_after_a_commit_failed_on_a_full_disk_are_committed() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("h.db");
    let s = store::open(
        &StoreSetting::Sqlite { path: db.clone() },
        StoreOptions {
            lease: Duration::from_secs(60),
            max_transcript_bytes: 1 << 30,
        },
    )
    .await
    .unwrap();
    s.create_session(&NewSession {
        id: "s".into(),
        agent: "a".into(),
        owner: "o".into(),
        extra_hooks: vec![],
        metadata: Default::default(),
    })
    .await
    .unwrap();
    let lease = s.begin_run("s", "r", "A").await.unwrap();
    s.append(&lease, &[Message::user("before")]).await.unwrap();

    // Writing past the limit fails (EFBIG) instead of killing the process:
    // a handler for SIGXFSZ replaces its default action.
    let _xfsz = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::from_raw(
        rustix::process::Signal::XFSZ.as_raw(),
    ))
    .unwrap();
    let wal = std::fs::metadata(dir.path().join("h.db-wal"))
        .map(|m| m.len())
        .unwrap_or(0);
    let big = "x".repeat(32 * 1024);
    let failed = {
        let _limit = FileSizeLimit::set(wal.max(4096));
        let mut failed = None;
        // The log is written from its start again after a checkpoint, so
        // a few appends may fit before one reaches the limit.
        for _ in 0..400 {
            if let Err(e) = s.append(&lease, &[Message::user(&big)]).await {
                failed = Some(e);
                break;
            }
        }
        failed
    };
    let failed = failed.expect("an append failed once the disk was full");
    assert!(
        matches!(failed, StoreError::Backend(_) | StoreError::Unavailable(_)),
        "{failed:?}"
    );

    // A refusal inside a transaction (rolled back), then a write.
    let refused = s
        .resolve_approval(
            "r",
            "never-asked",
            &Decision {
                approve: true,
                note: String::new(),
            },
        )
        .await
        .unwrap_err();
    assert!(
        matches!(refused, StoreError::ApprovalNotAsked { .. }),
        "{refused:?}"
    );
    s.append(&lease, &[Message::user("after")]).await.unwrap();

    // What another connection, or the next process, finds in the file.
    use sqlx::Connection as _;
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let (after,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM messages WHERE body LIKE '%after%'")
            .fetch_one(&mut other)
            .await
            .unwrap();
    assert_eq!(after, 1, "the write after the full disk is committed");
    s.close().await;
}
