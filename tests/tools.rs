//! Tools and turns: hook-owned tools, batches (fail-fast, call order),
//! schema-invalid calls with retry, approvals, held vs passed deltas, and
//! Run/Invoke parity.

mod support;

use std::sync::{Arc, Mutex};

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use pb::EventKind as K;
use support::*;
use tokio::sync::Notify;

fn results_in_events(events: &[pb::RunEvent]) -> Vec<(u32, String)> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(pb::run_event::Event::ToolResult(r)) => {
                Some((r.call_index, r.result.clone().unwrap().content))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn terminate_mid_batch_stops_later_calls_and_commits_nothing_of_the_turn() {
    let owner = weather_owner().start().await;
    let guard = FnHook::new("guard", &[K::ToolCall])
        .on_tool_call(|_, ev| async move {
            if ev.call_index == 1 {
                Reply::new(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::Terminate(
                        hook_server::terminate(
                            "Oslo is forbidden",
                            Some("I cannot check Oslo.".into()),
                        ),
                    )),
                })
            } else {
                Reply::new(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("guard", &guard.addr, "")],
        "tools: [get_weather]\ntool_concurrency: 1",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "three tools").await;
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Terminated);
    assert!(r.reason.contains("Oslo is forbidden"));
    let ran: Vec<String> = owner
        .hook
        .tool_calls
        .lock()
        .unwrap()
        .iter()
        .map(city)
        .collect();
    assert_eq!(ran, ["Paris"], "call 0 ran; call 2 never started");
    assert!(
        results_in_events(&events).is_empty(),
        "a failed batch surfaces no results"
    );
    assert_eq!(
        texts(&r.messages),
        ["three tools", "I cannot check Oslo."],
        "no dangling tool call in history"
    );
    server.stop().await;
}

#[tokio::test]
async fn results_surface_in_call_order_despite_reordered_completion() {
    // Paris (call 0) finishes only after Oslo (call 1) finished.
    let oslo_done = Arc::new(Notify::new());
    let order = Arc::new(Mutex::new(Vec::new()));
    let (d, o) = (oslo_done.clone(), order.clone());
    let owner = FnHook::new("owner", &[])
        .with_tool(weather_tool(), move |_, call| {
            let (d, o) = (d.clone(), o.clone());
            async move {
                let c = city(&call);
                if c == "Paris" {
                    d.notified().await;
                } else {
                    d.notify_one();
                }
                o.lock().unwrap().push(c.clone());
                pb::CallToolResponse {
                    content: format!("sunny in {c}"),
                    is_error: false,
                }
            }
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, "")],
        "tools: [get_weather]\ntool_concurrency: 2",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "two tools").await;
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(
        *order.lock().unwrap(),
        ["Oslo", "Paris"],
        "completion was reordered"
    );
    assert_eq!(
        results_in_events(&events),
        [(0, "sunny in Paris".into()), (1, "sunny in Oslo".into())]
    );
    let t = texts(&r.messages);
    assert_eq!(&t[3..5], ["result:sunny in Paris", "result:sunny in Oslo"]);
    server.stop().await;
}

