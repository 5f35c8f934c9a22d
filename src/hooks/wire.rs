//! The boundary between `pb` and the domain: `TryFrom` wire verdicts into
//! domain verdicts (with `InvalidVerdict` errors), and domain payloads into
//! wire events. The only hooks module that knows the generated types.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::agent::outcome::RunOutcome;
use crate::event::EventKind;
use crate::hooks::payload::{CallProblem, EventContext, Payload};
use crate::hooks::verdict::*;
use crate::message::{Block, Message, Role, ToolCall, ToolResult, ToolSpec, Usage};
use crate::model::{ModelRequest, ModelResponse, ToolChoice};
use crate::pb;

/// Largest content field of a verdict: rewritten input, blocks, arguments,
/// results and answers, patch texts, each history block, `reply`,
/// `feedback`, `continue_run.message`, `telemetry_redaction`.
pub const MAX_VERDICT_TEXT: usize = 4 * 1024 * 1024;
/// Largest note: `reason`, `terminate.reason`, `ask.question`.
pub const MAX_VERDICT_NOTE: usize = 64 * 1024;
/// Largest name or id: tool names, call ids, `active_tools` entries,
/// `tool_choice.tool_name`, scratchpad keys.
pub const MAX_VERDICT_NAME: usize = 1024;
/// Most bytes (keys plus values) a run's scratchpad holds; it travels with
/// every event to every hook. A verdict whose updates would exceed it is
/// invalid (checked where updates are applied; one value alone is checked
/// here).
pub const MAX_SCRATCHPAD_BYTES: usize = 1024 * 1024;
/// Longest `ask.timeout_ms` honoured; longer asks wait this long (the run's
/// own deadline ends every ask sooner anyway).
pub const MAX_ASK_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// What an empty verdict usually means: the server set its fields under
/// names the encoder did not know, so they were dropped. The classic case is
/// a Node.js server that loads the proto with @grpc/proto-loader's default
/// options (camelCase names) and writes the proto's snake_case ones.
pub const FIELD_NAMES_HINT: &str = "if your server did set it, its encoder did not know the field names: with Node.js @grpc/proto-loader, load the proto with keepCase: true (and longs: String, enums: String, oneofs: true, defaults: true) to use the proto's snake_case names, e.g. run_start, rewrite_input (see docs/writing-hooks.md, Node.js)";

