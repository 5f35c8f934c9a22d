//! hookwire under test: the real `serve_with_admin` on port 0 in this
//! process, its config, a client over loopback, and `/metrics` scrapes.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hookwire::config::Config;
use hookwire::pb;
use hookwire::pb::agent_service_client::AgentServiceClient;
use tokio::sync::oneshot;
use tonic::transport::{Channel, Endpoint};

/// What a run asks the scripted model for.
pub mod input {
    /// One turn, text only: run_start, model_request, model_response,
    /// turn_end.
    pub const CHAT: &str = "hello there";
    /// Two turns with three tool calls: the shape of a small agent step.
    pub const TOOLS: &str = "weather in three cities";
    /// Calls a tool nobody offers until `max_turns` (10) ends the run.
    pub const LOOP: &str = "loop forever";
}

pub const RULES: &str = r#"
      - when: { last_user_contains: "weather" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } }, { name: get_weather, arguments: { city: "Oslo" } }, { name: get_weather, arguments: { city: "Rome" } } ]
      - when: { last_user_contains: "loop" }
        tool_calls: [ { name: no_such_tool, arguments: {} } ]
      - when: { last_tool_result_contains: "unknown tool" }
        tool_calls: [ { name: no_such_tool, arguments: {} } ]
      - when: { last_tool_result_contains: "" }
        text: "Tool said: {{last_tool_result}}"
      - text: "You said: {{last_user}}"
"#;

/// A config under construction: hooks and agents appended by the figures.
pub struct Yaml {
    hooks: String,
    agents: String,
}

impl Yaml {
    pub fn new() -> Yaml {
        Yaml {
            hooks: String::new(),
            agents: String::new(),
        }
    }

    pub fn hook(&mut self, name: &str, endpoint: &str, events: &[&str]) -> &mut Self {
        self.hooks
            .push_str(&format!("  - name: {name}\n    endpoint: {endpoint}\n"));
        if !events.is_empty() {
            self.hooks
                .push_str(&format!("    events: [{}]\n", events.join(", ")));
        }
        self
    }

    /// An agent offering `get_weather`, with `hooks` in firing order.
    pub fn agent(&mut self, name: &str, hooks: &[String], max_turns: u32) -> &mut Self {
        self.agents.push_str(&format!(
            "  - name: {name}\n    model: m\n    system_prompt: \"You are a helpful assistant.\"\n    hooks: [{}]\n    tools: [get_weather]\n    max_turns: {max_turns}\n",
            hooks.join(", ")
        ));
        self
    }

    pub fn build(&self) -> String {
        let hooks = if self.hooks.is_empty() {
            "hooks: []\n".to_string()
        } else {
            format!("hooks:\n{}", self.hooks)
        };
        format!(
            "models:\n  - name: m\n    provider: scripted\n    rules:{RULES}{hooks}agents:\n{}",
            self.agents
        )
    }
}

/// Runs until dropped (dropping the sender is the shutdown signal).
pub struct Service {
    pub addr: String,
    pub admin: SocketAddr,
    _stop: oneshot::Sender<()>,
}

impl Service {
    pub async fn start(yaml: &str) -> Service {
        let config = Config::parse(yaml, "bench config").expect("bench config is valid");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin = admin_listener.local_addr().unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (stop, rx) = oneshot::channel::<()>();
        tokio::spawn(hookwire::server::serve_with_admin(
            listener,
            Some(admin_listener),
            config,
            async {
                let _ = rx.await;
            },
        ));
        Service {
            addr,
            admin,
            _stop: stop,
        }
    }

    /// A client on its own connection, once the service answers.
    pub async fn client(&self) -> AgentServiceClient<Channel> {
        client(&self.addr).await
    }
}

/// Connects like a production client would (TCP_NODELAY, HTTP/2), retrying
/// while the server is still describing its hooks.
pub async fn client(addr: &str) -> AgentServiceClient<Channel> {
    let endpoint = Endpoint::from_shared(addr.to_string())
        .unwrap()
        .tcp_nodelay(true);
    for _ in 0..400 {
        if let Ok(ch) = endpoint.connect().await {
            let mut c = AgentServiceClient::new(ch);
            if c.list_hooks(pb::ListHooksRequest {}).await.is_ok() {
                return c;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("hookwire at {addr} never answered");
}

/// `n` fresh sessions of `agent`, created concurrently before a timed batch
/// (a fresh session keeps every run's history, and so its events, the same
/// size).
pub async fn sessions(c: &AgentServiceClient<Channel>, agent: &str, n: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(64) {
        let calls = chunk.iter().map(|_| {
            let mut c = c.clone();
            async move {
                c.create_session(pb::CreateSessionRequest {
                    agent: agent.into(),
                    ..Default::default()
                })
                .await
                .expect("create session")
                .into_inner()
                .id
            }
        });
        out.extend(futures::future::join_all(calls).await);
    }
    out
}

/// One run through `Invoke` under a load that may refuse it: a gRPC error
/// (a store that could not record the run's start answers `UNAVAILABLE`)
/// is a run that did not complete, with the status's message as its
/// reason, so the figure reports it rather than ending `make bench`.
pub async fn invoke_under_load(
    c: &mut AgentServiceClient<Channel>,
    session: &str,
    input: &str,
) -> (Duration, pb::RunResult) {
    let (t, r) = timed_invoke(c, session, input).await;
    let r = r.unwrap_or_else(|status| pb::RunResult {
        outcome: pb::RunOutcome::Failed as i32,
        reason: format!("{:?}: {}", status.code(), status.message()),
        ..Default::default()
    });
    (t, r)
}

/// One run through `Invoke`, timed at the client.
pub async fn invoke(
    c: &mut AgentServiceClient<Channel>,
    session: &str,
    input: &str,
) -> (Duration, pb::RunResult) {
    let (t, r) = timed_invoke(c, session, input).await;
    (t, r.expect("invoke"))
}

async fn timed_invoke(
    c: &mut AgentServiceClient<Channel>,
    session: &str,
    input: &str,
) -> (Duration, Result<pb::RunResult, tonic::Status>) {
    let t = Instant::now();
    let r = c
        .invoke(pb::RunRequest {
            session_id: session.into(),
            input: input.into(),
        })
        .await
        .map(tonic::Response::into_inner);
    (t.elapsed(), r)
}

pub fn assert_completed(r: &pb::RunResult, what: &str) {
    let outcome = pb::RunOutcome::try_from(r.outcome).unwrap_or(pb::RunOutcome::Unspecified);
    assert!(completed(r), "{what}: run ended {outcome:?}: {}", r.reason);
}

/// Whether the run ended as a bench run should (completed, or at its turn
/// limit).
pub fn completed(r: &pb::RunResult) -> bool {
    matches!(
        pb::RunOutcome::try_from(r.outcome),
        Ok(pb::RunOutcome::Completed | pb::RunOutcome::MaxTurns)
    )
}

/// The admin port's `/metrics` text.
pub async fn metrics(admin: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(admin).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// Sum of every sample of `name` whose labels contain all of `labels`
/// (each written as `key="value"`).
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name && labels.iter().all(|want| rest.contains(want)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}
