//! Parsing and validation. Every error names the path of the offending value
//! (`agents[0].model`) and, where it can, the fix.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::{env, Config, ProviderKind};
use crate::event::nearest;

/// The configuration `hookwire serve --no-demo-hooks` runs without
/// `--config`: one agent `demo` on the embedded scripted model, no hooks
/// (without the flag, `crate::demo` adds its hook server).
pub const EMBEDDED_DEFAULT: &str = r#"
models:
  - name: scripted
    provider: scripted
agents:
  - name: demo
    model: scripted
    system_prompt: "You are hookwire's demo agent."
"#;

/// Connections per hook server at most: each is a socket (a file
/// descriptor) on both sides.
pub const MAX_HOOK_CONNECTIONS: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {file}: {source}")]
    Read {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{origin}: {path}: {message}")]
    Parse {
        origin: String,
        path: String,
        message: String,
    },
    #[error("{origin}: {path}: {message}")]
    Invalid {
        origin: String,
        path: String,
        message: String,
    },
}

impl ConfigError {
    /// The dotted path of the offending value.
    pub fn path(&self) -> Option<&str> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Parse { path, .. } | ConfigError::Invalid { path, .. } => Some(path),
        }
    }
}

impl Config {
    /// Reads `file` and applies the endpoint overrides in the process
    /// environment (see [`super::env`]).
    pub fn load(file: &Path) -> Result<Config, ConfigError> {
        Config::load_with_env(file, std::env::vars())
    }

    /// [`Config::load`] with the environment given.
    pub fn load_with_env(
        file: &Path,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(file).map_err(|source| ConfigError::Read {
            file: file.to_path_buf(),
            source,
        })?;
        Config::parse_with_env(&text, &file.display().to_string(), vars)
    }

    pub fn embedded_default() -> Config {
        Config::parse(EMBEDDED_DEFAULT, "embedded default").expect("embedded default is valid")
    }

