//! The chat-completions wire format: building the request body from a
//! [`ModelRequest`], the streamed chunk shapes, and provider error bodies.
//!
//! Everything here is pure (no IO) so the mapping is unit-tested on its own.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::message::{Block, Message, Role};
use crate::model::{ModelRequest, ToolChoice};

/// Request defaults from the model config, used when the effective request
/// leaves a field unset.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Defaults {
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
}

/// Body keys the provider sets from the request. `additional_params`
/// cannot override them: `model` is the configured model id, `messages` is
/// built from the history, `stream` is the model's `stream` option, which
/// decides how the response is parsed, and the rest carry the request's
/// typed fields. A hook's patch that sets one is refused before it gets
/// here (`hooks::compose::RESERVED_PARAMS`); this is the provider's own
/// guard.
pub(super) const RESERVED_KEYS: [&str; 9] = [
    "model",
    "messages",
    "stream",
    "temperature",
    "max_tokens",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
];

/// The chat-completions request body for one call; `stream` asks for a
/// streamed answer (with usage in a final chunk) or one JSON answer.
///
/// Fails only when a tool's JSON schema is not valid JSON.
pub(super) fn request_body(
    request: &ModelRequest,
    model: &str,
    defaults: &Defaults,
    stream: bool,
) -> Result<Map<String, Value>, String> {
    let mut body = Map::new();
    body.insert("model".into(), model.into());
    body.insert("messages".into(), Value::Array(messages(request)));

    let tools = tools(request)?;
    let has_tools = !tools.is_empty();
    if has_tools {
        body.insert("tools".into(), Value::Array(tools));
    }
    // Without tools, `auto` and `none` mean the same as leaving the field out,
    // and several servers reject `tool_choice` when no tool is offered. A
    // `required` or named choice is still sent so the provider reports the
    // contradiction instead of hookwire silently dropping it.
    let choice = match &request.tool_choice {
        ToolChoice::Auto if has_tools => Some(json!("auto")),
        ToolChoice::None if has_tools => Some(json!("none")),
        ToolChoice::Auto | ToolChoice::None => None,
        ToolChoice::Required => Some(json!("required")),
        ToolChoice::Tool(name) => Some(json!({"type": "function", "function": {"name": name}})),
    };
    if let Some(choice) = choice {
        body.insert("tool_choice".into(), choice);
    }

    if let Some(t) = request.temperature.or(defaults.temperature) {
        body.insert("temperature".into(), json!(t));
    }
    if let Some(n) = request.max_tokens.or(defaults.max_tokens) {
        body.insert("max_tokens".into(), json!(n));
    }

    for (key, value) in &request.additional_params {
        if RESERVED_KEYS.contains(&key.as_str()) {
            tracing::warn!(
                key = key.as_str(),
                "additional_params key is managed by the openai provider; ignored"
            );
            continue;
        }
        body.insert(key.clone(), value.clone());
    }

    body.insert("stream".into(), Value::Bool(stream));
    if stream {
        // Usage arrives in a final chunk only when asked for. Keep any other
        // stream options a hook set.
        let mut stream_options = match body.remove("stream_options") {
            Some(Value::Object(m)) => m,
            _ => Map::new(),
        };
        stream_options.insert("include_usage".into(), Value::Bool(true));
        body.insert("stream_options".into(), Value::Object(stream_options));
    } else {
        // Several servers reject stream options on a request that does not
        // stream; a whole answer carries its usage anyway.
        body.remove("stream_options");
    }
    Ok(body)
}

fn messages(request: &ModelRequest) -> Vec<Value> {
    let mut out = Vec::with_capacity(request.history.len() + 1);
    let system = request.system_text();
    if !system.is_empty() {
        out.push(json!({"role": "system", "content": system}));
    }
    for m in &request.history {
        push_message(&mut out, m);
    }
    out
}

fn push_message(out: &mut Vec<Value>, m: &Message) {
    match m.role {
        Role::User => out.push(json!({"role": "user", "content": m.text()})),
        Role::Assistant => {
            let calls: Vec<Value> = m
                .tool_calls()
                .map(|c| {
                    json!({
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments_json},
                    })
                })
                .collect();
            let text = m.text();
            let mut msg = Map::new();
            msg.insert("role".into(), "assistant".into());
            // Always a string, "" for a pure tool-call turn. OpenAI returns
            // and accepts `null` there, but not every compatible server
            // takes it back: llama-cpp-python's server answers 500, Ollama's
            // OpenAI endpoint 400 "invalid message content type: <nil>",
            // older llama.cpp servers "Invalid 'content' type"; all of them,
            // vLLM and OpenAI accept "" (docs/openai-provider.md, quirks).
            msg.insert("content".into(), Value::String(text));
            if !calls.is_empty() {
                msg.insert("tool_calls".into(), Value::Array(calls));
            }
            out.push(Value::Object(msg));
        }
        Role::Tool => {}
    }
    // Tool results become one `tool` message each, whatever message carries
    // them. There is no error flag on the wire: the content says it.
    for r in m.tool_results_iter() {
        out.push(json!({"role": "tool", "tool_call_id": r.call_id, "content": r.content}));
    }
}

