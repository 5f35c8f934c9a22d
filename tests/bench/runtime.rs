//! The runtime choice, measured: the floor and the per-event figure again
//! with client, hookwire and hook all on one current-thread runtime (its
//! own OS thread), next to the multi-thread runtime `hookwire serve` uses.
//! On these VMs an idle vCPU halts, and a wake-up that crosses cores costs
//! tens of microseconds; one thread never pays it, but also never uses the
//! second core.

use crate::floor::Floor;
use crate::report::Row;
use crate::rig::{self, Extent, Rig};
use crate::stats::{micros, quantile, Spread};
use crate::Plan;

pub async fn measure(plan: &Plan) -> Vec<Row> {
    let plan = plan.clone();
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("current-thread runtime")
            .block_on(rounds(&plan))
    })
    .await
    .expect("current-thread figures")
}

async fn rounds(plan: &Plan) -> Vec<Row> {
    let mut rig = Rig::start(Extent::Lean).await;
    let floor = Floor::start(rig.typical_event.clone()).await;
    let events = rig.events_per_run(rig::HOOKED_TOOLS, "steady", 3).await;
    let (mut floors, mut per_event, mut ratios) = (vec![], vec![], vec![]);
    for _ in 0..plan.rounds {
        let mut rtt: Vec<f64> = floor
            .round_trips(plan.pings)
            .await
            .into_iter()
            .map(micros)
            .collect();
        let f50 = quantile(&mut rtt, 0.5);
        let mut lat = rig
            .latencies(&[rig::BARE_TOOLS, rig::HOOKED_TOOLS], plan.runs)
            .await;
        let o50 = (quantile(&mut lat[1], 0.5) - quantile(&mut lat[0], 0.5)) / events;
        floors.push(f50);
        per_event.push(o50);
        ratios.push(o50 / f50);
    }
    let f = Spread::of(&floors);
    vec![
        Row::new(1, "floor p50, current-thread runtime", "us", f),
        Row::new(
            2,
            format!("per-event overhead p50, tools run (N={events}), current-thread runtime"),
            "us",
            Spread::of(&per_event),
        )
        .against("its floor p50", f, &ratios),
    ]
}