    /// Parses and validates YAML; `origin` names the source in errors. The
    /// environment is not consulted.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(text, origin, std::iter::empty())
    }

    /// Parses YAML, applies the endpoint overrides among `vars`, then
    /// validates; an error in an overridden value names its variable.
    pub fn parse_with_env(
        text: &str,
        origin: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let de = serde_norway::Deserializer::from_str(text);
        let mut config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let path = if path.is_empty() || path == "." {
                "(top level)".into()
            } else {
                path
            };
            let message = without_path_prefix(&e.into_inner().to_string(), &path);
            ConfigError::Parse {
                origin: origin.to_string(),
                path,
                message,
            }
        })?;
        let applied = env::apply(&mut config, vars).map_err(|r| ConfigError::Invalid {
            origin: "environment".into(),
            path: r.var,
            message: r.message,
        })?;
        let errors = config.validate();
        match errors.into_iter().next() {
            Some((path, message)) => Err(ConfigError::Invalid {
                origin: match applied.get(&path) {
                    Some(var) => format!("{origin} (overridden by {var})"),
                    None => origin.to_string(),
                },
                path,
                message,
            }),
            None => Ok(config),
        }
    }

    /// Semantic checks serde cannot express; returns (path, message) pairs.
    fn validate(&self) -> Vec<(String, String)> {
        let mut errs = Vec::new();
        unique(
            &mut errs,
            "models",
            self.models.iter().map(|m| m.name.as_str()),
        );
        unique(
            &mut errs,
            "hooks",
            self.hooks.iter().map(|h| h.name.as_str()),
        );
        unique(
            &mut errs,
            "agents",
            self.agents.iter().map(|a| a.name.as_str()),
        );

        if self.agents.is_empty() {
            errs.push(("agents".into(), "at least one agent is required".into()));
        }

        for (i, m) in self.models.iter().enumerate() {
            let p = format!("models[{i}]");
            match m.provider {
                ProviderKind::Scripted => {
                    for (field, set) in [
                        ("base_url", m.base_url.is_some()),
                        ("model", m.model.is_some()),
                        ("api_key_env", m.api_key_env.is_some()),
                        ("organization", m.organization.is_some()),
                        ("headers", !m.headers.is_empty()),
                        ("max_retries", m.max_retries.is_some()),
                        ("timeout", m.timeout.is_some()),
                        ("stream", m.stream.is_some()),
                    ] {
                        if set {
                            errs.push((
                                format!("{p}.{field}"),
                                "only valid for provider: openai; remove it or change the provider"
                                    .into(),
                            ));
                        }
                    }
                }
                ProviderKind::Openai => {
                    for (field, set) in [("rules", m.rules.is_some()), ("delay", m.delay.is_some())]
                    {
                        if set {
                            errs.push((
                                format!("{p}.{field}"),
                                "only valid for provider: scripted".into(),
                            ));
                        }
                    }
                    match &m.base_url {
                        None => errs.push((
                            format!("{p}.base_url"),
                            "required for provider: openai (e.g. https://api.openai.com/v1)".into(),
                        )),
                        Some(u) if !(u.starts_with("http://") || u.starts_with("https://")) => errs
                            .push((
                                format!("{p}.base_url"),
                                format!("`{u}` must start with http:// or https://"),
                            )),
                        _ => {}
                    }
                    if m.model.is_none() {
                        errs.push((
                            format!("{p}.model"),
                            "required for provider: openai (the provider's model id)".into(),
                        ));
                    }
                    let max = crate::model::openai::MAX_TIMEOUT;
                    match m.timeout {
                        Some(t) if t.is_zero() => errs.push((
                            format!("{p}.timeout"),
                            "must be greater than zero".into(),
                        )),
                        Some(t) if t > max => errs.push((
                            format!("{p}.timeout"),
                            format!(
                                "must be at most {} (it bounds each wait for the server; the agent's run_timeout bounds a long answer)",
                                humantime_serde::re::humantime::format_duration(max)
                            ),
                        )),
                        _ => {}
                    }
                    if let Some(why) = m
                        .api_key_env
                        .as_deref()
                        .and_then(|env| super::secret_env::refused(env, "API key"))
                    {
                        errs.push((format!("{p}.api_key_env"), why));
                    }
                }
            }
            if let Some(t) = m.temperature {
                if !(0.0..=2.0).contains(&t) {
                    errs.push((
                        format!("{p}.temperature"),
                        "must be within 0.0..=2.0".into(),
                    ));
                }
            }
        }

        for (i, h) in self.hooks.iter().enumerate() {
            let p = format!("hooks[{i}]");
            if !(h.endpoint.starts_with("http://") || h.endpoint.starts_with("https://")) {
                errs.push((
                    format!("{p}.endpoint"),
                    format!(
                        "`{}` must be a URL starting with http:// or https:// (e.g. http://127.0.0.1:50061)",
                        super::redact_url(&h.endpoint)
                    ),
                ));
            } else if let Some(why) = endpoint_refused(&h.endpoint) {
                errs.push((format!("{p}.endpoint"), why));
            }
            if h.timeout.is_zero() {
                errs.push((format!("{p}.timeout"), "must be greater than zero".into()));
            }
            for (ev, d) in &h.event_timeouts {
                if d.0.is_zero() {
                    errs.push((
                        format!("{p}.event_timeouts.{ev}"),
                        "must be greater than zero".into(),
                    ));
                }
            }
            if !(1..=MAX_QUEUE).contains(&h.observe_queue) {
                errs.push((
                    format!("{p}.observe_queue"),
                    format!("must be 1..={MAX_QUEUE}"),
                ));
            }
            let c = &h.connections;
            if c.max == 0 || c.max > MAX_HOOK_CONNECTIONS {
                errs.push((
                    format!("{p}.connections.max"),
                    format!("must be 1..={MAX_HOOK_CONNECTIONS}"),
                ));
            }
            if c.max_streams_per_connection == 0 {
                errs.push((
                    format!("{p}.connections.max_streams_per_connection"),
                    "must be at least 1 (or left out: 1000, or the server's advertised limit if lower)".into(),
                ));
            }
            if c.idle_timeout.is_zero() {
                errs.push((
                    format!("{p}.connections.idle_timeout"),
                    "must be greater than zero".into(),
                ));
            }
        }

        let model_names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        let hook_names: Vec<&str> = self.hooks.iter().map(|h| h.name.as_str()).collect();
        for (i, a) in self.agents.iter().enumerate() {
            let p = format!("agents[{i}]");
            if !model_names.contains(&a.model.as_str()) {
                errs.push((
                    format!("{p}.model"),
                    unknown_ref("model", &a.model, &model_names, "models"),
                ));
            }
            for (j, h) in a.hooks.iter().enumerate() {
                if !hook_names.contains(&h.as_str()) {
                    errs.push((
                        format!("{p}.hooks[{j}]"),
                        unknown_ref("hook", h, &hook_names, "hooks"),
                    ));
                }
            }
            if a.max_turns == 0 {
                errs.push((format!("{p}.max_turns"), "must be at least 1".into()));
            }
            if a.tool_concurrency == 0 {
                errs.push((format!("{p}.tool_concurrency"), "must be at least 1".into()));
            }
            for (field, d) in [
                ("event_budget", a.event_budget),
                ("run_timeout", a.run_timeout),
                ("approval_timeout", a.approval_timeout),
            ] {
                if d.is_zero() {
                    errs.push((format!("{p}.{field}"), "must be greater than zero".into()));
                }
            }
            if let Some(t) = a.temperature {
                if !(0.0..=2.0).contains(&t) {
                    errs.push((
                        format!("{p}.temperature"),
                        "must be within 0.0..=2.0".into(),
                    ));
                }
            }
        }

        if self.server.run_lease < std::time::Duration::from_secs(1) {
            errs.push((
                "server.run_lease".into(),
                "must be at least 1s (the lease is renewed every third of it)".into(),
            ));
        }
        if self.server.session_ttl.is_some_and(|t| t.is_zero()) {
            errs.push((
                "server.session_ttl".into(),
                "must be greater than zero (leave it out to keep idle sessions)".into(),
            ));
        }
        if self.server.max_transcript_bytes == 0 {
            errs.push((
                "server.max_transcript_bytes".into(),
                "must be greater than zero".into(),
            ));
        }
        if !(super::MIN_RUN_EVENT_BUFFER..=MAX_QUEUE).contains(&self.server.run_event_buffer) {
            errs.push((
                "server.run_event_buffer".into(),
                format!("must be {}..={MAX_QUEUE}", super::MIN_RUN_EVENT_BUFFER),
            ));
        }
        if self.server.client_stall_timeout.is_zero() {
            errs.push((
                "server.client_stall_timeout".into(),
                "must be greater than zero".into(),
            ));
        }
        if self.server.max_input_bytes == 0 {
            errs.push(("server.max_input_bytes".into(), "must be at least 1".into()));
        }
        errs.extend(self.validate_security());

        if let Some(r) = self.telemetry.sampling_ratio {
            if !(0.0..=1.0).contains(&r) {
                errs.push((
                    "telemetry.sampling_ratio".into(),
                    "must be within 0.0..=1.0".into(),
                ));
            }
        }
        errs
    }
}

