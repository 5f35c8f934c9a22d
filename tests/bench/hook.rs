//! The hook servers the figures call: real tonic servers built with
//! `hookwire::hook_server`, on port 0 in this process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hookwire::hook_server::{self, Ctx, Hook, Reply};
use hookwire::pb;
use tokio::sync::{oneshot, watch};

/// Every event a blocking hook can answer.
pub const BLOCKING: [pb::EventKind; 8] = [
    pb::EventKind::SessionStart,
    pb::EventKind::RunStart,
    pb::EventKind::ModelRequest,
    pb::EventKind::ModelResponse,
    pb::EventKind::InvalidToolCall,
    pb::EventKind::ToolCall,
    pb::EventKind::ToolResult,
    pb::EventKind::TurnEnd,
];

/// Always continues and, when asked to, owns the `get_weather` tool. Keeps
/// one event of each kind from its first run.
#[derive(Clone)]
pub struct Steady {
    name: String,
    owns_tool: bool,
    /// Time taken to decide each event.
    thinking: Duration,
    /// Whether that time is kept exactly (see [`Steady::thinking_exactly`]).
    exact: bool,
    answered: Arc<AtomicU64>,
    /// One event of each kind seen, kept for the floor's message.
    pub sample: Arc<std::sync::Mutex<Vec<pb::HookEvent>>>,
}

impl Steady {
    pub fn new(name: &str, owns_tool: bool) -> Steady {
        Steady {
            name: name.into(),
            owns_tool,
            thinking: Duration::ZERO,
            exact: false,
            answered: Arc::default(),
            sample: Arc::default(),
        }
    }

    /// Takes `d` to decide each event, on tokio's timer: that rounds a
    /// sleep up to its next millisecond tick (and the worker's epoll
    /// timeout again), so 1 ms takes 1.3–2 ms, and hooks started a few µs
    /// apart may end a tick apart.
    pub fn thinking(mut self, d: Duration) -> Steady {
        self.thinking = d;
        self
    }

    /// Takes `d` to decide each event, ending within tens of µs of it (a
    /// blocking thread's nanosleep), as a lookup that takes 1 ms does; the
    /// hand-off to that thread and back adds its own wake-ups.
    pub fn thinking_exactly(mut self, d: Duration) -> Steady {
        self.thinking = d;
        self.exact = true;
        self
    }

    async fn decide(&self, ctx: &Ctx, kind: pb::EventKind, payload: pb::hook_event::Payload) {
        if self.exact {
            let d = self.thinking;
            let _ = tokio::task::spawn_blocking(move || std::thread::sleep(d)).await;
        } else if !self.thinking.is_zero() {
            tokio::time::sleep(self.thinking).await;
        }
        // Samples come from the first (calibration) run; after that, only
        // the count, so the bench hook costs next to nothing.
        if self.answered.fetch_add(1, Ordering::Relaxed) >= 64 {
            return;
        }
        let mut s = self.sample.lock().unwrap();
        if s.len() < BLOCKING.len() && !s.iter().any(|e| e.kind == kind as i32) {
            s.push(pb::HookEvent {
                seq: 1,
                kind: kind as i32,
                context: Some(ctx.clone()),
                expects_verdict: true,
                payload: Some(payload),
            });
        }
    }
}

pub fn weather_tool() -> pb::ToolSpec {
    pb::ToolSpec {
        name: "get_weather".into(),
        description: "Current weather for a city".into(),
        parameters_json_schema:
            r#"{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}"#
                .into(),
    }
}

fn proceed() -> Option<pb::Continue> {
    Some(pb::Continue {})
}

