//! Figure 4: hook events per second with many runs at once, each run with
//! one hook, against 64 raw streams ping-ponging on one connection.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::floor::{window_rate, Floor};
use crate::report::{Row, Target};
use crate::rig::{self, Rig, Variant};
use crate::service;
use crate::stats::Spread;
use crate::Plan;

/// The run every worker repeats.
const SHAPE: Variant = rig::HOOKED_CHAT;

pub async fn measure(rig: &mut Rig, floor: &Floor, plan: &Plan) -> Vec<Row> {
    let window = Duration::from_millis(plan.window_ms);
    let mut floors = Vec::new();
    let mut rates = vec![Vec::new(); plan.concurrency.len()];
    for _ in 0..plan.throughput_rounds {
        floors.push(floor.throughput(plan.floor_streams, window).await);
        for (i, &c) in plan.concurrency.iter().enumerate() {
            rates[i].push(events_per_second(rig, c, window, plan).await);
        }
        if plan.verbose {
            eprintln!(
                "  throughput: floor {:.0}/s; hookwire {:?}",
                floors.last().unwrap(),
                rates
                    .iter()
                    .map(|r| r.last().unwrap().round())
                    .collect::<Vec<_>>()
            );
        }
    }
    let floor_spread = Spread::of(&floors);
    let mut rows = vec![Row::new(
        1,
        format!("floor: round trips/s, {} streams", plan.floor_streams),
        "/s",
        floor_spread,
    )];
    for (i, c) in plan.concurrency.iter().enumerate() {
        let ratios: Vec<f64> = rates[i].iter().zip(&floors).map(|(r, f)| r / f).collect();
        rows.push(
            Row::new(
                4,
                format!("hook events/s, {c} concurrent runs"),
                "/s",
                Spread::of(&rates[i]),
            )
            .against(
                format!("floor {} streams", plan.floor_streams),
                floor_spread,
                &ratios,
            )
            .target(Target::ratio_at_least(0.5)),
        );
    }
    rows
}

/// `concurrency` clients each invoking runs back to back, on fresh
/// sessions made beforehand; the hook's answered events per second.
async fn events_per_second(
    rig: &mut Rig,
    concurrency: usize,
    window: Duration,
    plan: &Plan,
) -> f64 {
    let pool = Arc::new(Mutex::new(
        service::sessions(&rig.client, SHAPE.agent, plan.throughput_sessions).await,
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let dry = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (mut client, pool, stop, dry) =
                (rig.client.clone(), pool.clone(), stop.clone(), dry.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let next = pool.lock().unwrap().pop();
                    let session = match next {
                        Some(s) => s,
                        None => {
                            dry.fetch_add(1, Ordering::Relaxed);
                            service::sessions(&client, SHAPE.agent, 1).await.remove(0)
                        }
                    };
                    let (_, r) = service::invoke(&mut client, &session, SHAPE.input).await;
                    service::assert_completed(&r, "throughput run");
                }
            })
        })
        .collect();
    let rate = window_rate(&rig.steady.answered, window).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.expect("throughput worker");
    }
    if plan.verbose && dry.load(Ordering::Relaxed) > 0 {
        eprintln!(
            "  throughput: session pool ran dry {} times at {concurrency}",
            dry.load(Ordering::Relaxed)
        );
    }
    rate
}
