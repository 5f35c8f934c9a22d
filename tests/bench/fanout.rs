//! Figure 3: several hooks on one event. `model_request` hooks are called
//! concurrently and merged; `tool_result` hooks run as a chain. Each is the
//! cost of one event with K hooks: tools runs (two model requests, three
//! tool results) minus the same runs without hooks, per event.

use crate::report::{Row, Target};
use crate::rig::{self, Rig, Variant, FAN};
use crate::stats::{quantile, Spread};
use crate::Plan;

pub async fn measure(rig: &mut Rig, plan: &Plan) -> Vec<Row> {
    let mr_events = rig.events_per_run(rig::merged(1), "mr_1", 2).await;
    let tr_events = rig.events_per_run(rig::chained(1), "tr_1", 2).await;
    let mut variants: Vec<Variant> = vec![rig::BARE_TOOLS];
    variants.extend(FAN.map(rig::merged));
    variants.extend(FAN.map(rig::chained));
    // Hooks that take a while to decide, as most real ones do: merging is
    // concurrent when the cost is waiting rather than this machine's CPU.
    // In a block of their own, since their idle milliseconds let the vCPUs
    // halt and slow whatever runs next.
    let slow_variants = [
        rig::BARE_TOOLS,
        rig::merged_slow(1),
        rig::merged_slow(8),
        rig::merged_exact(1),
        rig::merged_exact(8),
    ];
    // Per round: p50 event cost with K merged / chained hooks.
    let mut merged = vec![Vec::new(); FAN.len()];
    let mut chained = vec![Vec::new(); FAN.len()];
    // 1 and 8 hooks on tokio's timer, then 1 and 8 that wait exactly.
    let mut slow = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..plan.rounds {
        let mut lat = rig.latencies(&variants, plan.fan_runs).await;
        let mut p50: Vec<f64> = lat.iter_mut().map(|l| quantile(l, 0.5)).collect();
        let bare = p50.remove(0);
        for (i, _) in FAN.iter().enumerate() {
            merged[i].push((p50[i] - bare) / mr_events);
            chained[i].push((p50[FAN.len() + i] - bare) / tr_events);
        }
        if plan.verbose {
            eprintln!("  fan-out: bare {bare:.0} us; runs p50 {p50:.0?}");
        }
    }
    for _ in 0..plan.rounds {
        let mut lat = rig
            .latencies(&slow_variants, (plan.fan_runs / 2).max(1))
            .await;
        let p50: Vec<f64> = lat.iter_mut().map(|l| quantile(l, 0.5)).collect();
        for (j, s) in slow.iter_mut().enumerate() {
            s.push((p50[j + 1] - p50[0]) / mr_events);
        }
    }
    let mut rows = Vec::new();
    let one = Spread::of(&merged[0]);
    for (i, k) in FAN.iter().enumerate() {
        let ratios: Vec<f64> = merged[i]
            .iter()
            .zip(&merged[0])
            .map(|(m, one)| m / one)
            .collect();
        let mut row = Row::new(
            3,
            format!("model_request p50, {k} merged hook(s)"),
            "us",
            Spread::of(&merged[i]),
        )
        .against("1 hook", one, &ratios);
        if *k == 8 {
            row = row.target(Target::ratio_at_most(1.5));
        }
        rows.push(row);
    }
    let ratio =
        |k: &[f64], one: &[f64]| -> Vec<f64> { k.iter().zip(one).map(|(k, o)| k / o).collect() };
    let ms = rig::SLOW.as_millis();
    for (j, k) in [1, 8].iter().enumerate() {
        let mut row = Row::new(
            3,
            format!("model_request p50, {k} merged hook(s) sleeping {ms} ms each"),
            "us",
            Spread::of(&slow[j]),
        );
        if *k == 8 {
            row = row
                .against(
                    "1 such hook",
                    Spread::of(&slow[0]),
                    &ratio(&slow[1], &slow[0]),
                )
                .target(Target::ratio_at_most(SLOW_MERGE_LIMIT));
        }
        rows.push(row);
    }
    // The same with hooks that end on time rather than on tokio's next
    // millisecond tick (hook.rs): what the merge costs without the timer's
    // rounding, with a thread hand-off per call added to both sides.
    for (j, k) in [1, 8].iter().enumerate() {
        let mut row = Row::new(
            3,
            format!("model_request p50, {k} merged hook(s) waiting exactly {ms} ms each"),
            "us",
            Spread::of(&slow[2 + j]),
        );
        if *k == 8 {
            row = row.against(
                "1 such hook",
                Spread::of(&slow[2]),
                &ratio(&slow[3], &slow[2]),
            );
        }
        rows.push(row);
    }
    let one = Spread::of(&chained[0]);
    for (i, k) in FAN.iter().enumerate() {
        // Against K times one hook: 1.0 is exactly linear.
        let ratios: Vec<f64> = chained[i]
            .iter()
            .zip(&chained[0])
            .map(|(c, one)| c / (one * *k as f64))
            .collect();
        let mut row = Row::new(
            3,
            format!("tool_result p50, chain of {k}"),
            "us",
            Spread::of(&chained[i]),
        )
        .against(format!("{k} x 1 hook"), one, &ratios);
        if *k > 1 {
            row = row.target(Target::ratio_at_most(LINEAR_SLACK));
        }
        rows.push(row);
    }
    rows
}

/// 8 merged hooks that each take time (not CPU) against one such hook:
/// the merge is concurrent, so only hookwire's own work per extra hook
/// should show.
const SLOW_MERGE_LIMIT: f64 = 1.2;

/// "Linear and no worse", with room for the noise of a shared machine.
const LINEAR_SLACK: f64 = 1.1;
