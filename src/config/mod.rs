//! The configuration model: one YAML file (ConfigMap friendly). Unknown
//! fields are rejected; every error names the offending path.
//!
//! Defaults are chosen for agents, whose hooks may themselves call a model:
//! seconds, not milliseconds. See README "Configuration reference".

pub(crate) mod duration;
mod env;
mod load;
pub mod secret_env;
mod security;
mod store;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::event::EventKind;
use crate::model::scripted::Rule;

pub use load::{ConfigError, EMBEDDED_DEFAULT};
pub use security::*;
/// A URL as logs and errors may show it: its password masked.
pub(crate) use store::redact as redact_url;
pub use store::StoreSetting;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:50051";
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9464";

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// gRPC listen address (AgentService, health, reflection).
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Admin HTTP listen address (/metrics, /healthz, /readyz).
    #[serde(default = "default_admin_listen")]
    pub admin_listen: SocketAddr,
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    #[serde(default)]
    pub hooks: Vec<HookConfig>,
    pub agents: Vec<AgentConfig>,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub server: ServerConfig,
    /// Where sessions live (see [`StoreSetting`]). Unset: `hookwire serve`
    /// uses SQLite in its data directory; the library's `serve` uses memory.
    #[serde(default)]
    pub store: Option<StoreSetting>,
    /// TLS on the gRPC port; plaintext when absent.
    pub tls: Option<ServerTls>,
    /// How callers authenticate; `none` (loopback only) when absent.
    #[serde(default)]
    pub auth: AuthConfig,
    /// Limits per principal.
    #[serde(default)]
    pub quotas: Quotas,
}

fn default_listen() -> SocketAddr {
    DEFAULT_LISTEN.parse().expect("valid default")
}
fn default_admin_listen() -> SocketAddr {
    DEFAULT_ADMIN_LISTEN.parse().expect("valid default")
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    Scripted,
    Openai,
}

/// A model. Fields apply to one provider each; using a field of another
/// provider is an error.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub provider: ProviderKind,
    // scripted
    #[serde(default)]
    pub rules: Option<Vec<Rule>>,
    /// How long every answer takes (a rule's own `delay` wins); lets load
    /// tests keep runs in flight as a real model would.
    #[serde(default, deserialize_with = "duration::option::deserialize")]
    pub delay: Option<Duration>,
    // openai
    pub base_url: Option<String>,
    pub model: Option<String>,
    pub api_key_env: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default, deserialize_with = "duration::option::deserialize")]
    pub timeout: Option<Duration>,
    pub max_retries: Option<u32>,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    pub organization: Option<String>,
    /// Stream the answer (default true); false asks for one JSON answer,
    /// for servers that cannot stream some requests.
    pub stream: Option<bool>,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum FailurePolicy {
    /// A hook failure ends the run with outcome hook_failed.
    #[default]
    Closed,
    /// A hook failure is treated as continue (warned, counted).
    Open,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum HookMode {
    #[default]
    Blocking,
    /// Every subscribed event is delivered without waiting; cannot steer.
    Observe,
}

pub const DEFAULT_HOOK_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_OBSERVE_QUEUE: usize = 256;
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
pub const DEFAULT_BREAKER_COOLDOWN: Duration = Duration::from_secs(30);

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookConfig {
    pub name: String,
    /// gRPC endpoint, e.g. `http://redactor:50061`.
    pub endpoint: String,
    /// Events to receive; empty means whatever Describe reports.
    #[serde(default)]
    pub events: Vec<EventKind>,
    /// Higher fires first; ties keep config order.
    #[serde(default)]
    pub priority: i32,
    /// Per-call deadline.
    #[serde(
        default = "default_hook_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub timeout: Duration,
    /// Per-event overrides of `timeout`.
    #[serde(default)]
    pub event_timeouts: BTreeMap<EventKind, HumanDuration>,
    #[serde(default)]
    pub failure: FailurePolicy,
    #[serde(default)]
    pub mode: HookMode,
    /// With failure: open, stop calling the hook for the rest of a run after
    /// it failed once.
    #[serde(default = "yes")]
    pub detach_on_failure: bool,
    /// Bounded queue of observe events per run stream; overflow is dropped
    /// and counted.
    #[serde(default = "default_observe_queue")]
    pub observe_queue: usize,
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// The pool of HTTP/2 connections to this hook server.
    #[serde(default)]
    pub connections: ConnectionsConfig,
    /// TLS settings for an `https://` endpoint.
    #[serde(default)]
    pub tls: HookTls,
    /// Bearer token sent on every call.
    #[serde(default)]
    pub credentials: HookCredentials,
}

pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Streams per connection at most, whatever the server advertises. An
/// h2-based server (tonic, hyper: Rust hook servers) closes a connection
/// with GOAWAY ENHANCE_YOUR_CALM once the small DATA frames it holds
/// unread cost more than half its connection window (512 KiB by default):
/// a burst of ~10 000 run starts on one connection did that (BENCHMARKS.md,
/// figure 9) and every run on it failed. 1 000 streams with an unread event
/// each stay under half that budget, and 64 connections still carry 64 000
/// runs per hook.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: usize = 1000;
pub const DEFAULT_CONNECTION_IDLE: Duration = Duration::from_secs(60);

/// Every run holds one `Process` stream per hook for its whole life, and a
/// hook server (or a proxy in front of it) caps concurrent streams per
/// HTTP/2 connection (nginx 128, cloud load balancers ~100, grpcio and
/// grpc-go when set): hookwire opens more connections as each reaches the
/// server's advertised limit (or refuses a stream), up to `max`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ConnectionsConfig {
    /// Connections to this hook server at most; new streams wait for a free
    /// slot (bounded by their deadline) when every one is full.
    #[serde(default = "default_max_connections")]
    pub max: usize,
    /// Streams per connection at most, below what the server advertises
    /// (SETTINGS_MAX_CONCURRENT_STREAMS); see
    /// [`DEFAULT_MAX_STREAMS_PER_CONNECTION`] for why there is a default.
    #[serde(default = "default_max_streams_per_connection")]
    pub max_streams_per_connection: usize,
    /// How long a surplus connection may carry no stream before it closes.
    #[serde(
        default = "default_connection_idle",
        deserialize_with = "duration::deserialize"
    )]
    pub idle_timeout: Duration,
}

