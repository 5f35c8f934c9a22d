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

use std::marker::PhantomData;
use std::sync::Arc;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::ProstDecoder;

use super::wire_event::WireEvent;
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
