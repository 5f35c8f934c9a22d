//! Several `hookwire serve` processes (the real binary) on one store behave
//! as one service: any replica serves any session, approvals and cancels
//! reach the run wherever it executes, a killed replica's run is ended
//! `interrupted` with a valid transcript, restarts lose nothing committed.
//! Postgres scenarios run three replicas on a real PostgreSQL; the SQLite
//! ones one replica on a file (the engine's supported shape).

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hookwire::pb;
use support::replica::*;
use support::*;

/// No scenario waits longer than this for anything: a hang fails.
const PATIENCE: Duration = Duration::from_secs(60);

enum Store {
    Postgres(String),
    Sqlite(tempfile::TempDir),
}

impl Store {
    fn postgres() -> Store {
        Store::Postgres(support::postgres::database())
    }
    fn sqlite() -> Store {
        Store::Sqlite(tempfile::tempdir().unwrap())
    }
    fn url(&self) -> String {
        match self {
            Store::Postgres(u) => u.clone(),
            Store::Sqlite(d) => format!("sqlite://{}/hookwire.db", d.path().display()),
        }
    }
}

/// `n` replicas on `store` with `hooks`; `server` adds `server:` lines.
struct Cluster {
    dir: tempfile::TempDir,
    cfg: std::path::PathBuf,
    replicas: Vec<Replica>,
}

impl Cluster {
    async fn start(n: usize, store: &Store, hooks: &[(&str, &str)], server: &str) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let cfg = write_config(dir.path(), hooks, &store.url(), server);
        let mut replicas = Vec::new();
        for _ in 0..n {
            replicas.push(Replica::start(&cfg).await);
        }
        Cluster { dir, cfg, replicas }
    }

    /// Replica `i` (wrapping: with one replica every index is the same).
    async fn client(
        &self,
        i: usize,
    ) -> pb::agent_service_client::AgentServiceClient<tonic::transport::Channel> {
        self.replicas[i % self.replicas.len()].client().await
    }
}

fn is_approval(e: &pb::run_event::Event) -> bool {
    matches!(e, pb::run_event::Event::ApprovalRequested(_))
}

fn call_id_of(events: &[pb::RunEvent]) -> String {
    events
        .iter()
        .find_map(|e| match &e.event {
            Some(pb::run_event::Event::ApprovalRequested(a)) => {
                a.call.as_ref().map(|c| c.id.clone())
            }
            _ => None,
        })
        .expect("an approval request")
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {PATIENCE:?}"))
}

// ------------------------------------------------------------ scenarios

