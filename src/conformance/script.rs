//! The scripted run the checker plays, as domain payloads (converted to the
//! wire by the engine's own `hooks::wire`): a session, then one run of two
//! turns — a user input with an e-mail address in it, a model request
//! offering tools, a model turn calling every owned tool and three tools the
//! server does not own (and an unknown tool when `invalid_tool_call` is
//! subscribed), the results, a second model request, a streamed final
//! answer, turn end, run end — then the session's end. Only the payloads
//! live here; `drive` decides what is sent when.
//!
//! The tools the server does not own stand in for the agent's other tools,
//! so a policy hook's decisions on them are exercised: a read-only lookup, a
//! destructive tool and an outbound one (the kinds policies skip or ask
//! approval for). The checker answers them itself.

use std::collections::BTreeMap;

use crate::agent::outcome::RunOutcome;
use crate::event::EventKind;
use crate::hooks::payload::{CallProblem, EventContext, Payload};
use crate::message::{Block, Message, Role, ToolCall, ToolResult, ToolSpec, Usage};
use crate::model::{ModelRequest, ModelResponse, ToolChoice};

/// The principal the checker sends unless `--principal` names another.
pub const DEFAULT_PRINCIPAL: &str = "hookwire-check";
pub const AGENT: &str = "conformance-check";
pub const MODEL: &str = "scripted";
pub const SYSTEM_PROMPT: &str =
    "You are a helpful support assistant. Use the tools you are offered when they help.";
/// Carries an e-mail address so redactors have something to do.
pub const INPUT: &str =
    "Hi, I'm ada@example.com. Please use your tools to help me with my order A-1001.";
pub const UNKNOWN_TOOL: &str = "no_such_tool";

/// A tool call of turn 1.
#[derive(Clone, Debug)]
pub struct PlannedCall {
    pub call: ToolCall,
    pub spec: ToolSpec,
    /// Executed by the hook server (`CallTool`); otherwise the checker plays
    /// a local tool and answers it itself.
    pub owned: bool,
}

pub struct Scenario {
    pub session_id: String,
    pub run_id: String,
    trace_id: String,
    events: Vec<EventKind>,
    calls: Vec<PlannedCall>,
    /// Who the checker says is calling (EventContext.principal).
    pub principal: String,
    pub principal_claims: BTreeMap<String, String>,
}

/// The tool names the checker offers and answers itself.
pub const STAND_INS: [&str; 3] = ["lookup_order", "delete_file", "send_email"];

/// Stands in for the agent's other tools (owned by other servers), with
/// the arguments the scripted model calls it with.
fn stand_in(name: &str) -> (ToolSpec, String) {
    let (description, schema, args) = match name {
        "lookup_order" => (
            "Status of an order by id.",
            r#"{"type":"object","properties":{"order_id":{"type":"string"}},"required":["order_id"]}"#,
            r#"{"order_id":"A-1001"}"#,
        ),
        "delete_file" => (
            "Delete a file.",
            r#"{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}"#,
            r#"{"path":"orders/A-1001.txt"}"#,
        ),
        _ => (
            "Send an e-mail.",
            r#"{"type":"object","properties":{"to":{"type":"string"},"body":{"type":"string"}},"required":["to","body"]}"#,
            r#"{"to":"ada@example.com","body":"Your order A-1001 has shipped."}"#,
        ),
    };
    (
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters_json_schema: schema.into(),
        },
        args.into(),
    )
}

impl Scenario {
    /// `events`: what the server subscribes to (already narrowed);
    /// `owned`: its tools with the arguments to call them with. The stand-ins
    /// follow, except those named like an owned tool.
    pub fn new(events: Vec<EventKind>, owned: Vec<(ToolSpec, String)>) -> Scenario {
        let others: Vec<(ToolSpec, String)> = STAND_INS
            .iter()
            .filter(|n| !owned.iter().any(|(spec, _)| spec.name == **n))
            .map(|n| stand_in(n))
            .collect();
        let calls: Vec<PlannedCall> = owned
            .into_iter()
            .map(|(spec, args)| (spec, args, true))
            .chain(others.into_iter().map(|(s, a)| (s, a, false)))
            .enumerate()
            .map(|(i, (spec, arguments_json, owned))| PlannedCall {
                call: ToolCall {
                    id: format!("call_1_{i}"),
                    name: spec.name.clone(),
                    arguments_json,
                },
                spec,
                owned,
            })
            .collect();
        Scenario {
            session_id: uuid::Uuid::new_v4().to_string(),
            run_id: uuid::Uuid::new_v4().to_string(),
            trace_id: uuid::Uuid::new_v4().simple().to_string(),
            events,
            calls,
            principal: DEFAULT_PRINCIPAL.into(),
            principal_claims: BTreeMap::from([("roles".to_string(), String::new())]),
        }
    }

