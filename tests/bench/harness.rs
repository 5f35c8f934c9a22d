//! `make bench`: hookwire's benchmark harness (a Cargo bench target without
//! libtest). `cargo bench --bench hookwire` passes `--bench` and gets the
//! full run, a table and `target/bench/results.json`; `cargo test
//! --all-targets` runs this binary without it, and gets a smoke pass of a
//! few seconds with tiny counts, so the harness cannot rot. Timing targets
//! are judged only in the full run, never in tests.
#![forbid(unsafe_code)]

mod fanout;
mod floor;
mod go;
mod hook;
mod inflight;
mod instructions;
mod machine;
mod memory;
mod orchestrator;
mod per_event;
mod profile;
mod python;
mod remote;
mod report;
mod rig;
mod runtime;
mod service;
mod stats;
mod store;
mod throughput;

/// The allocator `hookwire serve` ships with (src/main.rs), so the figures
/// measured in this process are the binary's.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::time::Instant;

use hookwire::telemetry::{LogFormat, Telemetry, TelemetryOptions};
use serde::Serialize;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

/// How much of everything to do.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub full: bool,
    /// Per-round details on stderr (`-- --verbose`).
    pub verbose: bool,
    /// Whether hookwire's default log layer was installed.
    pub telemetry: bool,
    /// Only these figures (`-- --only per-event,runtime,fanout,throughput,
    /// orchestrator,memory,inflight,store`); all when empty.
    pub only: Vec<String>,
    /// Rounds of every latency figure; each figure is the median of rounds.
    pub rounds: usize,
    /// Runs per variant per round.
    pub runs: usize,
    /// Floor round trips per round.
    pub pings: usize,
    /// Runs per fan-out variant per round (eight variants).
    pub fan_runs: usize,
    /// Throughput: rounds, measuring window, concurrent runs, floor streams,
    /// and fresh sessions made ready per measurement.
    pub throughput_rounds: usize,
    pub window_ms: u64,
    pub concurrency: Vec<usize>,
    pub floor_streams: usize,
    pub throughput_sessions: usize,
    /// Memory: fresh processes, idle sessions, in-flight runs.
    pub memory_rounds: usize,
    pub idle_sessions: usize,
    pub inflight_runs: usize,
    /// Figure 9: rounds, runs in flight at once, the model's delays (one
    /// series of rounds each), and probe runs (each hooked and bare)
    /// measured while they are in flight.
    pub many_rounds: usize,
    pub many_runs: usize,
    pub many_delays_ms: Vec<u64>,
    /// A series on a throwaway PostgreSQL (the replicas' store) with this
    /// model delay; `None`: none.
    pub many_postgres_delay_ms: Option<u64>,
    pub many_probes: usize,
    /// Figure 10: rounds, and the two lengths of each callgrind workload
    /// (chat runs; floor round trips).
    pub instruction_rounds: usize,
    pub instruction_runs: (usize, usize),
    pub instruction_pings: (usize, usize),
    /// Also tools runs and merged hooks (each workload is a valgrind run
    /// of seconds in a release build, tens of seconds in a debug one).
    pub instruction_all: bool,
}

impl Plan {
    fn full() -> Plan {
        Plan {
            full: true,
            verbose: false,
            telemetry: true,
            only: Vec::new(),
            rounds: 7,
            runs: 200,
            pings: 2000,
            fan_runs: 100,
            throughput_rounds: 3,
            window_ms: 1000,
            concurrency: vec![64, 512],
            floor_streams: 64,
            // Enough that the bare runs (up to ~55k runs/s, 4 per session,
            // workers running a little before and after the window) do not
            // run dry and make sessions in it: 16 000 fell short by a few
            // hundred in some rounds at 512.
            throughput_sessions: 24_000,
            memory_rounds: 3,
            idle_sessions: 10_000,
            inflight_runs: 1_000,
            many_rounds: 3,
            many_runs: 10_000,
            // The 2 s, and one long enough that every run's start
            // (its hook calls before the model) is over while all of them
            // still wait: the in-flight load without the start-up burst.
            many_delays_ms: vec![2000, 20_000],
            many_postgres_delay_ms: Some(2000),
            // Each hooked and bare; a p99 over 300 was their third slowest
            // and moved with one stall of the machine (the idle probes, half
            // as many, gave p99 from 185 to 490 us between invocations).
            many_probes: 1000,
            instruction_rounds: 3,
            instruction_runs: (20, 60),
            instruction_pings: (200, 1000),
            instruction_all: true,
        }
    }

