//! Hook failure classes. Every way a hook can misbehave maps to exactly one
//! class, and every class goes through the hook's failure policy.

use std::fmt;

use crate::event::EventKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureClass {
    /// Connection refused, DNS failure, unreachable.
    Connect,
    /// TLS handshake or certificate failure.
    Tls,
    /// The Process stream could not be opened (e.g. UNIMPLEMENTED).
    StreamRefused,
    /// No verdict before the deadline.
    Deadline,
    /// The stream or the server died mid-event.
    StreamReset,
    /// The hook answered with a gRPC error status.
    Status,
    /// A verdict whose kind is not the event's.
    WrongKind,
    /// A verdict that fails validation.
    InvalidVerdict,
    /// A second verdict for one seq.
    Duplicate,
    /// A verdict for a seq that was never sent.
    Spurious,
    /// The hook's circuit breaker is open; it was not called.
    CircuitOpen,
    /// A blocking hook's config names the event, but its server's Describe
    /// no longer lists it (a redeploy changed it): not called.
    Unsubscribed,
}

impl FailureClass {
    pub const ALL: [FailureClass; 12] = [
        FailureClass::Connect,
        FailureClass::Tls,
        FailureClass::StreamRefused,
        FailureClass::Deadline,
        FailureClass::StreamReset,
        FailureClass::Status,
        FailureClass::WrongKind,
        FailureClass::InvalidVerdict,
        FailureClass::Duplicate,
        FailureClass::Spurious,
        FailureClass::CircuitOpen,
        FailureClass::Unsubscribed,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            FailureClass::Connect => "connect",
            FailureClass::Tls => "tls",
            FailureClass::StreamRefused => "stream_refused",
            FailureClass::Deadline => "deadline",
            FailureClass::StreamReset => "stream_reset",
            FailureClass::Status => "status",
            FailureClass::WrongKind => "wrong_kind",
            FailureClass::InvalidVerdict => "invalid_verdict",
            FailureClass::Duplicate => "duplicate",
            FailureClass::Spurious => "spurious",
            FailureClass::CircuitOpen => "circuit_open",
            FailureClass::Unsubscribed => "unsubscribed",
        }
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What went wrong with one hook call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub class: FailureClass,
    /// The whole story, for the client and the model (a run's reason, a
    /// failed tool's result). May quote the hook server.
    pub detail: String,
    /// For a fault that broke the hook's stream (a duplicate or spurious
    /// verdict, a reset): the event it was seen after, which is the event a
    /// failure names, whatever event was in flight when it was noticed.
    pub seen_after: Option<EventKind>,
    /// `detail` without the text the hook server supplied (its gRPC status
    /// message, which often quotes request content); `None` when `detail`
    /// holds none. Logs above debug and spans use this one.
    pub quiet: Option<String>,
    /// The event never reached the hook: it waited for a free stream slot
    /// on the hook's connections until its deadline. The failure policy
    /// still applies, but the circuit breaker holds nothing against the
    /// hook for it (a busy pool is not a sick server).
    pub unsent: bool,
}

impl Fault {
    pub fn new(class: FailureClass, detail: impl Into<String>) -> Self {
        Fault {
            class,
            detail: detail.into(),
            seen_after: None,
            quiet: None,
            unsent: false,
        }
    }

    /// The event a failure from this fault is about, when noticed at `kind`.
    pub fn event(&self, kind: EventKind) -> EventKind {
        self.seen_after.unwrap_or(kind)
    }

    /// A fault whose `detail` quotes the hook server; `quiet` is the same
    /// story without the quote.
    pub fn quoting_hook(
        class: FailureClass,
        detail: impl Into<String>,
        quiet: impl Into<String>,
    ) -> Self {
        Fault {
            class,
            detail: detail.into(),
            seen_after: None,
            quiet: Some(quiet.into()),
            unsent: false,
        }
    }

    /// This fault, for an event that never reached the hook.
    pub fn unsent(mut self) -> Self {
        self.unsent = true;
        self
    }

    /// What may be logged above debug or exported: `detail` without any
    /// hook-supplied text.
    pub fn log_detail(&self) -> &str {
        self.quiet.as_deref().unwrap_or(&self.detail)
    }
}

/// A fail-closed hook failure: ends the run with outcome hook_failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("hook `{hook}` failed on {event}: {}: {}", .fault.class, .fault.detail)]
pub struct HookFailure {
    pub hook: String,
    pub event: EventKind,
    pub fault: Fault,
}
