//! Figure 9: ten thousand runs in flight on one replica. A separate
//! `hookwire serve` process (so its RSS, file descriptors and tasks are its
//! own), every run with two blocking hooks (a Rust hook in this process and
//! the Go example as a process) on its four events, the scripted model
//! answering after a delay as a real model would. All runs are started at
//! once; while they wait on the model, probe runs (no delay) measure what a
//! hook call adds under that load, against the floor of the same round,
//! against the same probes with nothing in flight, and against what the
//! two hooks cost without hookwire (the floor for the Rust hook, a direct
//! round trip to the Go one: medians averaged, so an estimate).
//!
//! Two latency figures: over every probe (while the runs start, wait and
//! end), and over the probes made while every run waits on the model (each
//! had its hook calls before the model, none has ended): the load of ten
//! thousand held streams without the burst of their start. With a short
//! model delay there may be no such moment (starting them all takes longer
//! than the delay); the probe count in the row says how many there were.
//!
//! Series: the default store (SQLite, one connection) with a 2 s and a 20 s
//! model, and a throwaway PostgreSQL (the replicas' store, a pool of
//! connections) with a 2 s model.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::floor::Floor;
use crate::go::GoHook;
use crate::hook::{self, Steady};
use crate::memory::{self, rss_bytes, settled_rss};
use crate::report::{Row, Target};
use crate::service;
use crate::stats::{micros, quantile, Spread};
use crate::Plan;

const KIB: f64 = 1024.0;
const EVENTS: &str = "[run_start, model_request, model_response, turn_end]";
/// The share of a run's hook calls made before the model answers:
/// `run_start` and `model_request`, two of [`EVENTS`]' four.
const PRE_MODEL_SHARE: f64 = 0.5;
/// What a run holds: figure 6's per-run target, for a run with one hook.
const RSS_TARGET_KIB: f64 = 64.0;
/// Connections are shared: descriptors must not grow with runs.
const FD_TARGET: f64 = 0.01;

fn yaml(rust: &str, go: &str, delay: Duration) -> String {
    format!(
        r#"models:
  - name: m
    provider: scripted
    rules:
      - when: {{ last_user_contains: "hold" }}
        text: "held"
        delay: {delay}ms
      - text: "You said: {{{{last_user}}}}"
hooks:
  - name: rust
    endpoint: {rust}
    events: {EVENTS}
    timeout: 120s
  - name: go
    endpoint: {go}
    events: {EVENTS}
    timeout: 120s
agents:
  - name: many
    model: m
    hooks: [rust, go]
    event_budget: 120s
  - name: bare
    model: m
"#,
        delay = delay.as_millis()
    )
}

fn fds(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as f64)
        .unwrap_or(f64::NAN)
}

async fn gauge(admin: std::net::SocketAddr, name: &str) -> f64 {
    service::metric_sum(&service::metrics(admin).await, name, &[])
}

/// One round's figures.
struct Round {
    completed: f64,
    peak: f64,
    rss_kib: f64,
    fds: f64,
    tasks: f64,
    /// Added latency per hook call (µs), p50 and p99, and the floor's.
    added50: f64,
    added99: f64,
    probe_failures: f64,
    steady50: f64,
    steady99: f64,
    steady_probes: usize,
    idle50: f64,
    idle99: f64,
    floor50: f64,
    floor99: f64,
    /// Round trips from this process straight to the Go hook (µs), p50
    /// and p99: that hook's own cost, without hookwire.
    go50: f64,
    go99: f64,
    probes: usize,
}

