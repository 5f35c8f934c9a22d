//! Figure 5: hookwire's own cost per turn, without hooks, on the scripted
//! model. Timed inside the server: `hookwire_run_duration_seconds` (sum and
//! count, exact) covers a run from its start to its report, so the client
//! call and the gRPC transport are not in it.

use crate::floor::Floor;
use crate::report::{Row, Target};
use crate::rig::{Rig, Variant};
use crate::service::{self, input};
use crate::stats::{quantile, Spread};
use crate::Plan;

const ONE_TURN: Variant = Variant {
    agent: "solo",
    input: input::CHAT,
};
const TEN_TURNS: Variant = Variant {
    agent: "looping",
    input: input::LOOP,
};

/// Mean server-side run time (µs) and mean turns of `runs` runs of `v`.
async fn server_time(rig: &mut Rig, v: Variant, runs: usize) -> (f64, f64) {
    let sessions = service::sessions(&rig.client, v.agent, runs).await;
    let agent = format!("agent=\"{}\"", v.agent);
    let read = |text: &str| {
        (
            service::metric_sum(text, "hookwire_run_duration_seconds_sum", &[&agent]),
            service::metric_sum(text, "hookwire_run_duration_seconds_count", &[&agent]),
        )
    };
    let before = read(&service::metrics(rig.service.admin).await);
    let mut turns = 0u64;
    for s in &sessions {
        let (_, r) = service::invoke(&mut rig.client, s, v.input).await;
        service::assert_completed(&r, v.agent);
        turns += u64::from(r.turns);
    }
    let after = read(&service::metrics(rig.service.admin).await);
    let count = after.1 - before.1;
    assert_eq!(count as usize, runs, "every run is counted once");
    (
        (after.0 - before.0) * 1e6 / count,
        turns as f64 / runs as f64,
    )
}

pub async fn measure(rig: &mut Rig, floor: &Floor, plan: &Plan) -> Vec<Row> {
    let (mut one, mut ten, mut marginal, mut floors) = (vec![], vec![], vec![], vec![]);
    let mut turns = 0.0;
    for _ in 0..plan.rounds {
        let mut rtt: Vec<f64> = floor
            .round_trips(plan.pings / 4)
            .await
            .into_iter()
            .map(crate::stats::micros)
            .collect();
        floors.push(quantile(&mut rtt, 0.5));
        let (t1, n1) = server_time(rig, ONE_TURN, plan.runs).await;
        let (t10, n10) = server_time(rig, TEN_TURNS, plan.runs).await;
        turns = n10;
        one.push(t1 / n1);
        ten.push(t10 / n10);
        marginal.push((t10 - t1) / (n10 - n1));
        if plan.verbose {
            eprintln!("  orchestrator: run of {n1} turn {t1:.1} us, of {n10} turns {t10:.1} us");
        }
    }
    let f = Spread::of(&floors);
    let ratios = |v: &[f64]| -> Vec<f64> { v.iter().zip(&floors).map(|(x, f)| x / f).collect() };
    vec![
        Row::new(
            5,
            "server time per turn, 1-turn runs",
            "us",
            Spread::of(&one),
        )
        .against("floor p50", f, &ratios(&one))
        .target(Target::value_at_most(50.0)),
        Row::new(
            5,
            format!("server time per turn, {turns}-turn runs"),
            "us",
            Spread::of(&ten),
        )
        .against("floor p50", f, &ratios(&ten))
        .target(Target::value_at_most(50.0)),
        Row::new(
            5,
            "server time per extra turn (10-turn minus 1-turn)",
            "us",
            Spread::of(&marginal),
        )
        .against("floor p50", f, &ratios(&marginal)),
    ]
}
