//! Domain verdicts: a hook's typed answer to one event. Converted from the
//! wire in `hooks::wire`; composed in `hooks::compose`.

use std::time::Duration;

use crate::event::EventKind;
use crate::message::{Block, Message, ToolCall};
use crate::model::ToolChoice;

#[derive(Clone, Debug, PartialEq)]
pub struct Terminate {
    pub reason: String,
    pub reply: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ScratchOp {
    Set(String, Vec<u8>),
    Delete(String),
}

/// Fields every verdict may carry.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct VerdictMeta {
    pub scratchpad: Vec<ScratchOp>,
    pub reason: String,
    pub telemetry_redaction: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub meta: VerdictMeta,
    pub action: Action,
}

/// The typed action; its variant must match the event it answers.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    SessionStart(SessionStartAction),
    RunStart(RunStartAction),
    ModelRequest(ModelRequestAction),
    ModelResponse(ModelResponseAction),
    InvalidToolCall(InvalidToolCallAction),
    ToolCall(ToolCallAction),
    ToolResult(ToolResultAction),
    TurnEnd(TurnEndAction),
}

impl Action {
    pub fn event(&self) -> EventKind {
        match self {
            Action::SessionStart(_) => EventKind::SessionStart,
            Action::RunStart(_) => EventKind::RunStart,
            Action::ModelRequest(_) => EventKind::ModelRequest,
            Action::ModelResponse(_) => EventKind::ModelResponse,
            Action::InvalidToolCall(_) => EventKind::InvalidToolCall,
            Action::ToolCall(_) => EventKind::ToolCall,
            Action::ToolResult(_) => EventKind::ToolResult,
            Action::TurnEnd(_) => EventKind::TurnEnd,
        }
    }

    /// Verdict kind in snake_case, as shown in provenance and spans.
    pub fn kind_name(&self) -> &'static str {
        self.kind().name()
    }

    /// The kind of verdict, whatever the event.
    pub fn kind(&self) -> VerdictKind {
        use Action as A;
        use VerdictKind as K;
        match self {
            A::SessionStart(SessionStartAction::Continue)
            | A::RunStart(RunStartAction::Continue)
            | A::ModelRequest(ModelRequestAction::Continue)
            | A::ModelResponse(ModelResponseAction::Continue)
            | A::InvalidToolCall(InvalidToolCallAction::Continue)
            | A::ToolCall(ToolCallAction::Continue)
            | A::ToolResult(ToolResultAction::Continue)
            | A::TurnEnd(TurnEndAction::Continue) => K::Continue,
            A::SessionStart(SessionStartAction::Terminate(_))
            | A::RunStart(RunStartAction::Terminate(_))
            | A::ModelRequest(ModelRequestAction::Terminate(_))
            | A::ModelResponse(ModelResponseAction::Terminate(_))
            | A::InvalidToolCall(InvalidToolCallAction::Terminate(_))
            | A::ToolCall(ToolCallAction::Terminate(_))
            | A::ToolResult(ToolResultAction::Terminate(_))
            | A::TurnEnd(TurnEndAction::Terminate(_)) => K::Terminate,
            A::RunStart(RunStartAction::RewriteInput(_)) => K::RewriteInput,
            A::ModelRequest(ModelRequestAction::Patch(_)) => K::PatchRequest,
            A::ModelRequest(ModelRequestAction::Respond(_)) => K::Respond,
            A::ModelResponse(ModelResponseAction::Rewrite(_)) => K::RewriteResponse,
            A::ModelResponse(ModelResponseAction::Retry(_))
            | A::InvalidToolCall(InvalidToolCallAction::Retry(_)) => K::Retry,
            A::InvalidToolCall(InvalidToolCallAction::Skip(_))
            | A::ToolCall(ToolCallAction::Skip(_)) => K::Skip,
            A::ToolCall(ToolCallAction::RewriteArgs(_)) => K::RewriteArgs,
            A::ToolCall(ToolCallAction::Ask(_)) => K::Ask,
            A::ToolResult(ToolResultAction::Rewrite { .. }) => K::RewriteResult,
            A::TurnEnd(TurnEndAction::ContinueRun(_)) => K::ContinueRun,
        }
    }
}

/// The kinds of verdict across events (which an event allows is decided by
/// its chain or merge).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VerdictKind {
    Continue,
    RewriteInput,
    PatchRequest,
    Respond,
    RewriteResponse,
    Retry,
    Skip,
    RewriteArgs,
    Ask,
    RewriteResult,
    ContinueRun,
    Terminate,
}

impl VerdictKind {
    /// Snake_case, as in provenance, spans and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            VerdictKind::Continue => "continue",
            VerdictKind::RewriteInput => "rewrite_input",
            VerdictKind::PatchRequest => "patch_request",
            VerdictKind::Respond => "respond",
            VerdictKind::RewriteResponse => "rewrite_response",
            VerdictKind::Retry => "retry",
            VerdictKind::Skip => "skip",
            VerdictKind::RewriteArgs => "rewrite_args",
            VerdictKind::Ask => "ask",
            VerdictKind::RewriteResult => "rewrite_result",
            VerdictKind::ContinueRun => "continue_run",
            VerdictKind::Terminate => "terminate",
        }
    }

    /// Kinds that change the payload and let the event go on: reported only
    /// when they changed something.
    pub const fn is_rewrite(self) -> bool {
        matches!(
            self,
            VerdictKind::RewriteInput
                | VerdictKind::PatchRequest
                | VerdictKind::RewriteResponse
                | VerdictKind::RewriteArgs
                | VerdictKind::RewriteResult
        )
    }
}

impl std::fmt::Display for VerdictKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum SessionStartAction {
    Continue,
    Terminate(Terminate),
}

#[derive(Clone, Debug, PartialEq)]
pub enum RunStartAction {
    Continue,
    RewriteInput(String),
    Terminate(Terminate),
}

#[derive(Clone, Debug, PartialEq)]
pub enum ModelRequestAction {
    Continue,
    Patch(RequestPatch),
    Respond(Respond),
    Terminate(Terminate),
}

/// Per-call request changes. `None` / empty leaves a field alone.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct RequestPatch {
    pub extra_context: Vec<String>,
    pub system_prompt: Option<String>,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    pub tool_choice: Option<ToolChoice>,
    pub active_tools: Option<Vec<String>>,
    pub additional_params: Option<serde_json::Map<String, serde_json::Value>>,
    pub history: Option<Vec<Message>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Respond {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ModelResponseAction {
    Continue,
    Rewrite(Vec<Block>),
    Retry(String),
    Terminate(Terminate),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Skip {
    pub result: String,
    pub is_error: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub enum InvalidToolCallAction {
    Continue,
    Retry(String),
    Skip(Skip),
    Terminate(Terminate),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Ask {
    pub question: String,
    pub timeout: Option<Duration>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolCallAction {
    Continue,
    RewriteArgs(String),
    Skip(Skip),
    Ask(Ask),
    Terminate(Terminate),
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolResultAction {
    Continue,
    Rewrite {
        content: String,
        is_error: Option<bool>,
    },
    Terminate(Terminate),
}

#[derive(Clone, Debug, PartialEq)]
pub enum TurnEndAction {
    Continue,
    ContinueRun(String),
    Terminate(Terminate),
}