async fn create_on_a_run_on_b_read_on_c(store: Store) {
    let owner = weather_owner().start().await;
    let cl = Cluster::start(3, &store, &[("owner", &owner.addr)], "").await;
    let (mut a, mut b, mut c) = (cl.client(0).await, cl.client(1).await, cl.client(2).await);
    let s = session(&mut a, "a").await;
    let r = result_of(&run_events(&mut b, &s, "weather please").await);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{r:?}");
    let read = |mut c: pb::agent_service_client::AgentServiceClient<_>, s: String| async move {
        c.get_session(pb::GetSessionRequest { session_id: s })
            .await
            .unwrap()
            .into_inner()
    };
    // A keeps a copy of the transcript as B left it...
    let before = texts(&read(a.clone(), s.clone()).await.transcript);
    let r2 = invoke(&mut c, &s, "and hello").await;
    assert_eq!(outcome(&r2), pb::RunOutcome::Completed);
    // ...and reads what C appended after it.
    let got = read(a.clone(), s.clone()).await;
    let t = texts(&got.transcript);
    assert_eq!(t[..before.len()], before[..]);
    assert_eq!(t[0], "weather please");
    assert!(t.contains(&"result:sunny in Paris".to_string()), "{t:?}");
    assert_eq!(t[t.len() - 2], "and hello");
    assert_eq!(got.run_count, 2);
    assert_eq!(got.active_run_id, "");
    assert_eq!(got.owner, "anonymous");
    // A run on A is sent the whole transcript, C's run included: the
    // scripted model numbers its tool calls after the assistant messages
    // in what it is sent (2 from B's run, 1 from C's, so this is turn 4).
    let r3 = invoke(&mut a, &s, "weather again").await;
    assert_eq!(outcome(&r3), pb::RunOutcome::Completed, "{r3:?}");
    let after = read(b.clone(), s.clone()).await;
    let all = texts(&after.transcript);
    assert_eq!(all[..t.len()], t[..], "B reads the same history");
    let last_call = after
        .transcript
        .iter()
        .flat_map(|m| &m.blocks)
        .filter_map(|b| match &b.kind {
            Some(pb::block::Kind::ToolCall(c)) => Some(c.id.clone()),
            _ => None,
        })
        .next_back();
    assert_eq!(last_call.as_deref(), Some("call_4_0"), "{all:?}");
    // Every replica lists it.
    for i in 0..3 {
        let l = cl
            .client(i)
            .await
            .list_sessions(pb::ListSessionsRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(l.sessions.iter().any(|x| x.id == s));
    }
}

async fn approval_raised_on_one_replica_is_answered_on_another(store: Store) {
    let owner = weather_owner().start().await;
    let ask = asker("May I?", 0).start().await;
    let cl = Cluster::start(
        3,
        &store,
        &[("asker", &ask.addr), ("owner", &owner.addr)],
        "",
    )
    .await;
    let (mut a, mut b, mut c) = (cl.client(0).await, cl.client(1).await, cl.client(2).await);
    let s = session(&mut a, "a").await;
    let (run_id, stream, seen) = within(
        "approval request",
        run_until(&mut a, &s, "weather", is_approval),
    )
    .await;
    let call_id = call_id_of(&seen);
    let asked = Instant::now();
    b.resolve_approval(pb::ResolveApprovalRequest {
        run_id: run_id.clone(),
        call_id: call_id.clone(),
        approve: true,
        note: String::new(),
    })
    .await
    .expect("another replica records the answer");
    let r = within("the run's end", finish(stream)).await;
    eprintln!(
        "approval crossed replicas and the run ended in {:?}",
        asked.elapsed()
    );
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{r:?}");
    assert!(texts(&r.messages).contains(&"result:sunny in Paris".to_string()));
    assert_eq!(
        owner.hook.tool_calls.lock().unwrap().len(),
        1,
        "the tool ran once"
    );
    let again = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id,
            call_id,
            approve: false,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::NotFound, "{again:?}");
}

async fn cancel_on_another_replica_stops_the_run_and_denies_its_approval(store: Store) {
    let owner = weather_owner().start().await;
    let ask = asker("May I?", 0).start().await;
    let cl = Cluster::start(
        3,
        &store,
        &[("asker", &ask.addr), ("owner", &owner.addr)],
        "",
    )
    .await;
    let (mut a, mut b, mut c) = (cl.client(0).await, cl.client(1).await, cl.client(2).await);
    let s = session(&mut a, "a").await;
    let (run_id, stream, seen) = within(
        "approval request",
        run_until(&mut a, &s, "weather", is_approval),
    )
    .await;
    let call_id = call_id_of(&seen);
    let sent = Instant::now();
    b.cancel_run(pb::CancelRunRequest {
        run_id: run_id.clone(),
    })
    .await
    .expect("another replica records the cancel");
    let r = within("the run's end", finish(stream)).await;
    eprintln!(
        "cancel crossed replicas and the run ended in {:?}",
        sent.elapsed()
    );
    assert_eq!(outcome(&r), pb::RunOutcome::Cancelled, "{r:?}");
    assert!(
        owner.hook.tool_calls.lock().unwrap().is_empty(),
        "the tool never ran"
    );
    let late = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: run_id.clone(),
            call_id,
            approve: true,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        late.code(),
        tonic::Code::NotFound,
        "the cancel denied it: {late:?}"
    );
    let again = c
        .cancel_run(pb::CancelRunRequest { run_id })
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::NotFound);
    // The session is free for the next run, on any replica.
    let next = invoke(&mut c, &s, "hello").await;
    assert_eq!(outcome(&next), pb::RunOutcome::Completed);
}

