//! The contract grows (new fields, enum values, oneof cases, verdict
//! actions), so each side meets values it does not know. The rules are in
//! hook.proto's header and docs/writing-hooks.md ("When the contract
//! grows"); these tests hold both sides to them over real gRPC:
//!
//! - a hook (the Python example, a real process) fed events from a newer
//!   hookwire: unknown enum values, an unknown block kind, unknown fields, an
//!   observe event of an unknown kind. Sent as raw bytes, since the
//!   generated types cannot hold what they do not know;
//! - hookwire and its conformance checker fed verdicts from a newer hook
//!   (tests/support/future_hook.py, the Python example with fields added):
//!   unknown fields are ignored and the verdict applied; an unknown action
//!   is an invalid verdict, failing closed.

mod support;

use hookwire::pb;
use prost::bytes::{Buf, BufMut};
use prost::Message;
use support::python::PythonHook;
use support::*;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// What future_hook.py puts in the fields it adds; used here too.
const MARKER: &[u8] = b"field-from-a-newer-hookwire-v1";
const FUTURE_HOOK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/future_hook.py");
/// An enum value no released proto has.
const UNKNOWN_ENUM: i32 = 42;
const SECRET: &str = "sk-live-4f9a8b7c6d5e4f3a";

/// Passes messages through as bytes.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

/// One Process stream with `events` (then half-closed); every verdict, raw.
async fn process(addr: &str, events: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_string())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/hookwire.v1.HookService/Process");
    // Every event is queued before the call: grpcio answers headers only
    // with its first reply.
    let mut inbound = grpc
        .streaming(
            tonic::Request::new(tokio_stream::iter(events)),
            path,
            RawCodec,
        )
        .await?
        .into_inner();
    let mut verdicts = Vec::new();
    while let Some(v) = inbound.message().await? {
        verdicts.push(v);
    }
    Ok(verdicts)
}

/// A length-delimited field, encoded by hand.
fn field(number: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    prost::encoding::encode_key(number, prost::encoding::WireType::LengthDelimited, &mut out);
    prost::encoding::encode_varint(u64::try_from(payload.len()).unwrap(), &mut out);
    out.extend_from_slice(payload);
    out
}

/// A HookEvent whose payload (field `payload_field`) is given as bytes,
/// plus a field no released proto has.
fn event(
    seq: u64,
    kind: i32,
    expects_verdict: bool,
    payload_field: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = pb::HookEvent {
        seq,
        kind,
        context: Some(pb::EventContext {
            session_id: "s-1".into(),
            run_id: "r-1".into(),
            turn: 1,
            agent: "a".into(),
            deadline_remaining_ms: 5_000,
            ..Default::default()
        }),
        expects_verdict,
        payload: None,
    }
    .encode_to_vec();
    out.extend(field(payload_field, payload));
    out.extend(field(1000, MARKER));
    out
}