#[tonic::async_trait]
impl Hook for Steady {
    fn describe(&self) -> pb::DescribeResponse {
        let mut d = hook_server::describe(&self.name, &BLOCKING);
        if self.owns_tool {
            d.tools = vec![weather_tool()];
        }
        d
    }
    async fn run_start(&self, ctx: &Ctx, e: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
        self.decide(
            ctx,
            pb::EventKind::RunStart,
            pb::hook_event::Payload::RunStart(e),
        )
        .await;
        Reply::new(pb::RunStartVerdict {
            action: proceed().map(pb::run_start_verdict::Action::Proceed),
        })
    }
    async fn model_request(
        &self,
        ctx: &Ctx,
        e: pb::ModelRequestEvent,
    ) -> Reply<pb::ModelRequestVerdict> {
        self.decide(
            ctx,
            pb::EventKind::ModelRequest,
            pb::hook_event::Payload::ModelRequest(e),
        )
        .await;
        Reply::new(pb::ModelRequestVerdict {
            action: proceed().map(pb::model_request_verdict::Action::Proceed),
        })
    }
    async fn model_response(
        &self,
        ctx: &Ctx,
        e: pb::ModelResponseEvent,
    ) -> Reply<pb::ModelResponseVerdict> {
        self.decide(
            ctx,
            pb::EventKind::ModelResponse,
            pb::hook_event::Payload::ModelResponse(e),
        )
        .await;
        Reply::new(pb::ModelResponseVerdict {
            action: proceed().map(pb::model_response_verdict::Action::Proceed),
        })
    }
    async fn tool_call(&self, ctx: &Ctx, e: pb::ToolCallEvent) -> Reply<pb::ToolCallVerdict> {
        self.decide(
            ctx,
            pb::EventKind::ToolCall,
            pb::hook_event::Payload::ToolCall(e),
        )
        .await;
        Reply::new(pb::ToolCallVerdict {
            action: proceed().map(pb::tool_call_verdict::Action::Proceed),
        })
    }
    async fn tool_result(&self, ctx: &Ctx, e: pb::ToolResultEvent) -> Reply<pb::ToolResultVerdict> {
        self.decide(
            ctx,
            pb::EventKind::ToolResult,
            pb::hook_event::Payload::ToolResult(e),
        )
        .await;
        Reply::new(pb::ToolResultVerdict {
            action: proceed().map(pb::tool_result_verdict::Action::Proceed),
        })
    }
    async fn turn_end(&self, ctx: &Ctx, e: pb::TurnEndEvent) -> Reply<pb::TurnEndVerdict> {
        self.decide(
            ctx,
            pb::EventKind::TurnEnd,
            pb::hook_event::Payload::TurnEnd(e),
        )
        .await;
        Reply::new(pb::TurnEndVerdict {
            action: proceed().map(pb::turn_end_verdict::Action::Proceed),
        })
    }
    async fn call_tool(
        &self,
        _: &Ctx,
        call: pb::ToolCall,
    ) -> Result<pb::CallToolResponse, tonic::Status> {
        Ok(pb::CallToolResponse {
            content: format!("sunny, 21 C ({})", call.arguments_json),
            is_error: false,
        })
    }
}

/// Holds every `run_start` verdict until released, so a run keeps its hook
/// stream open for as long as the memory figure needs it.
#[derive(Clone)]
pub struct Holding {
    pub held: Arc<AtomicU64>,
    release: watch::Receiver<bool>,
}

impl Holding {
    pub fn new() -> (Holding, watch::Sender<bool>) {
        let (tx, rx) = watch::channel(false);
        (
            Holding {
                held: Arc::default(),
                release: rx,
            },
            tx,
        )
    }
}

#[tonic::async_trait]
impl Hook for Holding {
    fn describe(&self) -> pb::DescribeResponse {
        hook_server::describe("holding", &[pb::EventKind::RunStart])
    }
    async fn run_start(&self, _: &Ctx, _: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
        self.held.fetch_add(1, Ordering::SeqCst);
        let mut release = self.release.clone();
        let _ = release.wait_for(|r| *r).await;
        self.held.fetch_sub(1, Ordering::SeqCst);
        Reply::new(pb::RunStartVerdict {
            action: proceed().map(pb::run_start_verdict::Action::Proceed),
        })
    }
}

/// A hook server running until dropped.
pub struct Running {
    pub addr: String,
    _stop: oneshot::Sender<()>,
}

pub async fn start<H: Hook>(hook: H) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let (stop, rx) = oneshot::channel::<()>();
    tokio::spawn(hook_server::serve(hook, listener, async {
        let _ = rx.await;
    }));
    Running { addr, _stop: stop }
}
