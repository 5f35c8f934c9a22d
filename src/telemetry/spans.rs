//! Span constructors and recorders for the GenAI conventions.
//!
//! Every constructor declares, at creation, the OTel name (`otel.name`), the
//! kind (`otel.kind`) and every non-content attribute it will ever carry, the
//! late ones as `Empty`: tracing only records declared fields, and
//! tracing-opentelemetry fixes name and kind when the span starts. (The
//! per-hook-call span is not a tracing span: see [`super::hook_span`].)
//!
//! Parents are contextual: a constructor called inside an entered span (or
//! inside `parent.in_scope(|| ...)`, or in a future `.instrument(parent)`ed)
//! is that span's child.
//!
//! Every recorder here must be called at most once per span and key: the
//! OpenTelemetry SDK appends attributes instead of replacing them, so a second
//! call exports both values. That matters most for content, which is why
//! content goes through [`ContentCapture`] only, and never through a declared
//! field (declared fields also reach the log lines; content must not).

use opentelemetry::trace::Status;
use opentelemetry::{Array, StringValue, Value};
use tracing::field::Empty;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::{LookupSpan, Registry};

use super::attrs;
use crate::config::TelemetryConfig;

/// `invoke_agent {agent}` (INTERNAL): one per run.
pub fn invoke_agent(agent: &str, provider: &str, session_id: &str, run_id: &str) -> Span {
    let name = format!("invoke_agent {agent}");
    let span = tracing::info_span!(
        "invoke_agent",
        otel.name = name.as_str(),
        otel.kind = "internal",
        { attrs::GEN_AI_OPERATION_NAME } = attrs::operation::INVOKE_AGENT,
        { attrs::GEN_AI_PROVIDER_NAME } = provider,
        { attrs::GEN_AI_AGENT_NAME } = agent,
        { attrs::GEN_AI_CONVERSATION_ID } = session_id,
        { attrs::HOOKWIRE_RUN_ID } = run_id,
        { attrs::HOOKWIRE_RUN_OUTCOME } = Empty,
        { attrs::ERROR_TYPE } = Empty,
    );
    set_openinference_kind(&span, attrs::openinference_kind::AGENT);
    span
}

/// `chat {model}` (CLIENT): one per provider call. A `model_request` hook's
/// `respond` verdict calls no provider, so it gets no `chat` span (the hook
/// span's verdict says what happened).
pub fn chat(model: &str, provider: &str) -> Span {
    let name = format!("chat {model}");
    let span = tracing::info_span!(
        "chat",
        otel.name = name.as_str(),
        otel.kind = "client",
        { attrs::GEN_AI_OPERATION_NAME } = attrs::operation::CHAT,
        { attrs::GEN_AI_PROVIDER_NAME } = provider,
        { attrs::GEN_AI_REQUEST_MODEL } = model,
        { attrs::GEN_AI_RESPONSE_MODEL } = Empty,
        { attrs::GEN_AI_RESPONSE_ID } = Empty,
        { attrs::GEN_AI_USAGE_INPUT_TOKENS } = Empty,
        { attrs::GEN_AI_USAGE_OUTPUT_TOKENS } = Empty,
        { attrs::ERROR_TYPE } = Empty,
    );
    set_openinference_kind(&span, attrs::openinference_kind::LLM);
    span
}

/// `execute_tool {tool}` (INTERNAL): one per tool call the model made,
/// including skipped and denied ones (their result is still synthetic).
pub fn execute_tool(tool: &str, call_id: &str) -> Span {
    let name = format!("execute_tool {tool}");
    let span = tracing::info_span!(
        "execute_tool",
        otel.name = name.as_str(),
        otel.kind = "internal",
        { attrs::GEN_AI_OPERATION_NAME } = attrs::operation::EXECUTE_TOOL,
        { attrs::GEN_AI_TOOL_NAME } = tool,
        { attrs::GEN_AI_TOOL_CALL_ID } = call_id,
        { attrs::ERROR_TYPE } = Empty,
    );
    set_openinference_kind(&span, attrs::openinference_kind::TOOL);
    span
}

