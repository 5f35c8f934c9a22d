//! Figure 8: what the session store costs a run. The engine in-process (no
//! gRPC, so the store is most of what differs), a one-turn run, timed from
//! `start_run` to the recorded end:
//! - per run on SQLite and Postgres against the memory store, same rounds
//!   (the scripted model);
//! - per run on sessions holding 1 000 prior messages against fresh ones,
//!   twice: with a model that reads only the last message (`lean`: the
//!   model payload left out, target ≤ 1.2×), and with the scripted model,
//!   which walks the whole history it is sent (numbering its turn,
//!   estimating tokens) as a real provider encodes it: that part grows
//!   with the session by nature;
//! - store writes (transactions) per run and messages read from the store
//!   per run, counted by a wrapper;
//! - a quota check (`owner_usage`, limits of 100) for a principal that
//!   keeps 5 000 sessions against one that keeps 50, on SQLite and
//!   Postgres (vacuumed and analyzed after the fill): it reads no further
//!   than the limit, target ≤ 2×.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hookwire::agent::approvals::Decision;
use hookwire::config::{Config, StoreSetting};
use hookwire::engine::{Engine, RunHandle};
use hookwire::message::Message;
use hookwire::model::{
    BoxFuture, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse,
};
use hookwire::session::Session;
use hookwire::store::{
    self, ClaimedRun, NewSession, RunEnd, RunLease, SessionFilter, SessionPage, SessionStore,
    Signal, StoreError, StoreOptions,
};
use tokio::sync::broadcast;

use crate::report::{Row, Target};
use crate::stats::Spread;
use crate::Plan;

#[path = "../support/postgres.rs"]
#[allow(dead_code)]
pub mod postgres;

const CONFIG: &str = r#"
models:
  - name: m
    provider: scripted
    rules:
      - text: "noted: {{last_user}}"
  - name: lean
    provider: scripted
agents:
  - name: solo
    model: m
  - name: lean
    model: lean
"#;

/// A model whose work does not depend on the history it is sent: it
/// answers from the last message only. What a run on a long session costs
/// with it is hookwire's own part (store, transcript, requests), without
/// the model payload.
struct LastMessageModel;

impl ModelProvider for LastMessageModel {
    fn provider_name(&self) -> &'static str {
        "bench"
    }
    fn model_name(&self) -> &str {
        "lean"
    }
    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        _on_delta: DeltaSink<'a>,
    ) -> BoxFuture<'a, Result<ModelResponse, ModelError>> {
        let last = request
            .history
            .last()
            .map(Message::text)
            .unwrap_or_default();
        Box::pin(async move {
            Ok(ModelResponse {
                message: Some(Message::assistant_text(format!("noted: {last}"))),
                finish_reason: "stop".into(),
                ..Default::default()
            })
        })
    }
}

const PRIOR: usize = 1000;

/// Counts the store's writes (each one transaction) and the messages it
/// reads back.
struct Counting {
    inner: Arc<dyn SessionStore>,
    writes: AtomicU64,
    read: AtomicU64,
}