/// An Invoke on A pauses on an approval nobody on A's connection can see;
/// the hook tells its approval bot the run and call, and the bot answers
/// on B: the answer crosses replicas through the store and the run on A
/// completes, the tool run once.
async fn an_invoke_approval_is_answered_on_another_replica(store: Store) {
    let owner = weather_owner().start().await;
    let (ask, mut asked) = routing_asker("May I?", 0);
    let ask = ask.start().await;
    let cl = Cluster::start(
        3,
        &store,
        &[("asker", &ask.addr), ("owner", &owner.addr)],
        "",
    )
    .await;
    let (mut a, mut b, mut c) = (cl.client(0).await, cl.client(1).await, cl.client(2).await);
    let s = session(&mut a, "a").await;
    let run = tokio::spawn(async move { invoke(&mut a, &s, "weather").await });
    let routed = within("the hook's question", asked.recv())
        .await
        .expect("the hook asked");
    let sent = Instant::now();
    within(
        "the answer on another replica",
        resolve_once_pending(&mut b, &routed, true, ""),
    )
    .await;
    let r = within("the invoke's result", run).await.unwrap();
    eprintln!(
        "an Invoke's approval crossed replicas and the run ended in {:?}",
        sent.elapsed()
    );
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{r:?}");
    assert_eq!(r.run_id, routed.run_id);
    assert!(texts(&r.messages).contains(&"result:sunny in Paris".to_string()));
    assert_eq!(
        owner.hook.tool_calls.lock().unwrap().len(),
        1,
        "the tool ran once"
    );
    let again = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: routed.run_id,
            call_id: routed.call_id,
            approve: false,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::NotFound, "{again:?}");
}

/// The bot is faster than the hook: its answer reaches replica B before
/// the hook's `ask` reached A. B holds the answer until the store has the
/// request, then answers it; the run on A completes, the tool run once.
/// Such an answer used to be NOT_FOUND, and the bot had to retry.
async fn an_answer_on_another_replica_before_its_question_waits_for_it(store: Store) {
    let owner = weather_owner().start().await;
    let (ask, mut asked, gate) = gated_asker("May I?");
    let ask = ask.start().await;
    let cl = Cluster::start(
        2,
        &store,
        &[("asker", &ask.addr), ("owner", &owner.addr)],
        "",
    )
    .await;
    let (mut a, mut b) = (cl.client(0).await, cl.client(1).await);
    let s = session(&mut a, "a").await;
    let run = tokio::spawn(async move { invoke(&mut a, &s, "weather").await });
    let routed = within("the hook's question", asked.recv())
        .await
        .expect("the hook asked");
    let answering = tokio::spawn(async move {
        b.resolve_approval(pb::ResolveApprovalRequest {
            run_id: routed.run_id,
            call_id: routed.call_id,
            approve: true,
            note: String::new(),
        })
        .await
    });
    let answerer = &cl.replicas[1 % cl.replicas.len()];
    within(
        "the early answer held",
        until_metric(answerer.admin, "hookwire_approval_answers_waiting 1"),
    )
    .await;
    gate.add_permits(1);
    within("the held answer", answering)
        .await
        .unwrap()
        .expect("answered once the question was recorded");
    let r = within("the invoke's result", run).await.unwrap();
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{r:?}");
    assert_eq!(
        owner.hook.tool_calls.lock().unwrap().len(),
        1,
        "the tool ran once"
    );
}

/// A hook server owning get_weather whose tool never returns; signals when
/// a call arrived.
async fn stuck_tool() -> (TestHook, Arc<tokio::sync::Notify>) {
    let started = Arc::new(tokio::sync::Notify::new());
    let s2 = started.clone();
    let hook = FnHook::new("owner", &[])
        .with_tool(weather_tool(), move |_, _| {
            let s = s2.clone();
            async move {
                s.notify_one();
                std::future::pending::<()>().await;
                unreachable!()
            }
        })
        .start()
        .await;
    (hook, started)
}

