//! What a run tells its client, in order.

use std::time::Duration;

use crate::agent::outcome::RunOutcome;
use crate::hooks::provenance::VerdictRecord;
use crate::message::{Message, ToolCall, ToolResult, Usage};

#[derive(Clone, Debug, PartialEq)]
pub enum RunEvent {
    /// Always first, before any hook is called.
    Started,
    /// The input entered history (every run_start hook let it).
    InputCommitted {
        input: String,
        rewritten: bool,
    },
    TurnStarted {
        turn: u32,
    },
    TextDelta {
        turn: u32,
        text: String,
    },
    DeltasRetracted {
        turn: u32,
        reason: String,
    },
    AssistantMessage {
        turn: u32,
        message: Message,
        finish_reason: String,
        usage: Usage,
    },
    ToolCallRequested {
        turn: u32,
        index: u32,
        call: ToolCall,
    },
    ToolStarted {
        turn: u32,
        index: u32,
        call: ToolCall,
    },
    ToolResult {
        turn: u32,
        index: u32,
        result: ToolResult,
    },
    HookVerdict(VerdictRecord),
    ApprovalRequested {
        turn: u32,
        index: u32,
        call: ToolCall,
        question: String,
        hook: String,
        timeout: Duration,
    },
    Finished(RunReport),
}

/// An event in its run's queue to the client: boxed, because tokio's
/// channel allocates its slots 32 at a time at creation, and 32 slots of
/// this 200-byte enum were 6.4 KiB per run (most runs queue a handful).
pub type QueuedEvent = Box<RunEvent>;

/// The final result of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    pub run_id: String,
    pub session_id: String,
    pub outcome: RunOutcome,
    pub final_text: String,
    pub reason: String,
    pub usage: Usage,
    pub turns: u32,
    /// Messages this run committed to the transcript.
    pub messages: Vec<Message>,
    pub hook_verdicts: Vec<VerdictRecord>,
    /// The provider's finish reason of the last model turn ("" when none
    /// finished).
    pub finish_reason: String,
}

/// The finish reason providers give when the output hit the token limit.
pub const FINISH_LENGTH: &str = "length";

impl RunReport {
    /// The last model turn was cut off at the token limit.
    pub fn truncated(&self) -> bool {
        self.finish_reason == FINISH_LENGTH
    }
}
