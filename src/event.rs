//! The lifecycle events of a run: one list, one source of truth for names
//! used in configuration, the wire protocol, metrics and spans.

use std::fmt;
use std::str::FromStr;

/// A lifecycle point of a run (see DESIGN.md's event table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    SessionStart,
    RunStart,
    ModelRequest,
    TextDelta,
    ModelResponse,
    InvalidToolCall,
    ToolCall,
    ToolResult,
    TurnEnd,
    RunEnd,
    SessionEnd,
}

/// How the verdicts of several hooks on one event combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Composition {
    /// One after another; each sees the previous rewrite; terminal verdicts stop.
    Chain,
    /// All concurrently on the same baseline; patches merged in firing order.
    Merge,
    /// Delivered without waiting; never on the critical path.
    Observe,
}

impl EventKind {
    pub const ALL: [EventKind; 11] = [
        EventKind::SessionStart,
        EventKind::RunStart,
        EventKind::ModelRequest,
        EventKind::TextDelta,
        EventKind::ModelResponse,
        EventKind::InvalidToolCall,
        EventKind::ToolCall,
        EventKind::ToolResult,
        EventKind::TurnEnd,
        EventKind::RunEnd,
        EventKind::SessionEnd,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            EventKind::SessionStart => "session_start",
            EventKind::RunStart => "run_start",
            EventKind::ModelRequest => "model_request",
            EventKind::TextDelta => "text_delta",
            EventKind::ModelResponse => "model_response",
            EventKind::InvalidToolCall => "invalid_tool_call",
            EventKind::ToolCall => "tool_call",
            EventKind::ToolResult => "tool_result",
            EventKind::TurnEnd => "turn_end",
            EventKind::RunEnd => "run_end",
            EventKind::SessionEnd => "session_end",
        }
    }

    pub const fn composition(self) -> Composition {
        match self {
            EventKind::ModelRequest => Composition::Merge,
            EventKind::TextDelta | EventKind::RunEnd | EventKind::SessionEnd => {
                Composition::Observe
            }
            _ => Composition::Chain,
        }
    }

    /// Whether hookwire waits for a verdict on this event.
    pub const fn is_blocking(self) -> bool {
        !matches!(self.composition(), Composition::Observe)
    }

    /// Events a hook receives when neither its config nor `Describe` narrows
    /// them: text deltas are opt-in because they are chatty.
    pub const fn is_opt_in(self) -> bool {
        matches!(self, EventKind::TextDelta)
    }
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An event name that is not one of the eleven.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown event `{given}`{}", suggestion_text(.suggestion))]
pub struct UnknownEvent {
    pub given: String,
    pub suggestion: Option<&'static str>,
}

fn suggestion_text(s: &Option<&'static str>) -> String {
    match s {
        Some(name) => format!("; did you mean `{name}`?"),
        None => format!(
            "; valid events: {}",
            EventKind::ALL.map(EventKind::name).join(", ")
        ),
    }
}

impl FromStr for EventKind {
    type Err = UnknownEvent;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(kind) = EventKind::ALL.into_iter().find(|k| k.name() == s) {
            return Ok(kind);
        }
        Err(UnknownEvent {
            given: s.to_string(),
            suggestion: nearest(s, EventKind::ALL.map(EventKind::name).into_iter()),
        })
    }
}

/// The closest candidate by edit distance, if it is plausibly a typo.
pub fn nearest<'a>(given: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .map(|c| (strsim::damerau_levenshtein(given, c), c))
        .filter(|(d, c)| *d <= 3.max(c.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

impl<'de> serde::Deserialize<'de> for EventKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for EventKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in EventKind::ALL {
            assert_eq!(k.name().parse::<EventKind>().unwrap(), k);
        }
    }

    #[test]
    fn misspelling_suggests_nearest() {
        let err = "tool_cal".parse::<EventKind>().unwrap_err();
        assert_eq!(err.suggestion, Some("tool_call"));
        assert!(err.to_string().contains("did you mean `tool_call`"));
        let err = "model_requests".parse::<EventKind>().unwrap_err();
        assert_eq!(err.suggestion, Some("model_request"));
    }

    #[test]
    fn nonsense_lists_all_names() {
        let err = "zzzzzzzzzzzzzzzzzzzzzzzz".parse::<EventKind>().unwrap_err();
        // Spelled out, so a list that loses or reorders a name fails here.
        assert_eq!(
            err.to_string(),
            "unknown event `zzzzzzzzzzzzzzzzzzzzzzzz`; valid events: session_start, run_start, \
             model_request, text_delta, model_response, invalid_tool_call, tool_call, \
             tool_result, turn_end, run_end, session_end"
        );
    }

    #[test]
    fn composition_matches_design_table() {
        assert_eq!(EventKind::ModelRequest.composition(), Composition::Merge);
        for k in [
            EventKind::TextDelta,
            EventKind::RunEnd,
            EventKind::SessionEnd,
        ] {
            assert!(!k.is_blocking());
        }
        assert_eq!(EventKind::ALL.iter().filter(|k| k.is_blocking()).count(), 8);
    }
}