/// `store`: a store URL, else the default (SQLite in a fresh directory).
async fn round(
    floor: &Floor,
    plan: &Plan,
    go: &GoHook,
    delay_ms: u64,
    store: Option<&str>,
) -> Round {
    let rust = hook::start(Steady::new("rust", false)).await;
    let delay = Duration::from_millis(delay_ms);
    let mut config = yaml(&rust.addr, &go.addr, delay);
    if let Some(url) = store {
        config = format!("store: {url}\n{config}");
    }
    let server = memory::spawn_with(&config).await;
    let pid = server.child.id().expect("child pid");
    let connections = plan.many_runs.div_ceil(500).clamp(1, 32);
    let mut clients = Vec::new();
    for _ in 0..connections {
        clients.push(service::client(&server.addr).await);
    }
    let c0 = clients[0].clone();

    // Warm every path, and count the hook calls of a probe run.
    let calls = || async {
        service::metric_sum(
            &service::metrics(server.admin).await,
            "hookwire_hook_call_duration_seconds_count",
            &[],
        )
    };
    let warm = service::sessions(&c0, "many", 4).await;
    let before = calls().await;
    for s in &warm {
        let (_, r) = service::invoke(&mut c0.clone(), s, "hi").await;
        service::assert_completed(&r, "warm-up");
    }
    let calls_per_run = (calls().await - before) / warm.len() as f64;
    for s in service::sessions(&c0, "bare", 4).await {
        service::invoke(&mut c0.clone(), &s, "hi").await;
    }

    let sessions = service::sessions(&c0, "many", plan.many_runs).await;
    let probe_hooked = service::sessions(&c0, "many", plan.many_probes).await;
    let probe_bare = service::sessions(&c0, "bare", plan.many_probes).await;
    let idle_n = plan.many_probes.div_ceil(2);
    let idle_sessions = (
        service::sessions(&c0, "many", idle_n).await,
        service::sessions(&c0, "bare", idle_n).await,
    );
    let (rss0, fds0, tasks0) = (
        settled_rss(pid).await,
        fds(pid),
        gauge(server.admin, "hookwire_runtime_alive_tasks").await,
    );
    // The floor of this round, before the load; the same pings to the Go
    // hook (a process of its own, which also writes an audit line per
    // event, as it does for the probes).
    let (floor50, floor99) = round_trip_quantiles(floor, plan.pings).await;
    let (go50, go99) = round_trip_quantiles(&floor.to(go.addr.clone()), plan.pings).await;
    // The same probes with nothing in flight: what the two hooks take
    // themselves (the Go example does more per event than the floor's echo).
    let (mut idle_hooked, mut idle_bare) = (Vec::new(), Vec::new());
    for (h, b) in idle_sessions.0.iter().zip(&idle_sessions.1) {
        let (th, rh) = service::invoke(&mut c0.clone(), h, "hi").await;
        let (tb, rb) = service::invoke(&mut c0.clone(), b, "hi").await;
        service::assert_completed(&rh, "idle probe");
        service::assert_completed(&rb, "idle probe");
        idle_hooked.push(micros(th));
        idle_bare.push(micros(tb));
    }

    // Hook calls once every run has made those before the model.
    let all_waiting = calls().await + plan.many_runs as f64 * calls_per_run * PRE_MODEL_SHARE;
    let finished = Arc::new(AtomicUsize::new(0));
    let runs: Vec<_> = sessions
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let mut c = clients[i % clients.len()].clone();
            let finished = finished.clone();
            tokio::spawn(async move {
                let r = service::invoke_under_load(&mut c, &s, "hold").await.1;
                finished.fetch_add(1, Ordering::SeqCst);
                r
            })
        })
        .collect();
    // Until every run is in flight (or the first ended: the peak is past).
    let want = plan.many_runs as f64;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut peak = 0.0;
    loop {
        let active = gauge(server.admin, "hookwire_active_runs").await;
        if active >= peak {
            peak = active;
        }
        if active >= want || finished.load(Ordering::SeqCst) > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "runs never got in flight");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // What the runs hold: taken again, if there is a quiet phase, once
    // every run waits on the model with both hook streams open (at the
    // peak above, the last runs may not have opened theirs yet).
    let (mut rss1, mut fds1, mut tasks1) = (
        rss_bytes(pid),
        fds(pid),
        gauge(server.admin, "hookwire_runtime_alive_tasks").await,
    );
    let mut held_measured = false;
    let per = |a: f64, b: f64| (b - a) / peak.max(1.0);
    // Probes while the runs are in flight (waiting on the model, then
    // finishing), hooked and bare in turn.
    // A probe that does not complete is counted (and its reason shown),
    // not fatal: the figure must still report what happened.
    let (mut hooked, mut bare) = (Vec::new(), Vec::new());
    let (mut steady_hooked, mut steady_bare) = (Vec::new(), Vec::new());
    // The probes' own hook calls, which the counter also sees.
    let mut probe_calls = 0.0;
    let mut probe_failures = 0.0;
    let completed = |r: &hookwire::pb::RunResult| {
        matches!(
            hookwire::pb::RunOutcome::try_from(r.outcome),
            Ok(hookwire::pb::RunOutcome::Completed)
        )
    };
    for (h, b) in probe_hooked.iter().zip(&probe_bare) {
        if finished.load(Ordering::SeqCst) >= plan.many_runs {
            break;
        }
        let waiting =
            finished.load(Ordering::SeqCst) == 0 && calls().await - probe_calls >= all_waiting;
        if waiting && !held_measured {
            held_measured = true;
            (rss1, fds1, tasks1) = (
                rss_bytes(pid),
                fds(pid),
                gauge(server.admin, "hookwire_runtime_alive_tasks").await,
            );
        }
        let (th, rh) = service::invoke_under_load(&mut c0.clone(), h, "hi").await;
        let (tb, rb) = service::invoke_under_load(&mut c0.clone(), b, "hi").await;
        probe_calls += calls_per_run;
        if completed(&rh) && completed(&rb) {
            hooked.push(micros(th));
            bare.push(micros(tb));
            // Still no run ended: the pair ran wholly in the quiet phase.
            if waiting && finished.load(Ordering::SeqCst) == 0 {
                steady_hooked.push(micros(th));
                steady_bare.push(micros(tb));
            }
        } else {
            if probe_failures == 0.0 {
                eprintln!(
                    "  in-flight: a probe run did not complete: {} / {}",
                    rh.reason, rb.reason
                );
            }
            probe_failures += 1.0;
        }
    }
    let probes = hooked.len();
    let added = |q: f64, h: &mut Vec<f64>, b: &mut Vec<f64>| {
        if h.is_empty() {
            return f64::NAN;
        }
        (quantile(h, q) - quantile(b, q)) / calls_per_run
    };
    let added50 = added(0.5, &mut hooked, &mut bare);
    let added99 = added(0.99, &mut hooked, &mut bare);
    let steady_probes = steady_hooked.len();
    let steady50 = added(0.5, &mut steady_hooked, &mut steady_bare);
    let steady99 = added(0.99, &mut steady_hooked, &mut steady_bare);
    let idle50 = added(0.5, &mut idle_hooked, &mut idle_bare);
    let idle99 = added(0.99, &mut idle_hooked, &mut idle_bare);
    let mut done = 0.0;
    let mut first_failure = None;
    for r in runs {
        let r = r.await.expect("run task");
        if completed(&r) {
            done += 1.0;
        } else {
            first_failure.get_or_insert(r.reason);
        }
    }
    if let Some(why) = first_failure {
        eprintln!(
            "  in-flight: {} of {} runs did not complete; the first: {why}",
            plan.many_runs as f64 - done,
            plan.many_runs
        );
    }
    let completed = done;
    if plan.verbose {
        eprintln!(
            "  in-flight: peak {peak}, completed {completed}; RSS {:.1} -> {:.1} MiB, fds {fds0} -> {fds1}, tasks {tasks0} -> {tasks1}; {probes} probes ({steady_probes} while all wait; {calls_per_run} hook calls each), floor p50 {floor50:.1} p99 {floor99:.1} us, Go hook p50 {go50:.1} p99 {go99:.1} us, idle probes p50 {idle50:.1} p99 {idle99:.1} us",
            rss0 / KIB / KIB,
            rss1 / KIB / KIB
        );
    }
    drop(clients);
    let mut child = server.child;
    let _ = child.kill().await;
    Round {
        completed,
        peak,
        rss_kib: per(rss0, rss1) / KIB,
        fds: per(fds0, fds1),
        tasks: per(tasks0, tasks1),
        added50,
        added99,
        probe_failures,
        steady50,
        steady99,
        steady_probes,
        idle50,
        idle99,
        floor50,
        floor99,
        go50,
        go99,
        probes,
    }
}

