//! Every buffer is bounded and every size limit enforced: the run-event
//! queue to a client, approvals of runs that ended, oversized client input,
//! hook-supplied sizes, and the log under a hook outage.

mod support;

use std::sync::Arc;
use std::time::Duration;

use hookwire::agent::events::RunEvent;
use hookwire::agent::outcome::RunOutcome;
use hookwire::auth::Principal;
use hookwire::config::Config;
use hookwire::engine::{Engine, RunHandle};
use hookwire::telemetry::Instruments;
use support::memory_engine as engine;
use support::*;

/// An engine on `yaml` with its hooks described, as `serve` builds it.
async fn start(e: &Arc<Engine>, input: &str) -> RunHandle {
    start_streaming(e, input, true).await
}

/// `streaming` false: as `Invoke` starts a run.
async fn start_streaming(e: &Arc<Engine>, input: &str, streaming: bool) -> RunHandle {
    let s = e
        .create_session(&Principal::anonymous(), "a", vec![], Default::default())
        .await
        .unwrap();
    e.start_run(
        &Principal::anonymous(),
        &s.id,
        input.into(),
        streaming,
        Default::default(),
        None,
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_client_that_stops_reading_ends_its_run_instead_of_growing_a_queue() {
    let e = engine(&format!(
        "{}server:\n  run_event_buffer: 16\n  client_stall_timeout: 200ms\n",
        config(&[], "")
    ))
    .await;
    // The scripted model echoes the input in 12-character deltas: one model
    // call produces ~90 events, far more than the queue holds (they are
    // merged), and the run then waits for a client that never reads.
    let mut h = start(&e, &"x".repeat(1000)).await;
    let report = h.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert!(
        report.reason.contains("read none")
            && report.reason.contains("server.client_stall_timeout"),
        "{}",
        report.reason
    );
    let mut queued = 0;
    while h.events.recv().await.is_some() {
        queued += 1;
    }
    assert!(
        queued <= 16,
        "the queue never held more than its bound: {queued}"
    );
}

#[tokio::test]
async fn a_slow_client_slows_the_run_down_and_misses_nothing() {
    let owner = weather_owner().start().await;
    let e = engine(&format!(
        "{}server:\n  run_event_buffer: 16\n",
        config(&[("owner", &owner.addr, "")], "tools: [get_weather]")
    ))
    .await;
    // Three tool calls and a final answer: more events than the queue holds,
    // but no single step produces more than half of it.
    let mut h = start(&e, "three tools please").await;
    // Not reading at first: the run fills the queue past half and waits.
    while h.events.len() <= 8 {
        tokio::task::yield_now().await;
    }
    let mut events = Vec::new();
    while let Some(ev) = h.events.recv().await.map(|e| *e) {
        let last = matches!(ev, RunEvent::Finished(_));
        events.push(ev);
        if last {
            break;
        }
    }
    let Some(RunEvent::Finished(report)) = events.last() else {
        panic!("no Finished event: {events:?}")
    };
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    assert!(
        events.len() > 16,
        "more events than the queue holds: {}",
        events.len()
    );
    let results = events
        .iter()
        .filter(|e| matches!(e, RunEvent::ToolResult { .. }))
        .count();
    assert_eq!(results, 3);
    assert_eq!(h.task.await.unwrap(), report.clone());
}

/// The run's last check finds a fault (a failed-open hook's duplicate
/// `turn_end` verdict, after its answer) while the queue is full of the
/// run's last events (the answer's text, held for the blocking turn_end
/// hooks and released at once): its `hook_verdict` waits for room like
/// them. It was queued without waiting, refused and lost: a slow client
/// missed a verdict the run's report lists.
#[tokio::test]
async fn a_slow_client_gets_every_hook_verdict_of_the_runs_end_in_order() {
    use hookwire::hooks::failure::FailureClass;
    use hookwire::pb::{self, EventKind as K};
    use support::fault::{FaultHook, Misbehave};
    let (logs, _guard) = support::logwatch::LogWatch::install("info,hookwire::hooks::stream=debug");
    let (broken, _b) = FaultHook::new(K::TurnEnd, Misbehave::Status, &[])
        .start()
        .await;
    let release = Arc::new(tokio::sync::Notify::new());
    let mut twice = FaultHook::new(K::TurnEnd, Misbehave::Duplicate, &[]);
    twice.release = Some(release.clone());
    let (twice, _t) = twice.start().await;
    // The chain's last hook: the duplicate goes out while it is called,
    // and it answers once hookwire read it, so only the run's last check
    // (after the chain) can find it.
    let last = FnHook::new("last", &[K::TurnEnd])
        .on_turn_end(move |_, _| {
            let (release, logs) = (release.clone(), logs.clone());
            async move {
                release.notify_one();
                logs.wait_for(&["hook stream fault", "hook=twice", "class=duplicate"])
                    .await;
                hookwire::hook_server::Reply::new(pb::TurnEndVerdict {
                    action: Some(pb::turn_end_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let e = engine(&format!(
        "{}server:\n  run_event_buffer: 16\n",
        config(
            &[
                ("broken", &broken, "failure: open"),
                ("twice", &twice, "failure: open"),
                ("last", &last.addr, ""),
            ],
            "",
        )
    ))
    .await;
    // ~30 deltas of 12 characters.
    let mut h = start(&e, &"z".repeat(320)).await;
    let mut events = Vec::new();
    while let Some(ev) = h.events.recv().await.map(|e| *e) {
        events.push(ev);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = h.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    assert!(
        report
            .hook_verdicts
            .iter()
            .any(|v| v.hook == "twice" && v.failed_open == Some(FailureClass::Duplicate)),
        "the run's last check found the duplicate: {:?}",
        report.hook_verdicts
    );
    let got: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::HookVerdict(v) => Some(v.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(got, report.hook_verdicts, "every verdict, in order");
    assert!(
        matches!(events.last(), Some(RunEvent::Finished(r)) if *r == report),
        "finished comes last: {:?}",
        events.last()
    );
}

async fn approval_pending(h: &mut RunHandle) {
    while let Some(ev) = h.events.recv().await.map(|e| *e) {
        if matches!(ev, RunEvent::ApprovalRequested { .. }) {
            return;
        }
    }
    panic!("the run ended without asking");
}

#[tokio::test]
async fn approvals_are_withdrawn_when_their_run_is_cancelled_or_times_out() {
    let owner = weather_owner().start().await;
    let ask = asker("may I?", 0).start().await;
    for (agent_extra, want) in [
        ("tools: [get_weather]", RunOutcome::Cancelled),
        (
            "tools: [get_weather]\nrun_timeout: 500ms",
            RunOutcome::TimedOut,
        ),
    ] {
        let e = engine(&config(
            &[("owner", &owner.addr, ""), ("asker", &ask.addr, "")],
            agent_extra,
        ))
        .await;
        let mut h = start(&e, "weather please").await;
        approval_pending(&mut h).await;
        assert_eq!(e.pending_approvals(), 1);
        if want == RunOutcome::Cancelled {
            e.cancel_run(&Principal::anonymous(), &h.run_id)
                .await
                .unwrap();
        }
        let report = h.task.await.unwrap();
        assert_eq!(report.outcome, want, "{}", report.reason);
        assert_eq!(e.pending_approvals(), 0, "withdrawn with its run ({want})");
        let call_id = "call_1_0";
        assert!(
            e.resolve_approval(
                &Principal::anonymous(),
                &h.run_id,
                call_id,
                true,
                String::new()
            )
            .await
            .is_err(),
            "nothing left to answer"
        );
    }
    drop((owner, ask));
}

#[tokio::test]
async fn the_run_waits_for_room_before_a_step_until_the_client_reads() {
    use futures::FutureExt;
    use hookwire::agent::approvals::Approvals;
    use hookwire::agent::ledger::Ledger;
    use hookwire::agent::runner::{AgentRuntime, Run};
    use hookwire::hooks::dispatch::RunHooks;
    use hookwire::hooks::registry::HookRegistry;
    use hookwire::store::{MemoryStore, NewSession, SessionStore};

    let config = Config::parse(&config(&[], ""), "test config").unwrap();
    let models = hookwire::server::build_models(&config).unwrap();
    let inst = Instruments::new(&config.telemetry);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let store: Arc<dyn SessionStore> = Arc::new(MemoryStore::new(Default::default()));
    let session = store
        .create_session(&NewSession {
            id: "s".into(),
            agent: "a".into(),
            owner: hookwire::session::ANONYMOUS.into(),
            extra_hooks: vec![],
            metadata: Default::default(),
        })
        .await
        .unwrap();
    let lease = store.begin_run(&session.id, "r", "test").await.unwrap();
    let run = Run::new(
        "r".into(),
        "s".into(),
        Arc::new(AgentRuntime {
            config: config.agents[0].clone(),
            model: models["m"].clone(),
        }),
        RunHooks::new(
            vec![],
            Default::default(),
            deadline,
            Duration::from_secs(1),
            inst.clone(),
        ),
        Arc::new(HookRegistry::new(&config).unwrap()),
        true,
        Arc::new(Approvals::default()),
        deadline,
        tx,
        inst,
        Ledger::new(store, lease),
    );
    for turn in 0..9 {
        run.emit(RunEvent::TurnStarted { turn });
    }
    // 9 of 16 queued: less than half is free, so the next step waits.
    assert!(run.wait_for_room().now_or_never().is_none(), "waits");
    rx.recv().await.unwrap();
    assert!(
        run.wait_for_room().now_or_never().is_some(),
        "half free again"
    );
    // `deliver` waits for a free slot instead of failing the run.
    for turn in 0..8 {
        run.emit(RunEvent::TurnStarted { turn });
    }
    assert_eq!(rx.len(), 16);
    let mut delivering = Box::pin(run.deliver(RunEvent::TurnStarted { turn: 99 }));
    assert!((&mut delivering).now_or_never().is_none(), "full: waits");
    rx.recv().await.unwrap();
    delivering.await;
    assert_eq!(rx.len(), 16);
    // Deltas that find the queue full are merged, not dropped, and go first
    // once there is room.
    for text in ["a", "b", "c"] {
        run.emit(RunEvent::TextDelta {
            turn: 1,
            text: text.into(),
        });
    }
    assert!(!run.cancel.is_cancelled(), "deltas never overflow");
    while !rx.is_empty() {
        rx.recv().await.unwrap();
    }
    run.deliver(RunEvent::TurnStarted { turn: 100 }).await;
    assert_eq!(
        rx.recv().await.map(|e| *e),
        Some(RunEvent::TextDelta {
            turn: 1,
            text: "abc".into()
        })
    );
    assert_eq!(
        rx.recv().await.map(|e| *e),
        Some(RunEvent::TurnStarted { turn: 100 })
    );
    // Any other event that finds the queue full ends the run, naming the
    // limit.
    for turn in 0..16 {
        run.emit(RunEvent::TurnStarted { turn });
    }
    assert!(!run.cancel.is_cancelled());
    run.emit(RunEvent::TurnStarted { turn: 101 });
    assert!(run.cancel.is_cancelled(), "overflow cancels the run");
}

#[tokio::test]
async fn oversized_input_gets_invalid_argument_naming_the_limit() {
    let server = TestServer::start(&config(&[], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    for size in [5 * 1024 * 1024, 300 * 1024] {
        let req = || hookwire::pb::RunRequest {
            session_id: s.clone(),
            input: "x".repeat(size),
        };
        let invoked = c.invoke(req()).await.unwrap_err();
        let ran = c.run(req()).await.map(|_| ()).unwrap_err();
        for err in [invoked, ran] {
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{size}: {err:?}");
            assert!(
                err.message().contains("server.max_input_bytes")
                    && err.message().contains("262144"),
                "{size}: {}",
                err.message()
            );
        }
    }
    // The session is still usable.
    assert_eq!(
        invoke(&mut c, &s, "hi").await.outcome,
        hookwire::pb::RunOutcome::Completed as i32
    );
    server.stop().await;
}

#[tokio::test]
async fn bytes_that_are_not_the_request_message_get_invalid_argument() {
    let server = TestServer::start(&config(&[], "")).await;
    server.client().await;
    let channel = tonic::transport::Channel::from_shared(server.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Field 1 (session_id) as a varint-length string that runs off the end.
    let garbage = vec![0x0a, 0xff, 0x01, b'x'];
    let err = support::raw::unary(channel.clone(), "Invoke", garbage.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("not a valid message"),
        "{}",
        err.message()
    );
    let err = support::raw::streaming(channel, "Run", garbage)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    server.stop().await;
}

#[tokio::test]
async fn a_runs_scratchpad_has_a_total_cap() {
    use hookwire::hook_server::Reply;
    let proceed_start = || hookwire::pb::RunStartVerdict {
        action: Some(hookwire::pb::run_start_verdict::Action::Proceed(
            hookwire::pb::Continue {},
        )),
    };
    let proceed_request = || hookwire::pb::ModelRequestVerdict {
        action: Some(hookwire::pb::model_request_verdict::Action::Proceed(
            hookwire::pb::Continue {},
        )),
    };
    // Each value is under the cap; together they are over it.
    let big = vec![7u8; 600 * 1024];
    let (a, b) = (big.clone(), big);
    let pad = FnHook::new(
        "pad",
        &[
            hookwire::pb::EventKind::RunStart,
            hookwire::pb::EventKind::ModelRequest,
        ],
    )
    .on_run_start(move |_, _| {
        let a = a.clone();
        async move { Reply::new(proceed_start()).set("pad.a", a) }
    })
    .on_model_request(move |_, _| {
        let b = b.clone();
        async move { Reply::new(proceed_request()).set("pad.b", b) }
    })
    .start()
    .await;
    let server = TestServer::start(&config(&[("pad", &pad.addr, "")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(
        outcome(&r),
        hookwire::pb::RunOutcome::HookFailed,
        "{}",
        r.reason
    );
    assert!(
        r.reason
            .contains("failed on model_request: invalid_verdict")
            && r.reason.contains("scratchpad")
            && r.reason.contains("1048576"),
        "{}",
        r.reason
    );
    server.stop().await;
}

#[tokio::test]
async fn a_call_tool_timeout_is_classed_deadline_every_time() {
    // The tool never answers: hookwire's timer and the channel's own timer
    // for the call's grpc-timeout race for the same deadline.
    let owner = FnHook::new("owner", &[])
        .with_tool(weather_tool(), |_, _| async {
            std::future::pending::<hookwire::pb::CallToolResponse>().await
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, "timeout: 100ms")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    for _ in 0..5 {
        let s = session(&mut c, "a").await;
        let r = invoke(&mut c, &s, "weather please").await;
        assert_eq!(
            outcome(&r),
            hookwire::pb::RunOutcome::Completed,
            "{}",
            r.reason
        );
        assert!(
            r.final_text
                .contains("tool `get_weather` failed to execute: deadline:"),
            "{}",
            r.final_text
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn a_burst_of_deltas_larger_than_the_queue_reaches_a_reading_client_whole() {
    let server = TestServer::start(&format!(
        "{}server:\n  run_event_buffer: 16\n",
        config(&[], "")
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    // ~250 deltas produced in one go by the model, against a 16-event queue.
    let input = "y".repeat(3000);
    let events = run_events(&mut c, &s, &input).await;
    let r = result_of(&events);
    assert_eq!(
        outcome(&r),
        hookwire::pb::RunOutcome::Completed,
        "{}",
        r.reason
    );
    let streamed: String = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(hookwire::pb::run_event::Event::TextDelta(d)) => Some(d.text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(streamed, r.final_text, "every delta's text, in order");
    server.stop().await;
}

#[tokio::test]
async fn an_invoke_run_queues_its_report_and_nothing_else() {
    let owner = weather_owner().start().await;
    let e = engine(&config(
        &[("owner", &owner.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    // Two turns, three tool calls: a Run client would read dozens of events.
    let mut h = start_streaming(&e, "weather in Paris, Oslo and Rome", false).await;
    let report = (&mut h.task).await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    let mut queued = Vec::new();
    while let Some(ev) = h.events.recv().await {
        queued.push(*ev);
    }
    assert_eq!(queued, vec![RunEvent::Finished(report)]);
}

#[tokio::test]
async fn an_invoke_caller_that_leaves_ends_its_run() {
    use hookwire::hook_server::Reply;
    use hookwire::pb;
    // run_start waits until the caller has gone.
    let (arrived, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (a, r) = (arrived.clone(), release.clone());
    let hook = FnHook::new("h", &[pb::EventKind::RunStart])
        .on_run_start(move |_, _| {
            let (a, r) = (a.clone(), r.clone());
            async move {
                a.notify_one();
                r.notified().await;
                Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let e = engine(&config(&[("h", &hook.addr, "")], "")).await;
    let h = start_streaming(&e, "hello", false).await;
    arrived.notified().await;
    // The caller leaves: tonic drops its handler, and with it the events.
    drop(h.events);
    release.notify_one();
    let report = h.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Cancelled, "{}", report.reason);
    assert!(
        report.reason.contains("client disconnected"),
        "{}",
        report.reason
    );
}

/// A final answer whose events find the client's queue full (its deltas,
/// held for the blocking turn_end hook and released at once) no longer
/// keeps the session busy until the client reads them: the run's end is
/// recorded first, and the answer's events wait with the run's last ones.
/// They were delivered before the end was recorded, so a client that
/// stopped reading held the session for `server.client_stall_timeout`.
#[tokio::test]
async fn a_final_answer_a_slow_client_has_not_read_leaves_the_session_free() {
    let unread = UnreadEnd::start().await;
    let mut h = unread.run;
    let mut events = Vec::new();
    while let Some(ev) = h.events.recv().await.map(|e| *e) {
        events.push(ev);
    }
    let report = h.task.await.unwrap();
    assert_eq!(report.outcome, RunOutcome::Completed, "{}", report.reason);
    let text: String = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::TextDelta { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(text, report.final_text, "every delta reached the client");
    assert!(
        events
            .iter()
            .any(|e| matches!(e, RunEvent::AssistantMessage { .. })),
        "{events:?}"
    );
    assert!(matches!(events.last(), Some(RunEvent::Finished(r)) if *r == report));
}