/// Why a wire verdict is not a valid domain verdict.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidVerdict {
    #[error("verdict has no typed verdict field set (expected `{expected}`); {FIELD_NAMES_HINT}")]
    MissingVerdict { expected: EventKind },
    #[error("verdict has no typed verdict field set; {FIELD_NAMES_HINT}")]
    NoVerdict,
    #[error("{event} verdict has no action set (e.g. `proceed`); {FIELD_NAMES_HINT}")]
    MissingAction { event: EventKind },
    #[error("terminate needs a non-empty reason")]
    MissingReason,
    #[error("{field} is not valid JSON: {error}")]
    BadJson { field: &'static str, error: String },
    #[error("{field} must be a JSON object")]
    NotObject { field: &'static str },
    #[error("{field} is {size} bytes, over the {max} byte limit")]
    Oversize {
        field: &'static str,
        size: usize,
        max: usize,
    },
    #[error("{0}")]
    BadMessage(String),
}

impl InvalidVerdict {
    /// What may be logged above debug or exported: the story without what
    /// the hook sent (a message's text, a scratchpad key, a parser's quote
    /// of it).
    pub fn quiet(&self) -> String {
        match self {
            InvalidVerdict::BadJson { field, .. } => format!("{field} is not valid JSON"),
            InvalidVerdict::BadMessage(_) => {
                "a message, content block or scratchpad entry of the verdict is invalid".into()
            }
            other => other.to_string(),
        }
    }
}

impl From<EventKind> for pb::EventKind {
    fn from(k: EventKind) -> Self {
        match k {
            EventKind::SessionStart => pb::EventKind::SessionStart,
            EventKind::RunStart => pb::EventKind::RunStart,
            EventKind::ModelRequest => pb::EventKind::ModelRequest,
            EventKind::TextDelta => pb::EventKind::TextDelta,
            EventKind::ModelResponse => pb::EventKind::ModelResponse,
            EventKind::InvalidToolCall => pb::EventKind::InvalidToolCall,
            EventKind::ToolCall => pb::EventKind::ToolCall,
            EventKind::ToolResult => pb::EventKind::ToolResult,
            EventKind::TurnEnd => pb::EventKind::TurnEnd,
            EventKind::RunEnd => pb::EventKind::RunEnd,
            EventKind::SessionEnd => pb::EventKind::SessionEnd,
        }
    }
}

/// Wire event kinds from `Describe`; unspecified or unknown values are dropped.
pub fn event_kind_from_wire(v: i32) -> Option<EventKind> {
    let k = pb::EventKind::try_from(v).ok()?;
    Some(match k {
        pb::EventKind::Unspecified => return None,
        pb::EventKind::SessionStart => EventKind::SessionStart,
        pb::EventKind::RunStart => EventKind::RunStart,
        pb::EventKind::ModelRequest => EventKind::ModelRequest,
        pb::EventKind::TextDelta => EventKind::TextDelta,
        pb::EventKind::ModelResponse => EventKind::ModelResponse,
        pb::EventKind::InvalidToolCall => EventKind::InvalidToolCall,
        pb::EventKind::ToolCall => EventKind::ToolCall,
        pb::EventKind::ToolResult => EventKind::ToolResult,
        pb::EventKind::TurnEnd => EventKind::TurnEnd,
        pb::EventKind::RunEnd => EventKind::RunEnd,
        pb::EventKind::SessionEnd => EventKind::SessionEnd,
    })
}

impl From<RunOutcome> for pb::RunOutcome {
    fn from(o: RunOutcome) -> Self {
        match o {
            RunOutcome::Completed => pb::RunOutcome::Completed,
            RunOutcome::Terminated => pb::RunOutcome::Terminated,
            RunOutcome::Failed => pb::RunOutcome::Failed,
            RunOutcome::Cancelled => pb::RunOutcome::Cancelled,
            RunOutcome::MaxTurns => pb::RunOutcome::MaxTurns,
            RunOutcome::HookFailed => pb::RunOutcome::HookFailed,
            RunOutcome::ModelFailed => pb::RunOutcome::ModelFailed,
            RunOutcome::TimedOut => pb::RunOutcome::TimedOut,
            RunOutcome::Interrupted => pb::RunOutcome::Interrupted,
        }
    }
}

// ------------------------------------------------------------ domain -> wire

impl From<&ToolCall> for pb::ToolCall {
    fn from(c: &ToolCall) -> Self {
        pb::ToolCall {
            id: c.id.clone(),
            name: c.name.clone(),
            arguments_json: c.arguments_json.clone(),
        }
    }
}

impl From<&ToolResult> for pb::ToolResultBlock {
    fn from(r: &ToolResult) -> Self {
        pb::ToolResultBlock {
            call_id: r.call_id.clone(),
            name: r.name.clone(),
            content: r.content.clone(),
            is_error: r.is_error,
        }
    }
}

impl From<&ToolSpec> for pb::ToolSpec {
    fn from(t: &ToolSpec) -> Self {
        pb::ToolSpec {
            name: t.name.clone(),
            description: t.description.clone(),
            parameters_json_schema: t.parameters_json_schema.clone(),
        }
    }
}

impl From<Usage> for pb::Usage {
    fn from(u: Usage) -> Self {
        pb::Usage {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            estimated: u.estimated,
        }
    }
}

impl From<&Block> for pb::Block {
    fn from(b: &Block) -> Self {
        use pb::block::Kind;
        let kind = match b {
            Block::Text { text } => Kind::Text(pb::TextBlock { text: text.clone() }),
            Block::Reasoning { text } => Kind::Reasoning(pb::ReasoningBlock { text: text.clone() }),
            Block::ToolCall(c) => Kind::ToolCall(c.into()),
            Block::ToolResult(r) => Kind::ToolResult(r.into()),
        };
        pb::Block { kind: Some(kind) }
    }
}

impl From<&Message> for pb::Message {
    fn from(m: &Message) -> Self {
        pb::Message {
            role: match m.role {
                Role::User => pb::Role::User,
                Role::Assistant => pb::Role::Assistant,
                Role::Tool => pb::Role::Tool,
            } as i32,
            blocks: m.blocks.iter().map(Into::into).collect(),
        }
    }
}

impl From<&ToolChoice> for pb::ToolChoice {
    fn from(c: &ToolChoice) -> Self {
        use pb::tool_choice::Mode;
        let (mode, name) = match c {
            ToolChoice::Auto => (Mode::Auto, ""),
            ToolChoice::None => (Mode::None, ""),
            ToolChoice::Required => (Mode::Required, ""),
            ToolChoice::Tool(n) => (Mode::Tool, n.as_str()),
        };
        pb::ToolChoice {
            mode: mode as i32,
            tool_name: name.to_string(),
        }
    }
}

impl From<&ModelRequest> for pb::ModelRequest {
    fn from(r: &ModelRequest) -> Self {
        pb::ModelRequest {
            model: r.model.clone(),
            system_prompt: r.system_prompt.clone(),
            extra_context: r.extra_context.clone(),
            history: r.history.iter().map(Into::into).collect(),
            tools: r.tools.iter().map(Into::into).collect(),
            temperature: r.temperature,
            max_tokens: r.max_tokens,
            tool_choice: Some((&r.tool_choice).into()),
            additional_params_json: if r.additional_params.is_empty() {
                String::new()
            } else {
                serde_json::Value::Object(r.additional_params.clone()).to_string()
            },
        }
    }
}

impl From<&ModelResponse> for pb::ModelResponse {
    fn from(r: &ModelResponse) -> Self {
        pb::ModelResponse {
            message: r.message.as_ref().map(Into::into),
            finish_reason: r.finish_reason.clone(),
            usage: Some(r.usage.into()),
            model: r.model.clone(),
        }
    }
}

pub fn context_to_wire(
    ctx: &EventContext,
    scratchpad: &BTreeMap<String, Vec<u8>>,
    remaining: Duration,
) -> pb::EventContext {
    pb::EventContext {
        session_id: ctx.session_id.clone(),
        run_id: ctx.run_id.clone(),
        turn: ctx.turn,
        agent: ctx.agent.clone(),
        streaming: ctx.streaming,
        scratchpad: scratchpad_to_wire(scratchpad),
        deadline_remaining_ms: millis(remaining),
        traceparent: ctx.traceparent.clone(),
        tracestate: ctx.tracestate.clone(),
        principal: ctx.principal.clone(),
        principal_claims: ctx
            .principal_claims
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    }
}

/// `EventContext.deadline_remaining_ms`: saturates rather than wraps for a
/// duration past `u64::MAX` ms.
pub fn millis(remaining: Duration) -> u64 {
    u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX)
}

