//! Figure 6: resident memory of a separate `hookwire serve` process per
//! idle session and per in-flight run (each run holding its hook stream
//! open, since the hook holds its `run_start` verdict until released).
//! Each round is a fresh process; RSS is /proc/PID/status VmRSS.

use std::process::Stdio;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::hook::{self, Holding};
use crate::report::{Row, Target};
use crate::service::{self, input};
use crate::stats::Spread;
use crate::Plan;

const KIB: f64 = 1024.0;
const SESSION_TARGET_KIB: f64 = 16.0;
const RUN_TARGET_KIB: f64 = 64.0;

pub fn rss_bytes(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc status");
    kib * KIB
}

/// RSS once it stops moving (the allocator and the runtime settle after a
/// burst).
pub async fn settled_rss(pid: u32) -> f64 {
    let mut last = rss_bytes(pid);
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = rss_bytes(pid);
        if (now - last).abs() < 16.0 * KIB {
            return now;
        }
        last = now;
    }
    last
}

pub struct Server {
    pub child: Child,
    pub addr: String,
    pub admin: std::net::SocketAddr,
    _config: tempfile::NamedTempFile,
    _data: tempfile::TempDir,
}

/// `hookwire serve` on ports chosen by the OS, learnt from its JSON log.
async fn spawn(hook_addr: &str) -> Server {
    spawn_with(&format!(
        "models:\n  - name: m\n    provider: scripted\n    rules:{rules}hooks:\n  - name: holding\n    endpoint: {hook_addr}\n    timeout: 300s\nagents:\n  - name: idle\n    model: m\n  - name: held\n    model: m\n    hooks: [holding]\n    event_budget: 300s\n",
        rules = service::RULES
    ))
    .await
}

/// `hookwire serve` with `yaml` (listen addresses added), on ports chosen
/// by the OS.
pub async fn spawn_with(yaml: &str) -> Server {
    let yaml = format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{yaml}");
    let mut config = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    std::io::Write::write_all(&mut config, yaml.as_bytes()).unwrap();
    // The default store (SQLite, as a replica runs it), in a directory of
    // its own: never the user's data directory, never another run's file.
    let data = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .args(["serve", "--log-format", "json", "--config"])
        .arg(config.path())
        .env("HOOKWIRE_DATA_DIR", data.path())
        .env_remove("HOOKWIRE_STORE")
        .env(
            "RUST_LOG",
            std::env::var("HOOKWIRE_BENCH_SERVE_LOG").unwrap_or_else(|_| "info".into()),
        )
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env_remove("HOOKWIRE_LISTEN")
        .env_remove("HOOKWIRE_ADMIN_LISTEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("hookwire binary");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (grpc, admin) = tokio::time::timeout(Duration::from_secs(30), async {
        while let Ok(Some(line)) = lines.next_line().await {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            let f = &v["fields"];
            if let (Some(g), Some(a)) = (f["grpc"].as_str(), f["admin"].as_str()) {
                return (g.to_string(), a.parse().unwrap());
            }
        }
        panic!("hookwire serve exited before listening");
    })
    .await
    .expect("hookwire serve listens within 30 s");
    // hookwire's warnings and errors are worth seeing next to the figures.
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let wanted = line.contains(r#""level":"WARN""#)
                || line.contains(r#""level":"ERROR""#)
                || (line.contains(r#""level":"DEBUG""#) && line.to_lowercase().contains("goaway"));
            if wanted {
                eprintln!("hookwire serve: {line}");
            }
        }
    });
    Server {
        child,
        addr: format!("http://{grpc}"),
        admin,
        _config: config,
        _data: data,
    }
}

async fn active_hook_streams(admin: std::net::SocketAddr) -> f64 {
    service::metric_sum(
        &service::metrics(admin).await,
        "hookwire_active_hook_streams",
        &[],
    )
}

/// One fresh process: (bytes per idle session, bytes per in-flight run,
/// RSS at the start).
async fn round(plan: &Plan) -> (f64, f64, f64) {
    let (holding, release) = Holding::new();
    let held = holding.held.clone();
    let hook = hook::start(holding).await;
    let mut server = spawn(&hook.addr).await;
    let pid = server.child.id().expect("child pid");
    let client = service::client(&server.addr).await;

    // Warm up every path once so first-use allocations are not counted.
    release.send_replace(true);
    for s in service::sessions(&client, "held", 8).await {
        let (_, r) = service::invoke(&mut client.clone(), &s, input::CHAT).await;
        service::assert_completed(&r, "warm-up");
    }
    release.send_replace(false);
    service::sessions(&client, "idle", 64).await;

    let start = settled_rss(pid).await;
    service::sessions(&client, "idle", plan.idle_sessions).await;
    let idle = settled_rss(pid).await;
    let per_session = (idle - start) / plan.idle_sessions as f64;

    let sessions = service::sessions(&client, "held", plan.inflight_runs).await;
    let before_runs = settled_rss(pid).await;
    let runs: Vec<_> = sessions
        .into_iter()
        .map(|s| {
            let mut c = client.clone();
            tokio::spawn(async move { service::invoke(&mut c, &s, input::CHAT).await.1 })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    let want = plan.inflight_runs as f64;
    while held.load(Ordering::SeqCst) < plan.inflight_runs as u64
        || active_hook_streams(server.admin).await < want
    {
        assert!(Instant::now() < deadline, "runs never all reached the hook");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let in_flight = settled_rss(pid).await;
    let per_run = (in_flight - before_runs) / plan.inflight_runs as f64;
    release.send_replace(true);
    for r in runs {
        service::assert_completed(&r.await.unwrap(), "held run");
    }
    let _ = server.child.kill().await;
    (per_session, per_run, start)
}

pub async fn measure(plan: &Plan) -> Vec<Row> {
    let (mut sessions, mut runs, mut starts) = (vec![], vec![], vec![]);
    for _ in 0..plan.memory_rounds {
        let (s, r, start) = round(plan).await;
        if plan.verbose {
            eprintln!(
                "  memory: start {:.1} MiB; {:.2} KiB/session, {:.2} KiB/run",
                start / KIB / KIB,
                s / KIB,
                r / KIB
            );
        }
        sessions.push(s / KIB);
        runs.push(r / KIB);
        starts.push(start / KIB / KIB);
    }
    let ratio = |v: &[f64], t: f64| v.iter().map(|x| x / t).collect::<Vec<_>>();
    let session_target = Spread::of(&[SESSION_TARGET_KIB]);
    let run_target = Spread::of(&[RUN_TARGET_KIB]);
    vec![
        Row::new(
            6,
            "RSS at start (before sessions)",
            "MiB",
            Spread::of(&starts),
        ),
        Row::new(
            6,
            format!("RSS per idle session ({})", plan.idle_sessions),
            "KiB",
            Spread::of(&sessions),
        )
        .against(
            "target",
            session_target,
            &ratio(&sessions, SESSION_TARGET_KIB),
        )
        .target(Target::value_at_most(SESSION_TARGET_KIB)),
        Row::new(
            6,
            format!(
                "RSS per in-flight run ({}, each with a hook stream)",
                plan.inflight_runs
            ),
            "KiB",
            Spread::of(&runs),
        )
        .against("target", run_target, &ratio(&runs, RUN_TARGET_KIB))
        .target(Target::value_at_most(RUN_TARGET_KIB)),
    ]
}
