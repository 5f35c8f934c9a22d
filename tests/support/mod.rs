//! Shared test harness: a real hookwire server on port 0, real in-process
//! hook servers (built with `hookwire::hook_server`) on port 0, and client
//! helpers. No mocks: every call crosses a real gRPC connection.
#![allow(dead_code)]

pub mod auth;
pub mod certs;
pub mod fakellm;
pub mod fault;
pub mod go;
pub mod goaway;
pub mod jwt;
pub mod logwatch;
pub mod node;
pub mod postgres;
pub mod python;
pub mod raw;
pub mod replica;
pub mod script;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use hookwire::config::Config;
use hookwire::hook_server::{self, Ctx, Hook, Reply};
use hookwire::pb;
use hookwire::pb::agent_service_client::AgentServiceClient;
use tokio::sync::oneshot;
use tonic::transport::Channel;

pub struct TestServer {
    pub addr: String,
    shutdown: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<Result<(), hookwire::server::ServeError>>>,
}

impl TestServer {
    pub async fn start(yaml: &str) -> TestServer {
        let config = Config::parse(yaml, "test config").expect("test config is valid");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(hookwire::server::serve(listener, config, async {
            let _ = rx.await;
        }));
        TestServer {
            addr,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    pub async fn client(&self) -> AgentServiceClient<Channel> {
        // serve() binds before it describes hooks, so retry until it answers.
        for _ in 0..200 {
            if let Ok(c) = AgentServiceClient::connect(self.addr.clone()).await {
                let mut c = c;
                if c.list_sessions(pb::ListSessionsRequest::default())
                    .await
                    .is_ok()
                {
                    return c;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        panic!("hookwire at {} never answered", self.addr);
    }

    /// Like `start`, plus the admin HTTP port on 127.0.0.1:0 (returned).
    pub async fn start_with_admin(yaml: &str) -> (TestServer, std::net::SocketAddr) {
        let config = Config::parse(yaml, "test config").expect("test config is valid");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin_addr = admin.local_addr().unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(hookwire::server::serve_with_admin(
            listener,
            Some(admin),
            config,
            async {
                let _ = rx.await;
            },
        ));
        let server = TestServer {
            addr,
            shutdown: Some(tx),
            task: Some(task),
        };
        (server, admin_addr)
    }

    /// Like `start_with_admin`, with some configured models replaced by the
    /// given providers (by model name): e.g. one that panics on purpose.
    pub async fn start_with_models(
        yaml: &str,
        replace: Vec<(&str, Arc<dyn hookwire::model::ModelProvider>)>,
    ) -> (TestServer, std::net::SocketAddr) {
        let config = Config::parse(yaml, "test config").expect("test config is valid");
        let mut models = hookwire::server::build_models(&config).expect("models build");
        for (name, provider) in replace {
            models.insert(name.to_string(), provider);
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin_addr = admin.local_addr().unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(hookwire::server::serve_with_models(
            listener,
            Some(admin),
            config,
            models,
            async {
                let _ = rx.await;
            },
        ));
        let server = TestServer {
            addr,
            shutdown: Some(tx),
            task: Some(task),
        };
        (server, admin_addr)
    }

    /// A server started elsewhere (e.g. with an admin port).
    pub fn from_parts(
        addr: String,
        task: tokio::task::JoinHandle<Result<(), hookwire::server::ServeError>>,
    ) -> TestServer {
        TestServer {
            addr,
            shutdown: None,
            task: Some(task),
        }
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
    }
}

/// A plain HTTP/1.1 GET (the admin port); the whole response, headers
/// included, or empty when nothing listens.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

pub async fn session(c: &mut AgentServiceClient<Channel>, agent: &str) -> String {
    c.create_session(pb::CreateSessionRequest {
        agent: agent.into(),
        ..Default::default()
    })
    .await
    .expect("create session")
    .into_inner()
    .id
}

/// Streams a run to its end and returns every event.
pub async fn run_events(
    c: &mut AgentServiceClient<Channel>,
    session_id: &str,
    input: &str,
) -> Vec<pb::RunEvent> {
    let mut s = c
        .run(pb::RunRequest {
            session_id: session_id.into(),
            input: input.into(),
        })
        .await
        .expect("run accepted")
        .into_inner();
    let mut out = Vec::new();
    while let Some(ev) = s.message().await.expect("run stream") {
        out.push(ev);
    }
    out
}

pub fn result_of(events: &[pb::RunEvent]) -> pb::RunResult {
    match events.last().and_then(|e| e.event.clone()) {
        Some(pb::run_event::Event::Finished(f)) => f.result.unwrap(),
        other => panic!("last event is not finished: {other:?}"),
    }
}

pub async fn invoke(
    c: &mut AgentServiceClient<Channel>,
    session_id: &str,
    input: &str,
) -> pb::RunResult {
    c.invoke(pb::RunRequest {
        session_id: session_id.into(),
        input: input.into(),
    })
    .await
    .expect("invoke")
    .into_inner()
}

pub fn outcome(r: &pb::RunResult) -> pb::RunOutcome {
    pb::RunOutcome::try_from(r.outcome).unwrap()
}

pub fn texts(messages: &[pb::Message]) -> Vec<String> {
    messages
        .iter()
        .flat_map(|m| m.blocks.iter())
        .filter_map(|b| match &b.kind {
            Some(pb::block::Kind::Text(t)) => Some(t.text.clone()),
            Some(pb::block::Kind::ToolResult(r)) => Some(format!("result:{}", r.content)),
            Some(pb::block::Kind::ToolCall(c)) => {
                Some(format!("call:{}({})", c.name, c.arguments_json))
            }
            _ => None,
        })
        .collect()
}

pub fn verdicts(events: &[pb::RunEvent]) -> Vec<pb::HookVerdictApplied> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(pb::run_event::Event::HookVerdict(v)) => Some(v.clone()),
            _ => None,
        })
        .collect()
}

// ------------------------------------------------------------ test hooks

type Fut<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Handler<E, V> = Arc<dyn Fn(Ctx, E) -> Fut<Reply<V>> + Send + Sync>;
type ObserveFn = Arc<dyn Fn(Ctx, pb::HookEvent) -> Fut<()> + Send + Sync>;
type ToolFn = Arc<
    dyn Fn(Ctx, pb::ToolCall) -> Fut<Result<pb::CallToolResponse, tonic::Status>> + Send + Sync,
>;

/// A hook whose behaviour per event is a closure; every event it receives
/// is recorded (kind name, and the full event). Blocking events are rebuilt
/// from what the handler gets (seq 0, expects_verdict true); to read seqs
/// and streams as sent, use `script::ScriptHook`.
#[derive(Clone, Default)]
pub struct FnHook {
    name: String,
    events: Vec<pb::EventKind>,
    tools: Vec<pb::ToolSpec>,
    pub seen: Arc<Mutex<Vec<pb::HookEvent>>>,
    /// Signalled after each event is recorded in `seen`.
    arrived: Arc<tokio::sync::Notify>,
    pub tool_calls: Arc<Mutex<Vec<pb::ToolCall>>>,
    run_start: Option<Handler<pb::RunStartEvent, pb::RunStartVerdict>>,
    session_start: Option<Handler<pb::SessionStartEvent, pb::SessionStartVerdict>>,
    model_request: Option<Handler<pb::ModelRequestEvent, pb::ModelRequestVerdict>>,
    model_response: Option<Handler<pb::ModelResponseEvent, pb::ModelResponseVerdict>>,
    invalid_tool_call: Option<Handler<pb::InvalidToolCallEvent, pb::InvalidToolCallVerdict>>,
    tool_call: Option<Handler<pb::ToolCallEvent, pb::ToolCallVerdict>>,
    tool_result: Option<Handler<pb::ToolResultEvent, pb::ToolResultVerdict>>,
    turn_end: Option<Handler<pb::TurnEndEvent, pb::TurnEndVerdict>>,
    observe: Option<ObserveFn>,
    tool: Option<ToolFn>,
}

macro_rules! on {
    ($fn:ident, $field:ident, $ev:ty, $v:ty) => {
        pub fn $fn<F, R>(mut self, f: F) -> Self
        where
            F: Fn(Ctx, $ev) -> R + Send + Sync + 'static,
            R: Future<Output = Reply<$v>> + Send + 'static,
        {
            self.$field = Some(Arc::new(move |c, e| Box::pin(f(c, e))));
            self
        }
    };
}

impl FnHook {
    pub fn new(name: &str, events: &[pb::EventKind]) -> FnHook {
        FnHook {
            name: name.into(),
            events: events.to_vec(),
            ..Default::default()
        }
    }

    on!(
        on_run_start,
        run_start,
        pb::RunStartEvent,
        pb::RunStartVerdict
    );
    on!(
        on_session_start,
        session_start,
        pb::SessionStartEvent,
        pb::SessionStartVerdict
    );
    on!(
        on_model_request,
        model_request,
        pb::ModelRequestEvent,
        pb::ModelRequestVerdict
    );
    on!(
        on_model_response,
        model_response,
        pb::ModelResponseEvent,
        pb::ModelResponseVerdict
    );
    on!(
        on_invalid_tool_call,
        invalid_tool_call,
        pb::InvalidToolCallEvent,
        pb::InvalidToolCallVerdict
    );
    on!(
        on_tool_call,
        tool_call,
        pb::ToolCallEvent,
        pb::ToolCallVerdict
    );
    on!(
        on_tool_result,
        tool_result,
        pb::ToolResultEvent,
        pb::ToolResultVerdict
    );
    on!(on_turn_end, turn_end, pb::TurnEndEvent, pb::TurnEndVerdict);

    /// What to do with events that expect no verdict, after recording them.
    pub fn on_observe<F, R>(mut self, f: F) -> Self
    where
        F: Fn(Ctx, pb::HookEvent) -> R + Send + Sync + 'static,
        R: Future<Output = ()> + Send + 'static,
    {
        self.observe = Some(Arc::new(move |c, e| Box::pin(f(c, e))));
        self
    }

    /// Declares a tool and how to execute it.
    pub fn with_tool<F, R>(self, spec: pb::ToolSpec, f: F) -> Self
    where
        F: Fn(Ctx, pb::ToolCall) -> R + Send + Sync + 'static,
        R: Future<Output = pb::CallToolResponse> + Send + 'static,
    {
        let f = Arc::new(f);
        self.with_fallible_tool(spec, move |c, e| {
            let f = f.clone();
            async move { Ok(f(c, e).await) }
        })
    }

    /// Declares a tool whose execution may answer a gRPC error status.
    pub fn with_fallible_tool<F, R>(mut self, spec: pb::ToolSpec, f: F) -> Self
    where
        F: Fn(Ctx, pb::ToolCall) -> R + Send + Sync + 'static,
        R: Future<Output = Result<pb::CallToolResponse, tonic::Status>> + Send + 'static,
    {
        self.tools.push(spec);
        self.tool = Some(Arc::new(move |c, e| Box::pin(f(c, e))));
        self
    }

    /// The invalid_tool_call events received, in order.
    pub fn invalid_tool_calls(&self) -> Vec<pb::InvalidToolCallEvent> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match &e.payload {
                Some(pb::hook_event::Payload::InvalidToolCall(i)) => Some(i.clone()),
                _ => None,
            })
            .collect()
    }

    /// Names of the events received, in order.
    pub fn seen_kinds(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|e| {
                pb::EventKind::try_from(e.kind)
                    .unwrap()
                    .as_str_name()
                    .trim_start_matches("EVENT_KIND_")
                    .to_lowercase()
            })
            .collect()
    }

