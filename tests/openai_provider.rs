//! The `openai` provider end to end: against fakellm (a third-party
//! OpenAI-compatible server, PyPI `fakellm`, run as a real process on a free
//! port) for streaming, tool calls and request mapping, and against a tiny
//! HTTP/1.1 server written here for the faults fakellm cannot produce while
//! streaming (status errors, Retry-After, broken and malformed streams,
//! cancellation).
//!
//! fakellm is required, not optional: `make deps` installs it.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use hookwire::config::{Config, ModelConfig};
use hookwire::message::{Message, ToolResult, ToolSpec};
use hookwire::model::openai::OpenAiModel;
use hookwire::model::{ModelError, ModelProvider, ModelRequest, ModelResponse, ToolChoice};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::fakellm::{self, FakeLlm};

const API_KEY_VAR: &str = "HOOKWIRE_IT_OPENAI_KEY";
const API_KEY: &str = "sk-fake-123";

/// The `models:` entry `m` of a config with the given extra YAML fields.
fn model_config(base_url: &str, extra: &str) -> ModelConfig {
    let yaml = format!(
        "models:\n  - name: m\n    provider: openai\n    base_url: '{base_url}'\n    model: gpt-4o-mini\n{extra}agents: [{{name: a, model: m}}]\n"
    );
    let cfg = Config::parse(&yaml, "test").unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    cfg.model("m").unwrap().clone()
}

fn set_api_key() {
    static ONCE: Once = Once::new();
    // Set once, before any model reads it; the name is unique to this suite.
    ONCE.call_once(|| std::env::set_var(API_KEY_VAR, API_KEY));
}

fn weather_tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            description: "Current weather for a city".into(),
            parameters_json_schema:
                r#"{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}"#
                    .into(),
        },
        ToolSpec {
            name: "get_time".into(),
            description: "Local time".into(),
            parameters_json_schema: String::new(),
        },
    ]
}

/// Runs one call, collecting the text deltas.
async fn complete(
    model: &OpenAiModel,
    request: &ModelRequest,
) -> (Result<ModelResponse, ModelError>, Vec<String>) {
    let deltas = Mutex::new(Vec::new());
    let sink = |t: &str| deltas.lock().unwrap().push(t.to_string());
    let result = model.complete(request, &sink).await;
    (result, deltas.into_inner().unwrap())
}

#[tokio::test]
async fn streams_text_from_fakellm() {
    let server = FakeLlm::start(
        r#"
rules:
  - name: greeting
    when: {messages_contain: "hello"}
    respond: {content: "Hi there, this answer arrives word by word."}
"#,
    );
    let model = OpenAiModel::from_config(&model_config(&server.base_url(), "")).unwrap();
    let request = ModelRequest {
        history: vec![Message::user("hello!")].into(),
        ..Default::default()
    };
    let (r, deltas) = complete(&model, &request).await;
    let r = r.unwrap();
    assert_eq!(
        r.message(),
        Message::assistant_text("Hi there, this answer arrives word by word.")
    );
    assert!(deltas.len() > 3, "streamed in pieces: {deltas:?}");
    assert_eq!(
        deltas.concat(),
        "Hi there, this answer arrives word by word."
    );
    assert_eq!(r.finish_reason, "stop");
    assert_eq!(r.model, "gpt-4o-mini");
    // fakellm sends no usage chunk: estimated, and marked so.
    assert!(r.usage.estimated);
    assert!(r.usage.input_tokens > 0 && r.usage.output_tokens > 0);
}

#[tokio::test]
async fn multiple_tool_calls_then_an_answer_from_the_results() {
    let server = FakeLlm::start(
        r#"
rules:
  - name: answer
    when: {tool_result_contains: "sunny"}
    respond: {content: "It is sunny in Paris and 14:00 there."}
  - name: call_tools
    when: {messages_contain: "weather", tools_include: get_weather}
    respond:
      tool_calls:
        - {name: get_weather, arguments: {city: Paris}}
        - {name: get_time, arguments: {tz: Europe/Paris}}
"#,
    );
    let model = OpenAiModel::from_config(&model_config(&server.base_url(), "")).unwrap();
    let mut request = ModelRequest {
        system_prompt: "You are a travel assistant.".into(),
        history: vec![Message::user("What's the weather and time in Paris?")].into(),
        tools: weather_tools(),
        ..Default::default()
    };

    let (r, deltas) = complete(&model, &request).await;
    let r = r.unwrap();
    assert!(deltas.is_empty(), "tool calls are not text: {deltas:?}");
    assert_eq!(r.finish_reason, "tool_calls");
    let msg = r.message();
    let calls: Vec<_> = msg.tool_calls().cloned().collect();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].name, "get_weather");
    assert_eq!(
        serde_json::from_str::<Value>(&calls[0].arguments_json).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(calls[1].name, "get_time");
    assert_eq!(
        serde_json::from_str::<Value>(&calls[1].arguments_json).unwrap(),
        json!({"tz": "Europe/Paris"})
    );
    assert!(!calls[0].id.is_empty() && calls[0].id != calls[1].id);

    // The agent runs the tools and sends the results back.
    request.history.push(msg);
    request.history.push(Message::tool_results(vec![
        ToolResult {
            call_id: calls[0].id.clone(),
            name: "get_weather".into(),
            content: "sunny, 21C".into(),
            is_error: false,
        },
        ToolResult {
            call_id: calls[1].id.clone(),
            name: "get_time".into(),
            content: "14:00".into(),
            is_error: false,
        },
    ]));
    let (r, deltas) = complete(&model, &request).await;
    let r = r.unwrap();
    assert_eq!(r.message().text(), "It is sunny in Paris and 14:00 there.");
    assert_eq!(deltas.concat(), "It is sunny in Paris and 14:00 there.");
    assert_eq!(r.finish_reason, "stop");
    assert_eq!(
        server.rule_hits().await,
        json!({"call_tools": 1, "answer": 1})
    );
}

