//! The engine on a store that misbehaves at chosen moments: lease renewals
//! that fail (the replica must stop its runs before their leases can
//! expire), a run start held up in the store while shutdown begins (the
//! drain must wait for it) or while the run is cancelled, signals that
//! have not reached the replica yet (a cancel recorded by another one).

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hookwire::agent::approvals::Decision;
use hookwire::agent::outcome::RunOutcome;
use hookwire::auth::Principal;
use hookwire::config::{Config, StoreSetting};
use hookwire::engine::{CallerDeadline, Engine, EngineError};
use hookwire::message::Message;
use hookwire::pb;
use hookwire::session::Session;
use hookwire::store::{
    self, ClaimedRun, NewSession, OwnerUsage, RunEnd, RunLease, SessionFilter, SessionPage,
    SessionStore, Signal, StoreError, StoreOptions,
};
use support::fault::{FaultHook, Misbehave};
use support::*;
use tokio::sync::Notify;

/// No wait in these tests is meant to come near this: a hang fails.
const PATIENCE: Duration = Duration::from_secs(20);

/// Holds `begin_run` until opened.
#[derive(Default)]
struct Gate {
    entered: Notify,
    open: Notify,
}

impl Gate {
    /// Says it was entered, then waits to be opened.
    async fn wait(&self) {
        let open = self.open.notified();
        self.entered.notify_one();
        open.await;
    }
}