    /// Waits until an event of `kind` (snake_case name) has been received.
    #[allow(dead_code)] // not every test binary waits
    pub async fn wait_for(&self, kind: &str) {
        loop {
            let arrived = self.arrived.notified();
            if self.seen_kinds().iter().any(|k| k == kind) {
                return;
            }
            arrived.await;
        }
    }

    /// Waits until `n` events of `kind` (snake_case name) were received.
    #[allow(dead_code)]
    pub async fn wait_for_count(&self, kind: &str, n: usize) {
        loop {
            let arrived = self.arrived.notified();
            if self.seen_kinds().iter().filter(|k| *k == kind).count() >= n {
                return;
            }
            arrived.await;
        }
    }

    fn push(&self, ev: pb::HookEvent) {
        self.seen.lock().unwrap().push(ev);
        self.arrived.notify_waiters();
    }

    fn record(&self, ctx: &Ctx, kind: pb::EventKind, payload: pb::hook_event::Payload) {
        self.push(pb::HookEvent {
            seq: 0,
            kind: kind as i32,
            context: Some(ctx.clone()),
            expects_verdict: true,
            payload: Some(payload),
        });
    }

    pub async fn start(self) -> TestHook {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.start_on(listener)
    }

    /// Serves on `listener` (e.g. a fixed port, to restart a hook server at
    /// the same address).
    pub fn start_on(self, listener: tokio::net::TcpListener) -> TestHook {
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let handle = self.clone();
        let task = tokio::spawn(async move {
            let _ = hook_server::serve(handle, listener, async {
                let _ = rx.await;
            })
            .await;
        });
        TestHook {
            addr,
            hook: self,
            shutdown: Some(tx),
            task,
        }
    }
}

