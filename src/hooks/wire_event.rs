//! An event as it goes on a run's `Process` stream, with the run's part of
//! its `EventContext` encoded once per run.
//!
//! Why: the session, run, agent, streaming flag, principal and claims are
//! the same for every event of a run. Building them into each event's
//! `EventContext` copied four strings and a map, encoded them and freed
//! them again, at every event (~3k instructions per event, callgrind,
//! BENCHMARKS.md figure 10). They are now encoded once, when the run's
//! hooks are set up, and each event's context is those bytes followed by
//! the fields that change: turn, scratchpad, deadline and trace context.
//! Protobuf merges a message's fields wherever they appear in its bytes,
//! so a hook server in any language decodes the same `EventContext` as if
//! it had been encoded whole (tested below against prost's decoder, and
//! by every hook integration test).
//!
//! The event's other fields are written in field-number order, exactly as
//! prost writes them, so only the context's inner order differs.
//!
//! `deadline_remaining_ms` is computed as the event is encoded, from the
//! absolute deadline the event keeps: the proto promises the time left
//! when the event was sent, and an event may wait in hookwire first (for a
//! slow reader, a free stream slot in the pool, a connect, or a resend
//! after a refused stream). A value fixed when the event was built would
//! tell the hook it has time hookwire will not wait for.

use std::sync::Arc;

use prost::encoding::{self, WireType};
use prost::Message;
use tokio::time::Instant;

use super::payload::EventContext;
use crate::pb;

/// `HookEvent.context`'s field number.
const CONTEXT_FIELD: u32 = 3;
/// `EventContext.deadline_remaining_ms`'s field number.
const DEADLINE_FIELD: u32 = 7;

/// The fields of a run's `EventContext` that no event changes, encoded.
#[derive(Clone, Debug, Default)]
pub struct RunContext(Arc<[u8]>);

impl RunContext {
    pub fn new(ctx: &EventContext) -> RunContext {
        // Exhaustive, so a field added to the domain context is a compile
        // error here until it is placed on one side or the other.
        let EventContext {
            session_id,
            run_id,
            turn: _,
            agent,
            streaming,
            traceparent: _,
            tracestate: _,
            principal,
            principal_claims,
        } = ctx;
        let fixed = pb::EventContext {
            session_id: session_id.clone(),
            run_id: run_id.clone(),
            agent: agent.clone(),
            streaming: *streaming,
            principal: principal.clone(),
            principal_claims: principal_claims
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            ..Default::default()
        };
        RunContext(fixed.encode_to_vec().into())
    }
}

/// One event for a `Process` stream: `event` without its context, the
/// run's fixed context fields, and this event's own.
#[derive(Debug)]
pub struct WireEvent {
    pub event: pb::HookEvent,
    run: RunContext,
    context: pb::EventContext,
    /// When hookwire stops waiting for the verdict; sent as
    /// `deadline_remaining_ms`, measured at each encoding.
    deadline: Option<Instant>,
}

impl WireEvent {
    /// `context` holds only what changes per event (turn, scratchpad,
    /// deadline, trace context); whatever it sets of the run's fixed fields
    /// would be merged over them.
    pub fn new(mut event: pb::HookEvent, run: &RunContext, context: pb::EventContext) -> WireEvent {
        event.context = None;
        WireEvent {
            event,
            run: run.clone(),
            context,
            deadline: None,
        }
    }

    /// Sends the time left until `deadline` as `deadline_remaining_ms`,
    /// measured when the event is encoded (0 once it has passed), in place
    /// of the context's own value.
    pub fn with_deadline(mut self, deadline: Instant) -> WireEvent {
        self.context.deadline_remaining_ms = 0;
        self.deadline = Some(deadline);
        self
    }