impl Counting {
    fn w(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait::async_trait]
impl SessionStore for Counting {
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
        window: std::time::Duration,
        cap: u64,
    ) -> Result<store::OwnerUsage, StoreError> {
        self.inner.owner_usage(owner, window, cap).await
    }
    async fn delete_session(&self, id: &str) -> Result<Session, StoreError> {
        self.inner.delete_session(id).await
    }
    async fn transcript(&self, id: &str) -> Result<Vec<Message>, StoreError> {
        let t = self.inner.transcript(id).await?;
        self.read.fetch_add(t.len() as u64, Ordering::Relaxed);
        Ok(t)
    }
    async fn transcript_after(&self, id: &str, from: u64) -> Result<Vec<Message>, StoreError> {
        let t = self.inner.transcript_after(id, from).await?;
        self.read.fetch_add(t.len() as u64, Ordering::Relaxed);
        Ok(t)
    }
    async fn begin_run(&self, s: &str, r: &str, rep: &str) -> Result<RunLease, StoreError> {
        self.w();
        self.inner.begin_run(s, r, rep).await
    }
    async fn renew(&self, l: &RunLease) -> Result<(), StoreError> {
        self.w();
        self.inner.renew(l).await
    }
    async fn renew_all(&self, l: &[RunLease]) -> Result<Vec<bool>, StoreError> {
        self.w();
        self.inner.renew_all(l).await
    }
    async fn append(&self, l: &RunLease, m: &[Message]) -> Result<(), StoreError> {
        self.w();
        self.inner.append(l, m).await
    }
    async fn stage_turn(&self, l: &RunLease, t: Option<&Message>) -> Result<(), StoreError> {
        self.w();
        self.inner.stage_turn(l, t).await
    }
    async fn check_run(&self, l: &RunLease) -> Result<(), StoreError> {
        self.inner.check_run(l).await
    }
    async fn end_run(&self, l: &RunLease, m: &[Message], e: &RunEnd) -> Result<(), StoreError> {
        self.w();
        self.inner.end_run(l, m, e).await
    }
    async fn request_approval(&self, l: &RunLease, c: &str) -> Result<(), StoreError> {
        self.w();
        self.inner.request_approval(l, c).await
    }
    async fn resolve_approval(&self, r: &str, c: &str, d: &Decision) -> Result<(), StoreError> {
        self.w();
        self.inner.resolve_approval(r, c, d).await
    }
    async fn expire_approval(&self, l: &RunLease, c: &str) -> Result<Option<Decision>, StoreError> {
        self.w();
        self.inner.expire_approval(l, c).await
    }
    async fn request_cancel(&self, r: &str, why: &str) -> Result<(), StoreError> {
        self.w();
        self.inner.request_cancel(r, why).await
    }
    async fn signals(
        &self,
        rep: &str,
        waiting: &[(String, String)],
    ) -> Result<Vec<Signal>, StoreError> {
        self.inner.signals(rep, waiting).await
    }
    async fn claim_expired(&self, rep: &str, n: u32) -> Result<Vec<ClaimedRun>, StoreError> {
        self.inner.claim_expired(rep, n).await
    }
    async fn expire_sessions(&self, ttl: Duration, n: u32) -> Result<Vec<Session>, StoreError> {
        self.inner.expire_sessions(ttl, n).await
    }
    fn subscribe(&self) -> broadcast::Receiver<String> {
        self.inner.subscribe()
    }
    async fn close(&self) {
        self.inner.close().await
    }
}

struct Bench {
    engine: Arc<Engine>,
    store: Arc<Counting>,
}

async fn bench(setting: &StoreSetting) -> Bench {
    let config = Config::parse(CONFIG, "bench").expect("bench config");
    let inner = store::open(setting, StoreOptions::default())
        .await
        .expect("store opens");
    let store = Arc::new(Counting {
        inner,
        writes: AtomicU64::new(0),
        read: AtomicU64::new(0),
    });
    let mut models = hookwire::server::build_models(&config).expect("models");
    models.insert("lean".into(), Arc::new(LastMessageModel));
    let inst = hookwire::telemetry::Instruments::new(&config.telemetry);
    let engine = Arc::new(Engine::new(config, models, inst, store.clone()).expect("engine"));
    Bench { engine, store }
}

/// The caller of the figure's sessions and runs (no quotas configured, so
/// the store is not asked for counts).
fn bench_principal() -> hookwire::auth::Principal {
    hookwire::auth::Principal::new("bench", Vec::<String>::new())
}

async fn sessions(b: &Bench, agent: &str, n: usize, prior: usize) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        let s = b
            .engine
            .create_session(&bench_principal(), agent, vec![], Default::default())
            .await
            .expect("session");
        if prior > 0 {
            // History written straight through the store, as earlier runs
            // would have left it.
            let st = &b.store.inner;
            let seed = format!("seed-{}", s.id);
            let lease = st.begin_run(&s.id, &seed, "bench").await.unwrap();
            let msgs: Vec<Message> = (0..prior)
                .map(|i| {
                    if i % 2 == 0 {
                        Message::user(format!("question {i}: what is the weather like today?"))
                    } else {
                        Message::assistant_text(format!(
                            "answer {i}: sunny, 21 degrees, light wind"
                        ))
                    }
                })
                .collect();
            st.append(&lease, &msgs).await.unwrap();
            st.end_run(&lease, &[], &completed()).await.unwrap();
        }
        out.push(s.id);
    }
    out
}

/// The end of a run written straight through the store.
fn completed() -> RunEnd {
    RunEnd {
        outcome: hookwire::agent::outcome::RunOutcome::Completed,
        reason: String::new(),
        usage: Default::default(),
        turns: 0,
    }
}

