//! The OpenAI-compatible chat-completions provider (OpenAI, vLLM, llama.cpp
//! server, Ollama, LiteLLM, Azure and other compatible endpoints).
//!
//! Calls stream by default (`stream: true` with
//! `stream_options.include_usage`): text deltas are passed on as they
//! arrive, tool calls are assembled from their fragments, and usage comes
//! from the final chunk (or is estimated at 4 characters per token and
//! marked as such). A model configured with `stream: false` asks for one
//! JSON answer instead (for servers that cannot stream some requests, e.g.
//! llama-cpp-python with tools), parsed into the same turn; its text is
//! passed on as one delta.
//!
//! Robustness, per call:
//! - retries with jittered exponential backoff on 429, 5xx, connection
//!   failures and streams that break before any text was passed on; a
//!   `Retry-After` (seconds) or `retry-after-ms` header replaces the backoff,
//!   and one asking for more than 60 s ends the call instead;
//! - never a retry once a text delta was passed on (the client has seen it);
//! - `timeout` bounds connecting plus waiting for the response headers, and
//!   then each gap between pieces of the stream; a long, steadily streaming
//!   answer is not cut off (the agent's `run_timeout` bounds the whole run);
//! - at most [`MAX_RESPONSE_BYTES`] of SSE data per response;
//! - cancellation: dropping the future drops the HTTP request, which closes
//!   the connection (HTTP/1.1) or resets the stream (HTTP/2).
//!
//! Logs never carry prompts, answers or tool arguments above debug level.

#[cfg(test)]
mod fuzz;
mod retry;
mod stream;
mod wire;

use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use reqwest::{Response, StatusCode, Url};

use super::{BoxFuture, DeltaSink, ModelError, ModelProvider, ModelRequest, ModelResponse};
use crate::config::{ModelConfig, ProviderKind};
use crate::message::Usage;

pub const PROVIDER_NAME: &str = "openai";
/// Default for `timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Largest `timeout` a config may set: an hour without a byte is a dead
/// server (a long answer that keeps streaming is bounded by the agent's
/// `run_timeout`, not this).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
/// Default for `max_retries`.
pub const DEFAULT_MAX_RETRIES: u32 = 2;
/// Most SSE data read from one response.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;
/// Most of an error response body read for its message.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// Why an `openai` model could not be set up from its config.
#[derive(Debug, thiserror::Error)]
pub enum OpenAiSetupError {
    #[error("model `{model}` has provider `{provider:?}`, not openai")]
    WrongProvider {
        model: String,
        provider: ProviderKind,
    },
    #[error("model `{model}`: `{field}` is required for provider: openai")]
    MissingField { model: String, field: &'static str },
    #[error("model `{model}`: base_url `{url}` is not usable: {reason}")]
    InvalidBaseUrl {
        model: String,
        url: String,
        reason: String,
    },
    #[error("model `{model}`: environment variable `{var}` (api_key_env) is not set")]
    MissingApiKey { model: String, var: String },
    #[error("model `{model}`: environment variable `{var}` (api_key_env) is empty")]
    EmptyApiKey { model: String, var: String },
    #[error(
        "model `{model}`: environment variable `{var}` (api_key_env) does not hold a usable key (not valid in an HTTP header)"
    )]
    InvalidApiKey { model: String, var: String },
    #[error("model `{model}`: header `{header}` has an invalid {part}")]
    InvalidHeader {
        model: String,
        header: String,
        part: &'static str,
    },
    #[error("model `{model}`: cannot build the HTTP client: {source}")]
    Client {
        model: String,
        #[source]
        source: reqwest::Error,
    },
}

/// A model behind an OpenAI-compatible `/chat/completions` endpoint.
pub struct OpenAiModel {
    /// The provider's model id (`model:` in the config).
    model: String,
    endpoint: Url,
    /// `scheme://host[:port]` of the endpoint, for error messages.
    origin: String,
    client: reqwest::Client,
    timeout: Duration,
    max_retries: u32,
    backoff: retry::Backoff,
    defaults: wire::Defaults,
    max_response_bytes: usize,
    /// `stream` in the config (default true).
    stream: bool,
}

impl std::fmt::Debug for OpenAiModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The client holds the Authorization header: never print it.
        f.debug_struct("OpenAiModel")
            .field("model", &self.model)
            .field("endpoint", &self.origin)
            .field("timeout", &self.timeout)
            .field("max_retries", &self.max_retries)
            .finish_non_exhaustive()
    }
}