macro_rules! dispatch {
    ($self:ident, $ctx:ident, $ev:ident, $field:ident, $kind:ident, $variant:ident, $default:expr) => {{
        $self.record(
            $ctx,
            pb::EventKind::$kind,
            pb::hook_event::Payload::$variant($ev.clone()),
        );
        match &$self.$field {
            Some(f) => f($ctx.clone(), $ev).await,
            None => $default,
        }
    }};
}

fn cont<V: Default>() -> V {
    V::default()
}

#[tonic::async_trait]
impl Hook for FnHook {
    fn describe(&self) -> pb::DescribeResponse {
        let mut d = hook_server::describe(&self.name, &self.events);
        d.tools = self.tools.clone();
        d
    }
    async fn session_start(
        &self,
        ctx: &Ctx,
        ev: pb::SessionStartEvent,
    ) -> Reply<pb::SessionStartVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            session_start,
            SessionStart,
            SessionStart,
            Reply::new(pb::SessionStartVerdict {
                action: Some(pb::session_start_verdict::Action::Proceed(pb::Continue {}))
            })
        )
    }
    async fn run_start(&self, ctx: &Ctx, ev: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            run_start,
            RunStart,
            RunStart,
            Reply::new(pb::RunStartVerdict {
                action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {}))
            })
        )
    }
    async fn model_request(
        &self,
        ctx: &Ctx,
        ev: pb::ModelRequestEvent,
    ) -> Reply<pb::ModelRequestVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            model_request,
            ModelRequest,
            ModelRequest,
            Reply::new(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {}))
            })
        )
    }
    async fn model_response(
        &self,
        ctx: &Ctx,
        ev: pb::ModelResponseEvent,
    ) -> Reply<pb::ModelResponseVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            model_response,
            ModelResponse,
            ModelResponse,
            Reply::new(pb::ModelResponseVerdict {
                action: Some(pb::model_response_verdict::Action::Proceed(pb::Continue {}))
            })
        )
    }
    async fn invalid_tool_call(
        &self,
        ctx: &Ctx,
        ev: pb::InvalidToolCallEvent,
    ) -> Reply<pb::InvalidToolCallVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            invalid_tool_call,
            InvalidToolCall,
            InvalidToolCall,
            Reply::new(pb::InvalidToolCallVerdict {
                action: Some(pb::invalid_tool_call_verdict::Action::Proceed(
                    pb::Continue {}
                ))
            })
        )
    }
    async fn tool_call(&self, ctx: &Ctx, ev: pb::ToolCallEvent) -> Reply<pb::ToolCallVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            tool_call,
            ToolCall,
            ToolCall,
            Reply::new(pb::ToolCallVerdict {
                action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {}))
            })
        )
    }
    async fn tool_result(
        &self,
        ctx: &Ctx,
        ev: pb::ToolResultEvent,
    ) -> Reply<pb::ToolResultVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            tool_result,
            ToolResult,
            ToolResult,
            Reply::new(pb::ToolResultVerdict {
                action: Some(pb::tool_result_verdict::Action::Proceed(pb::Continue {}))
            })
        )
    }
    async fn turn_end(&self, ctx: &Ctx, ev: pb::TurnEndEvent) -> Reply<pb::TurnEndVerdict> {
        dispatch!(
            self,
            ctx,
            ev,
            turn_end,
            TurnEnd,
            TurnEnd,
            Reply::new(pb::TurnEndVerdict {
                action: Some(pb::turn_end_verdict::Action::Proceed(pb::Continue {}))
            })
        )
    }
    async fn observe(&self, ctx: &Ctx, ev: pb::HookEvent) {
        self.push(ev.clone());
        if let Some(f) = &self.observe {
            f(ctx.clone(), ev).await;
        }
    }
    async fn call_tool(
        &self,
        ctx: &Ctx,
        call: pb::ToolCall,
    ) -> Result<pb::CallToolResponse, tonic::Status> {
        self.tool_calls.lock().unwrap().push(call.clone());
        match &self.tool {
            Some(f) => f(ctx.clone(), call).await,
            None => Err(tonic::Status::unimplemented("no tool")),
        }
    }
}

