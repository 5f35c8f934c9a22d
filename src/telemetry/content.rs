//! What a run's spans say about its content: the OpenTelemetry GenAI JSON
//! shapes (messages made of typed parts, system instructions as parts, tool
//! definitions), and the run's sticky telemetry redactions.
//!
//! A hook's `telemetry_redaction` covers one piece of content, and from then
//! on every record of that content in the run shows the redaction:
//!
//! | event | the redaction covers | where it shows |
//! |---|---|---|
//! | `run_start` | the run's user message, as committed | input messages of every later `chat` span |
//! | `model_request` | that call's input (messages, system instructions) | that `chat` span; its messages in later inputs |
//! | `model_response` | the accepted assistant message: text, reasoning and its tool calls' arguments | that `chat` span's output, later inputs, its calls' `execute_tool` arguments |
//! | `invalid_tool_call`, `tool_call` | that call's arguments | its `execute_tool` span, later inputs |
//! | `tool_result` | that call's result, as committed | its `execute_tool` span, later inputs |
//! | `turn_end` | the final assistant message | its `chat` span's output, later inputs (after `continue_run`) |
//!
//! Under blocking `turn_end` hooks a final answer's `chat` span stays open
//! until they ran: its output is recorded once they accepted the answer,
//! and not at all when one terminated the run (or the run stopped first).
//!
//! A redacted message keeps its tool calls' ids and names (they are on the
//! `execute_tool` spans anyway), so a backend still pairs calls and results.
//! Content is matched by value, exactly as hookwire committed it; a
//! `model_request` hook that rewrites the history of one call redacts that
//! call itself. The scope is the run: redactions are not stored with the
//! transcript, so a later run of the session records earlier messages as
//! they are.
//!
//! Tool-call arguments reach telemetry only after the `tool_call` hooks ran:
//! a `chat` span's output lists the calls without their arguments, which
//! appear on the `execute_tool` span and in later input messages.

use crate::lock::LockExt;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use serde::Serialize;
use serde_json::Value;
use tracing::Span;

use super::attrs;
use super::spans::ContentCapture;
use crate::message::{Block, Message, Role, ToolCall, ToolResult, ToolSpec};
use crate::model::ModelRequest;

/// One run's view of its content for telemetry. Every method is a no-op
/// with content capture off.
#[derive(Debug, Default)]
pub struct ContentView {
    capture: ContentCapture,
    redactions: Mutex<Redactions>,
}

/// The redacted form of each piece of content, keyed by the content itself
/// (a `model_request` redaction adds one per message of its input, so a
/// long session can hold many). An empty map answers without hashing.
#[derive(Debug, Default)]
struct Redactions {
    messages: HashMap<Message, String>,
    arguments: HashMap<ToolCall, String>,
    results: HashMap<ToolResult, String>,
}

impl Redactions {
    fn message(&self, m: &Message) -> Option<&str> {
        self.messages.get(m).map(String::as_str)
    }

    fn arguments(&self, c: &ToolCall) -> Option<&str> {
        self.arguments.get(c).map(String::as_str)
    }

    fn result(&self, r: &ToolResult) -> Option<&str> {
        self.results.get(r).map(String::as_str)
    }

    /// Whether `call` belongs to a message redacted as a whole.
    fn covers_call(&self, call: &ToolCall) -> bool {
        self.messages
            .keys()
            .any(|m| m.tool_calls().any(|c| c == call))
    }

    /// `m` in the conventions' shape, with every redaction that applies.
    fn chat_message<'a>(&'a self, m: &'a Message) -> ChatMessage<'a> {
        if let Some(redaction) = self.message(m) {
            return self.redacted(m, redaction);
        }
        let parts = m
            .blocks
            .iter()
            .map(|b| match b {
                Block::Text { text } => Part::Text { content: text },
                Block::Reasoning { text } => Part::Reasoning { content: text },
                Block::ToolCall(c) => Part::ToolCall {
                    id: non_empty(&c.id),
                    name: &c.name,
                    arguments: Some(json_or_text(self.arguments(c).unwrap_or(&c.arguments_json))),
                },
                Block::ToolResult(r) => Part::ToolCallResponse {
                    id: non_empty(&r.call_id),
                    response: self.result(r).unwrap_or(&r.content),
                },
            })
            .collect();
        ChatMessage {
            role: role(m.role),
            parts,
            finish_reason: None,
        }
    }

