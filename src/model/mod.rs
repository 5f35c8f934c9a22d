//! Model providers: the embedded deterministic `scripted` model and (in
//! `openai`) any OpenAI-compatible chat-completions endpoint.

pub mod openai;
pub mod scripted;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::config::{ModelConfig, ProviderKind};
use crate::history::History;
use crate::message::{Message, ToolSpec, Usage};

/// Whether and how the model must call tools.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    Tool(String),
}

/// The effective request of one model call (after `model_request` hooks).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ModelRequest {
    pub model: String,
    pub system_prompt: String,
    pub extra_context: Vec<String>,
    /// The transcript, shared with the run (see [`History`]), then the
    /// run's messages.
    pub history: History,
    pub tools: Vec<ToolSpec>,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    pub tool_choice: ToolChoice,
    pub additional_params: serde_json::Map<String, serde_json::Value>,
}

impl ModelRequest {
    /// The system prompt followed by the extra context documents, as most
    /// providers take a single system message.
    pub fn system_text(&self) -> String {
        let mut parts: Vec<&str> = Vec::new();
        if !self.system_prompt.is_empty() {
            parts.push(&self.system_prompt);
        }
        parts.extend(self.extra_context.iter().map(String::as_str));
        parts.join("\n\n")
    }
}

/// A complete model turn.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ModelResponse {
    pub message: Option<Message>,
    pub finish_reason: String,
    pub usage: Usage,
    pub model: String,
    /// The provider's id for this completion (`gen_ai.response.id`); empty
    /// when there is none (the scripted model, a hook's `respond`).
    pub id: String,
}

impl ModelResponse {
    pub fn message(&self) -> Message {
        self.message
            .clone()
            .unwrap_or_else(|| Message::assistant_text(""))
    }
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("{provider} model `{model}` failed{}: {message}", status_text(.status))]
pub struct ModelError {
    pub provider: &'static str,
    pub model: String,
    /// HTTP status from the provider, when there was one.
    pub status: Option<u16>,
    pub message: String,
}

fn status_text(s: &Option<u16>) -> String {
    s.map(|s| format!(" (status {s})")).unwrap_or_default()
}

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Receives streamed text chunks while a model call is in flight.
pub type DeltaSink<'a> = &'a (dyn Fn(&str) + Send + Sync);

/// A model backend. Cancellation is by dropping the returned future.
pub trait ModelProvider: Send + Sync + 'static {
    /// Provider kind for telemetry (`gen_ai.provider.name`).
    fn provider_name(&self) -> &'static str;
    /// Configured model name.
    fn model_name(&self) -> &str;
    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        on_delta: DeltaSink<'a>,
    ) -> BoxFuture<'a, Result<ModelResponse, ModelError>>;
}

/// Why a configured model could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ModelSetupError {
    #[error(transparent)]
    OpenAi(#[from] openai::OpenAiSetupError),
}

/// The provider for one `models:` entry.
pub fn build(cfg: &ModelConfig) -> Result<Arc<dyn ModelProvider>, ModelSetupError> {
    Ok(match cfg.provider {
        ProviderKind::Scripted => Arc::new(
            scripted::ScriptedModel::new(cfg.name.clone(), cfg.rules.clone().unwrap_or_default())
                .with_delay(cfg.delay.unwrap_or_default()),
        ),
        ProviderKind::Openai => Arc::new(openai::OpenAiModel::from_config(cfg)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_covers_both_providers() {
        let cfg = crate::config::Config::parse(
            "models:\n  - {name: s, provider: scripted}\n  - {name: o, provider: openai, base_url: 'http://127.0.0.1:1/v1', model: gpt-x}\nagents: [{name: a, model: s}]\n",
            "test",
        )
        .unwrap();
        let s = build(cfg.model("s").unwrap()).unwrap();
        assert_eq!((s.provider_name(), s.model_name()), ("scripted", "s"));
        let o = build(cfg.model("o").unwrap()).unwrap();
        assert_eq!((o.provider_name(), o.model_name()), ("openai", "gpt-x"));
    }
}
