//! The store contract: every engine (memory, SQLite, a real PostgreSQL)
//! passes the same tests, generated per engine by `contract!`; and how the
//! engine reads what the store answers (a renewal refused for a run that
//! ended meanwhile).

mod support;

use std::sync::Arc;
use std::time::Duration;

use hookwire::agent::approvals::Decision;
use hookwire::agent::outcome::RunOutcome;
use hookwire::config::StoreSetting;
use hookwire::message::{Block, Message, Role, ToolCall};
use hookwire::store::{
    self, NewSession, RunEnd, SessionFilter, SessionStore, Signal, StoreError, StoreOptions,
    TranscriptCache,
};

/// A lease short enough to be expired after [`EXPIRED`]: the tests only
/// ever wait for at least that long, never for at most.
const SHORT_LEASE: Duration = Duration::from_millis(1);
const EXPIRED: Duration = Duration::from_millis(20);

fn opts(lease: Duration, max_bytes: u64) -> StoreOptions {
    StoreOptions {
        lease,
        max_transcript_bytes: max_bytes,
    }
}

async fn open(engine: &str, o: StoreOptions) -> Arc<dyn SessionStore> {
    let setting = match engine {
        "memory" => StoreSetting::Memory,
        "sqlite" => {
            let dir = tempfile::tempdir().unwrap().keep();
            StoreSetting::Sqlite {
                path: dir.join("h.db"),
            }
        }
        "postgres" => StoreSetting::parse(&support::postgres::database(), false).unwrap(),
        other => panic!("{other}"),
    };
    store::open(&setting, o).await.expect("store opens")
}

fn new_session(id: &str, agent: &str, owner: &str) -> NewSession {
    NewSession {
        id: id.into(),
        agent: agent.into(),
        owner: owner.into(),
        extra_hooks: vec!["h".into()],
        metadata: [("k".to_string(), "v".to_string())].into(),
    }
}

fn end(outcome: RunOutcome) -> RunEnd {
    RunEnd {
        outcome,
        reason: String::new(),
        usage: Default::default(),
        turns: 1,
    }
}

fn call_turn(ids: &[&str]) -> Message {
    Message {
        role: Role::Assistant,
        blocks: ids
            .iter()
            .map(|id| {
                Block::ToolCall(ToolCall {
                    id: id.to_string(),
                    name: "t".into(),
                    arguments_json: "{}".into(),
                })
            })
            .collect(),
    }
}

