//! Conformance checking of hook servers (`hookwire hooks check`): drives any
//! `HookService` implementation through a scripted session and run covering
//! every event it subscribes to, calls every tool it owns, and judges each
//! answer with the engine's own rules.
//!
//! - `script`: the payloads of the scripted run;
//! - `drive` / `stream`: the IO, played the way hookwire plays a run;
//! - `transcript`: what happened on the wire;
//! - `checks`: the judgement, free of IO;
//! - `args`: arguments for owned tools, from their schema;
//! - `report`: rows, table and JSON.
//!
//! The script does not branch on verdicts: terminal ones (terminate, skip,
//! respond, retry, ask, continue_run) are judged like any other and the run
//! goes on, so every subscribed event is exercised. Rewrites that hookwire
//! threads into later events (input, tool arguments and results, the final
//! answer, scratchpad) are threaded here too.

pub mod args;
pub mod checks;
pub mod drive;
pub mod report;
pub mod script;
pub mod stream;
pub mod transcript;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::event::EventKind;
use crate::hooks::wire::event_kind_from_wire;
use crate::message::ToolSpec;
use crate::pb::hook_service_client::HookServiceClient;

pub use report::{Report, Row, ServerInfo, Status};

/// Default `deadline_remaining_ms` sent with each event: hookwire's default
/// hook `timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// What to check and how.
#[derive(Clone, Debug)]
pub struct Options {
    /// `http://host:port`, `https://host:port`, or `host:port` (plaintext).
    pub endpoint: String,
    /// Narrows the events exercised (like a hook's `events:` in config).
    pub events: Option<Vec<EventKind>>,
    /// Deadline sent with every event; also bounds Describe and CallTool.
    pub timeout: Duration,
    /// Arguments (a JSON object, as text) per owned tool, instead of ones
    /// derived from the tool's schema.
    pub tool_args: BTreeMap<String, String>,
    /// TLS for an https:// endpoint, as a hook's `tls:` in config.
    pub tls: crate::config::HookTls,
    /// Bearer token sent on every call, as a hook's `credentials:`.
    pub token: Option<String>,
    /// The caller the events say they come from (EventContext.principal).
    pub principal: String,
    /// Its claims (EventContext.principal_claims).
    pub principal_claims: BTreeMap<String, String>,
    /// How long past a deadline to keep waiting, so a late verdict is
    /// reported as late rather than as missing. Default: the deadline,
    /// between 1 s and 2 s.
    pub grace: Option<Duration>,
}

impl Options {
    pub fn new(endpoint: impl Into<String>) -> Options {
        Options {
            endpoint: endpoint.into(),
            events: None,
            timeout: DEFAULT_TIMEOUT,
            tool_args: BTreeMap::new(),
            tls: Default::default(),
            token: None,
            principal: script::DEFAULT_PRINCIPAL.into(),
            principal_claims: BTreeMap::from([("roles".to_string(), String::new())]),
            grace: None,
        }
    }
}

/// Input the checker cannot start with. Everything about the server itself
/// is a row of the report, never an error.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("{0}")]
    Endpoint(String),
    #[error("--timeout must be more than zero")]
    ZeroTimeout,
}

/// The health services a hook server should report SERVING for.
const HEALTH_SERVICES: [&str; 2] = ["", "hookwire.v1.HookService"];

/// Accepts `host:port` as plaintext `http://host:port`, like most gRPC tools.
fn normalize(endpoint: &str) -> String {
    let e = endpoint.trim();
    if e.contains("://") {
        e.to_string()
    } else {
        format!("http://{e}")
    }
}

