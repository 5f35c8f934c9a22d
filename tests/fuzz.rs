//! Property-based fuzzing of the boundaries hookwire does not control:
//! verdicts from hook servers (arbitrary bytes and arbitrary messages,
//! through decoding, `accept_verdict` for every event and the composition
//! rules) and requests from clients (arbitrary AgentService calls, and
//! arbitrary bytes as their messages, through a real server). Nothing may
//! panic, and every rejection is a typed error: a hook failure class, or a
//! gRPC status hookwire chose.
//!
//! `make test` runs a few dozen cases per property; `make fuzz` runs them
//! with `PROPTEST_CASES` (default there: 20000). The OpenAI stream parser
//! and retry logic are fuzzed in their own modules (`cargo test --lib
//! fuzz_`).

mod support;

use hookwire::event::EventKind;
use hookwire::hooks::compose::{self, ChainEvent, Merged};
use hookwire::hooks::dispatch::accept_verdict;
use hookwire::hooks::failure::FailureClass;
use hookwire::hooks::verdict::Action;
use hookwire::message::{Block, Message, Role, ToolCall, ToolSpec};
use hookwire::model::ModelRequest;
use hookwire::pb;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use prost::Message as _;
use support::*;

/// `PROPTEST_CASES` when set (`make fuzz`), else `default` (`make test`).
fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        // Findings become named regression tests, not files in the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------ verdicts