async fn sessions_are_created_read_listed_by_page_and_deleted(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    let created = s
        .create_session(&new_session("s1", "a", "alice"))
        .await
        .unwrap();
    assert_eq!(created.owner, "alice");
    assert_eq!(created.extra_hooks, vec!["h".to_string()]);
    for i in 2..=5 {
        let agent = if i % 2 == 0 { "b" } else { "a" };
        s.create_session(&new_session(&format!("s{i}"), agent, "bob"))
            .await
            .unwrap();
    }
    let got = s.get_session("s1").await.unwrap();
    assert_eq!(got.metadata.get("k").map(String::as_str), Some("v"));
    // Pages of two, in creation order, covering every session once.
    let mut seen = Vec::new();
    let mut f = SessionFilter {
        page_size: 2,
        ..Default::default()
    };
    loop {
        let page = s.list_sessions(&f).await.unwrap();
        assert!(page.sessions.len() <= 2);
        seen.extend(page.sessions.iter().map(|s| s.id.clone()));
        if page.next_page_token.is_empty() {
            break;
        }
        f.page_token = page.next_page_token;
    }
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 5, "{seen:?}");
    let by_agent = s
        .list_sessions(&SessionFilter {
            agent: Some("b".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_agent.sessions.len(), 2);
    assert!(by_agent.sessions.iter().all(|s| s.agent == "b"));
    let by_owner = s
        .list_sessions(&SessionFilter {
            owner: Some("alice".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(by_owner.sessions.len(), 1);
    assert_eq!(
        s.list_sessions(&SessionFilter {
            page_token: "garbage".into(),
            ..Default::default()
        })
        .await
        .unwrap_err(),
        StoreError::BadPageToken
    );
    s.delete_session("s1").await.unwrap();
    assert_eq!(
        s.get_session("s1").await.unwrap_err(),
        StoreError::SessionNotFound("s1".into())
    );
    assert!(matches!(
        s.delete_session("s1").await,
        Err(StoreError::SessionNotFound(_))
    ));
    s.close().await;
}

/// The text of each message, in order.
fn texts_of(transcript: &[Message]) -> Vec<String> {
    transcript.iter().map(|m| m.text()).collect()
}

async fn one_active_run_per_session_and_transcript_in_order(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let lease = s.begin_run("s", "r1", "A").await.unwrap();
    assert_eq!(
        s.begin_run("s", "r2", "B").await.unwrap_err(),
        StoreError::Busy {
            session: "s".into(),
            run: "r1".into()
        }
    );
    assert!(matches!(
        s.begin_run("nope", "r3", "A").await,
        Err(StoreError::SessionNotFound(_))
    ));
    s.append(&lease, &[Message::user("one")]).await.unwrap();
    s.append(
        &lease,
        &[Message::assistant_text("two"), Message::user("three")],
    )
    .await
    .unwrap();
    s.end_run(
        &lease,
        &[Message::assistant_text("four")],
        &end(RunOutcome::Completed),
    )
    .await
    .unwrap();
    assert_eq!(
        texts_of(&s.transcript("s").await.unwrap()),
        ["one", "two", "three", "four"]
    );
    let info = s.get_session("s").await.unwrap();
    assert_eq!(info.active_run, None);
    assert_eq!(info.run_count, 1);
    // Free again; and an ended run's lease writes nothing.
    let l2 = s.begin_run("s", "r2", "B").await.unwrap();
    assert_eq!(
        s.append(&lease, &[Message::user("late")])
            .await
            .unwrap_err(),
        StoreError::LeaseLost("r1".into())
    );
    s.end_run(&l2, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    assert_eq!(s.transcript("s").await.unwrap().len(), 4);
    s.close().await;
}

/// A commit of more messages than one INSERT carries (200) keeps every
/// one, in order, with its run; and the transcript reads on from any
/// position across the statements' seams.
async fn a_commit_of_hundreds_of_messages_keeps_them_in_order(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let lease = s.begin_run("s", "r1", "A").await.unwrap();
    let texts = |from: usize, n: usize| (from..from + n).map(|i| format!("m{i}"));
    let turn: Vec<Message> = texts(0, 450).map(|t| Message::user(&t)).collect();
    s.append(&lease, &turn).await.unwrap();
    let last: Vec<Message> = texts(450, 201)
        .map(|t| Message::assistant_text(&t))
        .collect();
    s.end_run(&lease, &last, &end(RunOutcome::Completed))
        .await
        .unwrap();
    let got = texts_of(&s.transcript("s").await.unwrap());
    assert_eq!(got, texts(0, 651).collect::<Vec<_>>());
    let after = texts_of(&s.transcript_after("s", 199).await.unwrap());
    assert_eq!(after, texts(199, 452).collect::<Vec<_>>());
    s.close().await;
}

async fn a_claimed_run_fences_out_its_old_holder(engine: &str) {
    let s = open(engine, opts(SHORT_LEASE, 1 << 20)).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let old = s.begin_run("s", "r", "A").await.unwrap();
    s.append(&old, &[Message::user("go")]).await.unwrap();
    s.stage_turn(&old, Some(&call_turn(&["c1", "c2"])))
        .await
        .unwrap();
    s.request_approval(&old, "c1").await.unwrap();
    tokio::time::sleep(EXPIRED).await;
    let claimed = s.claim_expired("B", 10).await.unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    // An approval given meanwhile is not the old holder's to act on, nor
    // to expire.
    s.resolve_approval(
        "r",
        "c1",
        &Decision {
            approve: true,
            note: String::new(),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        s.expire_approval(&old, "c1").await,
        Err(StoreError::LeaseLost("r".into()))
    );
    let c = &claimed[0];
    assert_eq!(c.lost_replica, "A");
    assert!(c.lease.epoch > old.epoch);
    assert_eq!(c.session.as_ref().map(|s| s.agent.as_str()), Some("a"));
    assert_eq!(c.pending_turn, Some(call_turn(&["c1", "c2"])));
    // The old holder can no longer write anything.
    assert_eq!(
        s.append(&old, &[Message::user("x")]).await.unwrap_err(),
        StoreError::LeaseLost("r".into())
    );
    assert!(matches!(s.renew(&old).await, Err(StoreError::LeaseLost(_))));
    assert!(matches!(
        s.stage_turn(&old, None).await,
        Err(StoreError::LeaseLost(_))
    ));
    assert!(matches!(
        s.end_run(&old, &[], &end(RunOutcome::Completed)).await,
        Err(StoreError::LeaseLost(_))
    ));
    // The claimer's interrupted end closes the staged turn; every call
    // gets a result.
    s.end_run(&c.lease, &[], &end(RunOutcome::Interrupted))
        .await
        .unwrap();
    let t = s.transcript("s").await.unwrap();
    assert_eq!(t.len(), 3);
    let results: Vec<_> = t[2].tool_results_iter().collect();
    assert_eq!(results.len(), 2);
    assert!(results
        .iter()
        .all(|r| r.is_error && r.content == store::LOST_REPLICA_RESULT));
    assert_eq!(s.get_session("s").await.unwrap().active_run, None);
    // Claimed once only.
    tokio::time::sleep(EXPIRED).await;
    assert!(s.claim_expired("C", 10).await.unwrap().is_empty());
    s.close().await;
}

/// A replica renews all its runs' leases at once: each answer says whether
/// that lease still held, in order, over more leases than one statement
/// takes (ended runs, runs another replica took over, unknown runs: not).
async fn many_leases_are_renewed_at_once(engine: &str) {
    let s = open(engine, opts(SHORT_LEASE, 1 << 20)).await;
    let mut leases = Vec::new();
    for i in 0..600 {
        let id = format!("s{i}");
        s.create_session(&new_session(&id, "a", "o")).await.unwrap();
        leases.push(s.begin_run(&id, &format!("r{i}"), "A").await.unwrap());
    }
    // Ended, on both sides of the first statement's end.
    for i in [0, 499, 500, 599] {
        s.end_run(&leases[i], &[], &end(RunOutcome::Completed))
            .await
            .unwrap();
    }
    let mut want: Vec<bool> = (0..600).map(|i| ![0, 499, 500, 599].contains(&i)).collect();
    assert_eq!(s.renew_all(&leases).await.unwrap(), want);

    // Taken over by B: the old holder's lease no longer holds, the new one's does.
    tokio::time::sleep(EXPIRED).await;
    let claimed = s.claim_expired("B", 1).await.unwrap();
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    let taken: usize = claimed[0].lease.run_id[1..].parse().unwrap();
    want[taken] = false;
    leases.push(claimed[0].lease.clone());
    want.push(true);
    leases.push(store::RunLease {
        run_id: "nobody".into(),
        session_id: "s1".into(),
        epoch: 1,
    });
    want.push(false);
    assert_eq!(s.renew_all(&leases).await.unwrap(), want);
    assert_eq!(s.renew_all(&[]).await.unwrap(), Vec::<bool>::new());
    s.close().await;
}

/// A run that takes over two of its leases completes: its replica renews
/// the leases of all its runs in flight (`renew_all`) every third of one,
/// and its own reaper, which would end a run whose lease expired, finds
/// none.
async fn a_run_longer_than_its_lease_keeps_it(engine: &str) {
    let store = open(engine, opts(Duration::from_secs(2), 1 << 20)).await;
    let engine = engine_on(store, "5s", "2s");
    let (run, session) = start_one(&engine).await;
    let report = run.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    let s = engine
        .get_session(&hookwire::auth::Principal::anonymous(), &session)
        .await
        .unwrap();
    assert_eq!(s.transcript.len(), 2, "{:?}", s.transcript);
    engine.stop_background().await;
}

/// A lost replica's runs are all ended in the reaper's first pass, however
/// many: a pass used to stop after one batch (16), so a replica that held
/// 10 000 runs left their sessions busy for most of an hour.
async fn a_lost_replicas_runs_are_all_ended_in_one_pass(engine: &str) {
    let (logs, _guard) = support::logwatch::LogWatch::install("hookwire=info");
    let store = open(engine, opts(SHORT_LEASE, 1 << 20)).await;
    let n = 100;
    for i in 0..n {
        let id = format!("s{i}");
        store
            .create_session(&new_session(&id, "a", "o"))
            .await
            .unwrap();
        store
            .begin_run(&id, &format!("r{i}"), "gone")
            .await
            .unwrap();
    }
    tokio::time::sleep(EXPIRED).await;
    // With run_lease 60s the reaper passes every 5 s, the first at start:
    // 16 a pass would take 30 s for these.
    let engine = engine_on(store.clone(), "0ms", "60s");
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let mut busy = 0;
            for i in 0..n {
                let s = store.get_session(&format!("s{i}")).await.unwrap();
                busy += usize::from(s.active_run.is_some());
            }
            if busy == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every lost run ended in the first pass (16 a pass: 30 s)");
    let t = store.transcript("s7").await.unwrap();
    assert!(t.is_empty(), "no tool batch was staged: {t:?}");
    // Each run at info; one warning for the pass, with the count.
    let summary = [
        "WARN",
        "ended a lost replica's runs as interrupted",
        "lost=gone",
    ];
    tokio::time::timeout(Duration::from_secs(10), logs.wait_for(&summary))
        .await
        .unwrap_or_else(|_| panic!("no summary in:\n{}", logs.contents()));
    let warned = logs.lines_with(&summary);
    assert!(
        warned.len() == 1 && warned[0].contains("runs=100"),
        "{warned:?}"
    );
    assert_eq!(
        logs.lines_with(&["INFO", "ended a lost replica's run as interrupted"])
            .len(),
        n
    );
    engine.stop_background().await;
}

/// A run's end recorded twice under its lease is one end (the first call
/// may have committed while its answer was lost with the connection), and
/// a different end of the ended run is refused.
async fn the_same_end_twice_is_one_end(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let lease = s.begin_run("s", "r", "A").await.unwrap();
    let done = end(RunOutcome::Completed);
    let answer = [Message::user("go"), Message::assistant_text("done")];
    s.end_run(&lease, &answer, &done).await.unwrap();
    s.end_run(&lease, &answer, &done)
        .await
        .expect("the same end again is the end already recorded");
    assert_eq!(
        texts(&s.transcript("s").await.unwrap()),
        ["go", "done"],
        "appended once"
    );
    let other = RunEnd {
        reason: "the replica shut down before the run ended".into(),
        ..end(RunOutcome::Interrupted)
    };
    assert_eq!(
        s.end_run(&lease, &[], &other).await.unwrap_err(),
        StoreError::LeaseLost("r".into()),
        "another end of an ended run"
    );
    assert_eq!(s.get_session("s").await.unwrap().active_run, None);
    s.close().await;
}

/// A run ended `interrupted` by its own replica while a tool batch is
/// staged (stuck in a tool at shutdown, stopped for want of a renewal, a
/// late end before any claim) closes the batch as a reaper's end would:
/// its turn and an error result for each call, whose outcome is unknown.
/// It used to drop the turn, so the model never learnt that the calls may
/// have run. Any other end drops it: a failed batch commits nothing.
async fn an_interrupted_end_closes_the_staged_batch(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    for id in ["s1", "s2"] {
        s.create_session(&new_session(id, "a", "o")).await.unwrap();
    }
    let l1 = s.begin_run("s1", "r1", "A").await.unwrap();
    s.append(&l1, &[Message::user("go")]).await.unwrap();
    s.stage_turn(&l1, Some(&call_turn(&["c1", "c2"])))
        .await
        .unwrap();
    let interrupted = RunEnd {
        reason: "the replica shut down before the run ended".into(),
        ..end(RunOutcome::Interrupted)
    };
    s.end_run(&l1, &[], &interrupted).await.unwrap();
    s.end_run(&l1, &[], &interrupted)
        .await
        .expect("the same end again");
    let t = s.transcript("s1").await.unwrap();
    assert_eq!(t.len(), 3, "closed once: {t:?}");
    assert_eq!(t[1], call_turn(&["c1", "c2"]));
    let results: Vec<_> = t[2].tool_results_iter().collect();
    assert_eq!(
        results
            .iter()
            .map(|r| r.call_id.as_str())
            .collect::<Vec<_>>(),
        ["c1", "c2"]
    );
    assert!(results
        .iter()
        .all(|r| r.is_error && r.content == store::LOST_REPLICA_RESULT));
    assert_eq!(s.get_session("s1").await.unwrap().active_run, None);

    let l2 = s.begin_run("s2", "r2", "A").await.unwrap();
    s.append(&l2, &[Message::user("go")]).await.unwrap();
    s.stage_turn(&l2, Some(&call_turn(&["c1"]))).await.unwrap();
    s.end_run(&l2, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    assert_eq!(
        texts(&s.transcript("s2").await.unwrap()),
        ["go"],
        "a cancelled batch commits nothing"
    );
    s.close().await;
}

async fn a_settled_batch_is_no_longer_staged(engine: &str) {
    let s = open(engine, opts(SHORT_LEASE, 1 << 20)).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let l = s.begin_run("s", "r", "A").await.unwrap();
    s.stage_turn(&l, Some(&call_turn(&["c1"]))).await.unwrap();
    s.append(&l, &[call_turn(&["c1"]), Message::user("results")])
        .await
        .unwrap();
    tokio::time::sleep(EXPIRED).await;
    let claimed = s.claim_expired("B", 10).await.unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].pending_turn, None, "the turn was committed");
    s.close().await;
}

/// A replica whose runs wait for more approvals than one statement looks
/// up (500) gets every answer, and only answers to what waits.
async fn many_waiting_approvals_are_read_at_once(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    let mut waits = Vec::new();
    for i in 0..510 {
        let (sid, rid) = (format!("s{i}"), format!("r{i}"));
        s.create_session(&new_session(&sid, "a", "o"))
            .await
            .unwrap();
        let l = s.begin_run(&sid, &rid, "A").await.unwrap();
        s.request_approval(&l, "c").await.unwrap();
        if i % 2 == 0 {
            let d = Decision {
                approve: i % 4 == 0,
                note: format!("n{i}"),
            };
            s.resolve_approval(&rid, "c", &d).await.unwrap();
        }
        // An answered call nobody waits for any more is not read.
        s.request_approval(&l, "gone").await.unwrap();
        s.resolve_approval(
            &rid,
            "gone",
            &Decision {
                approve: true,
                note: String::new(),
            },
        )
        .await
        .unwrap();
        waits.push((rid, "c".to_string()));
    }
    let sig = s.signals("A", &waits).await.unwrap();
    let mut got: Vec<(String, bool, String)> = sig
        .into_iter()
        .map(|x| match x {
            Signal::Approval {
                run_id,
                call_id,
                decision,
            } => {
                assert_eq!(call_id, "c");
                (run_id, decision.approve, decision.note)
            }
            other => panic!("{other:?}"),
        })
        .collect();
    got.sort();
    let mut want: Vec<(String, bool, String)> = (0..510)
        .filter(|i| i % 2 == 0)
        .map(|i| (format!("r{i}"), i % 4 == 0, format!("n{i}")))
        .collect();
    want.sort();
    assert_eq!(got, want);
    s.close().await;
}

/// The (run, call) approvals a replica's runs wait for.
fn waiting(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(r, c)| (r.to_string(), c.to_string()))
        .collect()
}

async fn approvals_first_answer_wins_and_cancel_denies(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let l = s.begin_run("s", "r", "A").await.unwrap();
    let mut hints = s.subscribe();
    s.request_approval(&l, "c1").await.unwrap();
    let yes = Decision {
        approve: true,
        note: String::new(),
    };
    s.resolve_approval("r", "c1", &yes).await.unwrap();
    assert_eq!(
        hints.recv().await.unwrap(),
        store::asked_hint("r"),
        "every replica hears of the question: an answer held for it is tried again"
    );
    assert_eq!(
        hints.recv().await.unwrap(),
        "A",
        "the run's replica is woken"
    );
    assert_eq!(
        s.resolve_approval("r", "c1", &yes).await.unwrap_err(),
        StoreError::ApprovalNotPending {
            run_id: "r".into(),
            call_id: "c1".into()
        }
    );
    // The run is active: the question may still come.
    assert_eq!(
        s.resolve_approval("r", "never-asked", &yes)
            .await
            .unwrap_err(),
        StoreError::ApprovalNotAsked {
            run_id: "r".into(),
            call_id: "never-asked".into()
        }
    );
    assert!(matches!(
        s.resolve_approval("no-such-run", "c1", &yes).await,
        Err(StoreError::ApprovalNotPending { .. })
    ));
    let c1 = waiting(&[("r", "c1")]);
    assert_eq!(
        s.signals("A", &c1).await.unwrap(),
        vec![Signal::Approval {
            run_id: "r".into(),
            call_id: "c1".into(),
            decision: yes.clone()
        }]
    );
    assert!(s.signals("B", &c1).await.unwrap().is_empty(), "not B's run");
    assert!(
        s.signals("A", &[]).await.unwrap().is_empty(),
        "answers are read for what waits only"
    );
    assert!(s
        .signals("A", &waiting(&[("r", "other"), ("elsewhere", "c1")]))
        .await
        .unwrap()
        .is_empty());
    // Answered before the wait gave up: the answer stands.
    assert_eq!(
        s.expire_approval(&l, "c1").await.unwrap(),
        Some(yes.clone())
    );
    // Timed out first: a later answer is refused.
    s.request_approval(&l, "c2").await.unwrap();
    assert_eq!(s.expire_approval(&l, "c2").await.unwrap(), None);
    assert!(matches!(
        s.resolve_approval(
            "r",
            "c2",
            &Decision {
                approve: true,
                note: String::new()
            }
        )
        .await,
        Err(StoreError::ApprovalNotPending { .. })
    ));
    // A cancel is a signal for the run's replica and denies what waits.
    s.request_approval(&l, "c3").await.unwrap();
    s.request_cancel("r", "cancelled by client").await.unwrap();
    let sig = s.signals("A", &waiting(&[("r", "c3")])).await.unwrap();
    assert!(sig.contains(&Signal::Cancel {
        run_id: "r".into(),
        reason: "cancelled by client".into()
    }));
    assert!(sig.iter().any(|x| matches!(x, Signal::Approval { call_id, decision, .. } if call_id == "c3" && !decision.approve)));
    assert!(matches!(
        s.resolve_approval(
            "r",
            "c3",
            &Decision {
                approve: true,
                note: String::new()
            }
        )
        .await,
        Err(StoreError::ApprovalNotPending { .. })
    ));
    s.end_run(&l, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    // Ended: no question can come any more.
    assert!(matches!(
        s.resolve_approval("r", "never-asked", &yes).await,
        Err(StoreError::ApprovalNotPending { .. })
    ));
    assert_eq!(
        s.request_cancel("r", "again").await.unwrap_err(),
        StoreError::RunNotFound("r".into())
    );
    assert!(
        s.signals("A", &waiting(&[("r", "c3")]))
            .await
            .unwrap()
            .is_empty(),
        "ended runs signal nothing"
    );
    s.close().await;
}

async fn transcript_size_is_limited(engine: &str) {
    let s = open(engine, opts(Duration::from_secs(30), 200)).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let l = s.begin_run("s", "r", "A").await.unwrap();
    s.append(&l, &[Message::user("x".repeat(50))])
        .await
        .unwrap();
    let err = s
        .append(&l, &[Message::user("y".repeat(300))])
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::TranscriptFull { limit: 200, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("server.max_transcript_bytes"));
    // The final commit is kept; the next run is refused.
    s.end_run(
        &l,
        &[Message::assistant_text("z".repeat(300))],
        &end(RunOutcome::Failed),
    )
    .await
    .unwrap();
    assert_eq!(s.transcript("s").await.unwrap().len(), 2);
    assert!(matches!(
        s.begin_run("s", "r2", "A").await,
        Err(StoreError::TranscriptFull { .. })
    ));
    s.close().await;
}

/// A write refused for what is in its way changes nothing: a start refused
/// for a busy session counts no run, and a commit refused for size leaves
/// the staged batch staged (an interrupted end still closes it) and the
/// transcript's size as it was. (On PostgreSQL the writes are first tried
/// as one statement each, which must change nothing when it cannot do
/// all of its write.)
async fn a_refused_write_changes_nothing(engine: &str) {
    let s = open(engine, opts(Duration::from_secs(30), 200)).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let l = s.begin_run("s", "r", "A").await.unwrap();
    assert!(matches!(
        s.begin_run("s", "r2", "A").await,
        Err(StoreError::Busy { .. })
    ));
    let session = s.get_session("s").await.unwrap();
    assert_eq!(session.run_count, 1, "the refused start counted no run");
    assert_eq!(session.active_run.as_deref(), Some("r"));
    s.append(&l, &[Message::user("x".repeat(20))])
        .await
        .unwrap();
    s.stage_turn(&l, Some(&call_turn(&["c1"]))).await.unwrap();
    let err = s
        .append(&l, &[Message::user("y".repeat(300))])
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::TranscriptFull { .. }), "{err}");
    // Had the refused commit grown the transcript, this one would not fit.
    s.append(&l, &[Message::user("w".repeat(20))])
        .await
        .unwrap();
    s.stage_turn(&l, Some(&call_turn(&["c2"]))).await.unwrap();
    let err = s
        .append(&l, &[Message::user("y".repeat(300))])
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::TranscriptFull { .. }), "{err}");
    let interrupted = RunEnd {
        reason: "the replica shut down before the run ended".into(),
        ..end(RunOutcome::Interrupted)
    };
    s.end_run(&l, &[], &interrupted).await.unwrap();
    let t = s.transcript("s").await.unwrap();
    assert_eq!(t.len(), 4, "the staged batch was still staged: {t:?}");
    assert_eq!(t[2], call_turn(&["c2"]));
    s.close().await;
}

async fn idle_sessions_expire_but_busy_ones_do_not(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("idle", "a", "o"))
        .await
        .unwrap();
    s.create_session(&new_session("busy", "a", "o"))
        .await
        .unwrap();
    let l = s.begin_run("busy", "r", "A").await.unwrap();
    tokio::time::sleep(EXPIRED).await;
    let gone = s
        .expire_sessions(Duration::from_millis(1), 10)
        .await
        .unwrap();
    assert_eq!(
        gone.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
        ["idle"]
    );
    assert!(matches!(
        s.get_session("idle").await,
        Err(StoreError::SessionNotFound(_))
    ));
    s.end_run(&l, &[], &end(RunOutcome::Completed))
        .await
        .unwrap();
    assert!(s
        .expire_sessions(Duration::from_secs(3600), 10)
        .await
        .unwrap()
        .is_empty());
    s.close().await;
}

