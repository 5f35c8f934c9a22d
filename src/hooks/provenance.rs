//! Who changed what: every applied verdict is attributed to its hook.

use crate::event::EventKind;
use crate::hooks::failure::FailureClass;
use crate::hooks::verdict::VerdictKind;

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
    pub verdict: VerdictKind,
    pub fields_changed: Vec<String>,
    pub conflicts: Vec<Conflict>,
    pub reason: String,
    /// Set when the hook failed and its failure policy let the event proceed.
    pub failed_open: Option<FailureClass>,
}

impl VerdictRecord {
    pub fn new(hook: &str, event: EventKind, verdict: VerdictKind, reason: &str) -> Self {
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
    /// A rewrite or patch that left every field as it was changed nothing.
    pub fn is_notable(&self) -> bool {
        let quiet = self.verdict == VerdictKind::Continue || self.verdict.is_rewrite();
        !quiet
            || !self.fields_changed.is_empty()
            || !self.conflicts.is_empty()
            || self.failed_open.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewrite_that_changed_nothing_is_not_notable() {
        let mut r = VerdictRecord::new("h", EventKind::RunStart, VerdictKind::RewriteInput, "");
        assert!(!r.is_notable());
        r.fields_changed.push("input".into());
        assert!(r.is_notable());
        let stop = VerdictRecord::new("h", EventKind::ToolCall, VerdictKind::Skip, "");
        assert!(stop.is_notable(), "a terminal verdict always is");
        let mut failed = VerdictRecord::new("h", EventKind::ToolCall, VerdictKind::Continue, "");
        assert!(!failed.is_notable());
        failed.failed_open = Some(FailureClass::Deadline);
        assert!(failed.is_notable());
    }
}
