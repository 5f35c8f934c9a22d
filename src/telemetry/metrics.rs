//! Prometheus metrics, served as text on the admin port's `/metrics`.
//!
//! Label values must come from bounded sets: hook, event, agent and model
//! names from the config file; outcomes and failure classes from the code's
//! enums. Never pass a session id, run id, tool argument or error message as
//! a label: every distinct value is a new time series, kept forever.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Hook calls: local ones take well under a millisecond, remote ones a few,
/// and hooks that call a model themselves take seconds (the default hook
/// timeout is in seconds too), so 1 ms .. 60 s.
const HOOK_BUCKETS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Model calls: tens of milliseconds (scripted) to minutes (long answers).
const MODEL_BUCKETS: [f64; 13] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
];
/// Runs: several turns of model and tool calls, up to the run timeout.
const RUN_BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
];

fn hook_histogram() -> Histogram {
    Histogram::new(HOOK_BUCKETS)
}
fn model_histogram() -> Histogram {
    Histogram::new(MODEL_BUCKETS)
}
fn run_histogram() -> Histogram {
    Histogram::new(RUN_BUCKETS)
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Event and outcome come from fixed sets of names, so only the hook name
/// is copied per call (this is recorded at every hook call).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookCallLabels {
    hook: String,
    event: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookEventLabels {
    hook: String,
    event: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookFailureLabels {
    hook: String,
    event: String,
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HookLabels {
    hook: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabels {
    agent: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentLabels {
    agent: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
    provider: String,
}

/// Per principal *class* (admin, approver, user, anonymous), never per
/// principal: the number of principals is not bounded.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    limit: &'static str,
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    model: String,
    provider: String,
    /// `input` or `output`, as the GenAI `gen_ai.token.type`.
    token_type: &'static str,
    /// `true` when the provider reported no usage and hookwire estimated
    /// it (about 4 characters per token), so dashboards can tell.
    estimated: &'static str,
}

/// All of hookwire's metrics. Cheap to share behind an `Arc`; every method
/// takes `&self`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    hook_call_duration: HistogramFamily<HookCallLabels>,
    hook_failures: Family<HookFailureLabels, Counter>,
    hook_fail_open: Family<HookEventLabels, Counter>,
    hook_late_verdicts: Family<HookLabels, Counter>,
    observe_dropped: Family<HookLabels, Counter>,
    breaker_open: Family<HookLabels, Gauge>,
    hook_unsubscribed: Family<HookEventLabels, Gauge>,
    runs: Family<RunLabels, Counter>,
    run_duration: HistogramFamily<RunLabels>,
    run_panics: Family<AgentLabels, Counter>,
    model_call_duration: HistogramFamily<ModelLabels>,
    model_tokens: Family<TokenLabels, Counter>,
    active_runs: Gauge,
    active_hook_streams: Gauge,
    early_answers: Gauge,
    hook_connections: Family<HookLabels, Gauge>,
    hook_streams: Family<HookLabels, Gauge>,
    hook_streams_refused: Family<HookLabels, Counter>,
    hook_stream_waits: Family<HookLabels, Counter>,
    runtime_alive_tasks: Gauge,
    quota_rejections: Family<QuotaLabels, Counter>,
}

/// One hook's connection-pool series (see `hooks::pool`).
#[derive(Clone, Debug)]
pub struct PoolMetrics {
    pub connections: Gauge,
    pub streams: Gauge,
    pub refused: Counter,
    pub waits: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let hook_call_duration = HistogramFamily::new_with_constructor(hook_histogram as fn() -> _);
        registry.register_with_unit(
            "hookwire_hook_call_duration",
            "Hook call wall time, by hook, event and outcome (ok, timeout, a failure class, failed_open)",
            Unit::Seconds,
            hook_call_duration.clone(),
        );
        let hook_failures = Family::default();
        registry.register(
            "hookwire_hook_failures",
            "Hook failures by failure class, whatever the failure policy",
            hook_failures.clone(),
        );
        let hook_fail_open = Family::default();
        registry.register(
            "hookwire_hook_fail_open",
            "Hook failures that let the event proceed (failure: open)",
            hook_fail_open.clone(),
        );
        let hook_late_verdicts = Family::default();
        registry.register(
            "hookwire_hook_late_verdicts",
            "Verdicts that arrived after their deadline and were discarded",
            hook_late_verdicts.clone(),
        );
        let observe_dropped = Family::default();
        registry.register(
            "hookwire_observe_dropped",
            "Observe-only events dropped because the hook's queue was full",
            observe_dropped.clone(),
        );
        let breaker_open = Family::default();
        registry.register(
            "hookwire_hook_breaker_open",
            "1 while the hook's circuit breaker is open (the hook is not called)",
            breaker_open.clone(),
        );
        let hook_unsubscribed = Family::default();
        registry.register(
            "hookwire_hook_unsubscribed",
            "1 while a configured event of the hook is missing from its server's Describe (a blocking hook fails there, class unsubscribed)",
            hook_unsubscribed.clone(),
        );
        let runs = Family::default();
        registry.register(
            "hookwire_runs",
            "Finished runs by agent and outcome",
            runs.clone(),
        );
        let run_duration = HistogramFamily::new_with_constructor(run_histogram as fn() -> _);
        registry.register_with_unit(
            "hookwire_run_duration",
            "Run wall time by agent and outcome",
            Unit::Seconds,
            run_duration.clone(),
        );
        let run_panics = Family::default();
        registry.register(
            "hookwire_run_panics",
            "Runs ended by a panic inside hookwire (outcome failed, reason internal error): each one is a bug",
            run_panics.clone(),
        );
        let model_call_duration =
            HistogramFamily::new_with_constructor(model_histogram as fn() -> _);
        registry.register_with_unit(
            "hookwire_model_call_duration",
            "Model provider call wall time",
            Unit::Seconds,
            model_call_duration.clone(),
        );
        let model_tokens = Family::default();
        registry.register(
            "hookwire_model_tokens",
            "Tokens used by model calls, by token_type (input, output); estimated=true where the provider reported none and hookwire estimated them",
            model_tokens.clone(),
        );
        let active_runs = Gauge::default();
        registry.register(
            "hookwire_active_runs",
            "Runs in progress",
            active_runs.clone(),
        );
        let active_hook_streams = Gauge::default();
        registry.register(
            "hookwire_active_hook_streams",
            "Open Process streams to hook servers",
            active_hook_streams.clone(),
        );
        let early_answers = Gauge::default();
        registry.register(
            "hookwire_approval_answers_waiting",
            "ResolveApproval answers that came before their question (the hook's ask) and wait for it",
            early_answers.clone(),
        );
        let hook_connections = Family::default();
        registry.register(
            "hookwire_hook_connections",
            "HTTP/2 connections open to the hook server",
            hook_connections.clone(),
        );
        let hook_streams = Family::default();
        registry.register(
            "hookwire_hook_streams",
            "Streams and calls in flight to the hook server, over all its connections",
            hook_streams.clone(),
        );
        let hook_streams_refused = Family::default();
        registry.register(
            "hookwire_hook_streams_refused",
            "Streams the hook server refused (REFUSED_STREAM); each was retried on another connection",
            hook_streams_refused.clone(),
        );
        let hook_stream_waits = Family::default();
        registry.register(
            "hookwire_hook_stream_waits",
            "Streams that waited for a free slot: every connection at its limit, or one still connecting",
            hook_stream_waits.clone(),
        );
        let runtime_alive_tasks = Gauge::default();
        registry.register(
            "hookwire_runtime_alive_tasks",
            "Tokio tasks alive in hookwire's runtime, read at each scrape (a run holds a few: its own, one per hook stream, the HTTP/2 streams')",
            runtime_alive_tasks.clone(),
        );
        let quota_rejections = Family::default();
        registry.register(
            "hookwire_quota_rejections",
            "Calls refused with RESOURCE_EXHAUSTED, by limit and principal class (admin, approver, user, anonymous)",
            quota_rejections.clone(),
        );
        // Process-wide counters owned by tls/ and auth/ (they count before
        // any Metrics exists, e.g. while hook clients are built).
        registry.register(
            "hookwire_reload_failures",
            "Certificate, key, token or JWKS files that changed but could not be loaded (the previous version stays in use), by kind",
            crate::tls::reload_failures(),
        );
        registry.register(
            "hookwire_auth_failures",
            "Calls refused as UNAUTHENTICATED, by reason (missing_token, invalid, missing_certificate)",
            crate::auth::layer::auth_failures(),
        );
        Metrics {
            registry,
            quota_rejections,
            hook_call_duration,
            hook_failures,
            hook_fail_open,
            hook_late_verdicts,
            observe_dropped,
            breaker_open,
            hook_unsubscribed,
            runs,
            run_duration,
            run_panics,
            model_call_duration,
            model_tokens,
            active_runs,
            active_hook_streams,
            early_answers,
            hook_connections,
            hook_streams,
            hook_streams_refused,
            hook_stream_waits,
            runtime_alive_tasks,
        }
    }

    /// Refreshes the runtime gauges (call before encoding a scrape).
    pub fn runtime_tasks(&self, alive: usize) {
        self.runtime_alive_tasks
            .set(i64::try_from(alive).unwrap_or(i64::MAX));
    }

    /// The connection-pool series of `hook`, created now so they read 0
    /// before its first call.
    pub fn hook_pool(&self, hook: &str) -> PoolMetrics {
        let l = hook_labels(hook);
        PoolMetrics {
            connections: self.hook_connections.get_or_create(&l).clone(),
            streams: self.hook_streams.get_or_create(&l).clone(),
            refused: self.hook_streams_refused.get_or_create(&l).clone(),
            waits: self.hook_stream_waits.get_or_create(&l).clone(),
        }
    }

    /// The registry in the text exposition format (OpenMetrics 1.0, which
    /// Prometheus also reads as its classic text format).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("formatting into a String cannot fail");
        out
    }

    /// One hook call; `outcome` is `ok`, `timeout`, a failure class or
    /// `failed_open`.
    pub fn hook_call(
        &self,
        hook: &str,
        event: &'static str,
        outcome: &'static str,
        latency: Duration,
    ) {
        let labels = HookCallLabels {
            hook: hook.to_owned(),
            event,
            outcome,
        };
        self.hook_call_duration
            .get_or_create(&labels)
            .observe(latency.as_secs_f64());
    }

    /// The latency series of `hook`'s calls on `event` with `outcome`, to
    /// keep and observe without the family's lookup (a lock, the label
    /// set hashed and the hook name copied: ~0.8k instructions per call,
    /// callgrind). Observing it is [`Metrics::hook_call`].
    pub fn hook_call_series(
        &self,
        hook: &str,
        event: &'static str,
        outcome: &'static str,
    ) -> Histogram {
        self.hook_call_duration
            .get_or_create(&HookCallLabels {
                hook: hook.to_owned(),
                event,
                outcome,
            })
            .clone()
    }

    pub fn quota_rejected(&self, limit: &'static str, class: &'static str) {
        self.quota_rejections
            .get_or_create(&QuotaLabels { limit, class })
            .inc();
    }

    pub fn hook_failure(&self, hook: &str, event: &str, class: &str) {
        let labels = HookFailureLabels {
            hook: hook.to_owned(),
            event: event.to_owned(),
            class: class.to_owned(),
        };
        self.hook_failures.get_or_create(&labels).inc();
    }

    pub fn hook_fail_open(&self, hook: &str, event: &str) {
        let labels = HookEventLabels {
            hook: hook.to_owned(),
            event: event.to_owned(),
        };
        self.hook_fail_open.get_or_create(&labels).inc();
    }

    pub fn hook_late_verdict(&self, hook: &str) {
        self.hook_late_verdicts
            .get_or_create(&hook_labels(hook))
            .inc();
    }

    pub fn observe_dropped(&self, hook: &str) {
        self.observe_dropped.get_or_create(&hook_labels(hook)).inc();
    }

    /// Call with `open: false` for every configured hook at start-up, so the
    /// series exist (at 0) before the first trip.
    pub fn breaker_state(&self, hook: &str, open: bool) {
        self.breaker_open
            .get_or_create(&hook_labels(hook))
            .set(i64::from(open));
    }

    /// Whether a configured event is missing from the hook's Describe.
    pub fn hook_unsubscribed(&self, hook: &str, event: &str, missing: bool) {
        self.hook_unsubscribed
            .get_or_create(&HookEventLabels {
                hook: hook.to_owned(),
                event: event.to_owned(),
            })
            .set(i64::from(missing));
    }

    pub fn run_finished(&self, agent: &str, outcome: &str, duration: Duration) {
        let labels = RunLabels {
            agent: agent.to_owned(),
            outcome: outcome.to_owned(),
        };
        self.runs.get_or_create(&labels).inc();
        self.run_duration
            .get_or_create(&labels)
            .observe(duration.as_secs_f64());
    }

    /// A run whose driver panicked (it also counts in `runs` as failed).
    pub fn run_panicked(&self, agent: &str) {
        self.run_panics
            .get_or_create(&AgentLabels {
                agent: agent.to_owned(),
            })
            .inc();
    }

    /// One provider call. Token counts are `None` when the call failed;
    /// `estimated` when hookwire estimated them.
    pub fn model_call(
        &self,
        model: &str,
        provider: &str,
        latency: Duration,
        input_tokens: Option<u64>,
        output_tokens: Option<u64>,
        estimated: bool,
    ) {
        let labels = ModelLabels {
            model: model.to_owned(),
            provider: provider.to_owned(),
        };
        self.model_call_duration
            .get_or_create(&labels)
            .observe(latency.as_secs_f64());
        for (token_type, count) in [("input", input_tokens), ("output", output_tokens)] {
            if let Some(count) = count {
                let labels = TokenLabels {
                    model: labels.model.clone(),
                    provider: labels.provider.clone(),
                    token_type,
                    estimated: if estimated { "true" } else { "false" },
                };
                self.model_tokens.get_or_create(&labels).inc_by(count);
            }
        }
    }

    pub fn active_runs_inc(&self) {
        self.active_runs.inc();
    }

    pub fn active_runs_dec(&self) {
        self.active_runs.dec();
    }

    pub fn active_hook_streams_inc(&self) {
        self.active_hook_streams.inc();
    }

    pub fn active_hook_streams_dec(&self) {
        self.active_hook_streams.dec();
    }

    /// Counts a run as active until the guard drops: unlike inc/dec pairs,
    /// early returns, cancellation and panics cannot leak the count.
    pub fn active_run(&self) -> ActiveGuard {
        ActiveGuard::new(&self.active_runs)
    }

    /// As [`Metrics::active_run`], for an open hook stream.
    pub fn active_hook_stream(&self) -> ActiveGuard {
        ActiveGuard::new(&self.active_hook_streams)
    }

    /// As [`Metrics::active_run`], for an answer waiting for its question.
    pub fn early_answer(&self) -> ActiveGuard {
        ActiveGuard::new(&self.early_answers)
    }
}

fn hook_labels(hook: &str) -> HookLabels {
    HookLabels {
        hook: hook.to_owned(),
    }
}

/// Decrements its gauge when dropped.
#[derive(Debug)]
#[must_use = "the gauge is decremented when the guard drops"]
pub struct ActiveGuard(Gauge);

impl ActiveGuard {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        ActiveGuard(gauge.clone())
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(prefix))
    }

    #[test]
    fn series_move() {
        let m = Metrics::new();
        m.hook_call("redact", "tool_result", "ok", Duration::from_millis(3));
        m.hook_call("redact", "tool_result", "ok", Duration::from_millis(20));
        m.hook_failure("redact", "tool_result", "deadline");
        m.hook_fail_open("redact", "tool_result");
        m.hook_late_verdict("redact");
        m.observe_dropped("audit");
        m.breaker_state("redact", true);
        m.hook_unsubscribed("redact", "tool_call", true);
        m.run_finished("support", "completed", Duration::from_secs(2));
        m.run_panicked("support");
        m.model_call(
            "gpt",
            "openai",
            Duration::from_millis(800),
            Some(12),
            Some(5),
            false,
        );
        m.model_call(
            "gpt",
            "openai",
            Duration::from_millis(800),
            Some(3),
            None,
            false,
        );
        m.model_call(
            "local",
            "openai",
            Duration::from_millis(80),
            Some(7),
            Some(2),
            true,
        );
        let text = m.encode();
        for expected in [
            r#"hookwire_hook_call_duration_seconds_count{hook="redact",event="tool_result",outcome="ok"} 2"#,
            r#"hookwire_hook_call_duration_seconds_bucket{le="0.005",hook="redact",event="tool_result",outcome="ok"} 1"#,
            r#"hookwire_hook_failures_total{hook="redact",event="tool_result",class="deadline"} 1"#,
            r#"hookwire_hook_fail_open_total{hook="redact",event="tool_result"} 1"#,
            r#"hookwire_hook_late_verdicts_total{hook="redact"} 1"#,
            r#"hookwire_observe_dropped_total{hook="audit"} 1"#,
            r#"hookwire_hook_breaker_open{hook="redact"} 1"#,
            r#"hookwire_hook_unsubscribed{hook="redact",event="tool_call"} 1"#,
            r#"hookwire_runs_total{agent="support",outcome="completed"} 1"#,
            r#"hookwire_run_duration_seconds_count{agent="support",outcome="completed"} 1"#,
            r#"hookwire_run_panics_total{agent="support"} 1"#,
            r#"hookwire_model_call_duration_seconds_count{model="gpt",provider="openai"} 2"#,
            r#"hookwire_model_tokens_total{model="gpt",provider="openai",token_type="input",estimated="false"} 15"#,
            r#"hookwire_model_tokens_total{model="gpt",provider="openai",token_type="output",estimated="false"} 5"#,
            r#"hookwire_model_tokens_total{model="local",provider="openai",token_type="output",estimated="true"} 2"#,
        ] {
            assert!(text.contains(expected), "missing {expected} in\n{text}");
        }
        m.breaker_state("redact", false);
        assert!(m
            .encode()
            .contains(r#"hookwire_hook_breaker_open{hook="redact"} 0"#));
    }

    #[test]
    fn active_gauges_follow_guards_and_inc_dec() {
        let m = Metrics::new();
        let gauge = |m: &Metrics, name: &str| {
            line(&m.encode(), &format!("{name} "))
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_owned)
        };
        let run = m.active_run();
        let stream = m.active_hook_stream();
        m.active_runs_inc();
        assert_eq!(gauge(&m, "hookwire_active_runs").as_deref(), Some("2"));
        assert_eq!(
            gauge(&m, "hookwire_active_hook_streams").as_deref(),
            Some("1")
        );
        drop(run);
        drop(stream);
        m.active_runs_dec();
        assert_eq!(gauge(&m, "hookwire_active_runs").as_deref(), Some("0"));
        assert_eq!(
            gauge(&m, "hookwire_active_hook_streams").as_deref(),
            Some("0")
        );
        m.active_hook_streams_inc();
        m.active_hook_streams_dec();
        assert_eq!(
            gauge(&m, "hookwire_active_hook_streams").as_deref(),
            Some("0")
        );
    }
}