async fn deleting_a_session_with_an_active_run_lets_the_run_end(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let l = s.begin_run("s", "r", "A").await.unwrap();
    s.delete_session("s").await.unwrap();
    s.request_cancel("r", "session deleted").await.unwrap();
    assert!(matches!(
        s.append(&l, &[Message::user("x")]).await,
        Err(StoreError::SessionNotFound(_))
    ));
    s.end_run(&l, &[Message::user("x")], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    // A retry whose first attempt committed (its answer lost) is still
    // that end, though the run went with its session.
    s.end_run(&l, &[Message::user("x")], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    s.close().await;
}

/// A run that may start nothing more (a cancel recorded, on any replica,
/// or its session deleted) is told so by the writes that would start work
/// (the staged tool batch, an approval request) and by `check_run`; what
/// it commits and its end still go through.
async fn a_cancelled_or_deleted_runs_work_is_refused(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let l = s.begin_run("s", "r", "A").await.unwrap();
    s.check_run(&l).await.unwrap();
    s.stage_turn(&l, Some(&call_turn(&["c1"]))).await.unwrap();
    s.request_approval(&l, "c1").await.unwrap();
    s.request_cancel("r", "cancelled by client").await.unwrap();
    let cancelled = StoreError::RunCancelled {
        run: "r".into(),
        reason: "cancelled by client".into(),
    };
    assert_eq!(s.check_run(&l).await.unwrap_err(), cancelled);
    assert_eq!(
        s.stage_turn(&l, Some(&call_turn(&["c2"])))
            .await
            .unwrap_err(),
        cancelled
    );
    assert_eq!(s.request_approval(&l, "c2").await.unwrap_err(), cancelled);
    assert!(
        matches!(
            s.resolve_approval(
                "r",
                "c2",
                &Decision {
                    approve: true,
                    note: String::new()
                }
            )
            .await,
            Err(StoreError::ApprovalNotPending { .. })
        ),
        "the refused request was not recorded"
    );
    s.append(&l, &[Message::user("go")]).await.unwrap();
    s.end_run(&l, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    // Ended: the lease holds no more, whatever was recorded for the run.
    assert_eq!(
        s.check_run(&l).await.unwrap_err(),
        StoreError::LeaseLost("r".into())
    );
    // A deleted session's run, before any cancel of it is recorded.
    s.create_session(&new_session("s2", "a", "o"))
        .await
        .unwrap();
    let l2 = s.begin_run("s2", "r2", "A").await.unwrap();
    s.delete_session("s2").await.unwrap();
    let gone = StoreError::SessionNotFound("s2".into());
    assert_eq!(s.check_run(&l2).await.unwrap_err(), gone);
    assert_eq!(
        s.stage_turn(&l2, Some(&call_turn(&["c1"])))
            .await
            .unwrap_err(),
        gone
    );
    assert_eq!(s.request_approval(&l2, "c1").await.unwrap_err(), gone);
    s.end_run(&l2, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    s.close().await;
}

/// A run on `replica` that commits `msgs` (the first with a step, the rest
/// with its end).
async fn commit_run(s: &dyn SessionStore, run: &str, replica: &str, msgs: &[Message]) {
    let lease = s.begin_run("s", run, replica).await.unwrap();
    let (first, rest) = msgs.split_at(msgs.len().min(1));
    s.append(&lease, first).await.unwrap();
    s.end_run(&lease, rest, &end(RunOutcome::Completed))
        .await
        .unwrap();
}

fn texts(m: &[Message]) -> Vec<String> {
    m.iter().map(Message::text).collect()
}

async fn the_transcript_reads_from_a_position(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    assert!(s.transcript_after("s", 0).await.unwrap().is_empty());
    commit_run(
        &*s,
        "r1",
        "A",
        &[Message::user("one"), Message::assistant_text("two")],
    )
    .await;
    commit_run(
        &*s,
        "r2",
        "B",
        &[Message::user("three"), Message::assistant_text("four")],
    )
    .await;
    assert_eq!(
        s.transcript_after("s", 0).await.unwrap(),
        s.transcript("s").await.unwrap()
    );
    assert_eq!(
        texts(&s.transcript_after("s", 1).await.unwrap()),
        ["two", "three", "four"]
    );
    assert_eq!(texts(&s.transcript_after("s", 3).await.unwrap()), ["four"]);
    assert!(s.transcript_after("s", 4).await.unwrap().is_empty());
    assert!(s.transcript_after("s", 99).await.unwrap().is_empty());
    s.create_session(&new_session("empty", "a", "o"))
        .await
        .unwrap();
    assert!(s.transcript("empty").await.unwrap().is_empty());
    // An unknown session is not an empty one, on every engine: a reader
    // that checked the session before it was deleted (GetSession, a run's
    // start) is told it is gone. SQL used to answer an empty transcript.
    s.delete_session("s").await.unwrap();
    for from in [0, 2, 99] {
        assert_eq!(
            s.transcript_after("s", from).await,
            Err(StoreError::SessionNotFound("s".into())),
            "from {from}"
        );
    }
    assert_eq!(
        s.transcript("s").await,
        Err(StoreError::SessionNotFound("s".into()))
    );
    assert_eq!(
        s.transcript("never").await,
        Err(StoreError::SessionNotFound("never".into()))
    );
    s.close().await;
}

/// Two replicas' caches over one store: each sees what the other (or
/// anyone) committed since its copy, and reuses its copy when nothing was.
async fn a_replicas_transcript_cache_sees_what_other_replicas_appended(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let (a, b) = (TranscriptCache::default(), TranscriptCache::default());
    assert!(a.load(&*s, "s").await.unwrap().is_empty());
    commit_run(
        &*s,
        "r1",
        "B",
        &[Message::user("one"), Message::assistant_text("two")],
    )
    .await;
    assert_eq!(texts(&b.load(&*s, "s").await.unwrap()), ["one", "two"]);
    assert_eq!(
        texts(&a.load(&*s, "s").await.unwrap()),
        ["one", "two"],
        "A's empty copy is completed with B's run"
    );
    commit_run(
        &*s,
        "r2",
        "A",
        &[Message::user("three"), Message::assistant_text("four")],
    )
    .await;
    let full = s.transcript("s").await.unwrap();
    let on_a = a.load(&*s, "s").await.unwrap();
    assert_eq!(*on_a, full);
    assert_eq!(*b.load(&*s, "s").await.unwrap(), full, "B's copy too");
    let again = a.load(&*s, "s").await.unwrap();
    assert!(Arc::ptr_eq(&on_a, &again), "nothing new: the same copy");
    a.forget("s");
    assert_eq!(a.held().0, 0);
    s.close().await;
}

/// The store, recording what each `transcript_after` asked and got, and
/// holding the first lease renewal when given a gate.
struct Recording {
    inner: Arc<dyn SessionStore>,
    reads: std::sync::Mutex<Vec<(u64, usize)>>,
    renewal: Option<Arc<RenewalGate>>,
    ends: Option<Arc<EndFaults>>,
}

/// Makes the run's own end (its first lease; a reaper's end goes through)
/// fail UNAVAILABLE: `refuse` times before the store sees it, then, with
/// `lose_answer`, once after the store recorded it, as when the connection
/// drops between the commit and its answer.
///
/// With `stall`, the first refusal comes after that long (a call that
/// waited for a connection in vain); with `no_claims`, no reaper claims an
/// expired run (a single replica whose reaper waits on the same store).
/// With `slow`, the first end waits that long and then goes through (a
/// call that waited long for a connection, and got one).
#[derive(Default)]
struct EndFaults {
    slow: std::sync::Mutex<Option<Duration>>,
    refuse: std::sync::atomic::AtomicUsize,
    lose_answer: std::sync::atomic::AtomicBool,
    calls: std::sync::atomic::AtomicUsize,
    stall: std::sync::Mutex<Option<Duration>>,
    no_claims: bool,
}

impl EndFaults {
    fn refusing(times: usize) -> Arc<EndFaults> {
        let f = EndFaults::default();
        f.refuse.store(times, std::sync::atomic::Ordering::SeqCst);
        Arc::new(f)
    }
}

/// Holds the first renewal until opened, and keeps what the store answered.
#[derive(Default)]
struct RenewalGate {
    taken: std::sync::atomic::AtomicBool,
    entered: tokio::sync::Notify,
    open: tokio::sync::Notify,
    /// Whether the held renewal was refused as `LeaseLost`.
    lease_lost: std::sync::Mutex<Option<bool>>,
}

#[async_trait::async_trait]
impl SessionStore for Recording {
    fn engine(&self) -> &'static str {
        self.inner.engine()
    }
    async fn transcript_after(&self, id: &str, from: u64) -> Result<Vec<Message>, StoreError> {
        let got = self.inner.transcript_after(id, from).await?;
        self.reads.lock().unwrap().push((from, got.len()));
        Ok(got)
    }
    async fn create_session(
        &self,
        s: &NewSession,
    ) -> Result<hookwire::session::Session, StoreError> {
        self.inner.create_session(s).await
    }
    async fn get_session(&self, id: &str) -> Result<hookwire::session::Session, StoreError> {
        self.inner.get_session(id).await
    }
    async fn list_sessions(&self, f: &SessionFilter) -> Result<store::SessionPage, StoreError> {
        self.inner.list_sessions(f).await
    }
    async fn run_session(&self, run: &str) -> Result<hookwire::session::Session, StoreError> {
        self.inner.run_session(run).await
    }
    async fn owner_usage(
        &self,
        owner: &str,
        window: std::time::Duration,
        cap: u64,
    ) -> Result<store::OwnerUsage, StoreError> {
        self.inner.owner_usage(owner, window, cap).await
    }
    async fn delete_session(&self, id: &str) -> Result<hookwire::session::Session, StoreError> {
        self.inner.delete_session(id).await
    }
    async fn transcript(&self, id: &str) -> Result<Vec<Message>, StoreError> {
        self.inner.transcript(id).await
    }
    async fn begin_run(&self, s: &str, r: &str, rep: &str) -> Result<store::RunLease, StoreError> {
        self.inner.begin_run(s, r, rep).await
    }
    async fn renew(&self, l: &store::RunLease) -> Result<(), StoreError> {
        let Some(g) = self
            .renewal
            .as_ref()
            .filter(|g| !g.taken.swap(true, std::sync::atomic::Ordering::SeqCst))
        else {
            return self.inner.renew(l).await;
        };
        let open = g.open.notified();
        g.entered.notify_one();
        open.await;
        let answer = self.inner.renew(l).await;
        *g.lease_lost.lock().unwrap() = Some(matches!(answer, Err(StoreError::LeaseLost(_))));
        answer
    }
    async fn append(&self, l: &store::RunLease, m: &[Message]) -> Result<(), StoreError> {
        self.inner.append(l, m).await
    }
    async fn stage_turn(&self, l: &store::RunLease, t: Option<&Message>) -> Result<(), StoreError> {
        self.inner.stage_turn(l, t).await
    }
    async fn check_run(&self, l: &store::RunLease) -> Result<(), StoreError> {
        self.inner.check_run(l).await
    }
    async fn end_run(
        &self,
        l: &store::RunLease,
        m: &[Message],
        e: &RunEnd,
    ) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        let Some(f) = self.ends.as_ref().filter(|_| l.epoch == 1) else {
            return self.inner.end_run(l, m, e).await;
        };
        f.calls.fetch_add(1, SeqCst);
        let slow = f.slow.lock().unwrap().take();
        if let Some(d) = slow {
            tokio::time::sleep(d).await;
        }
        if f.refuse
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            let stall = f.stall.lock().unwrap().take();
            if let Some(d) = stall {
                tokio::time::sleep(d).await;
            }
            return Err(StoreError::Unavailable("no connection (test)".into()));
        }
        let answer = self.inner.end_run(l, m, e).await;
        if answer.is_ok() && f.lose_answer.swap(false, SeqCst) {
            return Err(StoreError::Unavailable(
                "connection lost after the commit (test)".into(),
            ));
        }
        answer
    }
    async fn request_approval(&self, l: &store::RunLease, c: &str) -> Result<(), StoreError> {
        self.inner.request_approval(l, c).await
    }
    async fn resolve_approval(&self, r: &str, c: &str, d: &Decision) -> Result<(), StoreError> {
        self.inner.resolve_approval(r, c, d).await
    }
    async fn expire_approval(
        &self,
        l: &store::RunLease,
        c: &str,
    ) -> Result<Option<Decision>, StoreError> {
        self.inner.expire_approval(l, c).await
    }
    async fn request_cancel(&self, r: &str, why: &str) -> Result<(), StoreError> {
        self.inner.request_cancel(r, why).await
    }
    async fn signals(
        &self,
        rep: &str,
        waiting: &[(String, String)],
    ) -> Result<Vec<Signal>, StoreError> {
        self.inner.signals(rep, waiting).await
    }
    async fn claim_expired(&self, rep: &str, n: u32) -> Result<Vec<store::ClaimedRun>, StoreError> {
        if self.ends.as_ref().is_some_and(|f| f.no_claims) {
            return Ok(Vec::new());
        }
        self.inner.claim_expired(rep, n).await
    }
    async fn expire_sessions(
        &self,
        ttl: Duration,
        n: u32,
    ) -> Result<Vec<hookwire::session::Session>, StoreError> {
        self.inner.expire_sessions(ttl, n).await
    }
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.inner.subscribe()
    }
    async fn close(&self) {
        self.inner.close().await
    }
}

