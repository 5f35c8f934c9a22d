//! Figure 10: instructions per hook event on hookwire's side, against
//! tonic's client-side cost of one round trip, both counted by callgrind in
//! this run (instruction counts repeat where wall time does not).
//!
//! Each count is this binary under `valgrind --tool=callgrind` running a
//! fixed workload twice, with `short` and `long` units of it; the
//! difference divided by the difference in units cancels start-up. With
//! `--remote` the hook server, the floor's echo server and an OTLP
//! collector run in a child process (not traced by valgrind), so what is
//! counted is hookwire, its exporter (on: spans are batched, encoded and
//! sent) and the client:
//!
//! - per hook event: (hooked runs − bare runs) / runs / events per run,
//!   so the client's calls and the runs' own work cancel; chat runs (a
//!   stream open shared by four events) and tools runs (by twelve);
//! - per extra merged hook: tools runs with 8 merged `model_request`
//!   hooks against 1, per model request and per hook beyond the first;
//! - the baseline: floor round trips on one stream (client side only),
//!   with the same event as the other figures' floor.
//!
//! Without valgrind the figure is skipped with the command that installs it.

use std::path::Path;
use std::process::Command;

use crate::report::{Row, Target};
use crate::rig::{self, Rig};
use crate::stats::Spread;
use crate::Plan;

/// hookwire's own instructions per event may be at most this many times a
/// tonic client round trip (issue 18, item 3).
const TARGET_RATIO: f64 = 2.0;

/// Total instructions of one callgrind run of `--profile what count`.
fn instructions(exe: &Path, what: &str, count: usize, dir: &Path) -> Result<f64, String> {
    let out = dir.join(format!("{what}.{count}.callgrind"));
    let status = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(exe)
        .args(["--profile", what, &count.to_string(), "--remote"])
        .output()
        .map_err(|e| format!("valgrind did not start: {e}"))?;
    if !status.status.success() {
        return Err(format!(
            "valgrind --profile {what} {count} failed: {}",
            String::from_utf8_lossy(&status.stderr)
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join(" | ")
        ));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    // callgrind writes `summary:` (and `totals:`) with the event counts.
    text.lines()
        .find_map(|l| {
            l.strip_prefix("summary:")
                .or_else(|| l.strip_prefix("totals:"))
        })
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("{}: no instruction total", out.display()))
}

/// Instructions per unit of `what`: the difference of two lengths.
fn per_unit(exe: &Path, what: &str, short: usize, long: usize, dir: &Path) -> Result<f64, String> {
    let a = instructions(exe, what, short, dir)?;
    let b = instructions(exe, what, long, dir)?;
    Ok((b - a) / (long - short) as f64)
}

struct Round {
    per_event: f64,
    per_bare_run: f64,
    round_trip: f64,
    /// Tools runs and merged hooks, when the plan measures them.
    more: Option<More>,
}

struct More {
    per_event_tools: f64,
    per_extra_hook: f64,
}

/// Events per chat run and per tools run.
#[derive(Clone, Copy)]
struct Events {
    chat: f64,
    tools: f64,
    /// `model_request` events per tools run (the merged hooks' event).
    model_requests: f64,
}

/// Per hook event of `hooked` runs net of `bare` ones, and per bare run.
fn per_event(
    exe: &Path,
    plan: &Plan,
    (hooked, bare): (&str, &str),
    events: f64,
    dir: &Path,
) -> Result<(f64, f64), String> {
    let (short, long) = plan.instruction_runs;
    let h = per_unit(exe, hooked, short, long, dir)?;
    let b = per_unit(exe, bare, short, long, dir)?;
    Ok(((h - b) / events, b))
}