#[tokio::test]
async fn every_request_field_reaches_fakellm() {
    set_api_key();
    // Headers are matched by a fakellm rule; the body is checked whole: the
    // rule answers with fakellm's echo, a hash of the body it received.
    let server = FakeLlm::start(
        r#"
rules:
  - name: all_fields
    when:
      header.authorization: "Bearer sk-fake-123"
      header.openai-organization: org-hookwire
      header.x-team: blue
      model_matches: "gpt-4o-*"
      messages_contain: "answer in french"
      tools_include: get_weather
    respond: {}
  - name: fallback
    respond: {content: "NO MATCH"}
"#,
    );
    let cfg = model_config(
        &server.base_url(),
        &format!(
            "    api_key_env: {API_KEY_VAR}\n    organization: org-hookwire\n    headers: {{x-team: blue}}\n    temperature: 0.5\n    max_tokens: 300\n"
        ),
    );
    let model = OpenAiModel::from_config(&cfg).unwrap();
    let mut request = ModelRequest {
        model: "ignored".into(),
        system_prompt: "Answer in French.".into(),
        extra_context: vec!["Context: doc 42.".into()],
        history: vec![Message::user("Quel temps fait-il ?")].into(),
        tools: weather_tools(),
        temperature: Some(0.25),
        max_tokens: Some(64),
        tool_choice: ToolChoice::Tool("get_weather".into()),
        additional_params: json!({"seed": 7, "user": "run-1"})
            .as_object()
            .unwrap()
            .clone(),
    };
    let tools = json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "Local time", "parameters": {"type": "object"}}},
    ]);
    let messages = json!([
        {"role": "system", "content": "Answer in French.\n\nContext: doc 42."},
        {"role": "user", "content": "Quel temps fait-il ?"},
    ]);
    let expected = json!({
        "model": "gpt-4o-mini",
        "messages": messages,
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0.25,
        "max_tokens": 64,
        "seed": 7,
        "user": "run-1",
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (r, _) = complete(&model, &request).await;
    let text = r.unwrap().message().text();
    assert_eq!(
        server.rule_hits().await,
        json!({"all_fields": 1}),
        "headers or body did not match"
    );
    assert_eq!(
        text,
        fakellm::echo(&expected),
        "fakellm received a different body than:\n{expected:#}"
    );

    // Unset temperature / max_tokens fall back to the config's defaults.
    request.temperature = None;
    request.max_tokens = None;
    request.tool_choice = ToolChoice::Required;
    request.additional_params.clear();
    let expected = json!({
        "model": "gpt-4o-mini",
        "messages": messages,
        "tools": tools,
        "tool_choice": "required",
        "temperature": 0.5,
        "max_tokens": 300,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (r, _) = complete(&model, &request).await;
    assert_eq!(
        r.unwrap().message().text(),
        fakellm::echo(&expected),
        "expected:\n{expected:#}"
    );
}

// ----------------------------------------------------- local fault server

#[derive(Debug, Clone)]
struct Captured {
    head: String,
    body: String,
}

/// A minimal HTTP/1.1 server: each connection carries one request, whose
/// head is recorded, then `handler(n, socket)` answers it (n counts from 0).
struct FaultServer {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<Captured>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultServer {
    async fn start<F, Fut>(handler: F) -> FaultServer
    where
        F: Fn(usize, TcpStream) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let count = Arc::new(AtomicUsize::new(0));
        let handler = Arc::new(handler);
        let reqs = requests.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut socket, _)) = listener.accept().await else {
                    return;
                };
                let (reqs, count, handler) = (reqs.clone(), count.clone(), handler.clone());
                tokio::spawn(async move {
                    let Some((head, body)) = read_request(&mut socket).await else {
                        return;
                    };
                    reqs.lock().unwrap().push(Captured { head, body });
                    let n = count.fetch_add(1, Ordering::SeqCst);
                    handler(n, socket).await;
                });
            }
        });
        FaultServer {
            addr,
            requests,
            task,
        }
    }

    fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