async fn wait_until_idle(
    c: &mut pb::agent_service_client::AgentServiceClient<tonic::transport::Channel>,
    s: &str,
) -> pb::Session {
    within("the interrupted run's end", async {
        loop {
            let got = c
                .get_session(pb::GetSessionRequest {
                    session_id: s.to_string(),
                })
                .await
                .unwrap()
                .into_inner();
            if got.active_run_id.is_empty() {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
}

fn assert_interrupted_transcript(got: &pb::Session) {
    let t = texts(&got.transcript);
    assert_eq!(
        t,
        [
            "weather now".to_string(),
            "call:get_weather({\"city\":\"Paris\"})".to_string(),
            format!("result:{}", hookwire::store::LOST_REPLICA_RESULT),
        ],
        "the staged turn is closed with a synthetic error result"
    );
    assert!(every_call_has_a_result(&got.transcript));
    let is_error = got.transcript[2]
        .blocks
        .iter()
        .all(|b| matches!(&b.kind, Some(pb::block::Kind::ToolResult(r)) if r.is_error));
    assert!(is_error);
}

async fn a_killed_replicas_run_is_interrupted_by_another(store: Store) {
    let (tool, started) = stuck_tool().await;
    let mut cl = Cluster::start(2, &store, &[("owner", &tool.addr)], "run_lease: 2s").await;
    let mut a = cl.client(0).await;
    let s = session(&mut a, "a").await;
    let mut a2 = a.clone();
    let s2 = s.clone();
    // The client stays on the stream (a client that goes away cancels).
    let run = tokio::spawn(async move {
        if let Ok(r) = a2
            .run(pb::RunRequest {
                session_id: s2,
                input: "weather now".into(),
            })
            .await
        {
            let mut st = r.into_inner();
            while let Ok(Some(_)) = st.message().await {}
        }
    });
    within("the tool call", started.notified()).await;
    let victim = cl.replicas.remove(0);
    victim.kill().await;
    let _ = run.await;
    let mut b = cl.client(0).await;
    let got = wait_until_idle(&mut b, &s).await;
    assert_interrupted_transcript(&got);
    // The survivor says what it did (the line may trail the commit).
    // The session takes a new run, which sees the closed call.
    let next = invoke(&mut b, &s, "hello again").await;
    assert_eq!(outcome(&next), pb::RunOutcome::Completed, "{next:?}");
}

/// Every replica is restarted (SIGTERM, wait, start) in turn while clients
/// keep running; every run that completed is in its session's transcript.
async fn rolling_restart_under_load_loses_no_committed_message(store: Store) {
    let owner = weather_owner().start().await;
    let cl = Cluster::start(3, &store, &[("owner", &owner.addr)], "shutdown_grace: 10s").await;
    let addrs = Arc::new(std::sync::Mutex::new(
        cl.replicas
            .iter()
            .map(|r| r.addr.clone())
            .collect::<Vec<_>>(),
    ));
    let mut first = cl.client(0).await;
    let mut sessions = Vec::new();
    for _ in 0..4 {
        sessions.push(session(&mut first, "a").await);
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for (w, s) in sessions.iter().cloned().enumerate() {
        let (addrs, stop) = (addrs.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut done: Vec<String> = Vec::new();
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                n += 1;
                let input = if n % 3 == 0 {
                    format!("weather w{w} n{n}")
                } else {
                    format!("hello w{w} n{n}")
                };
                let addr = {
                    let a = addrs.lock().unwrap();
                    a[(w + n) % a.len()].clone()
                };
                let Ok(mut c) = pb::agent_service_client::AgentServiceClient::connect(addr).await
                else {
                    continue;
                };
                if let Ok(r) = c
                    .invoke(pb::RunRequest {
                        session_id: s.clone(),
                        input: input.clone(),
                    })
                    .await
                {
                    let r = r.into_inner();
                    if r.outcome == pb::RunOutcome::Completed as i32 {
                        done.push(input);
                    }
                }
            }
            (s, done)
        }));
    }
    let mut cl = cl;
    for i in 0..3 {
        // Let some load through between restarts.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let old = cl.replicas.remove(0);
        let old_addr = old.addr.clone();
        assert!(old.terminate().await, "a replica exits 0 after its drain");
        let new = Replica::start(&cl.cfg).await;
        {
            let mut a = addrs.lock().unwrap();
            let pos = a.iter().position(|x| *x == old_addr).unwrap();
            a[pos] = new.addr.clone();
        }
        cl.replicas.push(new);
        eprintln!("restarted replica {i}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut c = cl.client(0).await;
    let mut total = 0;
    for w in workers {
        let (s, done) = within("load worker", w).await.unwrap();
        total += done.len();
        let got = c
            .get_session(pb::GetSessionRequest { session_id: s })
            .await
            .unwrap()
            .into_inner();
        let t = texts(&got.transcript);
        for input in &done {
            assert_eq!(
                t.iter().filter(|x| *x == input).count(),
                1,
                "completed run `{input}` is committed once: {t:?}"
            );
        }
        assert!(every_call_has_a_result(&got.transcript));
    }
    eprintln!("{total} runs completed across 3 restarts");
    assert!(total >= 8, "the load kept running: {total}");
    let _ = &cl.dir;
}

// ------------------------------------------------------------ postgres

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_create_on_a_run_on_b_read_on_c() {
    create_on_a_run_on_b_read_on_c(Store::postgres()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_approval_raised_on_one_replica_is_answered_on_another() {
    approval_raised_on_one_replica_is_answered_on_another(Store::postgres()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cancel_on_another_replica_stops_the_run_and_denies_its_approval() {
    cancel_on_another_replica_stops_the_run_and_denies_its_approval(Store::postgres()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_invoke_approval_is_answered_on_another_replica() {
    an_invoke_approval_is_answered_on_another_replica(Store::postgres()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_an_answer_on_another_replica_before_its_question_waits_for_it() {
    an_answer_on_another_replica_before_its_question_waits_for_it(Store::postgres()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_killed_replicas_run_is_interrupted_by_another() {
    a_killed_replicas_run_is_interrupted_by_another(Store::postgres()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rolling_restart_under_load_loses_no_committed_message() {
    rolling_restart_under_load_loses_no_committed_message(Store::postgres()).await
}

/// A replica draining on a shared store tells its clients to move as the
/// drain begins (HTTP/2 GOAWAY, its listener closed), so a long-lived
/// channel reconnects to another replica; its run in flight still
/// finishes on the connection it started on. It used to keep every
/// connection, answering UNAVAILABLE, until its last run ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_draining_replica_sends_its_clients_elsewhere_at_once() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(tokio::sync::Notify::new());
    let (g, e) = (gate.clone(), entered.clone());
    let hook = FnHook::new("slow", &[pb::EventKind::RunStart])
        .on_run_start(move |_, _| {
            let (g, e) = (g.clone(), e.clone());
            async move {
                e.notify_one();
                let _p = g.acquire().await;
                hookwire::hook_server::Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let mut cluster = Cluster::start(
        1,
        &Store::postgres(),
        &[("slow", &hook.addr)],
        "shutdown_grace: 120s",
    )
    .await;
    let mut c = cluster.client(0).await;
    let s = session(&mut c, "a").await;
    let run = tokio::spawn(async move { invoke(&mut c, &s, "hello").await });
    within("the run starts", entered.notified()).await;
    // An idle connection of its own (its handle kept: dropped, the client
    // would close the connection itself).
    let tcp =
        tokio::net::TcpStream::connect(cluster.replicas[0].addr.trim_start_matches("http://"))
            .await
            .unwrap();
    let (_handle, connection) = h2::client::handshake(tcp).await.unwrap();
    let closed = tokio::spawn(connection);
    cluster.replicas[0].sigterm().await;
    within("the idle connection is told to go", closed)
        .await
        .unwrap()
        .expect("closed by a GOAWAY, not torn down");
    // Told while the run is still held at its hook: not after the drain.
    assert!(!run.is_finished(), "the connection went only with the run");
    gate.add_permits(1);
    let r = within("the run in flight finishes", run).await.unwrap();
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(within("the exit", cluster.replicas.remove(0).exited_cleanly()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_replicas_starting_at_once_migrate_once() {
    let store = Store::postgres();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), &[], &store.url(), "");
    let (a, b) = tokio::join!(Replica::start(&cfg), Replica::start(&cfg));
    let Store::Postgres(url) = &store else {
        unreachable!()
    };
    assert_eq!(
        support::postgres::server()
            .query(url, "SELECT count(*) FROM _sqlx_migrations WHERE success"),
        "4",
        "each of the four migrations applied once"
    );
    let mut ca = a.client().await;
    let s = session(&mut ca, "a").await;
    let r = invoke(&mut b.client().await, &s, "hello").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
}

/// Quotas count what the store holds, so they hold across replicas:
/// sessions created on A count on B, and a run waiting on A takes the one
/// concurrent-run slot on B too; once it ends the slot is free everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_quotas_hold_across_replicas() {
    let store = Store::postgres();
    let owner = weather_owner().start().await;
    let ask = asker("May I?", 0).start().await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        &[("asker", &ask.addr), ("owner", &owner.addr)],
        &store.url(),
        "",
    );
    let mut yaml = std::fs::read_to_string(&cfg).unwrap();
    yaml.push_str("quotas: {max_sessions: 2, max_concurrent_runs: 1}\n");
    std::fs::write(&cfg, yaml).unwrap();
    let (ra, rb) = tokio::join!(Replica::start(&cfg), Replica::start(&cfg));
    let (mut a, mut b) = (ra.client().await, rb.client().await);
    let s1 = session(&mut a, "a").await;
    let s2 = session(&mut a, "a").await;
    let e = b
        .create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("quota `max_sessions` reached (2)"),
        "{e:?}"
    );
    let (run_id, stream, _) = within(
        "approval request",
        run_until(&mut a, &s1, "weather", is_approval),
    )
    .await;
    let e = b
        .invoke(pb::RunRequest {
            session_id: s2.clone(),
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message()
            .contains("quota `max_concurrent_runs` reached (1)"),
        "{e:?}"
    );
    b.cancel_run(pb::CancelRunRequest { run_id })
        .await
        .expect("cancelled from B");
    within("the run's end", finish(stream)).await;
    let r = invoke(&mut b, &s2, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{r:?}");
}

// ------------------------------------------------------------ sqlite

/// With SQLite the same scenarios run on one replica ("A", "B" and "C" are
/// the same process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_approval_and_cancel_scenarios() {
    create_on_a_run_on_b_read_on_c(Store::sqlite()).await;
    approval_raised_on_one_replica_is_answered_on_another(Store::sqlite()).await;
    cancel_on_another_replica_stops_the_run_and_denies_its_approval(Store::sqlite()).await;
    an_invoke_approval_is_answered_on_another_replica(Store::sqlite()).await;
    an_answer_on_another_replica_before_its_question_waits_for_it(Store::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_restart_keeps_sessions_and_transcripts() {
    let store = Store::sqlite();
    let owner = weather_owner().start().await;
    let cl = Cluster::start(1, &store, &[("owner", &owner.addr)], "").await;
    let mut c = cl.client(0).await;
    let s = session(&mut c, "a").await;
    assert_eq!(
        outcome(&invoke(&mut c, &s, "weather first").await),
        pb::RunOutcome::Completed
    );
    let before = c
        .get_session(pb::GetSessionRequest {
            session_id: s.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let Cluster {
        dir,
        cfg,
        mut replicas,
    } = cl;
    assert!(replicas.remove(0).terminate().await);
    let again = Replica::start(&cfg).await;
    let mut c = again.client().await;
    let after = c
        .get_session(pb::GetSessionRequest {
            session_id: s.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(after.transcript, before.transcript);
    assert_eq!(after.run_count, 1);
    let r = invoke(&mut c, &s, "second").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
    let t = texts(
        &c.get_session(pb::GetSessionRequest { session_id: s })
            .await
            .unwrap()
            .into_inner()
            .transcript,
    );
    assert_eq!(t[0], "weather first");
    assert_eq!(t[t.len() - 2], "second");
    drop(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_crash_mid_run_leaves_a_valid_transcript() {
    let store = Store::sqlite();
    let (tool, started) = stuck_tool().await;
    let cl = Cluster::start(1, &store, &[("owner", &tool.addr)], "run_lease: 2s").await;
    let mut c = cl.client(0).await;
    let s = session(&mut c, "a").await;
    let s2 = s.clone();
    let mut c2 = c.clone();
    // The client stays on the stream (a client that goes away cancels).
    let run = tokio::spawn(async move {
        if let Ok(r) = c2
            .run(pb::RunRequest {
                session_id: s2,
                input: "weather now".into(),
            })
            .await
        {
            let mut st = r.into_inner();
            while let Ok(Some(_)) = st.message().await {}
        }
    });
    within("the tool call", started.notified()).await;
    let Cluster {
        dir,
        cfg,
        mut replicas,
    } = cl;
    replicas.remove(0).kill().await;
    let _ = run.await;
    // The restarted process ends the dead run once its lease expired.
    let again = Replica::start(&cfg).await;
    let mut c = again.client().await;
    let got = wait_until_idle(&mut c, &s).await;
    assert_interrupted_transcript(&got);
    let next = invoke(&mut c, &s, "hello again").await;
    assert_eq!(outcome(&next), pb::RunOutcome::Completed);
    drop(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rolling_restart_loses_no_committed_message() {
    rolling_restart_under_load_loses_no_committed_message_single(Store::sqlite()).await
}

/// The SQLite variant: one replica restarted three times under load.
async fn rolling_restart_under_load_loses_no_committed_message_single(store: Store) {
    let owner = weather_owner().start().await;
    let mut cl = Cluster::start(1, &store, &[("owner", &owner.addr)], "shutdown_grace: 10s").await;
    let mut c = cl.client(0).await;
    let s = session(&mut c, "a").await;
    let mut done = Vec::new();
    for round in 0..3 {
        for n in 0..3 {
            let input = format!("weather r{round} n{n}");
            let r = invoke(&mut c, &s, &input).await;
            assert_eq!(outcome(&r), pb::RunOutcome::Completed);
            done.push(input);
        }
        assert!(cl.replicas.remove(0).terminate().await);
        cl.replicas.push(Replica::start(&cl.cfg).await);
        c = cl.client(0).await;
    }
    let got = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    let t = texts(&got.transcript);
    for input in &done {
        assert_eq!(
            t.iter().filter(|x| *x == input).count(),
            1,
            "{input}: {t:?}"
        );
    }
    assert!(every_call_has_a_result(&got.transcript));
}

// ------------------------------------------------------------ retention

/// An idle session is deleted after server.session_ttl and its hooks get
/// session_end with reason `expired`; ListSessions pages and filters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_expire_with_session_end_and_lists_page() {
    let hook = FnHook::new("watch", &[pb::EventKind::SessionEnd])
        .start()
        .await;
    let yaml = config(&[("watch", &hook.addr, "")], "")
        .replace("hooks:\n", "server:\n  session_ttl: 1s\nhooks:\n");
    let server = TestServer::start(&yaml).await;
    let mut c = server.client().await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(session(&mut c, "a").await);
    }
    let page = c
        .list_sessions(pb::ListSessionsRequest {
            page_size: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.sessions.len(), 2);
    assert!(!page.next_page_token.is_empty());
    let rest = c
        .list_sessions(pb::ListSessionsRequest {
            page_size: 2,
            page_token: page.next_page_token,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.sessions.len(), 1);
    assert!(rest.next_page_token.is_empty());
    let none = c
        .list_sessions(pb::ListSessionsRequest {
            agent: "other".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(none.sessions.is_empty());
    let bad = c
        .list_sessions(pb::ListSessionsRequest {
            page_token: "nonsense".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    within("session_end", hook.hook.wait_for("session_end")).await;
    let ends: Vec<String> = hook
        .hook
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match &e.payload {
            Some(pb::hook_event::Payload::SessionEnd(s)) => Some(s.reason.clone()),
            _ => None,
        })
        .collect();
    assert!(ends.iter().all(|r| r == "expired"), "{ends:?}");
    let gone = c
        .get_session(pb::GetSessionRequest {
            session_id: ids[0].clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), tonic::Code::NotFound);
    server.stop().await;
}

/// A session at server.max_transcript_bytes refuses new runs with
/// RESOURCE_EXHAUSTED naming the setting.
#[tokio::test]
async fn a_full_transcript_refuses_runs_naming_the_limit() {
    let yaml = format!("{}server:\n  max_transcript_bytes: 300\n", config(&[], ""));
    let server = TestServer::start(&yaml).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let first = invoke(&mut c, &s, &"x".repeat(200)).await;
    assert_eq!(outcome(&first), pb::RunOutcome::Completed);
    let err = c
        .invoke(pb::RunRequest {
            session_id: s,
            input: "more".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("server.max_transcript_bytes"),
        "{err:?}"
    );
    server.stop().await;
}

/// A run whose input the store refuses (the transcript would pass its
/// limit) reports no message: the client is never given one its
/// transcript lacks.
#[tokio::test]
async fn a_run_reports_only_what_its_transcript_holds() {
    let yaml = format!("{}server:\n  max_transcript_bytes: 300\n", config(&[], ""));
    let server = TestServer::start(&yaml).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, &"x".repeat(400)).await;
    assert_eq!(outcome(&r), pb::RunOutcome::Failed, "{}", r.reason);
    assert!(r.reason.contains("max_transcript_bytes"), "{}", r.reason);
    let got = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert!(got.transcript.is_empty(), "{:?}", got.transcript);
    assert!(r.messages.is_empty(), "reported: {:?}", r.messages);
    server.stop().await;
}