fn round(exe: &Path, plan: &Plan, events: Events, dir: &Path) -> Result<Round, String> {
    let (chat, bare) = per_event(exe, plan, ("hooked-chat", "bare-chat"), events.chat, dir)?;
    let more = if plan.instruction_all {
        let (tools, _) = per_event(exe, plan, ("hooked-tools", "bare-tools"), events.tools, dir)?;
        // Eight merged hooks against one, per extra hook and event.
        let (short, long) = plan.instruction_runs;
        let one = per_unit(exe, "mr1", short, long, dir)?;
        let eight = per_unit(exe, "mr8", short, long, dir)?;
        Some(More {
            per_event_tools: tools,
            per_extra_hook: (eight - one) / 7.0 / events.model_requests,
        })
    } else {
        None
    };
    let (p0, p1) = plan.instruction_pings;
    let round_trip = per_unit(exe, "floor", p0, p1, dir)?;
    Ok(Round {
        per_event: chat,
        per_bare_run: bare,
        round_trip,
        more,
    })
}

/// The rows, or why the figure could not run.
pub async fn measure(rig: &mut Rig, plan: &Plan) -> Result<Vec<Row>, String> {
    let found = Command::new("valgrind").arg("--version").output();
    if !found.is_ok_and(|o| o.status.success()) {
        return Err("valgrind is not installed (deploy/deps.sh installs it)".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    // Blocking hook events per chat run, counted by hookwire itself (the
    // profiles run the same agents against a hook in the child process).
    let events = Events {
        chat: rig.events_per_run(rig::HOOKED_CHAT, "steady", 4).await,
        tools: rig.events_per_run(rig::HOOKED_TOOLS, "steady", 4).await,
        model_requests: rig.events_per_run(rig::merged(1), "mr_1", 2).await,
    };
    if events.chat <= 0.0 || events.tools <= 0.0 || events.model_requests <= 0.0 {
        return Err("a hooked run made no hook calls".into());
    }
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let mut rounds = Vec::new();
    for _ in 0..plan.instruction_rounds {
        let (exe, dir) = (exe.clone(), dir.path().to_path_buf());
        let plan = plan.clone();
        // Minutes of child processes: off the runtime's workers.
        let r = tokio::task::spawn_blocking(move || round(&exe, &plan, events, &dir))
            .await
            .map_err(|e| format!("profile task: {e}"))??;
        rounds.push(r);
    }
    let col = |f: fn(&Round) -> f64| rounds.iter().map(f).collect::<Vec<f64>>();
    let (ev, rt, bare) = (
        col(|r| r.per_event),
        col(|r| r.round_trip),
        col(|r| r.per_bare_run),
    );
    let ratio = |v: &[f64]| -> Vec<f64> { v.iter().zip(&rt).map(|(e, t)| e / t).collect() };
    let k = |v: &[f64]| v.iter().map(|x| x / 1000.0).collect::<Vec<f64>>();
    let per_event_row = |what: String, v: &[f64]| {
        Row::new(10, what, "k", Spread::of(&k(v)))
            .against("tonic client round trip", Spread::of(&k(&rt)), &ratio(v))
            .target(Target::ratio_at_most(TARGET_RATIO))
    };
    let mut rows = vec![per_event_row(
        format!(
            "instructions per hook event, hookwire's side, exporter on (chat runs, {:.0} events each)",
            events.chat
        ),
        &ev,
    )];
    let more: Vec<&More> = rounds.iter().filter_map(|r| r.more.as_ref()).collect();
    if !more.is_empty() {
        let tools: Vec<f64> = more.iter().map(|m| m.per_event_tools).collect();
        let extra: Vec<f64> = more.iter().map(|m| m.per_extra_hook).collect();
        // The run's one stream open per hook, shared by more events.
        rows.push(per_event_row(
            format!(
                "instructions per hook event, hookwire's side, exporter on (tools runs, {:.0} events each)",
                events.tools
            ),
            &tools,
        ));
        // Issue 18, item 5: what each hook beyond the first costs hookwire
        // on a merged event (its own stream open, span, event, verdict and
        // the merge).
        rows.push(Row::new(
            10,
            format!(
                "instructions per extra merged hook, hookwire's side (8 vs 1 on model_request, {:.0} per tools run)",
                events.model_requests
            ),
            "k",
            Spread::of(&k(&extra)),
        ));
    }
    rows.push(Row::new(
        10,
        "instructions per bare chat run, hookwire and its client (no hook)",
        "k",
        Spread::of(&k(&bare)),
    ));
    Ok(rows)
}