pub struct TestHook {
    pub addr: String,
    pub hook: FnHook,
    shutdown: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<()>,
}

impl TestHook {
    /// Shuts the server down gracefully and waits until it has stopped:
    /// its listener is closed and its connections are gone.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let task = std::mem::replace(&mut self.task, tokio::spawn(async {}));
        let _ = task.await;
    }
}

impl Drop for TestHook {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.abort();
    }
}

/// The `city` argument of a get_weather call.
#[allow(dead_code)]
pub fn city(call: &pb::ToolCall) -> String {
    let v: serde_json::Value = serde_json::from_str(&call.arguments_json).unwrap();
    v["city"].as_str().unwrap_or("?").to_string()
}

/// A hook server named `owner` that owns get_weather: "sunny in CITY".
#[allow(dead_code)]
pub fn weather_owner() -> FnHook {
    FnHook::new("owner", &[]).with_tool(weather_tool(), |_, call| async move {
        pb::CallToolResponse {
            content: format!("sunny in {}", city(&call)),
            is_error: false,
        }
    })
}

/// A hook named `asker` that answers every tool_call with `ask(question)`
/// (`timeout_ms` 0: the agent's approval_timeout).
#[allow(dead_code)]
pub fn asker(question: &'static str, timeout_ms: u64) -> FnHook {
    FnHook::new("asker", &[pb::EventKind::ToolCall]).on_tool_call(move |_, _| async move {
        Reply::new(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::Ask(pb::Ask {
                question: question.into(),
                timeout_ms,
            })),
        })
    })
}

