//! The hook protocol as hookwire speaks it, read off the wire by a scripted
//! hook server: one `Process` stream per run per hook with unique increasing
//! seqs, session events on short streams of their own, Describe again after
//! a reconnect, late verdicts discarded and counted, and the scratchpad
//! written only by verdicts hookwire accepted.

mod support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hookwire::hook_server::Reply;
use hookwire::pb;
use pb::EventKind as K;
use support::fault::proceed;
use support::script::{continue_blocking, ScriptHook};
use support::*;

/// Generous bound for things that take milliseconds: only a bug reaches it.
const BOUND: Duration = Duration::from_secs(30);

fn verdict(seq: u64, v: pb::hook_verdict::Verdict) -> pb::HookVerdict {
    pb::HookVerdict {
        seq,
        verdict: Some(v),
        ..Default::default()
    }
}

fn set(key: &str) -> pb::ScratchpadUpdate {
    pb::ScratchpadUpdate {
        key: key.into(),
        op: Some(pb::scratchpad_update::Op::Set(b"x".to_vec())),
    }
}

fn kind(ev: &pb::HookEvent) -> K {
    K::try_from(ev.kind).unwrap()
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn one_process_stream_per_run_with_increasing_seqs_and_short_session_streams() {
    let all = [
        K::SessionStart,
        K::RunStart,
        K::ModelRequest,
        K::TextDelta,
        K::ModelResponse,
        K::InvalidToolCall,
        K::ToolCall,
        K::ToolResult,
        K::TurnEnd,
        K::RunEnd,
        K::SessionEnd,
    ];
    let rec = ScriptHook::new("rec", &all, continue_blocking);
    let rec_server = rec.start().await;
    let owner = weather_owner().start().await;
    let server = TestServer::start(&config(
        &[("rec", &rec_server.addr, ""), ("owner", &owner.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut run_ids = Vec::new();
    for input in ["weather", "two tools", "hello"] {
        let events = run_events(&mut c, &s, input).await;
        assert_eq!(
            outcome(&result_of(&events)),
            pb::RunOutcome::Completed,
            "{input}"
        );
        run_ids.push(events[0].run_id.clone());
    }
    c.delete_session(pb::DeleteSessionRequest { session_id: s })
        .await
        .unwrap();
    // Observe events and half-closes are not awaited by the runs.
    tokio::time::timeout(
        BOUND,
        rec.wait_until(|s| s.len() == 5 && s.iter().all(|s| s.half_closed)),
    )
    .await
    .unwrap_or_else(|_| panic!("streams: {:#?}", rec.streams()));
    let streams = rec.streams();

    for (i, only) in [(0, "session_start"), (4, "session_end")] {
        assert_eq!(streams[i].kinds(), [only], "stream {i}");
        assert_eq!(streams[i].run_ids(), [""], "{only} is outside any run");
    }
    for (i, run_id) in run_ids.iter().enumerate() {
        let st = &streams[i + 1];
        let kinds = st.kinds();
        assert_eq!(kinds.first().map(String::as_str), Some("run_start"));
        assert_eq!(kinds.last().map(String::as_str), Some("run_end"));
        assert!(
            st.run_ids().iter().all(|r| r == run_id),
            "run {run_id}: every event on its own stream: {:?}",
            st.run_ids()
        );
        let seqs = st.seqs();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "seqs unique and increasing: {seqs:?}"
        );
    }
    // The tool runs had their several blocking events on their one stream.
    assert!(streams[1].kinds().contains(&"tool_result".to_string()));
    assert_eq!(
        streams[2]
            .kinds()
            .iter()
            .filter(|k| *k == "tool_call")
            .count(),
        2
    );
    server.stop().await;
}

#[tokio::test]
async fn hooks_are_described_again_after_a_reconnect() {
    // One listening socket for both incarnations, so the restarted server
    // is at the same address and no other process can take the port.
    let socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    socket.set_nonblocking(true).unwrap();
    let listener = || tokio::net::TcpListener::from_std(socket.try_clone().unwrap()).unwrap();

    let v1 = ScriptHook::new("hook-v1", &[K::RunStart], continue_blocking);
    let first = v1.serve(listener());
    let server = TestServer::start(&config(&[("h", &first.addr, "")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    assert_eq!(
        outcome(&invoke(&mut c, &s, "hi").await),
        pb::RunOutcome::Completed
    );
    assert_eq!(v1.streams()[0].kinds(), ["run_start"]);
    first.stop().await;

    // The restarted server says something else about itself.
    let v2 = ScriptHook::new(
        "hook-v2",
        &[K::RunStart, K::ModelRequest],
        continue_blocking,
    );
    let _second = v2.serve(listener());
    tokio::time::timeout(BOUND, v2.wait_described())
        .await
        .expect("hookwire never called Describe on the restarted hook server");
    // Describe was answered; wait until hookwire took the answer in.
    let info = tokio::time::timeout(BOUND, async {
        loop {
            let hooks = c
                .list_hooks(pb::ListHooksRequest {})
                .await
                .unwrap()
                .into_inner()
                .hooks;
            if hooks[0].server_name == "hook-v2" {
                return hooks[0].clone();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("ListHooks shows the new Describe");
    assert_eq!(
        info.events,
        [K::RunStart as i32, K::ModelRequest as i32],
        "the new subscriptions"
    );
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(v2.streams()[0].kinds(), ["run_start", "model_request"]);
    server.stop().await;
}

#[tokio::test]
async fn late_verdicts_are_discarded_and_counted() {
    // The first model_request is answered only once the second arrives,
    // i.e. after hookwire gave up on it: late by construction, not by a
    // timer race. The late answer would end the run if it were applied.
    // Every other answer comes at once: 2 s is far beyond it.
    let late = ScriptHook::new("late", &[K::ModelRequest], |ev| {
        if ev.seq == 1 {
            return vec![];
        }
        let terminate = pb::hook_verdict::Verdict::ModelRequest(pb::ModelRequestVerdict {
            action: Some(pb::model_request_verdict::Action::Terminate(
                hookwire::hook_server::terminate("too late to matter", None),
            )),
        });
        let mut out = vec![verdict(1, terminate)];
        out.extend(continue_blocking(ev));
        out
    });
    let late_server = late.start().await;
    let owner = weather_owner().start().await;
    let (server, admin) = TestServer::start_with_admin(&config(
        &[
            (
                "late",
                &late_server.addr,
                "timeout: 2s\nfailure: open\ndetach_on_failure: false",
            ),
            ("owner", &owner.addr, ""),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(r.final_text, "Tool said: sunny in Paris");
    assert!(
        r.hook_verdicts
            .iter()
            .any(|v| v.hook == "late" && v.failed_open == "deadline"),
        "{:?}",
        r.hook_verdicts
    );
    assert_eq!(late.streams()[0].seqs(), [1, 2], "both on one stream");
    let metrics = http_get(admin, "/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            r#"hookwire_hook_late_verdicts_total{hook="late"}"#
        ),
        1.0,
        "{metrics}"
    );
    server.stop().await;
}

#[tokio::test]
async fn scratchpad_changes_come_only_from_accepted_verdicts() {
    // A fail-open hook whose every rejected verdict carries a scratchpad
    // write: a wrong kind (run_start), an invalid patch (model_request,
    // turn 1), a late answer (tool_call, sent after hookwire gave up). Only
    // its valid turn-2 model_request verdict may write.
    let writer = ScriptHook::new(
        "writer",
        &[K::RunStart, K::ModelRequest, K::ToolCall],
        |ev| {
            let with = |mut v: pb::HookVerdict, key: &str| {
                v.scratchpad.push(set(key));
                v
            };
            match (kind(ev), ev.context.as_ref().unwrap().turn) {
                (K::RunStart, _) => vec![with(verdict(ev.seq, proceed(K::ToolCall)), "wrong_kind")],
                (K::ModelRequest, 1) => vec![with(
                    verdict(
                        ev.seq,
                        pb::hook_verdict::Verdict::ModelRequest(pb::ModelRequestVerdict {
                            action: Some(pb::model_request_verdict::Action::PatchRequest(
                                pb::RequestPatch {
                                    active_tools: Some(pb::ToolNames {
                                        names: vec!["not_offered".into()],
                                    }),
                                    ..Default::default()
                                },
                            )),
                        }),
                    ),
                    "invalid",
                )],
                // Held back: answered late with the next event.
                (K::ToolCall, _) => vec![],
                (K::ModelRequest, _) => vec![
                    with(verdict(ev.seq - 1, proceed(K::ToolCall)), "late"),
                    with(verdict(ev.seq, proceed(K::ModelRequest)), "accepted"),
                ],
                other => panic!("not subscribed: {other:?}"),
            }
        },
    );
    // An observe-mode hook answering every event it gets, with a write.
    let observer = ScriptHook::new(
        "observer",
        &[K::RunStart, K::ModelRequest, K::ToolCall, K::ToolResult],
        |ev| {
            let mut v = verdict(ev.seq, proceed(kind(ev)));
            v.scratchpad.push(set("observer"));
            vec![v]
        },
    );
    let seen = Arc::new(Mutex::new(None::<BTreeSet<String>>));
    let s2 = seen.clone();
    let reader = FnHook::new("reader", &[K::TurnEnd]).on_turn_end(move |ctx, _| {
        *s2.lock().unwrap() = Some(ctx.scratchpad.keys().cloned().collect());
        async {
            Reply::new(pb::TurnEndVerdict {
                action: Some(pb::turn_end_verdict::Action::Proceed(pb::Continue {})),
            })
        }
    });
    let (w, o, rd) = (
        writer.start().await,
        observer.start().await,
        reader.start().await,
    );
    let owner = weather_owner().start().await;
    let server = TestServer::start(&config(
        &[
            (
                "writer",
                &w.addr,
                "timeout: 2s\nfailure: open\ndetach_on_failure: false",
            ),
            ("observer", &o.addr, "mode: observe"),
            ("reader", &rd.addr, ""),
            ("owner", &owner.addr, ""),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    let failed = |hook: &str| -> Vec<(String, &str)> {
        r.hook_verdicts
            .iter()
            .filter(|v| v.hook == hook && !v.failed_open.is_empty())
            .map(|v| (support::script::kind_name(v.event), v.failed_open.as_str()))
            .collect()
    };
    assert_eq!(
        failed("writer"),
        [
            ("run_start".to_string(), "wrong_kind"),
            ("model_request".to_string(), "invalid_verdict"),
            ("tool_call".to_string(), "deadline")
        ],
        "every rejection happened"
    );
    // The observer's answer to run_start (an event that expects no verdict)
    // breaks its stream: reported once, as the fault it is, and the run
    // goes on (observe-mode failures never fail a run).
    assert_eq!(
        failed("observer"),
        [("run_start".to_string(), "spurious")],
        "the observer's spurious verdict is reported, never applied"
    );
    assert!(!observer.streams().is_empty(), "the observer got events");
    assert_eq!(
        seen.lock().unwrap().clone(),
        Some(BTreeSet::from(["accepted".to_string()]))
    );
    server.stop().await;
}