    /// Appends the encoded event to `buf`.
    pub fn encode(&self, buf: &mut Vec<u8>) {
        // Exhaustive for the same reason as in `RunContext::new`.
        let pb::HookEvent {
            seq,
            kind,
            context: _,
            expects_verdict,
            payload,
        } = &self.event;
        if *seq != 0 {
            encoding::uint64::encode(1, seq, buf);
        }
        if *kind != 0 {
            encoding::int32::encode(2, kind, buf);
        }
        // Zero (passed, or none) is left out, as prost leaves it out.
        let remaining = self
            .deadline
            .map(|d| crate::hooks::wire::millis(d.saturating_duration_since(Instant::now())))
            .filter(|ms| *ms != 0);
        let deadline_len =
            remaining.map_or(0, |ms| encoding::uint64::encoded_len(DEADLINE_FIELD, &ms));
        encoding::encode_key(CONTEXT_FIELD, WireType::LengthDelimited, buf);
        encoding::encode_varint(
            (self.run.0.len() + self.context.encoded_len() + deadline_len) as u64,
            buf,
        );
        buf.extend_from_slice(&self.run.0);
        self.context.encode_raw(buf);
        if let Some(ms) = remaining {
            encoding::uint64::encode(DEADLINE_FIELD, &ms, buf);
        }
        if *expects_verdict {
            encoding::bool::encode(4, expects_verdict, buf);
        }
        if let Some(payload) = payload {
            payload.encode(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn run_ctx() -> EventContext {
        EventContext {
            session_id: "s-1".into(),
            run_id: "r-1".into(),
            turn: 9,
            agent: "demo".into(),
            streaming: true,
            traceparent: "ignored".into(),
            tracestate: String::new(),
            principal: "alice".into(),
            principal_claims: BTreeMap::from([("roles".into(), "admin ops".into())]),
        }
    }

    fn event_ctx() -> pb::EventContext {
        pb::EventContext {
            turn: 2,
            scratchpad: [("k".to_string(), vec![0, 1, 2])].into(),
            deadline_remaining_ms: 1500,
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            tracestate: "vendor=x".into(),
            ..Default::default()
        }
    }

    /// The event as prost would encode it whole.
    fn whole(event: &pb::HookEvent) -> pb::HookEvent {
        let mut whole = event.clone();
        let ctx = run_ctx();
        whole.context = Some(pb::EventContext {
            session_id: ctx.session_id,
            run_id: ctx.run_id,
            agent: ctx.agent,
            streaming: ctx.streaming,
            principal: ctx.principal,
            principal_claims: ctx.principal_claims.into_iter().collect(),
            ..event_ctx()
        });
        whole
    }

    fn bytes(event: pb::HookEvent, run: &RunContext, context: pb::EventContext) -> Vec<u8> {
        let mut buf = vec![];
        WireEvent::new(event, run, context).encode(&mut buf);
        buf
    }

    fn decoded(event: pb::HookEvent, context: pb::EventContext) -> pb::HookEvent {
        let buf = bytes(event, &RunContext::new(&run_ctx()), context);
        pb::HookEvent::decode(buf.as_slice()).unwrap()
    }

    #[test]
    fn a_hook_server_decodes_the_context_it_would_get_encoded_whole() {
        let event = pb::HookEvent {
            seq: 300,
            kind: pb::EventKind::ToolCall as i32,
            context: None,
            expects_verdict: true,
            payload: Some(pb::hook_event::Payload::ToolCall(pb::ToolCallEvent {
                call: Some(pb::ToolCall {
                    id: "c1".into(),
                    name: "get_weather".into(),
                    arguments_json: "{\"city\":\"Paris\"}".into(),
                }),
                ..Default::default()
            })),
        };
        assert_eq!(decoded(event.clone(), event_ctx()), whole(&event));
    }

    #[test]
    fn default_fields_are_left_out_as_prost_leaves_them_out() {
        // seq 0, the zero kind, no verdict expected and no payload: the
        // bytes are prost's for everything but the context.
        let event = pb::HookEvent::default();
        assert_eq!(decoded(event.clone(), event_ctx()), whole(&event));
        let buf = bytes(event, &RunContext::default(), pb::EventContext::default());
        let expected = pb::HookEvent {
            context: Some(pb::EventContext::default()),
            ..Default::default()
        };
        assert_eq!(buf, expected.encode_to_vec());
    }

    /// The time left is measured when the event is encoded, not when it was
    /// built: an event that waited in hookwire (for a slow reader, a stream
    /// slot, a resend) tells the hook what is really left, and nothing once
    /// the deadline passed.
    #[tokio::test(start_paused = true)]
    async fn the_time_left_is_measured_at_each_encoding() {
        use std::time::Duration;
        let start = Instant::now();
        let ev = WireEvent::new(
            pb::HookEvent::default(),
            &RunContext::new(&run_ctx()),
            event_ctx(),
        )
        .with_deadline(start + Duration::from_millis(5_000));
        let sent = |ev: &WireEvent| {
            let mut buf = vec![];
            ev.encode(&mut buf);
            let ctx = pb::HookEvent::decode(buf.as_slice())
                .unwrap()
                .context
                .unwrap();
            // Everything else is the context as given.
            let mut expected = whole(&pb::HookEvent::default()).context.unwrap();
            expected.deadline_remaining_ms = ctx.deadline_remaining_ms;
            assert_eq!(ctx, expected);
            ctx.deadline_remaining_ms
        };
        assert_eq!(sent(&ev), 5_000, "not the context's own 1500");
        tokio::time::advance(Duration::from_millis(1_750)).await;
        assert_eq!(sent(&ev), 3_250);
        tokio::time::advance(Duration::from_millis(4_000)).await;
        assert_eq!(sent(&ev), 0, "saturates once passed");
    }

    #[test]
    fn fields_outside_the_context_are_in_prost_s_order_and_bytes() {
        let event = pb::HookEvent {
            seq: 7,
            kind: pb::EventKind::RunEnd as i32,
            context: None,
            expects_verdict: true,
            payload: Some(pb::hook_event::Payload::RunEnd(pb::RunEndEvent::default())),
        };
        let buf = bytes(
            event.clone(),
            &RunContext::default(),
            pb::EventContext::default(),
        );
        let mut expected = event;
        expected.context = Some(pb::EventContext::default());
        assert_eq!(buf, expected.encode_to_vec());
    }
}