/// What a hook that routes its question to someone elsewhere (a chat-ops
/// bot, a ticket) learns from the `tool_call` event it asks on: the run and
/// the call that person answers for with ResolveApproval, and the caller.
#[derive(Clone, Debug)]
pub struct Routed {
    pub run_id: String,
    pub call_id: String,
    /// `EventContext.streaming`: false under Invoke.
    pub streaming: bool,
    pub principal: String,
}

impl Routed {
    fn of(ctx: &Ctx, ev: pb::ToolCallEvent) -> Routed {
        Routed {
            run_id: ctx.run_id.clone(),
            call_id: ev.call.map(|c| c.id).unwrap_or_default(),
            streaming: ctx.streaming,
            principal: ctx.principal.clone(),
        }
    }
}

/// Like [`asker`], publishing every question it asks on the channel
/// returned (what a hook sends its approval bot), before it answers `ask`.
#[allow(dead_code)]
pub fn routing_asker(
    question: &'static str,
    timeout_ms: u64,
) -> (FnHook, tokio::sync::mpsc::UnboundedReceiver<Routed>) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let hook = FnHook::new("asker", &[pb::EventKind::ToolCall]).on_tool_call(move |ctx, ev| {
        let _ = tx.send(Routed::of(&ctx, ev));
        async move {
            Reply::new(pb::ToolCallVerdict {
                action: Some(pb::tool_call_verdict::Action::Ask(pb::Ask {
                    question: question.into(),
                    timeout_ms,
                })),
            })
        }
    });
    (hook, rx)
}