pub async fn check(opts: &Options) -> Result<Report, CheckError> {
    if opts.timeout.is_zero() {
        return Err(CheckError::ZeroTimeout);
    }
    let url = normalize(&opts.endpoint);
    if !url.starts_with("https://") && opts.tls != crate::config::HookTls::default() {
        return Err(CheckError::Endpoint(format!(
            "TLS options need an https:// endpoint (got {url})"
        )));
    }
    // Exactly as hookwire connects: same connector, TLS and credentials.
    let tls = if url.starts_with("https://") {
        Some(
            crate::tls::HookTls::new(&url, &opts.tls, Duration::ZERO)
                .map_err(|e| CheckError::Endpoint(e.to_string()))?,
        )
    } else {
        None
    };
    let channel = crate::hooks::client::connect(
        &url,
        opts.timeout
            .clamp(Duration::from_secs(1), Duration::from_secs(10)),
        tls.as_ref(),
        // The checker makes one connection and does not re-Describe.
        Default::default(),
    )
    .map_err(CheckError::Endpoint)?;
    let credentials = match &opts.token {
        Some(t) => crate::hooks::credentials::Credentials::bearer(t)
            .map_err(|e| CheckError::Endpoint(format!("--token: {e}")))?,
        None => Default::default(),
    };
    let client = HookServiceClient::new(tonic::service::interceptor::InterceptedService::new(
        channel.clone(),
        credentials,
    ))
    .max_decoding_message_size(16 * 1024 * 1024);
    let mut report = Report {
        endpoint: url.clone(),
        server: None,
        rows: Vec::new(),
    };

    let (desc, took) = match drive::describe(client.clone(), opts.timeout).await {
        Ok(d) => d,
        Err(f) => {
            // Nothing else can be checked without Describe.
            report.rows.push(checks::describe_failed(&url, &f));
            return Ok(report);
        }
    };
    report.rows.extend(checks::describe(&desc, took));
    let described: Vec<EventKind> = desc
        .events
        .iter()
        .filter_map(|v| event_kind_from_wire(*v))
        .collect();
    let mut events = described.clone();
    if let Some(wanted) = &opts.events {
        report
            .rows
            .extend(checks::requested_events(wanted, &described));
        events.retain(|e| wanted.contains(e));
    }
    events.sort();
    events.dedup();

    for service in HEALTH_SERVICES {
        let answer = drive::health(channel.clone(), service, opts.timeout).await;
        report.rows.push(checks::health(service, &answer));
    }

    // Owned tools: schema, then arguments to call them with in the run.
    let tools: Vec<ToolSpec> = desc.tools.iter().cloned().map(Into::into).collect();
    let mut tool_rows = Vec::new();
    let mut planned = Vec::new();
    for spec in &tools {
        let schema = args::schema_of(spec);
        tool_rows.push(checks::tool_schema(spec, &schema));
        let (arguments, source) = match opts.tool_args.get(&spec.name) {
            Some(a) => (a.clone(), checks::ArgsSource::Flag),
            None => {
                let derived = match &schema {
                    args::Schema::Valid(_, value) => args::derive(value),
                    _ => serde_json::json!({}),
                };
                (derived.to_string(), checks::ArgsSource::Schema)
            }
        };
        let valid = args::validate(spec, &schema, &arguments);
        tool_rows.push(checks::tool_arguments(spec, &arguments, source, &valid));
        if valid.is_ok() {
            planned.push((spec.clone(), arguments));
        }
    }
    for name in opts.tool_args.keys() {
        if !tools.iter().any(|t| &t.name == name) {
            tool_rows.push(Row::fail(
                format!("tool {name}"),
                "--tool-args",
                "the server does not own a tool of this name",
            ));
        }
    }

    report.server = Some(ServerInfo {
        name: desc.name.clone(),
        version: desc.version.clone(),
        events: events.clone(),
        tools: tools.iter().map(|t| t.name.clone()).collect(),
    });
    let mut scenario = script::Scenario::new(events, planned);
    scenario.principal = opts.principal.clone();
    scenario.principal_claims = opts.principal_claims.clone();
    let hook_name = if desc.name.trim().is_empty() {
        "hook"
    } else {
        desc.name.as_str()
    };
    let mut timing = drive::Timing::new(opts.timeout);
    if let Some(grace) = opts.grace {
        timing.grace = grace;
    }
    let transcript = drive::run(&scenario, client, hook_name, timing).await;

    // Tool rows together: schema, arguments, then the call made in the run.
    for spec in &tools {
        let subject = format!("tool {}", spec.name);
        let log = transcript.tool_calls.iter().find(|l| l.tool == spec.name);
        let at = tool_rows
            .iter()
            .rposition(|r| r.subject == subject)
            .map_or(tool_rows.len(), |i| i + 1);
        tool_rows.insert(at, checks::tool_call(spec, log));
    }
    report.rows.extend(tool_rows);
    if !scenario.has_run_events() {
        report.rows.push(Row::skip(
            "run stream",
            "opens",
            "no run event to check (none subscribed, or --events left none): hookwire would not open Process for a run",
        ));
    }
    for log in &transcript.streams {
        report.rows.extend(checks::stream(log));
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_host_port_is_plaintext() {
        assert_eq!(normalize("127.0.0.1:50061"), "http://127.0.0.1:50061");
        assert_eq!(normalize(" https://h:1 "), "https://h:1");
    }

    #[tokio::test]
    async fn unreachable_endpoint_is_a_failed_row_naming_it() {
        // Bind then drop: a port nobody listens on.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut opts = Options::new(format!("127.0.0.1:{port}"));
        opts.timeout = Duration::from_secs(2);
        let r = check(&opts).await.unwrap();
        assert!(!r.passed());
        assert_eq!(r.rows.len(), 1);
        let reason = &r.rows[0].reason;
        assert!(
            reason.starts_with(&format!("http://127.0.0.1:{port}: connect:")),
            "{reason}"
        );
    }

    #[tokio::test]
    async fn bad_endpoint_is_an_error() {
        let err = check(&Options::new("http://bad host:1")).await.unwrap_err();
        assert!(err.to_string().contains("bad endpoint"), "{err}");
    }
}
