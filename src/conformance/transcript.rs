//! What happened on the wire during a check, recorded by `drive` and judged
//! afterwards by `checks`. Judging a finished transcript (rather than while
//! waiting) lets a verdict that arrives late, twice or unasked be attributed
//! to the event it belongs to, whenever it shows up before the stream ends.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::event::EventKind;
use crate::hooks::failure::Fault;
use crate::hooks::payload::Payload;
use crate::pb;

/// One event sent on a `Process` stream.
#[derive(Clone, Debug)]
pub struct SentEvent {
    pub seq: u64,
    pub kind: EventKind,
    /// Row subject, e.g. `tool_call get_weather`.
    pub subject: String,
    pub expects_verdict: bool,
    /// The `deadline_remaining_ms` sent with it.
    pub deadline: Duration,
    pub sent_at: Instant,
    /// How long the checker waited for its verdict (blocking events).
    pub waited: Duration,
    /// The event's payload, for a blocking event: what its verdict is
    /// judged against (the request a patch patches, the tool a
    /// `rewrite_args` must fit).
    pub payload: Option<Payload>,
    /// The run's scratchpad as the event carried it, for a blocking event:
    /// its verdict's updates must keep it within the run's limit.
    pub scratchpad: Option<BTreeMap<String, Vec<u8>>>,
}

/// A verdict as it arrived, whatever its seq.
#[derive(Clone, Debug)]
pub struct Arrival {
    pub verdict: pb::HookVerdict,
    pub at: Instant,
}

/// How the hook server's side of a stream ended.
#[derive(Clone, Debug)]
pub enum StreamEnd {
    /// Ended with OK after the checker half-closed.
    Clean { after: Duration },
    /// Ended with OK while the checker still had events to send.
    Early { at: Instant },
    /// `Process` was refused, or the stream failed with a status or reset.
    Failed {
        fault: Fault,
        at: Instant,
        opening: bool,
    },
    /// Still open this long after the half-close.
    NotClosed { waited: Duration },
}

impl StreamEnd {
    /// When the stream stopped delivering verdicts, if it did before the
    /// half-close.
    pub fn ended_at(&self) -> Option<Instant> {
        match self {
            StreamEnd::Early { at } | StreamEnd::Failed { at, .. } => Some(*at),
            _ => None,
        }
    }
}

/// One `Process` stream: the session_start, run or session_end stream.
#[derive(Clone, Debug)]
pub struct StreamLog {
    /// Row subject, e.g. `run stream`.
    pub name: String,
    pub events: Vec<SentEvent>,
    pub arrivals: Vec<Arrival>,
    pub end: StreamEnd,
    pub half_closed_at: Option<Instant>,
    /// Groups of seqs sent together, each before any of their verdicts was
    /// awaited (as hookwire's concurrent tool calls are).
    pub together: Vec<Vec<u64>>,
}

/// One `CallTool` of an owned tool.
#[derive(Clone, Debug)]
pub struct ToolCallLog {
    pub tool: String,
    pub arguments_json: String,
    /// Set when a tool_call verdict rewrote the generated arguments.
    pub rewritten: bool,
    pub deadline: Duration,
    pub latency: Duration,
    pub result: Result<pb::CallToolResponse, Fault>,
}

#[derive(Clone, Debug, Default)]
pub struct Transcript {
    pub streams: Vec<StreamLog>,
    pub tool_calls: Vec<ToolCallLog>,
}

/// The answer to one `grpc.health.v1.Health/Check`.
#[derive(Clone, Debug)]
pub enum Health {
    /// The `ServingStatus` value (1 = SERVING).
    Status(i32),
    /// UNIMPLEMENTED: the server does not serve health.
    NotServed,
    /// NOT_FOUND: health is served, but not for this service name.
    UnknownService,
    Failed(Fault),
}
