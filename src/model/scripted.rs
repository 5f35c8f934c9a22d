//! The embedded deterministic model: ordered rules, first match wins.
//!
//! It exists so hookwire runs (and is tested) without any network model, and
//! so demos and hook tests are repeatable. It streams text in small chunks and
//! reports token usage like a real provider.

use std::time::Duration;

use serde::Deserialize;

use super::{BoxFuture, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse};
use crate::message::{Block, Message, Role, ToolCall, Usage};

/// Conditions of a rule; all given conditions must hold (none = always).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct When {
    /// The latest user message contains this text (case-insensitive).
    pub last_user_contains: Option<String>,
    /// The conversation ends with tool results and one contains this text.
    pub last_tool_result_contains: Option<String>,
    /// The effective system prompt plus extra context contains this text.
    pub system_contains: Option<String>,
    /// The request offers a tool of this name.
    pub tool_available: Option<String>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScriptedToolCall {
    pub name: String,
    #[serde(default = "empty_object")]
    pub arguments: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// One scripted behaviour. Text may use the placeholders `{{last_user}}`,
/// `{{last_tool_result}}`, `{{system}}`, `{{tools}}`, `{{temperature}}` and
/// `{{max_tokens}}`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    #[serde(default)]
    pub when: When,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub tool_calls: Vec<ScriptedToolCall>,
    /// How long this answer takes (overrides the model's `delay`), so runs
    /// stay in flight the way they do on a real model.
    #[serde(
        default,
        deserialize_with = "crate::config::duration::option::deserialize"
    )]
    pub delay: Option<Duration>,
}

/// Rules used when a scripted model is configured without any, and by the
/// embedded demo agent.
pub fn default_rules() -> Vec<Rule> {
    vec![
        Rule {
            when: When {
                last_tool_result_contains: Some(String::new()),
                ..When::default()
            },
            text: Some("The tool returned: {{last_tool_result}}".into()),
            tool_calls: vec![],
            delay: None,
        },
        Rule {
            when: When::default(),
            text: Some("Hello from hookwire's scripted demo model. You said: {{last_user}}".into()),
            tool_calls: vec![],
            delay: None,
        },
    ]
}

pub struct ScriptedModel {
    name: String,
    rules: Vec<Rule>,
    chunk_chars: usize,
    /// Response time of every answer whose rule sets none.
    delay: Duration,
}

impl ScriptedModel {
    pub fn new(name: impl Into<String>, rules: Vec<Rule>) -> Self {
        let rules = if rules.is_empty() {
            default_rules()
        } else {
            rules
        };
        ScriptedModel {
            name: name.into(),
            rules,
            chunk_chars: 12,
            delay: Duration::ZERO,
        }
    }

    /// Every answer takes `delay` (a rule's own `delay` wins).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// How long the answer to `request` takes: the matching rule's delay,
    /// else the model's.
    pub fn delay_for(&self, request: &ModelRequest) -> Duration {
        let facts = Facts::of(request);
        self.rules
            .iter()
            .find(|r| facts.matches(&r.when))
            .and_then(|r| r.delay)
            .unwrap_or(self.delay)
    }

    /// Pure decision: the response for a request, plus its text chunks.
    pub fn respond(&self, request: &ModelRequest) -> (ModelResponse, Vec<String>) {
        let facts = Facts::of(request);
        let rule = self.rules.iter().find(|r| facts.matches(&r.when));
        let (text, calls) = match rule {
            Some(rule) => (
                rule.text
                    .as_deref()
                    .map(|t| facts.render(t))
                    .unwrap_or_default(),
                rule.tool_calls.clone(),
            ),
            None => (String::from("(no scripted rule matched)"), vec![]),
        };
        let turn_no = request
            .history
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count()
            + 1;
        let mut blocks = Vec::new();
        if !text.is_empty() {
            blocks.push(Block::Text { text: text.clone() });
        }
        for (i, c) in calls.iter().enumerate() {
            blocks.push(Block::ToolCall(ToolCall {
                id: format!("call_{turn_no}_{i}"),
                name: c.name.clone(),
                arguments_json: c.arguments.to_string(),
            }));
        }
        let finish_reason = if calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };
        let usage = Usage {
            input_tokens: estimate_tokens(request),
            output_tokens: count_words(&text) + calls.len() as u64 * 8,
            estimated: false,
        };
        let chunks = chunk(&text, self.chunk_chars);
        (
            ModelResponse {
                message: Some(Message {
                    role: Role::Assistant,
                    blocks,
                }),
                finish_reason: finish_reason.into(),
                usage,
                model: self.name.clone(),
                id: String::new(),
            },
            chunks,
        )
    }
}