/// A real store (SQLite) with chosen faults.
struct Faulty {
    inner: Arc<dyn SessionStore>,
    /// Every `begin_run` waits here.
    begin: Option<Arc<Gate>>,
    /// Lease renewals answer UNAVAILABLE (the database cut off).
    renewals_fail: bool,
    /// Renewals asked for.
    renewals: AtomicUsize,
    /// No expired run is ever claimed (the reapers of other replicas are
    /// cut off as well): a run only stops if its own replica stops it.
    no_claims: bool,
    /// The replica's poll reads no signal (it has not come round yet, or
    /// a hint was lost): what other replicas recorded reaches it only
    /// through the store's answers to its runs' own calls.
    no_signals: bool,
    /// The next transcript read waits here (once).
    transcript_gate: std::sync::Mutex<Option<Arc<Gate>>>,
    /// The next cancel recorded waits here (once).
    cancel_gate: std::sync::Mutex<Option<Arc<Gate>>>,
    /// The next owner count waits here (once), after it was read.
    usage_gate: std::sync::Mutex<Option<Arc<Gate>>>,
    /// The next run begun waits here (once), after the store began it.
    begun_gate: std::sync::Mutex<Option<Arc<Gate>>>,
    /// The next run begun is answered UNAVAILABLE (once), as if the
    /// connection was lost with the commit's answer.
    begin_answer_lost: std::sync::atomic::AtomicBool,
    /// The outcome and reason of each run end recorded, in order; `ended`
    /// is notified after each.
    ends: std::sync::Mutex<Vec<(RunOutcome, String)>>,
    ended: Notify,
    /// Every run end asked for, recorded or refused.
    end_attempts: AtomicUsize,
    /// The next run end waits here (once) before it is recorded.
    end_gate: std::sync::Mutex<Option<Arc<Gate>>>,
    /// Notified after each approval request the store recorded.
    approval_recorded: Notify,
    /// Notified after each cancel the store recorded.
    cancel_recorded: Notify,
    /// The ends of the runs of these sessions are refused (another
    /// replica took their leases).
    lost_ends: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Faulty {
    async fn sqlite(lease: Duration) -> Faulty {
        let dir = tempfile::tempdir().unwrap().keep();
        let setting = StoreSetting::Sqlite {
            path: dir.join("h.db"),
        };
        let options = StoreOptions {
            lease,
            ..Default::default()
        };
        Faulty {
            inner: store::open(&setting, options).await.expect("store opens"),
            begin: None,
            renewals_fail: false,
            renewals: AtomicUsize::new(0),
            no_claims: false,
            no_signals: false,
            transcript_gate: Default::default(),
            cancel_gate: Default::default(),
            usage_gate: Default::default(),
            begun_gate: Default::default(),
            begin_answer_lost: Default::default(),
            ends: Default::default(),
            ended: Notify::new(),
            end_attempts: AtomicUsize::new(0),
            end_gate: Default::default(),
            approval_recorded: Notify::new(),
            cancel_recorded: Notify::new(),
            lost_ends: Default::default(),
        }
    }

    fn renewal(&self) -> Result<(), StoreError> {
        self.renewals.fetch_add(1, Ordering::SeqCst);
        if self.renewals_fail {
            return Err(StoreError::Unavailable(
                "cut off from the database (test)".into(),
            ));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl SessionStore for Faulty {
    fn engine(&self) -> &'static str {
        self.inner.engine()
    }
    async fn create_session(&self, s: &NewSession) -> Result<Session, StoreError> {
        self.inner.create_session(s).await
    }
    async fn get_session(&self, id: &str) -> Result<Session, StoreError> {
        self.inner.get_session(id).await
    }
    async fn list_sessions(&self, f: &SessionFilter) -> Result<SessionPage, StoreError> {
        self.inner.list_sessions(f).await
    }
    async fn run_session(&self, run: &str) -> Result<Session, StoreError> {
        self.inner.run_session(run).await
    }
    async fn owner_usage(
        &self,
        owner: &str,
        window: Duration,
        cap: u64,
    ) -> Result<OwnerUsage, StoreError> {
        let usage = self.inner.owner_usage(owner, window, cap).await;
        let gate = self.usage_gate.lock().unwrap().take();
        if let Some(g) = gate {
            g.wait().await;
        }
        usage
    }
    async fn delete_session(&self, id: &str) -> Result<Session, StoreError> {
        self.inner.delete_session(id).await
    }
    async fn transcript(&self, id: &str) -> Result<Vec<Message>, StoreError> {
        self.inner.transcript(id).await
    }
    async fn transcript_after(&self, id: &str, from: u64) -> Result<Vec<Message>, StoreError> {
        let gate = self.transcript_gate.lock().unwrap().take();
        if let Some(g) = gate {
            let open = g.open.notified();
            g.entered.notify_one();
            open.await;
        }
        self.inner.transcript_after(id, from).await
    }
    async fn begin_run(&self, s: &str, r: &str, rep: &str) -> Result<RunLease, StoreError> {
        if let Some(g) = &self.begin {
            let open = g.open.notified();
            g.entered.notify_one();
            open.await;
        }
        let lease = self.inner.begin_run(s, r, rep).await?;
        let gate = self.begun_gate.lock().unwrap().take();
        if let Some(g) = gate {
            g.wait().await;
        }
        if self.begin_answer_lost.swap(false, Ordering::SeqCst) {
            return Err(StoreError::Unavailable("connection lost (test)".into()));
        }
        Ok(lease)
    }
    async fn renew(&self, l: &RunLease) -> Result<(), StoreError> {
        self.renewal()?;
        self.inner.renew(l).await
    }
    async fn renew_all(&self, leases: &[RunLease]) -> Result<Vec<bool>, StoreError> {
        self.renewal()?;
        self.inner.renew_all(leases).await
    }
    async fn append(&self, l: &RunLease, m: &[Message]) -> Result<(), StoreError> {
        self.inner.append(l, m).await
    }
    async fn stage_turn(&self, l: &RunLease, t: Option<&Message>) -> Result<(), StoreError> {
        self.inner.stage_turn(l, t).await
    }
    async fn check_run(&self, l: &RunLease) -> Result<(), StoreError> {
        self.inner.check_run(l).await
    }
    async fn end_run(&self, l: &RunLease, m: &[Message], e: &RunEnd) -> Result<(), StoreError> {
        self.end_attempts.fetch_add(1, Ordering::SeqCst);
        if self.lost_ends.lock().unwrap().contains(&l.session_id) {
            return Err(StoreError::LeaseLost(l.run_id.clone()));
        }
        let gate = self.end_gate.lock().unwrap().take();
        if let Some(g) = gate {
            g.wait().await;
        }
        self.inner.end_run(l, m, e).await?;
        self.ends
            .lock()
            .unwrap()
            .push((e.outcome, e.reason.clone()));
        self.ended.notify_one();
        Ok(())
    }
    async fn request_approval(&self, l: &RunLease, c: &str) -> Result<(), StoreError> {
        self.inner.request_approval(l, c).await?;
        self.approval_recorded.notify_one();
        Ok(())
    }
    async fn resolve_approval(&self, r: &str, c: &str, d: &Decision) -> Result<(), StoreError> {
        self.inner.resolve_approval(r, c, d).await
    }
    async fn expire_approval(&self, l: &RunLease, c: &str) -> Result<Option<Decision>, StoreError> {
        self.inner.expire_approval(l, c).await
    }
    async fn request_cancel(&self, r: &str, why: &str) -> Result<(), StoreError> {
        let gate = self.cancel_gate.lock().unwrap().take();
        if let Some(g) = gate {
            let open = g.open.notified();
            g.entered.notify_one();
            open.await;
        }
        self.inner.request_cancel(r, why).await?;
        self.cancel_recorded.notify_one();
        Ok(())
    }
    async fn signals(&self, rep: &str, w: &[(String, String)]) -> Result<Vec<Signal>, StoreError> {
        if self.no_signals {
            return Ok(Vec::new());
        }
        self.inner.signals(rep, w).await
    }
    async fn claim_expired(&self, rep: &str, n: u32) -> Result<Vec<ClaimedRun>, StoreError> {
        if self.no_claims {
            return Ok(Vec::new());
        }
        self.inner.claim_expired(rep, n).await
    }
    async fn expire_sessions(&self, ttl: Duration, n: u32) -> Result<Vec<Session>, StoreError> {
        self.inner.expire_sessions(ttl, n).await
    }
    fn subscribe(&self) -> tokio::sync::broadcast::Receiver<String> {
        self.inner.subscribe()
    }
    async fn close(&self) {
        self.inner.close().await
    }
}

/// An engine of `yaml` on `store`, its hooks described.
async fn engine_on(yaml: &str, store: Arc<dyn SessionStore>) -> Arc<Engine> {
    let config = Config::parse(yaml, "test").unwrap();
    let models = hookwire::server::build_models(&config).unwrap();
    let inst = hookwire::telemetry::Instruments::new(&config.telemetry);
    let engine = Arc::new(Engine::new(config, models, inst, store).unwrap());
    engine
        .registry()
        .describe_all(Duration::from_secs(10))
        .await;
    engine
}

/// Starts a run of `session` in a task of its own (a caller the test can
/// abort, as tonic drops a handler whose client left).
fn spawn_start(
    engine: &Arc<Engine>,
    session: &str,
    input: &str,
    caller: Option<CallerDeadline>,
) -> tokio::task::JoinHandle<Result<hookwire::engine::RunHandle, hookwire::engine::EngineError>> {
    let (engine, session, input) = (engine.clone(), session.to_string(), input.to_string());
    tokio::spawn(async move {
        engine
            .start_run(
                &Principal::anonymous(),
                &session,
                input,
                false,
                Default::default(),
                caller,
            )
            .await
    })
}

async fn new_session_of(engine: &Engine) -> Result<String, EngineError> {
    Ok(engine
        .create_session(&Principal::anonymous(), "a", vec![], Default::default())
        .await?
        .id)
}

async fn new_session(engine: &Engine) -> String {
    engine
        .create_session(&Principal::anonymous(), "a", vec![], Default::default())
        .await
        .unwrap()
        .id
}

/// Starts a run of `session` (not streaming), as an anonymous caller.
async fn start(
    engine: &Arc<Engine>,
    session: &str,
    input: &str,
) -> Result<hookwire::engine::RunHandle, EngineError> {
    engine
        .start_run(
            &Principal::anonymous(),
            session,
            input.into(),
            false,
            Default::default(),
            None,
        )
        .await
}

/// A run of `session` whose streaming client reads nothing for now: the
/// answer's ~80 deltas fill its queue (`server.run_event_buffer: 16`), and
/// the run waits for room.
async fn stalled_run(engine: &Arc<Engine>, session: &str) -> hookwire::engine::RunHandle {
    let run = engine
        .start_run(
            &Principal::anonymous(),
            session,
            "x".repeat(1000),
            true,
            Default::default(),
            None,
        )
        .await
        .unwrap();
    tokio::time::timeout(PATIENCE, async {
        while run.events.len() < 16 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the queue filled");
    run
}

/// Stops `engine` accepting and drains it with `grace`: how long that took.
async fn drained(engine: &Engine, grace: Duration) -> Duration {
    engine.stop_accepting();
    let began = tokio::time::Instant::now();
    tokio::time::timeout(PATIENCE, engine.drain(grace))
        .await
        .expect("the drain ended");
    began.elapsed()
}

/// The report of `run`, once it ended.
async fn finished(run: hookwire::engine::RunHandle) -> hookwire::agent::events::RunReport {
    tokio::time::timeout(PATIENCE, run.task)
        .await
        .expect("the run ended")
        .unwrap()
}

fn message_texts(m: &[Message]) -> Vec<String> {
    m.iter().map(|m| m.text()).collect()
}

/// A tool that never returns: `started` when a call arrives, `dropped`
/// when hookwire gave the call up (its request was cancelled), and the
/// number of calls that arrived.
struct StuckTool {
    hook: TestHook,
    started: Arc<Notify>,
    dropped: Arc<Notify>,
    calls: Arc<AtomicUsize>,
}

/// Signals when the call it lives in is dropped.
struct OnDrop(Arc<Notify>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

async fn stuck_tool() -> StuckTool {
    let started = Arc::new(Notify::new());
    let dropped = Arc::new(Notify::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let (s, d, c) = (started.clone(), dropped.clone(), calls.clone());
    let hook = FnHook::new("owner", &[])
        .with_tool(weather_tool(), move |_, _| {
            let (s, d, c) = (s.clone(), d.clone(), c.clone());
            async move {
                let _dropped = OnDrop(d);
                c.fetch_add(1, Ordering::SeqCst);
                s.notify_one();
                std::future::pending::<()>().await;
                pb::CallToolResponse::default()
            }
        })
        .start()
        .await;
    StuckTool {
        hook,
        started,
        dropped,
        calls,
    }
}

/// A replica whose lease renewals fail (cut off from the database, its
/// pool exhausted) stops its runs itself before their leases can expire:
/// after that another replica may claim the run, end it and free its
/// session, so no tool of it may start or go on here. It used to keep
/// running them (and starting their queued tool calls) until a write
/// failed.
#[tokio::test]
async fn a_replica_that_cannot_renew_its_leases_stops_its_runs_before_they_expire() {
    const LEASE: Duration = Duration::from_secs(3);
    let tool = stuck_tool().await;
    let mut store = Faulty::sqlite(LEASE).await;
    store.renewals_fail = true;
    store.no_claims = true;
    let store = Arc::new(store);
    let yaml = config(&[("owner", &tool.hook.addr, "")], "tools: [get_weather]")
        + "server:\n  run_lease: 3s\n";
    let engine = engine_on(&yaml, store.clone()).await;
    engine.start_background();
    let session = new_session(&engine).await;
    // Taken before the run's lease: it expires no earlier than LEASE after.
    let leased = tokio::time::Instant::now();
    // Two calls, one at a time: the second is queued behind the stuck first.
    // Streamed, so the client is shown the turn.
    let mut run = engine
        .start_run(
            &Principal::anonymous(),
            &session,
            "two tools".into(),
            true,
            Default::default(),
            None,
        )
        .await
        .unwrap();
    tokio::time::timeout(PATIENCE, tool.started.notified())
        .await
        .expect("the first tool call started");
    let report = tokio::time::timeout_at(leased + LEASE, run.task)
        .await
        .expect("the run stopped before its lease could expire")
        .unwrap();
    assert_eq!(report.outcome, RunOutcome::Interrupted, "{}", report.reason);
    assert!(
        report
            .reason
            .contains("stopped the run before the lease could expire"),
        "{}",
        report.reason
    );
    tokio::time::timeout(PATIENCE, tool.dropped.notified())
        .await
        .expect("the executing tool call was given up");
    assert_eq!(
        tool.calls.load(Ordering::SeqCst),
        1,
        "the queued call never started"
    );
    assert!(store.renewals.load(Ordering::SeqCst) > 0);
    // Its end went through (only renewals fail): the session is free.
    assert_eq!(store.get_session(&session).await.unwrap().active_run, None);
    // The batch it gave up is closed as a reaper would have closed it: the
    // model learns that both calls may have run (it used to find no trace
    // of them, so it could call them again).
    let t = store.transcript(&session).await.unwrap();
    assert_eq!(t.len(), 3, "input, the batch's turn, its results: {t:?}");
    let calls: Vec<&str> = t[1].tool_calls().map(|c| c.id.as_str()).collect();
    assert_eq!(calls.len(), 2, "{t:?}");
    let results: Vec<_> = t[2].tool_results_iter().collect();
    assert_eq!(
        results
            .iter()
            .map(|r| r.call_id.as_str())
            .collect::<Vec<_>>(),
        calls
    );
    assert!(
        results
            .iter()
            .all(|r| r.is_error && r.content == store::LOST_REPLICA_RESULT),
        "{results:?}"
    );
    // The session keeps the turn the client was shown: it is not retracted.
    let mut shown = Vec::new();
    while let Ok(ev) = run.events.try_recv() {
        shown.push(*ev);
    }
    use hookwire::agent::events::RunEvent;
    assert!(
        shown
            .iter()
            .any(|e| matches!(e, RunEvent::ToolCallRequested { turn: 1, .. })),
        "{shown:?}"
    );
    assert!(
        !shown
            .iter()
            .any(|e| matches!(e, RunEvent::DeltasRetracted { .. })),
        "{shown:?}"
    );
    engine.stop_background().await;
}

/// When the shutdown grace runs out, a run whose end is recorded but whose
/// last events still wait for room for a slow client (up to
/// `server.client_stall_timeout`) is done as far as the store goes: the
/// drain neither waits for its client nor ends it again. It used to count
/// as in flight: the drain waited out its 5 s wind-down for it, then
/// recorded it `interrupted`, which the store refused, with a warning.
#[tokio::test]
async fn a_drain_neither_waits_for_a_slow_client_nor_ends_its_recorded_run_again() {
    let (logs, _guard) = support::logwatch::LogWatch::install("info");
    const GRACE: Duration = Duration::from_millis(300);
    let store = Arc::new(Faulty::sqlite(Duration::from_secs(30)).await);
    let engine = engine_on(
        &(config(&[], "") + "server:\n  run_event_buffer: 16\n"),
        store.clone(),
    )
    .await;
    let session = new_session(&engine).await;
    let mut run = stalled_run(&engine, &session).await;
    // The grace runs out: the run is cancelled, records its end at once,
    // and its last events (the retraction, finished) wait for the client.
    let took = drained(&engine, GRACE).await;
    assert_eq!(
        *store.ends.lock().unwrap(),
        [(RunOutcome::Cancelled, "server shutting down".to_string())]
    );
    assert_eq!(
        store.end_attempts.load(Ordering::SeqCst),
        1,
        "the run's end was recorded once, and never asked for again"
    );
    assert!(
        logs.lines_with(&["WARN", "cannot record"]).is_empty(),
        "{}",
        logs.contents()
    );
    assert!(
        took < GRACE + Duration::from_secs(3),
        "the drain waited {took:?} for a run whose end was recorded"
    );
    assert_eq!(store.get_session(&session).await.unwrap().active_run, None);
    // Best-effort past the grace: a client that reads still gets them.
    let mut last = None;
    while let Some(ev) = run.events.recv().await {
        last = Some(*ev);
    }
    let report = finished(run).await;
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert_eq!(
        last,
        Some(hookwire::agent::events::RunEvent::Finished(report))
    );
}

/// Past the grace, a run whose end could not be recorded (its lease was
/// taken) is not waited for once it left, while another run's end is
/// recorded and its last events wait for a slow client: the drain returns
/// at once. It waited its whole 5 s wind-down for the first run's end to
/// be recorded, which never came.
#[tokio::test]
async fn a_drain_does_not_wait_for_an_end_that_cannot_be_recorded() {
    const GRACE: Duration = Duration::from_millis(300);
    let store = Arc::new(Faulty::sqlite(Duration::from_secs(30)).await);
    let engine = engine_on(
        &(config(&[], "") + "server:\n  run_event_buffer: 16\n"),
        store.clone(),
    )
    .await;
    let (lost, kept) = (new_session(&engine).await, new_session(&engine).await);
    store.lost_ends.lock().unwrap().insert(lost.clone());
    let _runs = [
        stalled_run(&engine, &lost).await,
        stalled_run(&engine, &kept).await,
    ];
    let took = drained(&engine, GRACE).await;
    assert!(
        took < GRACE + Duration::from_secs(3),
        "the drain waited {took:?} for an end that could not be recorded"
    );
    assert_eq!(
        *store.ends.lock().unwrap(),
        [(RunOutcome::Cancelled, "server shutting down".to_string())],
        "the kept run's end"
    );
    assert_eq!(
        store.end_attempts.load(Ordering::SeqCst),
        2,
        "one end asked for per run: the refused one is not asked for again"
    );
}

/// A run whose start was in the store when shutdown began is waited for:
/// the drain returns once its end is recorded. The drain used to see only
/// runs already registered and return at once, leaving the run's row open
/// and its session busy until a reaper ended it after the lease.
#[tokio::test]
async fn a_drain_waits_for_a_run_that_was_starting() {
    let gate = Arc::new(Gate::default());
    let mut store = Faulty::sqlite(Duration::from_secs(30)).await;
    store.begin = Some(gate.clone());
    let store = Arc::new(store);
    let engine = engine_on(&config(&[], ""), store.clone()).await;
    let session = new_session(&engine).await;
    let starting = spawn_start(&engine, &session, "hello", None);
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the start reached the store");
    engine.stop_accepting();
    let drain = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.drain(Duration::from_secs(60)).await })
    };
    // One thread runs every task here: these turns let the drain run
    // until it waits (or returns).
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(
        !drain.is_finished(),
        "the drain returned while a run was starting"
    );
    gate.open.notify_one();
    tokio::time::timeout(PATIENCE, drain)
        .await
        .expect("the drain returned")
        .unwrap();
    // The drain returned: the run's end is recorded.
    let s = store.get_session(&session).await.unwrap();
    assert_eq!(s.active_run, None, "the session is free");
    let transcript = store.transcript(&session).await.unwrap();
    assert_eq!(message_texts(&transcript).len(), 2, "{transcript:?}");
    let run = starting.await.unwrap().expect("the run started");
    let report = run.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
}

/// A start still in the store when the shutdown grace runs out is not
/// left running: the drain cancelled the runs it had, and this one is
/// cancelled as it registers, its end recorded before the drain returns.
#[tokio::test]
async fn a_run_that_starts_after_the_grace_ran_out_is_cancelled_at_once() {
    let (logs, _guard) = support::logwatch::LogWatch::install("hookwire=info");
    let gate = Arc::new(Gate::default());
    let mut store = Faulty::sqlite(Duration::from_secs(30)).await;
    store.begin = Some(gate.clone());
    let store = Arc::new(store);
    // A model that takes a minute: the run would outlive the drain's
    // wind-down unless it is cancelled.
    let yaml = config(&[], "").replace(
        "provider: scripted\n",
        "provider: scripted\n    delay: 60s\n",
    );
    let engine = engine_on(&yaml, store.clone()).await;
    let session = new_session(&engine).await;
    let starting = spawn_start(&engine, &session, "hello", None);
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the start reached the store");
    engine.stop_accepting();
    let drain = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.drain(Duration::from_millis(100)).await })
    };
    tokio::time::timeout(
        PATIENCE,
        logs.wait_for(&["shutdown grace elapsed; cancelling runs"]),
    )
    .await
    .unwrap_or_else(|_| panic!("the grace ran out:\n{}", logs.contents()));
    gate.open.notify_one();
    let run = starting.await.unwrap().expect("the run started");
    let report = finished(run).await;
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert!(
        report.reason.contains("server shutting down"),
        "{}",
        report.reason
    );
    tokio::time::timeout(PATIENCE, drain)
        .await
        .expect("the drain returned")
        .unwrap();
    let s = store.get_session(&session).await.unwrap();
    assert_eq!(s.active_run, None, "the session is free");
}

/// A hook `holder` whose first model_request call says it arrived, then
/// waits until released (later calls go through).
async fn holder() -> (TestHook, Arc<Notify>, Arc<Notify>) {
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (e, r) = (entered.clone(), release.clone());
    let first = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let hook = FnHook::new("holder", &[pb::EventKind::ModelRequest])
        .on_model_request(move |_, _| {
            let (e, r, first) = (e.clone(), r.clone(), first.clone());
            async move {
                if first.swap(false, Ordering::SeqCst) {
                    let released = r.notified();
                    e.notify_one();
                    released.await;
                }
                hookwire::hook_server::Reply::new(pb::ModelRequestVerdict {
                    action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    (hook, entered, release)
}

/// A run on replica A cancelled through replica B, before A's poll brought
/// it the cancel: once CancelRun answered OK, the run starts no tool. A's
/// last write before its tools (the staged turn) used to check only the
/// lease, so the tool ran after the cancel had been answered.
#[tokio::test]
async fn a_cancel_recorded_by_another_replica_stops_the_next_tool_batch() {
    let owner = weather_owner().start().await;
    let (holder, entered, release) = holder().await;
    let mut store = Faulty::sqlite(Duration::from_secs(30)).await;
    store.no_signals = true;
    let store = Arc::new(store);
    let yaml = config(
        &[("holder", &holder.addr, ""), ("owner", &owner.addr, "")],
        "tools: [get_weather]",
    );
    let a = engine_on(&yaml, store.clone()).await;
    a.start_background();
    let b = engine_on(&yaml, store.inner.clone()).await;
    let session = new_session(&a).await;
    let run = a
        .start_run(
            &Principal::anonymous(),
            &session,
            "weather".into(),
            false,
            Default::default(),
            None,
        )
        .await
        .unwrap();
    tokio::time::timeout(PATIENCE, entered.notified())
        .await
        .expect("the model_request hook was called");
    b.cancel_run(&Principal::anonymous(), &run.run_id)
        .await
        .expect("B records the cancel");
    release.notify_one();
    let report = finished(run).await;
    assert!(
        owner.hook.tool_calls.lock().unwrap().is_empty(),
        "no tool started after the cancel was answered"
    );
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert_eq!(report.reason, "cancelled by client");
    assert_eq!(store.get_session(&session).await.unwrap().active_run, None);
    a.stop_background().await;
}

/// A cancel answered while the run was starting (in the store, not yet on
/// this replica) stops it before its first hook. The cancel found no run
/// here to stop and its wake-up was dropped, so the run went on until a
/// poll, or, between polls, to its tools.
#[tokio::test]
async fn a_cancel_answered_while_the_run_was_starting_stops_it_before_any_hook() {
    let owner = weather_owner().start().await;
    let watch = FnHook::new("watch", &[pb::EventKind::RunStart, pb::EventKind::RunEnd])
        .start()
        .await;
    let gate = Arc::new(Gate::default());
    let store = Faulty::sqlite(Duration::from_secs(30)).await;
    *store.transcript_gate.lock().unwrap() = Some(gate.clone());
    let store = Arc::new(store);
    let yaml = config(
        &[("watch", &watch.addr, ""), ("owner", &owner.addr, "")],
        "tools: [get_weather]",
    );
    // No background work: the poll that would deliver the cancel later
    // does not run, so only the start itself can stop the run.
    let engine = engine_on(&yaml, store.clone()).await;
    let session = new_session(&engine).await;
    let starting = spawn_start(&engine, &session, "weather", None);
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the start reads the transcript");
    let run_id = store
        .get_session(&session)
        .await
        .unwrap()
        .active_run
        .expect("the run is in the store");
    engine
        .cancel_run(&Principal::anonymous(), &run_id)
        .await
        .expect("the cancel is recorded");
    gate.open.notify_one();
    let run = starting.await.unwrap().expect("the run started");
    let report = finished(run).await;
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert_eq!(report.reason, "cancelled by client");
    tokio::time::timeout(PATIENCE, watch.hook.wait_for("run_end"))
        .await
        .expect("run_end is observed");
    assert_eq!(
        watch.hook.seen_kinds(),
        ["run_end"],
        "no hook before the stop"
    );
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
}

/// A caller that leaves while its run is starting (tonic drops the handler
/// when the client's deadline passes or it disconnects; here the start is
/// dropped while it reads the transcript, after the store began the run)
/// does not leave the session busy: the start completes, the run nobody
/// hears ends cancelled, and the next run starts. The run used to stay
/// active in the store with no task behind it until its lease expired.
#[tokio::test]
async fn a_run_whose_caller_left_while_it_was_starting_frees_its_session() {
    // A caller that left at its own deadline is told from one that left
    // before it (the reason is decided as the start is dropped).
    let cases = [
        (None, "client disconnected"),
        (
            CallerDeadline::after(Duration::from_secs(30)),
            "client disconnected",
        ),
        (
            CallerDeadline::after(Duration::from_millis(300)),
            "client disconnected at its deadline (grpc-timeout 300ms)",
        ),
    ];
    for (caller, reason) in cases {
        let deadline = std::time::Instant::now() + Duration::from_millis(300);
        let gate = Arc::new(Gate::default());
        let store = Faulty::sqlite(Duration::from_secs(30)).await;
        *store.transcript_gate.lock().unwrap() = Some(gate.clone());
        let store = Arc::new(store);
        let engine = engine_on(&config(&[], ""), store.clone()).await;
        let session = new_session(&engine).await;
        let abandoned = spawn_start(&engine, &session, "hello", caller);
        tokio::time::timeout(PATIENCE, gate.entered.notified())
            .await
            .expect("the start reads the transcript");
        assert!(
            store
                .get_session(&session)
                .await
                .unwrap()
                .active_run
                .is_some(),
            "the store began the run"
        );
        if reason.contains("deadline") {
            // The caller leaves at its deadline, as tonic drops a handler.
            tokio::time::sleep_until(deadline.into()).await;
        }
        abandoned.abort();
        assert!(matches!(abandoned.await, Err(e) if e.is_cancelled()));
        gate.open.notify_one();
        tokio::time::timeout(PATIENCE, store.ended.notified())
            .await
            .expect("the abandoned run's end was recorded");
        assert_eq!(
            store.ends.lock().unwrap().as_slice(),
            [(RunOutcome::Cancelled, reason.to_string())]
        );
        let next = start(&engine, &session, "hello again")
            .await
            .expect("the session is free");
        let report = finished(next).await;
        assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    }
}

/// A DeleteSession whose caller left while the store recorded the cancel
/// of the session's run (the handler dropped at its deadline) still stops
/// the run and fires session_end. The run used to go on (its replica was
/// never told) and session_end never fired: the session's row was gone,
/// so no TTL sweep would find it either.
#[tokio::test]
async fn a_delete_whose_caller_left_still_stops_the_run_and_ends_the_session() {
    let watch = FnHook::new("watch", &[pb::EventKind::SessionEnd])
        .start()
        .await;
    let gate = Arc::new(Gate::default());
    let store = Faulty::sqlite(Duration::from_secs(30)).await;
    *store.cancel_gate.lock().unwrap() = Some(gate.clone());
    let store = Arc::new(store);
    // A model that takes a minute: the run is in flight when the session
    // goes, and would outlast the test unless it is cancelled.
    let yaml = config(&[("watch", &watch.addr, "")], "").replace(
        "provider: scripted\n",
        "provider: scripted\n    delay: 60s\n",
    );
    let engine = engine_on(&yaml, store.clone()).await;
    let session = new_session(&engine).await;
    let run = start(&engine, &session, "hello").await.unwrap();
    let deleting = {
        let (engine, session) = (engine.clone(), session.clone());
        tokio::spawn(async move {
            engine
                .delete_session(&Principal::anonymous(), &session)
                .await
        })
    };
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the delete records the run's cancel");
    deleting.abort();
    assert!(matches!(deleting.await, Err(e) if e.is_cancelled()));
    gate.open.notify_one();
    let report = finished(run).await;
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert_eq!(report.reason, "session deleted");
    tokio::time::timeout(PATIENCE, watch.hook.wait_for("session_end"))
        .await
        .expect("session_end fired");
    let ends: Vec<String> = watch
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
    assert_eq!(ends, ["deleted"]);
    assert!(matches!(
        store.get_session(&session).await,
        Err(StoreError::SessionNotFound(_))
    ));
}

/// A CancelRun whose caller leaves while the store records it: the cancel
/// was rolled back with the dropped call, so no poll could deliver it, and
/// the run went on as if never cancelled.
#[tokio::test]
async fn a_cancel_whose_caller_left_while_it_was_recorded_still_stops_the_run() {
    let gate = Arc::new(Gate::default());
    let store = Faulty::sqlite(Duration::from_secs(30)).await;
    *store.cancel_gate.lock().unwrap() = Some(gate.clone());
    let store = Arc::new(store);
    // A model that takes a minute: only the cancel ends the run in time.
    let yaml = config(&[], "").replace(
        "provider: scripted\n",
        "provider: scripted\n    delay: 60s\n",
    );
    let engine = engine_on(&yaml, store.clone()).await;
    let session = new_session(&engine).await;
    let run = start(&engine, &session, "hello").await.unwrap();
    let cancelling = {
        let (engine, run_id) = (engine.clone(), run.run_id.clone());
        tokio::spawn(async move { engine.cancel_run(&Principal::anonymous(), &run_id).await })
    };
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the cancel reaches the store");
    cancelling.abort();
    assert!(matches!(cancelling.await, Err(e) if e.is_cancelled()));
    gate.open.notify_one();
    let report = finished(run).await;
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert_eq!(report.reason, "cancelled by client");
}

/// Quotas are per principal; `max_concurrent_runs` is what the tests below
/// reach.
fn with_quotas(yaml: &str, quotas: &str) -> String {
    format!("{yaml}quotas: {quotas}\n")
}

/// Two creations at once on one replica, one slot left: the one whose
/// count was read before the other was recorded, and whose check came
/// after the other gave its slot back, saw neither and took a slot past
/// the limit.
#[tokio::test]
async fn concurrent_creations_on_one_replica_cannot_overshoot_a_quota() {
    let gate = Arc::new(Gate::default());
    let store = Faulty::sqlite(Duration::from_secs(30)).await;
    *store.usage_gate.lock().unwrap() = Some(gate.clone());
    let store = Arc::new(store);
    let engine = engine_on(
        &with_quotas(&config(&[], ""), "{max_sessions: 1}"),
        store.clone(),
    )
    .await;
    let late = {
        let engine = engine.clone();
        tokio::spawn(async move { new_session_of(&engine).await })
    };
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the first creation read the count");
    new_session_of(&engine)
        .await
        .expect("the other creation takes the slot");
    gate.open.notify_one();
    let e = late.await.unwrap().expect_err("the slot was taken");
    assert!(
        e.to_string().contains("quota `max_sessions` reached"),
        "{e}"
    );
}

/// Two starts on one idle session at once, under a run quota: one takes
/// the session, and the other is busy (FAILED_PRECONDITION: wait for the
/// run), not over the quota the first one's slot filled.
#[tokio::test]
async fn a_second_start_on_a_session_being_started_is_busy_not_over_quota() {
    let gate = Arc::new(Gate::default());
    let mut store = Faulty::sqlite(Duration::from_secs(30)).await;
    store.begin = Some(gate.clone());
    let store = Arc::new(store);
    let engine = engine_on(
        &with_quotas(&config(&[], ""), "{max_concurrent_runs: 1}"),
        store.clone(),
    )
    .await;
    let session = new_session(&engine).await;
    let first = spawn_start(&engine, &session, "hello", None);
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the first start reaches the store");
    let second = start(&engine, &session, "hello too").await;
    let Err(e) = second else {
        panic!("two runs started in one session")
    };
    assert!(
        matches!(e, EngineError::Store(StoreError::Busy { .. })),
        "{e}"
    );
    gate.open.notify_one();
    let run = first.await.unwrap().expect("the first start goes on");
    let report = finished(run).await;
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
}

/// The store began the run, but its answer never reached the start: the
/// caller left during the call, or the connection was lost with the
/// commit's answer. Nothing then recorded the run's end, and its session
/// stayed busy until the lease expired and a reaper came round.
#[tokio::test]
async fn a_run_begun_in_the_store_whose_answer_was_lost_frees_its_session() {
    let gate = Arc::new(Gate::default());
    let store = Faulty::sqlite(Duration::from_secs(30)).await;
    *store.begun_gate.lock().unwrap() = Some(gate.clone());
    let store = Arc::new(store);
    let engine = engine_on(&config(&[], ""), store.clone()).await;
    let session = new_session(&engine).await;
    // The caller leaves while the store's answer is on its way.
    let abandoned = spawn_start(&engine, &session, "hello", None);
    tokio::time::timeout(PATIENCE, gate.entered.notified())
        .await
        .expect("the store began the run");
    abandoned.abort();
    assert!(matches!(abandoned.await, Err(e) if e.is_cancelled()));
    tokio::time::timeout(PATIENCE, store.ended.notified())
        .await
        .expect("the abandoned run's end was recorded");
    assert!(store
        .get_session(&session)
        .await
        .unwrap()
        .active_run
        .is_none());
    // The answer is lost with the connection.
    store.begin_answer_lost.store(true, Ordering::SeqCst);
    let e = start(&engine, &session, "hello again")
        .await
        .err()
        .expect("the start saw the store unavailable");
    assert!(
        matches!(e, EngineError::Store(StoreError::Unavailable(_))),
        "{e}"
    );
    tokio::time::timeout(PATIENCE, store.ended.notified())
        .await
        .expect("the run the store began anyway was ended");
    assert_eq!(
        store.ends.lock().unwrap().as_slice(),
        [
            (RunOutcome::Cancelled, "client disconnected".to_string()),
            (
                RunOutcome::Cancelled,
                "the store's answer to the run's start was lost".to_string()
            )
        ]
    );
    assert!(store
        .get_session(&session)
        .await
        .unwrap()
        .active_run
        .is_none());
}

/// A closed hook's protocol fault that reaches hookwire while the run's end
/// is being recorded (here a duplicate `turn_end` verdict) no longer
/// changes the outcome the client is told: the store recorded `completed`,
/// and so the report says. The run's last check used to come after the
/// end was recorded, and told the client `hook_failed` for a run the store
/// holds as `completed`.
#[tokio::test]
async fn a_fault_seen_while_the_end_is_recorded_leaves_the_outcome_the_store_holds() {
    let (logs, _guard) = support::logwatch::LogWatch::install("info,hookwire::hooks::stream=debug");
    let release = Arc::new(Notify::new());
    let mut fault = FaultHook::new(pb::EventKind::TurnEnd, Misbehave::Duplicate, &[]);
    fault.release = Some(release.clone());
    let (addr, _t) = fault.start().await;
    let gate = Arc::new(Gate::default());
    let store = Faulty::sqlite(Duration::from_secs(30)).await;
    *store.end_gate.lock().unwrap() = Some(gate.clone());
    let store = Arc::new(store);
    let engine = engine_on(&config(&[("fault", &addr, "")], ""), store.clone()).await;
    let session = new_session(&engine).await;
    let entered = gate.entered.notified();
    let run = start(&engine, &session, "hi").await.unwrap();
    tokio::time::timeout(PATIENCE, entered)
        .await
        .expect("the run's end is being recorded");
    // Now the hook's second verdict for turn_end goes out, and hookwire's
    // stream reader takes it for the fault it is.
    release.notify_one();
    tokio::time::timeout(
        PATIENCE,
        logs.wait_for(&["hook stream fault", "hook=fault", "class=duplicate"]),
    )
    .await
    .expect("the duplicate was read");
    gate.open.notify_one();
    let report = finished(run).await;
    let recorded = store.ends.lock().unwrap().clone();
    assert_eq!(recorded.len(), 1, "{recorded:?}");
    assert_eq!(
        (report.outcome, report.reason.clone()),
        recorded[0],
        "the client is told what the store holds"
    );
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    // Still counted and logged, once, as a fault after the run's last step.
    tokio::time::timeout(
        PATIENCE,
        logs.wait_for(&["WARN", "hook=fault", "class=duplicate", "outcome stands"]),
    )
    .await
    .expect("the fault is logged");
}

/// An Invoke caller that leaves while its run waits for an approval
/// withdraws the request in the store at once, as a CancelRun does: an
/// approver answering on another replica before the run's end is recorded
/// is told NOT_FOUND. The request used to stay pending in the store until
/// the end was recorded, and such an answer was told OK for a call that
/// never runs.
#[tokio::test]
async fn a_gone_callers_approval_is_withdrawn_in_the_store_before_its_end() {
    let owner = weather_owner().start().await;
    let (asker, mut asked) = routing_asker("check the weather?", 60_000);
    let asker = asker.start().await;
    let store = Arc::new(Faulty::sqlite(Duration::from_secs(30)).await);
    let gate = Arc::new(Gate::default());
    *store.end_gate.lock().unwrap() = Some(gate.clone());
    let engine = engine_on(
        &config(
            &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
            "tools: [get_weather]",
        ),
        store.clone(),
    )
    .await;
    let session = new_session(&engine).await;
    let recorded = store.approval_recorded.notified();
    let run = start(&engine, &session, "weather").await.unwrap();
    tokio::time::timeout(PATIENCE, recorded)
        .await
        .expect("the approval request is recorded");
    let routed = asked.try_recv().expect("the hook asked");
    let ending = gate.entered.notified();
    let withdrawn = store.cancel_recorded.notified();
    engine.client_gone(&run.run_id, "client disconnected");
    tokio::time::timeout(PATIENCE, ending)
        .await
        .expect("the run's end is being recorded");
    tokio::time::timeout(PATIENCE, withdrawn)
        .await
        .expect("the gone client's run is cancelled in the store");
    // What another replica's ResolveApproval does, while the end waits.
    let answered = store
        .resolve_approval(
            &routed.run_id,
            &routed.call_id,
            &Decision {
                approve: true,
                note: String::new(),
            },
        )
        .await;
    assert!(
        matches!(answered, Err(StoreError::ApprovalNotPending { .. })),
        "{answered:?}"
    );
    gate.open.notify_one();
    let report = finished(run).await;
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
}