/// The OpenInference kind goes to the trace only: log lines already say
/// what the span is through `gen_ai.operation.name`.
fn set_openinference_kind(span: &Span, kind: &'static str) {
    if !span.is_disabled() {
        span.set_attribute(attrs::OPENINFERENCE_SPAN_KIND, kind);
    }
}

/// Records how the run ended; with `error_type`, also `error.type` and an
/// error status (pass it for failures, not for `completed`; whether
/// `terminated` or `max_turns` is an error is the caller's call).
pub fn record_run_outcome(span: &Span, outcome: &str, error_type: Option<&str>) {
    span.record(attrs::HOOKWIRE_RUN_OUTCOME, outcome);
    if let Some(error_type) = error_type {
        record_error(span, error_type);
    }
}

/// Sets `error.type` and an error status on any span from this module.
/// `error_type` must be low-cardinality (a failure class, not a message).
pub fn record_error(span: &Span, error_type: &str) {
    span.record(attrs::ERROR_TYPE, error_type);
    span.set_status(Status::error(error_type.to_owned()));
}

/// Records the provider's answer on a `chat` span. The response id is
/// skipped when empty (the provider gave none). Token counts are `None`
/// when the provider did not report usage (recording 0 would be a lie).
pub fn record_chat_response(
    span: &Span,
    response_model: &str,
    response_id: &str,
    finish_reasons: &[&str],
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
) {
    span.record(attrs::GEN_AI_RESPONSE_MODEL, response_model);
    if !response_id.is_empty() {
        span.record(attrs::GEN_AI_RESPONSE_ID, response_id);
    }
    if !finish_reasons.is_empty() {
        // A string array: tracing fields cannot carry one, so it goes straight
        // to the OTel span (and not to log lines, which is fine).
        let reasons: Vec<StringValue> = finish_reasons
            .iter()
            .map(|r| StringValue::from(r.to_string()))
            .collect();
        span.set_attribute(
            attrs::GEN_AI_RESPONSE_FINISH_REASONS,
            Value::Array(Array::String(reasons)),
        );
    }
    // tracing-opentelemetry turns u64 fields into strings; i64 stays an int.
    if let Some(n) = input_tokens {
        span.record(attrs::GEN_AI_USAGE_INPUT_TOKENS, saturating_i64(n));
    }
    if let Some(n) = output_tokens {
        span.record(attrs::GEN_AI_USAGE_OUTPUT_TOKENS, saturating_i64(n));
    }
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The GenAI convention's switch for content capture.
pub const CAPTURE_CONTENT_ENV: &str = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT";

/// Whether content attributes (prompts, answers, tool arguments and results)
/// are recorded on spans. Off by default.
///
/// Contract for callers: record a key once per span, after every hook of the
/// event has run, from the effective value or the hook's
/// `telemetry_redaction`; never on `terminate`. A second record of the same
/// key on the same span panics in debug builds and is dropped (with a
/// warning that names the key, not the value) in release builds: exporting
/// both values is exactly the leak redaction hooks exist to prevent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContentCapture {
    enabled: bool,
}

impl ContentCapture {
    pub const fn new(enabled: bool) -> Self {
        ContentCapture { enabled }
    }

    /// On when `telemetry.capture_content` is true or
    /// `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true`.
    pub fn from_config(cfg: &TelemetryConfig) -> Self {
        Self::resolve(cfg, |key| std::env::var(key).ok())
    }

    /// [`ContentCapture::from_config`] with an explicit environment lookup.
    pub fn resolve(cfg: &TelemetryConfig, env: impl Fn(&str) -> Option<String>) -> Self {
        let from_env =
            env(CAPTURE_CONTENT_ENV).is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        ContentCapture::new(cfg.capture_content || from_env)
    }

    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// Sets content attribute `key` (one of [`attrs::CONTENT_KEYS`]) on
    /// `span`, if capture is on. See the type's docs for the once-only rule.
    #[track_caller]
    pub fn record(&self, span: &Span, key: &'static str, value: &str) {
        if !self.enabled || span.is_disabled() {
            return;
        }
        debug_assert!(
            attrs::CONTENT_KEYS.contains(&key),
            "{key} is not a content attribute; record it with a field instead"
        );
        if !claim_content_key(span, key) {
            debug_assert!(
                false,
                "content attribute {key} recorded twice on one span: the OTel SDK would export both values"
            );
            tracing::warn!(
                key,
                "content attribute already recorded on this span; second value dropped"
            );
            return;
        }
        span.set_attribute(key, value.to_owned());
    }
}

