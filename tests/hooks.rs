//! The hook engine over real gRPC: every event fires at its point, every
//! verdict kind has its effect, chains thread rewrites in priority order,
//! model_request hooks run concurrently and merge, observe hooks never block.

mod support;

use std::sync::Arc;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use pb::EventKind as K;
use support::fault::{FaultHook, Misbehave};
use support::*;

fn proceed_run_start() -> Reply<pb::RunStartVerdict> {
    Reply::new(pb::RunStartVerdict {
        action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
    })
}

fn tool_hook(name: &str, events: &[K]) -> FnHook {
    FnHook::new(name, events).with_tool(weather_tool(), |_, call| async move {
        let args: serde_json::Value = serde_json::from_str(&call.arguments_json).unwrap();
        pb::CallToolResponse {
            content: format!("sunny in {}", args["city"].as_str().unwrap_or("?")),
            is_error: false,
        }
    })
}

#[tokio::test]
async fn every_event_fires_at_its_point_in_order() {
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
    let hook = tool_hook("rec", &all).start().await;
    let server =
        TestServer::start(&config(&[("rec", &hook.addr, "")], "tools: [get_weather]")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = result_of(&run_events(&mut c, &s, "what's the weather?").await);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(r.final_text, "Tool said: sunny in Paris");
    c.delete_session(pb::DeleteSessionRequest { session_id: s })
        .await
        .unwrap();
    // Observe events are fire-and-forget; wait until the last one landed.
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        hook.hook.wait_for("session_end"),
    )
    .await
    .expect("session_end reaches the hook");
    let mut seen = hook.hook.seen_kinds();
    seen.dedup(); // several text deltas in a row
    assert_eq!(
        seen,
        [
            "session_start",
            "run_start",
            "model_request",
            "model_response",
            "tool_call",
            "tool_result",
            "model_request",
            "text_delta",
            "model_response",
            "turn_end",
            "run_end",
            "session_end"
        ]
    );
    // Every run event carried the same run id (how they travel, one stream
    // per run with increasing seqs, is read off the wire in protocol.rs).
    let runs: std::collections::HashSet<String> = hook
        .hook
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind != K::SessionStart as i32 && e.kind != K::SessionEnd as i32)
        .map(|e| e.context.as_ref().unwrap().run_id.clone())
        .collect();
    assert_eq!(runs.len(), 1);
    assert_eq!(hook.hook.tool_calls.lock().unwrap().len(), 1);
    server.stop().await;
}

#[tokio::test]
async fn invalid_tool_call_fires_and_default_lists_available_tools() {
    let hook = tool_hook("rec", &[K::InvalidToolCall]).start().await;
    let server =
        TestServer::start(&config(&[("rec", &hook.addr, "")], "tools: [get_weather]")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "bogus please").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
    assert!(
        r.final_text.contains("unknown tool `no_such_tool`"),
        "{}",
        r.final_text
    );
    assert!(r.final_text.contains("Available tools: get_weather"));
    assert_eq!(hook.hook.seen_kinds(), ["invalid_tool_call"]);
    server.stop().await;
}

#[tokio::test]
async fn chain_threads_rewrites_in_priority_order_with_provenance() {
    let suffix = |tag: &'static str| {
        FnHook::new(tag, &[K::RunStart]).on_run_start(move |_, ev| async move {
            Reply::new(hook_server::rewrite_input(format!("{}-{tag}", ev.input)))
                .reason(format!("tag {tag}"))
        })
    };
    let low = suffix("low").start().await;
    let high = suffix("high").start().await;
    let server = TestServer::start(&config(
        &[
            ("low", &low.addr, "priority: 1"),
            ("high", &high.addr, "priority: 5"),
        ],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "x").await;
    let r = result_of(&events);
    assert_eq!(r.final_text, "sys=base temp= user=x-high-low");
    assert_eq!(
        texts(&r.messages)[0],
        "x-high-low",
        "the rewritten input entered history"
    );
    let v = verdicts(&events);
    assert_eq!(
        v.iter().map(|v| v.hook.as_str()).collect::<Vec<_>>(),
        ["high", "low"]
    );
    assert_eq!(v[0].verdict_kind(), pb::VerdictKind::RewriteInput);
    assert_eq!(v[0].fields_changed, ["input"]);
    assert_eq!(v[0].reason, "tag high");
    // The second hook saw the first one's rewrite.
    let first = low.hook.seen.lock().unwrap()[0].clone();
    let Some(pb::hook_event::Payload::RunStart(ev)) = first.payload else {
        panic!()
    };
    assert_eq!(ev.input, "x-high");
    server.stop().await;
}