    /// The accepted assistant message as a `chat` span's output: its
    /// redacted form, or its parts with tool calls listed without arguments.
    fn output_message<'a>(&'a self, m: &'a Message, finish_reason: &'a str) -> ChatMessage<'a> {
        let mut out = match self.message(m) {
            Some(r) => self.redacted(m, r),
            None => {
                let mut out = self.chat_message(m);
                for part in &mut out.parts {
                    if let Part::ToolCall { arguments, .. } = part {
                        *arguments = None;
                    }
                }
                out
            }
        };
        out.finish_reason = Some(semconv_finish_reason(finish_reason));
        out
    }

    /// What an `execute_tool` span records as `call`'s arguments once its
    /// `tool_call` hooks ran: their redaction, else the effective arguments
    /// (`None`: covered by a message redaction and not rewritten).
    fn arguments_record<'a>(&'a self, call: &ToolCall, effective: &'a ToolCall) -> Option<&'a str> {
        match self.arguments(call) {
            Some(r) => Some(r),
            None if self.covers_call(call) && effective.arguments_json == call.arguments_json => {
                None
            }
            None => Some(&effective.arguments_json),
        }
    }

    /// A message replaced by `redaction`: one text part, then its tool calls
    /// by id and name (arguments only where a call hook redacted them). A
    /// message of tool results keeps one response per call id instead, each
    /// the result's own redaction or `redaction`.
    fn redacted<'a>(&'a self, m: &'a Message, redaction: &'a str) -> ChatMessage<'a> {
        let mut parts: Vec<Part<'a>> = m
            .tool_results_iter()
            .map(|r| Part::ToolCallResponse {
                id: non_empty(&r.call_id),
                response: self.result(r).unwrap_or(redaction),
            })
            .collect();
        if parts.is_empty() {
            parts.push(Part::Text { content: redaction });
        }
        parts.extend(m.tool_calls().map(|c| Part::ToolCall {
            id: non_empty(&c.id),
            name: &c.name,
            arguments: self.arguments(c).map(json_or_text),
        }));
        ChatMessage {
            role: role(m.role),
            parts,
            finish_reason: None,
        }
    }
}

impl ContentView {
    pub fn new(capture: ContentCapture) -> Self {
        ContentView {
            capture,
            redactions: Mutex::default(),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.capture.is_enabled()
    }

    fn redactions(&self) -> MutexGuard<'_, Redactions> {
        // Plain data, valid after any panic elsewhere: never propagate one.
        self.redactions.locked()
    }

    /// A `run_start`, `model_response` or `turn_end` hook redacted
    /// `message` (as committed to the transcript).
    pub fn redact_message(&self, message: &Message, redaction: Option<String>) {
        if let Some(r) = redaction.filter(|_| self.is_enabled()) {
            self.redactions().messages.insert(message.clone(), r);
        }
    }