    fn smoke() -> Plan {
        Plan {
            full: false,
            verbose: false,
            telemetry: true,
            only: Vec::new(),
            rounds: 1,
            runs: 3,
            pings: 20,
            fan_runs: 1,
            throughput_rounds: 1,
            window_ms: 100,
            concurrency: vec![4, 16],
            floor_streams: 4,
            throughput_sessions: 50,
            memory_rounds: 1,
            idle_sessions: 50,
            inflight_runs: 10,
            many_rounds: 1,
            many_runs: 20,
            many_delays_ms: vec![300],
            many_postgres_delay_ms: Some(300),
            many_probes: 3,
            instruction_rounds: 1,
            instruction_runs: (2, 4),
            instruction_pings: (20, 40),
            instruction_all: false,
        }
    }
}

impl Plan {
    /// `--bench` (passed by `cargo bench`) selects the full run.
    fn from_args(args: &[String]) -> Plan {
        let mut plan = if args.iter().any(|a| a == "--bench") {
            Plan::full()
        } else {
            Plan::smoke()
        };
        plan.verbose = args.iter().any(|a| a == "--verbose");
        // `--many-runs N`: figure 9 with N runs in flight instead.
        if let Some(n) = args
            .iter()
            .position(|a| a == "--many-runs")
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse().ok())
        {
            plan.many_runs = n;
        }
        // `--many-delay-ms MS`: figure 9 with only that model delay (on
        // the default store).
        if let Some(ms) = args
            .iter()
            .position(|a| a == "--many-delay-ms")
            .and_then(|i| args.get(i + 1))
            .and_then(|n| n.parse().ok())
        {
            plan.many_delays_ms = vec![ms];
            plan.many_postgres_delay_ms = None;
        }
        if let Some(i) = args.iter().position(|a| a == "--only") {
            plan.only = args
                .get(i + 1)
                .map(|s| s.split(',').map(String::from).collect())
                .unwrap_or_default();
        }
        plan
    }
}

/// What `hookwire serve` installs with no OTLP endpoint: the log layer at
/// info, which makes hookwire's info spans real. The filter is fixed here
/// rather than read from RUST_LOG, so runs compare.
fn install_telemetry(otlp: Option<String>) -> Telemetry {
    let mut opts = TelemetryOptions::new(LogFormat::Text);
    opts.otlp_endpoint = otlp;
    let (dispatch, telemetry) =
        hookwire::telemetry::build(&opts, BoxMakeWriter::new(std::io::stderr))
            .expect("telemetry pipeline");
    tracing::dispatcher::set_global_default(dispatch).expect("one subscriber");
    telemetry
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mut plan = Plan::from_args(&args);
    // hookwire's own runtime (src/main.rs): multi-thread, one worker per CPU.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if args.iter().any(|a| a == "--serve-remote") {
        runtime.block_on(remote::serve());
        return;
    }
    // `--profile W N --remote`: the hook and an OTLP collector in a child
    // process, and the exporter on (see remote.rs).
    let remote = args
        .iter()
        .any(|a| a == "--remote")
        .then(|| runtime.block_on(remote::Remote::start()));
    let telemetry = {
        let _in_runtime = runtime.enter();
        (!args.iter().any(|a| a == "--no-telemetry"))
            .then(|| install_telemetry(remote.as_ref().map(|r| r.otlp.clone())))
    };
    plan.telemetry = telemetry.is_some();
    if let Some(i) = args.iter().position(|a| a == "--profile") {
        let what = args.get(i + 1).map(String::as_str).unwrap_or("");
        let count = args.get(i + 2).and_then(|n| n.parse().ok()).unwrap_or(100);
        let hook = remote.as_ref();
        if args.iter().any(|a| a == "--current-thread") {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime")
                .block_on(profile::run(what, count, hook));
        } else {
            runtime.block_on(profile::run(what, count, hook));
        }
        if let Some(t) = telemetry {
            // Export what is batched, so the exporter's work is counted.
            runtime.block_on(t.shutdown());
        }
        return;
    }
    runtime.block_on(run(plan));
}