impl Default for ConnectionsConfig {
    fn default() -> Self {
        ConnectionsConfig {
            max: DEFAULT_MAX_CONNECTIONS,
            max_streams_per_connection: DEFAULT_MAX_STREAMS_PER_CONNECTION,
            idle_timeout: DEFAULT_CONNECTION_IDLE,
        }
    }
}

fn default_max_connections() -> usize {
    DEFAULT_MAX_CONNECTIONS
}
fn default_max_streams_per_connection() -> usize {
    DEFAULT_MAX_STREAMS_PER_CONNECTION
}
fn default_connection_idle() -> Duration {
    DEFAULT_CONNECTION_IDLE
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct HumanDuration(#[serde(deserialize_with = "duration::deserialize")] pub Duration);

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive failures (across runs) that open the breaker; 0 disables.
    #[serde(default = "default_breaker_failures")]
    pub failures: u32,
    /// How long the breaker stays open before a probe call is let through.
    #[serde(
        default = "default_breaker_cooldown",
        deserialize_with = "duration::deserialize"
    )]
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: DEFAULT_BREAKER_FAILURES,
            cooldown: DEFAULT_BREAKER_COOLDOWN,
        }
    }
}

fn default_hook_timeout() -> Duration {
    DEFAULT_HOOK_TIMEOUT
}
fn default_observe_queue() -> usize {
    DEFAULT_OBSERVE_QUEUE
}
fn default_breaker_failures() -> u32 {
    DEFAULT_BREAKER_FAILURES
}
fn default_breaker_cooldown() -> Duration {
    DEFAULT_BREAKER_COOLDOWN
}
fn yes() -> bool {
    true
}

impl HookConfig {
    /// The longest per-call deadline any event of this hook may get.
    pub fn longest_timeout(&self) -> Duration {
        self.event_timeouts
            .values()
            .map(|d| d.0)
            .fold(self.timeout, Duration::max)
    }

    pub fn timeout_for(&self, event: EventKind) -> Duration {
        self.event_timeouts
            .get(&event)
            .map(|d| d.0)
            .unwrap_or(self.timeout)
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum StreamDeltas {
    /// Hold text deltas until model_response hooks accept the turn.
    #[default]
    Hold,
    /// Stream deltas provisionally; retract them if the turn is rewritten.
    Pass,
}

pub const DEFAULT_MAX_TURNS: u32 = 8;
pub const DEFAULT_EVENT_BUDGET: Duration = Duration::from_secs(15);
pub const DEFAULT_RUN_TIMEOUT: Duration = Duration::from_secs(600);
pub const DEFAULT_APPROVAL_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub name: String,
    /// Name of a configured model.
    pub model: String,
    #[serde(default)]
    pub system_prompt: String,
    /// Static context documents appended after the system prompt.
    #[serde(default)]
    pub context: Vec<String>,
    /// Hook names, from `hooks:`.
    #[serde(default)]
    pub hooks: Vec<String>,
    /// Tool names, owned by configured hook servers.
    #[serde(default)]
    pub tools: Vec<String>,
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    #[serde(default = "one")]
    pub tool_concurrency: usize,
    #[serde(default)]
    pub stream_deltas: StreamDeltas,
    /// All hooks of one event together.
    #[serde(
        default = "default_event_budget",
        deserialize_with = "duration::deserialize"
    )]
    pub event_budget: Duration,
    #[serde(
        default = "default_run_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub run_timeout: Duration,
    #[serde(
        default = "default_approval_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub approval_timeout: Duration,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    /// Who may create sessions on this agent; everyone when absent.
    pub allow: Option<AgentAllow>,
    /// Roles that may resolve approvals on this agent's sessions without
    /// owning them.
    #[serde(default = "default_approver_roles")]
    pub approver_roles: Vec<String>,
}

fn default_approver_roles() -> Vec<String> {
    vec![ROLE_APPROVER.to_string()]
}