    /// A `model_request` hook redacted a call's input: each of its messages
    /// (as committed, and as a hook's `history` patch sent them) shows the
    /// redaction in every later record too, unless it already has one of
    /// its own. Otherwise a hook that redacts only when the newest message
    /// holds a secret would see that secret recorded raw at the next call.
    pub fn redact_input<'m>(
        &self,
        messages: impl IntoIterator<Item = &'m Message>,
        redaction: &str,
    ) {
        if !self.is_enabled() {
            return;
        }
        let mut redactions = self.redactions();
        for m in messages {
            if !redactions.messages.contains_key(m) {
                redactions.messages.insert(m.clone(), redaction.to_string());
            }
        }
    }

    /// An `invalid_tool_call` or `tool_call` hook redacted the arguments of
    /// `call` (the call as the model made it).
    pub fn redact_arguments(&self, call: &ToolCall, redaction: Option<String>) {
        if let Some(r) = redaction.filter(|_| self.is_enabled()) {
            self.redactions().arguments.insert(call.clone(), r);
        }
    }

    /// A `tool_result` hook redacted `result` (as committed).
    pub fn redact_result(&self, result: &ToolResult, redaction: Option<String>) {
        if let Some(r) = redaction.filter(|_| self.is_enabled()) {
            self.redactions().results.insert(result.clone(), r);
        }
    }

    /// The input of one model call on its `chat` span: tool definitions,
    /// then system instructions and input messages, or, when a
    /// `model_request` hook redacted this call, the redaction as the one
    /// input message.
    pub fn record_request(&self, span: &Span, request: &ModelRequest, redaction: Option<&str>) {
        if !self.is_enabled() {
            return;
        }
        if !request.tools.is_empty() {
            let defs: Vec<ToolDefinition> = request.tools.iter().map(ToolDefinition::of).collect();
            self.record_json(span, attrs::GEN_AI_TOOL_DEFINITIONS, &defs);
        }
        if let Some(r) = redaction {
            let messages = [ChatMessage {
                role: role(Role::User),
                parts: vec![Part::Text { content: r }],
                finish_reason: None,
            }];
            self.record_json(span, attrs::GEN_AI_INPUT_MESSAGES, &messages);
            return;
        }
        let system: Vec<Part> = std::iter::once(request.system_prompt.as_str())
            .chain(request.extra_context.iter().map(String::as_str))
            .filter(|t| !t.is_empty())
            .map(|content| Part::Text { content })
            .collect();
        if !system.is_empty() {
            self.record_json(span, attrs::GEN_AI_SYSTEM_INSTRUCTIONS, &system);
        }
        let redactions = self.redactions();
        let messages: Vec<ChatMessage> = request
            .history
            .iter()
            .map(|m| redactions.chat_message(m))
            .collect();
        self.record_json(span, attrs::GEN_AI_INPUT_MESSAGES, &messages);
    }

    /// The accepted assistant message on its `chat` span, after the
    /// `model_response` hooks (register their redaction first). Tool calls
    /// are listed without arguments: no `tool_call` hook has seen them yet.
    pub fn record_response(&self, span: &Span, message: &Message, finish_reason: &str) {
        if !self.is_enabled() {
            return;
        }
        let redactions = self.redactions();
        let out = redactions.output_message(message, finish_reason);
        self.record_json(span, attrs::GEN_AI_OUTPUT_MESSAGES, &[out]);
    }

    /// A call's arguments on its `execute_tool` span, after the `tool_call`
    /// hooks: their redaction, else the effective arguments. Arguments
    /// covered by a `model_response` redaction of their message are left
    /// out unless a hook rewrote them.
    pub fn record_arguments(&self, span: &Span, call: &ToolCall, effective: &ToolCall) {
        if !self.is_enabled() {
            return;
        }
        let redactions = self.redactions();
        if let Some(text) = redactions.arguments_record(call, effective) {
            self.capture
                .record(span, attrs::GEN_AI_TOOL_CALL_ARGUMENTS, text);
        }
    }

    /// A call's result on its `execute_tool` span (its redaction, if a
    /// `tool_result` hook gave one).
    pub fn record_result(&self, span: &Span, result: &ToolResult) {
        if !self.is_enabled() {
            return;
        }
        let redactions = self.redactions();
        let text = redactions.result(result).unwrap_or(&result.content);
        self.capture
            .record(span, attrs::GEN_AI_TOOL_CALL_RESULT, text);
    }

    fn record_json(&self, span: &Span, key: &'static str, value: &impl Serialize) {
        // Serializing these types cannot fail (string keys, no maps of
        // non-string keys); an empty attribute would be the only fallout.
        let json = serde_json::to_string(value).unwrap_or_default();
        self.capture.record(span, key, &json);
    }
}

/// A message in the conventions' shape (`ChatMessage`, or `OutputMessage`
/// with its `finish_reason`).
#[derive(Debug, Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    parts: Vec<Part<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    finish_reason: Option<&'a str>,
}

/// The message parts hookwire produces. A call or result without an id
/// gets `null`, as the conventions allow.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part<'a> {
    Text {
        content: &'a str,
    },
    Reasoning {
        content: &'a str,
    },
    ToolCall {
        id: Option<&'a str>,
        name: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        arguments: Option<Value>,
    },
    ToolCallResponse {
        id: Option<&'a str>,
        response: &'a str,
    },
}

/// A `FunctionToolDefinition`.
#[derive(Debug, Serialize)]
struct ToolDefinition<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    name: &'a str,
    description: &'a str,
    /// Left out when the tool declares none (any object) or it is not JSON.
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
}

impl<'a> ToolDefinition<'a> {
    fn of(spec: &'a ToolSpec) -> Self {
        ToolDefinition {
            kind: "function",
            name: &spec.name,
            description: &spec.description,
            parameters: serde_json::from_str(&spec.parameters_json_schema).ok(),
        }
    }
}

fn role(role: Role) -> &'static str {
    match role {
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}

fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

/// Arguments as the JSON they are (backends render objects), or as text
/// when they are not JSON (a malformed call, a plain-text redaction).
fn json_or_text(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.to_owned()))
}