    pub fn subscribes(&self, kind: EventKind) -> bool {
        self.events.contains(&kind)
    }

    /// Whether hookwire would open a run stream at all.
    pub fn has_run_events(&self) -> bool {
        self.events
            .iter()
            .any(|k| !matches!(k, EventKind::SessionStart | EventKind::SessionEnd))
    }

    /// Session events travel outside any run: empty run id, turn 0.
    pub fn session_context(&self) -> EventContext {
        EventContext {
            session_id: self.session_id.clone(),
            agent: AGENT.into(),
            traceparent: self.traceparent(),
            principal: self.principal.clone(),
            principal_claims: self.principal_claims.clone(),
            ..Default::default()
        }
    }

    pub fn run_context(&self, turn: u32) -> EventContext {
        EventContext {
            session_id: self.session_id.clone(),
            run_id: self.run_id.clone(),
            turn,
            agent: AGENT.into(),
            streaming: true,
            traceparent: self.traceparent(),
            tracestate: String::new(),
            principal: self.principal.clone(),
            principal_claims: self.principal_claims.clone(),
        }
    }

    /// A W3C traceparent in the run's trace with a fresh span id, as each
    /// hook call has its own span.
    pub fn traceparent(&self) -> String {
        let span = uuid::Uuid::new_v4().simple().to_string();
        format!("00-{}-{}-01", self.trace_id, &span[..16])
    }

    pub fn calls(&self) -> &[PlannedCall] {
        &self.calls
    }

    pub fn session_start(&self, hook_name: &str) -> Payload {
        Payload::SessionStart {
            hooks: vec![hook_name.to_string()],
            metadata: BTreeMap::from([("channel".to_string(), "web".to_string())]),
        }
    }

    pub fn session_end(&self) -> Payload {
        Payload::SessionEnd {
            reason: "deleted".into(),
        }
    }

    fn offered_tools(&self) -> Vec<ToolSpec> {
        self.calls.iter().map(|c| c.spec.clone()).collect()
    }

    pub fn request(&self, history: Vec<Message>) -> ModelRequest {
        ModelRequest {
            model: MODEL.into(),
            system_prompt: SYSTEM_PROMPT.into(),
            extra_context: vec![],
            history: history.into(),
            tools: self.offered_tools(),
            temperature: Some(0.2),
            max_tokens: Some(1024),
            tool_choice: ToolChoice::Auto,
            additional_params: Default::default(),
        }
    }

    /// Turn 1's answer: a call of every planned tool, plus a call of an
    /// unknown tool when invalid_tool_call hooks are there to see it.
    pub fn tool_turn(&self) -> ModelResponse {
        let mut blocks: Vec<Block> = self
            .calls
            .iter()
            .map(|c| Block::ToolCall(c.call.clone()))
            .collect();
        if self.subscribes(EventKind::InvalidToolCall) {
            blocks.push(Block::ToolCall(self.unknown_call()));
        }
        ModelResponse {
            message: Some(Message {
                role: Role::Assistant,
                blocks,
            }),
            finish_reason: "tool_calls".into(),
            usage: usage(120, 24),
            model: MODEL.into(),
            id: String::new(),
        }
    }

    pub fn unknown_call(&self) -> ToolCall {
        ToolCall {
            id: format!("call_1_{}", self.calls.len()),
            name: UNKNOWN_TOOL.into(),
            arguments_json: "{}".into(),
        }
    }

    pub fn invalid_call(&self, call: &ToolCall) -> Payload {
        Payload::InvalidToolCall {
            call: call.clone(),
            problem: CallProblem::UnknownTool,
            error: format!("unknown tool `{}`", call.name),
            available: self.offered_tools().into_iter().map(|t| t.name).collect(),
        }
    }