impl OpenAiModel {
    /// Builds the provider from a `provider: openai` model config. The API
    /// key is read now from the variable named by `api_key_env`; without
    /// `api_key_env` no Authorization header is sent (local servers).
    pub fn from_config(cfg: &ModelConfig) -> Result<OpenAiModel, OpenAiSetupError> {
        let name = || cfg.name.clone();
        if cfg.provider != ProviderKind::Openai {
            return Err(OpenAiSetupError::WrongProvider {
                model: name(),
                provider: cfg.provider,
            });
        }
        let base_url = cfg
            .base_url
            .as_deref()
            .ok_or_else(|| OpenAiSetupError::MissingField {
                model: name(),
                field: "base_url",
            })?;
        let model = cfg.model.clone().filter(|m| !m.is_empty()).ok_or_else(|| {
            OpenAiSetupError::MissingField {
                model: name(),
                field: "model",
            }
        })?;
        let endpoint = endpoint(base_url).map_err(|reason| OpenAiSetupError::InvalidBaseUrl {
            model: name(),
            url: base_url.to_string(),
            reason,
        })?;
        let origin = endpoint.origin().ascii_serialization();

        let stream = cfg.stream.unwrap_or(true);
        let mut headers = HeaderMap::new();
        headers.insert(
            ACCEPT,
            HeaderValue::from_static(if stream {
                "text/event-stream"
            } else {
                "application/json"
            }),
        );
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let invalid = |header: &str, part| OpenAiSetupError::InvalidHeader {
            model: name(),
            header: header.to_string(),
            part,
        };
        for (k, v) in &cfg.headers {
            let hn = HeaderName::from_bytes(k.as_bytes()).map_err(|_| invalid(k, "name"))?;
            let hv = HeaderValue::from_str(v).map_err(|_| invalid(k, "value"))?;
            headers.insert(hn, hv);
        }
        if let Some(org) = &cfg.organization {
            let hv = HeaderValue::from_str(org).map_err(|_| invalid("organization", "value"))?;
            headers.insert(HeaderName::from_static("openai-organization"), hv);
        }
        if let Some(var) = &cfg.api_key_env {
            headers.insert(AUTHORIZATION, bearer_from_env(&cfg.name, var)?);
        }

        let timeout = cfg.timeout.unwrap_or(DEFAULT_TIMEOUT);
        ensure_crypto_provider();
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .user_agent(concat!("hookwire/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(timeout)
            .build()
            .map_err(|source| OpenAiSetupError::Client {
                model: name(),
                source,
            })?;

        Ok(OpenAiModel {
            model,
            endpoint,
            origin,
            client,
            timeout,
            max_retries: cfg.max_retries.unwrap_or(DEFAULT_MAX_RETRIES),
            backoff: retry::Backoff::default(),
            defaults: wire::Defaults {
                temperature: cfg.temperature,
                max_tokens: cfg.max_tokens,
            },
            max_response_bytes: MAX_RESPONSE_BYTES,
            stream,
        })
    }

    /// Overrides the retry backoff (base delay before the first retry, and
    /// the cap). Defaults: 500 ms, 8 s. Mostly for tests.
    pub fn with_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff = retry::Backoff { base, max };
        self
    }

    /// Overrides the response size bound ([`MAX_RESPONSE_BYTES`]).
    pub fn with_max_response_bytes(mut self, max: usize) -> Self {
        self.max_response_bytes = max;
        self
    }

    /// The URL requests are sent to.
    pub fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    fn error(&self, status: Option<u16>, message: String) -> ModelError {
        ModelError {
            provider: PROVIDER_NAME,
            model: self.model.clone(),
            status,
            message,
        }
    }

    async fn call(
        &self,
        request: &ModelRequest,
        on_delta: DeltaSink<'_>,
    ) -> Result<ModelResponse, ModelError> {
        let body = wire::request_body(request, &self.model, &self.defaults, self.stream)
            .map_err(|m| self.error(None, m))?;
        let body = serde_json::to_vec(&body).map_err(|e| self.error(None, e.to_string()))?;
        let mut retries = 0u32;
        loop {
            tracing::debug!(model = %self.model, attempt = retries + 1, "chat completion request");
            let failure = match self.attempt(body.clone(), on_delta).await {
                Ok(done) => return Ok(self.response(request, done)),
                Err(failure) => failure,
            };
            let attempts = retries + 1;
            let wait = match failure.retry {
                Retry::No => None,
                _ if retries >= self.max_retries => None,
                Retry::After(Some(after)) if after > retry::MAX_RETRY_AFTER => {
                    return Err(self.error(
                        failure.status,
                        format!(
                            "{} (the server asked to retry after {:?}, longer than hookwire waits)",
                            failure.message, after
                        ),
                    ));
                }
                Retry::After(Some(after)) => Some(after),
                Retry::After(None) => Some(self.backoff.delay(retries, retry::jitter())),
            };
            let Some(wait) = wait else {
                let message = if attempts > 1 {
                    format!("{} (gave up after {attempts} attempts)", failure.message)
                } else {
                    failure.message
                };
                return Err(self.error(failure.status, message));
            };
            tracing::warn!(
                model = %self.model,
                status = failure.status,
                attempt = attempts,
                retry_in_ms = wait.as_millis() as u64,
                "model call failed; retrying"
            );
            tracing::debug!(model = %self.model, error = %failure.message, "model call failure");
            tokio::time::sleep(wait).await;
            retries += 1;
        }
    }

    async fn attempt(
        &self,
        body: Vec<u8>,
        on_delta: DeltaSink<'_>,
    ) -> Result<stream::Assembled, AttemptFailure> {
        let send = self.client.post(self.endpoint.clone()).body(body).send();
        let response = match tokio::time::timeout(self.timeout, send).await {
            Err(_) => {
                return Err(AttemptFailure::transient(format!(
                    "no response from {} within {:?}",
                    self.origin, self.timeout
                )))
            }
            Ok(Err(e)) => {
                let retry = if e.is_builder() {
                    Retry::No
                } else {
                    Retry::After(None)
                };
                return Err(AttemptFailure {
                    status: None,
                    message: format!(
                        "cannot reach {}: {}",
                        self.origin,
                        error_chain(&e.without_url())
                    ),
                    retry,
                });
            }
            Ok(Ok(r)) => r,
        };

        let status = response.status();
        if !status.is_success() {
            return Err(self.status_failure(response).await);
        }
        // Clearly not a stream (a server ignoring `stream: true`, a proxy's
        // HTML page): say so instead of failing to parse it. Other types are
        // tried as SSE, as some servers mislabel their streams.
        let mime = mime(response.headers());
        if !self.stream && mime != "text/event-stream" {
            return self.whole(response, status, &mime, on_delta).await;
        }
        if mime == "application/json" || mime == "text/html" {
            let body = read_bounded(response, MAX_ERROR_BODY_BYTES, self.timeout).await;
            let detail = match wire::error_message(&body) {
                Some(m) if mime == "application/json" => format!(": {m}"),
                _ => String::new(),
            };
            return Err(AttemptFailure {
                status: Some(status.as_u16()),
                message: format!(
                    "expected an event stream (text/event-stream) but got {mime}{detail}"
                ),
                retry: Retry::No,
            });
        }

        let limits = stream::Limits {
            max_bytes: self.max_response_bytes,
            idle_timeout: self.timeout,
        };
        stream::read(response.bytes_stream(), limits, on_delta)
            .await
            .map_err(|f| AttemptFailure {
                status: None,
                retry: if f.kind.transient() && !f.emitted {
                    Retry::After(None)
                } else {
                    Retry::No
                },
                message: if f.emitted {
                    format!("{} (after partial output; not retried)", f.message)
                } else {
                    f.message
                },
            })
    }

    /// A non-streamed answer (`stream: false`): the whole body, bounded like
    /// a stream, parsed into the same turn; its text goes to `on_delta` once.
    async fn whole(
        &self,
        mut response: Response,
        status: StatusCode,
        mime: &str,
        on_delta: DeltaSink<'_>,
    ) -> Result<stream::Assembled, AttemptFailure> {
        let mut body = Vec::new();
        loop {
            match tokio::time::timeout(self.timeout, response.chunk()).await {
                Err(_) => {
                    return Err(AttemptFailure::transient(format!(
                        "the response stalled: nothing received for {:?}",
                        self.timeout
                    )))
                }
                Ok(Err(e)) => {
                    return Err(AttemptFailure::transient(format!(
                        "the response broke: {}",
                        error_chain(&e.without_url())
                    )))
                }
                Ok(Ok(None)) => break,
                Ok(Ok(Some(piece))) => {
                    if body.len().saturating_add(piece.len()) > self.max_response_bytes {
                        return Err(AttemptFailure {
                            status: Some(status.as_u16()),
                            message: format!(
                                "the response exceeded {} bytes",
                                self.max_response_bytes
                            ),
                            retry: Retry::No,
                        });
                    }
                    body.extend_from_slice(&piece);
                }
            }
        }
        let (done, text) = stream::whole(&body).map_err(|(_, message)| AttemptFailure {
            status: Some(status.as_u16()),
            message: if mime == "text/html" {
                "expected a JSON chat completion but got text/html".into()
            } else {
                message
            },
            retry: Retry::No,
        })?;
        if let Some(text) = text {
            on_delta(&text);
        }
        Ok(done)
    }

    async fn status_failure(&self, response: Response) -> AttemptFailure {
        let status = response.status();
        let after = retry::retry_after(response.headers());
        let mime = mime(response.headers());
        let body = read_bounded(response, MAX_ERROR_BODY_BYTES, self.timeout).await;
        let message = wire::error_message(&body).unwrap_or_else(|| {
            let line = format!(
                "HTTP {} {}",
                status.as_u16(),
                status.canonical_reason().unwrap_or("")
            )
            .trim_end()
            .to_string();
            // A body that is not an error object is not quoted (it may echo
            // the request); its type says what the server sent.
            match (body.is_empty(), mime.is_empty()) {
                (true, _) => line,
                (false, true) => format!("{line} (untyped body not shown: not an error object)"),
                (false, false) => format!("{line} ({mime} body not shown: not an error object)"),
            }
        });
        let retryable = status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error();
        AttemptFailure {
            status: Some(status.as_u16()),
            message,
            retry: if retryable {
                Retry::After(after)
            } else {
                Retry::No
            },
        }
    }

    fn response(&self, request: &ModelRequest, done: stream::Assembled) -> ModelResponse {
        let usage = done.usage.unwrap_or_else(|| Usage {
            input_tokens: wire::estimate_input_tokens(request),
            output_tokens: wire::tokens_from_chars(done.output_chars),
            estimated: true,
        });
        ModelResponse {
            message: Some(done.message),
            finish_reason: done.finish_reason,
            usage,
            model: done.model.unwrap_or_else(|| self.model.clone()),
            id: done.id.unwrap_or_default(),
        }
    }
}

impl ModelProvider for OpenAiModel {
    fn provider_name(&self) -> &'static str {
        PROVIDER_NAME
    }