fn tools(request: &ModelRequest) -> Result<Vec<Value>, String> {
    request
        .tools
        .iter()
        .map(|t| {
            let parameters = if t.parameters_json_schema.trim().is_empty() {
                json!({"type": "object"})
            } else {
                serde_json::from_str::<Value>(&t.parameters_json_schema).map_err(|e| {
                    format!(
                        "tool `{}` has a parameter schema that is not JSON: {e}",
                        t.name
                    )
                })?
            };
            let mut function = Map::new();
            function.insert("name".into(), t.name.clone().into());
            if !t.description.is_empty() {
                function.insert("description".into(), t.description.clone().into());
            }
            function.insert("parameters".into(), parameters);
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

/// Rough input size in tokens (chars / 4) for servers that report no usage.
pub(super) fn estimate_input_tokens(request: &ModelRequest) -> u64 {
    let mut chars = request.system_text().chars().count();
    for m in &request.history {
        for b in &m.blocks {
            chars += match b {
                Block::Text { text } => text.chars().count(),
                Block::Reasoning { .. } => 0,
                Block::ToolCall(c) => c.name.chars().count() + c.arguments_json.chars().count(),
                Block::ToolResult(r) => r.content.chars().count(),
            };
        }
    }
    for t in &request.tools {
        chars += t.name.len() + t.description.chars().count() + t.parameters_json_schema.len();
    }
    tokens_from_chars(chars)
}

pub(super) fn tokens_from_chars(chars: usize) -> u64 {
    (chars as u64).div_ceil(4)
}

/// One `data:` payload of a streamed chat completion, or a whole
/// non-streamed one (its choices carry `message` instead of `delta`).
#[derive(Debug, Deserialize)]
pub(super) struct Chunk {
    /// The completion's id (`chatcmpl-…`), repeated in every chunk.
    #[serde(default)]
    pub id: Option<String>,
    /// Empty or null in the usage chunk and some servers' first chunk.
    #[serde(default)]
    pub choices: Option<Vec<ChunkChoice>>,
    /// Read with [`usage`]: a count of an odd type must not fail the chunk.
    #[serde(default)]
    pub usage: Option<Value>,
    #[serde(default)]
    pub model: Option<String>,
    /// Some servers report a failure inside the stream.
    #[serde(default)]
    pub error: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub(super) struct ChunkChoice {
    #[serde(default)]
    pub index: Option<u32>,
    #[serde(default)]
    pub delta: Option<Delta>,
    /// The whole message of a non-streamed answer (same shape as a delta).
    #[serde(default)]
    pub message: Option<Delta>,
    #[serde(default)]
    pub finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct Delta {
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub refusal: Option<String>,
    /// Reasoning text as vLLM / DeepSeek-style servers stream it.
    #[serde(default, alias = "reasoning")]
    pub reasoning_content: Option<String>,
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct ToolCallDelta {
    /// Position of the call in the turn; absent on a few servers that send
    /// each call whole (then the order of arrival is used).
    #[serde(default)]
    pub index: Option<u32>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub function: Option<FunctionDelta>,
}

#[derive(Debug, Deserialize)]
pub(super) struct FunctionDelta {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WireUsage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// Most tokens one count may claim: beyond any context window, and far
/// from overflowing the sums and the metrics counters they feed.
pub(super) const MAX_TOKEN_COUNT: u64 = 1_000_000_000;

/// The token counts of a `usage` value, when both are non-negative
/// integers (larger ones are clamped to [`MAX_TOKEN_COUNT`]). Anything else
/// (`null`, `5.0`, a string, a missing count, `{}`) is no usage at all, so
/// the caller estimates it instead of failing the turn or reporting zeros.
pub(super) fn usage(v: &Value) -> Option<WireUsage> {
    let count = |key| v.get(key)?.as_u64().map(|n| n.min(MAX_TOKEN_COUNT));
    Some(WireUsage {
        prompt_tokens: count("prompt_tokens")?,
        completion_tokens: count("completion_tokens")?,
    })
}

/// Longest provider error text carried into a [`crate::model::ModelError`].
const MAX_ERROR_TEXT: usize = 512;

/// The provider's message from an error body: `{"error":{"message":..}}`
/// (OpenAI, vLLM, LiteLLM), `{"error":".."}` (Ollama, llama.cpp),
/// `{"message":..}` or `{"detail":..}`, trimmed and truncated. `None` for
/// any other body, which is never quoted: it may be a completion (a server
/// ignoring `stream: true`), a proxy's page, or a validation error echoing
/// the request, and the message becomes the run's reason, which clients,
/// the store and `run_end` hooks see.
pub(super) fn error_message(body: &[u8]) -> Option<String> {
    let v = serde_json::from_slice::<Value>(body).ok()?;
    match v.as_object()?.get("error") {
        Some(err) => error_value_message(err),
        None => object_message(v.as_object()?),
    }
}

/// The text of an `error` value (of a body, or of a stream chunk): a
/// string, or an object's `message` / `detail` / `msg` string (with its
/// `code`), trimmed and truncated; `None` for anything else.
pub(super) fn error_value_message(err: &Value) -> Option<String> {
    match err {
        Value::String(s) => nonempty(s),
        Value::Object(o) => object_message(o),
        _ => None,
    }
}

fn object_message(o: &Map<String, Value>) -> Option<String> {
    let message = ["message", "detail", "msg"]
        .iter()
        .find_map(|k| o.get(*k).and_then(Value::as_str))
        .and_then(nonempty)?;
    match o.get("code").and_then(Value::as_str) {
        Some(code) if !code.is_empty() => Some(truncate(&format!("{message} (code: {code})"))),
        _ => Some(message),
    }
}

fn nonempty(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty()).then(|| truncate(s))
}

fn truncate(s: &str) -> String {
    if s.len() <= MAX_ERROR_TEXT {
        return s.to_string();
    }
    let mut end = MAX_ERROR_TEXT;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{ToolCall, ToolResult, ToolSpec};

    fn body(request: &ModelRequest) -> Value {
        Value::Object(request_body(request, "gpt-test", &Defaults::default(), true).unwrap())
    }

    fn weather_tool() -> ToolSpec {
        ToolSpec {
            name: "get_weather".into(),
            description: "Weather for a city".into(),
            parameters_json_schema:
                r#"{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}"#
                    .into(),
        }
    }

    fn tool_history() -> Vec<Message> {
        vec![
            Message::user("Weather in Paris and the time?"),
            Message {
                role: Role::Assistant,
                blocks: vec![
                    Block::Reasoning {
                        text: "private chain of thought".into(),
                    },
                    Block::Text {
                        text: "Let me check.".into(),
                    },
                    Block::ToolCall(ToolCall {
                        id: "call_1".into(),
                        name: "get_weather".into(),
                        arguments_json: r#"{"city":"Paris"}"#.into(),
                    }),
                    Block::ToolCall(ToolCall {
                        id: "call_2".into(),
                        name: "get_time".into(),
                        arguments_json: "{}".into(),
                    }),
                ],
            },
            Message::tool_results(vec![
                ToolResult {
                    call_id: "call_1".into(),
                    name: "get_weather".into(),
                    content: "sunny, 21C".into(),
                    is_error: false,
                },
                ToolResult {
                    call_id: "call_2".into(),
                    name: "get_time".into(),
                    content: "clock unavailable".into(),
                    is_error: true,
                },
            ]),
        ]
    }

    #[test]
    fn minimal_request_streams_with_usage_and_omits_unset_fields() {
        let b = body(&ModelRequest {
            model: "ignored-alias".into(),
            history: vec![Message::user("hi")].into(),
            ..Default::default()
        });
        assert_eq!(
            b,
            json!({
                "model": "gpt-test",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": true,
                "stream_options": {"include_usage": true},
            })
        );
    }

    #[test]
    fn system_prompt_and_extra_context_form_one_system_message() {
        let b = body(&ModelRequest {
            system_prompt: "Be terse.".into(),
            extra_context: vec!["doc one".into(), "doc two".into()],
            history: vec![Message::user("hi")].into(),
            ..Default::default()
        });
        assert_eq!(
            b["messages"][0],
            json!({"role": "system", "content": "Be terse.\n\ndoc one\n\ndoc two"})
        );
        // Extra context without a system prompt still makes a system message.
        let b = body(&ModelRequest {
            extra_context: vec!["ctx".into()],
            ..Default::default()
        });
        assert_eq!(b["messages"], json!([{"role": "system", "content": "ctx"}]));
    }

    #[test]
    fn history_maps_tool_calls_and_one_tool_message_per_result() {
        let b = body(&ModelRequest {
            history: tool_history().into(),
            ..Default::default()
        });
        assert_eq!(
            b["messages"],
            json!([
                {"role": "user", "content": "Weather in Paris and the time?"},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                        {"id": "call_2", "type": "function",
                         "function": {"name": "get_time", "arguments": "{}"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "clock unavailable"},
            ])
        );
        assert!(
            !b.to_string().contains("chain of thought"),
            "reasoning blocks are never sent back"
        );
    }

    #[test]
    fn pure_tool_call_turn_has_empty_string_content() {
        let b = body(&ModelRequest {
            history: vec![Message {
                role: Role::Assistant,
                blocks: vec![Block::ToolCall(ToolCall {
                    id: "c".into(),
                    name: "t".into(),
                    arguments_json: "{}".into(),
                })],
            }]
            .into(),
            ..Default::default()
        });
        assert_eq!(
            b["messages"][0]["content"],
            json!(""),
            "a string every compatible server accepts, never null"
        );
        let b = body(&ModelRequest {
            history: vec![Message::assistant_text("plain")].into(),
            ..Default::default()
        });
        assert_eq!(
            b["messages"][0],
            json!({"role": "assistant", "content": "plain"})
        );
    }

    #[test]
    fn tools_map_to_function_tools_with_default_schema() {
        let b = body(&ModelRequest {
            tools: vec![
                weather_tool(),
                ToolSpec {
                    name: "get_time".into(),
                    description: String::new(),
                    parameters_json_schema: "  ".into(),
                },
            ],
            ..Default::default()
        });
        assert_eq!(
            b["tools"],
            json!([
                {"type": "function", "function": {
                    "name": "get_weather",
                    "description": "Weather for a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                }},
                {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
            ])
        );
        assert_eq!(b["tool_choice"], json!("auto"));
    }

    #[test]
    fn invalid_tool_schema_is_an_error_naming_the_tool() {
        let err = request_body(
            &ModelRequest {
                tools: vec![ToolSpec {
                    name: "broken".into(),
                    description: String::new(),
                    parameters_json_schema: "{not json".into(),
                }],
                ..Default::default()
            },
            "m",
            &Defaults::default(),
            true,
        )
        .unwrap_err();
        assert!(err.contains("`broken`"), "{err}");
    }

    #[test]
    fn tool_choice_variants() {
        let with = |choice: ToolChoice, tools: Vec<ToolSpec>| {
            body(&ModelRequest {
                tools,
                tool_choice: choice,
                ..Default::default()
            })
            .get("tool_choice")
            .cloned()
        };
        let t = || vec![weather_tool()];
        assert_eq!(with(ToolChoice::Auto, t()), Some(json!("auto")));
        assert_eq!(with(ToolChoice::None, t()), Some(json!("none")));
        assert_eq!(with(ToolChoice::Required, t()), Some(json!("required")));
        assert_eq!(
            with(ToolChoice::Tool("get_weather".into()), t()),
            Some(json!({"type": "function", "function": {"name": "get_weather"}}))
        );
        // No tools: auto / none are left out, a hard requirement is still sent.
        assert_eq!(with(ToolChoice::Auto, vec![]), None);
        assert_eq!(with(ToolChoice::None, vec![]), None);
        assert_eq!(with(ToolChoice::Required, vec![]), Some(json!("required")));
    }

    #[test]
    fn temperature_and_max_tokens_prefer_the_request_over_config_defaults() {
        let defaults = Defaults {
            temperature: Some(0.7),
            max_tokens: Some(100),
        };
        let b = request_body(&ModelRequest::default(), "m", &defaults, true).unwrap();
        assert_eq!(b["temperature"], json!(0.7));
        assert_eq!(b["max_tokens"], json!(100));
        let b = request_body(
            &ModelRequest {
                temperature: Some(0.0),
                max_tokens: Some(5),
                ..Default::default()
            },
            "m",
            &defaults,
            true,
        )
        .unwrap();
        assert_eq!(b["temperature"], json!(0.0));
        assert_eq!(b["max_tokens"], json!(5));
    }

    #[test]
    fn additional_params_merge_shallowly_but_cannot_take_over_the_stream() {
        let params = json!({
            "seed": 7,
            "response_format": {"type": "json_object"},
            "temperature": 0.1,
            "max_completion_tokens": 9,
            "tools": [{"type": "function", "function": {"name": "hidden"}}],
            "model": "other-model",
            "stream": false,
            "messages": [],
            "stream_options": {"include_usage": false, "include_obfuscation": false},
        });
        let b = body(&ModelRequest {
            history: vec![Message::user("hi")].into(),
            temperature: Some(0.9),
            additional_params: params.as_object().unwrap().clone(),
            ..Default::default()
        });
        assert_eq!(b["seed"], json!(7));
        assert_eq!(b["response_format"], json!({"type": "json_object"}));
        assert_eq!(
            b["temperature"],
            json!(0.9),
            "typed fields are not overridden"
        );
        assert_eq!(b["max_completion_tokens"], json!(9), "not a typed field's");
        assert!(b.get("tools").is_none(), "{b:?}");
        assert_eq!(b["model"], json!("gpt-test"));
        assert_eq!(b["stream"], json!(true));
        assert_eq!(b["messages"].as_array().unwrap().len(), 1);
        assert_eq!(
            b["stream_options"],
            json!({"include_usage": true, "include_obfuscation": false})
        );
    }

    #[test]
    fn without_streaming_no_stream_options_are_sent() {
        let mut params = Map::new();
        params.insert("stream_options".into(), json!({"include_usage": true}));
        let b = request_body(
            &ModelRequest {
                history: vec![Message::user("hi")].into(),
                additional_params: params,
                ..Default::default()
            },
            "m",
            &Defaults::default(),
            false,
        )
        .unwrap();
        assert_eq!(b["stream"], json!(false));
        assert!(b.get("stream_options").is_none(), "{b:?}");
    }

    #[test]
    fn error_bodies() {
        let m = |s: &str| error_message(s.as_bytes());
        assert_eq!(
            m(
                r#"{"error":{"message":"Invalid 'temperature'","type":"invalid_request_error","code":null}}"#
            ),
            Some("Invalid 'temperature'".into())
        );
        assert_eq!(
            m(r#"{"error":{"message":"too long","code":"context_length_exceeded"}}"#),
            Some("too long (code: context_length_exceeded)".into())
        );
        assert_eq!(
            m(r#"{"error":"model not found"}"#),
            Some("model not found".into())
        );
        assert_eq!(m(r#"{"detail":"Not Found"}"#), Some("Not Found".into()));
        assert_eq!(
            m(r#"{"message":"  upstream timed out \n"}"#),
            Some("upstream timed out".into())
        );
        assert_eq!(m(""), None);
        let long = json!({ "error": "é".repeat(600) }).to_string();
        let t = m(&long).unwrap();
        assert!(t.ends_with('…') && t.len() <= MAX_ERROR_TEXT + '…'.len_utf8());
    }

    /// Only an error-shaped value is quoted: other bodies may carry the
    /// model's answer or echo the request.
    #[test]
    fn bodies_that_are_not_error_objects_are_never_quoted() {
        let m = |s: &str| error_message(s.as_bytes());
        for body in [
            "upstream SECRET timed out",
            r#""SECRET""#,
            r#"{"id":"c1","choices":[{"index":0,"message":{"role":"assistant","content":"SECRET"}}]}"#,
            r#"{"detail":[{"loc":["body","messages"],"msg":"bad","input":"SECRET"}]}"#,
            r#"{"error":{"type":"SECRET"}}"#,
            r#"{"error":{"message":"  "}}"#,
            "<html>SECRET</html>",
        ] {
            assert_eq!(m(body), None, "{body}");
        }
    }

    #[test]
    fn usage_counts_are_read_leniently() {
        let u = |v: Value| usage(&v);
        assert_eq!(
            u(json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})),
            Some(WireUsage {
                prompt_tokens: 3,
                completion_tokens: 2
            })
        );
        assert_eq!(
            u(json!({"prompt_tokens": u64::MAX, "completion_tokens": 0})),
            Some(WireUsage {
                prompt_tokens: MAX_TOKEN_COUNT,
                completion_tokens: 0
            })
        );
        for odd in [
            json!({"prompt_tokens": 3, "completion_tokens": null}),
            json!({"prompt_tokens": 3, "completion_tokens": 5.0}),
            json!({"prompt_tokens": -1, "completion_tokens": 2}),
            json!({"prompt_tokens": "3", "completion_tokens": 2}),
            json!({"prompt_tokens": 1e30, "completion_tokens": 2}),
            json!({"prompt_tokens": 3}),
            json!({}),
            json!(7),
        ] {
            assert_eq!(u(odd.clone()), None, "{odd}");
        }
    }

    #[test]
    fn input_estimate_counts_chars_over_four() {
        let r = ModelRequest {
            system_prompt: "abcd".into(),
            history: vec![Message::user("abcde")].into(),
            ..Default::default()
        };
        assert_eq!(estimate_input_tokens(&r), 3);
    }
}