impl Drop for FaultServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one request; returns its head (lower-cased) and body.
async fn read_request(socket: &mut TcpStream) -> Option<(String, String)> {
    let mut buf = Vec::new();
    let mut piece = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = socket.read(&mut piece).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&piece[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = socket.read(&mut piece).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&piece[..n]);
    }
    let body = String::from_utf8_lossy(&buf[head_end..head_end + length]).into_owned();
    Some((head, body))
}

async fn respond(socket: &mut TcpStream, status: &str, extra_headers: &str, body: &str) {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n{extra_headers}\r\n{body}",
        body.len()
    );
    socket.write_all(msg.as_bytes()).await.unwrap();
    let _ = socket.shutdown().await;
}

/// Like [`respond`], with another content type.
async fn respond_as(socket: &mut TcpStream, status: &str, content_type: &str, body: &str) {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(msg.as_bytes()).await.unwrap();
    let _ = socket.shutdown().await;
}

async fn sse_start(socket: &mut TcpStream) {
    socket
        .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
}

/// Sends `data: {payload}` as one HTTP chunk.
async fn sse_data(socket: &mut TcpStream, payload: &str) {
    let event = format!("data: {payload}\n\n");
    let chunk = format!("{:x}\r\n{event}\r\n", event.len());
    socket.write_all(chunk.as_bytes()).await.unwrap();
    socket.flush().await.unwrap();
}

async fn sse_end(socket: &mut TcpStream) {
    socket.write_all(b"0\r\n\r\n").await.unwrap();
    let _ = socket.shutdown().await;
}

fn text_chunk(text: &str) -> String {
    json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
        .to_string()
}