pub fn scratchpad_to_wire(
    scratchpad: &BTreeMap<String, Vec<u8>>,
) -> std::collections::HashMap<String, Vec<u8>> {
    scratchpad
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

pub fn payload_to_wire(p: &Payload) -> pb::hook_event::Payload {
    use pb::hook_event::Payload as W;
    match p {
        Payload::SessionStart { hooks, metadata } => W::SessionStart(pb::SessionStartEvent {
            hooks: hooks.clone(),
            metadata: metadata
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }),
        Payload::RunStart { input } => W::RunStart(pb::RunStartEvent {
            input: input.clone(),
        }),
        Payload::ModelRequest(r) => W::ModelRequest(pb::ModelRequestEvent {
            request: Some(r.into()),
        }),
        Payload::TextDelta(t) => W::TextDelta(pb::TextDeltaEvent { text: t.clone() }),
        Payload::ModelResponse(r) => W::ModelResponse(pb::ModelResponseEvent {
            response: Some(r.into()),
        }),
        Payload::InvalidToolCall {
            call,
            problem,
            error,
            available,
        } => W::InvalidToolCall(pb::InvalidToolCallEvent {
            call: Some(call.into()),
            problem: match problem {
                CallProblem::UnknownTool => pb::invalid_tool_call_event::Problem::UnknownTool,
                CallProblem::InvalidArguments => {
                    pb::invalid_tool_call_event::Problem::InvalidArguments
                }
            } as i32,
            error: error.clone(),
            available_tools: available.clone(),
        }),
        Payload::ToolCall { call, index, tool } => W::ToolCall(pb::ToolCallEvent {
            call: Some(call.into()),
            call_index: *index,
            tool: Some(tool.into()),
        }),
        Payload::ToolResult {
            call,
            index,
            result,
        } => W::ToolResult(pb::ToolResultEvent {
            call: Some(call.into()),
            call_index: *index,
            result: Some(result.into()),
        }),
        Payload::TurnEnd(m) => W::TurnEnd(pb::TurnEndEvent {
            message: Some(m.into()),
        }),
        Payload::RunEnd {
            outcome,
            reason,
            final_text,
            usage,
            turns,
        } => W::RunEnd(pb::RunEndEvent {
            outcome: pb::RunOutcome::from(*outcome) as i32,
            reason: reason.clone(),
            final_text: final_text.clone(),
            usage: Some((*usage).into()),
            turns: *turns,
        }),
        Payload::SessionEnd { reason } => W::SessionEnd(pb::SessionEndEvent {
            reason: reason.clone(),
        }),
    }
}

// ------------------------------------------------------------ wire -> domain

fn check_len(field: &'static str, size: usize, max: usize) -> Result<(), InvalidVerdict> {
    if size > max {
        return Err(InvalidVerdict::Oversize { field, size, max });
    }
    Ok(())
}

fn check_size(field: &'static str, s: &str) -> Result<(), InvalidVerdict> {
    check_len(field, s.len(), MAX_VERDICT_TEXT)
}

fn check_note(field: &'static str, s: &str) -> Result<(), InvalidVerdict> {
    check_len(field, s.len(), MAX_VERDICT_NOTE)
}

fn check_name(field: &'static str, s: &str) -> Result<(), InvalidVerdict> {
    check_len(field, s.len(), MAX_VERDICT_NAME)
}

fn check_json(field: &'static str, s: &str) -> Result<serde_json::Value, InvalidVerdict> {
    check_size(field, s)?;
    serde_json::from_str(s).map_err(|e| InvalidVerdict::BadJson {
        field,
        error: e.to_string(),
    })
}

/// Whether a tool call's arguments must be valid JSON now. History patches
/// defer that check to [`crate::hooks::compose::validate_patch`], which
/// applies it only to calls the hook changed: hookwire's own history may
/// hold a model's malformed call (cut off by `max_tokens`), and a hook that
/// sends it back unchanged did nothing wrong. A `rewrite_response` defers
/// it to the run, which screens every call of the accepted response
/// ([`assistant_block`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Args {
    Json,
    Deferred,
}

