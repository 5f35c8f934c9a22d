//! Provider-agnostic, block-structured conversation messages.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
    Tool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub blocks: Vec<Block>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Block {
    Text { text: String },
    Reasoning { text: String },
    ToolCall(ToolCall),
    ToolResult(ToolResult),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// JSON text, kept verbatim so what the model sent is what hooks see.
    pub arguments_json: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolResult {
    pub call_id: String,
    pub name: String,
    pub content: String,
    pub is_error: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema text; empty means any object.
    pub parameters_json_schema: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub estimated: bool,
}

impl Usage {
    /// Sums a run's turns. Counts come from model endpoints, so they
    /// saturate instead of overflowing.
    pub fn add(&mut self, other: Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.estimated |= other.estimated;
    }
}

impl Message {
    pub fn user(text: impl Into<String>) -> Self {
        Message {
            role: Role::User,
            blocks: vec![Block::Text { text: text.into() }],
        }
    }

    pub fn assistant_text(text: impl Into<String>) -> Self {
        Message {
            role: Role::Assistant,
            blocks: vec![Block::Text { text: text.into() }],
        }
    }

    pub fn tool_results(results: Vec<ToolResult>) -> Self {
        Message {
            role: Role::Tool,
            blocks: results.into_iter().map(Block::ToolResult).collect(),
        }
    }

    /// All text blocks joined (reasoning excluded).
    pub fn text(&self) -> String {
        let mut out = String::new();
        for b in &self.blocks {
            if let Block::Text { text } = b {
                out.push_str(text);
            }
        }
        out
    }

    pub fn tool_calls(&self) -> impl Iterator<Item = &ToolCall> {
        self.blocks.iter().filter_map(|b| match b {
            Block::ToolCall(c) => Some(c),
            _ => None,
        })
    }

    pub fn tool_results_iter(&self) -> impl Iterator<Item = &ToolResult> {
        self.blocks.iter().filter_map(|b| match b {
            Block::ToolResult(r) => Some(r),
            _ => None,
        })
    }

    /// Gives each tool call without a usable id the id `{prefix}{position}`
    /// (position among the message's calls). Results are paired with calls
    /// by id and approvals are addressed by it, so an id must be there,
    /// unique in its message and at most `max_len` bytes (what a client may
    /// send back in ResolveApproval); calls a hook injected (`respond`,
    /// `rewrite_response`) or a terse or faulty server sent may break that.
    pub fn normalize_call_ids(&mut self, prefix: &str, max_len: usize) {
        let calls = self.blocks.iter_mut().filter_map(|b| match b {
            Block::ToolCall(c) => Some(c),
            _ => None,
        });
        let mut seen: Vec<String> = Vec::new();
        for (i, c) in calls.enumerate() {
            if c.id.is_empty() || c.id.len() > max_len || seen.contains(&c.id) {
                c.id = format!("{prefix}{i}");
            }
            seen.push(c.id.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_without_a_usable_id_get_one_and_other_ids_are_kept() {
        let call = |id: &str| {
            Block::ToolCall(ToolCall {
                id: id.into(),
                name: "t".into(),
                arguments_json: "{}".into(),
            })
        };
        let mut m = Message {
            role: Role::Assistant,
            blocks: vec![
                Block::Text { text: "x".into() },
                call(""),
                call("given"),
                call(""),
                call("given"),
                call(&"x".repeat(9)),
                call(&"y".repeat(8)),
            ],
        };
        m.normalize_call_ids("hw_r1_2_", 8);
        let ids: Vec<_> = m.tool_calls().map(|c| c.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "hw_r1_2_0",
                "given",
                "hw_r1_2_2",
                "hw_r1_2_3",
                "hw_r1_2_4",
                "yyyyyyyy"
            ]
        );
    }

    #[test]
    fn usage_from_a_lying_endpoint_saturates() {
        let mut total = Usage {
            input_tokens: 10,
            output_tokens: 1,
            estimated: false,
        };
        total.add(Usage {
            input_tokens: u64::MAX,
            output_tokens: u64::MAX - 1,
            estimated: true,
        });
        total.add(total);
        assert_eq!(total.input_tokens, u64::MAX);
        assert_eq!(total.output_tokens, u64::MAX);
        assert!(total.estimated);
    }
}
