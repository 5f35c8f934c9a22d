//! What tonic rejects before AgentService sees a request (a message over the
//! decode limit, bytes that are not the method's message), answered the way
//! hookwire answers its own bad requests: INVALID_ARGUMENT naming the limit
//! or the problem, instead of tonic's generic OUT_OF_RANGE / INTERNAL.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::Status;

use crate::server::status;

/// Room above `server.max_input_bytes` for the rest of a request (ids,
/// metadata, framing), so that an input just over the limit is decoded and
/// refused by the engine with its size.
const ENVELOPE_BYTES: usize = 64 * 1024;
/// tonic's own default decode limit, kept as the floor for requests
/// without user input (CreateSession metadata).
const MIN_DECODE_BYTES: usize = 4 * 1024 * 1024;

/// The largest request message AgentService decodes.
pub fn decode_limit(max_input_bytes: usize) -> usize {
    max_input_bytes
        .saturating_add(ENVELOPE_BYTES)
        .max(MIN_DECODE_BYTES)
}

/// Wraps the AgentService server and rewrites the statuses tonic produced
/// while decoding a request (see [`status::decode_rejection`]).
#[derive(Clone)]
pub struct CheckedRequests<S> {
    inner: S,
    max_input_bytes: usize,
}

impl<S> CheckedRequests<S> {
    pub fn new(inner: S, max_input_bytes: usize) -> Self {
        CheckedRequests {
            inner,
            max_input_bytes,
        }
    }
}

impl<S: NamedService> NamedService for CheckedRequests<S> {
    const NAME: &'static str = S::NAME;
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, B> tower::Service<http::Request<B>> for CheckedRequests<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let fut = self.inner.call(req);
        let max = self.max_input_bytes;
        Box::pin(async move {
            let resp = fut.await?;
            // tonic answers a request it could not decode with a
            // trailers-only response carrying the Status as an extension.
            let rewritten = resp
                .extensions()
                .get::<Status>()
                .and_then(|s| status::decode_rejection(s, max));
            Ok(match rewritten {
                Some(s) => s.into_http(),
                None => resp,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decode_limit_leaves_room_above_the_input_limit() {
        assert_eq!(decode_limit(256 * 1024), MIN_DECODE_BYTES);
        assert_eq!(
            decode_limit(16 * 1024 * 1024),
            16 * 1024 * 1024 + ENVELOPE_BYTES
        );
        assert_eq!(decode_limit(usize::MAX), usize::MAX);
    }
}