async fn run(plan: Plan) {
    let started = Instant::now();
    let mut rig = rig::Rig::start(rig::Extent::Full).await;
    if let (false, Some(why)) = (plan.full, &rig.python_missing) {
        // The smoke pass runs under `cargo test` (make test), where a
        // missing peer is a failure, never a skip that reads as a pass.
        panic!(
            "smoke pass: figure 7 needs the Python example hook server: {why} \
             (install it with: bash examples/hooks/install-deps.sh python)"
        );
    }
    let floor = floor::Floor::start(rig.typical_event.clone()).await;
    let floor_message = serde_json::json!({
        "kind": hookwire::pb::EventKind::try_from(rig.typical_event.kind)
            .map(|k| k.as_str_name())
            .unwrap_or("?"),
        "bytes": prost::Message::encoded_len(&rig.typical_event),
    });
    let mut rows = Vec::new();
    let wanted = |name: &str| plan.only.is_empty() || plan.only.iter().any(|o| o == name);
    if wanted("per-event") {
        rows.extend(per_event::measure(&mut rig, &floor, &plan).await);
    }
    if wanted("runtime") {
        rows.extend(runtime::measure(&plan).await);
    }
    if wanted("fanout") {
        rows.extend(fanout::measure(&mut rig, &plan).await);
    }
    if wanted("throughput") {
        rows.extend(throughput::measure(&mut rig, &floor, &plan).await);
    }
    if wanted("orchestrator") {
        rows.extend(orchestrator::measure(&mut rig, &floor, &plan).await);
    }
    if wanted("memory") {
        rows.extend(memory::measure(&plan).await);
    }
    let mut skipped = Vec::new();
    if wanted("inflight") {
        match inflight::measure(&floor, &plan).await {
            Ok(r) => rows.extend(r),
            Err(why) => skipped.push(format!("figure 9 skipped: {why}")),
        }
    }
    if wanted("store") {
        rows.extend(store::measure(&plan).await);
    }
    if wanted("instructions") {
        match instructions::measure(&mut rig, &plan).await {
            Ok(r) => rows.extend(r),
            // The smoke pass runs under `make test`, which installs
            // valgrind: there a missing figure is a failure.
            Err(why) if !plan.full => panic!("smoke pass: figure 10: {why}"),
            Err(why) => skipped.push(format!("figure 10 skipped: {why}")),
        }
    }
    rows.sort_by_key(|r| r.figure);
    if !plan.full {
        // Tiny counts in a debug build: nothing to judge.
        for r in &mut rows {
            r.pass = None;
        }
    }
    let machine = machine::describe();
    println!(
        "hookwire benchmarks, {}; {} CPUs ({}), load {}",
        if plan.full {
            "full run"
        } else {
            "smoke pass (debug build, tiny counts: numbers meaningless)"
        },
        machine["cpus"],
        machine["cpu_model"].as_str().unwrap_or("?"),
        machine["load_average"].as_str().unwrap_or("?"),
    );
    println!(
        "runtime: tokio multi-thread as hookwire serve; tracing: {}; floor message: {} of {} bytes",
        if plan.telemetry {
            "the log layer of hookwire serve (info, no exporter)"
        } else {
            "none"
        },
        floor_message["kind"].as_str().unwrap_or("?"),
        floor_message["bytes"],
    );
    if let Some(why) = &rig.python_missing {
        // Only a full run gets here without Python.
        println!("figure 7 skipped: {why}");
    }
    for why in &skipped {
        println!("{why}");
    }
    println!("{}", report::table(&rows));
    let results = report::Results {
        machine,
        floor_message,
        plan: serde_json::to_value(&plan).unwrap(),
        elapsed_s: started.elapsed().as_secs_f64(),
        rows: &rows,
    };
    let file = if plan.full {
        "results.json"
    } else {
        "smoke.json"
    };
    match report::write_json(&results, file) {
        Ok(p) => println!("results: {}", p.display()),
        Err(e) => eprintln!("cannot write results: {e}"),
    }
}