/// A run's `Process` stream starts with 1 KiB buffers each way
/// (hooks/codec.rs); verdicts and events many times larger still arrive
/// whole, in both directions and on one stream after a small message.
#[tokio::test]
async fn verdicts_and_events_larger_than_a_streams_first_buffers_arrive_whole() {
    let big = "b".repeat(40 * 1024);
    let grow = {
        let big = big.clone();
        FnHook::new("grow", &[K::RunStart]).on_run_start(move |_, ev| {
            let big = big.clone();
            async move { Reply::new(hook_server::rewrite_input(format!("{}{big}", ev.input))) }
        })
    }
    .start()
    .await;
    let see = FnHook::new("see", &[K::RunStart])
        .on_run_start(|_, _| async move { proceed_run_start() })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[
            ("grow", &grow.addr, "priority: 5"),
            ("see", &see.addr, "priority: 1"),
        ],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = result_of(&run_events(&mut c, &s, "x").await);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(texts(&r.messages)[0], format!("x{big}"));
    let seen = see.hook.seen.lock().unwrap()[0].clone();
    let Some(pb::hook_event::Payload::RunStart(ev)) = seen.payload else {
        panic!("not a run_start: {seen:?}")
    };
    assert_eq!(ev.input.len(), 1 + big.len());
    server.stop().await;
}

#[tokio::test]
async fn terminal_verdict_stops_the_chain_and_reply_is_the_answer() {
    let guard = FnHook::new("guard", &[K::RunStart])
        .on_run_start(|_, _| async {
            Reply::new(pb::RunStartVerdict {
                action: Some(pb::run_start_verdict::Action::Terminate(
                    hook_server::terminate(
                        "off-topic",
                        Some("I can only talk about weather.".into()),
                    ),
                )),
            })
        })
        .start()
        .await;
    let after = FnHook::new("after", &[K::RunStart]).start().await;
    let server = TestServer::start(&config(
        &[("guard", &guard.addr, ""), ("after", &after.addr, "")],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "tell me a joke").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Terminated);
    assert_eq!(r.final_text, "I can only talk about weather.");
    assert!(r.reason.contains("`guard`") && r.reason.contains("off-topic"));
    assert!(
        after.hook.seen_kinds().is_empty(),
        "later hooks are not called"
    );
    assert_eq!(r.turns, 0, "the model was never called");
    server.stop().await;
}

#[tokio::test]
async fn model_request_hooks_run_concurrently_and_patches_merge() {
    // Each hook waits until all three received the event: only concurrent
    // calls can pass this barrier.
    let barrier = Arc::new(tokio::sync::Barrier::new(3));
    let patcher = |name: &'static str, patch: pb::RequestPatch| {
        let b = barrier.clone();
        FnHook::new(name, &[K::ModelRequest]).on_model_request(move |_, _| {
            let (b, patch) = (b.clone(), patch.clone());
            async move {
                b.wait().await;
                Reply::new(hook_server::patch_request(patch))
            }
        })
    };
    let h1 = patcher(
        "p1",
        pb::RequestPatch {
            extra_context: vec!["doc1".into()],
            system_prompt: Some("S1".into()),
            ..Default::default()
        },
    )
    .start()
    .await;
    let h2 = patcher(
        "p2",
        pb::RequestPatch {
            extra_context: vec!["doc2".into()],
            system_prompt: Some("S2".into()),
            temperature: Some(0.25),
            ..Default::default()
        },
    )
    .start()
    .await;
    let h3 = patcher(
        "p3",
        pb::RequestPatch {
            temperature: Some(0.9),
            additional_params_json: r#"{"seed":7}"#.into(),
            ..Default::default()
        },
    )
    .start()
    .await;
    let server = TestServer::start(&config(
        &[
            ("p1", &h1.addr, "priority: 3"),
            ("p2", &h2.addr, "priority: 2"),
            ("p3", &h3.addr, "priority: 1"),
        ],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "hi").await;
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(r.final_text, "sys=S1\n\ndoc1\n\ndoc2 temp=0.25 user=hi");
    let v = verdicts(&events);
    let p2 = v.iter().find(|v| v.hook == "p2").unwrap();
    assert_eq!(
        p2.conflicts,
        vec![pb::PatchConflict {
            field: "system_prompt".into(),
            winner: "p1".into(),
            loser: "p2".into()
        }]
    );
    let p3 = v.iter().find(|v| v.hook == "p3").unwrap();
    assert_eq!(p3.conflicts[0].field, "temperature");
    assert_eq!(p3.fields_changed, ["additional_params"]);
    // Patches are per call: the transcript keeps the real system-free history.
    let sess = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(texts(&sess.transcript)[0], "hi");
    server.stop().await;
}

