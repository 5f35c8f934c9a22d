//! Write a hook server in Rust: implement [`Hook`] (one async method per
//! blocking event, each defaulting to "continue"), then [`serve`] it.
//!
//! ```no_run
//! use hookwire::hook_server::{self, Hook, Ctx, Reply};
//! use hookwire::pb;
//!
//! struct Shout;
//!
//! #[tonic::async_trait]
//! impl Hook for Shout {
//!     fn describe(&self) -> pb::DescribeResponse {
//!         hook_server::describe("shout", &[pb::EventKind::RunStart])
//!     }
//!     async fn run_start(&self, _ctx: &Ctx, ev: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
//!         Reply::new(hook_server::rewrite_input(ev.input.to_uppercase()))
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:50061").await?;
//! hook_server::serve(Shout, listener, std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! The events of one stream are decided concurrently on that stream's own
//! task (no task per event), so a handler that awaits something slow does
//! not hold up the run's other events (tool calls may run concurrently).
//! Blocking or CPU-heavy work belongs in `tokio::task::spawn_blocking`: it
//! would stall every event of the stream.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status, Streaming};

use crate::pb;
use crate::pb::hook_service_server::{HookService, HookServiceServer};

/// Facts about the run an event belongs to.
pub type Ctx = pb::EventContext;

/// A verdict action plus the fields every verdict may carry.
#[derive(Clone, Debug, Default)]
pub struct Reply<V> {
    pub action: V,
    pub reason: String,
    pub scratchpad: Vec<pb::ScratchpadUpdate>,
    pub telemetry_redaction: Option<String>,
}

impl<V> Reply<V> {
    pub fn new(action: V) -> Self {
        Reply {
            action,
            reason: String::new(),
            scratchpad: Vec::new(),
            telemetry_redaction: None,
        }
    }
    pub fn reason(mut self, r: impl Into<String>) -> Self {
        self.reason = r.into();
        self
    }
    pub fn set(mut self, key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.scratchpad.push(pb::ScratchpadUpdate {
            key: key.into(),
            op: Some(pb::scratchpad_update::Op::Set(value.into())),
        });
        self
    }
    pub fn delete(mut self, key: impl Into<String>) -> Self {
        self.scratchpad.push(pb::ScratchpadUpdate {
            key: key.into(),
            op: Some(pb::scratchpad_update::Op::Delete(true)),
        });
        self
    }
    pub fn redact_telemetry(mut self, text: impl Into<String>) -> Self {
        self.telemetry_redaction = Some(text.into());
        self
    }
}

/// Implement the events you care about; every other blocking event answers
/// continue. Subscriptions come from [`Hook::describe`].
#[tonic::async_trait]
pub trait Hook: Send + Sync + 'static {
    fn describe(&self) -> pb::DescribeResponse;

    async fn session_start(
        &self,
        _: &Ctx,
        _: pb::SessionStartEvent,
    ) -> Reply<pb::SessionStartVerdict> {
        Reply::new(pb::SessionStartVerdict {
            action: Some(pb::session_start_verdict::Action::Proceed(pb::Continue {})),
        })
    }
    async fn run_start(&self, _: &Ctx, _: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
        Reply::new(pb::RunStartVerdict {
            action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
        })
    }
    async fn model_request(
        &self,
        _: &Ctx,
        _: pb::ModelRequestEvent,
    ) -> Reply<pb::ModelRequestVerdict> {
        Reply::new(pb::ModelRequestVerdict {
            action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {})),
        })
    }
    async fn model_response(
        &self,
        _: &Ctx,
        _: pb::ModelResponseEvent,
    ) -> Reply<pb::ModelResponseVerdict> {
        Reply::new(pb::ModelResponseVerdict {
            action: Some(pb::model_response_verdict::Action::Proceed(pb::Continue {})),
        })
    }
    async fn invalid_tool_call(
        &self,
        _: &Ctx,
        _: pb::InvalidToolCallEvent,
    ) -> Reply<pb::InvalidToolCallVerdict> {
        Reply::new(pb::InvalidToolCallVerdict {
            action: Some(pb::invalid_tool_call_verdict::Action::Proceed(
                pb::Continue {},
            )),
        })
    }
    async fn tool_call(&self, _: &Ctx, _: pb::ToolCallEvent) -> Reply<pb::ToolCallVerdict> {
        Reply::new(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {})),
        })
    }
    async fn tool_result(&self, _: &Ctx, _: pb::ToolResultEvent) -> Reply<pb::ToolResultVerdict> {
        Reply::new(pb::ToolResultVerdict {
            action: Some(pb::tool_result_verdict::Action::Proceed(pb::Continue {})),
        })
    }
    async fn turn_end(&self, _: &Ctx, _: pb::TurnEndEvent) -> Reply<pb::TurnEndVerdict> {
        Reply::new(pb::TurnEndVerdict {
            action: Some(pb::turn_end_verdict::Action::Proceed(pb::Continue {})),
        })
    }
    /// Events that expect no verdict (text_delta, run_end, session_end, and
    /// every event when configured with mode: observe).
    async fn observe(&self, _: &Ctx, _: pb::HookEvent) {}

    /// Executes a tool declared in `describe`.
    async fn call_tool(&self, _: &Ctx, call: pb::ToolCall) -> Result<pb::CallToolResponse, Status> {
        Err(Status::unimplemented(format!(
            "this hook owns no tool `{}`",
            call.name
        )))
    }
}