/// Like [`routing_asker`], holding each `ask` verdict until the returned
/// semaphore gives a permit: its approver can answer before hookwire has
/// the question.
#[allow(dead_code)]
pub fn gated_asker(
    question: &'static str,
) -> (
    FnHook,
    tokio::sync::mpsc::UnboundedReceiver<Routed>,
    Arc<tokio::sync::Semaphore>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = gate.clone();
    let hook = FnHook::new("asker", &[pb::EventKind::ToolCall]).on_tool_call(move |ctx, ev| {
        let _ = tx.send(Routed::of(&ctx, ev));
        let held = held.clone();
        async move {
            held.acquire().await.expect("the gate stays open").forget();
            Reply::new(pb::ToolCallVerdict {
                action: Some(pb::tool_call_verdict::Action::Ask(pb::Ask {
                    question: question.into(),
                    timeout_ms: 0,
                })),
            })
        }
    });
    (hook, rx, gate)
}

/// Waits until the admin endpoint's metrics hold `line` (a series and its
/// value), for up to 20 s.
#[allow(dead_code)]
pub async fn until_metric(admin: std::net::SocketAddr, line: &str) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let metrics = http_get(admin, "/metrics").await;
        if metrics.lines().any(|l| l == line) {
            return;
        }
        assert!(
            std::time::Instant::now() < until,
            "{line} never appeared in\n{metrics}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Answers the approval `asked` is about, as an approval bot does: the hook
/// published the question before hookwire received its `ask` (and recorded
/// the request); an answer that arrives first waits for it, for up to 5 s,
/// and one NOT_FOUND after that is sent again, for up to 10 s. Any other
/// refusal panics.
#[allow(dead_code)]
pub async fn resolve_once_pending<T>(
    c: &mut AgentServiceClient<T>,
    asked: &Routed,
    approve: bool,
    note: &str,
) where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let answered = c
            .resolve_approval(pb::ResolveApprovalRequest {
                run_id: asked.run_id.clone(),
                call_id: asked.call_id.clone(),
                approve,
                note: note.into(),
            })
            .await;
        match answered {
            Ok(_) => return,
            Err(e) if e.code() == tonic::Code::NotFound && std::time::Instant::now() < until => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("ResolveApproval for {asked:?}: {e:?}"),
        }
    }
}

/// Runs `cmd` to completion: whether it succeeded, and stdout then stderr.
#[allow(dead_code)]
pub async fn command_output(cmd: &mut tokio::process::Command) -> (bool, String) {
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
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

/// Scripted model rules shared by the suites.
pub const SCRIPTED_RULES: &str = r#"
      - when: { last_user_contains: "mixed calls" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } }, { name: get_weather, arguments: { town: "Oslo" } } ]
      - when: { last_user_contains: "three tools" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } }, { name: get_weather, arguments: { city: "Oslo" } }, { name: get_weather, arguments: { city: "Rome" } } ]
      - when: { last_user_contains: "bad args with text" }
        text: "Let me check the weather."
        tool_calls: [ { name: get_weather, arguments: { town: "Paris" } } ]
      - when: { last_user_contains: "bad args" }
        tool_calls: [ { name: get_weather, arguments: { town: "Paris" } } ]
      - when: { last_user_contains: "look up the weather" }
        text: "Let me look it up."
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } } ]
      - when: { last_user_contains: "use city" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } } ]
      - when: { last_user_contains: "weather" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } } ]
      - when: { last_user_contains: "two tools" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } }, { name: get_weather, arguments: { city: "Oslo" } } ]
      - when: { last_user_contains: "bogus" }
        tool_calls: [ { name: no_such_tool, arguments: {} } ]
      - when: { last_tool_result_contains: "" }
        text: "Tool said: {{last_tool_result}}"
      - text: "sys={{system}} temp={{temperature}} user={{last_user}}"