/// Per run, over `runs` runs spread over `sessions`: mean µs, store writes,
/// messages read from the store.
async fn per_run(b: &Bench, sessions: &[String], runs: usize) -> (f64, f64, f64) {
    let writes = b.store.writes.load(Ordering::Relaxed);
    let read = b.store.read.load(Ordering::Relaxed);
    let started = Instant::now();
    for i in 0..runs {
        let s = &sessions[i % sessions.len()];
        let RunHandle { events, task, .. } = b
            .engine
            .start_run(
                &bench_principal(),
                s,
                "hello there".into(),
                false,
                Default::default(),
                None,
            )
            .await
            .expect("run starts");
        let report = task.await.expect("run task");
        drop(events);
        assert_eq!(
            report.outcome,
            hookwire::agent::outcome::RunOutcome::Completed,
            "{}",
            report.reason
        );
    }
    let us = started.elapsed().as_secs_f64() * 1e6 / runs as f64;
    let w = (b.store.writes.load(Ordering::Relaxed) - writes) as f64 / runs as f64;
    let r = (b.store.read.load(Ordering::Relaxed) - read) as f64 / runs as f64;
    (us, w, r)
}

/// One engine's sessions: fresh and long, per model.
struct Sets {
    fresh: Vec<String>,
    long: Vec<String>,
    lean_fresh: Vec<String>,
    lean_long: Vec<String>,
}

pub async fn measure(plan: &Plan) -> Vec<Row> {
    let sqlite_dir = tempfile::tempdir().expect("temp dir");
    let engines = [
        ("memory", StoreSetting::Memory),
        (
            "SQLite",
            StoreSetting::Sqlite {
                path: sqlite_dir.path().join("bench.db"),
            },
        ),
        (
            "Postgres",
            StoreSetting::parse(&postgres::database(), false).expect("pg url"),
        ),
    ];
    let pools = if plan.full { 20 } else { 2 };
    let mut benches = Vec::new();
    for (name, setting) in &engines {
        let b = bench(setting).await;
        let sets = Sets {
            fresh: sessions(&b, "solo", plan.runs, 0).await,
            long: sessions(&b, "solo", pools, PRIOR).await,
            lean_fresh: sessions(&b, "lean", plan.runs, 0).await,
            lean_long: sessions(&b, "lean", pools, PRIOR).await,
        };
        // One warm-up pass: a replica has read its sessions before (a
        // first run on a session reads its whole transcript once).
        for set in [&sets.long, &sets.lean_long] {
            per_run(&b, set, set.len()).await;
        }
        benches.push((*name, b, sets));
    }
    // Per engine, per round.
    let n = benches.len();
    let (mut fresh_us, mut long_us) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let (mut lean_fresh_us, mut lean_long_us) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    let (mut writes, mut reads) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for _ in 0..plan.rounds {
        for (i, (name, b, sets)) in benches.iter().enumerate() {
            let (f, w, _) = per_run(b, &sets.fresh, plan.runs).await;
            let (l, _, r) = per_run(b, &sets.long, plan.runs).await;
            let (lf, _, _) = per_run(b, &sets.lean_fresh, plan.runs).await;
            let (ll, _, _) = per_run(b, &sets.lean_long, plan.runs).await;
            if plan.verbose {
                eprintln!(
                    "  store {name}: scripted fresh {f:.1} us, {PRIOR} prior {l:.1} us; \
                     lean fresh {lf:.1} us, {PRIOR} prior {ll:.1} us; \
                     {w:.2} writes/run, {r:.1} messages read/run on long sessions"
                );
            }
            fresh_us[i].push(f);
            long_us[i].push(l);
            lean_fresh_us[i].push(lf);
            lean_long_us[i].push(ll);
            writes[i].push(w);
            reads[i].push(r);
        }
    }
    let ratio =
        |a: &[f64], b: &[f64]| -> Vec<f64> { a.iter().zip(b).map(|(x, y)| x / y).collect() };
    let mem = Spread::of(&fresh_us[0]);
    let mut rows = vec![Row::new(
        8,
        "run, memory store (in-process, 1 turn)",
        "us",
        mem,
    )];
    for i in 1..n {
        rows.push(
            Row::new(
                8,
                format!("run, {} store", benches[i].0),
                "us",
                Spread::of(&fresh_us[i]),
            )
            .against("memory store", mem, &ratio(&fresh_us[i], &fresh_us[0])),
        );
    }
    for i in 0..n {
        rows.push(
            Row::new(
                8,
                format!(
                    "run on a {PRIOR}-message session, {}, model payload left out",
                    benches[i].0
                ),
                "us",
                Spread::of(&lean_long_us[i]),
            )
            .against(
                "fresh session",
                Spread::of(&lean_fresh_us[i]),
                &ratio(&lean_long_us[i], &lean_fresh_us[i]),
            )
            .target(Target::ratio_at_most(1.2)),
        );
    }
    for i in 0..n {
        rows.push(
            Row::new(
                8,
                format!(
                    "run on a {PRIOR}-message session, {}, scripted model (walks the history)",
                    benches[i].0
                ),
                "us",
                Spread::of(&long_us[i]),
            )
            .against(
                "fresh session",
                Spread::of(&fresh_us[i]),
                &ratio(&long_us[i], &fresh_us[i]),
            ),
        );
    }
    for i in 0..n {
        rows.push(Row::new(
            8,
            format!("store writes per 1-turn run, {}", benches[i].0),
            "writes",
            Spread::of(&writes[i]),
        ));
    }
    for i in 0..n {
        rows.push(Row::new(
            8,
            format!(
                "messages read from the store per run on a {PRIOR}-message session, {}",
                benches[i].0
            ),
            "messages",
            Spread::of(&reads[i]),
        ));
    }
    for ((name, b, _), (_, setting)) in benches.iter().zip(&engines).skip(1) {
        rows.push(quota_check(plan, name, setting, &b.store.inner).await);
    }
    for (_, b, _) in &benches {
        b.store.close().await;
    }
    rows
}