/// What is wrong with a hook endpoint that starts with a scheme, beyond
/// what the connector says when it cannot parse it at all.
fn endpoint_refused(endpoint: &str) -> Option<String> {
    let authority = endpoint.split_once("://")?.1;
    let authority = authority.split(['/', '?', '#']).next().unwrap_or("");
    // gRPC never sends user info, and it shows wherever the endpoint does
    // (logs, ListHooks): a password there would be published.
    if authority.contains('@') {
        return Some(
            "must not carry user info (`user:password@`): gRPC does not send it; give a hook's credentials with credentials.bearer_token_env or bearer_token_file"
                .into(),
        );
    }
    // A port past 65535 (or not a number) parsed, and the connector then
    // dialled the scheme's default port instead.
    let port = match authority.rsplit_once(']') {
        Some((_, rest)) => rest.strip_prefix(':'),
        None => authority.rsplit_once(':').map(|(_, p)| p),
    };
    match port {
        Some(p) if p.parse::<u16>().map_or(true, |n| n == 0) => Some(format!(
            "`{endpoint}` has port `{p}`; a port is 1..=65535 (leave it out for the scheme's default)"
        )),
        _ => None,
    }
}

/// The longest queue a setting may ask for: far more than any run or
/// hook needs, and far below what tokio's channels refuse with a panic
/// (usize::MAX >> 3), which a request would otherwise meet.
const MAX_QUEUE: usize = 1 << 20;

