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

/// Two tool_call events in flight on one hook's stream, answered in the
/// reverse order: each verdict reaches its own call (routed by seq, not by
/// arrival).
#[tokio::test]
async fn verdicts_answered_out_of_order_on_one_stream_reach_their_own_calls() {
    let second_answered = Arc::new(Notify::new());
    let s1 = second_answered.clone();
    let rewriter = FnHook::new("rewriter", &[K::ToolCall])
        .on_tool_call(move |_, ev| {
            let s1 = s1.clone();
            async move {
                let to = if ev.call_index == 0 {
                    // Answered only after call 1 was.
                    s1.notified().await;
                    "Rome"
                } else {
                    s1.notify_one();
                    "Bergen"
                };
                Reply::new(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::RewriteArgs(
                        pb::RewriteArgs {
                            arguments_json: format!(r#"{{"city":"{to}"}}"#),
                        },
                    )),
                })
            }
        })
        .start()
        .await;
    let owner = weather_owner().start().await;
    let server = TestServer::start(&config(
        &[("rewriter", &rewriter.addr, ""), ("owner", &owner.addr, "")],
        "tools: [get_weather]\ntool_concurrency: 2",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "two tools").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    let t = texts(&r.messages);
    assert_eq!(
        &t[3..5],
        ["result:sunny in Rome", "result:sunny in Bergen"],
        "{t:?}"
    );
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

/// An invalid_tool_call `retry` discards a turn the client was already
/// shown (its deltas, assistant message and tool call, all sent once the
/// model_response hooks accepted it): the client is told with a retraction
/// of that turn before the model is asked again, in either delta mode.
#[tokio::test]
async fn an_invalid_tool_call_retry_retracts_the_turn_the_client_was_shown() {
    use pb::run_event::Event as E;
    for mode in ["pass", "hold"] {
        let owner = weather_owner().start().await;
        let fixer = FnHook::new("fixer", &[K::InvalidToolCall])
            .on_invalid_tool_call(|_, _| async move {
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
            &format!("tools: [get_weather]\nstream_deltas: {mode}"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let events = run_events(&mut c, &s, "bad args with text").await;
        let r = result_of(&events);
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::Completed,
            "{mode}: {}",
            r.reason
        );
        assert_eq!(r.final_text, "Tool said: sunny in Paris");
        let turn1: Vec<&E> = events
            .iter()
            .filter_map(|e| e.event.as_ref())
            .take_while(|e| !matches!(e, E::TurnStarted(t) if t.turn == 2))
            .collect();
        let shown: String = turn1
            .iter()
            .filter_map(|e| match e {
                E::TextDelta(d) if d.turn == 1 => Some(d.text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(shown, "Let me check the weather.", "{mode}");
        assert!(
            turn1
                .iter()
                .any(|e| matches!(e, E::ToolCall(t) if t.turn == 1)),
            "{mode}: the client was shown the invalid call"
        );
        match turn1.last() {
            Some(E::DeltasRetracted(d)) => {
                assert_eq!(d.turn, 1, "{mode}");
                assert!(
                    d.reason.contains("invalid_tool_call"),
                    "{mode}: {}",
                    d.reason
                );
            }
            other => panic!("{mode}: turn 1 was discarded without a retraction: {other:?}"),
        }
        assert_eq!(
            texts(&r.messages)[1],
            "use city, not town",
            "{mode}: the retracted turn is not in history"
        );
        server.stop().await;
    }
}

/// A `terminate` at `tool_call` fails the batch of a turn the client was
/// shown (its deltas, assistant message and tool call, sent once
/// model_response accepted it): the failed batch commits nothing, so the
/// client is told with a retraction of that turn before `finished`, in
/// either delta mode. It used to get none, and kept a turn the session
/// never holds.
/// A settled batch whose commit the store refuses (the transcript would
/// pass `server.max_transcript_bytes`) ends the run without its results:
/// the client hears neither the results nor a next turn, and the shown
/// turn's retraction comes after everything it had of that turn. The
/// results and the next turn's start used to reach the client after the
/// retraction, for a turn the session never held.
#[tokio::test]
async fn a_batch_whose_commit_is_refused_shows_no_results_and_is_retracted_last() {
    use pb::run_event::Event as E;
    let owner = weather_owner().start().await;
    let server = TestServer::start(&format!(
        "{}server:\n  max_transcript_bytes: 200\n",
        config(&[("owner", &owner.addr, "")], "tools: [get_weather]")
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "weather").await;
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Failed, "{}", r.reason);
    assert!(r.reason.contains("max_transcript_bytes"), "{}", r.reason);
    assert_eq!(r.turns, 1, "the turn after the refused batch never began");
    let kinds: Vec<&E> = events.iter().filter_map(|e| e.event.as_ref()).collect();
    assert!(
        kinds
            .iter()
            .any(|e| matches!(e, E::ToolCall(t) if t.turn == 1)),
        "the client was shown the call: {kinds:?}"
    );
    assert!(
        !kinds.iter().any(|e| match e {
            E::ToolResult(_) => true,
            E::TurnStarted(t) => t.turn > 1,
            _ => false,
        }),
        "nothing of a commit the store refused: {kinds:?}"
    );
    match kinds[kinds.len() - 2] {
        E::DeltasRetracted(d) => assert_eq!(d.turn, 1),
        other => panic!("the shown turn was not retracted last: {other:?}"),
    }
    let kept = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        kept.transcript.len(),
        1,
        "the input only: {:?}",
        kept.transcript
    );
    server.stop().await;
}

#[tokio::test]
async fn a_terminate_at_tool_call_retracts_the_turn_the_client_was_shown() {
    use pb::run_event::Event as E;
    let owner = weather_owner().start().await;
    let guard = FnHook::new("guard", &[K::ToolCall])
        .on_tool_call(|_, _| async move {
            Reply::new(pb::ToolCallVerdict {
                action: Some(pb::tool_call_verdict::Action::Terminate(
                    hook_server::terminate("no weather today", None),
                )),
            })
        })
        .start()
        .await;
    for mode in ["pass", "hold"] {
        let server = TestServer::start(&config(
            &[("owner", &owner.addr, ""), ("guard", &guard.addr, "")],
            &format!("tools: [get_weather]\nstream_deltas: {mode}"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let events = run_events(&mut c, &s, "look up the weather").await;
        let r = result_of(&events);
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::Terminated,
            "{mode}: {}",
            r.reason
        );
        let kinds: Vec<&E> = events.iter().filter_map(|e| e.event.as_ref()).collect();
        let shown: String = kinds
            .iter()
            .filter_map(|e| match e {
                E::TextDelta(d) if d.turn == 1 => Some(d.text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(shown, "Let me look it up.", "{mode}");
        assert!(
            kinds
                .iter()
                .any(|e| matches!(e, E::ToolCall(t) if t.turn == 1)),
            "{mode}: the client was shown the call"
        );
        match kinds[kinds.len() - 2] {
            E::DeltasRetracted(d) => {
                assert_eq!(d.turn, 1, "{mode}");
                assert!(
                    d.reason.contains("terminated") && d.reason.contains("committed"),
                    "{mode}: {}",
                    d.reason
                );
            }
            other => panic!("{mode}: the shown turn was not retracted before finished: {other:?}"),
        }
        let kept = c
            .get_session(pb::GetSessionRequest { session_id: s })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            texts(&kept.transcript),
            ["look up the weather"],
            "{mode}: the session does not hold the turn"
        );
        assert!(owner.hook.tool_calls.lock().unwrap().is_empty(), "{mode}");
        server.stop().await;
    }
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
    // Every case below is about an approval that was asked for: a run that
    // never asked would pass the loop above without checking anything.
    let asked = events
        .iter()
        .filter(|e| matches!(e.event, Some(pb::run_event::Event::ApprovalRequested(_))))
        .count();
    assert_eq!(asked, 1, "one approval requested: {events:?}");
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
        "Tool said: approval for tool `get_weather` was denied: not today"
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

/// Agent `a` asking before every get_weather call through a routing asker
/// (the agent's approval_timeout), with token auth: alice owns the
/// sessions, carol holds the agent's approver role, bob neither. An Invoke
/// caller reads nothing but its result, for longer than
/// `server.client_stall_timeout` (200 ms here) while the run waits.
struct Approvers {
    server: TestServer,
    owner: TestHook,
    asked: tokio::sync::mpsc::UnboundedReceiver<Routed>,
    _kept: (TestHook, support::auth::Tokens),
}

async fn approvers() -> Approvers {
    let tokens = support::auth::Tokens::write();
    let owner = weather_owner().start().await;
    let (asker, asked) = routing_asker("check the weather for alice?", 0);
    let asker = asker.start().await;
    let mut yaml = config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]\napprover_roles: [approver]",
    );
    yaml.push_str(&tokens.auth_yaml());
    yaml.push_str("server:\n  client_stall_timeout: 200ms\n");
    Approvers {
        server: TestServer::start(&yaml).await,
        owner,
        asked,
        _kept: (asker, tokens),
    }
}

/// Alice invokes "weather"; her run's hook asks, and tells its approval
/// bot; carol answers from her own connection once the Invoke has waited
/// past the client stall timeout. The result, the tool calls made, and
/// what the hook was told.
async fn invoke_answered_by_carol(approve: bool, note: &str) -> (pb::RunResult, usize, Routed) {
    use support::auth::{self as sa, ALICE, BOB, CAROL};
    let mut rig = approvers().await;
    let mut alice = sa::client(&rig.server.addr, Some(ALICE)).await;
    let s = sa::new_session(&mut alice, "a").await.unwrap();
    let invoking = tokio::spawn(async move {
        alice
            .invoke(pb::RunRequest {
                session_id: s,
                input: "weather".into(),
            })
            .await
    });
    let asked = tokio::time::timeout(std::time::Duration::from_secs(20), rig.asked.recv())
        .await
        .expect("the hook was asked in time")
        .expect("the hook was asked");
    // Longer than the stall timeout: a caller that reads only its result
    // is not a stalled one.
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert!(!invoking.is_finished(), "the run waits for the answer");
    let mut bob = sa::client(&rig.server.addr, Some(BOB)).await;
    let e = bob
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: asked.run_id.clone(),
            call_id: asked.call_id.clone(),
            approve: true,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        tonic::Code::NotFound,
        "bob neither owns nor approves: {e:?}"
    );
    let mut carol = sa::client(&rig.server.addr, Some(CAROL)).await;
    resolve_once_pending(&mut carol, &asked, approve, note).await;
    let r = tokio::time::timeout(std::time::Duration::from_secs(20), invoking)
        .await
        .expect("the run ended once answered")
        .unwrap()
        .expect("invoke")
        .into_inner();
    let again = carol
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: asked.run_id.clone(),
            call_id: asked.call_id.clone(),
            approve: !approve,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        again.code(),
        tonic::Code::NotFound,
        "answered: nothing left to answer"
    );
    let ran = rig.owner.hook.tool_calls.lock().unwrap().len();
    rig.server.stop().await;
    (r, ran, asked)
}

/// An Invoke caller never sees approval requests; the hook that asks routes
/// them to someone who does. Here carol, the agent's approver, learns the
/// run and call ids from the hook, as an approval bot would, and her
/// ResolveApproval resumes the run. An `ask` under Invoke used to end the
/// run `failed` at once.
#[tokio::test]
async fn an_invoke_run_waits_for_an_approver_the_hook_told_and_runs_the_tool() {
    let (r, ran, asked) = invoke_answered_by_carol(true, "").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(r.final_text, "Tool said: sunny in Paris");
    assert_eq!(ran, 1, "the approved call executed once");
    assert_eq!(r.run_id, asked.run_id);
    assert!(
        !asked.streaming,
        "the hook is told the caller is not streaming"
    );
    assert_eq!(asked.principal, "alice");
}

#[tokio::test]
async fn an_invoke_call_the_approver_denies_never_runs() {
    let (r, ran, _) = invoke_answered_by_carol(false, "not today").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(ran, 0, "a denied call never executes");
    let denial = "approval for tool `get_weather` was denied: not today";
    assert_eq!(history_results(&r.messages), [(denial.to_string(), true)]);
    assert_eq!(r.final_text, format!("Tool said: {denial}"));
}

/// An approver's answer that reaches hookwire before the hook's `ask` (the
/// hook told its bot first) waits for the question, then answers it: the
/// call runs once. It used to be NOT_FOUND, so a bot that fast had to
/// retry. An answer for a run that ended is NOT_FOUND at once.
#[tokio::test]
async fn an_answer_that_comes_before_its_question_waits_for_it() {
    let owner = weather_owner().start().await;
    let (asker, mut asked, gate) = gated_asker("check the weather?");
    let asker = asker.start().await;
    let (server, admin) = TestServer::start_with_admin(&config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut invoker = c.clone();
    let invoking = tokio::spawn(async move { invoke(&mut invoker, &s, "weather").await });
    let routed = tokio::time::timeout(std::time::Duration::from_secs(20), asked.recv())
        .await
        .expect("the hook was asked in time")
        .expect("the hook was asked");
    let mut bot = c.clone();
    let request = pb::ResolveApprovalRequest {
        run_id: routed.run_id.clone(),
        call_id: routed.call_id.clone(),
        approve: true,
        note: String::new(),
    };
    let answer = request.clone();
    let answering = tokio::spawn(async move { bot.resolve_approval(answer).await });
    // The answer is in, and waits: only now does the hook give its ask.
    until_metric(admin, "hookwire_approval_answers_waiting 1").await;
    assert!(
        !answering.is_finished(),
        "the answer waits for its question"
    );
    gate.add_permits(1);
    answering
        .await
        .unwrap()
        .expect("the early answer is taken once the question comes");
    let r = invoking.await.unwrap();
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(r.final_text, "Tool said: sunny in Paris");
    assert_eq!(owner.hook.tool_calls.lock().unwrap().len(), 1, "ran once");
    until_metric(admin, "hookwire_approval_answers_waiting 0").await;
    // The run is over: no question can come, and the answer says so now.
    let late = c
        .resolve_approval(pb::ResolveApprovalRequest {
            call_id: "never-asked".into(),
            ..request
        })
        .await
        .unwrap_err();
    assert_eq!(late.code(), tonic::Code::NotFound, "{late:?}");
    assert!(!late.message().contains("within"), "not held: {late:?}");
    server.stop().await;
}

/// Nobody answers: the call is denied at the ask's timeout, exactly as for
/// a Run whose client does not answer (same outcome, text, transcript and
/// verdicts), and the Invoke caller reads why in its result.
#[tokio::test]
async fn an_unanswered_invoke_approval_is_denied_at_its_timeout_as_under_run() {
    let owner = weather_owner().start().await;
    let (asker, mut asked) = routing_asker("check the weather?", 300);
    let asker = asker.start().await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let started = std::time::Instant::now();
    let invoked = invoke(&mut c, &s, "weather").await;
    let waited = started.elapsed();
    let routed = asked.try_recv().expect("the hook asked");
    assert_eq!(routed.run_id, invoked.run_id);
    assert!(
        waited >= std::time::Duration::from_millis(300),
        "the run waited for an answer: {waited:?}"
    );
    assert_eq!(
        outcome(&invoked),
        pb::RunOutcome::Completed,
        "{}",
        invoked.reason
    );
    let denial = "approval for tool `get_weather` timed out after 300ms and was denied";
    assert_eq!(
        history_results(&invoked.messages),
        [(denial.to_string(), true)]
    );
    assert_eq!(invoked.final_text, format!("Tool said: {denial}"));
    assert!(
        invoked
            .hook_verdicts
            .iter()
            .any(|v| v.hook == "asker" && v.verdict_kind() == pb::VerdictKind::Ask),
        "{:?}",
        invoked.hook_verdicts
    );
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    let late = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: routed.run_id,
            call_id: routed.call_id,
            approve: true,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(late.code(), tonic::Code::NotFound, "denied: {late:?}");
    // The same input in a Run whose client reads but never answers.
    let s2 = session(&mut c, "a").await;
    let streamed = result_of(&run_events(&mut c, &s2, "weather").await);
    assert_eq!(streamed.outcome, invoked.outcome);
    assert_eq!(streamed.final_text, invoked.final_text);
    assert_eq!(streamed.turns, invoked.turns);
    assert_eq!(streamed.hook_verdicts, invoked.hook_verdicts);
    assert_eq!(texts(&streamed.messages), texts(&invoked.messages));
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    server.stop().await;
}

/// The approval wait never outlasts the run: with the agent's 2-minute
/// approval_timeout and a 1 s `run_timeout`, the Invoke run ends
/// `timed_out`, its request withdrawn, the tool never run.
#[tokio::test]
async fn an_invoke_approval_ends_with_its_run_deadline() {
    let owner = weather_owner().start().await;
    let (asker, mut asked) = routing_asker("check the weather?", 0);
    let asker = asker.start().await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]\nrun_timeout: 1s",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        invoke(&mut c, &s, "weather"),
    )
    .await
    .expect("the run ended at its deadline, not the approval's");
    assert_eq!(outcome(&r), pb::RunOutcome::TimedOut, "{}", r.reason);
    let routed = asked.try_recv().expect("the hook asked");
    let e = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: routed.run_id,
            call_id: routed.call_id,
            approve: true,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        tonic::Code::NotFound,
        "withdrawn with its run: {e:?}"
    );
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    server.stop().await;
}

/// An Invoke caller whose own deadline passes while its run waits for an
/// approval has left: the run is cancelled at once (not at the approval's
/// timeout), the request withdrawn, the tool never run, the session free.
#[tokio::test]
async fn an_invoke_caller_that_gives_up_during_an_approval_ends_the_run() {
    let owner = weather_owner().start().await;
    let (asker, mut asked) = routing_asker("check the weather?", 60_000);
    let asker = asker.start().await;
    let watcher = FnHook::new("watcher", &[K::RunEnd]).start().await;
    let server = TestServer::start(&config(
        &[
            ("owner", &owner.addr, ""),
            ("asker", &asker.addr, ""),
            ("watcher", &watcher.addr, ""),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut req = tonic::Request::new(pb::RunRequest {
        session_id: s.clone(),
        input: "weather".into(),
    });
    req.set_timeout(std::time::Duration::from_secs(1));
    let e = c.invoke(req).await.unwrap_err();
    assert!(
        matches!(
            e.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{e:?}"
    );
    let routed = asked
        .try_recv()
        .expect("the hook asked before the deadline");
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        watcher.hook.wait_for_count("run_end", 1),
    )
    .await
    .expect("the run ended when its caller left");
    let ended = watcher.hook.seen.lock().unwrap().clone();
    let Some(pb::hook_event::Payload::RunEnd(end)) = &ended[0].payload else {
        panic!("{ended:?}")
    };
    assert_eq!(end.outcome, pb::RunOutcome::Cancelled as i32);
    // Its own deadline, not just any disconnect (read from grpc-timeout).
    assert_eq!(
        end.reason,
        "client disconnected at its deadline (grpc-timeout 1s)"
    );
    let e = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: routed.run_id,
            call_id: routed.call_id,
            approve: true,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    let got = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.active_run_id, "");
    server.stop().await;
}

/// A Run client that leaves while its run waits for an approval ends the
/// run at once: the approval is withdrawn (an answer gets NOT_FOUND), the
/// tool never runs and the session is free. The run used to notice only
/// at its next event, so an answer given meanwhile still ran the tool.
#[tokio::test]
async fn a_run_client_that_leaves_during_an_approval_ends_the_run() {
    let owner = weather_owner().start().await;
    let asker = asker("check the weather?", 60_000).start().await;
    let watcher = FnHook::new("watcher", &[K::RunEnd]).start().await;
    let server = TestServer::start(&config(
        &[
            ("owner", &owner.addr, ""),
            ("asker", &asker.addr, ""),
            ("watcher", &watcher.addr, ""),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut stream = c
        .run(pb::RunRequest {
            session_id: s.clone(),
            input: "weather".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let (run_id, call_id) = loop {
        let ev = stream
            .message()
            .await
            .unwrap()
            .expect("an approval request");
        if let Some(pb::run_event::Event::ApprovalRequested(a)) = &ev.event {
            break (ev.run_id.clone(), a.call.clone().unwrap().id);
        }
    };
    drop(stream);
    // Well before the approval's own timeout (60 s), which would end it too.
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        watcher.hook.wait_for_count("run_end", 1),
    )
    .await
    .expect("the run ended when its client left");
    let ended = watcher.hook.seen.lock().unwrap().clone();
    let Some(pb::hook_event::Payload::RunEnd(end)) = &ended[0].payload else {
        panic!("{ended:?}")
    };
    assert_eq!(end.outcome, pb::RunOutcome::Cancelled as i32);
    assert_eq!(end.reason, "client disconnected", "no deadline was set");
    let e = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id,
            call_id,
            approve: true,
            note: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(owner.hook.tool_calls.lock().unwrap().is_empty());
    let got = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.active_run_id, "");
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

/// The tool results in history: (content, is_error).
fn history_results(messages: &[pb::Message]) -> Vec<(String, bool)> {
    messages
        .iter()
        .flat_map(|m| m.blocks.iter())
        .filter_map(|b| match &b.kind {
            Some(pb::block::Kind::ToolResult(r)) => Some((r.content.clone(), r.is_error)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_tool_that_fails_to_execute_becomes_an_error_result_and_the_run_goes_on() {
    // An error status, and an owner that never answers (only its timeout
    // can end the call).
    for (case, owner_extra) in [("status", ""), ("timeout", "timeout: 300ms")] {
        let owner = FnHook::new("owner", &[])
            .with_fallible_tool(weather_tool(), move |_, _| async move {
                if case == "status" {
                    Err(tonic::Status::internal("db down"))
                } else {
                    std::future::pending().await
                }
            })
            .start()
            .await;
        let server = TestServer::start(&config(
            &[("owner", &owner.addr, owner_extra)],
            "tools: [get_weather]",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let r = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            invoke(&mut c, &s, "weather"),
        )
        .await
        .unwrap_or_else(|_| panic!("{case}: the run never ended"));
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::Completed,
            "{case}: {}",
            r.reason
        );
        assert_eq!(owner.hook.tool_calls.lock().unwrap().len(), 1, "{case}");
        let results = history_results(&r.messages);
        assert_eq!(results.len(), 1, "{case}: {results:?}");
        let (content, is_error) = &results[0];
        assert!(is_error, "{case}");
        assert!(
            content.starts_with("tool `get_weather` failed to execute: "),
            "{case}: {content}"
        );
        // The model read it and answered with it.
        assert_eq!(r.final_text, format!("Tool said: {content}"), "{case}");
        assert_eq!(r.turns, 2, "{case}");
        if case == "status" {
            assert!(content.contains("db down"), "{content}");
        }
        server.stop().await;
    }
}

fn tool_call_block(id: &str, city: &str) -> pb::Block {
    pb::Block {
        kind: Some(pb::block::Kind::ToolCall(pb::ToolCall {
            id: id.into(),
            name: "get_weather".into(),
            arguments_json: format!(r#"{{"city":"{city}"}}"#),
        })),
    }
}

#[tokio::test]
async fn tool_calls_a_hook_puts_in_the_answer_are_executed() {
    // rewrite_response turns turn 1's plain answer into a tool call;
    // respond answers turn 1 with a tool call instead of the model.
    let rewriter =
        FnHook::new("rewriter", &[K::ModelResponse]).on_model_response(|ctx, _| async move {
            let action = if ctx.turn == 1 {
                pb::model_response_verdict::Action::RewriteResponse(pb::RewriteResponse {
                    blocks: vec![
                        pb::Block {
                            kind: Some(pb::block::Kind::Text(pb::TextBlock {
                                text: "Let me check Rome.".into(),
                            })),
                        },
                        tool_call_block("rw-1", "Rome"),
                    ],
                })
            } else {
                pb::model_response_verdict::Action::Proceed(pb::Continue {})
            };
            Reply::new(pb::ModelResponseVerdict {
                action: Some(action),
            })
        });
    let responder =
        FnHook::new("responder", &[K::ModelRequest]).on_model_request(|ctx, _| async move {
            let action = if ctx.turn == 1 {
                pb::model_request_verdict::Action::Respond(pb::Respond {
                    text: "Checking Oslo.".into(),
                    tool_calls: vec![pb::ToolCall {
                        id: "rs-1".into(),
                        name: "get_weather".into(),
                        arguments_json: r#"{"city":"Oslo"}"#.into(),
                    }],
                })
            } else {
                pb::model_request_verdict::Action::Proceed(pb::Continue {})
            };
            Reply::new(pb::ModelRequestVerdict {
                action: Some(action),
            })
        });
    for (name, hook, want, id) in [
        ("rewriter", rewriter, "Rome", "rw-1"),
        ("responder", responder, "Oslo", "rs-1"),
    ] {
        let owner = weather_owner().start().await;
        let hook = hook.start().await;
        let server = TestServer::start(&config(
            &[("owner", &owner.addr, ""), (name, &hook.addr, "")],
            "tools: [get_weather]",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let events = run_events(&mut c, &s, "hello").await;
        let r = result_of(&events);
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::Completed,
            "{name}: {}",
            r.reason
        );
        let ran: Vec<String> = owner
            .hook
            .tool_calls
            .lock()
            .unwrap()
            .iter()
            .map(city)
            .collect();
        assert_eq!(ran, [want], "{name}: the hook's call was executed");
        assert_eq!(
            results_in_events(&events),
            [(0, format!("sunny in {want}"))],
            "{name}"
        );
        let t = texts(&r.messages);
        assert!(
            t.contains(&format!(r#"call:get_weather({{"city":"{want}"}})"#)),
            "{name}: {t:?}"
        );
        let results: Vec<_> = r
            .messages
            .iter()
            .flat_map(|m| m.blocks.iter())
            .filter_map(|b| match &b.kind {
                Some(pb::block::Kind::ToolResult(res)) => Some(res.call_id.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            results,
            [id],
            "{name}: the result answers the hook's call id"
        );
        assert_eq!(
            r.final_text,
            format!("Tool said: sunny in {want}"),
            "{name}"
        );
        server.stop().await;
    }
}

/// A call the model cut off at max_tokens (arguments that are not JSON)
/// may travel through rewrite_response hooks: `cutter` stands in for the
/// model, `echo` sends back what it received, as hooks that edit only the
/// text do. Neither is a hook failure; the call is screened like the
/// model's own, goes to invalid_tool_call and never runs.
#[tokio::test]
async fn a_cut_off_call_in_a_rewritten_response_goes_to_invalid_tool_call() {
    const CUT: &str = r#"{"city": "Par"#;
    let owner = weather_owner().start().await;
    let cutter = FnHook::new("cutter", &[K::ModelResponse]).on_model_response(|_, ev| async move {
        let mut blocks = ev.response.unwrap().message.unwrap().blocks;
        for b in &mut blocks {
            if let Some(pb::block::Kind::ToolCall(c)) = &mut b.kind {
                c.arguments_json = CUT.into();
            }
        }
        Reply::new(pb::ModelResponseVerdict {
            action: Some(pb::model_response_verdict::Action::RewriteResponse(
                pb::RewriteResponse { blocks },
            )),
        })
    });
    let echo = FnHook::new("echo", &[K::ModelResponse, K::InvalidToolCall]).on_model_response(
        |_, ev| async move {
            Reply::new(pb::ModelResponseVerdict {
                action: Some(pb::model_response_verdict::Action::RewriteResponse(
                    pb::RewriteResponse {
                        blocks: ev.response.unwrap().message.unwrap().blocks,
                    },
                )),
            })
        },
    );
    let (cutter, echo) = (cutter.start().await, echo.start().await);
    let server = TestServer::start(&config(
        &[
            ("owner", &owner.addr, ""),
            ("cutter", &cutter.addr, "priority: 2"),
            ("echo", &echo.addr, "priority: 1"),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(
        owner.hook.tool_calls.lock().unwrap().is_empty(),
        "the cut-off call ran"
    );
    let invalid = echo.hook.invalid_tool_calls();
    assert_eq!(invalid.len(), 1, "{invalid:?}");
    assert_eq!(
        invalid[0].problem,
        pb::invalid_tool_call_event::Problem::InvalidArguments as i32
    );
    assert_eq!(invalid[0].call.as_ref().unwrap().arguments_json, CUT);
    assert!(
        r.final_text.contains("arguments are not valid JSON"),
        "{}",
        r.final_text
    );
    server.stop().await;
}

/// With blocking turn_end hooks the client sees a final answer (its held
/// deltas and its assistant message) only once turn_end accepted it: a
/// turn_end terminate never follows an answer the client already has, and
/// with `stream_deltas: pass` it retracts the deltas it streamed.
#[tokio::test]
async fn a_final_answer_reaches_the_client_only_once_turn_end_accepted_it() {
    for mode in ["hold", "pass"] {
        // Rejects the first answer, forces another turn on the second,
        // accepts the third.
        let n = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let judge = FnHook::new("judge", &[K::TurnEnd])
            .on_turn_end(move |_, _| {
                let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    Reply::new(pb::TurnEndVerdict {
                        action: Some(match i {
                            0 => pb::turn_end_verdict::Action::Terminate(hook_server::terminate(
                                "not that answer",
                                Some("I cannot answer that.".into()),
                            )),
                            1 => pb::turn_end_verdict::Action::ContinueRun(pb::ContinueRun {
                                message: "and more".into(),
                            }),
                            _ => pb::turn_end_verdict::Action::Proceed(pb::Continue {}),
                        }),
                    })
                }
            })
            .start()
            .await;
        let server = TestServer::start(&config(
            &[("judge", &judge.addr, "")],
            &format!("stream_deltas: {mode}"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let events = run_events(&mut c, &s, "hello").await;
        let r = result_of(&events);
        if mode == "hold" {
            assert_eq!(outcome(&r), pb::RunOutcome::Terminated);
            assert_eq!(
                kinds_of(&events),
                ["turn_end_verdict", "finished"],
                "hold: the rejected answer never reached the client"
            );
            assert_eq!(r.final_text, "I cannot answer that.");
        } else {
            assert_eq!(outcome(&r), pb::RunOutcome::Terminated);
            let k = kinds_of(&events);
            assert!(k.starts_with(&["delta"]), "pass streams at once: {k:?}");
            assert!(
                !k.contains(&"assistant"),
                "pass: the rejected answer was never committed to the client: {k:?}"
            );
            assert_eq!(
                k[k.len() - 3..],
                ["turn_end_verdict", "retracted", "finished"],
                "{k:?}"
            );
        }
        // Second run: continue_run, then accepted. Each answer is shown after
        // turn_end's decision on it.
        let events = run_events(&mut c, &s, "hello").await;
        let r = result_of(&events);
        assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
        let k = kinds_of(&events);
        let first_answer = k.iter().position(|x| *x == "assistant").unwrap();
        let verdict = k.iter().position(|x| *x == "turn_end_verdict").unwrap();
        assert!(verdict < first_answer, "{mode}: {k:?}");
        if mode == "hold" {
            let first_delta = k.iter().position(|x| *x == "delta").unwrap();
            assert!(verdict < first_delta, "hold: {k:?}");
        }
        assert_eq!(k.iter().filter(|x| **x == "assistant").count(), 2, "{k:?}");
        assert!(!k.contains(&"retracted"), "{mode}: {k:?}");
        server.stop().await;
    }
}

/// Nothing new starts after a sibling stopped the batch, at any concurrency.
/// Call 0 (Paris) terminates while call 1 (Oslo) sits between the two hooks
/// of its tool_call chain and, when it has started at all, call 2 (Rome)
/// waits on an `ask`. Neither goes on: no second hook call, the approval is
/// withdrawn (approving it now is refused), and the recording tool never runs.
#[tokio::test]
async fn a_stopped_batch_starts_nothing_new_at_any_concurrency() {
    for concurrency in [2u32, 4] {
        let owner = weather_owner().start().await;
        let (go0, go1, in1) = (
            Arc::new(Notify::new()),
            Arc::new(Notify::new()),
            Arc::new(Notify::new()),
        );
        let (g0, g1, i1) = (go0.clone(), go1.clone(), in1.clone());
        let gate = FnHook::new("gate", &[K::ToolCall])
            .on_tool_call(move |_, ev| {
                let (g0, g1, i1) = (g0.clone(), g1.clone(), i1.clone());
                async move {
                    let action = match ev.call_index {
                        0 => {
                            g0.notified().await;
                            pb::tool_call_verdict::Action::Terminate(hook_server::terminate(
                                "Paris stops the batch",
                                None,
                            ))
                        }
                        1 => {
                            i1.notify_one();
                            g1.notified().await;
                            pb::tool_call_verdict::Action::Proceed(pb::Continue {})
                        }
                        _ => pb::tool_call_verdict::Action::Ask(pb::Ask {
                            question: "Rome?".into(),
                            timeout_ms: 0,
                        }),
                    };
                    Reply::new(pb::ToolCallVerdict {
                        action: Some(action),
                    })
                }
            })
            .start()
            .await;
        let second = FnHook::new("second", &[K::ToolCall]).start().await;
        let server = TestServer::start(&config(
            &[
                ("owner", &owner.addr, ""),
                ("gate", &gate.addr, "priority: 10\ntimeout: 60s"),
                ("second", &second.addr, "priority: 5"),
            ],
            &format!("tools: [get_weather]\ntool_concurrency: {concurrency}\napproval_timeout: 600s\nevent_budget: 60s"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let mut stream = c
            .run(pb::RunRequest {
                session_id: s,
                input: "three tools".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let mut events = Vec::new();
        let mut next = async || {
            let ev = stream.message().await.unwrap().expect("the run goes on");
            events.push(ev.clone());
            ev
        };
        // Call 1 is in its chain; with room for it, call 2 waits on `ask`.
        in1.notified().await;
        let mut asked = None;
        if concurrency > 2 {
            while asked.is_none() {
                if let Some(pb::run_event::Event::ApprovalRequested(a)) = next().await.event {
                    assert_eq!(a.call_index, 2);
                    asked = a.call.map(|c| c.id);
                }
            }
        }
        // Call 0 terminates; its verdict reaches the client once the batch
        // is stopped.
        go0.notify_one();
        let run_id = loop {
            let ev = next().await;
            if let Some(pb::run_event::Event::HookVerdict(v)) = &ev.event {
                if v.hook == "gate" && v.verdict_kind() == pb::VerdictKind::Terminate {
                    break ev.run_id;
                }
            }
        };
        if let Some(call_id) = asked {
            let refused = c
                .resolve_approval(pb::ResolveApprovalRequest {
                    run_id,
                    call_id,
                    approve: true,
                    note: String::new(),
                })
                .await
                .expect_err("the stopped batch's approval was withdrawn");
            assert_eq!(refused.code(), tonic::Code::NotFound);
        }
        // Call 1's first hook now answers `proceed`.
        go1.notify_one();
        while stream
            .message()
            .await
            .unwrap()
            .map(|e| events.push(e))
            .is_some()
        {}
        let r = result_of(&events);
        assert_eq!(
            outcome(&r),
            pb::RunOutcome::Terminated,
            "concurrency {concurrency}: {}",
            r.reason
        );
        assert!(r.reason.contains("Paris stops the batch"), "{}", r.reason);
        assert!(
            owner.hook.tool_calls.lock().unwrap().is_empty(),
            "concurrency {concurrency}: a tool ran after the batch stopped"
        );
        assert!(
            second.hook.seen_kinds().is_empty(),
            "concurrency {concurrency}: a hook was called after the batch stopped"
        );
        let gate_saw: Vec<u32> = gate
            .hook
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match &e.payload {
                Some(pb::hook_event::Payload::ToolCall(t)) => Some(t.call_index),
                _ => None,
            })
            .collect();
        let mut gate_saw = gate_saw;
        gate_saw.sort();
        let want: &[u32] = if concurrency > 2 { &[0, 1, 2] } else { &[0, 1] };
        assert_eq!(gate_saw, want, "concurrency {concurrency}");
        assert!(
            !events
                .iter()
                .any(|e| matches!(e.event, Some(pb::run_event::Event::ToolStarted(_)))),
            "concurrency {concurrency}"
        );
        server.stop().await;
    }
}

/// A call to a tool a `model_request` patch hid from that model call is an
/// unknown tool (`invalid_tool_call`), never executed, even though the agent
/// has the tool and the model (scripted here) called it anyway.
/// Current-thread on purpose: the hook's verdict for call 0 and its
/// duplicate arrive in one read, so the stream breaks (handing its fault to
/// call 1, still waiting) before either call is polled again, and call 0,
/// woken first, is polled first: the order in which the fault could hide.
#[tokio::test(flavor = "current_thread")]
async fn a_broken_closed_stream_stops_a_call_whose_own_verdict_came_first() {
    let owner = weather_owner().start().await;
    let mut dup =
        support::fault::FaultHook::new(K::ToolCall, support::fault::Misbehave::Duplicate, &[]);
    dup.only_index = Some(0);
    let (dup_addr, _task) = dup.start().await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("dup", &dup_addr, "")],
        "tools: [get_weather]\ntool_concurrency: 2",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "two tools").await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed, "{}", r.reason);
    assert!(
        r.reason
            .contains("hook `dup` failed on tool_call: duplicate"),
        "{}",
        r.reason
    );
    let ran = owner.hook.tool_calls.lock().unwrap().len();
    assert_eq!(ran, 0, "no tool starts after a closed hook's stream broke");
    server.stop().await;
}

#[tokio::test]
async fn a_tool_hidden_by_active_tools_is_an_unknown_tool_and_never_runs() {
    let owner = weather_owner().start().await;
    let narrow = FnHook::new("narrow", &[K::ModelRequest, K::InvalidToolCall])
        .on_model_request(|_, ev| async move {
            // Hide every tool from the first call only.
            let first = ev
                .request
                .is_some_and(|r| !r.history.iter().any(|m| m.role == pb::Role::Tool as i32));
            Reply::new(if first {
                hook_server::patch_request(pb::RequestPatch {
                    active_tools: Some(pb::ToolNames { names: vec![] }),
                    ..Default::default()
                })
            } else {
                pb::ModelRequestVerdict {
                    action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {})),
                }
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[("owner", &owner.addr, ""), ("narrow", &narrow.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "weather").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(
        owner.hook.tool_calls.lock().unwrap().is_empty(),
        "the hidden tool ran"
    );
    let invalid = narrow.hook.invalid_tool_calls();
    assert_eq!(invalid.len(), 1, "{invalid:?}");
    assert_eq!(
        invalid[0].problem,
        pb::invalid_tool_call_event::Problem::UnknownTool as i32
    );
    assert!(
        invalid[0].available_tools.is_empty(),
        "{:?}",
        invalid[0].available_tools
    );
    assert_eq!(
        r.final_text,
        "Tool said: error: unknown tool `get_weather`. Available tools: (none)"
    );
    server.stop().await;
}

/// Every call of a turn is validated before any starts: a valid call next
/// to an invalid one whose hook asks for a retry never executes (its side
/// effect would be discarded with the turn).
#[tokio::test]
async fn an_invalid_call_retry_discards_no_call_that_already_ran() {
    for concurrency in [1u32, 2] {
        let owner = weather_owner().start().await;
        let fixer = FnHook::new("fixer", &[K::InvalidToolCall])
            .on_invalid_tool_call(|_, _| async {
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
            &format!("tools: [get_weather]\ntool_concurrency: {concurrency}"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let r = invoke(&mut c, &s, "mixed calls").await;
        assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
        assert_eq!(r.final_text, "Tool said: sunny in Paris");
        let ran: Vec<String> = owner
            .hook
            .tool_calls
            .lock()
            .unwrap()
            .iter()
            .map(city)
            .collect();
        assert_eq!(
            ran,
            ["Paris"],
            "concurrency {concurrency}: only the retried turn's call ran"
        );
        server.stop().await;
    }
}

/// Tool calls a hook injects without an id (`respond` here) get one: the
/// call runs, its hooks and the transcript pair call and result by it.
#[tokio::test]
async fn a_call_id_repeated_in_a_later_turn_gets_an_approval_of_its_own() {
    // A hook answers turns 1 and 2 with a call that has the same id, as a
    // provider numbering its ids per response would. Approvals are
    // addressed by (run, call id): turn 2's must not be turn 1's.
    let owner = weather_owner().start().await;
    let responder = FnHook::new("responder", &[K::ModelRequest])
        .on_model_request(|ctx, _| async move {
            Reply::new(pb::ModelRequestVerdict {
                action: Some(if ctx.turn <= 2 {
                    pb::model_request_verdict::Action::Respond(pb::Respond {
                        text: String::new(),
                        tool_calls: vec![pb::ToolCall {
                            id: "x".into(),
                            name: "get_weather".into(),
                            arguments_json: format!(r#"{{"city":"City{}"}}"#, ctx.turn),
                        }],
                    })
                } else {
                    pb::model_request_verdict::Action::Proceed(pb::Continue {})
                }),
            })
        })
        .start()
        .await;
    let asker = asker("ok?", 0).start().await;
    let server = TestServer::start(&config(
        &[
            ("owner", &owner.addr, ""),
            ("responder", &responder.addr, ""),
            ("asker", &asker.addr, ""),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut stream = c
        .run(pb::RunRequest {
            session_id: s,
            input: "hello".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut asked = Vec::new();
    let mut events = Vec::new();
    while let Some(ev) = stream.message().await.unwrap() {
        if let Some(pb::run_event::Event::ApprovalRequested(a)) = &ev.event {
            let call = a.call.clone().unwrap();
            // What ran so far is what was approved before this question.
            let ran = owner.hook.tool_calls.lock().unwrap().len();
            asked.push((call.id.clone(), city(&call), ran));
            c.resolve_approval(pb::ResolveApprovalRequest {
                run_id: ev.run_id.clone(),
                call_id: call.id,
                approve: true,
                note: String::new(),
            })
            .await
            .unwrap();
        }
        events.push(ev);
    }
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert_eq!(asked[0].0, "x");
    assert_ne!(asked[1].0, "x", "turn 2's call gets an id of its own");
    assert_eq!((asked[0].1.as_str(), asked[0].2), ("City1", 0));
    assert_eq!((asked[1].1.as_str(), asked[1].2), ("City2", 1));
    let ran: Vec<String> = owner
        .hook
        .tool_calls
        .lock()
        .unwrap()
        .iter()
        .map(city)
        .collect();
    assert_eq!(ran, ["City1", "City2"]);
    server.stop().await;
}

#[tokio::test]
async fn injected_tool_calls_without_an_id_get_one() {
    let owner = weather_owner().start().await;
    let responder = FnHook::new("responder", &[K::ModelRequest, K::ToolCall])
        .on_model_request(|_, ev| async move {
            let first = ev
                .request
                .is_some_and(|r| !r.history.iter().any(|m| m.role == pb::Role::Tool as i32));
            Reply::new(pb::ModelRequestVerdict {
                action: Some(if first {
                    pb::model_request_verdict::Action::Respond(pb::Respond {
                        text: String::new(),
                        tool_calls: vec![
                            pb::ToolCall {
                                id: String::new(),
                                name: "get_weather".into(),
                                arguments_json: r#"{"city":"Paris"}"#.into(),
                            },
                            pb::ToolCall {
                                id: String::new(),
                                name: "get_weather".into(),
                                arguments_json: r#"{"city":"Oslo"}"#.into(),
                            },
                        ],
                    })
                } else {
                    pb::model_request_verdict::Action::Proceed(pb::Continue {})
                }),
            })
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[
            ("owner", &owner.addr, ""),
            ("responder", &responder.addr, ""),
        ],
        "tools: [get_weather]",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "hello").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    let calls = owner.hook.tool_calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert!(calls.iter().all(|c| !c.id.is_empty()), "{calls:?}");
    assert_ne!(calls[0].id, calls[1].id);
    let hooked: Vec<String> = responder
        .hook
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match &e.payload {
            Some(pb::hook_event::Payload::ToolCall(t)) => t.call.as_ref().map(|c| c.id.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(hooked.len(), 2);
    assert!(hooked.iter().all(|id| !id.is_empty()), "{hooked:?}");
    // In the transcript, each result names its call's id.
    let mut call_ids = Vec::new();
    let mut result_ids = Vec::new();
    for b in r.messages.iter().flat_map(|m| m.blocks.iter()) {
        match &b.kind {
            Some(pb::block::Kind::ToolCall(c)) => call_ids.push(c.id.clone()),
            Some(pb::block::Kind::ToolResult(t)) => result_ids.push(t.call_id.clone()),
            _ => {}
        }
    }
    assert_eq!(call_ids.len(), 2);
    assert_eq!(call_ids, result_ids);
    server.stop().await;
}

fn kinds_of(events: &[pb::RunEvent]) -> Vec<&'static str> {
    use pb::run_event::Event as E;
    events
        .iter()
        .filter_map(|e| {
            Some(match e.event.as_ref()? {
                E::TextDelta(_) => "delta",
                E::AssistantMessage(_) => "assistant",
                E::DeltasRetracted(_) => "retracted",
                E::HookVerdict(v) if v.event == K::TurnEnd as i32 => "turn_end_verdict",
                E::Finished(_) => "finished",
                _ => return None,
            })
        })
        .collect()
}

/// With `stream_deltas: pass`, deltas of a turn that is never accepted are
/// retracted whatever ends it: a hook failure, a timeout or a cancel.
#[tokio::test]
async fn pass_mode_retracts_deltas_when_a_failure_timeout_or_cancel_ends_the_turn() {
    for (case, hook_extra, agent_extra, want) in [
        ("failure", "timeout: 150ms", "", pb::RunOutcome::HookFailed),
        (
            "timeout",
            "timeout: 60s",
            "run_timeout: 300ms",
            pb::RunOutcome::TimedOut,
        ),
        ("cancel", "timeout: 60s", "", pb::RunOutcome::Cancelled),
    ] {
        // A model_response hook that never answers; it says when it is asked.
        let asked = Arc::new(Notify::new());
        let a = asked.clone();
        let silent = FnHook::new("silent", &[K::ModelResponse])
            .on_model_response(move |_, _| {
                let a = a.clone();
                async move {
                    a.notify_one();
                    std::future::pending::<()>().await;
                    unreachable!()
                }
            })
            .start()
            .await;
        let server = TestServer::start(&config(
            &[("silent", &silent.addr, hook_extra)],
            &format!("stream_deltas: pass\nevent_budget: 60s\n{agent_extra}"),
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let mut c2 = c.clone();
        let s2 = s.clone();
        let run = tokio::spawn(async move { run_events(&mut c2, &s2, "hello").await });
        if case == "cancel" {
            asked.notified().await;
            let session = c
                .get_session(pb::GetSessionRequest {
                    session_id: s.clone(),
                })
                .await
                .unwrap()
                .into_inner();
            c.cancel_run(pb::CancelRunRequest {
                run_id: session.active_run_id,
            })
            .await
            .unwrap();
        }
        let events = run.await.unwrap();
        let r = result_of(&events);
        assert_eq!(outcome(&r), want, "{case}: {}", r.reason);
        let k = kinds_of(&events);
        assert!(k.contains(&"delta"), "{case}: deltas were streamed: {k:?}");
        assert_eq!(k[k.len() - 2..], ["retracted", "finished"], "{case}: {k:?}");
        let reason = events
            .iter()
            .find_map(|e| match &e.event {
                Some(pb::run_event::Event::DeltasRetracted(d)) => Some(d.reason.clone()),
                _ => None,
            })
            .unwrap();
        assert!(reason.contains("before the turn was accepted"), "{reason}");
        server.stop().await;
    }
}

/// A call that passed its hooks while every connection to its tool's owner
/// was busy waits for a slot; a stop during that wait (call 2's terminate
/// here) means it never sends its `CallTool`, even once the slot frees.
#[tokio::test]
async fn a_call_waiting_for_a_connection_slot_never_runs_after_a_terminate() {
    // The owner's only slot is held by the first call to arrive until the
    // test has seen the terminate.
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let first_arrived = Arc::new(Notify::new());
    let (r, f) = (release.clone(), first_arrived.clone());
    let owner = FnHook::new("owner", &[])
        .with_tool(weather_tool(), move |_, call| {
            let (r, f) = (r.clone(), f.clone());
            async move {
                f.notify_one();
                let _held = r.acquire().await.unwrap();
                pb::CallToolResponse {
                    content: format!("sunny in {}", city(&call)),
                    is_error: false,
                }
            }
        })
        .start()
        .await;
    let arrived = first_arrived.clone();
    let g = FnHook::new("g", &[K::ToolCall])
        .on_tool_call(move |_, ev| {
            let arrived = arrived.clone();
            async move {
                let action = if ev.call_index < 2 {
                    pb::tool_call_verdict::Action::Proceed(pb::Continue {})
                } else {
                    // One of calls 0 and 1 holds the slot; the other, past
                    // its hooks, reaches the wait for it well within this
                    // pause (there is no signal for "waiting in the pool").
                    arrived.notified().await;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    pb::tool_call_verdict::Action::Terminate(hook_server::terminate(
                        "Rome stops the batch",
                        None,
                    ))
                };
                Reply::new(pb::ToolCallVerdict {
                    action: Some(action),
                })
            }
        })
        .start()
        .await;
    let server = TestServer::start(&config(
        &[
            (
                "owner",
                &owner.addr,
                "connections: {max: 1, max_streams_per_connection: 1}\ntimeout: 60s",
            ),
            ("g", &g.addr, "timeout: 60s"),
        ],
        "tools: [get_weather]\ntool_concurrency: 3\nevent_budget: 60s",
    ))
    .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut stream = c
        .run(pb::RunRequest {
            session_id: s,
            input: "three tools".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    while let Some(ev) = stream.message().await.unwrap() {
        if let Some(pb::run_event::Event::HookVerdict(v)) = &ev.event {
            if v.hook == "g" && v.verdict_kind() == pb::VerdictKind::Terminate {
                // The batch is stopped: the slot may free now.
                release.add_permits(3);
            }
        }
        events.push(ev);
    }
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Terminated, "{}", r.reason);
    assert!(r.reason.contains("Rome stops the batch"), "{}", r.reason);
    let ran = owner.hook.tool_calls.lock().unwrap().len();
    assert_eq!(ran, 1, "only the call holding the slot ran");
    server.stop().await;
}

/// A `rewrite_args` verdict whose arguments the tool would refuse (its
/// schema requires `city`; not a JSON object) fails validation: under a
/// closed policy the run fails (`invalid_verdict`) before any tool runs;
/// under an open one the rewrite is ignored (the hook counts as having
/// said continue) and the model's own arguments go to the tool.
#[tokio::test]
async fn rewritten_arguments_are_checked_against_the_tools_schema() {
    let (logs, _guard) = support::logwatch::LogWatch::install("info");
    for (args, failure) in [
        (r#"{"town":"Paris"}"#, "closed"),
        ("[1]", "closed"),
        (r#"{"town":"Paris"}"#, "open"),
    ] {
        let owner = weather_owner().start().await;
        let rewriter = FnHook::new("rewriter", &[K::ToolCall])
            .on_tool_call(move |_, _| async move {
                Reply::new(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::RewriteArgs(
                        pb::RewriteArgs {
                            arguments_json: args.into(),
                        },
                    )),
                })
            })
            .start()
            .await;
        let server = TestServer::start(&config(
            &[
                ("rewriter", &rewriter.addr, &format!("failure: {failure}")),
                ("owner", &owner.addr, ""),
            ],
            "tools: [get_weather]",
        ))
        .await;
        let mut c = server.client().await;
        let s = session(&mut c, "a").await;
        let r = invoke(&mut c, &s, "weather").await;
        let ran: Vec<String> = owner
            .hook
            .tool_calls
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.arguments_json.clone())
            .collect();
        if failure == "closed" {
            assert_eq!(
                outcome(&r),
                pb::RunOutcome::HookFailed,
                "{args}: {}",
                r.reason
            );
            assert!(
                r.reason
                    .contains("hook `rewriter` failed on tool_call: invalid_verdict"),
                "{args}: {}",
                r.reason
            );
            assert!(ran.is_empty(), "{args}: the tool ran with {ran:?}");
        } else {
            assert_eq!(
                outcome(&r),
                pb::RunOutcome::Completed,
                "{args}: {}",
                r.reason
            );
            assert_eq!(ran, [r#"{"city":"Paris"}"#], "the rewrite was ignored");
            assert!(
                r.hook_verdicts
                    .iter()
                    .any(|v| v.hook == "rewriter" && v.failed_open == "invalid_verdict"),
                "{:?}",
                r.hook_verdicts
            );
            // The schema's complaint names the hook's keys: not above debug.
            let warned = logs.lines_with(&["WARN", "hook failed", "rewriter"]);
            assert!(!warned.is_empty(), "{}", logs.contents());
            assert!(
                warned.iter().all(|l| !l.contains("required property")),
                "{warned:?}"
            );
        }
        server.stop().await;
    }
}
