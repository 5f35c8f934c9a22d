//! Span attribute names.
//!
//! The GenAI names follow the OpenTelemetry GenAI semantic conventions. We
//! define them here instead of using `opentelemetry-semantic-conventions`
//! because that crate's GenAI constants are deprecated and have been renamed
//! upstream more than once; a name we export is part of what dashboards and
//! Jaeger queries depend on, so it is pinned in this file.

// --- GenAI semantic conventions -------------------------------------------

/// `invoke_agent`, `chat` or `execute_tool`.
pub const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
/// The model provider, e.g. `openai`; for the embedded provider, `scripted`.
pub const GEN_AI_PROVIDER_NAME: &str = "gen_ai.provider.name";
pub const GEN_AI_AGENT_NAME: &str = "gen_ai.agent.name";
/// The session id: a conversation in GenAI terms.
pub const GEN_AI_CONVERSATION_ID: &str = "gen_ai.conversation.id";
pub const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
pub const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
/// The provider's id of the completion (e.g. `chatcmpl-…`), when it gave one.
pub const GEN_AI_RESPONSE_ID: &str = "gen_ai.response.id";
/// A string array.
pub const GEN_AI_RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
pub const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
pub const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
pub const GEN_AI_TOOL_NAME: &str = "gen_ai.tool.name";
pub const GEN_AI_TOOL_CALL_ID: &str = "gen_ai.tool.call.id";

// Content attributes: off by default, recorded only through
// `ContentCapture::record` (exactly once per span, after hooks ran).

pub const GEN_AI_INPUT_MESSAGES: &str = "gen_ai.input.messages";
pub const GEN_AI_OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
pub const GEN_AI_SYSTEM_INSTRUCTIONS: &str = "gen_ai.system_instructions";
pub const GEN_AI_TOOL_CALL_ARGUMENTS: &str = "gen_ai.tool.call.arguments";
pub const GEN_AI_TOOL_CALL_RESULT: &str = "gen_ai.tool.call.result";
/// The tools offered to the model (names, descriptions, parameter schemas).
/// Not user data, but large and opt-in in the conventions, so it follows
/// the content switch.
pub const GEN_AI_TOOL_DEFINITIONS: &str = "gen_ai.tool.definitions";

/// Every content attribute. Anything in this list may carry user data and
/// must never be set outside `ContentCapture`.
pub const CONTENT_KEYS: [&str; 6] = [
    GEN_AI_INPUT_MESSAGES,
    GEN_AI_OUTPUT_MESSAGES,
    GEN_AI_SYSTEM_INSTRUCTIONS,
    GEN_AI_TOOL_CALL_ARGUMENTS,
    GEN_AI_TOOL_CALL_RESULT,
    GEN_AI_TOOL_DEFINITIONS,
];

// --- General semantic conventions -----------------------------------------

/// A low-cardinality failure class (e.g. `hook_failed`, `deadline`).
pub const ERROR_TYPE: &str = "error.type";

// --- OpenInference ----------------------------------------------------------

/// The span kind OpenInference backends (Arize Phoenix, ...) group and
/// render spans by; set alongside the GenAI attributes, which they do not
/// all map to a kind themselves.
pub const OPENINFERENCE_SPAN_KIND: &str = "openinference.span.kind";

/// Values of `openinference.span.kind`.
pub mod openinference_kind {
    pub const AGENT: &str = "AGENT";
    pub const LLM: &str = "LLM";
    pub const TOOL: &str = "TOOL";
    /// A blocking hook call: it can stop or rewrite what the run does.
    pub const GUARDRAIL: &str = "GUARDRAIL";
}

// --- hookwire ---------------------------------------------------------------

pub const HOOKWIRE_RUN_ID: &str = "hookwire.run.id";
/// `completed`, `terminated`, `failed`, `cancelled`, `max_turns`, ...
pub const HOOKWIRE_RUN_OUTCOME: &str = "hookwire.run.outcome";
pub const HOOKWIRE_HOOK_NAME: &str = "hookwire.hook.name";
/// The snake_case event name, as in config.
pub const HOOKWIRE_HOOK_EVENT: &str = "hookwire.hook.event";
/// The verdict kind the hook answered with (`continue`, `rewrite_args`, ...).
pub const HOOKWIRE_HOOK_VERDICT: &str = "hookwire.hook.verdict";
/// `ok`, `timeout`, a failure class, or `failed_open`.
pub const HOOKWIRE_HOOK_OUTCOME: &str = "hookwire.hook.outcome";
/// Wall time of the hook call in milliseconds (a float: sub-ms matters here).
pub const HOOKWIRE_HOOK_LATENCY_MS: &str = "hookwire.hook.latency_ms";

/// Every non-content attribute name above, for tests that check the span
/// constructors only use names defined here.
pub const METADATA_KEYS: [&str; 21] = [
    GEN_AI_OPERATION_NAME,
    GEN_AI_PROVIDER_NAME,
    GEN_AI_AGENT_NAME,
    GEN_AI_CONVERSATION_ID,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_MODEL,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_FINISH_REASONS,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    GEN_AI_TOOL_NAME,
    GEN_AI_TOOL_CALL_ID,
    ERROR_TYPE,
    OPENINFERENCE_SPAN_KIND,
    HOOKWIRE_RUN_ID,
    HOOKWIRE_RUN_OUTCOME,
    HOOKWIRE_HOOK_NAME,
    HOOKWIRE_HOOK_EVENT,
    HOOKWIRE_HOOK_VERDICT,
    HOOKWIRE_HOOK_OUTCOME,
    HOOKWIRE_HOOK_LATENCY_MS,
];

/// Operation names (values of `gen_ai.operation.name`).
pub mod operation {
    pub const INVOKE_AGENT: &str = "invoke_agent";
    pub const CHAT: &str = "chat";
    pub const EXECUTE_TOOL: &str = "execute_tool";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_and_metadata_keys_are_disjoint_and_unique() {
        let mut all: Vec<&str> = CONTENT_KEYS
            .iter()
            .chain(METADATA_KEYS.iter())
            .copied()
            .collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "an attribute name is listed twice");
    }
}
