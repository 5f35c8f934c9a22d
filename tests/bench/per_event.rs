//! Figures 2 and 7: what one hook event adds to a run. Runs with N blocking
//! events to one hook that always continues, minus the same runs with no
//! hooks, divided by N; the p50 and p99 of that, against the floor's p50
//! and p99 from the same round.

use crate::floor::Floor;
use crate::report::{Row, Target};
use crate::rig::{self, Rig, Variant};
use crate::stats::{quantile, Spread};
use crate::Plan;

struct Case {
    figure: u8,
    label: &'static str,
    hooked: Variant,
    bare: Variant,
    hook: &'static str,
    events: f64,
    p50: Vec<f64>,
    p99: Vec<f64>,
    r50: Vec<f64>,
    r99: Vec<f64>,
}

pub async fn measure(rig: &mut Rig, floor: &Floor, plan: &Plan) -> Vec<Row> {
    let mut cases = vec![
        (
            2,
            "Rust hook, tools run",
            rig::HOOKED_TOOLS,
            rig::BARE_TOOLS,
            "steady",
        ),
        (
            2,
            "Rust hook, chat run",
            rig::HOOKED_CHAT,
            rig::BARE_CHAT,
            "steady",
        ),
        (
            7,
            "Python hook, tools run",
            rig::PYTHON_TOOLS,
            rig::BARE_TOOLS,
            "py",
        ),
    ]
    .into_iter()
    .filter(|c| rig.has(c.2))
    .map(|(figure, label, hooked, bare, hook)| Case {
        figure,
        label,
        hooked,
        bare,
        hook,
        events: 0.0,
        p50: vec![],
        p99: vec![],
        r50: vec![],
        r99: vec![],
    })
    .collect::<Vec<_>>();
    for c in &mut cases {
        c.events = rig.events_per_run(c.hooked, c.hook, 3).await;
    }
    let mut floor50 = Vec::new();
    let mut floor99 = Vec::new();
    for _ in 0..plan.rounds {
        let mut rtt: Vec<f64> = floor
            .round_trips(plan.pings)
            .await
            .into_iter()
            .map(crate::stats::micros)
            .collect();
        let (f50, f99) = (quantile(&mut rtt, 0.5), quantile(&mut rtt, 0.99));
        floor50.push(f50);
        floor99.push(f99);
        // The Rust and the Python cases run in blocks of their own: runs
        // that leave the CPUs idle for milliseconds (a Python hook's) let
        // the vCPUs halt, which slows whatever runs next.
        for figure in [2, 7] {
            let block: Vec<&mut Case> = cases.iter_mut().filter(|c| c.figure == figure).collect();
            if block.is_empty() {
                continue;
            }
            let mut variants: Vec<Variant> = Vec::new();
            for c in &block {
                for v in [c.bare, c.hooked] {
                    if !variants.contains(&v) {
                        variants.push(v);
                    }
                }
            }
            let mut lat = rig.latencies(&variants, plan.runs).await;
            if plan.verbose {
                for (v, l) in variants.iter().zip(lat.iter_mut()) {
                    eprintln!(
                        "  {:>7} {:>6}: run p50 {:>7.1} us, p99 {:>7.1} us (floor p50 {f50:.1}, p99 {f99:.1})",
                        v.agent,
                        &v.input[..6],
                        quantile(l, 0.5),
                        quantile(l, 0.99)
                    );
                }
            }
            let pos = |v: Variant| variants.iter().position(|x| *x == v).unwrap();
            for c in block {
                let (h, b) = (pos(c.hooked), pos(c.bare));
                let mut per =
                    |q: f64| (quantile(&mut lat[h], q) - quantile(&mut lat[b], q)) / c.events;
                let (o50, o99) = (per(0.5), per(0.99));
                c.p50.push(o50);
                c.p99.push(o99);
                c.r50.push(o50 / f50);
                c.r99.push(o99 / f99);
            }
        }
    }
    let mut rows = vec![
        Row::new(
            1,
            "floor: tonic bidi round trip p50",
            "us",
            Spread::of(&floor50),
        ),
        Row::new(
            1,
            "floor: tonic bidi round trip p99",
            "us",
            Spread::of(&floor99),
        ),
    ];
    for c in &cases {
        let (t50, t99) = if c.figure == 2 {
            (
                Some(Target::ratio_at_most(1.25)),
                Some(Target::ratio_at_most(1.5)),
            )
        } else {
            (None, None)
        };
        let name = |q: &str| format!("per-event overhead {q}, {} (N={})", c.label, c.events);
        let mut r = Row::new(c.figure, name("p50"), "us", Spread::of(&c.p50)).against(
            "floor p50",
            Spread::of(&floor50),
            &c.r50,
        );
        if let Some(t) = t50 {
            r = r.target(t);
        }
        rows.push(r);
        let mut r = Row::new(c.figure, name("p99"), "us", Spread::of(&c.p99)).against(
            "floor p99",
            Spread::of(&floor99),
            &c.r99,
        );
        if let Some(t) = t99 {
            r = r.target(t);
        }
        rows.push(r);
    }
    rows
}
