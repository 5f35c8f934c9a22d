//! The demo hook server's behaviour: a small guard of the kind hookwire
//! exists to call. It redacts API-key-looking strings from the user input
//! at `run_start`, denies every `delete_*` tool at `tool_call`, and owns two
//! tools: `get_weather` (canned demo data) and `delete_file` (declared so
//! the policy has something to deny; it never deletes anything).

use tonic::Status;

use crate::hook_server::{self, Ctx, Hook, Reply};
use crate::pb;

/// The hook's name in Describe and in the demo config.
pub const NAME: &str = "demo-guard";
/// What a redacted key becomes.
pub const REDACTED: &str = "[REDACTED:api_key]";
/// Keys start with this and go on with at least `MIN_KEY_TAIL` key
/// characters (OpenAI's `sk-…`, Anthropic's `sk-ant-…`, and look-alikes).
const KEY_PREFIX: &str = "sk-";
const MIN_KEY_TAIL: usize = 8;

/// The guard (stateless: nothing is kept between events or runs).
pub struct DemoGuard;

/// Replaces every API-key-looking token; returns the text and how many.
pub fn redact_api_keys(text: &str) -> (String, usize) {
    let is_key_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
    let mut out = String::with_capacity(text.len());
    let mut count = 0;
    let mut rest = text;
    while let Some(at) = rest.find(KEY_PREFIX) {
        // Only at the start of a word: `task-` must not look like a key.
        let starts_word = !rest[..at].chars().next_back().is_some_and(is_key_char);
        let after = &rest[at + KEY_PREFIX.len()..];
        let tail = after.find(|c: char| !is_key_char(c)).unwrap_or(after.len());
        out.push_str(&rest[..at]);
        if starts_word && tail >= MIN_KEY_TAIL {
            out.push_str(REDACTED);
            count += 1;
        } else {
            out.push_str(&rest[at..at + KEY_PREFIX.len() + tail]);
        }
        rest = &after[tail..];
    }
    out.push_str(rest);
    (out, count)
}

fn tool(name: &str, description: &str, schema: &str) -> pb::ToolSpec {
    pb::ToolSpec {
        name: name.into(),
        description: description.into(),
        parameters_json_schema: schema.into(),
    }
}

fn argument(call: &pb::ToolCall, key: &str) -> Option<String> {
    serde_json::from_str::<serde_json::Value>(&call.arguments_json)
        .ok()?
        .get(key)?
        .as_str()
        .map(str::to_string)
}

#[tonic::async_trait]
impl Hook for DemoGuard {
    fn describe(&self) -> pb::DescribeResponse {
        let mut d =
            hook_server::describe(NAME, &[pb::EventKind::RunStart, pb::EventKind::ToolCall]);
        d.tools = vec![
            tool(
                "get_weather",
                "Current weather for a city (demo data).",
                r#"{"type":"object","properties":{"city":{"type":"string","examples":["Paris"]}},"required":["city"]}"#,
            ),
            tool(
                "delete_file",
                "Delete a file. The demo policy denies it.",
                r#"{"type":"object","properties":{"path":{"type":"string","examples":["notes.txt"]}},"required":["path"]}"#,
            ),
        ];
        d
    }

    async fn run_start(&self, _: &Ctx, ev: pb::RunStartEvent) -> Reply<pb::RunStartVerdict> {
        let (redacted, count) = redact_api_keys(&ev.input);
        if count == 0 {
            return Reply::new(pb::RunStartVerdict {
                action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
            });
        }
        let noun = if count == 1 { "API key" } else { "API keys" };
        Reply::new(hook_server::rewrite_input(redacted.clone()))
            .reason(format!("redacted {count} {noun}"))
            .redact_telemetry(redacted)
    }

    async fn tool_call(&self, _: &Ctx, ev: pb::ToolCallEvent) -> Reply<pb::ToolCallVerdict> {
        let name = ev.call.map(|c| c.name).unwrap_or_default();
        if name.starts_with("delete_") {
            return Reply::new(hook_server::skip_tool(
                format!(
                    "The tool `{name}` is denied by policy: nothing is deleted. Answer without it."
                ),
                true,
            ))
            .reason("delete_* tools are denied");
        }
        Reply::new(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::Proceed(pb::Continue {})),
        })
    }

    async fn call_tool(&self, _: &Ctx, call: pb::ToolCall) -> Result<pb::CallToolResponse, Status> {
        match call.name.as_str() {
            "get_weather" => Ok(match argument(&call, "city") {
                Some(city) => pb::CallToolResponse {
                    content: format!("sunny, 21°C in {city} (demo data)"),
                    is_error: false,
                },
                None => pb::CallToolResponse {
                    content: "get_weather needs a `city` string".into(),
                    is_error: true,
                },
            }),
            // Only reached if a configuration let it past the policy.
            "delete_file" => Ok(pb::CallToolResponse {
                content: "the demo never deletes anything".into(),
                is_error: true,
            }),
            other => Err(Status::not_found(format!("{NAME} owns no tool `{other}`"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_redacted_and_look_alikes_are_not() {
        assert_eq!(
            redact_api_keys("my key is sk-live-4f9a8b7c6d, ok?"),
            (format!("my key is {REDACTED}, ok?"), 1)
        );
        assert_eq!(
            redact_api_keys("sk-abcdefgh and sk-ant-api03-XYZ12345"),
            (format!("{REDACTED} and {REDACTED}"), 2)
        );
        // Too short, or not at the start of a word.
        assert_eq!(redact_api_keys("ask-me sk-short task-12345678").1, 0);
        assert_eq!(
            redact_api_keys("no secrets here"),
            ("no secrets here".into(), 0)
        );
    }
}