/// A complete streamed answer with a usage chunk.
async fn sse_answer(socket: &mut TcpStream, text: &str) {
    sse_start(socket).await;
    sse_data(socket, &text_chunk(text)).await;
    sse_data(
        socket,
        &json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}).to_string(),
    )
    .await;
    sse_data(
        socket,
        &json!({"choices": [], "model": "served-model",
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
        .to_string(),
    )
    .await;
    sse_data(socket, "[DONE]").await;
    sse_end(socket).await;
}

fn fast_model(server: &FaultServer, extra: &str) -> OpenAiModel {
    OpenAiModel::from_config(&model_config(&server.base_url(), extra))
        .unwrap()
        .with_backoff(Duration::from_millis(1), Duration::from_millis(10))
}

fn hi() -> ModelRequest {
    ModelRequest {
        history: vec![Message::user("hi")].into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_500_is_retried_and_headers_are_sent() {
    set_api_key();
    let server = FaultServer::start(|n, mut s| async move {
        if n == 0 {
            respond(
                &mut s,
                "500 Internal Server Error",
                "",
                r#"{"error":{"message":"boom"}}"#,
            )
            .await;
        } else {
            sse_answer(&mut s, "ok").await;
        }
    })
    .await;
    let model = fast_model(
        &server,
        &format!("    api_key_env: {API_KEY_VAR}\n    organization: org-1\n    headers: {{X-Custom: yes}}\n"),
    );
    let (r, deltas) = complete(&model, &hi()).await;
    let r = r.unwrap();
    assert_eq!(r.message().text(), "ok");
    assert_eq!(deltas, vec!["ok"]);
    assert_eq!(r.model, "served-model");
    assert_eq!(r.usage.input_tokens, 5);
    assert_eq!(r.usage.output_tokens, 1);
    assert!(!r.usage.estimated);
    assert_eq!(server.count(), 2);
    let head = server.requests.lock().unwrap()[1].head.clone();
    assert!(
        head.starts_with("post /v1/chat/completions http/1.1"),
        "{head}"
    );
    for h in [
        "authorization: bearer sk-fake-123",
        "openai-organization: org-1",
        "x-custom: yes",
        "accept: text/event-stream",
        "content-type: application/json",
    ] {
        assert!(head.contains(h), "missing `{h}` in\n{head}");
    }
}

#[tokio::test]
async fn no_authorization_without_api_key_env() {
    let server = FaultServer::start(|_, mut s| async move { sse_answer(&mut s, "ok").await }).await;
    let model = fast_model(&server, "");
    complete(&model, &hi()).await.0.unwrap();
    assert!(!server.requests.lock().unwrap()[0]
        .head
        .contains("authorization"));
}

#[tokio::test]
async fn a_429_waits_for_retry_after() {
    let server = FaultServer::start(|n, mut s| async move {
        if n == 0 {
            respond(
                &mut s,
                "429 Too Many Requests",
                "Retry-After: 1\r\n",
                r#"{"error":{"message":"slow down"}}"#,
            )
            .await;
        } else {
            sse_answer(&mut s, "ok").await;
        }
    })
    .await;
    // Backoff alone would wait at most 10 ms.
    let model = fast_model(&server, "");
    let started = Instant::now();
    let (r, _) = complete(&model, &hi()).await;
    assert_eq!(r.unwrap().message().text(), "ok");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(1), "waited only {waited:?}");
    assert!(waited < Duration::from_secs(10), "waited {waited:?}");
    assert_eq!(server.count(), 2);
}

/// A 429 asking for an absurd wait (`retry-after-ms: 1e30` once overflowed
/// `Duration::from_secs_f64` and panicked the run task): the call ends at
/// once as a model failure, and the run that made it frees its session.
#[tokio::test]
async fn a_429_with_an_absurd_retry_after_ends_the_call_and_the_run() {
    let server = FaultServer::start(|_, mut s| async move {
        respond(
            &mut s,
            "429 Too Many Requests",
            "retry-after-ms: 1e30\r\nRetry-After: 1e30\r\n",
            r#"{"error":{"message":"slow down"}}"#,
        )
        .await;
    })
    .await;
    let model = fast_model(&server, "");
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert_eq!(err.status, Some(429));
    assert!(
        err.message.contains("longer than hookwire waits"),
        "{}",
        err.message
    );
    assert_eq!(server.count(), 1, "not retried");

    // Through a hookwire run: model_failed, and the session is free again.
    use hookwire::pb;
    let yaml = format!(
        "models: [{{name: gpt, provider: openai, base_url: '{}', model: m}}]\nagents: [{{name: a, model: gpt}}]\n",
        server.base_url()
    );
    let hw = support::TestServer::start(&yaml).await;
    let mut c = hw.client().await;
    let s = support::session(&mut c, "a").await;
    for _ in 0..2 {
        let events = support::run_events(&mut c, &s, "hi").await;
        let r = support::result_of(&events);
        assert_eq!(
            support::outcome(&r),
            pb::RunOutcome::ModelFailed,
            "{}",
            r.reason
        );
        assert!(
            r.reason.contains("longer than hookwire waits"),
            "{}",
            r.reason
        );
    }
    let session = c
        .get_session(pb::GetSessionRequest {
            session_id: s.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(session.active_run_id, "", "the session is not wedged");
    assert_eq!(session.run_count, 2);
    hw.stop().await;
}

#[tokio::test]
async fn a_400_is_not_retried_and_carries_status_and_message() {
    let server = FaultServer::start(|_, mut s| async move {
        respond(
            &mut s,
            "400 Bad Request",
            "",
            r#"{"error":{"message":"Invalid 'temperature': decimal above maximum value.","type":"invalid_request_error","param":"temperature","code":"decimal_above_max_value"}}"#,
        )
        .await;
    })
    .await;
    let model = fast_model(&server, "");
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert_eq!(err.status, Some(400));
    assert_eq!(err.provider, "openai");
    assert_eq!(err.model, "gpt-4o-mini");
    assert_eq!(
        err.message,
        "Invalid 'temperature': decimal above maximum value. (code: decimal_above_max_value)"
    );
    assert!(err.to_string().contains("(status 400)"), "{err}");
    assert_eq!(server.count(), 1);
}

/// A timeout too large for an Instant (a config's is bounded at load; a
/// ModelConfig built in code is not) panicked the call on `Instant +
/// timeout` while reading an error body.
#[tokio::test]
async fn a_huge_timeout_does_not_panic_on_an_error_body() {
    let server = FaultServer::start(|_, mut s| async move {
        respond(&mut s, "400 Bad Request", "", r#"{"error":"no"}"#).await;
    })
    .await;
    let mut cfg = model_config(&server.base_url(), "");
    cfg.timeout = Some(Duration::MAX);
    let model = OpenAiModel::from_config(&cfg).unwrap();
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert_eq!((err.status, err.message.as_str()), (Some(400), "no"));
}

#[tokio::test]
async fn gives_up_after_max_retries() {
    let server = FaultServer::start(|_, mut s| async move {
        respond(&mut s, "503 Service Unavailable", "", "").await;
    })
    .await;
    let model = fast_model(&server, "");
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert_eq!(err.status, Some(503));
    assert_eq!(
        err.message,
        "HTTP 503 Service Unavailable (gave up after 3 attempts)"
    );
    assert_eq!(server.count(), 3, "1 attempt + max_retries (default 2)");

    let model = fast_model(&server, "    max_retries: 0\n");
    complete(&model, &hi()).await.0.unwrap_err();
    assert_eq!(server.count(), 4);
}

#[tokio::test]
async fn a_stream_broken_before_any_text_is_retried() {
    let server = FaultServer::start(|n, mut s| async move {
        if n == 0 {
            sse_start(&mut s).await;
            sse_data(
                &mut s,
                &json!({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}).to_string(),
            )
            .await;
            // Dropped without the terminating chunk.
        } else {
            sse_answer(&mut s, "second try").await;
        }
    })
    .await;
    let model = fast_model(&server, "");
    let (r, deltas) = complete(&model, &hi()).await;
    assert_eq!(r.unwrap().message().text(), "second try");
    assert_eq!(deltas, vec!["second try"]);
    assert_eq!(server.count(), 2);
}

#[tokio::test]
async fn a_disconnect_after_a_delta_is_an_error_without_retry() {
    let server = FaultServer::start(|_, mut s| async move {
        sse_start(&mut s).await;
        sse_data(&mut s, &text_chunk("Hel")).await;
        // The connection drops mid-stream.
    })
    .await;
    let model = fast_model(&server, "");
    let (r, deltas) = complete(&model, &hi()).await;
    let err = r.unwrap_err();
    assert_eq!(deltas, vec!["Hel"]);
    assert_eq!(err.status, None);
    assert!(err.message.contains("broke"), "{err}");
    assert!(err.message.contains("not retried"), "{err}");
    assert_eq!(server.count(), 1);
}

/// A connection dropped after the finish reason, before the usage chunk,
/// `[DONE]` and the body's terminating chunk: the answer was complete and
/// is kept, with usage estimated (the call failed, and could not be retried
/// as its text had been passed on).
#[tokio::test]
async fn a_disconnect_after_the_finish_reason_keeps_the_answer() {
    let server = FaultServer::start(|_, mut s| async move {
        sse_start(&mut s).await;
        sse_data(&mut s, &text_chunk("complete answer")).await;
        let finish = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
        sse_data(&mut s, &finish.to_string()).await;
        // Dropped without the terminating chunk.
    })
    .await;
    let model = fast_model(&server, "");
    let (r, deltas) = complete(&model, &hi()).await;
    let r = r.unwrap();
    assert_eq!(r.message().text(), "complete answer");
    assert_eq!(r.finish_reason, "stop");
    assert!(r.usage.estimated, "{:?}", r.usage);
    assert_eq!(deltas, vec!["complete answer"]);
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn malformed_sse_json_is_an_error() {
    let server = FaultServer::start(|_, mut s| async move {
        sse_start(&mut s).await;
        sse_data(&mut s, r#"{"choices": [{"index": 0, "delta": {"content": "#).await;
        sse_data(&mut s, "[DONE]").await;
        sse_end(&mut s).await;
    })
    .await;
    let model = fast_model(&server, "");
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert!(err.message.contains("malformed chunk"), "{err}");
    assert_eq!(server.count(), 1, "a malformed stream is not retried");
}

#[tokio::test]
async fn an_oversized_stream_is_cut_off() {
    let server = FaultServer::start(|_, mut s| async move {
        sse_start(&mut s).await;
        for _ in 0..100 {
            sse_data(&mut s, &text_chunk("0123456789")).await;
        }
        sse_data(&mut s, "[DONE]").await;
        sse_end(&mut s).await;
    })
    .await;
    let model = fast_model(&server, "").with_max_response_bytes(2048);
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert!(err.message.contains("exceeded 2048 bytes"), "{err}");
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn no_response_within_the_timeout_is_an_error() {
    let (hold_tx, hold_rx) = tokio::sync::watch::channel(());
    let server = FaultServer::start(move |_, s| {
        let mut hold = hold_rx.clone();
        async move {
            // Never answers; keeps the socket open until the test ends.
            let _ = hold.changed().await;
            drop(s);
        }
    })
    .await;
    let model = fast_model(&server, "    timeout: 200ms\n    max_retries: 1\n");
    let started = Instant::now();
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert!(err.message.contains("no response"), "{err}");
    assert!(err.message.contains("gave up after 2 attempts"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(server.count(), 2);
    drop(hold_tx);
}

#[tokio::test]
async fn dropping_the_future_closes_the_connection() {
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
    let closed_tx = Arc::new(Mutex::new(Some(closed_tx)));
    let server = FaultServer::start(move |_, mut s| {
        let closed_tx = closed_tx.clone();
        async move {
            sse_start(&mut s).await;
            sse_data(&mut s, &text_chunk("first")).await;
            // Wait for the client to go away: EOF or a reset.
            let mut buf = [0u8; 64];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            if let Some(tx) = closed_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
        }
    })
    .await;
    let model = Arc::new(fast_model(&server, ""));
    let (delta_tx, mut delta_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let call = tokio::spawn({
        let model = model.clone();
        async move {
            let sink = move |t: &str| {
                let _ = delta_tx.send(t.to_string());
            };
            model.complete(&hi(), &sink).await
        }
    });
    assert_eq!(delta_rx.recv().await.as_deref(), Some("first"));
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    tokio::time::timeout(Duration::from_secs(10), closed_rx)
        .await
        .expect("the server saw the connection close after the future was dropped")
        .unwrap();
    assert_eq!(server.count(), 1);
}

#[tokio::test]
async fn an_unreachable_server_is_retried_then_reported() {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let cfg = model_config(&format!("http://{addr}/v1"), "    max_retries: 1\n");
    let model = OpenAiModel::from_config(&cfg)
        .unwrap()
        .with_backoff(Duration::from_millis(1), Duration::from_millis(10));
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert_eq!(err.status, None);
    assert!(
        err.message
            .starts_with(&format!("cannot reach http://{addr}: ")),
        "{err}"
    );
    assert!(err.message.ends_with("(gave up after 2 attempts)"), "{err}");
    assert!(
        !err.message.contains("/v1/chat/completions"),
        "no URL path: {err}"
    );
}

#[tokio::test]
async fn a_json_answer_to_a_stream_request_is_reported() {
    let server = FaultServer::start(|_, mut s| async move {
        respond(
            &mut s,
            "200 OK",
            "",
            r#"{"error":{"message":"streaming is disabled"}}"#,
        )
        .await;
    })
    .await;
    let model = fast_model(&server, "");
    let err = complete(&model, &hi()).await.0.unwrap_err();
    assert_eq!(
        err.message,
        "expected an event stream (text/event-stream) but got application/json: streaming is disabled"
    );
    assert_eq!(server.count(), 1);
}

/// A final usage chunk with a count of the wrong type (`null`) once failed
/// the chunk, and so the turn, as malformed: the answer stands, its usage
/// estimated.
#[tokio::test]
async fn a_null_usage_count_gives_an_estimate_not_a_failure() {
    let server = FaultServer::start(|_, mut s| async move {
        sse_start(&mut s).await;
        sse_data(&mut s, &text_chunk("Hello there")).await;
        let usage = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": null}});
        sse_data(&mut s, &usage.to_string()).await;
        sse_data(&mut s, "[DONE]").await;
        sse_end(&mut s).await;
    })
    .await;
    let model = fast_model(&server, "");
    let r = complete(&model, &hi()).await.0.unwrap();
    assert_eq!(r.message().text(), "Hello there");
    assert!(r.usage.estimated, "{:?}", r.usage);
    assert_eq!(r.usage.output_tokens, 3, "11 characters, 4 per token");
}

/// A body that is not an error object is never quoted in the message (the
/// run's reason, which clients, the store and `run_end` hooks see): a
/// whole completion answering a stream request carries the model's answer,
/// a proxy's page or a validation error may echo the request.
#[tokio::test]
async fn bodies_that_are_not_error_objects_stay_out_of_the_message() {
    let server = FaultServer::start(|n, mut s| async move {
        match n {
            0 => {
                let completion = json!({"id": "c1", "object": "chat.completion",
                    "choices": [{"index": 0, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "the SECRET answer"}}]});
                respond(&mut s, "200 OK", "", &completion.to_string()).await;
            }
            1 => respond_as(&mut s, "400 Bad Request", "text/html", "<p>SECRET</p>").await,
            _ => {
                let echo = json!({"detail": [{"msg": "bad", "input": "SECRET"}]});
                respond(&mut s, "422 Unprocessable Entity", "", &echo.to_string()).await;
            }
        }
    })
    .await;
    let model = fast_model(&server, "");
    let messages = [
        "expected an event stream (text/event-stream) but got application/json",
        "HTTP 400 Bad Request (text/html body not shown: not an error object)",
        "HTTP 422 Unprocessable Entity (application/json body not shown: not an error object)",
    ];
    for want in messages {
        let err = complete(&model, &hi()).await.0.unwrap_err();
        assert_eq!(err.message, want);
        assert!(!err.to_string().contains("SECRET"), "{err}");
    }
    assert_eq!(server.count(), 3);
}

// ------------------------------------------------ whole agent runs (gRPC)

/// A hookwire agent on fakellm: a hook owns `get_weather` and patches every
/// model request; fakellm only plays along when the patch (extra context),
/// the hook-owned tool and the configured header reach it.
#[tokio::test]
async fn an_agent_runs_a_hook_owned_tool_on_fakellm_streamed_and_unary() {
    use hookwire::hook_server::{self, Reply};
    use hookwire::pb;
    use support::{FnHook, TestServer};

    let server = FakeLlm::start(
        r#"
rules:
  - name: answer
    when: {tool_result_contains: "sunny in Paris", messages_contain: "patched-context-42"}
    respond: {content: "The tool says it is sunny in Paris."}
  - name: call_tool
    when: {messages_contain: "patched-context-42", tools_include: get_weather, header.x-team: blue}
    respond:
      tool_calls: [{name: get_weather, arguments: {city: Paris}}]
  - name: unpatched
    respond: {content: "NO MATCH: the patched request did not reach fakellm"}
"#,
    );
    let hook = FnHook::new(
        "weather",
        &[pb::EventKind::ModelRequest, pb::EventKind::ToolResult],
    )
    .on_model_request(|_, _| async {
        Reply::new(hook_server::patch_request(pb::RequestPatch {
            extra_context: vec!["patched-context-42".into()],
            temperature: Some(0.1),
            additional_params_json: r#"{"seed": 3}"#.into(),
            ..Default::default()
        }))
    })
    .with_tool(support::weather_tool(), |_, call| async move {
        let args: Value = serde_json::from_str(&call.arguments_json).unwrap();
        pb::CallToolResponse {
            content: format!("sunny in {}", args["city"].as_str().unwrap_or("?")),
            is_error: false,
        }
    })
    .start()
    .await;
    let yaml = format!(
        "models:
  - name: gpt
    provider: openai
    base_url: {base}
    model: gpt-4o-mini
    headers: {{x-team: blue}}
hooks:
  - name: weather
    endpoint: {hook}
agents:
  - name: a
    model: gpt
    system_prompt: You answer weather questions.
    hooks: [weather]
    tools: [get_weather]
",
        base = server.base_url(),
        hook = hook.addr
    );
    let hw = TestServer::start(&yaml).await;
    let mut c = hw.client().await;

    // Streamed (Run).
    let s = support::session(&mut c, "a").await;
    let events = support::run_events(&mut c, &s, "What's the weather in Paris?").await;
    let r = support::result_of(&events);
    assert_eq!(
        support::outcome(&r),
        pb::RunOutcome::Completed,
        "{}",
        r.reason
    );
    assert_eq!(r.final_text, "The tool says it is sunny in Paris.");
    assert_eq!(r.turns, 2);
    let streamed: String = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(pb::run_event::Event::TextDelta(d)) => Some(d.text.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(streamed, r.final_text);
    assert_eq!(
        support::texts(&r.messages),
        [
            "What's the weather in Paris?",
            r#"call:get_weather({"city": "Paris"})"#,
            "result:sunny in Paris",
            "The tool says it is sunny in Paris.",
        ]
    );
    assert!(r.usage.unwrap().output_tokens > 0);

    // Unary (Invoke), in a new conversation (fakellm keys conversations by
    // their first user message).
    let s = support::session(&mut c, "a").await;
    let r = support::invoke(&mut c, &s, "Paris weather, please").await;
    assert_eq!(
        support::outcome(&r),
        pb::RunOutcome::Completed,
        "{}",
        r.reason
    );
    assert_eq!(r.final_text, "The tool says it is sunny in Paris.");

    assert_eq!(
        server.rule_hits().await,
        json!({"call_tool": 2, "answer": 2}),
        "every model call carried the patch, the tool and the header"
    );
    assert_eq!(hook.hook.tool_calls.lock().unwrap().len(), 2);
    hw.stop().await;
}

#[test]
fn start_up_fails_naming_a_missing_key_variable() {
    let yaml = "models: [{name: gpt, provider: openai, base_url: 'http://127.0.0.1:1/v1', model: m, api_key_env: HOOKWIRE_IT_SURELY_UNSET_KEY}]\nagents: [{name: a, model: gpt}]\n";
    let cfg = Config::parse(yaml, "test").unwrap();
    let err = hookwire::server::build_models(&cfg).err().expect("fails");
    assert_eq!(
        err.to_string(),
        "model `gpt`: environment variable `HOOKWIRE_IT_SURELY_UNSET_KEY` (api_key_env) is not set"
    );
}

/// The last request's body as JSON.
fn last_body(server: &FaultServer) -> Value {
    let body = server.requests.lock().unwrap().last().unwrap().body.clone();
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// A history whose assistant turn is tool calls only, then their results.
fn after_a_tool_call() -> ModelRequest {
    use hookwire::message::{Block, Role, ToolCall};
    ModelRequest {
        history: vec![
            Message::user("weather in Paris?"),
            Message {
                role: Role::Assistant,
                blocks: vec![Block::ToolCall(ToolCall {
                    id: "call_1".into(),
                    name: "get_weather".into(),
                    arguments_json: r#"{"city":"Paris"}"#.into(),
                })],
            },
            Message::tool_results(vec![ToolResult {
                call_id: "call_1".into(),
                name: "get_weather".into(),
                content: "sunny, 21C".into(),
                is_error: false,
            }]),
        ]
        .into(),
        tools: weather_tools(),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_tool_call_turn_goes_back_with_string_content_as_local_servers_require() {
    // llama-cpp-python's server answers 500 and Ollama's 400 to an
    // assistant message whose content is null (which OpenAI accepts).
    let server = FaultServer::start(|_, mut s| async move {
        sse_answer(&mut s, "It is sunny.").await;
    })
    .await;
    let model = fast_model(&server, "");
    let (r, _) = complete(&model, &after_a_tool_call()).await;
    assert_eq!(r.unwrap().message().text(), "It is sunny.");
    let body = last_body(&server);
    let assistant = &body["messages"][1];
    assert_eq!(assistant["role"], "assistant");
    assert_eq!(
        assistant["content"],
        json!(""),
        "a string, never null: {assistant}"
    );
    assert_eq!(assistant["tool_calls"][0]["id"], "call_1");
}

#[tokio::test]
async fn stream_false_asks_for_one_json_answer_and_parses_it_like_a_stream() {
    let server = FaultServer::start(|_, mut s| async move {
        let answer = json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "served-model",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [{"id": "call_9", "type": "function",
                                "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}],
            }}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
        });
        respond(&mut s, "200 OK", "", &answer.to_string()).await;
    })
    .await;
    let model = fast_model(&server, "    stream: false\n");
    let (r, deltas) = complete(&model, &after_a_tool_call()).await;
    let r = r.unwrap();
    let body = last_body(&server);
    assert_eq!(body["stream"], json!(false));
    assert!(body.get("stream_options").is_none(), "{body}");
    let head = server.requests.lock().unwrap()[0].head.clone();
    assert!(head.contains("accept: application/json"), "{head}");
    // The same turn a stream would have given, its text as one delta.
    assert_eq!(deltas, ["Let me check."]);
    assert_eq!(r.finish_reason, "tool_calls");
    assert_eq!(r.model, "served-model");
    assert_eq!((r.usage.input_tokens, r.usage.output_tokens), (11, 4));
    assert!(!r.usage.estimated);
    let msg = r.message();
    assert_eq!(msg.text(), "Let me check.");
    let call = msg.tool_calls().next().unwrap().clone();
    assert_eq!(
        (call.id.as_str(), call.name.as_str()),
        ("call_9", "get_weather")
    );
    assert_eq!(call.arguments_json, r#"{"city":"Oslo"}"#);
}

#[tokio::test]
async fn stream_false_against_fakellm_gives_what_streaming_gives() {
    let server = FakeLlm::start(
        r#"
rules:
  - name: answer
    when: {tool_result_contains: "sunny"}
    respond: {content: "It is sunny in Paris."}
  - name: call_tools
    when: {messages_contain: "weather", tools_include: get_weather}
    respond:
      tool_calls:
        - {name: get_weather, arguments: {city: Paris}}
"#,
    );
    let streamed = OpenAiModel::from_config(&model_config(&server.base_url(), "")).unwrap();
    let whole =
        OpenAiModel::from_config(&model_config(&server.base_url(), "    stream: false\n")).unwrap();
    let request = ModelRequest {
        history: vec![Message::user("What's the weather in Paris?")].into(),
        tools: weather_tools(),
        ..Default::default()
    };
    let (a, _) = complete(&streamed, &request).await;
    let (b, deltas) = complete(&whole, &request).await;
    let (a, b) = (a.unwrap(), b.unwrap());
    assert!(deltas.is_empty(), "{deltas:?}");
    assert_eq!(b.finish_reason, a.finish_reason);
    let (ca, cb): (Vec<_>, Vec<_>) = (
        a.message().tool_calls().cloned().collect(),
        b.message().tool_calls().cloned().collect(),
    );
    assert_eq!(cb.len(), 1);
    assert_eq!(cb[0].name, ca[0].name);
    assert_eq!(
        serde_json::from_str::<Value>(&cb[0].arguments_json).unwrap(),
        serde_json::from_str::<Value>(&ca[0].arguments_json).unwrap()
    );

    let mut request = request;
    request.history.push(b.message());
    request.history.push(Message::tool_results(vec![ToolResult {
        call_id: cb[0].id.clone(),
        name: "get_weather".into(),
        content: "sunny, 21C".into(),
        is_error: false,
    }]));
    let (r, deltas) = complete(&whole, &request).await;
    let r = r.unwrap();
    assert_eq!(r.message().text(), "It is sunny in Paris.");
    assert_eq!(deltas, ["It is sunny in Paris."]);
    assert_eq!(r.finish_reason, "stop");
}

#[tokio::test]
async fn a_max_tokens_stop_and_estimated_usage_reach_the_result_the_cli_and_metrics() {
    // Streams an answer cut at the token limit, with no usage chunk.
    let server = FaultServer::start(|_, mut s| async move {
        sse_start(&mut s).await;
        sse_data(&mut s, &text_chunk("The capital of France is")).await;
        sse_data(
            &mut s,
            &json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}).to_string(),
        )
        .await;
        sse_data(&mut s, "[DONE]").await;
        sse_end(&mut s).await;
    })
    .await;
    let yaml = format!(
        "models:\n  - name: gpt\n    provider: openai\n    base_url: '{}'\n    model: tiny\n    max_tokens: 5\nagents:\n  - name: a\n    model: gpt\n",
        server.base_url()
    );
    let (hw, admin) = support::TestServer::start_with_admin(&yaml).await;
    let mut c = hw.client().await;
    let s = support::session(&mut c, "a").await;
    let r = support::invoke(&mut c, &s, "What is the capital of France?").await;
    assert_eq!(support::outcome(&r), hookwire::pb::RunOutcome::Completed);
    assert_eq!(r.final_text, "The capital of France is");
    assert_eq!(r.finish_reason, "length");
    assert!(r.truncated, "the result says the answer was cut off");
    assert!(r.usage.unwrap().estimated, "no usage chunk: estimated");

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .args(["run", "--addr", &hw.addr, "--agent", "a", "And of Spain?"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("✔ completed (truncated) · 1 turn(s)"),
        "{text}"
    );
    assert!(text.contains("(estimated)"), "{text}");
    assert!(
        text.contains(
            "the answer is cut off: the model stopped at its token limit (finish_reason length)"
        ),
        "{text}"
    );

    let metrics = support::http_get(admin, "/metrics").await;
    assert!(
        metrics.contains(r#"hookwire_model_tokens_total{model="tiny",provider="openai",token_type="output",estimated="true"}"#),
        "{metrics}"
    );
    hw.stop().await;
}
