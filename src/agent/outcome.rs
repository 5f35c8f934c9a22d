//! How a run ends.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RunOutcome {
    Completed,
    Terminated,
    Failed,
    Cancelled,
    MaxTurns,
    HookFailed,
    ModelFailed,
    TimedOut,
    /// The replica running it was lost (or lost its lease); another replica
    /// ended it. Tools are never replayed.
    Interrupted,
}

impl RunOutcome {
    pub const fn name(self) -> &'static str {
        match self {
            RunOutcome::Completed => "completed",
            RunOutcome::Terminated => "terminated",
            RunOutcome::Failed => "failed",
            RunOutcome::Cancelled => "cancelled",
            RunOutcome::MaxTurns => "max_turns",
            RunOutcome::HookFailed => "hook_failed",
            RunOutcome::ModelFailed => "model_failed",
            RunOutcome::TimedOut => "timed_out",
            RunOutcome::Interrupted => "interrupted",
        }
    }
}

impl fmt::Display for RunOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