fn tool_call(c: pb::ToolCall, args: Args) -> Result<ToolCall, InvalidVerdict> {
    if c.name.is_empty() {
        return Err(InvalidVerdict::BadMessage(
            "tool call without a name".into(),
        ));
    }
    check_name("tool_call.name", &c.name)?;
    check_name("tool_call.id", &c.id)?;
    let arguments_json = if c.arguments_json.is_empty() {
        "{}".to_string()
    } else {
        match args {
            Args::Json => {
                check_json("tool_call.arguments_json", &c.arguments_json)?;
            }
            Args::Deferred => check_size("tool_call.arguments_json", &c.arguments_json)?,
        }
        c.arguments_json
    };
    Ok(ToolCall {
        id: c.id,
        name: c.name,
        arguments_json,
    })
}

impl TryFrom<pb::ToolCall> for ToolCall {
    type Error = InvalidVerdict;
    fn try_from(c: pb::ToolCall) -> Result<Self, Self::Error> {
        tool_call(c, Args::Json)
    }
}

fn block(b: pb::Block, args: Args) -> Result<Block, InvalidVerdict> {
    use pb::block::Kind;
    Ok(match b.kind {
        Some(Kind::Text(t)) => {
            check_size("block.text", &t.text)?;
            Block::Text { text: t.text }
        }
        Some(Kind::Reasoning(t)) => {
            check_size("block.reasoning", &t.text)?;
            Block::Reasoning { text: t.text }
        }
        Some(Kind::ToolCall(c)) => Block::ToolCall(tool_call(c, args)?),
        Some(Kind::ToolResult(r)) => {
            check_name("tool_result.call_id", &r.call_id)?;
            check_name("tool_result.name", &r.name)?;
            check_size("tool_result.content", &r.content)?;
            Block::ToolResult(ToolResult {
                call_id: r.call_id,
                name: r.name,
                content: r.content,
                is_error: r.is_error,
            })
        }
        None => return Err(InvalidVerdict::BadMessage("block with no content".into())),
    })
}

/// A block of an assistant message a verdict builds (`rewrite_response`):
/// what the model could have said. A tool result is not: results come
/// from running the calls, and one committed in the assistant message is
/// sent to the provider as a tool message of its own (an orphan it
/// rejects, at every later call of the session) or gives a call a second
/// result. Tool-call arguments are left to the run's screening of the
/// calls (`invalid_tool_call`), as the model's own are: a hook that sends
/// back a call the model cut off at `max_tokens` did nothing wrong.
fn assistant_block(b: pb::Block) -> Result<Block, InvalidVerdict> {
    if let Some(pb::block::Kind::ToolResult(_)) = b.kind {
        return Err(InvalidVerdict::BadMessage(
            "rewrite_response holds a tool-result block; an assistant message has only text, reasoning and tool-call blocks (results come from running the calls)".into(),
        ));
    }
    block(b, Args::Deferred)
}

impl TryFrom<pb::Block> for Block {
    type Error = InvalidVerdict;
    fn try_from(b: pb::Block) -> Result<Self, Self::Error> {
        block(b, Args::Json)
    }
}

impl TryFrom<pb::Message> for Message {
    type Error = InvalidVerdict;
    fn try_from(m: pb::Message) -> Result<Self, Self::Error> {
        message(m, Args::Json)
    }
}

fn message(m: pb::Message, args: Args) -> Result<Message, InvalidVerdict> {
    let role = match pb::Role::try_from(m.role) {
        Ok(pb::Role::User) => Role::User,
        Ok(pb::Role::Assistant) => Role::Assistant,
        Ok(pb::Role::Tool) => Role::Tool,
        _ => {
            return Err(InvalidVerdict::BadMessage(format!(
                "message role {} is not user, assistant or tool",
                m.role
            )))
        }
    };
    Ok(Message {
        role,
        blocks: m
            .blocks
            .into_iter()
            .map(|b| block(b, args))
            .collect::<Result<_, _>>()?,
    })
}

pub fn tool_choice_from_wire(c: pb::ToolChoice) -> Result<ToolChoice, InvalidVerdict> {
    use pb::tool_choice::Mode;
    Ok(match Mode::try_from(c.mode) {
        Ok(Mode::Auto) => ToolChoice::Auto,
        Ok(Mode::None) => ToolChoice::None,
        Ok(Mode::Required) => ToolChoice::Required,
        Ok(Mode::Tool) if !c.tool_name.is_empty() => {
            check_name("tool_choice.tool_name", &c.tool_name)?;
            ToolChoice::Tool(c.tool_name)
        }
        Ok(Mode::Tool) => {
            return Err(InvalidVerdict::BadMessage(
                "tool_choice MODE_TOOL needs tool_name".into(),
            ))
        }
        Err(_) => {
            return Err(InvalidVerdict::BadMessage(format!(
                "unknown tool_choice mode {}",
                c.mode
            )))
        }
    })
}