fn default_max_turns() -> u32 {
    DEFAULT_MAX_TURNS
}
fn one() -> usize {
    1
}
fn default_event_budget() -> Duration {
    DEFAULT_EVENT_BUDGET
}
fn default_run_timeout() -> Duration {
    DEFAULT_RUN_TIMEOUT
}
fn default_approval_timeout() -> Duration {
    DEFAULT_APPROVAL_TIMEOUT
}

#[derive(Clone, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Record prompt / tool content on spans (after hooks ran). Off by default.
    #[serde(default)]
    pub capture_content: bool,
    /// OTLP gRPC endpoint; `OTEL_EXPORTER_OTLP_ENDPOINT` overrides it. Export
    /// is off when neither is set.
    pub otlp_endpoint: Option<String>,
    /// Service name; `OTEL_SERVICE_NAME` overrides it.
    pub service_name: Option<String>,
    /// Parent-based trace-id ratio sampling, 0.0..=1.0 (default 1.0).
    pub sampling_ratio: Option<f64>,
}

pub const DEFAULT_MAX_INPUT_BYTES: usize = 256 * 1024;
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(25);
pub const DEFAULT_RUN_LEASE: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_TRANSCRIPT_BYTES: u64 = 8 * 1024 * 1024;
pub const DEFAULT_RUN_EVENT_BUFFER: usize = 1024;
pub const DEFAULT_CLIENT_STALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Smallest `server.run_event_buffer`: one step's events must fit in half.
pub const MIN_RUN_EVENT_BUFFER: usize = 16;
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Largest accepted user input.
    #[serde(default = "default_max_input")]
    pub max_input_bytes: usize,
    /// How long in-flight runs may finish after SIGTERM before cancellation.
    #[serde(default = "default_grace", deserialize_with = "duration::deserialize")]
    pub shutdown_grace: Duration,
    /// How long a run's lease lasts; its replica renews it every third of
    /// that. When a replica dies, another ends its runs `interrupted` once
    /// their lease expired; a replica that could not renew a run's lease
    /// for two thirds of it stops the run itself first. Also how long a
    /// run's end is written again after the store first failed to take it.
    #[serde(
        default = "default_run_lease",
        deserialize_with = "duration::deserialize"
    )]
    pub run_lease: Duration,
    /// Idle sessions (no run, no activity) are deleted after this long,
    /// firing session_end with reason `expired`. Unset: kept until deleted.
    #[serde(default, deserialize_with = "duration::option::deserialize")]
    pub session_ttl: Option<Duration>,
    /// Largest transcript per session (bytes of stored messages). A run
    /// cannot start on a session at the limit, and a run whose commit would
    /// pass it ends `failed`; a run's final commit is never refused.
    #[serde(default = "default_max_transcript")]
    pub max_transcript_bytes: u64,
    /// Events of one run queued for its client. A slow `Run` reader slows
    /// the run down; one that stops reading ends it (cancelled).
    #[serde(default = "default_run_event_buffer")]
    pub run_event_buffer: usize,
    /// How long a run waits for a `Run` client that reads none of its
    /// events (its queue full) before it is cancelled.
    #[serde(
        default = "default_client_stall",
        deserialize_with = "duration::deserialize"
    )]
    pub client_stall_timeout: Duration,
    /// How often certificate, key, token and JWKS files are checked for
    /// changes (on use: a connection or call after this long re-reads them);
    /// 0s checks on every use.
    #[serde(
        default = "default_reload_interval",
        deserialize_with = "duration::deserialize"
    )]
    pub reload_interval: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_input_bytes: DEFAULT_MAX_INPUT_BYTES,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            run_lease: DEFAULT_RUN_LEASE,
            session_ttl: None,
            max_transcript_bytes: DEFAULT_MAX_TRANSCRIPT_BYTES,
            run_event_buffer: DEFAULT_RUN_EVENT_BUFFER,
            client_stall_timeout: DEFAULT_CLIENT_STALL_TIMEOUT,
            reload_interval: DEFAULT_RELOAD_INTERVAL,
        }
    }
}

fn default_run_lease() -> Duration {
    DEFAULT_RUN_LEASE
}
fn default_max_transcript() -> u64 {
    DEFAULT_MAX_TRANSCRIPT_BYTES
}
fn default_run_event_buffer() -> usize {
    DEFAULT_RUN_EVENT_BUFFER
}
fn default_client_stall() -> Duration {
    DEFAULT_CLIENT_STALL_TIMEOUT
}

fn default_max_input() -> usize {
    DEFAULT_MAX_INPUT_BYTES
}
fn default_grace() -> Duration {
    DEFAULT_SHUTDOWN_GRACE
}
fn default_reload_interval() -> Duration {
    DEFAULT_RELOAD_INTERVAL
}

impl Config {
    pub fn agent(&self, name: &str) -> Option<&AgentConfig> {
        self.agents.iter().find(|a| a.name == name)
    }
    pub fn hook(&self, name: &str) -> Option<&HookConfig> {
        self.hooks.iter().find(|h| h.name == name)
    }
    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }
}
