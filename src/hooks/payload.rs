//! Event payloads as the engine produces them (domain side of HookEvent).

use std::collections::BTreeMap;

use crate::agent::outcome::RunOutcome;
use crate::event::EventKind;
use crate::message::{Message, ToolCall, ToolResult, ToolSpec, Usage};
use crate::model::{ModelRequest, ModelResponse};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallProblem {
    UnknownTool,
    InvalidArguments,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    SessionStart {
        hooks: Vec<String>,
        metadata: BTreeMap<String, String>,
    },
    RunStart {
        input: String,
    },
    ModelRequest(ModelRequest),
    TextDelta(String),
    ModelResponse(ModelResponse),
    InvalidToolCall {
        call: ToolCall,
        problem: CallProblem,
        error: String,
        available: Vec<String>,
    },
    ToolCall {
        call: ToolCall,
        index: u32,
        tool: ToolSpec,
    },
    ToolResult {
        call: ToolCall,
        index: u32,
        result: ToolResult,
    },
    TurnEnd(Message),
    RunEnd {
        outcome: RunOutcome,
        reason: String,
        final_text: String,
        usage: Usage,
        turns: u32,
    },
    SessionEnd {
        reason: String,
    },
}

impl Payload {
    pub fn kind(&self) -> EventKind {
        match self {
            Payload::SessionStart { .. } => EventKind::SessionStart,
            Payload::RunStart { .. } => EventKind::RunStart,
            Payload::ModelRequest(_) => EventKind::ModelRequest,
            Payload::TextDelta(_) => EventKind::TextDelta,
            Payload::ModelResponse(_) => EventKind::ModelResponse,
            Payload::InvalidToolCall { .. } => EventKind::InvalidToolCall,
            Payload::ToolCall { .. } => EventKind::ToolCall,
            Payload::ToolResult { .. } => EventKind::ToolResult,
            Payload::TurnEnd(_) => EventKind::TurnEnd,
            Payload::RunEnd { .. } => EventKind::RunEnd,
            Payload::SessionEnd { .. } => EventKind::SessionEnd,
        }
    }
}

/// Run facts sent with every event.
#[derive(Clone, Debug, Default)]
pub struct EventContext {
    pub session_id: String,
    pub run_id: String,
    pub turn: u32,
    pub agent: String,
    pub streaming: bool,
    pub traceparent: String,
    pub tracestate: String,
    /// The authenticated caller whose call caused the event.
    pub principal: String,
    /// The caller's claims selected by `auth.forward_claims`.
    pub principal_claims: BTreeMap<String, String>,
}