/// The conventions' finish reasons are singular (`tool_call`) where
/// OpenAI's are plural; other values pass through (the schema allows any
/// string).
fn semconv_finish_reason(reason: &str) -> &str {
    match reason {
        "tool_calls" | "function_call" => "tool_call",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn call(id: &str, args: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            name: "get_weather".into(),
            arguments_json: args.into(),
        }
    }

    fn result(id: &str, content: &str) -> ToolResult {
        ToolResult {
            call_id: id.into(),
            name: "get_weather".into(),
            content: content.into(),
            is_error: false,
        }
    }

    fn assistant(blocks: Vec<Block>) -> Message {
        Message {
            role: Role::Assistant,
            blocks,
        }
    }

    fn json_of(m: ChatMessage) -> Value {
        serde_json::to_value(m).unwrap()
    }

    fn on() -> ContentView {
        ContentView::new(ContentCapture::new(true))
    }

    #[test]
    fn messages_take_the_conventions_shape() {
        let r = Redactions::default();
        let m = assistant(vec![
            Block::Reasoning {
                text: "think".into(),
            },
            Block::Text {
                text: "calling".into(),
            },
            Block::ToolCall(call("c1", r#"{"city":"Paris"}"#)),
            Block::ToolCall(call("", "{not json")),
        ]);
        assert_eq!(
            json_of(r.chat_message(&m)),
            json!({"role": "assistant", "parts": [
                {"type": "reasoning", "content": "think"},
                {"type": "text", "content": "calling"},
                {"type": "tool_call", "id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}},
                {"type": "tool_call", "id": null, "name": "get_weather", "arguments": "{not json"},
            ]})
        );
        let t = Message::tool_results(vec![result("c1", "sunny")]);
        assert_eq!(
            json_of(r.chat_message(&t)),
            json!({"role": "tool", "parts": [
                {"type": "tool_call_response", "id": "c1", "response": "sunny"},
            ]})
        );
        assert_eq!(
            json_of(r.chat_message(&Message::user("hi"))),
            json!({"role": "user", "parts": [{"type": "text", "content": "hi"}]})
        );
    }

    #[test]
    fn output_lists_calls_without_arguments_and_a_semconv_finish_reason() {
        let r = Redactions::default();
        let m = assistant(vec![
            Block::Text { text: "ok".into() },
            Block::ToolCall(call("c1", r#"{"city":"Paris"}"#)),
        ]);
        assert_eq!(
            json_of(r.output_message(&m, "tool_calls")),
            json!({"role": "assistant", "finish_reason": "tool_call", "parts": [
                {"type": "text", "content": "ok"},
                {"type": "tool_call", "id": "c1", "name": "get_weather"},
            ]})
        );
        let text = Message::assistant_text("done");
        assert_eq!(
            json_of(r.output_message(&text, "length"))["finish_reason"],
            "length"
        );
    }

    #[test]
    fn redactions_replace_exactly_the_content_they_cover() {
        let view = on();
        let secret_input = Message::user("my key is sk-1");
        let c1 = call("c1", r#"{"city":"sk-2"}"#);
        let c2 = call("c2", r#"{"city":"Oslo"}"#);
        let r1 = result("c1", "sk-3");
        view.redact_message(&secret_input, Some("[input]".into()));
        view.redact_arguments(&c1, Some(r#"{"city":"[args]"}"#.into()));
        view.redact_result(&r1, Some("[result]".into()));
        // No redaction given: nothing registered.
        view.redact_result(&result("c2", "fine"), None);

        let r = view.redactions();
        assert_eq!(
            json_of(r.chat_message(&secret_input)),
            json!({"role": "user", "parts": [{"type": "text", "content": "[input]"}]})
        );
        // Another message is not covered.
        assert_eq!(
            json_of(r.chat_message(&Message::user("hello")))["parts"][0]["content"],
            "hello"
        );
        let m = assistant(vec![
            Block::ToolCall(c1.clone()),
            Block::ToolCall(c2.clone()),
        ]);
        let parts = json_of(r.chat_message(&m))["parts"].clone();
        assert_eq!(parts[0]["arguments"], json!({"city": "[args]"}));
        assert_eq!(parts[1]["arguments"], json!({"city": "Oslo"}));
        let t = Message::tool_results(vec![r1.clone(), result("c2", "fine")]);
        let parts = json_of(r.chat_message(&t))["parts"].clone();
        assert_eq!(parts[0]["response"], "[result]");
        assert_eq!(parts[1]["response"], "fine");
        // The execute_tool span of c1 shows the redaction too.
        assert_eq!(r.arguments_record(&c1, &c1), Some(r#"{"city":"[args]"}"#));
        assert_eq!(r.result(&r1), Some("[result]"));
        assert_eq!(r.arguments_record(&c2, &c2), Some(r#"{"city":"Oslo"}"#));
    }

    #[test]
    fn a_redacted_message_keeps_only_call_ids_and_names() {
        let view = on();
        let c1 = call("c1", r#"{"key":"sk-9"}"#);
        let c2 = call("c2", r#"{"key":"sk-8"}"#);
        let m = assistant(vec![
            Block::Text {
                text: "using sk-9".into(),
            },
            Block::ToolCall(c1.clone()),
            Block::ToolCall(c2.clone()),
        ]);
        view.redact_message(&m, Some("[answer]".into()));
        view.redact_arguments(&c2, Some("[c2 args]".into()));
        let r = view.redactions();
        let expected_parts = json!([
            {"type": "text", "content": "[answer]"},
            {"type": "tool_call", "id": "c1", "name": "get_weather"},
            {"type": "tool_call", "id": "c2", "name": "get_weather", "arguments": "[c2 args]"},
        ]);
        assert_eq!(json_of(r.chat_message(&m))["parts"], expected_parts);
        let out = json_of(r.output_message(&m, "tool_calls"));
        assert_eq!(out["parts"], expected_parts);
        assert_eq!(out["finish_reason"], "tool_call");
        // The covered arguments stay off the execute_tool span unless a
        // tool_call hook redacted or rewrote them.
        assert_eq!(r.arguments_record(&c1, &c1), None);
        assert_eq!(r.arguments_record(&c2, &c2), Some("[c2 args]"));
        let rewritten = call("c1", r#"{"key":"[masked]"}"#);
        assert_eq!(
            r.arguments_record(&c1, &rewritten),
            Some(r#"{"key":"[masked]"}"#)
        );
    }

    #[test]
    fn an_input_redaction_covers_each_message_but_keeps_their_own() {
        let view = on();
        let user = Message::user("my key is sk-1");
        let asked = Message::user("which one?");
        let results = Message::tool_results(vec![result("c1", "sk-5"), result("c2", "fine")]);
        view.redact_message(&asked, Some("[own]".into()));
        view.redact_result(&result("c2", "fine"), Some("[c2]".into()));
        view.redact_input([&user, &asked, &results], "[input]");
        let r = view.redactions();
        assert_eq!(r.message(&user), Some("[input]"));
        // A message's own, earlier redaction stands.
        assert_eq!(r.message(&asked), Some("[own]"));
        // Results keep their call ids (a backend still pairs them), each
        // with its own redaction or the input's.
        assert_eq!(
            json_of(r.chat_message(&results)),
            json!({"role": "tool", "parts": [
                {"type": "tool_call_response", "id": "c1", "response": "[input]"},
                {"type": "tool_call_response", "id": "c2", "response": "[c2]"},
            ]})
        );
    }

    #[test]
    fn the_latest_redaction_of_a_piece_of_content_wins() {
        let view = on();
        let m = Message::user("x");
        view.redact_message(&m, Some("[first]".into()));
        view.redact_message(&m, Some("[second]".into()));
        let r = view.redactions();
        assert_eq!(r.messages.len(), 1);
        assert_eq!(r.message(&m), Some("[second]"));
    }

    #[test]
    fn nothing_is_kept_with_capture_off() {
        let view = ContentView::new(ContentCapture::new(false));
        view.redact_message(&Message::user("x"), Some("[r]".into()));
        view.redact_arguments(&call("c", "{}"), Some("[r]".into()));
        view.redact_result(&result("c", "y"), Some("[r]".into()));
        view.redact_input([&Message::user("z")], "[r]");
        let r = view.redactions();
        assert!(r.messages.is_empty() && r.arguments.is_empty() && r.results.is_empty());
    }

    #[test]
    fn tool_definitions_are_function_definitions() {
        let spec = ToolSpec {
            name: "get_weather".into(),
            description: "Weather".into(),
            parameters_json_schema: r#"{"type":"object"}"#.into(),
        };
        let any = ToolSpec {
            name: "ping".into(),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value([ToolDefinition::of(&spec), ToolDefinition::of(&any)]).unwrap(),
            json!([
                {"type": "function", "name": "get_weather", "description": "Weather", "parameters": {"type": "object"}},
                {"type": "function", "name": "ping", "description": ""},
            ])
        );
    }
}