/// The YAML parser starts some messages with its own, shorter, path of the
/// value (`hooks[1].events: unknown event …` for `hooks[1].events[0]`);
/// the error already leads with the full path, so say it once.
fn without_path_prefix(message: &str, path: &str) -> String {
    match message.split_once(": ") {
        Some((head, rest)) if !head.is_empty() && path.starts_with(head) => rest.to_string(),
        _ => message.to_string(),
    }
}

fn unique<'a>(errs: &mut Vec<(String, String)>, list: &str, names: impl Iterator<Item = &'a str>) {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    // Clients name agents in requests and hooks in `extra_hooks`, which
    // take names up to this long: a longer one could never be asked for.
    let max = crate::hooks::wire::MAX_VERDICT_NAME;
    for (i, n) in names.enumerate() {
        if n.is_empty() {
            errs.push((format!("{list}[{i}].name"), "must not be empty".into()));
        } else if n.len() > max {
            errs.push((
                format!("{list}[{i}].name"),
                format!("is {} bytes; a name is at most {max} bytes", n.len()),
            ));
        } else if let Some(first) = seen.insert(n, i) {
            errs.push((
                format!("{list}[{i}].name"),
                format!("duplicate name `{n}` (first defined at {list}[{first}])"),
            ));
        }
    }
}