impl ModelProvider for ScriptedModel {
    fn provider_name(&self) -> &'static str {
        "scripted"
    }

    fn model_name(&self) -> &str {
        &self.name
    }

    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        on_delta: DeltaSink<'a>,
    ) -> BoxFuture<'a, Result<ModelResponse, ModelError>> {
        Box::pin(async move {
            // Only a configured delay pays for matching the rules twice.
            if !self.delay.is_zero() || self.rules.iter().any(|r| r.delay.is_some()) {
                let delay = self.delay_for(request);
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
            }
            let (response, chunks) = self.respond(request);
            for c in &chunks {
                on_delta(c);
            }
            Ok(response)
        })
    }
}

struct Facts {
    last_user: String,
    last_tool_result: Option<String>,
    system: String,
    tools: Vec<String>,
    temperature: Option<f64>,
    max_tokens: Option<u32>,
}

impl Facts {
    fn of(request: &ModelRequest) -> Self {
        let last_user = request
            .history
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .map(Message::text)
            .unwrap_or_default();
        let last_tool_result = request
            .history
            .last()
            .filter(|m| m.role == Role::Tool)
            .map(|m| {
                m.tool_results_iter()
                    .map(|r| r.content.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            });
        Facts {
            last_user,
            last_tool_result,
            system: request.system_text(),
            tools: request.tools.iter().map(|t| t.name.clone()).collect(),
            temperature: request.temperature,
            max_tokens: request.max_tokens,
        }
    }

    fn matches(&self, when: &When) -> bool {
        let contains =
            |hay: &str, needle: &str| hay.to_lowercase().contains(&needle.to_lowercase());
        if let Some(n) = &when.last_user_contains {
            // A trailing tool result means the user message was already answered
            // with a tool call; do not match it again and loop.
            if self.last_tool_result.is_some() || !contains(&self.last_user, n) {
                return false;
            }
        }
        if let Some(n) = &when.last_tool_result_contains {
            match &self.last_tool_result {
                Some(r) if contains(r, n) => {}
                _ => return false,
            }
        }
        if let Some(n) = &when.system_contains {
            if !contains(&self.system, n) {
                return false;
            }
        }
        if let Some(t) = &when.tool_available {
            if !self.tools.iter().any(|x| x == t) {
                return false;
            }
        }
        true
    }

    /// Fills the template's placeholders in one pass over the template
    /// only: a value put in is never read for placeholders again. Chained
    /// replaces expanded `{{system}}` typed by a user into the system
    /// prompt (and then each copy of it), thousands of copies per input.
    fn render(&self, template: &str) -> String {
        let mut out = String::with_capacity(template.len());
        let mut rest = template;
        while let Some(open) = rest.find("{{") {
            out.push_str(&rest[..open]);
            let after = &rest[open + 2..];
            let Some(close) = after.find("}}") else {
                rest = &rest[open..];
                break;
            };
            let value = match &after[..close] {
                "last_user" => Some(self.last_user.clone()),
                "last_tool_result" => Some(self.last_tool_result.clone().unwrap_or_default()),
                "system" => Some(self.system.clone()),
                "tools" => Some(self.tools.join(", ")),
                "temperature" => Some(self.temperature.map(|t| t.to_string()).unwrap_or_default()),
                "max_tokens" => Some(self.max_tokens.map(|t| t.to_string()).unwrap_or_default()),
                _ => None,
            };
            match value {
                Some(v) => {
                    out.push_str(&v);
                    rest = &after[close + 2..];
                }
                // Not a placeholder: kept, and the search goes on after
                // its braces.
                None => {
                    out.push_str("{{");
                    rest = after;
                }
            }
        }
        out.push_str(rest);
        out
    }
}

fn count_words(s: &str) -> u64 {
    s.split_whitespace().count() as u64
}

fn estimate_tokens(request: &ModelRequest) -> u64 {
    let mut n = count_words(&request.system_text());
    for m in &request.history {
        for b in &m.blocks {
            n += match b {
                Block::Text { text } | Block::Reasoning { text } => count_words(text),
                Block::ToolCall(c) => 4 + count_words(&c.arguments_json),
                Block::ToolResult(r) => 4 + count_words(&r.content),
            };
        }
    }
    n
}

/// Splits on char boundaries into pieces of about `size` chars, preferring
/// to break after whitespace, so deltas look like a real stream.
fn chunk(text: &str, size: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in text.chars() {
        cur.push(ch);
        if cur.chars().count() >= size && ch.is_whitespace() || cur.chars().count() >= size * 2 {
            out.push(std::mem::take(&mut cur));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(history: Vec<Message>) -> ModelRequest {
        ModelRequest {
            model: "scripted".into(),
            history: history.into(),
            ..Default::default()
        }
    }

    fn weather_rules() -> Vec<Rule> {
        serde_norway::from_str(
            r#"
- when: { last_user_contains: "weather" }
  tool_calls: [ { name: get_weather, arguments: { city: "Paris" } } ]
- when: { last_tool_result_contains: "sunny" }
  text: "It is sunny in Paris."
- text: "You said: {{last_user}}"
"#,
        )
        .unwrap()
    }

    #[test]
    fn first_matching_rule_wins_and_calls_tools() {
        let m = ScriptedModel::new("s", weather_rules());
        let (r, chunks) = m.respond(&req(vec![Message::user("What's the WEATHER?")]));
        let msg = r.message.unwrap();
        let calls: Vec<_> = msg.tool_calls().collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments_json, r#"{"city":"Paris"}"#);
        assert_eq!(r.finish_reason, "tool_calls");
        assert!(chunks.is_empty());
    }

    #[test]
    fn tool_result_rule_matches_only_after_results() {
        let m = ScriptedModel::new("s", weather_rules());
        let history = vec![
            Message::user("weather?"),
            Message {
                role: Role::Assistant,
                blocks: vec![],
            },
            Message::tool_results(vec![crate::message::ToolResult {
                call_id: "c".into(),
                name: "get_weather".into(),
                content: "sunny, 21C".into(),
                is_error: false,
            }]),
        ];
        let (r, chunks) = m.respond(&req(history));
        assert_eq!(r.message.unwrap().text(), "It is sunny in Paris.");
        assert_eq!(chunks.concat(), "It is sunny in Paris.");
        assert!(chunks.len() > 1, "streams in several chunks");
    }

    /// A value put in is never read for placeholders again: `{{system}}`
    /// typed by a user came back as the system prompt.
    #[test]
    fn placeholders_in_what_was_filled_in_stay_as_they_are() {
        let m = ScriptedModel::new("s", weather_rules());
        let mut r = req(vec![Message::user("{{system}} and {{tools}} {{nope}} {{")]);
        r.system_prompt = "S3CR3T".into();
        let (r, _) = m.respond(&r);
        assert_eq!(
            r.message.unwrap().text(),
            "You said: {{system}} and {{tools}} {{nope}} {{"
        );
        let rules: Vec<Rule> = serde_norway::from_str(
            "- text: \"{{nope}} {{system}}|{{max_tokens}}|{{ {{tools}}}}\"\n",
        )
        .unwrap();
        let m = ScriptedModel::new("s", rules);
        let mut r = req(vec![Message::user("hi")]);
        r.system_prompt = "sys".into();
        let (r, _) = m.respond(&r);
        assert_eq!(r.message.unwrap().text(), "{{nope}} sys||{{ }}");
    }

    #[test]
    fn template_and_usage() {
        let m = ScriptedModel::new("s", weather_rules());
        let (r, _) = m.respond(&req(vec![Message::user("hello there")]));
        assert_eq!(r.message.unwrap().text(), "You said: hello there");
        assert_eq!(r.usage.output_tokens, 4);
        assert_eq!(r.usage.input_tokens, 2);
    }

    /// Paused time: the answer comes exactly when the delay has passed,
    /// the rule's own delay winning over the model's.
    #[tokio::test(start_paused = true)]
    async fn delay_holds_the_answer_and_a_rule_delay_wins() {
        let rules: Vec<Rule> = serde_norway::from_str(
            r#"
- when: { last_user_contains: "slow" }
  text: "slow answer"
  delay: 7s
- text: "You said: {{last_user}}"
"#,
        )
        .unwrap();
        let m = ScriptedModel::new("s", rules).with_delay(Duration::from_secs(2));
        let sink = |_: &str| {};
        for (input, want) in [("hello", 2), ("a slow one", 7)] {
            let r = req(vec![Message::user(input)]);
            let t = tokio::time::Instant::now();
            let answer = m.complete(&r, &sink).await.unwrap();
            assert_eq!(t.elapsed(), Duration::from_secs(want), "{input}");
            assert!(answer.message.is_some());
        }
        let fast = ScriptedModel::new("s", vec![]);
        let t = tokio::time::Instant::now();
        fast.complete(&req(vec![Message::user("hi")]), &sink)
            .await
            .unwrap();
        assert_eq!(t.elapsed(), Duration::ZERO, "no delay configured");
    }

    #[test]
    fn default_rules_answer_sensibly() {
        let m = ScriptedModel::new("s", vec![]);
        let (r, _) = m.respond(&req(vec![Message::user("hi")]));
        assert!(r.message.unwrap().text().contains("You said: hi"));
    }
}
