//! The codec of hookwire's side of a `Process` stream: prost's encoding,
//! with each event written into a scratch buffer the stream reuses.
//!
//! Why: tonic hands prost its `EncodeBuf`, whose byte writes go through
//! `BytesMut::put_slice`, a call and a `memcpy` per byte. Every tag and
//! length in protobuf is such a byte (a varint), and an event has dozens
//! of them: ~70 instructions each, ~2–3k per event (callgrind, BENCHMARKS.md
//! figure 10). A `Vec<u8>` takes them as plain stores, and the encoded
//! event is then copied into tonic's buffer in one piece. The bytes on the
//! wire are the same.
//!
//! Verdicts are decoded by prost's own decoder, unchanged.
//!
//! [`ToolCallCodec`] is `CallTool`'s: prost's encoding too, with the
//! request's `deadline_remaining_ms` measured as it is encoded, as an
//! event's is (`hooks::wire_event`): the request is encoded only once its
//! connection is there, and dialing one (a TLS handshake, a connection
//! another call is dialing, a resend after GOAWAY) takes time that a value
//! fixed when the request was built would still offer the tool.

use std::marker::PhantomData;
use std::sync::Arc;

use prost::Message;
use tokio::time::Instant;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::ProstDecoder;

use super::wire_event::WireEvent;
use crate::pb;
use crate::pb::codec::call_buffers;

/// A scratch buffer grown past this by one large event (a model request
/// with a long history) is let go after it, so a run holding its stream
/// does not hold that memory until it ends.
const KEEP_SCRATCH: usize = 64 * 1024;

/// `application/grpc+proto`, encoding [`WireEvent`]s (shared with the
/// stream, which keeps them until the server accepted it) and decoding `U`.
pub struct ScratchCodec<U>(PhantomData<U>);

impl<U> Default for ScratchCodec<U> {
    fn default() -> Self {
        ScratchCodec(PhantomData)
    }
}

impl<U> Codec for ScratchCodec<U>
where
    U: Message + Default + Send + 'static,
{
    type Encode = Arc<WireEvent>;
    type Decode = U;
    type Encoder = ScratchEncoder;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ScratchEncoder {
            scratch: Vec::new(),
        }
    }

    /// Verdicts: prost's decoder, with the small buffers of every
    /// generated call (a held run keeps one per stream).
    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(call_buffers())
    }
}

pub struct ScratchEncoder {
    scratch: Vec<u8>,
}

impl Encoder for ScratchEncoder {
    type Item = Arc<WireEvent>;
    type Error = Status;

    fn encode(&mut self, item: Arc<WireEvent>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        use prost::bytes::BufMut as _;
        buf.put_slice(encode_into(&mut self.scratch, &item));
        if self.scratch.capacity() > KEEP_SCRATCH {
            self.scratch = Vec::new();
        }
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        call_buffers()
    }
}

/// A `CallTool` request and when hookwire stops waiting for its answer.
pub struct ToolRequest {
    pub request: pb::CallToolRequest,
    pub deadline: Instant,
}

/// `application/grpc+proto` for `CallTool`: encodes a [`ToolRequest`] with
/// `context.deadline_remaining_ms` set to the time left as it is encoded
/// (0 once it has passed), decodes the response with prost.
#[derive(Default)]
pub struct ToolCallCodec;

impl Codec for ToolCallCodec {
    type Encode = ToolRequest;
    type Decode = pb::CallToolResponse;
    type Encoder = ToolRequestEncoder;
    type Decoder = ProstDecoder<pb::CallToolResponse>;

    fn encoder(&mut self) -> Self::Encoder {
        ToolRequestEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(call_buffers())
    }
}

pub struct ToolRequestEncoder;

impl Encoder for ToolRequestEncoder {
    type Item = ToolRequest;
    type Error = Status;

    fn encode(&mut self, item: ToolRequest, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        stamped(item)
            .encode(buf)
            .map_err(|e| Status::internal(format!("cannot encode CallTool: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        call_buffers()
    }
}

/// The request with the time left until its deadline, now.
fn stamped(item: ToolRequest) -> pb::CallToolRequest {
    let ToolRequest {
        mut request,
        deadline,
    } = item;
    request
        .context
        .get_or_insert_with(Default::default)
        .deadline_remaining_ms =
        super::wire::millis(deadline.saturating_duration_since(Instant::now()));
    request
}

/// `item` encoded into `scratch` (cleared first).
fn encode_into<'a>(scratch: &'a mut Vec<u8>, item: &WireEvent) -> &'a [u8] {
    scratch.clear();
    item.encode(scratch);
    scratch
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::wire_event::RunContext;
    use crate::pb;

    fn wire(event: pb::HookEvent) -> WireEvent {
        WireEvent::new(event, &RunContext::default(), pb::EventContext::default())
    }

    #[tokio::test(start_paused = true)]
    async fn a_tool_request_is_told_the_time_left_when_it_is_encoded() {
        let item = ToolRequest {
            request: pb::CallToolRequest::default(),
            deadline: Instant::now() + std::time::Duration::from_secs(5),
        };
        // Built, then kept waiting (for its connection) before encoding.
        tokio::time::advance(std::time::Duration::from_millis(1200)).await;
        let sent = stamped(item);
        assert_eq!(sent.context.unwrap().deadline_remaining_ms, 3800);
        let late = ToolRequest {
            request: pb::CallToolRequest {
                context: Some(pb::EventContext {
                    deadline_remaining_ms: 5000,
                    ..Default::default()
                }),
                ..Default::default()
            },
            deadline: Instant::now(),
        };
        assert_eq!(stamped(late).context.unwrap().deadline_remaining_ms, 0);
    }

    #[test]
    fn a_reused_scratch_buffer_holds_only_the_last_event() {
        let big = wire(pb::HookEvent {
            seq: 300,
            kind: pb::EventKind::ToolCall as i32,
            expects_verdict: true,
            payload: Some(pb::hook_event::Payload::RunStart(pb::RunStartEvent {
                input: "x".repeat(200),
            })),
            ..Default::default()
        });
        let small = wire(pb::HookEvent {
            seq: 1,
            ..Default::default()
        });
        let mut alone = vec![];
        small.encode(&mut alone);
        let mut scratch = vec![1, 2, 3];
        encode_into(&mut scratch, &big);
        assert_eq!(encode_into(&mut scratch, &small), alone.as_slice());
    }
}