fn unknown_ref(what: &str, given: &str, known: &[&str], section: &str) -> String {
    let hint = match nearest(given, known.iter().copied()) {
        Some(n) => format!("; did you mean `{n}`?"),
        None if known.is_empty() => format!("; no {what}s are defined under `{section}:`"),
        None => format!("; defined {what}s: {}", known.join(", ")),
    };
    format!("unknown {what} `{given}`{hint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(yaml: &str) -> ConfigError {
        Config::parse(yaml, "test.yaml").unwrap_err()
    }

    #[test]
    fn embedded_default_is_valid() {
        let c = Config::embedded_default();
        assert_eq!(c.agents[0].name, "demo");
        assert_eq!(c.agents[0].max_turns, super::super::DEFAULT_MAX_TURNS);
    }

    #[test]
    fn unknown_field_names_its_path() {
        let e = err("agents:\n  - name: a\n    model: m\n    max_turn: 3\nmodels: [{name: m, provider: scripted}]\n");
        assert_eq!(e.path(), Some("agents[0].max_turn"));
        assert!(e.to_string().contains("unknown field `max_turn`"), "{e}");
        assert!(
            e.to_string().contains("max_turns"),
            "lists expected fields: {e}"
        );
    }

    #[test]
    fn misspelled_event_suggests_nearest() {
        let e = err(
            "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\nhooks:\n  - name: h\n    endpoint: http://x:1\n    events: [run_start, tool_reslt]\n",
        );
        assert_eq!(e.path(), Some("hooks[0].events[1]"));
        assert!(e.to_string().contains("did you mean `tool_result`"), "{e}");
        assert_eq!(e.to_string().matches("hooks[0].events").count(), 1, "{e}");
        assert!(
            e.to_string()
                .starts_with("test.yaml: hooks[0].events[1]: unknown event `tool_reslt`"),
            "{e}"
        );
    }

    #[test]
    fn unknown_model_reference_suggests() {
        let e = err(
            "models: [{name: scripted, provider: scripted}]\nagents: [{name: a, model: scriptd}]\n",
        );
        assert_eq!(e.path(), Some("agents[0].model"));
        assert!(e.to_string().contains("did you mean `scripted`"), "{e}");
    }

    /// The defaults README and docs/writing-hooks.md promise, spelled out
    /// (not read back from the constants, which would agree with anything).
    #[test]
    fn hook_defaults_are_the_documented_ones() {
        let c = Config::parse(
            "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m, hooks: [h]}]\nhooks: [{name: h, endpoint: 'http://x:1'}]\n",
            "t",
        )
        .unwrap();
        let h = &c.hooks[0];
        use crate::config::{FailurePolicy, HookMode};
        use std::time::Duration;
        assert_eq!(h.timeout, Duration::from_secs(5));
        assert_eq!(h.failure, FailurePolicy::Closed);
        assert_eq!(h.mode, HookMode::Blocking);
        assert_eq!(h.priority, 0);
        assert!(h.detach_on_failure);
        assert_eq!(h.observe_queue, 256);
        assert_eq!(h.breaker.failures, 5);
        assert_eq!(h.breaker.cooldown, Duration::from_secs(30));
    }

    #[test]
    fn hook_endpoints_with_a_bad_port_or_user_info_are_refused() {
        let yaml = |e: &str| {
            format!("models: [{{name: m, provider: scripted}}]\nhooks: [{{name: h, endpoint: '{e}'}}]\nagents: [{{name: a, model: m, hooks: [h]}}]\n")
        };
        for (endpoint, says) in [
            ("https://guard.hooks.svc:500610", "port `500610`"),
            ("http://guard:0", "port `0`"),
            ("http://guard:http", "port `http`"),
            ("http://[::1]:70000/x", "port `70000`"),
            ("http://u:SECRET@guard:50061", "user info"),
        ] {
            let e = err(&yaml(endpoint));
            assert_eq!(e.path(), Some("hooks[0].endpoint"), "{endpoint}: {e}");
            assert!(e.to_string().contains(says), "{endpoint}: {e}");
            assert!(!e.to_string().contains("SECRET"), "{e}");
        }
        for fine in [
            "http://guard:50061",
            "https://guard",
            "http://[::1]:1/",
            "http://g:65535?x",
        ] {
            Config::parse(&yaml(fine), "t").unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
    }

    /// Each of these parsed, then panicked on the first request that used
    /// it (a run's deadline, a channel, a JWT's leeway under now).
    #[test]
    fn huge_durations_and_queues_are_refused_naming_their_path() {
        let base = "models: [{name: m, provider: scripted}]\nhooks: [{name: h, endpoint: 'http://x:1'}]\nagents: [{name: a, model: m, hooks: [h]}]\n";
        let huge = "10000000000000000000s";
        for (yaml, path) in [
            (
                base.replace(
                    "model: m, hooks",
                    &format!("model: m, run_timeout: {huge}, hooks"),
                ),
                "agents[0].run_timeout",
            ),
            (
                base.replace("model: m, hooks", "model: m, event_budget: 367d, hooks"),
                "agents[0].event_budget",
            ),
            (
                base.replace("'http://x:1'", &format!("'http://x:1', timeout: {huge}")),
                "hooks[0].timeout",
            ),
            (
                base.replace(
                    "'http://x:1'",
                    &format!("'http://x:1', event_timeouts: {{run_start: {huge}}}"),
                ),
                "hooks[0].event_timeouts.run_start",
            ),
            (
                base.replace(
                    "provider: scripted",
                    &format!("provider: scripted, delay: {huge}"),
                ),
                "models[0].delay",
            ),
            (
                format!("{base}server: {{session_ttl: {huge}}}\n"),
                "server.session_ttl",
            ),
            (
                base.replace(
                    "'http://x:1'",
                    "'http://x:1', observe_queue: 3000000000000000000",
                ),
                "hooks[0].observe_queue",
            ),
            (
                format!("{base}server: {{run_event_buffer: 3000000000000000000}}\n"),
                "server.run_event_buffer",
            ),
        ] {
            let e = err(&yaml);
            assert!(e.path().is_some_and(|p| p.starts_with(path)), "{path}: {e}");
        }
        // The longest accepted is a year and a day.
        Config::parse(
            &base.replace("model: m, hooks", "model: m, run_timeout: 366d, hooks"),
            "t",
        )
        .unwrap();
    }

    #[test]
    fn unknown_hook_reference() {
        let e = err("models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m, hooks: [nope]}]\n");
        assert_eq!(e.path(), Some("agents[0].hooks[0]"));
        assert!(e.to_string().contains("no hooks are defined"), "{e}");
    }

    #[test]
    fn openai_requires_base_url_and_model() {
        let e = err("models: [{name: m, provider: openai}]\nagents: [{name: a, model: m}]\n");
        assert_eq!(e.path(), Some("models[0].base_url"));
    }

    #[test]
    fn provider_field_mismatch() {
        let e = err("models: [{name: m, provider: scripted, base_url: 'http://x'}]\nagents: [{name: a, model: m}]\n");
        assert_eq!(e.path(), Some("models[0].base_url"));
        assert!(e.to_string().contains("only valid for provider: openai"));
    }

    #[test]
    fn scripted_delay_parses_and_is_scripted_only() {
        let c = Config::parse("models: [{name: m, provider: scripted, delay: 2s, rules: [{text: hi, delay: 150ms}]}]\nagents: [{name: a, model: m}]\n", "t").unwrap();
        let m = c.model("m").unwrap();
        assert_eq!(m.delay, Some(std::time::Duration::from_secs(2)));
        assert_eq!(
            m.rules.as_ref().unwrap()[0].delay,
            Some(std::time::Duration::from_millis(150))
        );
        let e = err("models: [{name: m, provider: openai, base_url: 'http://x:1/v1', model: x, delay: 2s}]\nagents: [{name: a, model: m}]\n");
        assert_eq!(e.path(), Some("models[0].delay"));
        assert!(
            e.to_string().contains("only valid for provider: scripted"),
            "{e}"
        );
        let e = err(
            "models: [{name: m, provider: scripted, delay: soon}]\nagents: [{name: a, model: m}]\n",
        );
        assert_eq!(e.path(), Some("models[0].delay"));
    }

    /// A model timeout of 0 failed every call; a huge one panicked on
    /// `Instant + timeout` when an error body was read.
    #[test]
    fn an_openai_timeout_is_within_bounds() {
        let yaml = |t: &str| {
            format!("models: [{{name: s, provider: scripted}}, {{name: m, provider: openai, base_url: 'http://x:1/v1', model: x, timeout: {t}}}]\nagents: [{{name: a, model: m}}]\n")
        };
        for ok in ["1ms", "60s", "1h"] {
            let c = Config::parse(&yaml(ok), "t").unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(c.model("m").unwrap().timeout.is_some());
        }
        for (bad, why) in [
            ("0s", "must be greater than zero"),
            ("61m", "must be at most 1h"),
            // Past every duration's bound, which the parser checks first.
            ("500000000y", "at most 366d"),
        ] {
            let e = err(&yaml(bad));
            assert_eq!(e.path(), Some("models[1].timeout"), "{bad}: {e}");
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn hook_connections_defaults_and_bounds() {
        let c = Config::parse("models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\nhooks: [{name: h, endpoint: 'http://x:1'}, {name: g, endpoint: 'http://x:2', connections: {max: 8, max_streams_per_connection: 100, idle_timeout: 5s}}]\n", "t").unwrap();
        assert_eq!(
            c.hooks[0].connections,
            super::super::ConnectionsConfig::default()
        );
        assert_eq!(
            c.hooks[0].connections.max_streams_per_connection,
            super::super::DEFAULT_MAX_STREAMS_PER_CONNECTION
        );
        let g = &c.hooks[1].connections;
        assert_eq!((g.max, g.max_streams_per_connection), (8, 100));
        assert_eq!(g.idle_timeout, std::time::Duration::from_secs(5));
        for (bad, path) in [
            ("{max: 0}", "hooks[0].connections.max"),
            (
                "{max_streams_per_connection: 0}",
                "hooks[0].connections.max_streams_per_connection",
            ),
            ("{idle_timeout: 0s}", "hooks[0].connections.idle_timeout"),
            ("{max: 2, streams: 4}", "hooks[0].connections.streams"),
        ] {
            let e = err(&format!("models: [{{name: m, provider: scripted}}]\nagents: [{{name: a, model: m}}]\nhooks: [{{name: h, endpoint: 'http://x:1', connections: {bad}}}]\n"));
            assert_eq!(e.path(), Some(path), "{bad}: {e}");
        }
    }

    #[test]
    fn a_name_no_request_could_carry_is_refused() {
        let long = "a".repeat(1025);
        let e = err(&format!(
            "models: [{{name: m, provider: scripted}}]\nagents: [{{name: {long}, model: m}}]\n"
        ));
        assert_eq!(e.path(), Some("agents[0].name"));
        assert!(e.to_string().contains("at most 1024 bytes"), "{e}");
    }

    #[test]
    fn duplicate_names() {
        let e = err("models: [{name: m, provider: scripted}, {name: m, provider: scripted}]\nagents: [{name: a, model: m}]\n");
        assert_eq!(e.path(), Some("models[1].name"));
    }

    #[test]
    fn bad_duration_and_endpoint() {
        let e = err("models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\nhooks: [{name: h, endpoint: 'x:1', timeout: 5 parsecs}]\n");
        assert_eq!(e.path(), Some("hooks[0].timeout"));
        let e = err("models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\nhooks: [{name: h, endpoint: 'x:1'}]\n");
        assert_eq!(e.path(), Some("hooks[0].endpoint"));
    }

    const WITH_HOOK_AND_MODEL: &str = "models: [{name: m, provider: scripted}, {name: gpt, provider: openai, base_url: 'http://file:1/v1', model: x}]\nagents: [{name: a, model: m, hooks: [py-guard]}]\nhooks: [{name: py-guard, endpoint: 'http://file:2'}]\n";

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn env_overrides_hook_endpoints_and_model_urls() {
        let c = Config::parse_with_env(
            WITH_HOOK_AND_MODEL,
            "t",
            vars(&[
                (
                    "HOOKWIRE_HOOK_PY_GUARD_ENDPOINT",
                    "http://guard.ns.svc:50061",
                ),
                ("HOOKWIRE_MODEL_GPT_BASE_URL", "http://vllm:8000/v1"),
                ("PATH", "/bin"),
            ]),
        )
        .unwrap();
        assert_eq!(c.hooks[0].endpoint, "http://guard.ns.svc:50061");
        assert_eq!(c.models[1].base_url.as_deref(), Some("http://vllm:8000/v1"));
        // Without the variables the file's values stand.
        let c = Config::parse(WITH_HOOK_AND_MODEL, "t").unwrap();
        assert_eq!(c.hooks[0].endpoint, "http://file:2");
    }

    #[test]
    fn a_bad_override_names_its_variable() {
        let e = Config::parse_with_env(
            WITH_HOOK_AND_MODEL,
            "t.yaml",
            vars(&[("HOOKWIRE_HOOK_PY_GUARD_ENDPOINT", "guard:50061")]),
        )
        .unwrap_err();
        assert_eq!(e.path(), Some("hooks[0].endpoint"));
        assert!(
            e.to_string()
                .starts_with("t.yaml (overridden by HOOKWIRE_HOOK_PY_GUARD_ENDPOINT)"),
            "{e}"
        );
        let e = Config::parse_with_env(
            WITH_HOOK_AND_MODEL,
            "t.yaml",
            vars(&[("HOOKWIRE_HOOK_PY_GAURD_ENDPOINT", "http://x:1")]),
        )
        .unwrap_err();
        assert_eq!(e.path(), Some("HOOKWIRE_HOOK_PY_GAURD_ENDPOINT"));
        assert!(
            e.to_string()
                .contains("did you mean HOOKWIRE_HOOK_PY_GUARD_ENDPOINT?"),
            "{e}"
        );
        let e = Config::parse_with_env(
            WITH_HOOK_AND_MODEL,
            "t.yaml",
            vars(&[("HOOKWIRE_MODEL_M_BASE_URL", "http://x:1")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not provider: openai"), "{e}");
    }

    #[test]
    fn names_that_share_a_variable_are_rejected_only_when_overriding() {
        let yaml = "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\nhooks: [{name: a-b, endpoint: 'http://x:1'}, {name: a_b, endpoint: 'http://x:2'}]\n";
        assert!(Config::parse(yaml, "t").is_ok());
        let e = Config::parse_with_env(
            yaml,
            "t",
            vars(&[("HOOKWIRE_HOOK_A_B_ENDPOINT", "http://x:3")]),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("matches both hooks[0] and hooks[1]"),
            "{e}"
        );
    }

    #[test]
    fn hook_defaults_and_overrides() {
        let c = Config::parse("models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m, hooks: [h]}]\nhooks: [{name: h, endpoint: 'http://x:1', timeout: 2s, event_timeouts: {tool_call: 30s}}]\n", "t").unwrap();
        let h = &c.hooks[0];
        assert_eq!(h.failure, super::super::FailurePolicy::Closed);
        assert_eq!(
            h.timeout_for(crate::event::EventKind::ToolCall).as_secs(),
            30
        );
        assert_eq!(
            h.timeout_for(crate::event::EventKind::RunStart).as_secs(),
            2
        );
    }
}