/// A DescribeResponse for `name` subscribed to `events`.
pub fn describe(name: &str, events: &[pb::EventKind]) -> pb::DescribeResponse {
    pb::DescribeResponse {
        name: name.to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        events: events.iter().map(|e| *e as i32).collect(),
        tools: vec![],
    }
}

pub fn terminate(reason: impl Into<String>, reply: Option<String>) -> pb::Terminate {
    pb::Terminate {
        reason: reason.into(),
        reply,
    }
}

pub fn rewrite_input(input: impl Into<String>) -> pb::RunStartVerdict {
    pb::RunStartVerdict {
        action: Some(pb::run_start_verdict::Action::RewriteInput(
            pb::RewriteInput {
                input: input.into(),
            },
        )),
    }
}

pub fn patch_request(patch: pb::RequestPatch) -> pb::ModelRequestVerdict {
    pb::ModelRequestVerdict {
        action: Some(pb::model_request_verdict::Action::PatchRequest(patch)),
    }
}

pub fn rewrite_result(content: impl Into<String>) -> pb::ToolResultVerdict {
    pb::ToolResultVerdict {
        action: Some(pb::tool_result_verdict::Action::RewriteResult(
            pb::RewriteResult {
                content: content.into(),
                is_error: None,
            },
        )),
    }
}

pub fn skip_tool(result: impl Into<String>, is_error: bool) -> pb::ToolCallVerdict {
    pb::ToolCallVerdict {
        action: Some(pb::tool_call_verdict::Action::Skip(pb::Skip {
            result: result.into(),
            is_error,
        })),
    }
}

/// The gRPC adapter around a [`Hook`].
pub struct HookAdapter<H> {
    hook: Arc<H>,
}

impl<H: Hook> HookAdapter<H> {
    pub fn new(hook: H) -> Self {
        HookAdapter {
            hook: Arc::new(hook),
        }
    }
}

fn finish<V>(
    seq: u64,
    r: Reply<V>,
    wrap: impl FnOnce(V) -> pb::hook_verdict::Verdict,
) -> pb::HookVerdict {
    pb::HookVerdict {
        seq,
        scratchpad: r.scratchpad,
        reason: r.reason,
        telemetry_redaction: r.telemetry_redaction,
        verdict: Some(wrap(r.action)),
    }
}

/// The verdict for `ev` (`None`: an observe event). A blocking event this
/// helper cannot read (a kind newer than it, no payload) fails the stream,
/// as the proto asks: left unanswered, hookwire would wait out its deadline.
async fn handle<H: Hook>(
    hook: &H,
    mut ev: pb::HookEvent,
) -> Result<Option<pb::HookVerdict>, Status> {
    use pb::hook_event::Payload as P;
    use pb::hook_verdict::Verdict as V;
    if !ev.expects_verdict {
        let ctx = ev.context.clone().unwrap_or_default();
        hook.observe(&ctx, ev).await;
        return Ok(None);
    }
    // The event is taken apart below, so its context moves rather than
    // being copied.
    let ctx = ev.context.take().unwrap_or_default();
    let seq = ev.seq;
    let Some(payload) = ev.payload else {
        return Err(Status::invalid_argument(format!(
            "blocking event seq {seq} (kind {}) has no payload this hook server can read: it may be newer than this server's hookwire.v1",
            ev.kind
        )));
    };
    Ok(Some(match payload {
        P::SessionStart(e) => finish(seq, hook.session_start(&ctx, e).await, V::SessionStart),
        P::RunStart(e) => finish(seq, hook.run_start(&ctx, e).await, V::RunStart),
        P::ModelRequest(e) => finish(seq, hook.model_request(&ctx, e).await, V::ModelRequest),
        P::ModelResponse(e) => finish(seq, hook.model_response(&ctx, e).await, V::ModelResponse),
        P::InvalidToolCall(e) => finish(
            seq,
            hook.invalid_tool_call(&ctx, e).await,
            V::InvalidToolCall,
        ),
        P::ToolCall(e) => finish(seq, hook.tool_call(&ctx, e).await, V::ToolCall),
        P::ToolResult(e) => finish(seq, hook.tool_result(&ctx, e).await, V::ToolResult),
        P::TurnEnd(e) => finish(seq, hook.turn_end(&ctx, e).await, V::TurnEnd),
        // Observe-only events never expect a verdict; answering would be a
        // protocol violation.
        P::TextDelta(_) | P::RunEnd(_) | P::SessionEnd(_) => return Ok(None),
    }))
}