#[tokio::test]
async fn terminate_beats_respond_and_respond_skips_the_model() {
    let responder = FnHook::new("responder", &[K::ModelRequest])
        .on_model_request(|_, _| async {
            Reply::new(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::Respond(pb::Respond {
                    text: "canned".into(),
                    tool_calls: vec![],
                })),
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("responder", &responder.addr, "")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(r.final_text, "canned", "the scripted model was not called");
    assert_eq!(r.usage.unwrap().output_tokens, 0);
    server.stop().await;

    let terminator = FnHook::new("terminator", &[K::ModelRequest])
        .on_model_request(|_, _| async {
            Reply::new(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::Terminate(
                    hook_server::terminate("budget", None),
                )),
            })
        })
        .start()
        .await;
    // The responder fires first (higher priority) but terminate still wins.
    let server = TestServer::start(&config(
        &[
            ("responder", &responder.addr, "priority: 9"),
            ("terminator", &terminator.addr, ""),
        ],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Terminated);
    assert!(r.reason.contains("`terminator`: budget"));
    server.stop().await;
}

#[tokio::test]
async fn response_rewrite_retry_and_turn_end_continue_run() {
    let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let n = calls.clone();
    let reviewer = FnHook::new("reviewer", &[K::ModelResponse, K::TurnEnd])
        .on_model_response(move |_, ev| {
            let n = n.clone();
            async move {
                let text = ev
                    .response
                    .unwrap()
                    .message
                    .unwrap()
                    .blocks
                    .iter()
                    .filter_map(|b| match &b.kind {
                        Some(pb::block::Kind::Text(t)) => Some(t.text.clone()),
                        _ => None,
                    })
                    .collect::<String>();
                let action = match n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
                    0 => pb::model_response_verdict::Action::Retry(pb::Retry {
                        feedback: "try again".into(),
                    }),
                    _ => pb::model_response_verdict::Action::RewriteResponse(pb::RewriteResponse {
                        blocks: vec![pb::Block {
                            kind: Some(pb::block::Kind::Text(pb::TextBlock {
                                text: text.to_uppercase(),
                            })),
                        }],
                    }),
                };
                Reply::new(pb::ModelResponseVerdict {
                    action: Some(action),
                })
            }
        })
        .on_turn_end(|_, _| async {
            Reply::new(pb::TurnEndVerdict {
                action: Some(pb::turn_end_verdict::Action::ContinueRun(pb::ContinueRun {
                    message: "and more".into(),
                })),
            })
        })
        .start()
        .await;
    let server =
        TestServer::start(&config(&[("reviewer", &reviewer.addr, "")], "max_turns: 3")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "hi").await;
    let r = result_of(&events);
    // turn 1 retried, turn 2 rewritten then continue_run, turn 3 rewritten then continue_run -> max_turns
    assert_eq!(outcome(&r), pb::RunOutcome::MaxTurns);
    let t = texts(&r.messages);
    assert_eq!(
        t,
        [
            "hi",
            "try again",
            "SYS=BASE TEMP= USER=TRY AGAIN",
            "and more",
            "SYS=BASE TEMP= USER=AND MORE",
            "and more"
        ]
    );
    // With the default stream_deltas: hold, a rejected or rewritten answer's
    // text never reached the client: only the accepted (rewritten) text.
    let deltas: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(pb::run_event::Event::TextDelta(d)) => Some(d.text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        deltas,
        [
            "SYS=BASE TEMP= USER=TRY AGAIN",
            "SYS=BASE TEMP= USER=AND MORE"
        ],
        "one delta per accepted (rewritten) turn, none for the retried one"
    );
    server.stop().await;
}