    fn model_name(&self) -> &str {
        &self.model
    }

    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        on_delta: DeltaSink<'a>,
    ) -> BoxFuture<'a, Result<ModelResponse, ModelError>> {
        Box::pin(self.call(request, on_delta))
    }
}

#[derive(Debug)]
enum Retry {
    No,
    /// Retryable; after the server's requested delay, or backoff if none.
    After(Option<Duration>),
}

#[derive(Debug)]
struct AttemptFailure {
    status: Option<u16>,
    message: String,
    retry: Retry,
}

impl AttemptFailure {
    fn transient(message: String) -> Self {
        AttemptFailure {
            status: None,
            message,
            retry: Retry::After(None),
        }
    }
}

/// The media type of a response (`text/event-stream`), lower-cased,
/// without parameters; empty when there is none or when it is too long to
/// be a media type (it ends up in error messages).
fn mime(headers: &HeaderMap) -> String {
    let mime = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim();
    if mime.len() > 128 {
        return String::new();
    }
    mime.to_ascii_lowercase()
}

/// `Bearer <key>` from the environment variable `var`, marked sensitive so
/// it never shows in debug output.
fn bearer_from_env(model: &str, var: &str) -> Result<HeaderValue, OpenAiSetupError> {
    let (model, var_name) = (model.to_string(), var.to_string());
    let key = match std::env::var(var) {
        Ok(k) => k,
        Err(std::env::VarError::NotPresent) => {
            return Err(OpenAiSetupError::MissingApiKey {
                model,
                var: var_name,
            })
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err(OpenAiSetupError::InvalidApiKey {
                model,
                var: var_name,
            })
        }
    };
    let key = key.trim();
    if key.is_empty() {
        return Err(OpenAiSetupError::EmptyApiKey {
            model,
            var: var_name,
        });
    }
    let mut hv = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
        OpenAiSetupError::InvalidApiKey {
            model,
            var: var_name,
        }
    })?;
    hv.set_sensitive(true);
    Ok(hv)
}