fn text(t: &str) -> pb::Block {
    pb::Block {
        kind: Some(pb::block::Kind::Text(pb::TextBlock { text: t.into() })),
    }
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

/// A newer hookwire sends the Python example a model_request whose history
/// has a message of an unknown role and whose tool_choice has an unknown
/// mode, a model_response with a block of an unknown kind, a run_end with an
/// unknown outcome and an observe event of an unknown kind, each with an
/// unknown field. The hook must answer the two blocking events correctly
/// (leaving the unknown mode alone, keeping the unknown block when it
/// rewrites the message), answer nothing else, and end the stream cleanly.
#[tokio::test]
async fn the_python_example_handles_events_from_a_newer_hookwire() {
    let py = PythonHook::start(&[]).await;

    let tool = |name: &str| pb::ToolSpec {
        name: name.into(),
        description: "a tool".into(),
        parameters_json_schema: r#"{"type":"object"}"#.into(),
    };
    let request = pb::ModelRequestEvent {
        request: Some(pb::ModelRequest {
            model: "m".into(),
            history: vec![pb::Message {
                role: UNKNOWN_ENUM,
                blocks: vec![text("from a role this hook does not know")],
            }],
            // delete_file is denied by the example's default policy.
            tools: vec![tool("get_weather"), tool("delete_file")],
            tool_choice: Some(pb::ToolChoice {
                mode: UNKNOWN_ENUM,
                tool_name: String::new(),
            }),
            ..Default::default()
        }),
    }
    .encode_to_vec();

    let mut message = pb::Message {
        role: pb::Role::Assistant.into(),
        blocks: vec![text(&format!("your key is {SECRET}"))],
    }
    .encode_to_vec();
    // A second block whose kind (oneof case 9) no released proto has.
    message.extend(field(2, &field(9, MARKER)));
    let mut response = pb::ModelResponse {
        finish_reason: "stop".into(),
        model: "m".into(),
        ..Default::default()
    }
    .encode_to_vec();
    response.extend(field(1, &message));
    let response = field(1, &response);

    let run_end = pb::RunEndEvent {
        outcome: UNKNOWN_ENUM,
        turns: 1,
        ..Default::default()
    }
    .encode_to_vec();

    let verdicts = process(
        &py.addr,
        vec![
            event(1, pb::EventKind::ModelRequest.into(), true, 12, &request),
            event(2, pb::EventKind::ModelResponse.into(), true, 14, &response),
            event(3, UNKNOWN_ENUM, false, 30, MARKER),
            event(4, pb::EventKind::RunEnd.into(), false, 19, &run_end),
        ],
    )
    .await
    .expect("the stream ends cleanly");
    assert_eq!(verdicts.len(), 2, "only the blocking events are answered");
    let mut decoded: Vec<(pb::HookVerdict, &Vec<u8>)> = verdicts
        .iter()
        .map(|raw| (pb::HookVerdict::decode(&raw[..]).unwrap(), raw))
        .collect();
    decoded.sort_by_key(|(v, _)| v.seq);

    use pb::hook_verdict::Verdict as V;
    let (v, _) = &decoded[0];
    assert_eq!(v.seq, 1);
    let Some(V::ModelRequest(pb::ModelRequestVerdict {
        action: Some(pb::model_request_verdict::Action::PatchRequest(patch)),
    })) = &v.verdict
    else {
        panic!("model_request: expected a patch, got {v:?}");
    };
    assert_eq!(
        patch.active_tools.as_ref().map(|t| t.names.clone()),
        Some(vec!["get_weather".to_string()])
    );
    assert_eq!(
        patch.tool_choice, None,
        "an unknown tool_choice mode is left alone"
    );

    let (v, raw) = &decoded[1];
    assert_eq!(v.seq, 2);
    let Some(V::ModelResponse(pb::ModelResponseVerdict {
        action: Some(pb::model_response_verdict::Action::RewriteResponse(rewrite)),
    })) = &v.verdict
    else {
        panic!("model_response: expected a rewrite, got {v:?}");
    };
    assert_eq!(rewrite.blocks.len(), 2, "{rewrite:?}");
    assert_eq!(rewrite.blocks[0], text("your key is [REDACTED:api_key]"));
    assert_eq!(
        count(raw, MARKER),
        1,
        "the block of an unknown kind is copied into the rewrite, intact"
    );
}

const CONFIG: &str = r#"
models:
  - name: m
    provider: scripted
    rules:
      - text: "You said: {{last_user}}"
agents:
  - name: a
    model: m
    hooks: [future]
hooks:
  - name: future
    endpoint: ENDPOINT
"#;

async fn future_hook(action: Option<&str>) -> PythonHook {
    let env: Vec<(&str, &str)> = action.map(|a| ("FUTURE_ACTION", a)).into_iter().collect();
    PythonHook::start_script(FUTURE_HOOK, &["--features", "redactor"], &env).await
}

async fn hooks_check(addr: &str) -> (bool, String) {
    command_output(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire")).args(["hooks", "check", addr]),
    )
    .await
}

/// A verdict carrying fields this hookwire does not know, on HookVerdict and
/// inside the typed verdict, is applied as if they were absent, by hookwire
/// and by the conformance checker alike.
#[tokio::test]
async fn verdict_fields_hookwire_does_not_know_are_ignored() {
    let hook = future_hook(None).await;
    // The fixture really sends them: both unknown fields are on the wire.
    let run_start = pb::RunStartEvent {
        input: format!("my key is {SECRET}"),
    }
    .encode_to_vec();
    let raw = process(
        &hook.addr,
        vec![event(
            1,
            pb::EventKind::RunStart.into(),
            true,
            11,
            &run_start,
        )],
    )
    .await
    .unwrap();
    assert_eq!(raw.len(), 1);
    assert_eq!(
        count(&raw[0], MARKER),
        2,
        "{:?}",
        String::from_utf8_lossy(&raw[0])
    );

    let server = TestServer::start(&CONFIG.replace("ENDPOINT", &hook.addr)).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, &format!("my key is {SECRET}")).await;
    let r = result_of(&events);
    assert_eq!(
        pb::RunOutcome::try_from(r.outcome),
        Ok(pb::RunOutcome::Completed),
        "{}",
        r.reason
    );
    assert_eq!(r.final_text, "You said: my key is [REDACTED:api_key]");

    let (ok, out) = hooks_check(&hook.addr).await;
    assert!(ok, "hooks check failed:\n{out}");
}

/// A verdict whose action is one this hookwire does not know (a newer
/// proto's) is never taken for continue: it is an invalid verdict, a hook
/// failure under the hook's policy (closed by default), and a failed check.
#[tokio::test]
async fn a_verdict_action_hookwire_does_not_know_fails_closed() {
    let hook = future_hook(Some("run_start")).await;
    let server = TestServer::start(&CONFIG.replace("ENDPOINT", &hook.addr)).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "hello").await;
    let r = result_of(&events);
    assert_eq!(
        pb::RunOutcome::try_from(r.outcome),
        Ok(pb::RunOutcome::HookFailed),
        "{}",
        r.reason
    );
    assert!(r.reason.contains("future"), "{}", r.reason);
    assert!(
        r.reason.contains("run_start verdict has no action set"),
        "{}",
        r.reason
    );

    let (ok, out) = hooks_check(&hook.addr).await;
    assert!(!ok, "hooks check passed an unknown action:\n{out}");
    assert!(out.contains("run_start verdict has no action set"), "{out}");
}