type VerdictStream = Pin<Box<dyn Stream<Item = Result<pb::HookVerdict, Status>> + Send>>;
type Decision = Pin<Box<dyn Future<Output = Result<Option<pb::HookVerdict>, Status>> + Send>>;

/// One `Process` stream's verdicts. It reads the events and drives their
/// handlers itself, concurrently, inside the response stream: the stream
/// task that sends verdicts also decodes the events and decides them, so an
/// event costs no task spawn and no channel hop (each hop can wake another
/// core, tens of microseconds on small VMs).
struct Verdicts<H> {
    hook: Arc<H>,
    /// None once hookwire half-closed the stream (or it broke).
    inbound: Option<Streaming<pb::HookEvent>>,
    deciding: FuturesUnordered<Decision>,
}

impl<H: Hook> Stream for Verdicts<H> {
    type Item = Result<pb::HookVerdict, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        // Take in every event that has arrived, so a slow decision never
        // holds up reading the next one.
        while let Some(inbound) = &mut this.inbound {
            match inbound.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(ev))) => {
                    let hook = this.hook.clone();
                    this.deciding
                        .push(Box::pin(async move { handle(hook.as_ref(), ev).await }));
                }
                Poll::Ready(Some(Err(_)) | None) => this.inbound = None,
                Poll::Pending => break,
            }
        }
        loop {
            match this.deciding.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(Some(v)))) => return Poll::Ready(Some(Ok(v))),
                // An observe event: nothing to answer.
                Poll::Ready(Some(Ok(None))) => continue,
                // The stream fails with it; nothing more is read.
                Poll::Ready(Some(Err(status))) => {
                    this.inbound = None;
                    this.deciding.clear();
                    return Poll::Ready(Some(Err(status)));
                }
                // Half-closed and every event answered: end our side.
                Poll::Ready(None) if this.inbound.is_none() => return Poll::Ready(None),
                // Waiting for events (inbound registered the waker) or for
                // decisions.
                Poll::Ready(None) | Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[tonic::async_trait]
impl<H: Hook> HookService for HookAdapter<H> {
    async fn describe(
        &self,
        _: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        Ok(Response::new(self.hook.describe()))
    }

    type ProcessStream = VerdictStream;

    async fn process(
        &self,
        req: Request<Streaming<pb::HookEvent>>,
    ) -> Result<Response<VerdictStream>, Status> {
        Ok(Response::new(Box::pin(Verdicts {
            hook: self.hook.clone(),
            inbound: Some(req.into_inner()),
            deciding: FuturesUnordered::new(),
        })))
    }

    async fn call_tool(
        &self,
        req: Request<pb::CallToolRequest>,
    ) -> Result<Response<pb::CallToolResponse>, Status> {
        let r = req.into_inner();
        let call = r
            .call
            .ok_or_else(|| Status::invalid_argument("`call` is required"))?;
        let ctx = r.context.unwrap_or_default();
        Ok(Response::new(self.hook.call_tool(&ctx, call).await?))
    }
}

/// The tonic service for a hook, to mount on your own server.
pub fn service<H: Hook>(hook: H) -> HookServiceServer<HookAdapter<H>> {
    HookServiceServer::new(HookAdapter::new(hook))
}

/// Serves a hook (plus grpc.health.v1) on `listener` until `shutdown`.
pub async fn serve<H: Hook>(
    hook: H,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    // SERVING for "" and for the hook service by name, as the guide asks
    // of every hook server (probes may check either).
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    reporter
        .set_serving::<HookServiceServer<HookAdapter<H>>>()
        .await;
    // Nagle off, the verdicts of one scheduler pass in one write, and a
    // deadline for a new connection's preface.
    let incoming = crate::accept::plain(listener);
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(service(hook))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