/// Content keys already recorded on a span, kept in the span's registry
/// extensions so the check costs one small Vec per span that has content.
struct RecordedContent(Vec<&'static str>);

/// Returns false if `key` was already recorded on `span`. Without a
/// `Registry` under the dispatcher there is nothing to check against and
/// the key counts as fresh.
fn claim_content_key(span: &Span, key: &'static str) -> bool {
    span.with_subscriber(|(id, dispatch)| {
        let Some(registry) = dispatch.downcast_ref::<Registry>() else {
            return true;
        };
        let Some(data) = registry.span(id) else {
            return true;
        };
        let mut extensions = data.extensions_mut();
        match extensions.get_mut::<RecordedContent>() {
            Some(recorded) if recorded.0.contains(&key) => false,
            Some(recorded) => {
                recorded.0.push(key);
                true
            }
            None => {
                extensions.insert(RecordedContent(vec![key]));
                true
            }
        }
    })
    .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared_fields(span: &Span) -> Vec<&'static str> {
        span.metadata()
            .expect("span enabled")
            .fields()
            .iter()
            .map(|f| f.name())
            .collect()
    }

    #[test]
    fn constructors_declare_only_known_non_content_attributes() {
        tracing::subscriber::with_default(Registry::default(), || {
            for span in [
                invoke_agent("a", "scripted", "s", "r"),
                chat("m", "openai"),
                execute_tool("t", "c"),
            ] {
                for field in declared_fields(&span) {
                    if field == "otel.name" || field == "otel.kind" {
                        continue;
                    }
                    assert!(
                        attrs::METADATA_KEYS.contains(&field),
                        "{field} is not an attribute constant"
                    );
                    assert!(!attrs::CONTENT_KEYS.contains(&field), "{field} is content");
                }
            }
        });
    }

    #[test]
    fn capture_is_off_by_default_and_enabled_by_config_or_env() {
        let off = TelemetryConfig::default();
        assert!(!ContentCapture::resolve(&off, |_| None).is_enabled());
        assert!(!ContentCapture::resolve(&off, |_| Some("false".into())).is_enabled());
        assert!(ContentCapture::resolve(&off, |k| (k == CAPTURE_CONTENT_ENV)
            .then(|| "True".into()))
        .is_enabled());
        let on = TelemetryConfig {
            capture_content: true,
            ..Default::default()
        };
        assert!(ContentCapture::resolve(&on, |_| None).is_enabled());
    }

    #[test]
    fn content_keys_are_claimed_once_per_span() {
        tracing::subscriber::with_default(Registry::default(), || {
            let a = execute_tool("t", "1");
            let b = execute_tool("t", "2");
            assert!(claim_content_key(&a, attrs::GEN_AI_TOOL_CALL_RESULT));
            assert!(claim_content_key(&a, attrs::GEN_AI_TOOL_CALL_ARGUMENTS));
            assert!(!claim_content_key(&a, attrs::GEN_AI_TOOL_CALL_RESULT));
            // Another span has its own record.
            assert!(claim_content_key(&b, attrs::GEN_AI_TOOL_CALL_RESULT));
        });
    }

    #[test]
    fn disabled_capture_never_claims() {
        tracing::subscriber::with_default(Registry::default(), || {
            let s = chat("m", "p");
            ContentCapture::new(false).record(&s, attrs::GEN_AI_OUTPUT_MESSAGES, "x");
            assert!(claim_content_key(&s, attrs::GEN_AI_OUTPUT_MESSAGES));
        });
    }

    #[test]
    #[cfg(debug_assertions)]
    fn second_record_of_a_key_panics_in_debug_builds() {
        tracing::subscriber::with_default(Registry::default(), || {
            let s = chat("m", "p");
            let capture = ContentCapture::new(true);
            capture.record(&s, attrs::GEN_AI_OUTPUT_MESSAGES, "first");
            let second = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                capture.record(&s, attrs::GEN_AI_OUTPUT_MESSAGES, "second")
            }));
            assert!(second.is_err());
        });
    }
}
