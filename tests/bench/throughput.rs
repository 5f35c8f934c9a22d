//! Figure 4: hook events per second with many runs at once, each run with
//! one hook, against 64 raw streams ping-ponging on one connection. The
//! same runs without the hook, at the same concurrency, tell how much of
//! the machine the run itself takes (the client call, the stream opened per
//! run, the orchestration), and so what the hook events alone cost. And
//! tonic alone with the hooked runs' stream shape (a stream per run, closed
//! after the run's N round trips) tells whether a cost that grows with
//! concurrency is the protocol's, one stream per run, or hookwire's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::floor::{window_rate, Floor};
use crate::report::{Row, Target};
use crate::rig::{self, Rig, Variant};
use crate::service;
use crate::stats::Spread;
use crate::Plan;

/// The run every worker repeats, with its hook and without.
const HOOKED: Variant = rig::HOOKED_CHAT;
const BARE: Variant = rig::BARE_CHAT;

/// Runs per session: a short conversation, so fewer fresh sessions are
/// needed (a bare chat run takes ~50 µs of machine time).
const RUNS_PER_SESSION: usize = 4;

/// Fresh sessions per agent, kept between measurements and topped up
/// before each (made outside the window).
type Pools = HashMap<&'static str, Arc<Mutex<Vec<String>>>>;

pub async fn measure(rig: &mut Rig, floor: &Floor, plan: &Plan) -> Vec<Row> {
    let window = Duration::from_millis(plan.window_ms);
    let events = rig.events_per_run(HOOKED, "steady", 2).await;
    let mut floors = Vec::new();
    let mut pools = Pools::new();
    let n = plan.concurrency.len();
    let (mut hooked, mut bare) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    // The floor with as many streams as runs (no target): whether a cost
    // that grows with concurrency is the runs' or HTTP/2's and tokio's own.
    let mut floors_at = vec![Vec::new(); n];
    // The same number of streams, each closed after a run's N round trips
    // (no target): what one stream per run costs with tonic alone, the
    // shape the hooked runs have before hookwire or the run adds anything.
    let mut shaped = vec![Vec::new(); n];
    // Runs that did not complete, per concurrency, both variants together.
    let mut failed = vec![Vec::new(); n];
    for _ in 0..plan.throughput_rounds {
        floors.push(
            floor
                .throughput(plan.floor_streams, window, plan.verbose)
                .await,
        );
        for (i, &c) in plan.concurrency.iter().enumerate() {
            floors_at[i].push(if c == plan.floor_streams {
                *floors.last().unwrap()
            } else {
                floor.throughput(c, window, plan.verbose).await
            });
            shaped[i].push(
                floor
                    .throughput_per_stream_of(c, events as usize, window, plan.verbose)
                    .await,
            );
            let (h, hf) = runs_per_second(rig, &mut pools, HOOKED, c, window, plan).await;
            let (b, bf) = runs_per_second(rig, &mut pools, BARE, c, window, plan).await;
            hooked[i].push(h);
            bare[i].push(b);
            failed[i].push(hf + bf);
        }
        if plan.verbose {
            eprintln!(
                "  throughput: floor {:.0}/s; runs/s with hook {:?}, without {:?}",
                floors.last().unwrap(),
                hooked
                    .iter()
                    .map(|r| r.last().unwrap().round())
                    .collect::<Vec<_>>(),
                bare.iter()
                    .map(|r| r.last().unwrap().round())
                    .collect::<Vec<_>>(),
            );
        }
    }
    let floor_spread = Spread::of(&floors);
    let floor_name = format!("floor {} streams", plan.floor_streams);
    let mut rows = vec![Row::new(
        1,
        format!("floor: round trips/s, {} streams", plan.floor_streams),
        "/s",
        floor_spread,
    )];
    for (i, c) in plan.concurrency.iter().enumerate() {
        let direct: Vec<f64> = hooked[i].iter().map(|r| r * events).collect();
        // The machine time a hooked run takes beyond a bare one, spent on
        // its N hook events.
        let net: Vec<f64> = hooked[i]
            .iter()
            .zip(&bare[i])
            .map(|(h, b)| events / (1.0 / h - 1.0 / b))
            .collect();
        let ratio = |v: &[f64]| -> Vec<f64> { v.iter().zip(&floors).map(|(x, f)| x / f).collect() };
        rows.push(
            Row::new(
                4,
                format!("hook events/s, {c} concurrent chat runs (N={events})"),
                "/s",
                Spread::of(&direct),
            )
            .against(&floor_name, floor_spread, &ratio(&direct))
            .target(Target::ratio_at_least(0.5)),
        );
        rows.push(
            Row::new(
                4,
                format!("hook events/s net of the runs' own cost, {c} concurrent"),
                "/s",
                Spread::of(&net),
            )
            .against(&floor_name, floor_spread, &ratio(&net)),
        );
        if *c != plan.floor_streams {
            let at = Spread::of(&floors_at[i]);
            let over = |v: &[f64]| -> Vec<f64> {
                v.iter().zip(&floors_at[i]).map(|(x, f)| x / f).collect()
            };
            rows.push(Row::new(
                4,
                format!("floor: round trips/s, {c} streams"),
                "/s",
                at,
            ));
            rows.push(
                Row::new(
                    4,
                    format!(
                        "hook events/s, {c} concurrent chat runs, against the floor at {c} streams"
                    ),
                    "/s",
                    Spread::of(&direct),
                )
                .against(format!("floor {c} streams"), at, &over(&direct)),
            );
        }
        let shape = Spread::of(&shaped[i]);
        rows.push(
            Row::new(
                4,
                format!(
                    "floor: round trips/s, {c} streams, each closed after {events} (a stream per run, tonic alone)"
                ),
                "/s",
                shape,
            )
            .against(&floor_name, floor_spread, &ratio(&shaped[i])),
        );
        let per_shape: Vec<f64> = direct.iter().zip(&shaped[i]).map(|(x, f)| x / f).collect();
        rows.push(
            Row::new(
                4,
                format!("hook events/s, {c} concurrent chat runs, against a stream per run on tonic alone"),
                "/s",
                Spread::of(&direct),
            )
            .against(format!("{c} streams of {events}"), shape, &per_shape),
        );
        rows.push(
            Row::new(
                4,
                format!("runs that did not complete per round, {c} concurrent"),
                "runs",
                Spread::of(&failed[i]),
            )
            .target(Target::value_at_most(0.0)),
        );
    }
    rows
}