fn terminate(t: pb::Terminate) -> Result<Terminate, InvalidVerdict> {
    if t.reason.trim().is_empty() {
        return Err(InvalidVerdict::MissingReason);
    }
    check_note("terminate.reason", &t.reason)?;
    if let Some(r) = &t.reply {
        check_size("terminate.reply", r)?;
    }
    Ok(Terminate {
        reason: t.reason,
        reply: t.reply,
    })
}

fn skip(s: pb::Skip) -> Result<Skip, InvalidVerdict> {
    check_size("skip.result", &s.result)?;
    Ok(Skip {
        result: s.result,
        is_error: s.is_error,
    })
}

fn patch(p: pb::RequestPatch) -> Result<RequestPatch, InvalidVerdict> {
    let additional_params = if p.additional_params_json.is_empty() {
        None
    } else {
        match check_json("additional_params_json", &p.additional_params_json)? {
            serde_json::Value::Object(m) => Some(m),
            _ => {
                return Err(InvalidVerdict::NotObject {
                    field: "additional_params_json",
                })
            }
        }
    };
    for c in &p.extra_context {
        check_size("extra_context", c)?;
    }
    if let Some(s) = &p.system_prompt {
        check_size("system_prompt", s)?;
    }
    for n in p.active_tools.iter().flat_map(|t| &t.names) {
        check_name("active_tools", n)?;
    }
    Ok(RequestPatch {
        extra_context: p.extra_context,
        system_prompt: p.system_prompt,
        temperature: p.temperature,
        max_tokens: p.max_tokens,
        tool_choice: p.tool_choice.map(tool_choice_from_wire).transpose()?,
        active_tools: p.active_tools.map(|t| t.names),
        additional_params,
        history: p
            .history
            .map(|h| {
                h.messages
                    .into_iter()
                    .map(|m| message(m, Args::Deferred))
                    .collect()
            })
            .transpose()?,
    })
}

/// Converts a wire verdict into `(seq, Verdict)`. Whether the verdict's kind
/// matches its event is decided by the chain (`ChainEvent::apply`).
impl TryFrom<pb::HookVerdict> for Verdict {
    type Error = InvalidVerdict;