fn text() -> BoxedStrategy<String> {
    prop_oneof![
        Just(String::new()),
        Just(" ".to_string()),
        "[a-z_]{1,8}",
        any::<String>(),
        Just("{}".to_string()),
        Just(r#"{"city":"Paris"}"#.to_string()),
        Just(r#"{"city": "Par"#.to_string()),
        Just("[1]".to_string()),
        Just("null".to_string()),
        "\\{\"[a-z]{0,4}\":.{0,12}\\}?",
    ]
    .boxed()
}

fn name() -> BoxedStrategy<String> {
    prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        Just("c".to_string()),
        Just("get_weather".to_string()),
        text()
    ]
    .boxed()
}

fn number() -> BoxedStrategy<f64> {
    prop_oneof![
        0.0..=2.0f64,
        any::<f64>(),
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(-0.0),
        Just(1e30)
    ]
    .boxed()
}

fn enum_value(known: i32) -> BoxedStrategy<i32> {
    prop_oneof![0..known, any::<i32>()].boxed()
}

fn terminate() -> BoxedStrategy<pb::Terminate> {
    (text(), option::of(text()))
        .prop_map(|(reason, reply)| pb::Terminate { reason, reply })
        .boxed()
}

fn tool_call() -> BoxedStrategy<pb::ToolCall> {
    (text(), name(), text())
        .prop_map(|(id, name, arguments_json)| pb::ToolCall {
            id,
            name,
            arguments_json,
        })
        .boxed()
}

fn block() -> BoxedStrategy<pb::Block> {
    use pb::block::Kind;
    prop_oneof![
        text().prop_map(|text| Some(Kind::Text(pb::TextBlock { text }))),
        text().prop_map(|text| Some(Kind::Reasoning(pb::ReasoningBlock { text }))),
        tool_call().prop_map(|c| Some(Kind::ToolCall(c))),
        (text(), name(), text(), any::<bool>()).prop_map(|(call_id, name, content, is_error)| {
            Some(Kind::ToolResult(pb::ToolResultBlock {
                call_id,
                name,
                content,
                is_error,
            }))
        }),
        Just(None),
    ]
    .prop_map(|kind| pb::Block { kind })
    .boxed()
}

fn message() -> BoxedStrategy<pb::Message> {
    (enum_value(4), vec(block(), 0..3))
        .prop_map(|(role, blocks)| pb::Message { role, blocks })
        .boxed()
}

fn tool_choice() -> BoxedStrategy<pb::ToolChoice> {
    (enum_value(4), name())
        .prop_map(|(mode, tool_name)| pb::ToolChoice { mode, tool_name })
        .boxed()
}

fn patch() -> BoxedStrategy<pb::RequestPatch> {
    (
        vec(text(), 0..2),
        option::of(text()),
        option::of(number()),
        option::of(any::<u32>()),
        option::of(tool_choice()),
        option::of(vec(name(), 0..3)),
        text(),
        option::of(vec(message(), 0..3)),
    )
        .prop_map(
            |(
                extra_context,
                system_prompt,
                temperature,
                max_tokens,
                tc,
                active,
                params,
                history,
            )| {
                pb::RequestPatch {
                    extra_context,
                    system_prompt,
                    temperature,
                    max_tokens,
                    tool_choice: tc,
                    active_tools: active.map(|names| pb::ToolNames { names }),
                    additional_params_json: params,
                    history: history.map(|messages| pb::MessageList { messages }),
                }
            },
        )
        .boxed()
}

fn skip() -> BoxedStrategy<pb::Skip> {
    (text(), any::<bool>())
        .prop_map(|(result, is_error)| pb::Skip { result, is_error })
        .boxed()
}

fn typed_verdict() -> BoxedStrategy<pb::hook_verdict::Verdict> {
    use pb::hook_verdict::Verdict as V;
    let c = || Just(pb::Continue {});
    prop_oneof![
        prop_oneof![
            c().prop_map(pb::session_start_verdict::Action::Proceed),
            terminate().prop_map(pb::session_start_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::SessionStart(pb::SessionStartVerdict { action: Some(a) })),
        prop_oneof![
            c().prop_map(pb::run_start_verdict::Action::Proceed),
            text().prop_map(|input| pb::run_start_verdict::Action::RewriteInput(
                pb::RewriteInput { input }
            )),
            terminate().prop_map(pb::run_start_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::RunStart(pb::RunStartVerdict { action: Some(a) })),
        prop_oneof![
            c().prop_map(pb::model_request_verdict::Action::Proceed),
            patch().prop_map(pb::model_request_verdict::Action::PatchRequest),
            (text(), vec(tool_call(), 0..3)).prop_map(|(text, tool_calls)| {
                pb::model_request_verdict::Action::Respond(pb::Respond { text, tool_calls })
            }),
            terminate().prop_map(pb::model_request_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::ModelRequest(pb::ModelRequestVerdict { action: Some(a) })),
        prop_oneof![
            c().prop_map(pb::model_response_verdict::Action::Proceed),
            vec(block(), 0..3).prop_map(|blocks| {
                pb::model_response_verdict::Action::RewriteResponse(pb::RewriteResponse { blocks })
            }),
            text().prop_map(
                |feedback| pb::model_response_verdict::Action::Retry(pb::Retry { feedback })
            ),
            terminate().prop_map(pb::model_response_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::ModelResponse(pb::ModelResponseVerdict { action: Some(a) })),
        prop_oneof![
            c().prop_map(pb::invalid_tool_call_verdict::Action::Proceed),
            text().prop_map(
                |feedback| pb::invalid_tool_call_verdict::Action::Retry(pb::Retry { feedback })
            ),
            skip().prop_map(pb::invalid_tool_call_verdict::Action::Skip),
            terminate().prop_map(pb::invalid_tool_call_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::InvalidToolCall(pb::InvalidToolCallVerdict { action: Some(a) })),
        prop_oneof![
            c().prop_map(pb::tool_call_verdict::Action::Proceed),
            text().prop_map(|arguments_json| pb::tool_call_verdict::Action::RewriteArgs(
                pb::RewriteArgs { arguments_json }
            )),
            skip().prop_map(pb::tool_call_verdict::Action::Skip),
            (text(), any::<u64>()).prop_map(|(question, timeout_ms)| {
                pb::tool_call_verdict::Action::Ask(pb::Ask {
                    question,
                    timeout_ms,
                })
            }),
            terminate().prop_map(pb::tool_call_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::ToolCall(pb::ToolCallVerdict { action: Some(a) })),
        prop_oneof![
            c().prop_map(pb::tool_result_verdict::Action::Proceed),
            (text(), option::of(any::<bool>())).prop_map(|(content, is_error)| {
                pb::tool_result_verdict::Action::RewriteResult(pb::RewriteResult {
                    content,
                    is_error,
                })
            }),
            terminate().prop_map(pb::tool_result_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::ToolResult(pb::ToolResultVerdict { action: Some(a) })),
        prop_oneof![
            c().prop_map(pb::turn_end_verdict::Action::Proceed),
            text().prop_map(
                |message| pb::turn_end_verdict::Action::ContinueRun(pb::ContinueRun { message })
            ),
            terminate().prop_map(pb::turn_end_verdict::Action::Terminate),
        ]
        .prop_map(|a| V::TurnEnd(pb::TurnEndVerdict { action: Some(a) })),
        // A verdict field with no action set.
        Just(V::ToolCall(pb::ToolCallVerdict { action: None })),
    ]
    .boxed()
}

fn scratchpad_update() -> BoxedStrategy<pb::ScratchpadUpdate> {
    use pb::scratchpad_update::Op;
    (
        text(),
        prop_oneof![
            vec(any::<u8>(), 0..32).prop_map(|b| Some(Op::Set(b))),
            any::<bool>().prop_map(|d| Some(Op::Delete(d))),
            Just(None),
        ],
    )
        .prop_map(|(key, op)| pb::ScratchpadUpdate { key, op })
        .boxed()
}

fn hook_verdict() -> BoxedStrategy<pb::HookVerdict> {
    (
        any::<u64>(),
        vec(scratchpad_update(), 0..3),
        text(),
        option::of(text()),
        option::of(typed_verdict()),
    )
        .prop_map(
            |(seq, scratchpad, reason, telemetry_redaction, verdict)| pb::HookVerdict {
                seq,
                scratchpad,
                reason,
                telemetry_redaction,
                verdict,
            },
        )
        .boxed()
}

/// The request a `model_request` verdict patches: tools a, b, c, and a
/// history holding a model's malformed (cut-off) tool call.
fn baseline() -> ModelRequest {
    ModelRequest {
        model: "m".into(),
        system_prompt: "sys".into(),
        history: vec![
            Message::user("weather?"),
            Message {
                role: Role::Assistant,
                blocks: vec![Block::ToolCall(ToolCall {
                    id: "call_1".into(),
                    name: "get_weather".into(),
                    arguments_json: r#"{"city": "Par"#.into(),
                })],
            },
        ]
        .into(),
        tools: ["a", "b", "c"]
            .iter()
            .map(|n| ToolSpec {
                name: n.to_string(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// Judges `v` as hookwire does for every event, with and without a
/// baseline, then feeds accepted actions to the composition rules.
fn judge_everywhere(v: &pb::HookVerdict, base: &ModelRequest) -> Result<(), TestCaseError> {
    for kind in EventKind::ALL {
        for baseline in [Some(base), None] {
            match accept_verdict(kind, v.clone(), baseline) {
                Ok(verdict) => {
                    prop_assert_eq!(verdict.action.event(), kind);
                    compose_action(kind, verdict.action, base)?;
                }
                Err(f) => prop_assert!(
                    matches!(
                        f.class,
                        FailureClass::InvalidVerdict | FailureClass::WrongKind
                    ),
                    "unexpected class {:?}",
                    f
                ),
            }
        }
    }
    Ok(())
}

fn compose_action(
    kind: EventKind,
    action: Action,
    base: &ModelRequest,
) -> Result<(), TestCaseError> {
    fn chain<E: ChainEvent>(mut payload: E::Payload, action: Action) -> Result<(), TestCaseError> {
        prop_assert!(
            E::apply(&mut payload, action).is_ok(),
            "accepted but not applicable"
        );
        Ok(())
    }
    let call = ToolCall {
        id: "1".into(),
        name: "a".into(),
        arguments_json: "{}".into(),
    };
    match kind {
        EventKind::SessionStart => chain::<compose::SessionStartChain>((), action),
        EventKind::RunStart => chain::<compose::RunStartChain>("in".into(), action),
        EventKind::ModelResponse => {
            chain::<compose::ModelResponseChain>(Default::default(), action)
        }
        EventKind::InvalidToolCall => chain::<compose::InvalidToolCallChain>(call, action),
        EventKind::ToolCall => chain::<compose::ToolCallChain>(call, action),
        EventKind::ToolResult => chain::<compose::ToolResultChain>(
            hookwire::message::ToolResult {
                call_id: "1".into(),
                name: "a".into(),
                content: "r".into(),
                is_error: false,
            },
            action,
        ),
        EventKind::TurnEnd => chain::<compose::TurnEndChain>(Message::user("x"), action),
        EventKind::ModelRequest => {
            let Action::ModelRequest(a) = action else {
                unreachable!("kind checked")
            };
            let merged = compose::merge(base, vec![("h".into(), a.clone()), ("g".into(), a)]);
            if let Merged::Request {
                request,
                records,
                removed,
            } = merged
            {
                let _ = compose::validate_effective(&request, &records, &removed);
            }
            Ok(())
        }
        EventKind::TextDelta | EventKind::RunEnd | EventKind::SessionEnd => Err(
            TestCaseError::fail(format!("an observe event ({kind}) accepted a verdict")),
        ),
    }
}

#[test]
fn fuzz_arbitrary_verdict_messages_are_judged_without_panics() {
    let base = baseline();
    let mut runner = TestRunner::new(cases(256));
    runner
        .run(
            &(
                hook_verdict(),
                vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            ),
            |(v, flips)| {
                judge_everywhere(&v, &base)?;
                // The same verdict with a few bytes changed on the wire.
                let mut bytes = v.encode_to_vec();
                for (at, byte) in flips {
                    if !bytes.is_empty() {
                        let i = at.index(bytes.len());
                        bytes[i] = byte;
                    }
                }
                if let Ok(mutated) = pb::HookVerdict::decode(bytes.as_slice()) {
                    judge_everywhere(&mutated, &base)?;
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn fuzz_arbitrary_verdict_bytes_are_decoded_and_judged_without_panics() {
    let base = baseline();
    let mut runner = TestRunner::new(cases(256));
    runner
        .run(&vec(any::<u8>(), 0..256), |bytes| {
            if let Ok(v) = pb::HookVerdict::decode(bytes.as_slice()) {
                judge_everywhere(&v, &base)?;
            }
            Ok(())
        })
        .unwrap();
}

// ------------------------------------------------------------ AgentService

/// Stands for the id of a session created for the case.
const SESSION: &str = "<session>";

#[derive(Clone, Debug)]
enum Call {
    Create {
        agent: String,
        extra_hooks: Vec<String>,
        metadata: Vec<(String, String)>,
    },
    Get(String),
    List {
        agent: String,
        page_size: i32,
        page_token: String,
    },
    Delete(String),
    Run {
        session: String,
        input: String,
    },
    Invoke {
        session: String,
        input: String,
    },
    Cancel(String),
    Resolve {
        run_id: String,
        call_id: String,
        approve: bool,
        note: String,
    },
    ListHooks,
    Raw {
        method: &'static str,
        bytes: Vec<u8>,
    },
}

const METHODS: [&str; 10] = [
    "CreateSession",
    "GetSession",
    "ListSessions",
    "DeleteSession",
    "Run",
    "Invoke",
    "CancelRun",
    "ResolveApproval",
    "ListHooks",
    "NoSuchMethod",
];

fn session_id() -> BoxedStrategy<String> {
    prop_oneof![3 => Just(SESSION.to_string()), 1 => text()].boxed()
}

fn input() -> BoxedStrategy<String> {
    // The server below accepts at most 512 bytes of input.
    prop_oneof![text(), "[ -~]{400,700}", Just("weather please".to_string())].boxed()
}

fn call() -> BoxedStrategy<Call> {
    prop_oneof![
        (
            prop_oneof![Just("a".to_string()), text()],
            vec(prop_oneof![Just("obs".to_string()), text()], 0..2),
            vec((text(), text()), 0..3)
        )
            .prop_map(|(agent, extra_hooks, metadata)| Call::Create {
                agent,
                extra_hooks,
                metadata
            }),
        session_id().prop_map(Call::Get),
        (
            prop_oneof![Just(String::new()), Just("a".to_string()), text()],
            prop_oneof![Just(0i32), any::<i32>()],
            prop_oneof![Just(String::new()), text()]
        )
            .prop_map(|(agent, page_size, page_token)| Call::List {
                agent,
                page_size,
                page_token
            }),
        session_id().prop_map(Call::Delete),
        (session_id(), input()).prop_map(|(session, input)| Call::Run { session, input }),
        (session_id(), input()).prop_map(|(session, input)| Call::Invoke { session, input }),
        text().prop_map(Call::Cancel),
        (text(), text(), any::<bool>(), text()).prop_map(|(run_id, call_id, approve, note)| {
            Call::Resolve {
                run_id,
                call_id,
                approve,
                note,
            }
        }),
        Just(Call::ListHooks),
        (prop::sample::select(&METHODS[..]), vec(any::<u8>(), 0..64))
            .prop_map(|(method, bytes)| Call::Raw { method, bytes }),
    ]
    .boxed()
}

/// Statuses hookwire answers bad client requests with. Anything else
/// (INTERNAL, UNKNOWN, a reset connection) is a bug: a panic, a mapping
/// nobody chose, or tonic speaking for hookwire.
fn chosen(s: &tonic::Status) -> Result<(), TestCaseError> {
    use tonic::Code;
    prop_assert!(
        matches!(
            s.code(),
            Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition | Code::Unimplemented
        ),
        "unchosen status {:?}: {}",
        s.code(),
        s.message()
    );
    Ok(())
}

async fn exercise(
    c: &mut pb::agent_service_client::AgentServiceClient<tonic::transport::Channel>,
    channel: &tonic::transport::Channel,
    call: Call,
) -> Result<(), TestCaseError> {
    let s = session(c, "a").await;
    let fill = |id: String| if id == SESSION { s.clone() } else { id };
    let status = match call {
        Call::Create {
            agent,
            extra_hooks,
            metadata,
        } => c
            .create_session(pb::CreateSessionRequest {
                agent,
                extra_hooks,
                metadata: metadata.into_iter().collect(),
            })
            .await
            .err(),
        Call::Get(id) => c
            .get_session(pb::GetSessionRequest {
                session_id: fill(id),
            })
            .await
            .err(),
        Call::List {
            agent,
            page_size,
            page_token,
        } => c
            .list_sessions(pb::ListSessionsRequest {
                agent,
                page_size,
                page_token,
            })
            .await
            .err(),
        Call::Delete(id) => c
            .delete_session(pb::DeleteSessionRequest {
                session_id: fill(id),
            })
            .await
            .err(),
        Call::Run { session, input } => {
            match c
                .run(pb::RunRequest {
                    session_id: fill(session),
                    input,
                })
                .await
            {
                Err(e) => Some(e),
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    let mut last = None;
                    loop {
                        match stream.message().await {
                            Ok(Some(ev)) => last = ev.event,
                            Ok(None) => break,
                            Err(e) => {
                                return Err(TestCaseError::fail(format!("run stream: {e:?}")))
                            }
                        }
                    }
                    prop_assert!(
                        matches!(last, Some(pb::run_event::Event::Finished(_))),
                        "a run stream ends with Finished: {:?}",
                        last
                    );
                    None
                }
            }
        }
        Call::Invoke { session, input } => c
            .invoke(pb::RunRequest {
                session_id: fill(session),
                input,
            })
            .await
            .err(),
        Call::Cancel(run_id) => c.cancel_run(pb::CancelRunRequest { run_id }).await.err(),
        Call::Resolve {
            run_id,
            call_id,
            approve,
            note,
        } => c
            .resolve_approval(pb::ResolveApprovalRequest {
                run_id,
                call_id,
                approve,
                note,
            })
            .await
            .err(),
        Call::ListHooks => c.list_hooks(pb::ListHooksRequest {}).await.err(),
        Call::Raw { method, bytes } => {
            if method == "Run" {
                support::raw::streaming(channel.clone(), method, bytes)
                    .await
                    .err()
            } else {
                support::raw::unary(channel.clone(), method, bytes)
                    .await
                    .err()
            }
        }
    };
    if let Some(s) = status {
        chosen(&s)?;
    }
    Ok(())
}

#[test]
fn fuzz_arbitrary_agent_service_requests_get_chosen_statuses() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let obs = rt.block_on(FnHook::new("obs", &[pb::EventKind::RunStart]).start());
    let yaml =
        config(&[("obs", &obs.addr, "mode: observe")], "") + "server:\n  max_input_bytes: 512\n";
    let server = rt.block_on(TestServer::start(&yaml));
    let mut c = rt.block_on(server.client());
    let channel = rt.block_on(async {
        tonic::transport::Channel::from_shared(server.addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap()
    });
    let mut runner = TestRunner::new(cases(64));
    runner
        .run(&call(), |call| {
            let mut c = c.clone();
            rt.block_on(exercise(&mut c, &channel, call))
        })
        .unwrap();
    // Still serving.
    rt.block_on(async {
        c.list_sessions(pb::ListSessionsRequest::default())
            .await
            .unwrap();
        server.stop().await;
    });
    drop(obs);
}
