//! Raw gRPC calls: any bytes as the request message of any method, to see
//! what a server does with messages no generated client would send.

use prost::bytes::{Buf, BufMut};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Request, Status};

#[derive(Clone, Copy, Default)]
pub struct RawCodec;
pub struct RawEncoder;
pub struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

fn path(method: &str) -> PathAndQuery {
    PathAndQuery::try_from(format!("/hookwire.v1.AgentService/{method}")).unwrap()
}

/// Calls a unary AgentService `method` with `body` as its message.
pub async fn unary(channel: Channel, method: &str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    grpc.unary(Request::new(body), path(method), RawCodec)
        .await
        .map(|r| r.into_inner())
}

/// Calls a server-streaming AgentService `method`; every message until the
/// stream ends, or the first error.
pub async fn streaming(
    channel: Channel,
    method: &str,
    body: Vec<u8>,
) -> Result<Vec<Vec<u8>>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut stream = grpc
        .server_streaming(Request::new(body), path(method), RawCodec)
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        out.push(m);
    }
    Ok(out)
}