/// `{base_url}/chat/completions`, keeping any query (Azure's `api-version`).
/// A base URL that already ends in `/chat/completions` is used as is.
fn endpoint(base_url: &str) -> Result<Url, String> {
    let mut url = Url::parse(base_url.trim()).map_err(|e| e.to_string())?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("the scheme must be http or https".into());
    }
    if url.cannot_be_a_base() || url.host().is_none() {
        return Err("not a base URL with a host".into());
    }
    let path = url.path().trim_end_matches('/').to_string();
    if !path.ends_with("/chat/completions") {
        url.set_path(&format!("{path}/chat/completions"));
    }
    Ok(url)
}

/// reqwest links with rustls but no built-in crypto provider (to avoid
/// aws-lc's C build); install ring as the process default unless something
/// else already installed one.
fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race to another installer is fine: one provider is set.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// An error and its sources, without the request URL.
fn error_chain(e: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        source = s.source();
    }
    out
}

/// Reads at most `limit` bytes of a body, within `timeout`; whatever was
/// read by then (an error body is best effort).
async fn read_bounded(mut response: Response, limit: usize, timeout: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    // `+` panics past what an Instant holds; a config's timeout is bounded
    // at load, but a ModelConfig may be built in code. Beyond it: no bound.
    let deadline = tokio::time::Instant::now().checked_add(timeout);
    while out.len() < limit {
        let piece = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, response.chunk()).await,
            None => Ok(response.chunk().await),
        };
        match piece {
            Ok(Ok(Some(piece))) => {
                let room = limit - out.len();
                out.extend_from_slice(&piece[..piece.len().min(room)]);
            }
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn cfg(yaml_extra: &[(&str, &str)]) -> ModelConfig {
        let mut c = ModelConfig {
            name: "gpt".into(),
            provider: ProviderKind::Openai,
            rules: None,
            delay: None,
            base_url: Some("http://127.0.0.1:9/v1".into()),
            model: Some("gpt-test".into()),
            api_key_env: None,
            headers: BTreeMap::new(),
            timeout: None,
            max_retries: None,
            temperature: None,
            max_tokens: None,
            organization: None,
            stream: None,
        };
        for (k, v) in yaml_extra {
            match *k {
                "base_url" => c.base_url = Some(v.to_string()),
                "api_key_env" => c.api_key_env = Some(v.to_string()),
                "header" => {
                    let (hk, hv) = v.split_once('=').unwrap();
                    c.headers.insert(hk.into(), hv.into());
                }
                _ => unreachable!(),
            }
        }
        c
    }

    #[test]
    fn endpoint_appends_chat_completions_and_keeps_the_query() {
        let e = |u: &str| endpoint(u).map(|u| u.to_string());
        assert_eq!(
            e("https://api.openai.com/v1").unwrap(),
            "https://api.openai.com/v1/chat/completions"
        );
        assert_eq!(
            e("http://localhost:8000/v1/").unwrap(),
            "http://localhost:8000/v1/chat/completions"
        );
        assert_eq!(
            e("https://x.openai.azure.com/openai/deployments/d?api-version=2024-10-21").unwrap(),
            "https://x.openai.azure.com/openai/deployments/d/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(
            e("http://h/v1/chat/completions").unwrap(),
            "http://h/v1/chat/completions"
        );
        assert!(e("ftp://h/v1").is_err());
        assert!(e("not a url").is_err());
    }

    #[test]
    fn a_missing_key_variable_is_named() {
        let c = cfg(&[("api_key_env", "HOOKWIRE_UNIT_TEST_SURELY_UNSET_KEY")]);
        let e = OpenAiModel::from_config(&c).unwrap_err();
        assert!(matches!(e, OpenAiSetupError::MissingApiKey { .. }));
        assert_eq!(
            e.to_string(),
            "model `gpt`: environment variable `HOOKWIRE_UNIT_TEST_SURELY_UNSET_KEY` (api_key_env) is not set"
        );
    }

    #[test]
    fn no_key_variable_means_no_authorization_and_bad_headers_are_rejected() {
        let m = OpenAiModel::from_config(&cfg(&[])).unwrap();
        assert_eq!(m.provider_name(), "openai");
        assert_eq!(m.model_name(), "gpt-test");
        assert_eq!(
            m.endpoint().as_str(),
            "http://127.0.0.1:9/v1/chat/completions"
        );
        let e = OpenAiModel::from_config(&cfg(&[("header", "x-bad=line\nbreak")])).unwrap_err();
        assert!(
            e.to_string()
                .contains("header `x-bad` has an invalid value"),
            "{e}"
        );
        let e = OpenAiModel::from_config(&cfg(&[("header", "bad name=v")])).unwrap_err();
        assert!(e.to_string().contains("invalid name"), "{e}");
        let mut scripted = cfg(&[]);
        scripted.provider = ProviderKind::Scripted;
        assert!(matches!(
            OpenAiModel::from_config(&scripted),
            Err(OpenAiSetupError::WrongProvider { .. })
        ));
    }
}