"#;

/// A config with one scripted agent `a` using `hooks` (name, endpoint, extra
/// YAML lines for the hook).
pub fn config(hooks: &[(&str, &str, &str)], agent_extra: &str) -> String {
    let mut y = format!(
        "models:\n  - name: m\n    provider: scripted\n    rules:{SCRIPTED_RULES}\nhooks:\n"
    );
    if hooks.is_empty() {
        y = y.replace("hooks:\n", "hooks: []\n");
    }
    for (name, endpoint, extra) in hooks {
        y.push_str(&format!("  - name: {name}\n    endpoint: {endpoint}\n"));
        for line in extra.lines().filter(|l| !l.trim().is_empty()) {
            y.push_str(&format!("    {}\n", line.trim()));
        }
    }
    let names: Vec<&str> = hooks.iter().map(|h| h.0).collect();
    y.push_str(&format!(
        "agents:\n  - name: a\n    model: m\n    system_prompt: base\n    hooks: [{}]\n",
        names.join(", ")
    ));
    for line in agent_extra.lines().filter(|l| !l.trim().is_empty()) {
        y.push_str(&format!("    {}\n", line.trim()));
    }
    y
}

/// An engine on `yaml` with the memory store, its hooks described and
/// started: a replica without its gRPC server.
#[allow(dead_code)]
pub async fn memory_engine(yaml: &str) -> Arc<hookwire::engine::Engine> {
    let config = Config::parse(yaml, "test config").expect("valid config");
    let models = hookwire::server::build_models(&config).unwrap();
    let inst = hookwire::telemetry::Instruments::new(&config.telemetry);
    let store = Arc::new(hookwire::store::MemoryStore::new(Default::default()));
    let e = Arc::new(hookwire::engine::Engine::new(config, models, inst, store).unwrap());
    e.registry()
        .describe_all(std::time::Duration::from_secs(5))
        .await;
    e.registry().start();
    e
}

/// A run whose `Run` client reads nothing, on an engine whose client queue
/// holds 16 events: its answer's ~30 deltas are held for a blocking
/// turn_end hook, so they go with the run's last events, after its end is
/// recorded. Returned once it is (the session free), the queue full.
#[allow(dead_code)]
pub struct UnreadEnd {
    pub engine: Arc<hookwire::engine::Engine>,
    pub session_id: String,
    pub run: hookwire::engine::RunHandle,
    _accept: TestHook,
}

#[allow(dead_code)]
impl UnreadEnd {
    pub async fn start() -> UnreadEnd {
        use hookwire::auth::Principal;
        let accept = FnHook::new("accept", &[pb::EventKind::TurnEnd])
            .start()
            .await;
        let e = memory_engine(&format!(
            "{}server:\n  run_event_buffer: 16\n  client_stall_timeout: 60s\n",
            config(&[("accept", &accept.addr, "")], "")
        ))
        .await;
        let s = e
            .create_session(&Principal::anonymous(), "a", vec![], Default::default())
            .await
            .unwrap();
        // ~30 deltas of 12 characters, held until turn_end accepts them.
        let run = e
            .start_run(
                &Principal::anonymous(),
                &s.id,
                "y".repeat(360),
                true,
                Default::default(),
                None,
            )
            .await
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(20), async {
            while e
                .store()
                .get_session(&s.id)
                .await
                .unwrap()
                .active_run
                .is_some()
            {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the run's end is recorded while its client reads nothing");
        assert_eq!(
            run.events.len(),
            16,
            "the client read nothing: its queue is full"
        );
        UnreadEnd {
            engine: e,
            session_id: s.id,
            run,
            _accept: accept,
        }
    }
}
