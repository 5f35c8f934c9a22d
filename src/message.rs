//! Provider-agnostic, block-structured conversation messages.

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
    Tool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub blocks: Vec<Block>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Block {
    Text { text: String },
    Reasoning { text: String },
    ToolCall(ToolCall),
    ToolResult(ToolResult),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// JSON text, kept verbatim so what the model sent is what hooks see.
    pub arguments_json: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

    /// Gives each tool call without a usable id one of hookwire's,
    /// `{prefix}{position}` (position among the message's calls; a suffix
    /// is added if even that is taken). Results are paired with calls by
    /// id and approvals are addressed by it within the run, so an id must
    /// be there, unique in the run (`used`: the ids of its earlier turns)
    /// and at most `max_len` bytes (what a client may send back in
    /// ResolveApproval). Calls a hook injected (`respond`,
    /// `rewrite_response`) or a terse or faulty server sent may break that,
    /// as may a provider that numbers its ids per response.
    pub fn normalize_call_ids(
        &mut self,
        prefix: &str,
        max_len: usize,
        used: &std::collections::HashSet<String>,
    ) {
        let ids: Vec<String> = self.tool_calls().map(|c| c.id.clone()).collect();
        let calls = self.blocks.iter_mut().filter_map(|b| match b {
            Block::ToolCall(c) => Some(c),
            _ => None,
        });
        let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
        for (i, c) in calls.enumerate() {
            let usable = !c.id.is_empty()
                && c.id.len() <= max_len
                && !used.contains(&c.id)
                && !seen.contains(&c.id);
            if !usable {
                // Not one any call of the run has, nor one a later call of
                // this message keeps.
                let taken = |id: &str| {
                    used.contains(id) || seen.contains(id) || ids[i + 1..].iter().any(|x| x == id)
                };
                let mut id = format!("{prefix}{i}");
                let mut k = 1;
                while taken(&id) {
                    id = format!("{prefix}{i}_{k}");
                    k += 1;
                }
                c.id = id;
            }
            seen.insert(c.id.clone());
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
        m.normalize_call_ids("hw_r1_2_", 8, &Default::default());
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
    fn call_ids_are_unique_in_the_run_generated_ones_too() {
        let call = |id: &str| {
            Block::ToolCall(ToolCall {
                id: id.into(),
                name: "t".into(),
                arguments_json: "{}".into(),
            })
        };
        let mut m = Message {
            role: Role::Assistant,
            blocks: vec![call("p1"), call(""), call("x"), call(""), call("p3")],
        };
        // `x` was a call of an earlier turn; `p1` is given here, so the
        // second call cannot be `p1`; `p3` is kept by the last call.
        let used = ["x".to_string()].into_iter().collect();
        m.normalize_call_ids("p", 64, &used);
        let ids: Vec<_> = m.tool_calls().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["p1", "p1_1", "p2", "p3_1", "p3"]);
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