/// Sessions the small and the large principal of the quota rows keep (the
/// smoke pass: 500).
const QUOTA_SMALL: usize = 50;
const QUOTA_LARGE: usize = 5_000;
/// The limit the checks count to (the engine passes its largest one).
const QUOTA_LIMIT: u64 = 100;

/// A quota check's cost for a principal keeping [`QUOTA_LARGE`] sessions
/// of one run each, all started within the window (so each count meets
/// the limit), against one keeping [`QUOTA_SMALL`]: checks of the two
/// alternate, per round the median of each.
async fn quota_check(
    plan: &Plan,
    engine: &str,
    setting: &StoreSetting,
    st: &Arc<dyn SessionStore>,
) -> Row {
    let large_n = if plan.full { QUOTA_LARGE } else { 500 };
    for (owner, n) in [("quota-small", QUOTA_SMALL), ("quota-large", large_n)] {
        for i in 0..n {
            let id = format!("{owner}-{i}");
            st.create_session(&NewSession {
                id: id.clone(),
                agent: "solo".into(),
                owner: owner.into(),
                extra_hooks: vec![],
                metadata: Default::default(),
            })
            .await
            .expect("session");
            let lease = st
                .begin_run(&id, &format!("{id}-run"), "bench")
                .await
                .unwrap();
            st.end_run(&lease, &[], &completed()).await.unwrap();
        }
    }
    // Vacuumed, as kept sessions are by the time a replica counts them:
    // whether autovacuum has visited a database this fresh depends on what
    // else it is doing (after figure 9's databases, it had not), and until
    // it has, every count also visits the dead row versions that each
    // run's start and end left, which made the large check 2.4× the small
    // one (BENCHMARKS.md, "The fixes after efdf4f5").
    if let StoreSetting::Postgres { url, .. } = setting {
        postgres::server().query(url, "VACUUM ANALYZE");
    }
    let checks = if plan.full { 200 } else { 20 };
    let (mut small, mut large) = (Vec::new(), Vec::new());
    for _ in 0..plan.rounds {
        let (mut s, mut l) = (Vec::new(), Vec::new());
        for _ in 0..checks {
            for (owner, into) in [("quota-small", &mut s), ("quota-large", &mut l)] {
                let t = Instant::now();
                let u = st
                    .owner_usage(owner, Duration::from_secs(60), QUOTA_LIMIT)
                    .await
                    .expect("usage");
                into.push(t.elapsed().as_secs_f64() * 1e6);
                std::hint::black_box(u);
            }
        }
        small.push(Spread::of(&s).median);
        large.push(Spread::of(&l).median);
    }
    let ratios: Vec<f64> = large.iter().zip(&small).map(|(l, s)| l / s).collect();
    Row::new(
        8,
        format!("quota check, a principal keeping {large_n} sessions, {engine}"),
        "us",
        Spread::of(&large),
    )
    .against(
        format!("one keeping {QUOTA_SMALL}"),
        Spread::of(&small),
        &ratios,
    )
    .target(Target::ratio_at_most(2.0))
}
