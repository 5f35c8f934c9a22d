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

use prost::Message;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::Status;
use tonic_prost::ProstDecoder;

/// A scratch buffer grown past this by one large event (a model request
/// with a long history) is let go after it, so a run holding its stream
/// does not hold that memory until it ends.
const KEEP_SCRATCH: usize = 64 * 1024;

/// `application/grpc+proto`, encoding `T` and decoding `U`.
pub struct ScratchCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ScratchCodec<T, U> {
    fn default() -> Self {
        ScratchCodec(PhantomData)
    }
}

impl<T, U> Codec for ScratchCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ScratchEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ScratchEncoder {
            scratch: Vec::new(),
            _pd: PhantomData,
        }
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

pub struct ScratchEncoder<T> {
    scratch: Vec<u8>,
    _pd: PhantomData<T>,
}

impl<T: Message> Encoder for ScratchEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        use prost::bytes::BufMut as _;
        buf.put_slice(encode_into(&mut self.scratch, &item)?);
        if self.scratch.capacity() > KEEP_SCRATCH {
            self.scratch = Vec::new();
        }
        Ok(())
    }
}

/// `item` encoded into `scratch` (cleared first). A `Vec` grows as
/// needed, so this fails only past `isize::MAX` bytes.
fn encode_into<'a, T: Message>(scratch: &'a mut Vec<u8>, item: &T) -> Result<&'a [u8], Status> {
    scratch.clear();
    item.encode(scratch)
        .map_err(|e| Status::internal(format!("encoding a hook event: {e}")))?;
    Ok(scratch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    #[test]
    fn an_event_is_encoded_as_prost_encodes_it() {
        let event = pb::HookEvent {
            seq: 300,
            kind: pb::EventKind::ToolCall as i32,
            expects_verdict: true,
            context: Some(pb::EventContext {
                session_id: "s".repeat(200),
                run_id: "r-1".into(),
                turn: 2,
                ..Default::default()
            }),
            payload: None,
        };
        let mut scratch = vec![1, 2, 3];
        assert_eq!(
            encode_into(&mut scratch, &event).unwrap(),
            event.encode_to_vec()
        );
        // Reused: the previous event's bytes are gone.
        let small = pb::HookEvent {
            seq: 1,
            ..Default::default()
        };
        assert_eq!(
            encode_into(&mut scratch, &small).unwrap(),
            small.encode_to_vec()
        );
    }
}