/// A cache reads only the messages after its copy: none when it is
/// current, just the new ones when another replica appended.
async fn the_transcript_cache_reads_only_what_follows_its_copy(engine: &str) {
    let s = Recording {
        inner: open(engine, StoreOptions::default()).await,
        reads: Default::default(),
        renewal: None,
        ends: None,
    };
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let cache = TranscriptCache::default();
    cache.load(&s, "s").await.unwrap();
    commit_run(
        &s,
        "r1",
        "A",
        &[Message::user("one"), Message::assistant_text("two")],
    )
    .await;
    cache.load(&s, "s").await.unwrap();
    cache.load(&s, "s").await.unwrap();
    commit_run(
        &s,
        "r2",
        "B",
        &[Message::user("three"), Message::assistant_text("four")],
    )
    .await;
    let got = cache.load(&s, "s").await.unwrap();
    assert_eq!(texts(&got), ["one", "two", "three", "four"]);
    assert_eq!(
        *s.reads.lock().unwrap(),
        [(0, 0), (0, 2), (2, 0), (2, 2)],
        "(from, messages read) per load"
    );
    s.close().await;
}

/// Ownership lives in the store: each session keeps its owner, a listing
/// by owner holds only that owner's sessions and pages over them alone
/// (full pages, however the owners interleave), an active run leads to its
/// session's owner from any replica, and the counts quotas read are per
/// owner.
async fn sessions_are_owned_listed_by_owner_and_counted(engine: &str) {
    let s = open(engine, StoreOptions::default()).await;
    // alice and bob interleaved: alice a1..a5, bob b1..b4.
    for i in 1..=5 {
        s.create_session(&new_session(&format!("a{i}"), "x", "alice"))
            .await
            .unwrap();
        if i < 5 {
            s.create_session(&new_session(&format!("b{i}"), "x", "bob"))
                .await
                .unwrap();
        }
    }
    assert_eq!(s.get_session("b2").await.unwrap().owner, "bob");
    let mut f = SessionFilter {
        owner: Some("alice".into()),
        page_size: 2,
        ..Default::default()
    };
    let mut pages = Vec::new();
    loop {
        let page = s.list_sessions(&f).await.unwrap();
        assert!(
            page.sessions.iter().all(|x| x.owner == "alice"),
            "only alice's: {:?}",
            page.sessions
        );
        pages.push(
            page.sessions
                .iter()
                .map(|x| x.id.clone())
                .collect::<Vec<_>>(),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        f.page_token = page.next_page_token;
    }
    let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
    assert_eq!(sizes, vec![2, 2, 1], "full pages of alice's own: {pages:?}");
    let mut all: Vec<String> = pages.concat();
    all.sort();
    assert_eq!(all, ["a1", "a2", "a3", "a4", "a5"]);
    let nobody = s
        .list_sessions(&SessionFilter {
            owner: Some("carol".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(nobody.sessions.is_empty());

    // A run leads to its session (and owner) while it is active only.
    let lease = s.begin_run("a1", "r1", "A").await.unwrap();
    assert_eq!(s.run_session("r1").await.unwrap().owner, "alice");
    assert_eq!(
        s.run_session("nope").await.unwrap_err(),
        StoreError::RunNotFound("nope".into())
    );
    let minute = Duration::from_secs(60);
    let alice = s.owner_usage("alice", minute, u64::MAX).await.unwrap();
    assert_eq!(
        alice,
        store::OwnerUsage {
            sessions: 5,
            active_runs: 1,
            recent_runs: 1
        }
    );
    let bob = s.owner_usage("bob", minute, u64::MAX).await.unwrap();
    assert_eq!((bob.sessions, bob.active_runs, bob.recent_runs), (4, 0, 0));
    s.end_run(&lease, &[Message::user("hi")], &end(RunOutcome::Completed))
        .await
        .unwrap();
    assert_eq!(
        s.run_session("r1").await.unwrap_err(),
        StoreError::RunNotFound("r1".into()),
        "an ended run leads nowhere"
    );
    let alice = s.owner_usage("alice", minute, u64::MAX).await.unwrap();
    assert_eq!((alice.active_runs, alice.recent_runs), (0, 1));
    let empty_window = s
        .owner_usage("alice", Duration::ZERO, u64::MAX)
        .await
        .unwrap();
    assert_eq!(empty_window.recent_runs, 0, "outside the window");
    s.delete_session("a2").await.unwrap();
    assert_eq!(
        s.owner_usage("alice", minute, u64::MAX)
            .await
            .unwrap()
            .sessions,
        4
    );

    let held = s.begin_run("a3", "r3", "A").await.unwrap();
    let alice = s.owner_usage("alice", minute, u64::MAX).await.unwrap();
    assert_eq!(
        (alice.sessions, alice.active_runs, alice.recent_runs),
        (4, 1, 2)
    );
    // Counts stop at the cap a quota asks for.
    let capped = s.owner_usage("alice", minute, 1).await.unwrap();
    assert_eq!(
        (capped.sessions, capped.active_runs, capped.recent_runs),
        (1, 1, 1)
    );
    let capped = s.owner_usage("alice", minute, 3).await.unwrap();
    assert_eq!(
        (capped.sessions, capped.active_runs, capped.recent_runs),
        (3, 1, 2)
    );
    // Deleting a session takes its run in flight (cancelled, ending) out
    // of the active count, but not its runs out of the run rate.
    s.delete_session("a1").await.unwrap();
    s.delete_session("a3").await.unwrap();
    assert_eq!(
        s.owner_usage("alice", minute, u64::MAX).await.unwrap(),
        store::OwnerUsage {
            sessions: 2,
            active_runs: 0,
            recent_runs: 2
        }
    );
    // Once each: the deleted session's run ending changes nothing.
    s.end_run(&held, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    assert_eq!(
        s.owner_usage("alice", minute, u64::MAX).await.unwrap(),
        store::OwnerUsage {
            sessions: 2,
            active_runs: 0,
            recent_runs: 2
        }
    );
    assert_eq!(
        s.owner_usage("alice", Duration::ZERO, u64::MAX)
            .await
            .unwrap()
            .recent_runs,
        0,
        "outside the window"
    );
    assert_eq!(
        s.owner_usage("alice", minute, 1).await.unwrap().recent_runs,
        1
    );
    s.close().await;
}

/// Where a SQL engine's test database is: a file in `dir`, or a fresh
/// database on the binary's PostgreSQL.
fn sql_url(engine: &str, dir: &std::path::Path) -> String {
    match engine {
        "sqlite" => format!("sqlite://{}", dir.join("h.db").display()),
        _ => support::postgres::database(),
    }
}

async fn open_sql(url: &str, o: StoreOptions) -> Arc<dyn SessionStore> {
    store::open(&StoreSetting::parse(url, false).unwrap(), o)
        .await
        .unwrap()
}

/// `q` run straight on the database behind the store (what its API does
/// not show): the first column of the first row as text, "" for none.
async fn raw(engine: &str, url: &str, q: &str) -> String {
    match engine {
        "sqlite" => {
            use sqlx::Connection as _;
            let mut c = sqlx::SqliteConnection::connect(url).await.unwrap();
            let v: Option<String> = sqlx::query_scalar(q)
                .fetch_optional(&mut c)
                .await
                .unwrap()
                .flatten();
            v.unwrap_or_default()
        }
        _ => support::postgres::server().query(url, q),
    }
}

/// Runs kept without an owner (started before migration 2, or by an older
/// binary during a rolling upgrade: the column is NULL) count for their
/// session's owner while the session exists, like those that have one.
async fn runs_without_an_owner_count_through_their_session(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = sql_url(engine, dir.path());
    let s = open_sql(&url, StoreOptions::default()).await;
    for (id, owner) in [
        ("a1", "alice"),
        ("a2", "alice"),
        ("a3", "alice"),
        ("b1", "bob"),
    ] {
        s.create_session(&new_session(id, "a", owner))
            .await
            .unwrap();
    }
    let ended = s.begin_run("a1", "r1", "A").await.unwrap();
    s.end_run(&ended, &[], &end(RunOutcome::Completed))
        .await
        .unwrap();
    let _in_flight = s.begin_run("a2", "r2", "A").await.unwrap();
    let _bobs = s.begin_run("b1", "rb", "A").await.unwrap();
    // What the check reads directly, without the join through sessions.
    assert_eq!(
        raw(engine, &url, "SELECT owner FROM runs WHERE id = 'r2'").await,
        "alice"
    );
    raw(engine, &url, "UPDATE runs SET owner = NULL").await;
    // One started by this binary next to them.
    let _new = s.begin_run("a3", "r3", "A").await.unwrap();
    let minute = Duration::from_secs(60);
    let usage = |u: store::OwnerUsage| (u.sessions, u.active_runs, u.recent_runs);
    let alice = s.owner_usage("alice", minute, u64::MAX).await.unwrap();
    assert_eq!(usage(alice), (3, 2, 3));
    let bob = s.owner_usage("bob", minute, u64::MAX).await.unwrap();
    assert_eq!(usage(bob), (1, 1, 1));
    assert_eq!(
        usage(s.owner_usage("alice", minute, 2).await.unwrap()),
        (2, 2, 2),
        "capped"
    );
    assert_eq!(
        usage(
            s.owner_usage("alice", Duration::ZERO, u64::MAX)
                .await
                .unwrap()
        ),
        (3, 2, 0),
        "outside the window"
    );
    // A deleted session takes its run in flight out of the active count;
    // its runs' starts, ended or not, still count for the rate, under the
    // session's owner.
    s.delete_session("a1").await.unwrap();
    s.delete_session("a2").await.unwrap();
    let alice = s.owner_usage("alice", minute, u64::MAX).await.unwrap();
    assert_eq!(usage(alice), (1, 1, 3));
    let bob = s.owner_usage("bob", minute, u64::MAX).await.unwrap();
    assert_eq!(usage(bob), (1, 1, 1));
    s.close().await;
}

/// Migration 1 alone, as a database that an older hookwire created.
#[derive(Debug)]
struct FirstMigration(&'static str);

impl<'s> sqlx::migrate::MigrationSource<'s> for FirstMigration {
    fn resolve(
        self,
    ) -> futures::future::BoxFuture<
        's,
        Result<Vec<sqlx::migrate::Migration>, sqlx::error::BoxDynError>,
    > {
        Box::pin(async move {
            Ok(vec![sqlx::migrate::Migration::new(
                1,
                "sessions runs transcript approvals".into(),
                sqlx::migrate::MigrationType::Simple,
                self.0.into(),
                false,
            )])
        })
    }
}

/// A database an older hookwire left (migration 1 only, a run in flight
/// with a cancel, an ended one) is migrated when a store opens it, and
/// what it held keeps counting: quotas through the runs' sessions, the
/// cancel through the index migration 3 builds over existing rows.
async fn a_database_from_before_the_run_owner_is_upgraded_in_place(engine: &str) {
    use sqlx::Connection as _;
    let dir = tempfile::tempdir().unwrap();
    let url = sql_url(engine, dir.path());
    let first = FirstMigration(match engine {
        "sqlite" => include_str!("../src/store/migrations/sqlite/0001_sessions.sql"),
        _ => include_str!("../src/store/migrations/postgres/0001_sessions.sql"),
    });
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let far = now + 3_600_000;
    // What the older binary wrote: no owner on its runs.
    let old = format!(
        "INSERT INTO sessions (id, agent, owner, extra_hooks, metadata, created_ms, last_active_ms, active_run)
           VALUES ('a1', 'a', 'alice', '[]', '{{}}', {now}, {now}, 'r-old'),
                  ('a2', 'a', 'alice', '[]', '{{}}', {now}, {now}, NULL),
                  ('b1', 'a', 'bob', '[]', '{{}}', {now}, {now}, NULL);
         INSERT INTO runs (id, session_id, replica, epoch, lease_expires_ms, started_ms, ended_ms, outcome, cancel_reason)
           VALUES ('r-old', 'a1', 'A', 1, {far}, {now}, NULL, NULL, 'stop'),
                  ('r-done', 'a2', 'A', 1, {now}, {now}, {now}, 'completed', NULL);"
    );
    let migrator = sqlx::migrate::Migrator::new(first).await.unwrap();
    match engine {
        "sqlite" => {
            let opts = <sqlx::sqlite::SqliteConnectOptions as std::str::FromStr>::from_str(&url)
                .unwrap()
                .create_if_missing(true);
            let mut c = sqlx::SqliteConnection::connect_with(&opts).await.unwrap();
            migrator.run_direct(&mut c).await.unwrap();
            sqlx::raw_sql(&old).execute(&mut c).await.unwrap();
            c.close().await.unwrap();
        }
        _ => {
            let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
            migrator.run_direct(&mut c).await.unwrap();
            sqlx::raw_sql(&old).execute(&mut c).await.unwrap();
            c.close().await.unwrap();
        }
    }
    let s = store::open(
        &StoreSetting::parse(&url, false).unwrap(),
        StoreOptions::default(),
    )
    .await
    .expect("an older database opens and migrates");
    let minute = Duration::from_secs(60);
    let usage = |u: store::OwnerUsage| (u.sessions, u.active_runs, u.recent_runs);
    assert_eq!(
        usage(s.owner_usage("alice", minute, u64::MAX).await.unwrap()),
        (2, 1, 2)
    );
    assert_eq!(
        usage(s.owner_usage("bob", minute, u64::MAX).await.unwrap()),
        (1, 0, 0)
    );
    assert_eq!(
        s.signals("A", &[]).await.unwrap(),
        vec![Signal::Cancel {
            run_id: "r-old".into(),
            reason: "stop".into()
        }]
    );
    // A run of this binary next to the older ones, then the older one ends.
    let _new = s.begin_run("a2", "r-new", "A").await.unwrap();
    assert_eq!(
        usage(s.owner_usage("alice", minute, u64::MAX).await.unwrap()),
        (2, 2, 3)
    );
    let old_lease = store::RunLease {
        run_id: "r-old".into(),
        session_id: "a1".into(),
        epoch: 1,
    };
    s.end_run(&old_lease, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    assert_eq!(
        usage(s.owner_usage("alice", minute, u64::MAX).await.unwrap()),
        (2, 1, 3)
    );
    assert!(s.signals("A", &[]).await.unwrap().is_empty());
    s.close().await;
}

#[tokio::test]
async fn sqlite_a_database_from_before_the_run_owner_is_upgraded_in_place() {
    a_database_from_before_the_run_owner_is_upgraded_in_place("sqlite").await
}

#[tokio::test]
async fn postgres_a_database_from_before_the_run_owner_is_upgraded_in_place() {
    a_database_from_before_the_run_owner_is_upgraded_in_place("postgres").await
}

/// A run in flight when its session is deleted goes when it ends, with
/// its approvals, as the session's ended runs went: ended by its replica
/// or, that replica lost, by the reaper. Nothing of it stays behind.
async fn a_deleted_sessions_run_goes_when_it_ends(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = sql_url(engine, dir.path());
    let s = open_sql(&url, opts(SHORT_LEASE, 1 << 20)).await;
    let count = |q: &'static str| raw(engine, &url, q);
    for id in ["s1", "s2", "kept"] {
        s.create_session(&new_session(id, "a", "o")).await.unwrap();
    }
    let ends = s.begin_run("s1", "r1", "A").await.unwrap();
    let lost = s.begin_run("s2", "r2", "B").await.unwrap();
    let kept = s.begin_run("kept", "rk", "A").await.unwrap();
    for l in [&ends, &lost, &kept] {
        s.request_approval(l, "c").await.unwrap();
    }
    s.delete_session("s1").await.unwrap();
    s.delete_session("s2").await.unwrap();
    s.end_run(&ends, &[], &end(RunOutcome::Cancelled))
        .await
        .unwrap();
    // B is gone: its lease expires and the reaper ends r2 (and rk, whose
    // lease is as short: it stays, its session does).
    tokio::time::sleep(EXPIRED).await;
    let claimed = s.claim_expired("A", 10).await.unwrap();
    let mut ids: Vec<&str> = claimed.iter().map(|c| c.lease.run_id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["r2", "rk"]);
    for c in &claimed {
        assert_eq!(c.session.is_none(), c.lease.run_id == "r2");
        s.end_run(&c.lease, &[], &end(RunOutcome::Interrupted))
            .await
            .unwrap();
    }
    assert_eq!(
        count("SELECT CAST(COUNT(*) AS TEXT) FROM runs").await,
        "1",
        "only rk"
    );
    assert_eq!(
        count("SELECT CAST(COUNT(*) AS TEXT) FROM approvals").await,
        "1",
        "only rk's"
    );
    assert_eq!(
        count("SELECT CAST(COUNT(*) AS TEXT) FROM runs WHERE id = 'rk'").await,
        "1"
    );
    // B, the holder before the reaper, ending late: nothing of the run or
    // its session is left to refuse it with, so it answers Ok, as a retry
    // of an end that committed does.
    s.end_run(&lost, &[], &end(RunOutcome::Completed))
        .await
        .unwrap();
    s.close().await;
}

#[tokio::test]
async fn sqlite_a_deleted_sessions_run_goes_when_it_ends() {
    a_deleted_sessions_run_goes_when_it_ends("sqlite").await
}

#[tokio::test]
async fn postgres_a_deleted_sessions_run_goes_when_it_ends() {
    a_deleted_sessions_run_goes_when_it_ends("postgres").await
}

/// Waits until a statement on the database at `url` waits for a row lock
/// (the store's call is then blocked behind the test's open transaction).
async fn until_a_statement_waits_for_a_lock(watch: &mut sqlx::PgConnection) {
    until_the_database_shows(
        watch,
        "SELECT COUNT(*) > 0 FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
        "a statement waiting for the open transaction's lock",
    )
    .await
}

/// Waits (about 10 s at most) until `condition`, a query of one boolean,
/// holds on `watch`'s database; else fails the test for want of `what`.
async fn until_the_database_shows(watch: &mut sqlx::PgConnection, condition: &str, what: &str) {
    for _ in 0..2000 {
        let holds: bool = sqlx::query_scalar(condition)
            .fetch_one(&mut *watch)
            .await
            .unwrap();
        if holds {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never saw {what}");
}

/// Session `s1` with run `r1` started in it: the run's lease.
async fn run_in_s1(s: &Arc<dyn SessionStore>) -> store::RunLease {
    s.create_session(&new_session("s1", "a", "o"))
        .await
        .unwrap();
    s.begin_run("s1", "r1", "A").await.unwrap()
}

/// A transaction of another client of `url`'s database that ran `sql`:
/// what it locked stays locked until it is rolled back.
async fn holding(url: &str, sql: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let other = sqlx::PgPool::connect(url).await.unwrap();
    let mut tx = other.begin().await.unwrap();
    sqlx::query(sql).execute(&mut *tx).await.unwrap();
    tx
}

/// PostgreSQL: a store call stuck behind another transaction's row lock
/// (or a server that stopped answering) gives up after a lease, as
/// `Unavailable`, instead of holding its run for as long as the lock.
#[tokio::test]
async fn postgres_a_statement_stuck_behind_a_lock_gives_up_after_a_lease() {
    let url = support::postgres::database();
    // The statement timeout is the lease, at least 5 s.
    let s = open_sql(&url, opts(Duration::from_millis(1), 1 << 20)).await;
    let lease = run_in_s1(&s).await;
    let tx = holding(&url, "SELECT 1 FROM runs WHERE id = 'r1' FOR UPDATE").await;
    let stuck = tokio::time::timeout(
        Duration::from_secs(30),
        s.append(&lease, &[Message::user("x")]),
    )
    .await
    .expect("the store call gave up by itself");
    assert!(
        matches!(&stuck, Err(StoreError::Unavailable(m)) if m.contains("statement timeout")),
        "{stuck:?}"
    );
    tx.rollback().await.unwrap();
    s.close().await;
}

/// PostgreSQL: lease renewals do not queue behind the runs' own calls.
/// Here every connection of the pool waits on a lock that another session
/// holds (as every one waited over 20 s under a burst of 10 000 run
/// starts); the renewal still goes through at once. In the pool it waited
/// with the rest, and under that burst the replica stopped a third of its
/// runs as if the store were unreachable.
#[tokio::test]
async fn postgres_a_lease_is_renewed_while_every_pooled_connection_waits() {
    use sqlx::Connection as _;
    let url = support::postgres::database();
    let setting = StoreSetting::Postgres {
        url: url.clone(),
        password_env: None,
        max_connections: 2,
    };
    // A long lease: the statement timeout (a lease) must not free the
    // pool before the renewal is tried.
    let s = store::open(&setting, opts(Duration::from_secs(120), 1 << 20))
        .await
        .unwrap();
    let lease = run_in_s1(&s).await;
    let tx = holding(&url, "LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE").await;
    // More callers than the pool has connections (one of its two is the
    // listener's), each waiting on the lock once it has one.
    let blocked: Vec<_> = (0..3)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move { s.get_session("s1").await })
        })
        .collect();
    // Every pooled connection is waiting on the lock: some wait, none idle
    // (but the listener's; the watch is not idle while it asks).
    let mut watch = sqlx::PgConnection::connect(&url).await.unwrap();
    until_the_database_shows(
        &mut watch,
        "SELECT count(*) FILTER (WHERE wait_event_type = 'Lock' AND query LIKE 'SELECT%') > 0
             AND count(*) FILTER (WHERE state = 'idle' AND query NOT LIKE 'LISTEN%') = 0
         FROM pg_stat_activity WHERE datname = current_database()",
        "every pooled connection waiting on the lock",
    )
    .await;
    let renewed = tokio::time::timeout(Duration::from_secs(10), s.renew_all(&[lease]))
        .await
        .expect("the renewal did not wait for the pool");
    assert_eq!(renewed.unwrap(), vec![true]);
    tx.rollback().await.unwrap();
    for b in blocked {
        b.await.unwrap().unwrap();
    }
    s.close().await;
}

/// SQLite: a lease renewal goes ahead of the calls waiting for the one
/// connection, behind at most the call that holds it and the next one.
/// Queued with them, it waited behind all of them: 7 s under a burst of
/// 10 000 run starts on a fast machine, and on a slower one past what is
/// left of a lease, when the replica stops its runs as PostgreSQL's did.
#[tokio::test]
async fn sqlite_a_lease_renewal_goes_ahead_of_the_calls_waiting_for_the_connection() {
    use sqlx::Connection as _;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.db");
    let setting = StoreSetting::Sqlite { path: path.clone() };
    let s = store::open(&setting, opts(Duration::from_secs(120), 1 << 20))
        .await
        .unwrap();
    let lease = run_in_s1(&s).await;
    // Another client holds SQLite's write lock: the store's next write
    // holds the connection, waiting for it, while the others queue.
    let mut other = sqlx::SqliteConnection::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut other)
        .await
        .unwrap();
    let done = Arc::new(std::sync::Mutex::new(Vec::new()));
    let call = |name: String, f: futures::future::BoxFuture<'static, ()>| {
        let done = done.clone();
        tokio::spawn(async move {
            f.await;
            done.lock().unwrap().push(name);
        })
    };
    let mut calls = Vec::new();
    {
        let (s, lease) = (s.clone(), lease.clone());
        calls.push(call(
            "the write that holds the connection".into(),
            Box::pin(async move { s.renew(&lease).await.unwrap() }),
        ));
    }
    for i in 0..8 {
        let s = s.clone();
        calls.push(call(
            format!("read {i}"),
            Box::pin(async move {
                s.get_session("s1").await.unwrap();
            }),
        ));
    }
    // This runtime has one thread: each call has taken its place once
    // every task has run until it waits.
    tokio::task::yield_now().await;
    {
        let (s, lease) = (s.clone(), lease.clone());
        calls.push(call(
            "renewal".into(),
            Box::pin(async move { assert_eq!(s.renew_all(&[lease]).await.unwrap(), vec![true]) }),
        ));
    }
    tokio::task::yield_now().await;
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    for c in calls {
        c.await.unwrap();
    }
    let done = done.lock().unwrap().clone();
    let at = done.iter().position(|n| n == "renewal").unwrap();
    assert!(at <= 2, "the renewal waited behind {at} calls: {done:?}");
    s.close().await;
}

/// PostgreSQL: a replica that starts while another one migrates waits for
/// it, however long the migration takes. The migrations used to run under
/// the pool's statement timeout (a lease, at least 5 s): the wait for the
/// migrator's advisory lock was cancelled after 5 s and the store did not
/// open (and a migration longer than that could never have applied).
#[tokio::test]
async fn postgres_a_store_opening_while_another_migrates_waits_for_it() {
    use sqlx::migrate::Migrate as _;
    use sqlx::Connection as _;
    let url = support::postgres::database();
    // The lock sqlx's migrator takes, held as a replica migrating holds it.
    let mut migrating = sqlx::PgConnection::connect(&url).await.unwrap();
    migrating.lock().await.unwrap();
    let mut watch = sqlx::PgConnection::connect(&url).await.unwrap();
    let setting = StoreSetting::parse(&url, false).unwrap();
    let mut opening = Box::pin(store::open(&setting, opts(Duration::from_secs(1), 1 << 20)));
    // Nothing signals that a limit did not cut a wait short, so this waits
    // until the open has waited for the lock past the pool's limit, by the
    // server's clock (the one its timeout uses), with a second's margin.
    let waited_past_the_limit = async {
        loop {
            let past: Option<bool> = sqlx::query_scalar(
                "SELECT bool_or(clock_timestamp() - query_start > interval '6 seconds')
                 FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'
                   AND wait_event = 'advisory'",
            )
            .fetch_one(&mut watch)
            .await
            .unwrap();
            if past == Some(true) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), async {
        tokio::select! {
            opened = &mut opening => panic!(
                "the store stopped waiting for the migration: {:?}",
                opened.map(|_| ())
            ),
            () = waited_past_the_limit => {}
        }
    })
    .await
    .expect("the open waited for the lock");
    migrating.unlock().await.unwrap();
    let s = tokio::time::timeout(Duration::from_secs(30), opening)
        .await
        .expect("the store opens once the migration is done")
        .expect("the store opens");
    s.create_session(&new_session("s1", "a", "o"))
        .await
        .unwrap();
    s.close().await;
}

/// Deletes session `id` while another connection's open transaction has
/// run `statements` (what another replica's store call does), committing
/// that transaction once the delete waits for it.
async fn delete_while_open(s: &Arc<dyn SessionStore>, url: &str, id: &str, statements: &[String]) {
    use sqlx::Connection as _;
    let mut other = sqlx::PgConnection::connect(url).await.unwrap();
    let mut watch = sqlx::PgConnection::connect(url).await.unwrap();
    let mut tx = other.begin().await.unwrap();
    for q in statements {
        sqlx::query(q).execute(&mut *tx).await.unwrap();
    }
    let deleting = tokio::spawn({
        let (s, id) = (s.clone(), id.to_string());
        async move { s.delete_session(&id).await }
    });
    until_a_statement_waits_for_a_lock(&mut watch).await;
    tx.commit().await.unwrap();
    deleting.await.unwrap().unwrap();
}

/// PostgreSQL, where another replica's transactions interleave with a
/// session's deletion: a run whose end (or start) holds its session when
/// the session is deleted is neither left behind nor counted for the
/// owner afterwards. The other replica is an open transaction doing what
/// `end_run` and `begin_run` do, committed once the delete waits for it.
#[tokio::test]
async fn postgres_a_session_deleted_while_its_run_ends_or_starts_leaves_nothing_behind() {
    let url = support::postgres::database();
    let s = open_sql(&url, opts(Duration::from_secs(60), 1 << 20)).await;
    let now = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)";

    // The run's end has marked the run ended and freed the session, not
    // yet committed, when the delete comes.
    s.create_session(&new_session("s1", "a", "o"))
        .await
        .unwrap();
    s.begin_run("s1", "r1", "A").await.unwrap();
    let end = [
        format!("UPDATE runs SET ended_ms = {now}, outcome = 'completed' WHERE id = 'r1'"),
        "UPDATE sessions SET active_run = NULL WHERE id = 's1'".to_string(),
    ];
    delete_while_open(&s, &url, "s1", &end).await;
    assert_eq!(
        raw(
            "postgres",
            &url,
            "SELECT CAST(COUNT(*) AS TEXT) FROM runs WHERE id = 'r1'"
        )
        .await,
        "0",
        "the ended run went with its session"
    );

    // A run's start has claimed the session and inserted the run, not yet
    // committed, when the delete comes.
    s.create_session(&new_session("s2", "a", "o"))
        .await
        .unwrap();
    let start = [
        "UPDATE sessions SET active_run = 'r2', run_count = run_count + 1 WHERE id = 's2'"
            .to_string(),
        format!(
            "INSERT INTO runs (id, session_id, replica, epoch, lease_expires_ms, started_ms, owner)
             VALUES ('r2', 's2', 'A', 1, {now} + 60000, {now}, 'o')"
        ),
    ];
    delete_while_open(&s, &url, "s2", &start).await;
    let usage = s
        .owner_usage("o", Duration::from_secs(60), 100)
        .await
        .unwrap();
    assert_eq!(
        (usage.sessions, usage.active_runs, usage.recent_runs),
        (0, 0, 2),
        "the run in flight of a deleted session is not active for the owner \
         any more, but both runs (the one started while the delete waited \
         too) count for its run rate, once each"
    );
    s.close().await;
}

/// The starts a deleted (or expired) session leaves for its owner's run
/// rate are kept only while a window can count them: each deletion drops
/// those that left it, whoever owned them.
async fn deleted_sessions_starts_are_kept_for_the_window_only(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = sql_url(engine, dir.path());
    let s = open_sql(&url, StoreOptions::default()).await;
    let kept = |q: &'static str| raw(engine, &url, q);
    for (id, owner) in [("a1", "alice"), ("a2", "alice"), ("b1", "bob")] {
        s.create_session(&new_session(id, "a", owner))
            .await
            .unwrap();
    }
    let r1 = s.begin_run("a1", "r1", "A").await.unwrap();
    s.end_run(&r1, &[], &end(RunOutcome::Completed))
        .await
        .unwrap();
    let r2 = s.begin_run("a2", "r2", "A").await.unwrap();
    s.end_run(&r2, &[], &end(RunOutcome::Completed))
        .await
        .unwrap();
    // A start of carol's deleted session, two minutes old.
    kept("INSERT INTO deleted_run_starts (owner, started_ms) VALUES ('carol', 0)").await;
    s.delete_session("a1").await.unwrap();
    assert_eq!(
        kept("SELECT CAST(COUNT(*) AS TEXT) FROM deleted_run_starts").await,
        "1",
        "r1's start kept, carol's old one dropped"
    );
    // The session TTL's sweep keeps them the same way (the sessions were
    // idle a second; the clock is the database's).
    kept("UPDATE sessions SET last_active_ms = last_active_ms - 1000").await;
    let expired = s
        .expire_sessions(Duration::from_millis(500), 10)
        .await
        .unwrap();
    let mut ids: Vec<&str> = expired.iter().map(|x| x.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["a2", "b1"]);
    let minute = Duration::from_secs(60);
    let usage = |u: store::OwnerUsage| (u.sessions, u.active_runs, u.recent_runs);
    assert_eq!(
        usage(s.owner_usage("alice", minute, u64::MAX).await.unwrap()),
        (0, 0, 2)
    );
    assert_eq!(
        usage(s.owner_usage("bob", minute, u64::MAX).await.unwrap()),
        (0, 0, 0)
    );
    assert_eq!(kept("SELECT CAST(COUNT(*) AS TEXT) FROM runs").await, "0");
    // A minute later they count no more, and the next deletion drops them.
    kept("UPDATE deleted_run_starts SET started_ms = started_ms - 60000").await;
    assert_eq!(
        usage(s.owner_usage("alice", minute, u64::MAX).await.unwrap()),
        (0, 0, 0)
    );
    s.create_session(&new_session("b2", "a", "bob"))
        .await
        .unwrap();
    s.delete_session("b2").await.unwrap();
    assert_eq!(
        kept("SELECT CAST(COUNT(*) AS TEXT) FROM deleted_run_starts").await,
        "0"
    );
    s.close().await;
}

#[tokio::test]
async fn sqlite_deleted_sessions_starts_are_kept_for_the_window_only() {
    deleted_sessions_starts_are_kept_for_the_window_only("sqlite").await
}

#[tokio::test]
async fn postgres_deleted_sessions_starts_are_kept_for_the_window_only() {
    deleted_sessions_starts_are_kept_for_the_window_only("postgres").await
}

#[tokio::test]
async fn sqlite_runs_without_an_owner_count_through_their_session() {
    runs_without_an_owner_count_through_their_session("sqlite").await
}

#[tokio::test]
async fn postgres_runs_without_an_owner_count_through_their_session() {
    runs_without_an_owner_count_through_their_session("postgres").await
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $( #[tokio::test] async fn $name() { super::$name("memory").await } )*
        }
        mod sqlite {
            $( #[tokio::test] async fn $name() { super::$name("sqlite").await } )*
        }
        mod postgres {
            $( #[tokio::test] async fn $name() { super::$name("postgres").await } )*
        }
    };
}

contract!(
    sessions_are_created_read_listed_by_page_and_deleted,
    many_waiting_approvals_are_read_at_once,
    many_leases_are_renewed_at_once,
    a_run_longer_than_its_lease_keeps_it,
    a_lost_replicas_runs_are_all_ended_in_one_pass,
    one_active_run_per_session_and_transcript_in_order,
    a_commit_of_hundreds_of_messages_keeps_them_in_order,
    a_claimed_run_fences_out_its_old_holder,
    the_same_end_twice_is_one_end,
    a_settled_batch_is_no_longer_staged,
    an_interrupted_end_closes_the_staged_batch,
    approvals_first_answer_wins_and_cancel_denies,
    transcript_size_is_limited,
    a_refused_write_changes_nothing,
    idle_sessions_expire_but_busy_ones_do_not,
    deleting_a_session_with_an_active_run_lets_the_run_end,
    a_cancelled_or_deleted_runs_work_is_refused,
    the_transcript_reads_from_a_position,
    a_replicas_transcript_cache_sees_what_other_replicas_appended,
    the_transcript_cache_reads_only_what_follows_its_copy,
    sessions_are_owned_listed_by_owner_and_counted,
);

/// Two stores opening one fresh Postgres database at once: sqlx's migrator
/// holds an advisory lock, so each migration is applied once and both open.
#[tokio::test]
async fn postgres_two_stores_migrating_at_once_migrate_once() {
    let url = support::postgres::database();
    let setting = StoreSetting::parse(&url, false).unwrap();
    let (a, b) = tokio::join!(
        store::open(&setting, StoreOptions::default()),
        store::open(&setting, StoreOptions::default())
    );
    let (a, b) = (a.expect("first opens"), b.expect("second opens"));
    let pg = support::postgres::server();
    assert_eq!(
        pg.query(&url, "SELECT count(*) FROM _sqlx_migrations WHERE success"),
        "4",
        "each of the four migrations applied once"
    );
    a.close().await;
    b.close().await;
}

/// PostgreSQL: a quota check and a page of sessions read no further than
/// their limit however many sessions the principal keeps, whatever the
/// planner knows of the tables. Not analyzed yet (as after a burst), it
/// chose bitmap scans, which read every matching index entry before the
/// LIMIT: all 5 000 here, twice over. Analyzed, with the principal a fifth
/// of the table, it counted its recent runs by scanning the whole table.
#[tokio::test]
async fn postgres_capped_reads_stop_at_their_limit_whatever_the_planner_knows() {
    use sqlx::Connection as _;
    let url = support::postgres::database();
    let s = open_sql(&url, StoreOptions::default()).await;
    let mut watch = sqlx::PgConnection::connect(&url).await.unwrap();
    let now = "CAST(EXTRACT(EPOCH FROM now()) * 1000 AS BIGINT)";
    for q in [
        // Analyzed only when the test says so, whatever autovacuum is up to.
        "ALTER TABLE sessions SET (autovacuum_enabled = false)".to_string(),
        "ALTER TABLE runs SET (autovacuum_enabled = false)".to_string(),
        // 20 000 sessions of someone else first in the heap, then 5 000 of
        // `big`; each with a run started now.
        "INSERT INTO sessions (id, agent, owner, extra_hooks, metadata, created_ms, last_active_ms)
         SELECT 'other-' || i, 'a', 'other', '[]', '{}', i, i FROM generate_series(1, 20000) AS i
         UNION ALL
         SELECT 'big-' || i, 'a', 'big', '[]', '{}', i, i FROM generate_series(1, 5000) AS i"
            .to_string(),
        format!(
            "INSERT INTO runs (id, session_id, replica, epoch, lease_expires_ms, started_ms,
                               ended_ms, outcome, owner)
             SELECT o || '-' || i || '-run', o || '-' || i, 'A', 1, 0, {now}, {now}, 'completed', o
             FROM (VALUES ('other', 20000), ('big', 5000)) AS t(o, n), generate_series(1, n) AS i"
        ),
    ] {
        sqlx::query(&q).execute(&mut watch).await.unwrap();
    }
    for analyzed in [false, true] {
        if analyzed {
            sqlx::query("ANALYZE sessions, runs")
                .execute(&mut watch)
                .await
                .unwrap();
        }
        let usage = s
            .owner_usage("big", Duration::from_secs(60), 100)
            .await
            .unwrap();
        assert_eq!((usage.sessions, usage.recent_runs), (100, 100));
        let page = s
            .list_sessions(&SessionFilter {
                owner: Some("big".into()),
                page_size: 50,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(page.sessions.len(), 50);
    }
    // A server process reports what it read when it exits, so the store's
    // connections are closed first; then at least the counts' 2 x 100 and
    // the pages' 2 x 50 rows show, read from the indexes or by scans.
    s.close().await;
    let reads = "SELECT
           CAST(COALESCE(SUM(idx_tup_read) FILTER (WHERE indexrelname = 'sessions_owner_page'), 0) AS BIGINT),
           CAST(COALESCE(SUM(idx_tup_read) FILTER (WHERE indexrelname = 'runs_owner_started'), 0) AS BIGINT),
           (SELECT CAST(SUM(seq_tup_read) AS BIGINT) FROM pg_stat_user_tables
            WHERE relname IN ('sessions', 'runs'))
         FROM pg_stat_user_indexes";
    until_the_database_shows(
        &mut watch,
        &format!("SELECT s + q >= 300 AND r + q >= 200 FROM ({reads}) AS t(s, r, q)"),
        "the index reads of the store's closed connections",
    )
    .await;
    let (sessions, runs, scanned): (i64, i64, i64) =
        sqlx::query_as(reads).fetch_one(&mut watch).await.unwrap();
    // Each count and page plus the entry that ends it, twice.
    assert!(
        sessions <= 2 * 152,
        "two quota counts and two pages read {sessions} of the owner's sessions' index entries"
    );
    assert!(
        runs <= 2 * 101,
        "two quota counts read {runs} of the owner's runs' index entries"
    );
    assert_eq!(scanned, 0, "rows read by scanning sessions and runs whole");
}

/// The next wake-up hint, within 10 s.
async fn next_hint(hints: &mut tokio::sync::broadcast::Receiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(10), hints.recv())
        .await
        .expect("a hint within 10 s")
        .unwrap()
}

/// A notification sent while the store's PostgreSQL listener has no
/// connection is lost for good, so once it listens again the listener
/// tells every waiter to read the store ([`store::REREAD_ALL`]), and only
/// then: a held approval answer woken by it either finds its question or
/// will hear of it. Here the server ends the listener's connection; a
/// question recorded as soon as `REREAD_ALL` arrives is heard.
#[tokio::test]
async fn postgres_a_listener_that_lost_its_connection_says_so_once_it_listens_again() {
    let url = support::postgres::database();
    let setting = StoreSetting::parse(&url, false).unwrap();
    let s = store::open(&setting, StoreOptions::default())
        .await
        .unwrap();
    s.create_session(&new_session("s", "a", "o")).await.unwrap();
    let l = s.begin_run("s", "r", "A").await.unwrap();
    let mut hints = s.subscribe();
    let db = url.rsplit('/').next().unwrap();
    let ended = support::postgres::server().query(
        &url,
        &format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = '{db}' AND query LIKE 'LISTEN%'"
        ),
    );
    assert_eq!(ended, "1", "the listener's connection was ended");
    assert_eq!(next_hint(&mut hints).await, store::REREAD_ALL);
    s.request_approval(&l, "c1").await.unwrap();
    assert_eq!(
        next_hint(&mut hints).await,
        store::asked_hint("r"),
        "listening again before it said so"
    );
    s.close().await;
}

/// A renewal that waited for the store (under load: seconds, behind other
/// calls) while its run recorded its end is refused: the store does not
/// renew an ended run. That is the end winning the race, not another
/// replica taking the run over: no warning, nothing interrupted. (A burst
/// of 10 000 runs on SQLite logged ~1 000 false "lost the run's lease".)
#[tokio::test]
async fn a_renewal_refused_because_the_run_ended_meanwhile_is_not_a_lost_lease() {
    let (logs, _guard) = support::logwatch::LogWatch::install("hookwire=debug");
    let gate = Arc::new(RenewalGate::default());
    let store = Arc::new(Recording {
        inner: open("memory", StoreOptions::default()).await,
        reads: Default::default(),
        renewal: Some(gate.clone()),
        ends: None,
    });
    // Renewals every third of the lease (1 s); the run takes 1.5 s, so a
    // renewal finds it in flight. Held, that renewal leaves the lease
    // unconfirmed: the run must end before its replica would stop it for
    // that (at 2 s, a lease minus a renewal period).
    let engine = engine_on(store, "1500ms", "3s");
    let (run, _) = start_one(&engine).await;
    tokio::time::timeout(Duration::from_secs(10), gate.entered.notified())
        .await
        .expect("a renewal while the run is in flight");
    let report = run.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    gate.open.notify_one();
    tokio::time::timeout(
        Duration::from_secs(10),
        logs.wait_for(&["the run ended while its lease was renewed"]),
    )
    .await
    .unwrap_or_else(|_| panic!("no such line in:\n{}", logs.contents()));
    assert!(
        *gate.lease_lost.lock().unwrap() == Some(true),
        "the store refused the renewal"
    );
    assert!(
        logs.lines_with(&["lost the run's lease"]).is_empty(),
        "{}",
        logs.contents()
    );
    engine.stop_background().await;
}

/// Idle sessions past their TTL are all expired in one sweep, however
/// many: a sweep used to stop after one batch (100), once a minute with a
/// TTL of 4 minutes or more, so a service that made more sessions than
/// that kept more and more of them.
#[tokio::test(start_paused = true)]
async fn idle_sessions_past_their_ttl_all_expire_in_one_sweep() {
    let store = open("memory", StoreOptions::default()).await;
    let n = 250;
    for i in 0..n {
        store
            .create_session(&new_session(&format!("s{i}"), "a", "o"))
            .await
            .unwrap();
    }
    tokio::time::advance(Duration::from_secs(600)).await;
    // A TTL of 5 minutes: a sweep every minute, the first at start. The
    // clock stands still while this task keeps running, so no second
    // sweep comes.
    let yaml = "models:\n  - name: m\n    provider: scripted\n    rules:\n      - text: done\nagents:\n  - name: a\n    model: m\nserver:\n  session_ttl: 5m\n";
    let config = hookwire::config::Config::parse(yaml, "test").unwrap();
    let models = hookwire::server::build_models(&config).unwrap();
    let inst = hookwire::telemetry::Instruments::new(&config.telemetry);
    let engine =
        Arc::new(hookwire::engine::Engine::new(config, models, inst, store.clone()).unwrap());
    engine.start_background();
    let mut left = n;
    for _ in 0..10_000 {
        tokio::task::yield_now().await;
        left = 0;
        for i in 0..n {
            left += usize::from(store.get_session(&format!("s{i}")).await.is_ok());
        }
        if left == 0 {
            break;
        }
    }
    assert_eq!(left, 0, "sessions left after the first sweep");
    engine.stop_background().await;
}

/// An engine on `store` whose one agent `a` answers "done" after `delay`,
/// with runs leased for `lease`.
fn engine_on(
    store: Arc<dyn SessionStore>,
    delay: &str,
    lease: &str,
) -> Arc<hookwire::engine::Engine> {
    let yaml = format!("models:\n  - name: m\n    provider: scripted\n    delay: {delay}\n    rules:\n      - text: done\nagents:\n  - name: a\n    model: m\nserver:\n  run_lease: {lease}\n");
    let config = hookwire::config::Config::parse(&yaml, "test").unwrap();
    let models = hookwire::server::build_models(&config).unwrap();
    let inst = hookwire::telemetry::Instruments::new(&config.telemetry);
    let engine = Arc::new(hookwire::engine::Engine::new(config, models, inst, store).unwrap());
    engine.start_background();
    engine
}

/// A run of "hello" on a new session of `engine`: its handle and session.
async fn start_one(
    engine: &Arc<hookwire::engine::Engine>,
) -> (hookwire::engine::RunHandle, String) {
    let me = hookwire::auth::Principal::anonymous();
    let s = engine
        .create_session(&me, "a", vec![], Default::default())
        .await
        .unwrap();
    let run = engine
        .start_run(&me, &s.id, "hello".into(), false, Default::default(), None)
        .await
        .unwrap();
    (run, s.id)
}

/// [`start_one`], run to its end: its report and session.
async fn one_run(
    engine: &Arc<hookwire::engine::Engine>,
) -> (hookwire::agent::events::RunReport, String) {
    let (run, session) = start_one(engine).await;
    (run.task.await.unwrap(), session)
}

/// `engine`'s store, leasing runs for `lease` (as the engine's
/// `server.run_lease` configures it), whose run ends fail as `ends` says.
async fn faulty(engine: &str, ends: &Arc<EndFaults>, lease: Duration) -> Arc<dyn SessionStore> {
    Arc::new(Recording {
        inner: open(engine, opts(lease, 1 << 20)).await,
        reads: Default::default(),
        renewal: None,
        ends: Some(ends.clone()),
    })
}

/// A store that cannot take the run's end for a moment (no connection
/// within its wait, a failover) does not cost the run its answer: the end
/// is written again until it is recorded. Without the retry the client got
/// "done" while the transcript never would.
#[tokio::test]
async fn a_run_whose_end_the_store_refused_for_a_moment_is_recorded_by_a_retry() {
    let ends = EndFaults::refusing(2);
    completes_with_its_answer(&ends, "sqlite", 30, 3).await;
}

/// One run on `engine`'s store failing as `ends` says, with runs leased
/// for `lease_s` seconds: it completes, after `calls` attempts to record its end,
/// with "done" told to the client and in the transcript, once.
async fn completes_with_its_answer(
    ends: &Arc<EndFaults>,
    engine: &str,
    lease_s: u64,
    calls: usize,
) {
    let store = faulty(engine, ends, Duration::from_secs(lease_s)).await;
    let engine = engine_on(store.clone(), "0ms", &format!("{lease_s}s"));
    let (report, session) = one_run(&engine).await;
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    assert_eq!(report.final_text, "done");
    assert_eq!(ends.calls.load(std::sync::atomic::Ordering::SeqCst), calls);
    assert_eq!(
        texts(&store.transcript(&session).await.unwrap()),
        ["hello", "done"]
    );
    assert_eq!(store.get_session(&session).await.unwrap().active_run, None);
    engine.stop_background().await;
}

/// The end's first write waited longer than a lease for a connection and
/// failed: it is still written again (the window runs from the first
/// failure), and lands while no other replica took the run over. Counted
/// from the first attempt, the window was spent before any retry.
#[tokio::test]
async fn a_run_whose_first_end_write_waited_longer_than_a_lease_is_still_retried() {
    let ends = Arc::new(EndFaults {
        stall: std::sync::Mutex::new(Some(Duration::from_millis(1200))),
        no_claims: true,
        ..Default::default()
    });
    ends.refuse.store(1, std::sync::atomic::Ordering::SeqCst);
    completes_with_its_answer(&ends, "memory", 1, 2).await;
}

/// An end that waits for the store longer than a lease (under a burst of
/// 10 000 run starts on PostgreSQL, calls waited over 20 s for a
/// connection) keeps its run's lease: the replica renews a run until its
/// end is settled. Renewals used to stop once the end began; the lease
/// expired, the reaper took the run, and the end was refused as a lost
/// lease, the run interrupted.
#[tokio::test]
async fn a_run_whose_end_waits_longer_than_a_lease_keeps_its_lease_and_completes() {
    let ends = Arc::new(EndFaults {
        slow: std::sync::Mutex::new(Some(Duration::from_millis(2500))),
        ..Default::default()
    });
    completes_with_its_answer(&ends, "memory", 1, 1).await;
}

/// The end's first write committed, but its answer was lost with the
/// connection: the retry finds its own end recorded, and the run completes
/// with its answer in the transcript once.
#[tokio::test]
async fn a_run_whose_end_committed_but_whose_answer_was_lost_completes_once() {
    let ends = EndFaults::refusing(0);
    ends.lose_answer
        .store(true, std::sync::atomic::Ordering::SeqCst);
    completes_with_its_answer(&ends, "sqlite", 30, 2).await;
}

/// A store that never takes the run's end: after retrying for the lease,
/// the client is told the run was interrupted, without the answer, which
/// is what its session records once a reaper ends it after the lease. It
/// used to be told "completed: done" while the transcript lacked "done".
#[tokio::test]
async fn a_run_whose_end_cannot_be_recorded_is_reported_interrupted_as_its_session_will_be() {
    let ends = EndFaults::refusing(usize::MAX);
    let store = faulty("memory", &ends, Duration::from_secs(1)).await;
    let engine = engine_on(store.clone(), "0ms", "1s");
    let (report, session) = one_run(&engine).await;
    assert_eq!(report.outcome, RunOutcome::Interrupted, "{}", report.reason);
    assert!(
        report.reason.contains("could not be recorded"),
        "{}",
        report.reason
    );
    assert_eq!(report.final_text, "", "no answer the transcript lacks");
    assert!(
        ends.calls.load(std::sync::atomic::Ordering::SeqCst) > 1,
        "retried before giving up"
    );
    // The reaper ends the run once its lease expired and frees the session.
    tokio::time::timeout(Duration::from_secs(20), async {
        while store
            .get_session(&session)
            .await
            .unwrap()
            .active_run
            .is_some()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the reaper frees the session");
    assert_eq!(texts(&store.transcript(&session).await.unwrap()), ["hello"]);
    engine.stop_background().await;
}

/// A store that takes no run's end warns once for all the runs, not once
/// per run: in a database outage every run fails the same way (measured
/// before: a line per run, as sqlx's per-call warning was). The others are
/// logged at debug and counted in the next warning.
#[tokio::test]
async fn runs_whose_end_cannot_be_recorded_are_warned_of_once_not_per_run() {
    const RUNS: usize = 20;
    let (logs, _guard) = support::logwatch::LogWatch::install("hookwire=debug");
    let ends = EndFaults::refusing(usize::MAX);
    let store = faulty("memory", &ends, Duration::from_secs(1)).await;
    let engine = engine_on(store.clone(), "0ms", "1s");
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        runs.push(start_one(&engine).await.0);
    }
    for run in runs {
        let report = run.task.await.unwrap();
        assert_eq!(report.outcome, RunOutcome::Interrupted, "{}", report.reason);
    }
    // The message, then its fields (not the retries' "… end yet; retrying").
    let what = "cannot record the run's end run=";
    let warned = logs.lines_with(&["WARN", what]);
    assert_eq!(warned.len(), 1, "{warned:#?}");
    assert!(warned[0].contains("left_out=0"), "{}", warned[0]);
    assert_eq!(logs.lines_with(&["DEBUG", what]).len(), RUNS - 1);
    engine.stop_background().await;
}