#[tokio::test]
async fn tool_hooks_rewrite_args_skip_and_rewrite_results() {
    let owner = tool_hook("owner", &[]).start().await;
    let policy = FnHook::new("policy", &[K::ToolCall, K::ToolResult])
        .on_tool_call(|_, ev| async move {
            let call = ev.call.unwrap();
            if call.arguments_json.contains("Oslo") {
                Reply::new(hook_server::skip_tool("Oslo is off limits", true))
            } else {
                Reply::new(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::RewriteArgs(
                        pb::RewriteArgs {
                            arguments_json: r#"{"city":"Lyon"}"#.into(),
                        },
                    )),
                })
            }
        })
        .on_tool_result(|_, ev| async move {
            let content = ev.result.unwrap().content;
            Reply::new(hook_server::rewrite_result(
                content.replace("sunny", "[weather]"),
            ))
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("policy", &policy.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "two tools please").await;
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    let executed = owner.hook.tool_calls.lock().unwrap().clone();
    assert_eq!(executed.len(), 1, "the skipped call never executed");
    assert_eq!(executed[0].arguments_json, r#"{"city":"Lyon"}"#);
    let t = texts(&r.messages);
    assert_eq!(
        t[1], r#"call:get_weather({"city":"Paris"})"#,
        "history keeps the model's own call"
    );
    assert_eq!(t[2], r#"call:get_weather({"city":"Oslo"})"#);
    assert_eq!(t[3], "result:[weather] in Lyon");
    assert_eq!(t[4], "result:Oslo is off limits");
    // The execution-start event carries the effective arguments; none for the skip.
    let started: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(pb::run_event::Event::ToolStarted(s)) => {
                Some(s.call.clone().unwrap().arguments_json)
            }
            _ => None,
        })
        .collect();
    assert_eq!(started, [r#"{"city":"Lyon"}"#]);
    server.stop().await;
}

#[tokio::test]
async fn scratchpad_is_shared_across_hooks_and_events() {
    let writer = FnHook::new("writer", &[K::RunStart])
        .on_run_start(|_, _| async { proceed_run_start().set("tenant", "acme") })
        .start()
        .await;
    let reader = FnHook::new("reader", &[K::ModelRequest])
        .on_model_request(|ctx, _| async move {
            let tenant =
                String::from_utf8(ctx.scratchpad.get("tenant").cloned().unwrap_or_default())
                    .unwrap();
            Reply::new(hook_server::patch_request(pb::RequestPatch {
                extra_context: vec![format!("tenant={tenant}")],
                ..Default::default()
            }))
            .delete("tenant")
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("writer", &writer.addr, ""), ("reader", &reader.addr, "")],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(r.final_text, "sys=base\n\ntenant=acme temp= user=hi");
    server.stop().await;
}

#[tokio::test]
async fn observe_mode_hook_never_delays_the_run() {
    // The hook is stuck on everything it receives until the run is over:
    // a run that waited for it in any way could never finish, and its
    // one-hour timeout leaves no deadline to end the wait early.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (g1, g2) = (gate.clone(), gate.clone());
    let stuck = FnHook::new(
        "stuck",
        &[
            K::RunStart,
            K::ModelRequest,
            K::ModelResponse,
            K::TurnEnd,
            K::RunEnd,
        ],
    )
    .on_observe(move |_, _| {
        let g = g1.clone();
        async move {
            let _ = g.acquire().await;
        }
    })
    .on_run_start(move |_, _| {
        let g = g2.clone();
        async move {
            let _ = g.acquire().await;
            proceed_run_start()
        }
    })
    .start()
    .await;
    let server = TestServer::start(&config(
        &[("stuck", &stuck.addr, "mode: observe\ntimeout: 3600s")],
        "",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = tokio::time::timeout(std::time::Duration::from_secs(30), invoke(&mut c, &s, "hi"))
        .await
        .expect("the run waited for an observe-mode hook");
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
    assert!(r.hook_verdicts.is_empty(), "observers cannot steer");
    // It did get every event (each one then stuck), as observe events.
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        stuck.hook.wait_for("run_end"),
    )
    .await
    .expect("run_end reaches the observer");
    assert_eq!(
        stuck.hook.seen_kinds(),
        [
            "run_start",
            "model_request",
            "model_response",
            "turn_end",
            "run_end"
        ]
    );
    assert!(stuck
        .hook
        .seen
        .lock()
        .unwrap()
        .iter()
        .all(|e| !e.expects_verdict));
    gate.add_permits(100);
    server.stop().await;
}

#[tokio::test]
async fn wrong_kind_verdict_fails_the_run_closed() {
    // Answers a tool_call verdict to run_start.
    let (addr, _task) = FaultHook::new(K::RunStart, Misbehave::WrongKind, &[])
        .start()
        .await;
    let server = TestServer::start(&config(&[("wrong", &addr, "")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hi").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason
            .contains("hook `wrong` failed on run_start: wrong_kind: answered a tool_call verdict"),
        "{}",
        r.reason
    );
    assert!(r.messages.is_empty(), "the input never entered history");
    server.stop().await;
}

/// A closed hook that fails an event ends the run, and the run's report
/// (and a `Run` client's events) keeps what happened at that event before
/// it: the verdict of a hook earlier in a chain, a hook that failed open.
/// Both used to be dropped with the event. Under `model_request` (merged,
/// called together) the failed-open hook is kept likewise.
#[tokio::test]
async fn an_event_failed_closed_keeps_the_records_of_the_hooks_before_it() {
    for kind in [K::RunStart, K::ModelRequest] {
        let tagger = FnHook::new("tagger", &[K::RunStart])
            .on_run_start(|_, ev| async move {
                Reply::new(hook_server::rewrite_input(format!("{}!", ev.input))).reason("tagged")
            })
            .start()
            .await;
        let (flaky, _flaky) = FaultHook::new(kind, Misbehave::Status, &[]).start().await;
        let (wrong, _wrong) = FaultHook::new(kind, Misbehave::WrongKind, &[])
            .start()
            .await;
        let server = TestServer::start(&config(
            &[
                ("tagger", &tagger.addr, "priority: 3"),
                ("flaky", &flaky, "priority: 2\n    failure: open"),
                ("wrong", &wrong, "priority: 1"),
            ],
            "",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let events = run_events(&mut c, &s, "hi").await;
        let streamed = verdicts(&events);
        let r = result_of(&events);
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::HookFailed,
            "{kind:?}: {}",
            r.reason
        );
        assert!(r.reason.contains("hook `wrong` failed"), "{}", r.reason);
        let seen = |v: &[pb::HookVerdictApplied]| -> Vec<(String, pb::VerdictKind, String)> {
            v.iter()
                .map(|v| (v.hook.clone(), v.verdict_kind(), v.failed_open.clone()))
                .collect()
        };
        let expected = vec![
            (
                "tagger".to_string(),
                pb::VerdictKind::RewriteInput,
                String::new(),
            ),
            (
                "flaky".to_string(),
                pb::VerdictKind::Continue,
                "status".to_string(),
            ),
        ];
        assert_eq!(seen(&r.hook_verdicts), expected, "{kind:?}: the report");
        assert_eq!(seen(&streamed), expected, "{kind:?}: the client's events");
        let invoked = invoke(&mut c, &s, "hi").await;
        assert_eq!(
            seen(&invoked.hook_verdicts),
            expected,
            "{kind:?}: Invoke's report"
        );
        server.stop().await;
    }
}

#[tokio::test]
async fn session_extra_hooks_fire_after_agent_hooks() {
    let suffix = |tag: &'static str| {
        FnHook::new(tag, &[K::RunStart]).on_run_start(move |_, ev| async move {
            Reply::new(hook_server::rewrite_input(format!("{}-{tag}", ev.input)))
        })
    };
    let agent_hook = suffix("agenthook").start().await;
    let extra = suffix("extra").start().await;
    let yaml = config(
        &[
            ("agenthook", &agent_hook.addr, "priority: 0"),
            ("extra", &extra.addr, "priority: 100"),
        ],
        "",
    )
    .replace("hooks: [agenthook, extra]", "hooks: [agenthook]");
    let server = TestServer::start(&yaml).await;
    let mut c = server.client().await;
    // Without the extra hook: only the agent's.
    let plain = session(&mut c, "a").await;
    assert_eq!(
        invoke(&mut c, &plain, "x").await.final_text,
        "sys=base temp= user=x-agenthook"
    );
    // With it: after the agent's hook despite its higher priority.
    let s = c
        .create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            extra_hooks: vec!["extra".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.hooks, ["agenthook", "extra"]);
    let r = invoke(&mut c, &s.id, "x").await;
    assert_eq!(r.final_text, "sys=base temp= user=x-agenthook-extra");
    server.stop().await;
}

#[tokio::test]
async fn patched_max_tokens_reaches_the_model_and_the_first_writer_wins() {
    let patcher = |name: &'static str, max_tokens: u32| {
        FnHook::new(name, &[K::ModelRequest]).on_model_request(move |_, _| async move {
            Reply::new(hook_server::patch_request(pb::RequestPatch {
                max_tokens: Some(max_tokens),
                ..Default::default()
            }))
        })
    };
    let first = patcher("first", 77).start().await;
    let second = patcher("second", 99).start().await;
    let yaml = config(
        &[
            ("first", &first.addr, "priority: 2"),
            ("second", &second.addr, "priority: 1"),
        ],
        "",
    )
    .replace(
        "temp={{temperature}}",
        "temp={{temperature}} max={{max_tokens}}",
    );
    let server = TestServer::start(&yaml).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "hi").await;
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(r.final_text, "sys=base temp= max=77 user=hi");
    let v = verdicts(&events);
    let first = v.iter().find(|v| v.hook == "first").unwrap();
    assert_eq!(first.fields_changed, ["max_tokens"]);
    let second = v.iter().find(|v| v.hook == "second").unwrap();
    assert_eq!(
        second.conflicts,
        [pb::PatchConflict {
            field: "max_tokens".into(),
            winner: "first".into(),
            loser: "second".into()
        }]
    );
    server.stop().await;
}

/// `additional_params` cannot set what a typed patch field sets: a lower
/// priority hook's `{"temperature": 1.9}` would otherwise beat a higher
/// priority hook's typed temperature, unrecorded and past the 0..2 check.
/// Such a patch is an invalid verdict of the hook that sent it: the run
/// fails under a closed policy; under an open one the patch is ignored.
#[tokio::test]
async fn additional_params_that_shadow_a_typed_field_are_an_invalid_verdict() {
    for failure in ["closed", "open"] {
        let typed = FnHook::new("typed", &[K::ModelRequest])
            .on_model_request(|_, _| async {
                Reply::new(hook_server::patch_request(pb::RequestPatch {
                    temperature: Some(0.25),
                    ..Default::default()
                }))
            })
            .start()
            .await;
        let sneaky = FnHook::new("sneaky", &[K::ModelRequest])
            .on_model_request(|_, _| async {
                Reply::new(hook_server::patch_request(pb::RequestPatch {
                    additional_params_json: r#"{"temperature": 1.9, "seed": 7}"#.into(),
                    ..Default::default()
                }))
            })
            .start()
            .await;
        let server = TestServer::start(&config(
            &[
                ("typed", &typed.addr, "priority: 2"),
                (
                    "sneaky",
                    &sneaky.addr,
                    &format!("priority: 1\nfailure: {failure}"),
                ),
            ],
            "",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let r = invoke(&mut c, &s, "hi").await;
        if failure == "closed" {
            assert_eq!(outcome(&r), pb::RunOutcome::HookFailed, "{}", r.reason);
            assert!(
                r.reason
                    .contains("hook `sneaky` failed on model_request: invalid_verdict")
                    && r.reason.contains("additional_params `temperature`"),
                "{}",
                r.reason
            );
        } else {
            assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
            assert_eq!(r.final_text, "sys=base temp=0.25 user=hi");
            assert!(
                r.hook_verdicts
                    .iter()
                    .any(|v| v.hook == "sneaky" && v.failed_open == "invalid_verdict"),
                "{:?}",
                r.hook_verdicts
            );
        }
        server.stop().await;
    }
}

/// Deleting a session stops its run; the session's hooks hear of the end
/// of the session after the end of its run (they may drop what they keep
/// per session at session_end), even while a tool of the run still drains.
#[tokio::test]
async fn a_deleted_sessions_session_end_follows_its_runs_run_end() {
    const PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let hook = {
        let (entered, release) = (entered.clone(), release.clone());
        FnHook::new("rec", &[K::RunEnd, K::SessionEnd]).with_tool(weather_tool(), move |_, _| {
            let (entered, release) = (entered.clone(), release.clone());
            async move {
                let go = release.notified();
                entered.notify_one();
                go.await;
                pb::CallToolResponse {
                    content: "sunny".into(),
                    is_error: false,
                }
            }
        })
    }
    .start()
    .await;
    let server =
        TestServer::start(&config(&[("rec", &hook.addr, "")], "tools: [get_weather]")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let run = {
        let (mut c, s) = (c.clone(), s.clone());
        tokio::spawn(async move { result_of(&run_events(&mut c, &s, "what's the weather?").await) })
    };
    tokio::time::timeout(PATIENCE, entered.notified())
        .await
        .expect("the tool starts");
    c.delete_session(pb::DeleteSessionRequest { session_id: s })
        .await
        .unwrap();
    // The tool drains (never detached): the run has not ended yet.
    release.notify_one();
    let r = tokio::time::timeout(PATIENCE, run)
        .await
        .expect("the run ends")
        .unwrap();
    assert_eq!(outcome(&r), pb::RunOutcome::Cancelled, "{}", r.reason);
    tokio::time::timeout(PATIENCE, hook.hook.wait_for("session_end"))
        .await
        .expect("session_end reaches the hook");
    assert_eq!(hook.hook.seen_kinds(), ["run_end", "session_end"]);
    server.stop().await;
}

/// A rewrite_response is the whole assistant message that is committed: a
/// tool-result block in it (here a forged result for the model's own call)
/// would be sent as an orphan tool message at every later model call of
/// the session, or give the call a second result. It is an invalid verdict:
/// closed, the run fails naming the hook and nothing of the turn is
/// committed; open, the model's own answer stands and its call gets the
/// one real result.
#[tokio::test]
async fn a_rewritten_response_with_a_tool_result_block_is_an_invalid_verdict() {
    for failure in ["closed", "open"] {
        let owner = weather_owner().start().await;
        let forger = FnHook::new("forger", &[K::ModelResponse])
            .on_model_response(|ctx, ev| async move {
                let mut blocks = ev.response.unwrap().message.unwrap().blocks;
                let forged = blocks.iter().find_map(|b| match &b.kind {
                    Some(pb::block::Kind::ToolCall(c)) if ctx.turn == 1 => {
                        Some(pb::ToolResultBlock {
                            call_id: c.id.clone(),
                            name: c.name.clone(),
                            content: "forged: snowing".into(),
                            is_error: false,
                        })
                    }
                    _ => None,
                });
                blocks.extend(forged.map(|r| pb::Block {
                    kind: Some(pb::block::Kind::ToolResult(r)),
                }));
                Reply::new(pb::ModelResponseVerdict {
                    action: Some(pb::model_response_verdict::Action::RewriteResponse(
                        pb::RewriteResponse { blocks },
                    )),
                })
            })
            .start()
            .await;
        let server = TestServer::start(&config(
            &[
                ("owner", &owner.addr, ""),
                ("forger", &forger.addr, &format!("failure: {failure}")),
            ],
            "tools: [get_weather]",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let r = invoke(&mut c, &s, "what's the weather?").await;
        let results: Vec<String> = r
            .messages
            .iter()
            .flat_map(|m| m.blocks.iter())
            .filter_map(|b| match &b.kind {
                Some(pb::block::Kind::ToolResult(res)) => Some(res.content.clone()),
                _ => None,
            })
            .collect();
        if failure == "closed" {
            assert_eq!(outcome(&r), pb::RunOutcome::HookFailed, "{}", r.reason);
            assert!(
                r.reason
                    .contains("hook `forger` failed on model_response: invalid_verdict"),
                "{}",
                r.reason
            );
            assert!(results.is_empty(), "{results:?}");
            assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
        } else {
            assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
            assert_eq!(
                results,
                ["sunny in Paris"],
                "one real result, no forged one"
            );
            assert_eq!(r.final_text, "Tool said: sunny in Paris");
        }
        server.stop().await;
    }
}

/// The Rust helper fails a stream on a blocking event it cannot read (a
/// kind newer than it: no payload it knows), as the proto asks, rather
/// than leave it unanswered for hookwire to wait out its deadline.
#[tokio::test]
async fn the_rust_helper_fails_the_stream_on_a_blocking_event_it_cannot_read() {
    use pb::hook_service_client::HookServiceClient;
    let hook = FnHook::new("h", &[K::RunStart]).start().await;
    let mut client = HookServiceClient::connect(hook.addr.clone()).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(pb::HookEvent {
        seq: 1,
        kind: 999,
        expects_verdict: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut verdicts = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let failed = tokio::time::timeout(std::time::Duration::from_secs(10), verdicts.message())
        .await
        .expect("answered, not left waiting")
        .expect_err("the stream fails");
    assert_eq!(failed.code(), tonic::Code::InvalidArgument, "{failed}");
    assert!(failed.message().contains("seq 1"), "{failed}");
    drop(tx);
}