    fn try_from(v: pb::HookVerdict) -> Result<Self, Self::Error> {
        use pb::hook_verdict::Verdict as V;
        let meta = VerdictMeta {
            scratchpad: v
                .scratchpad
                .into_iter()
                .map(|u| match u.op {
                    _ if u.key.len() > MAX_VERDICT_NAME => Err(InvalidVerdict::Oversize {
                        field: "scratchpad key",
                        size: u.key.len(),
                        max: MAX_VERDICT_NAME,
                    }),
                    Some(pb::scratchpad_update::Op::Set(b)) if b.len() > MAX_SCRATCHPAD_BYTES => {
                        Err(InvalidVerdict::Oversize {
                            field: "scratchpad value",
                            size: b.len(),
                            max: MAX_SCRATCHPAD_BYTES,
                        })
                    }
                    Some(pb::scratchpad_update::Op::Set(b)) => Ok(ScratchOp::Set(u.key, b)),
                    Some(pb::scratchpad_update::Op::Delete(_)) => Ok(ScratchOp::Delete(u.key)),
                    None => Err(InvalidVerdict::BadMessage(format!(
                        "scratchpad update for `{}` has neither set nor delete",
                        u.key
                    ))),
                })
                .collect::<Result<_, _>>()?,
            reason: v.reason,
            telemetry_redaction: v.telemetry_redaction,
        };
        check_note("reason", &meta.reason)?;
        if let Some(r) = &meta.telemetry_redaction {
            check_size("telemetry_redaction", r)?;
        }
        let missing = |event| InvalidVerdict::MissingAction { event };
        let action = match v.verdict {
            None => return Err(InvalidVerdict::NoVerdict),
            Some(V::SessionStart(s)) => {
                use pb::session_start_verdict::Action as A;
                Action::SessionStart(match s.action.ok_or(missing(EventKind::SessionStart))? {
                    A::Proceed(_) => SessionStartAction::Continue,
                    A::Terminate(t) => SessionStartAction::Terminate(terminate(t)?),
                })
            }
            Some(V::RunStart(s)) => {
                use pb::run_start_verdict::Action as A;
                Action::RunStart(match s.action.ok_or(missing(EventKind::RunStart))? {
                    A::Proceed(_) => RunStartAction::Continue,
                    A::RewriteInput(r) => {
                        check_size("rewrite_input.input", &r.input)?;
                        RunStartAction::RewriteInput(r.input)
                    }
                    A::Terminate(t) => RunStartAction::Terminate(terminate(t)?),
                })
            }
            Some(V::ModelRequest(s)) => {
                use pb::model_request_verdict::Action as A;
                Action::ModelRequest(match s.action.ok_or(missing(EventKind::ModelRequest))? {
                    A::Proceed(_) => ModelRequestAction::Continue,
                    A::PatchRequest(p) => ModelRequestAction::Patch(patch(p)?),
                    A::Respond(r) => {
                        check_size("respond.text", &r.text)?;
                        ModelRequestAction::Respond(Respond {
                            text: r.text,
                            tool_calls: r
                                .tool_calls
                                .into_iter()
                                .map(ToolCall::try_from)
                                .collect::<Result<_, _>>()?,
                        })
                    }
                    A::Terminate(t) => ModelRequestAction::Terminate(terminate(t)?),
                })
            }
            Some(V::ModelResponse(s)) => {
                use pb::model_response_verdict::Action as A;
                Action::ModelResponse(match s.action.ok_or(missing(EventKind::ModelResponse))? {
                    A::Proceed(_) => ModelResponseAction::Continue,
                    A::RewriteResponse(r) => ModelResponseAction::Rewrite(
                        r.blocks
                            .into_iter()
                            .map(assistant_block)
                            .collect::<Result<_, _>>()?,
                    ),
                    A::Retry(r) => {
                        check_size("retry.feedback", &r.feedback)?;
                        ModelResponseAction::Retry(r.feedback)
                    }
                    A::Terminate(t) => ModelResponseAction::Terminate(terminate(t)?),
                })
            }
            Some(V::InvalidToolCall(s)) => {
                use pb::invalid_tool_call_verdict::Action as A;
                Action::InvalidToolCall(
                    match s.action.ok_or(missing(EventKind::InvalidToolCall))? {
                        A::Proceed(_) => InvalidToolCallAction::Continue,
                        A::Retry(r) => {
                            check_size("retry.feedback", &r.feedback)?;
                            InvalidToolCallAction::Retry(r.feedback)
                        }
                        A::Skip(s) => InvalidToolCallAction::Skip(skip(s)?),
                        A::Terminate(t) => InvalidToolCallAction::Terminate(terminate(t)?),
                    },
                )
            }
            Some(V::ToolCall(s)) => {
                use pb::tool_call_verdict::Action as A;
                Action::ToolCall(match s.action.ok_or(missing(EventKind::ToolCall))? {
                    A::Proceed(_) => ToolCallAction::Continue,
                    A::RewriteArgs(r) => {
                        // Tool arguments are a JSON object, as the model's
                        // own call must be; the tool's schema is checked by
                        // the run, which knows the tool (`RunHooks`).
                        let field = "rewrite_args.arguments_json";
                        if !check_json(field, &r.arguments_json)?.is_object() {
                            return Err(InvalidVerdict::NotObject { field });
                        }
                        ToolCallAction::RewriteArgs(r.arguments_json)
                    }
                    A::Skip(s) => ToolCallAction::Skip(skip(s)?),
                    A::Ask(a) => {
                        check_note("ask.question", &a.question)?;
                        ToolCallAction::Ask(Ask {
                            question: a.question,
                            timeout: (a.timeout_ms > 0)
                                .then(|| Duration::from_millis(a.timeout_ms).min(MAX_ASK_TIMEOUT)),
                        })
                    }
                    A::Terminate(t) => ToolCallAction::Terminate(terminate(t)?),
                })
            }
            Some(V::ToolResult(s)) => {
                use pb::tool_result_verdict::Action as A;
                Action::ToolResult(match s.action.ok_or(missing(EventKind::ToolResult))? {
                    A::Proceed(_) => ToolResultAction::Continue,
                    A::RewriteResult(r) => {
                        check_size("rewrite_result.content", &r.content)?;
                        ToolResultAction::Rewrite {
                            content: r.content,
                            is_error: r.is_error,
                        }
                    }
                    A::Terminate(t) => ToolResultAction::Terminate(terminate(t)?),
                })
            }
            Some(V::TurnEnd(s)) => {
                use pb::turn_end_verdict::Action as A;
                Action::TurnEnd(match s.action.ok_or(missing(EventKind::TurnEnd))? {
                    A::Proceed(_) => TurnEndAction::Continue,
                    A::ContinueRun(c) => {
                        check_size("continue_run.message", &c.message)?;
                        TurnEndAction::ContinueRun(c.message)
                    }
                    A::Terminate(t) => TurnEndAction::Terminate(terminate(t)?),
                })
            }
        };
        Ok(Verdict { meta, action })
    }
}

