//! A fixed amount of one kind of work, for `valgrind --tool=callgrind`:
//! instruction counts are repeatable where wall time is not. Run it twice
//! with different counts; the difference divided by the difference in
//! count is the cost of one unit, with set-up cancelled out.
//!
//! ```sh
//! valgrind --tool=callgrind target/release/deps/hookwire-HASH --profile hooked-tools 200
//! ```

use crate::floor::Floor;
use crate::remote::Remote;
use crate::rig::{self, Extent, Rig, Variant};
use crate::service;

fn variant(name: &str) -> Option<Variant> {
    Some(match name {
        "bare-chat" => rig::BARE_CHAT,
        "bare-tools" => rig::BARE_TOOLS,
        "hooked-chat" => rig::HOOKED_CHAT,
        "hooked-tools" => rig::HOOKED_TOOLS,
        "mr1" => rig::merged(1),
        "mr8" => rig::merged(8),
        "tr1" => rig::chained(1),
        "tr8" => rig::chained(8),
        _ => return None,
    })
}

/// `remote`: the child process of `--remote` (remote.rs).
pub async fn run(what: &str, count: usize, remote: Option<&Remote>) {
    // The lean rig (no Python, no fan-out hooks) keeps start-up out of
    // process-wide counters such as `perf stat` or `time`.
    let lean = std::env::args().any(|a| a == "--lean");
    if what.starts_with("floor") {
        // The lean rig (in this process) only for the floor's message: a
        // real event of the in-process hook's samples, the same as the
        // other figures' floor; its start-up cancels in a difference.
        let rig = Rig::start(Extent::Lean).await;
        let floor = match remote {
            Some(r) => Floor::connect(r.floor.clone(), rig.typical_event.clone()),
            None => Floor::start(rig.typical_event.clone()).await,
        };
        match what {
            "floor-open" => floor.open_streams(count).await,
            "floor-64" => floor.concurrent_pings(64, count).await,
            _ => {
                floor.round_trips(count).await;
            }
        }
        return;
    }
    let mut rig = match remote {
        Some(r) => Rig::start_remote(&r.hook, &r.fan).await,
        None => Rig::start(if lean { Extent::Lean } else { Extent::Full }).await,
    };
    // 64 clients at once (`--clients N` for another number), `count` runs
    // in all.
    if let Some(v) = what.strip_prefix("concurrent-").and_then(variant) {
        let args: Vec<String> = std::env::args().collect();
        let clients = args
            .iter()
            .position(|a| a == "--clients")
            .and_then(|i| args.get(i + 1))
            .map(|n| n.parse::<usize>().expect("--clients takes a number"))
            .unwrap_or(64)
            .max(1);
        let sessions = service::sessions(&rig.client, v.agent, count).await;
        let tasks: Vec<_> = sessions
            .chunks(count.div_ceil(clients))
            .map(|chunk| {
                let (mut client, chunk) = (rig.client.clone(), chunk.to_vec());
                tokio::spawn(async move {
                    for s in chunk {
                        let (_, r) = service::invoke(&mut client, &s, v.input).await;
                        service::assert_completed(&r, v.agent);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        return;
    }
    let v = variant(what).unwrap_or_else(|| {
        panic!("--profile takes floor, floor-open, floor-64, [concurrent-]bare-chat, bare-tools, hooked-chat, hooked-tools, mr1, mr8, tr1 or tr8")
    });
    let sessions = service::sessions(&rig.client, v.agent, count).await;
    for s in &sessions {
        let (_, r) = service::invoke(&mut rig.client, s, v.input).await;
        service::assert_completed(&r, v.agent);
    }
}
