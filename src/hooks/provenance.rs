//! Who changed what: every applied verdict is attributed to its hook.

use crate::event::EventKind;
use crate::hooks::failure::FailureClass;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub field: String,
    /// The hook whose value stands.
    pub winner: String,
    /// The hook whose value was dropped.
    pub loser: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerdictRecord {
    pub hook: String,
    pub event: EventKind,
    pub verdict: &'static str,
    pub fields_changed: Vec<String>,
    pub conflicts: Vec<Conflict>,
    pub reason: String,
    /// Set when the hook failed and its failure policy let the event proceed.
    pub failed_open: Option<FailureClass>,
}

impl VerdictRecord {
    pub fn new(hook: &str, event: EventKind, verdict: &'static str, reason: &str) -> Self {
        VerdictRecord {
            hook: hook.to_string(),
            event,
            verdict,
            fields_changed: Vec::new(),
            conflicts: Vec::new(),
            reason: reason.to_string(),
            failed_open: None,
        }
    }

    /// Worth telling the client: it changed, stopped or failed something.
    pub fn is_notable(&self) -> bool {
        self.verdict != "continue"
            || !self.fields_changed.is_empty()
            || !self.conflicts.is_empty()
            || self.failed_open.is_some()
    }
}