impl From<pb::ToolSpec> for ToolSpec {
    fn from(t: pb::ToolSpec) -> Self {
        ToolSpec {
            name: t.name,
            description: t.description,
            parameters_json_schema: t.parameters_json_schema,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(v: pb::hook_verdict::Verdict) -> pb::HookVerdict {
        pb::HookVerdict {
            seq: 1,
            verdict: Some(v),
            ..Default::default()
        }
    }

    #[test]
    fn rewrite_args_must_be_json() {
        let v = verdict(pb::hook_verdict::Verdict::ToolCall(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::RewriteArgs(
                pb::RewriteArgs {
                    arguments_json: "{not json".into(),
                },
            )),
        }));
        assert!(matches!(
            Verdict::try_from(v),
            Err(InvalidVerdict::BadJson { .. })
        ));
    }

    #[test]
    fn missing_action_and_reason_are_invalid() {
        let v = verdict(pb::hook_verdict::Verdict::RunStart(pb::RunStartVerdict {
            action: None,
        }));
        assert_eq!(
            Verdict::try_from(v).unwrap_err(),
            InvalidVerdict::MissingAction {
                event: EventKind::RunStart
            }
        );
        let v = verdict(pb::hook_verdict::Verdict::TurnEnd(pb::TurnEndVerdict {
            action: Some(pb::turn_end_verdict::Action::Terminate(pb::Terminate {
                reason: " ".into(),
                reply: None,
            })),
        }));
        assert_eq!(
            Verdict::try_from(v).unwrap_err(),
            InvalidVerdict::MissingReason
        );
        assert!(Verdict::try_from(pb::HookVerdict::default()).is_err());
    }

    #[test]
    fn oversize_is_invalid() {
        let v = verdict(pb::hook_verdict::Verdict::ToolResult(
            pb::ToolResultVerdict {
                action: Some(pb::tool_result_verdict::Action::RewriteResult(
                    pb::RewriteResult {
                        content: "x".repeat(MAX_VERDICT_TEXT + 1),
                        is_error: None,
                    },
                )),
            },
        ));
        assert!(matches!(
            Verdict::try_from(v),
            Err(InvalidVerdict::Oversize { .. })
        ));
    }