#[tokio::test]
async fn schema_invalid_arguments_go_to_invalid_tool_call_and_retry_reasks_the_model() {
    let owner = weather_owner().start().await;
    let fixer = FnHook::new("fixer", &[K::InvalidToolCall])
        .on_invalid_tool_call(|_, ev| async move {
            assert_eq!(
                ev.problem,
                pb::invalid_tool_call_event::Problem::InvalidArguments as i32
            );
            assert!(ev.error.contains("city"), "{}", ev.error);
            Reply::new(pb::InvalidToolCallVerdict {
                action: Some(pb::invalid_tool_call_verdict::Action::Retry(pb::Retry {
                    feedback: "use city, not town".into(),
                })),
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("fixer", &fixer.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "bad args").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(r.final_text, "Tool said: sunny in Paris");
    assert_eq!(r.turns, 3);
    let t = texts(&r.messages);
    assert_eq!(t[0], "bad args");
    assert_eq!(
        t[1], "use city, not town",
        "the invalid turn was discarded, the feedback kept"
    );
    assert_eq!(
        owner.hook.tool_calls.lock().unwrap().len(),
        1,
        "the invalid call never executed"
    );
    server.stop().await;
}

#[tokio::test]
async fn invalid_arguments_default_is_an_error_result_for_the_model() {
    let owner = weather_owner().start().await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, "")],
        "tools: [get_weather]\nmax_turns: 2",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "bad args").await;
    assert!(
        r.final_text
            .contains("arguments do not match the schema of `get_weather`"),
        "{}",
        r.final_text
    );
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    server.stop().await;
}

async fn approval_run(
    decision: Option<bool>,
    ask_timeout_ms: u64,
) -> (pb::RunResult, Vec<pb::RunEvent>, usize) {
    let owner = weather_owner().start().await;
    let asker = asker("check the weather?", ask_timeout_ms).start().await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut stream = c
        .run(pb::RunRequest {
            session_id: s,
            input: "weather".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    while let Some(ev) = stream.message().await.unwrap() {
        if let Some(pb::run_event::Event::ApprovalRequested(a)) = &ev.event {
            assert_eq!(a.hook, "asker");
            assert_eq!(a.question, "check the weather?");
            assert_eq!(city(a.call.as_ref().unwrap()), "Paris");
            if let Some(approve) = decision {
                c.resolve_approval(pb::ResolveApprovalRequest {
                    run_id: ev.run_id.clone(),
                    call_id: a.call.clone().unwrap().id,
                    approve,
                    note: if approve {
                        String::new()
                    } else {
                        "not today".into()
                    },
                })
                .await
                .unwrap();
            }
        }
        events.push(ev);
    }
    let ran = owner.hook.tool_calls.lock().unwrap().len();
    server.stop().await;
    (result_of(&events), events, ran)
}

#[tokio::test]
async fn approval_approve_deny_and_timeout() {
    let (r, events, ran) = approval_run(Some(true), 0).await;
    assert_eq!(r.final_text, "Tool said: sunny in Paris");
    assert_eq!(ran, 1);
    assert!(events
        .iter()
        .any(|e| matches!(e.event, Some(pb::run_event::Event::ToolStarted(_)))));

    let (r, _, ran) = approval_run(Some(false), 0).await;
    assert_eq!(ran, 0, "a denied call never executes");
    assert_eq!(
        r.final_text,
        "Tool said: the user denied the call of tool `get_weather`: not today"
    );

    let (r, _, ran) = approval_run(None, 500).await;
    assert_eq!(ran, 0);
    assert!(
        r.final_text
            .contains("approval for tool `get_weather` timed out after 500ms and was denied"),
        "the deadline as given, not rounded down to whole seconds: {}",
        r.final_text
    );
}

#[tokio::test]
async fn invoke_cannot_answer_approvals_and_says_so() {
    let owner = weather_owner().start().await;
    let asker = asker("ok?", 0).start().await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Failed);
    assert!(r.reason.contains("AgentService.Run"), "{}", r.reason);
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn pass_mode_streams_deltas_and_retracts_a_rewritten_turn() {
    let rewriter = FnHook::new("rewriter", &[K::ModelResponse])
        .on_model_response(|_, _| async {
            Reply::new(pb::ModelResponseVerdict {
                action: Some(pb::model_response_verdict::Action::RewriteResponse(
                    pb::RewriteResponse {
                        blocks: vec![pb::Block {
                            kind: Some(pb::block::Kind::Text(pb::TextBlock {
                                text: "REWRITTEN".into(),
                            })),
                        }],
                    },
                )),
            })
        })
        .start()
        .await;
    for (mode, want_original_text, want_retraction) in
        [("hold", false, false), ("pass", true, true)]
    {
        let server = TestServer::start(&config(
            &[("rewriter", &rewriter.addr, "")],
            &format!("stream_deltas: {mode}"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let events = run_events(&mut c, &s, "hello").await;
        let deltas: String = events
            .iter()
            .filter_map(|e| match &e.event {
                Some(pb::run_event::Event::TextDelta(d)) => Some(d.text.clone()),
                _ => None,
            })
            .collect();
        let retracted = events
            .iter()
            .any(|e| matches!(e.event, Some(pb::run_event::Event::DeltasRetracted(_))));
        assert_eq!(
            deltas.contains("user=hello"),
            want_original_text,
            "{mode}: {deltas}"
        );
        assert_eq!(retracted, want_retraction, "{mode}");
        assert!(
            deltas.ends_with("REWRITTEN"),
            "{mode}: the accepted text is streamed"
        );
        assert_eq!(result_of(&events).final_text, "REWRITTEN");
        server.stop().await;
    }
}

#[tokio::test]
async fn run_and_invoke_are_identical_on_a_tool_run_with_hooks() {
    let owner = weather_owner().start().await;
    let redactor = FnHook::new("redactor", &[K::ToolResult, K::RunStart])
        .on_tool_result(|_, ev| async move {
            Reply::new(hook_server::rewrite_result(
                ev.result.unwrap().content.replace("sunny", "[redacted]"),
            ))
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("redactor", &redactor.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    for input in ["weather", "two tools", "bogus", "hello"] {
        let (s1, s2) = (session(&mut c, "a").await, session(&mut c, "a").await);
        let streamed = result_of(&run_events(&mut c, &s1, input).await);
        let invoked = invoke(&mut c, &s2, input).await;
        assert_eq!(streamed.outcome, invoked.outcome, "{input}");
        assert_eq!(streamed.final_text, invoked.final_text, "{input}");
        assert_eq!(streamed.turns, invoked.turns, "{input}");
        assert_eq!(streamed.hook_verdicts, invoked.hook_verdicts, "{input}");
        let strip = |m: &[pb::Message]| texts(m);
        assert_eq!(
            strip(&streamed.messages),
            strip(&invoked.messages),
            "{input}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn a_tool_owned_by_two_hook_servers_is_a_startup_error() {
    let a = weather_owner().start().await;
    let b = weather_owner().start().await;
    let config = hookwire::config::Config::parse(
        &config(
            &[("a1", &a.addr, ""), ("b1", &b.addr, "")],
            "tools: [get_weather]",
        ),
        "t",
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = hookwire::server::serve(listener, config, std::future::pending())
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("`get_weather`") && msg.contains("`a1`") && msg.contains("`b1`"),
        "{msg}"
    );
}