    /// The result hookwire gives the model for an unknown tool when every
    /// invalid_tool_call hook answers continue.
    pub fn invalid_call_result(&self, call: &ToolCall) -> ToolResult {
        let available: Vec<String> = self.offered_tools().into_iter().map(|t| t.name).collect();
        ToolResult {
            call_id: call.id.clone(),
            name: call.name.clone(),
            content: format!(
                "error: unknown tool `{}`. Available tools: {}",
                call.name,
                available.join(", ")
            ),
            is_error: true,
        }
    }

    /// What a stand-in tool returns (the checker plays it; nothing is
    /// deleted or sent).
    pub fn local_result(&self, call: &ToolCall) -> ToolResult {
        let content = match call.name.as_str() {
            "lookup_order" => "order A-1001: shipped on 2024-05-01",
            "delete_file" => "deleted orders/A-1001.txt",
            _ => "e-mail sent to ada@example.com",
        };
        ToolResult {
            call_id: call.id.clone(),
            name: call.name.clone(),
            content: content.into(),
            is_error: false,
        }
    }

    pub fn answer_text(&self, results: &[ToolResult]) -> String {
        let found: Vec<&str> = results
            .iter()
            .filter(|r| !r.is_error)
            .map(|r| r.content.as_str())
            .collect();
        if found.is_empty() {
            "Sorry, my tools could not help with that.".into()
        } else {
            format!("Here is what I found: {}", found.join("; "))
        }
    }

    /// The answer as streamed text chunks (at most three).
    pub fn deltas(text: &str) -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let size = chars.len().div_ceil(3).max(1);
        chars.chunks(size).map(|c| c.iter().collect()).collect()
    }

    pub fn answer(&self, text: &str) -> ModelResponse {
        ModelResponse {
            message: Some(Message::assistant_text(text)),
            finish_reason: "stop".into(),
            usage: usage(240, 40),
            model: MODEL.into(),
            id: String::new(),
        }
    }

    pub fn run_end(&self, final_text: &str) -> Payload {
        Payload::RunEnd {
            outcome: RunOutcome::Completed,
            reason: String::new(),
            final_text: final_text.into(),
            usage: usage(360, 64),
            turns: 2,
        }
    }
}

fn usage(input_tokens: u64, output_tokens: u64) -> Usage {
    Usage {
        input_tokens,
        output_tokens,
        estimated: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            ..Default::default()
        }
    }

    #[test]
    fn owned_tools_and_the_stand_ins_are_called() {
        let s = Scenario::new(vec![EventKind::ToolCall], vec![]);
        let names: Vec<_> = s.calls().iter().map(|c| c.call.name.as_str()).collect();
        assert_eq!(names, STAND_INS);
        assert!(s.calls().iter().all(|c| !c.owned));
        let s = Scenario::new(
            vec![EventKind::InvalidToolCall],
            vec![(spec("a"), "{}".into()), (spec("delete_file"), "{}".into())],
        );
        let names: Vec<_> = s
            .calls()
            .iter()
            .map(|c| (c.call.name.as_str(), c.owned))
            .collect();
        assert_eq!(
            names,
            [
                ("a", true),
                ("delete_file", true),
                ("lookup_order", false),
                ("send_email", false)
            ],
            "a stand-in never shadows an owned tool"
        );
        let turn = s.tool_turn().message.unwrap();
        let called: Vec<_> = turn.tool_calls().map(|c| c.id.as_str()).collect();
        assert_eq!(
            called,
            ["call_1_0", "call_1_1", "call_1_2", "call_1_3", "call_1_4"]
        );
    }

    #[test]
    fn session_events_have_no_run() {
        let s = Scenario::new(vec![EventKind::SessionStart], vec![]);
        assert!(s.session_context().run_id.is_empty());
        assert!(!s.has_run_events());
        let tp = s.run_context(1).traceparent;
        assert_eq!(tp.len(), 55, "{tp}");
        assert_ne!(tp, s.run_context(1).traceparent, "a span id per call");
    }

    #[test]
    fn deltas_rebuild_the_text() {
        let text = "Here is what I found: sunny";
        let d = Scenario::deltas(text);
        assert_eq!(d.len(), 3);
        assert_eq!(d.concat(), text);
    }
}