    #[test]
    fn every_verdict_text_field_has_a_limit() {
        use pb::hook_verdict::Verdict as V;
        let big = "x".repeat(MAX_VERDICT_TEXT + 1);
        let note = "x".repeat(MAX_VERDICT_NOTE + 1);
        let name = "x".repeat(MAX_VERDICT_NAME + 1);
        let term = |reason: &str, reply: Option<String>| pb::Terminate {
            reason: reason.into(),
            reply,
        };
        let call = |id: &str, name: &str, args: &str| pb::ToolCall {
            id: id.into(),
            name: name.into(),
            arguments_json: args.into(),
        };
        let text_block = |t: &str| pb::Block {
            kind: Some(pb::block::Kind::Text(pb::TextBlock { text: t.into() })),
        };
        let history = |m: pb::Block| {
            V::ModelRequest(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::PatchRequest(
                    pb::RequestPatch {
                        history: Some(pb::MessageList {
                            messages: vec![pb::Message {
                                role: pb::Role::Assistant as i32,
                                blocks: vec![m],
                            }],
                        }),
                        ..Default::default()
                    },
                )),
            })
        };
        let cases: Vec<(&str, pb::HookVerdict)> = vec![
            (
                "reason",
                pb::HookVerdict {
                    reason: note.clone(),
                    verdict: Some(V::RunStart(pb::RunStartVerdict {
                        action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                    })),
                    ..Default::default()
                },
            ),
            (
                "telemetry_redaction",
                pb::HookVerdict {
                    telemetry_redaction: Some(big.clone()),
                    verdict: Some(V::RunStart(pb::RunStartVerdict {
                        action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                    })),
                    ..Default::default()
                },
            ),
            (
                "terminate.reason",
                verdict(V::TurnEnd(pb::TurnEndVerdict {
                    action: Some(pb::turn_end_verdict::Action::Terminate(term(&note, None))),
                })),
            ),
            (
                "terminate.reply",
                verdict(V::TurnEnd(pb::TurnEndVerdict {
                    action: Some(pb::turn_end_verdict::Action::Terminate(term(
                        "r",
                        Some(big.clone()),
                    ))),
                })),
            ),
            (
                "continue_run.message",
                verdict(V::TurnEnd(pb::TurnEndVerdict {
                    action: Some(pb::turn_end_verdict::Action::ContinueRun(pb::ContinueRun {
                        message: big.clone(),
                    })),
                })),
            ),
            (
                "retry.feedback",
                verdict(V::ModelResponse(pb::ModelResponseVerdict {
                    action: Some(pb::model_response_verdict::Action::Retry(pb::Retry {
                        feedback: big.clone(),
                    })),
                })),
            ),
            (
                "retry.feedback",
                verdict(V::InvalidToolCall(pb::InvalidToolCallVerdict {
                    action: Some(pb::invalid_tool_call_verdict::Action::Retry(pb::Retry {
                        feedback: big.clone(),
                    })),
                })),
            ),
            (
                "ask.question",
                verdict(V::ToolCall(pb::ToolCallVerdict {
                    action: Some(pb::tool_call_verdict::Action::Ask(pb::Ask {
                        question: note.clone(),
                        timeout_ms: 0,
                    })),
                })),
            ),
            (
                "block.text",
                verdict(V::ModelResponse(pb::ModelResponseVerdict {
                    action: Some(pb::model_response_verdict::Action::RewriteResponse(
                        pb::RewriteResponse {
                            blocks: vec![text_block(&big)],
                        },
                    )),
                })),
            ),
            (
                "tool_call.name",
                verdict(V::ModelRequest(pb::ModelRequestVerdict {
                    action: Some(pb::model_request_verdict::Action::Respond(pb::Respond {
                        text: String::new(),
                        tool_calls: vec![call("c1", &name, "{}")],
                    })),
                })),
            ),
            (
                "tool_call.id",
                verdict(V::ModelRequest(pb::ModelRequestVerdict {
                    action: Some(pb::model_request_verdict::Action::Respond(pb::Respond {
                        text: String::new(),
                        tool_calls: vec![call(&name, "t", "{}")],
                    })),
                })),
            ),
            ("block.text", verdict(history(text_block(&big)))),
            (
                "tool_call.arguments_json",
                verdict(history(pb::Block {
                    kind: Some(pb::block::Kind::ToolCall(call("c1", "t", &big))),
                })),
            ),
            (
                "active_tools",
                verdict(V::ModelRequest(pb::ModelRequestVerdict {
                    action: Some(pb::model_request_verdict::Action::PatchRequest(
                        pb::RequestPatch {
                            active_tools: Some(pb::ToolNames {
                                names: vec![name.clone()],
                            }),
                            ..Default::default()
                        },
                    )),
                })),
            ),
            (
                "scratchpad key",
                pb::HookVerdict {
                    scratchpad: vec![pb::ScratchpadUpdate {
                        key: name.clone(),
                        op: Some(pb::scratchpad_update::Op::Delete(true)),
                    }],
                    verdict: Some(V::RunStart(pb::RunStartVerdict {
                        action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                    })),
                    ..Default::default()
                },
            ),
            (
                "scratchpad value",
                pb::HookVerdict {
                    scratchpad: vec![pb::ScratchpadUpdate {
                        key: "k".into(),
                        op: Some(pb::scratchpad_update::Op::Set(vec![
                            0;
                            MAX_SCRATCHPAD_BYTES + 1
                        ])),
                    }],
                    verdict: Some(V::RunStart(pb::RunStartVerdict {
                        action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                    })),
                    ..Default::default()
                },
            ),
        ];
        for (field, v) in cases {
            match Verdict::try_from(v) {
                Err(InvalidVerdict::Oversize { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn an_ask_timeout_is_clamped() {
        let v = verdict(pb::hook_verdict::Verdict::ToolCall(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::Ask(pb::Ask {
                question: "ok?".into(),
                timeout_ms: u64::MAX,
            })),
        }));
        let Verdict {
            action: Action::ToolCall(ToolCallAction::Ask(a)),
            ..
        } = Verdict::try_from(v).unwrap()
        else {
            panic!()
        };
        assert_eq!(a.timeout, Some(MAX_ASK_TIMEOUT));
    }

    #[test]
    fn patch_converts_every_field() {
        let v = verdict(pb::hook_verdict::Verdict::ModelRequest(
            pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::PatchRequest(
                    pb::RequestPatch {
                        extra_context: vec!["doc".into()],
                        system_prompt: Some("sys".into()),
                        temperature: Some(0.3),
                        max_tokens: Some(10),
                        tool_choice: Some(pb::ToolChoice {
                            mode: pb::tool_choice::Mode::Tool as i32,
                            tool_name: "t".into(),
                        }),
                        active_tools: Some(pb::ToolNames {
                            names: vec!["t".into()],
                        }),
                        additional_params_json: r#"{"seed":1}"#.into(),
                        history: Some(pb::MessageList {
                            messages: vec![(&Message::user("x")).into()],
                        }),
                    },
                )),
            },
        ));
        let Verdict {
            action: Action::ModelRequest(ModelRequestAction::Patch(p)),
            ..
        } = Verdict::try_from(v).unwrap()
        else {
            panic!()
        };
        let mut params = serde_json::Map::new();
        params.insert("seed".into(), 1.into());
        assert_eq!(
            p,
            RequestPatch {
                extra_context: vec!["doc".into()],
                system_prompt: Some("sys".into()),
                temperature: Some(0.3),
                max_tokens: Some(10),
                tool_choice: Some(ToolChoice::Tool("t".into())),
                active_tools: Some(vec!["t".into()]),
                additional_params: Some(params),
                history: Some(vec![Message::user("x")]),
            }
        );
    }
}