/// `concurrency` clients invoking runs of `v` back to back; completed runs
/// per second over the window, and how many runs did not complete. A run
/// that fails is counted and its reason shown once, not fatal: the table
/// must still say what happened (a panic here once lost a whole
/// `make bench`).
async fn runs_per_second(
    rig: &mut Rig,
    pools: &mut Pools,
    v: Variant,
    concurrency: usize,
    window: Duration,
    plan: &Plan,
) -> (f64, f64) {
    let pool = pools.entry(v.agent).or_default().clone();
    let missing = plan
        .throughput_sessions
        .saturating_sub(pool.lock().unwrap().len());
    let fresh = service::sessions(&rig.client, v.agent, missing).await;
    pool.lock().unwrap().extend(fresh);
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let dry = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (mut client, pool, done, stop, dry, failed) = (
                rig.client.clone(),
                pool.clone(),
                done.clone(),
                stop.clone(),
                dry.clone(),
                failed.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let next = pool.lock().unwrap().pop();
                    let session = match next {
                        Some(s) => s,
                        None => {
                            dry.fetch_add(1, Ordering::Relaxed);
                            service::sessions(&client, v.agent, 1).await.remove(0)
                        }
                    };
                    for _ in 0..RUNS_PER_SESSION {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let (_, r) = service::invoke(&mut client, &session, v.input).await;
                        if !service::completed(&r) {
                            if failed.fetch_add(1, Ordering::Relaxed) == 0 {
                                eprintln!(
                                    "  throughput: a {} run did not complete at {concurrency}: {}",
                                    v.agent, r.reason
                                );
                            }
                            // Its session may be left mid-run: take another.
                            break;
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let rate = window_rate(&done, window, plan.verbose).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.expect("throughput worker");
    }
    if plan.verbose && dry.load(Ordering::Relaxed) > 0 {
        eprintln!(
            "  throughput: {} sessions made during the window ({} at {concurrency})",
            dry.load(Ordering::Relaxed),
            v.agent
        );
    }
    (rate, failed.load(Ordering::Relaxed) as f64)
}