/// The rows, or why the figure could not run.
pub async fn measure(floor: &Floor, plan: &Plan) -> Result<Vec<Row>, String> {
    let go = GoHook::start().await?;
    let mut rows = Vec::new();
    for &delay_ms in &plan.many_delays_ms {
        let mut rounds = Vec::new();
        for _ in 0..plan.many_rounds {
            rounds.push(round(floor, plan, &go, delay_ms, None).await);
        }
        rows.extend(series(plan, delay_ms, "", &rounds));
    }
    // The replicas' store: its pool of connections, not SQLite's one, is
    // what a burst of starts queues on (a fresh database per round).
    if let Some(delay_ms) = plan.many_postgres_delay_ms {
        let mut rounds = Vec::new();
        for _ in 0..plan.many_rounds {
            let url = crate::store::postgres::database();
            rounds.push(round(floor, plan, &go, delay_ms, Some(&url)).await);
        }
        rows.extend(series(plan, delay_ms, ", Postgres store", &rounds));
    }
    Ok(rows)
}

/// Hook-call latency rows against the floor of the same rounds: p50
/// (target 1.25×) and p99 (1.5×); `[added p50, floor p50, added p99,
/// floor p99]`, one value per round.
fn against_floor(p50: String, p99: String, v: [&[f64]; 4]) -> [Row; 2] {
    let ratio = |a: &[f64], by: &[f64]| a.iter().zip(by).map(|(a, b)| a / b).collect::<Vec<_>>();
    let [a50, f50, a99, f99] = v;
    [
        Row::new(9, p50, "us", Spread::of(a50))
            .against("floor p50", Spread::of(f50), &ratio(a50, f50))
            .target(Target::ratio_at_most(1.25)),
        Row::new(9, p99, "us", Spread::of(a99))
            .against("floor p99", Spread::of(f99), &ratio(a99, f99))
            .target(Target::ratio_at_most(1.5)),
    ]
}

