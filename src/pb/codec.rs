//! The codec of every generated service and client (`build.rs` names it):
//! prost's encoding, with smaller starting buffers than tonic's.
//!
//! Why: tonic gives each call a buffer to encode into and one to decode
//! from, 8 KiB each by default, and a streaming call keeps both for its
//! life: a hook server's `Process` stream for as long as the run (held
//! runs number in the thousands, figure 9), a client's `Run` stream the
//! same. hookwire's messages are a few hundred bytes to a few KiB, and a
//! buffer grows when a message needs more (tonic reserves what the message
//! takes), so 1 KiB is enough to start. Besides resident memory, a
//! stream's decoder writes each message where the last one ended until
//! the buffer wraps, so an 8 KiB buffer touches eight times the cache
//! lines of a 1 KiB one over its cycle, per stream (BENCHMARKS.md, "A
//! stream's buffers" and "Why an event costs more at 512 runs than at
//! 64").

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

/// Starting size 1 KiB; the yield threshold is tonic's default (32 KiB).
pub(crate) fn call_buffers() -> BufferSettings {
    BufferSettings::new(1024, 32 * 1024)
}

/// `application/grpc+proto` through prost, with [`call_buffers`].
#[derive(Debug, Clone)]
pub struct SmallBufferCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallBufferCodec<T, U> {
    fn default() -> Self {
        SmallBufferCodec(PhantomData)
    }
}

impl<T, U> Codec for SmallBufferCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(call_buffers())
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(call_buffers())
    }
}