/// The rows of one series' rounds; `store` names a store other than the
/// default (", Postgres store").
fn series(plan: &Plan, delay_ms: u64, store: &str, rounds: &[Round]) -> Vec<Row> {
    let col = |f: fn(&Round) -> f64| rounds.iter().map(f).collect::<Vec<f64>>();
    let n = plan.many_runs;
    let what = format!(
        "{n} in-flight runs (Rust + Go hook, model delay {} s{store})",
        delay_ms as f64 / 1000.0
    );
    let runs = Spread::of(&[n as f64]);
    let fixed = |v: &[f64], t: f64| v.iter().map(|x| x / t).collect::<Vec<_>>();
    let completed = col(|r| r.completed);
    let peak = col(|r| r.peak);
    let rss = col(|r| r.rss_kib);
    let fds = col(|r| r.fds);
    let tasks = col(|r| r.tasks);
    let (a50, a99, f50, f99) = (
        col(|r| r.added50),
        col(|r| r.added99),
        col(|r| r.floor50),
        col(|r| r.floor99),
    );
    let probes = rounds.iter().map(|r| r.probes).min().unwrap_or(0);
    let mut rows = vec![
        Row::new(
            9,
            format!("{what}: runs completed"),
            "runs",
            Spread::of(&completed),
        )
        .against("runs started", runs, &fixed(&completed, n as f64))
        .target(Target::ratio_at_least(1.0)),
        Row::new(
            9,
            format!("{what}: probe runs that did not complete"),
            "runs",
            Spread::of(&col(|r| r.probe_failures)),
        )
        .target(Target::value_at_most(0.0)),
        Row::new(
            9,
            format!("{what}: peak in flight (hookwire_active_runs)"),
            "runs",
            Spread::of(&peak),
        )
        .against("runs started", runs, &fixed(&peak, n as f64)),
        Row::new(
            9,
            format!("{what}: RSS per in-flight run"),
            "KiB",
            Spread::of(&rss),
        )
        .against(
            "target",
            Spread::of(&[RSS_TARGET_KIB]),
            &fixed(&rss, RSS_TARGET_KIB),
        )
        .target(Target::value_at_most(RSS_TARGET_KIB)),
        Row::new(
            9,
            format!("{what}: file descriptors per in-flight run"),
            "fds",
            Spread::of(&fds),
        )
        .target(Target::value_at_most(FD_TARGET)),
        Row::new(
            9,
            format!("{what}: tokio tasks per in-flight run"),
            "tasks",
            Spread::of(&tasks),
        ),
    ];
    rows.extend(against_floor(
        format!("{what}: added latency p50 per hook call ({probes}+ probe runs)"),
        format!("{what}: added latency p99 per hook call"),
        [&a50, &f50, &a99, &f99],
    ));
    // Only the rounds that had a quiet phase; how many probes it held.
    let quiet: Vec<&Round> = rounds.iter().filter(|r| r.steady_probes > 0).collect();
    let least = quiet.iter().map(|r| r.steady_probes).min().unwrap_or(0);
    rows.push(Row::new(
        9,
        format!("{what}: probe runs made while every run waits on the model"),
        "runs",
        Spread::of(&col(|r| r.steady_probes as f64)),
    ));
    if !quiet.is_empty() {
        let qcol = |f: fn(&Round) -> f64| quiet.iter().map(|r| f(r)).collect::<Vec<f64>>();
        let (s50, s99, q50, q99) = (
            qcol(|r| r.steady50),
            qcol(|r| r.steady99),
            qcol(|r| r.floor50),
            qcol(|r| r.floor99),
        );
        rows.extend(against_floor(
            format!(
                "{what}: added latency p50 per hook call while all wait ({least}+ probes, {} of {} rounds)",
                quiet.len(),
                rounds.len()
            ),
            format!("{what}: added latency p99 per hook call while all wait"),
            [&s50, &q50, &s99, &q99],
        ));
        // What the load itself adds: the same probes, same hooks, same
        // round, with nothing in flight.
        let (i50, i99) = (qcol(|r| r.idle50), qcol(|r| r.idle99));
        let against_nothing = |q: u8| {
            format!(
            "{what}: added latency p{q} per hook call while all wait, against nothing in flight"
        )
        };
        rows.push(versus(against_nothing(50), &s50, "idle probes p50", &i50));
        rows.push(versus(against_nothing(99), &s99, "idle probes p99", &i99));
        // What the two hooks cost without hookwire: the floor's echo for
        // the Rust hook (in this process, so if anything cheaper than
        // hookwire's calls to it from another), a direct round trip for the
        // Go one; a probe run calls each equally often.
        let (g50, g99) = (qcol(|r| r.go50), qcol(|r| r.go99));
        let own = |g: &[f64], f: &[f64]| {
            g.iter()
                .zip(f)
                .map(|(g, f)| (g + f) / 2.0)
                .collect::<Vec<_>>()
        };
        let (o50, o99) = (own(&g50, &q50), own(&g99, &q99));
        let go = |q: u8| format!("{what}: the Go hook's own round trip p{q}, nothing in flight");
        rows.push(versus(go(50), &g50, "floor p50", &q50));
        rows.push(versus(go(99), &g99, "floor p99", &q99));
        let against_own = |q: u8| {
            format!("{what}: added latency p{q} per hook call while all wait, against the hooks' own round trips")
        };
        rows.push(versus(
            against_own(50),
            &s50,
            "mean of floor and Go p50",
            &o50,
        ));
        rows.push(versus(
            against_own(99),
            &s99,
            "mean of floor and Go p99",
            &o99,
        ));
    }
    rows
}

/// An informative row of µs, one value per round, against a baseline of
/// the same rounds (no target).
fn versus(name: String, v: &[f64], baseline: &str, by: &[f64]) -> Row {
    let ratio: Vec<f64> = v.iter().zip(by).map(|(a, b)| a / b).collect();
    Row::new(9, name, "us", Spread::of(v)).against(baseline, Spread::of(by), &ratio)
}

/// p50 and p99 (µs) of `n` sequential round trips on one stream.
async fn round_trip_quantiles(floor: &Floor, n: usize) -> (f64, f64) {
    let mut rtt: Vec<f64> = floor.round_trips(n).await.into_iter().map(micros).collect();
    (quantile(&mut rtt, 0.5), quantile(&mut rtt, 0.99))
}
