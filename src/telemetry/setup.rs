//! Installing the tracing pipeline: a log layer (text or JSON on stdout) and,
//! when an OTLP endpoint is configured, an OpenTelemetry layer exporting over
//! gRPC with the batch span processor.
//!
//! Each layer has its own filter. A global `EnvFilter` would make `RUST_LOG`
//! decide what is exported too, and with `RUST_LOG=warn` every info span (all
//! of ours) would silently vanish from Jaeger. So `RUST_LOG` only filters the
//! log layer, and the export layer always takes hookwire's spans at info and
//! above (and nothing from other crates: the exporter's own tonic/h2 events
//! must not feed back into the exporter).
//!
//! Settings are resolved once, into [`TelemetryOptions`], from the config file
//! and the standard `OTEL_*` variables (environment wins over the file, as
//! operators expect from a ConfigMap plus a Deployment's `env:`). Resolution
//! takes the environment as a function so it is testable without mutating the
//! process environment.

use std::io::IsTerminal;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::resource::{Resource, TelemetryResourceDetector};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::fmt::writer::BoxMakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::{SubscriberInitExt, TryInitError};
use tracing_subscriber::{Layer, Registry};

use crate::config::TelemetryConfig;
use crate::telemetry::hook_span::HookTracer;
use crate::telemetry::otlp_export::{self, ExportSettings, OtlpExporter};

/// Environment variables read by [`TelemetryOptions::from_env`].
pub mod env {
    pub const RUST_LOG: &str = "RUST_LOG";
    pub const OTEL_SDK_DISABLED: &str = "OTEL_SDK_DISABLED";
    pub const OTEL_TRACES_EXPORTER: &str = "OTEL_TRACES_EXPORTER";
    pub const OTEL_EXPORTER_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
    pub const OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
    pub const OTEL_SERVICE_NAME: &str = "OTEL_SERVICE_NAME";
    pub const OTEL_RESOURCE_ATTRIBUTES: &str = "OTEL_RESOURCE_ATTRIBUTES";
    pub const OTEL_TRACES_SAMPLER: &str = "OTEL_TRACES_SAMPLER";
    pub const OTEL_TRACES_SAMPLER_ARG: &str = "OTEL_TRACES_SAMPLER_ARG";
    pub const OTEL_EXPORTER_OTLP_HEADERS: &str = "OTEL_EXPORTER_OTLP_HEADERS";
    pub const OTEL_EXPORTER_OTLP_TRACES_HEADERS: &str = "OTEL_EXPORTER_OTLP_TRACES_HEADERS";
    pub const OTEL_EXPORTER_OTLP_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TIMEOUT";
    pub const OTEL_EXPORTER_OTLP_TRACES_TIMEOUT: &str = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT";
    pub const OTEL_EXPORTER_OTLP_COMPRESSION: &str = "OTEL_EXPORTER_OTLP_COMPRESSION";
    pub const OTEL_EXPORTER_OTLP_TRACES_COMPRESSION: &str = "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION";
}

/// The crate whose spans are exported (module paths of both the library and
/// the binary start with it).
const EXPORTED_TARGET: &str = "hookwire";
const DEFAULT_SERVICE_NAME: &str = "hookwire";
const DEFAULT_LOG_FILTER: &str = "info";

/// Log line format (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// The trace sampler, as named by `OTEL_TRACES_SAMPLER`.
#[derive(Clone, Debug, PartialEq)]
pub enum Sampling {
    AlwaysOn,
    AlwaysOff,
    TraceIdRatio(f64),
    ParentBasedAlwaysOn,
    ParentBasedAlwaysOff,
    ParentBasedRatio(f64),
}

impl Sampling {
    fn to_sampler(&self) -> Sampler {
        let parent_based = |root: Sampler| Sampler::ParentBased(Box::new(root));
        match *self {
            Sampling::AlwaysOn => Sampler::AlwaysOn,
            Sampling::AlwaysOff => Sampler::AlwaysOff,
            Sampling::TraceIdRatio(r) => Sampler::TraceIdRatioBased(r),
            Sampling::ParentBasedAlwaysOn => parent_based(Sampler::AlwaysOn),
            Sampling::ParentBasedAlwaysOff => parent_based(Sampler::AlwaysOff),
            Sampling::ParentBasedRatio(r) => parent_based(Sampler::TraceIdRatioBased(r)),
        }
    }
}

/// Fully resolved telemetry settings. Build one with [`TelemetryOptions::new`]
/// (defaults, no environment) or [`TelemetryOptions::from_env`].
#[derive(Clone, Debug, PartialEq)]
pub struct TelemetryOptions {
    pub format: LogFormat,
    /// Colour in text logs (only when stdout is a terminal).
    pub ansi: bool,
    /// `RUST_LOG` directives. They filter the log layer only.
    pub log_filter: String,
    /// OTLP gRPC endpoint (`http://host:4317`); `None` turns export off.
    pub otlp_endpoint: Option<String>,
    /// gRPC metadata on every export (`OTEL_EXPORTER_OTLP_HEADERS`).
    pub otlp_headers: Vec<(String, String)>,
    /// One export's bound, retries included (`OTEL_EXPORTER_OTLP_TIMEOUT`).
    pub otlp_timeout: Duration,
    pub service_name: String,
    /// Extra resource attributes (`OTEL_RESOURCE_ATTRIBUTES`).
    pub resource_attributes: Vec<(String, String)>,
    pub sampling: Sampling,
    /// Batch processor schedule delay; `None` keeps the SDK default (5 s, or
    /// `OTEL_BSP_SCHEDULE_DELAY`). Tests shorten it to see spans without a
    /// flush.
    pub batch_delay: Option<Duration>,
    /// Problems found while resolving (bad sampler names, bad ratios, ...).
    /// They are logged once the subscriber is up, since nothing can be logged
    /// before.
    pub warnings: Vec<String>,
}

impl TelemetryOptions {
    /// Defaults: `info` logs, no export, service `hookwire`, parent-based
    /// always-on sampling. Reads no environment.
    pub fn new(format: LogFormat) -> Self {
        TelemetryOptions {
            format,
            ansi: false,
            log_filter: DEFAULT_LOG_FILTER.to_owned(),
            otlp_endpoint: None,
            otlp_headers: Vec::new(),
            otlp_timeout: otlp_export::DEFAULT_TIMEOUT,
            service_name: DEFAULT_SERVICE_NAME.to_owned(),
            resource_attributes: Vec::new(),
            sampling: Sampling::ParentBasedAlwaysOn,
            batch_delay: None,
            warnings: Vec::new(),
        }
    }

    /// Resolves from the config file and the process environment.
    pub fn from_env(cfg: &TelemetryConfig, format: LogFormat) -> Self {
        Self::resolve(cfg, format, |key| std::env::var(key).ok())
    }

    /// Resolves from the config file and `env` (a lookup standing in for the
    /// process environment). Empty variables count as unset.
    ///
    /// Precedence: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, then
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`, then `telemetry.otlp_endpoint`; export
    /// is off when none is set, or when `OTEL_SDK_DISABLED=true` or
    /// `OTEL_TRACES_EXPORTER=none`. Service name: `OTEL_SERVICE_NAME`, then
    /// `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, then
    /// `telemetry.service_name`, then `hookwire`. Sampler:
    /// `OTEL_TRACES_SAMPLER`(`_ARG`), then `telemetry.sampling_ratio` as a
    /// parent-based ratio, then parent-based always-on.
    pub fn resolve(
        cfg: &TelemetryConfig,
        format: LogFormat,
        env: impl Fn(&str) -> Option<String>,
    ) -> Self {
        let var = |key: &str| {
            env(key)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let mut opts = TelemetryOptions::new(format);

        if let Some(filter) = var(env::RUST_LOG) {
            opts.log_filter = filter;
        }

        let sdk_disabled =
            var(env::OTEL_SDK_DISABLED).is_some_and(|v| v.eq_ignore_ascii_case("true"));
        let exporter = var(env::OTEL_TRACES_EXPORTER).map(|v| v.to_ascii_lowercase());
        let exporter_off = match exporter.as_deref() {
            None | Some("otlp") => false,
            Some("none") => true,
            Some(other) => {
                opts.warnings.push(format!(
                    "{}={other} is not supported (only otlp or none); using otlp",
                    env::OTEL_TRACES_EXPORTER
                ));
                false
            }
        };
        if !(sdk_disabled || exporter_off) {
            opts.otlp_endpoint = var(env::OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
                .or_else(|| var(env::OTEL_EXPORTER_OTLP_ENDPOINT))
                .or_else(|| non_empty(cfg.otlp_endpoint.as_deref()))
                .map(|e| normalize_endpoint(&e));
        }
        // The signal's own variable wins over the general one.
        let first_set =
            |names: [&'static str; 2]| names.into_iter().find_map(|k| var(k).map(|v| (k, v)));
        let headers_var = first_set([
            env::OTEL_EXPORTER_OTLP_TRACES_HEADERS,
            env::OTEL_EXPORTER_OTLP_HEADERS,
        ]);
        if let Some((name, raw)) = headers_var {
            match parse_key_values(&raw) {
                Ok(headers) => opts.otlp_headers = headers,
                // Not the entry itself: it may hold a credential.
                Err(_) => opts.warnings.push(format!(
                    "{name} ignored: an entry is not key=value (key=value,... with values percent-encoded)"
                )),
            }
        }
        let timeout_var = first_set([
            env::OTEL_EXPORTER_OTLP_TRACES_TIMEOUT,
            env::OTEL_EXPORTER_OTLP_TIMEOUT,
        ]);
        if let Some((name, raw)) = timeout_var {
            match raw.parse::<u64>() {
                Ok(ms) if ms > 0 => opts.otlp_timeout = Duration::from_millis(ms),
                _ => opts.warnings.push(format!(
                    "{name}={raw} is not a number of milliseconds above 0; using {} ms",
                    otlp_export::DEFAULT_TIMEOUT.as_millis()
                )),
            }
        }
        for name in [
            env::OTEL_EXPORTER_OTLP_TRACES_COMPRESSION,
            env::OTEL_EXPORTER_OTLP_COMPRESSION,
        ] {
            if let Some(v) = var(name).filter(|v| !v.eq_ignore_ascii_case("none")) {
                opts.warnings.push(format!(
                    "{name}={v} is not supported; spans are exported uncompressed"
                ));
            }
        }

        if let Some(raw) = var(env::OTEL_RESOURCE_ATTRIBUTES) {
            match parse_key_values(&raw) {
                Ok(attrs) => opts.resource_attributes = attrs,
                Err(bad) => opts.warnings.push(format!(
                    "{} ignored: entry `{bad}` is not key=value",
                    env::OTEL_RESOURCE_ATTRIBUTES
                )),
            }
        }
        let from_resource = opts
            .resource_attributes
            .iter()
            .find(|(k, _)| k == "service.name")
            .map(|(_, v)| v.clone());
        opts.service_name = var(env::OTEL_SERVICE_NAME)
            .or(from_resource)
            .or_else(|| non_empty(cfg.service_name.as_deref()))
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_owned());

        let configured = match cfg.sampling_ratio {
            None => Sampling::ParentBasedAlwaysOn,
            Some(r) => Sampling::ParentBasedRatio(checked_ratio(
                Some(r.to_string()),
                "telemetry.sampling_ratio",
                &mut opts.warnings,
            )),
        };
        opts.sampling = match var(env::OTEL_TRACES_SAMPLER) {
            None => configured,
            Some(name) => {
                let arg = var(env::OTEL_TRACES_SAMPLER_ARG);
                let warnings = &mut opts.warnings;
                let mut ratio =
                    || checked_ratio(arg.clone(), env::OTEL_TRACES_SAMPLER_ARG, warnings);
                match name.to_ascii_lowercase().as_str() {
                    "always_on" => Sampling::AlwaysOn,
                    "always_off" => Sampling::AlwaysOff,
                    "traceidratio" => Sampling::TraceIdRatio(ratio()),
                    "parentbased_always_on" => Sampling::ParentBasedAlwaysOn,
                    "parentbased_always_off" => Sampling::ParentBasedAlwaysOff,
                    "parentbased_traceidratio" => Sampling::ParentBasedRatio(ratio()),
                    other => {
                        opts.warnings.push(format!(
                            "{}={other} is not supported; using the configured sampler",
                            env::OTEL_TRACES_SAMPLER
                        ));
                        configured
                    }
                }
            }
        };
        opts
    }
}

fn non_empty(s: Option<&str>) -> Option<String> {
    s.map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// `jaeger:4317` means `http://jaeger:4317`: tonic needs a scheme, and a
/// bare host:port is what people type.
fn normalize_endpoint(endpoint: &str) -> String {
    if endpoint.contains("://") {
        endpoint.to_owned()
    } else {
        format!("http://{endpoint}")
    }
}

/// A sampling ratio in 0..=1; anything else (missing, unparsable, out of
/// range) becomes 1.0 with a warning, as the OTel spec asks for the env var.
fn checked_ratio(raw: Option<String>, source: &str, warnings: &mut Vec<String>) -> f64 {
    match raw.as_deref().map(str::parse::<f64>) {
        Some(Ok(r)) if (0.0..=1.0).contains(&r) => r,
        _ => {
            warnings.push(format!(
                "{source}={} is not a ratio in 0..=1; sampling everything",
                raw.as_deref().unwrap_or("<unset>")
            ));
            1.0
        }
    }
}

/// Parses `key1=value1,key2=value2` (values percent-encoded, per the OTel
/// spec), as `OTEL_RESOURCE_ATTRIBUTES` and `OTEL_EXPORTER_OTLP_HEADERS`
/// both write it. On a malformed entry the whole value is discarded, as the spec
/// says; the entry is returned for the warning.
fn parse_key_values(raw: &str) -> Result<Vec<(String, String)>, String> {
    raw.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| match entry.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                Ok((percent_decode(k.trim()), percent_decode(v.trim())))
            }
            _ => Err(entry.to_owned()),
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot build the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        #[source]
        source: crate::telemetry::otlp_export::ExportSetupError,
    },
    #[error("OTLP export needs a Tokio runtime: set telemetry up from inside one")]
    NoRuntime,
    #[error("a global tracing subscriber is already installed")]
    AlreadyInstalled(#[source] TryInitError),
    #[error("flushing spans failed: {0}")]
    Flush(String),
}

/// The telemetry guard. Keep it for the life of the process and call
/// [`Telemetry::shutdown`] on the way out, or spans still in the batch queue
/// are lost.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported (an endpoint was configured).
    pub fn is_exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports every ended span now. The batch processor blocks its caller
    /// until the export is done, and the export itself needs the Tokio
    /// runtime (tonic), so it runs on a blocking thread: calling it on a
    /// runtime worker would deadlock a current-thread runtime and stall a
    /// multi-thread one.
    pub async fn flush(&self) -> Result<(), TelemetryError> {
        let Some(provider) = self.provider.clone() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || provider.force_flush())
            .await
            .map_err(|e| TelemetryError::Flush(e.to_string()))?
            .map_err(|e| TelemetryError::Flush(e.to_string()))
    }

    /// Flushes and shuts the exporter down (on a blocking thread, see
    /// [`Telemetry::flush`]). Failures are logged, not returned: at shutdown
    /// there is nothing better to do with them.
    pub async fn shutdown(mut self) {
        let Some(provider) = self.provider.take() else {
            return;
        };
        match tokio::task::spawn_blocking(move || provider.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "telemetry shutdown: spans may be lost"),
            Err(e) => tracing::warn!(error = %e, "telemetry shutdown task failed"),
        }
    }
}

impl Drop for Telemetry {
    /// Forgotten `shutdown()`: the SDK would shut down (blocking) wherever
    /// the last provider handle drops, possibly on a runtime thread. Do it on
    /// a plain thread instead; best effort, the process may exit first.
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = std::thread::Builder::new()
                .name("otel-shutdown".into())
                .spawn(move || {
                    let _ = provider.shutdown();
                });
        }
    }
}

/// Installs the global subscriber (logs to stdout, where container runtimes
/// and log shippers expect a service's lines; export when configured),
/// the panic hook that logs through it ([`super::panic_log`]), the W3C
/// TraceContext propagator and the global tracer provider. Call once,
/// from inside the Tokio runtime.
pub fn init(cfg: &TelemetryConfig, format: LogFormat) -> Result<Telemetry, TelemetryError> {
    let mut opts = TelemetryOptions::from_env(cfg, format);
    opts.ansi = format == LogFormat::Text && std::io::stdout().is_terminal();
    let (subscriber, telemetry) = assemble(&opts, BoxMakeWriter::new(std::io::stdout))?;
    // try_init also routes `log` records into tracing.
    subscriber
        .try_init()
        .map_err(TelemetryError::AlreadyInstalled)?;
    super::panic_log::install();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    if let Some(provider) = &telemetry.provider {
        opentelemetry::global::set_tracer_provider(provider.clone());
    }
    for warning in &opts.warnings {
        tracing::warn!(%warning, "telemetry configuration");
    }
    match &opts.otlp_endpoint {
        Some(endpoint) => tracing::info!(
            endpoint = %crate::config::redact_url(endpoint),
            service_name = %opts.service_name,
            sampling = ?opts.sampling,
            "exporting traces over OTLP/gRPC"
        ),
        None => tracing::info!("trace export off (no OTLP endpoint configured)"),
    }
    Ok(telemetry)
}

/// Builds the same pipeline as [`init`] without installing anything global:
/// logs go to `writer`, and the returned `Dispatch` is used with
/// `tracing::dispatcher::with_default` or `WithSubscriber::with_subscriber`.
/// Several can coexist in one process (tests). Needs a Tokio runtime when
/// `opts.otlp_endpoint` is set.
pub fn build(
    opts: &TelemetryOptions,
    writer: BoxMakeWriter,
) -> Result<(tracing::Dispatch, Telemetry), TelemetryError> {
    let (subscriber, telemetry) = assemble(opts, writer)?;
    Ok((tracing::Dispatch::new(subscriber), telemetry))
}

type BoxedLayer = Box<dyn Layer<Registry> + Send + Sync>;

fn assemble(
    opts: &TelemetryOptions,
    writer: BoxMakeWriter,
) -> Result<(impl tracing::Subscriber + Send + Sync, Telemetry), TelemetryError> {
    let provider = match &opts.otlp_endpoint {
        Some(endpoint) => Some(tracer_provider(opts, endpoint)?),
        None => None,
    };

    // Invalid directives are skipped (and reported on stderr by
    // tracing-subscriber) rather than refusing to start over a RUST_LOG typo.
    let log_filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .parse_lossy(&opts.log_filter);
    let log_layer: BoxedLayer = match opts.format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(opts.ansi)
            .with_filter(log_filter)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(writer)
            .with_filter(log_filter)
            .boxed(),
    };
    let mut layers = vec![log_layer];

    if let Some(provider) = &provider {
        let export_filter = Targets::new().with_target(EXPORTED_TARGET, LevelFilter::INFO);
        layers.push(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer_with_scope(scope()))
                // Every span comes from telemetry::spans, so source
                // locations and targets would only repeat that.
                .with_location(false)
                .with_target(false)
                .with_threads(false)
                // busy_ns / idle_ns on every span: poll-time bookkeeping of
                // the tracing span, which backends show as two meaningless
                // attributes next to the span's real duration.
                .with_tracked_inactivity(false)
                // Entering a span would otherwise also attach its OTel
                // context to a thread-local stack (and pop it on exit), at
                // every poll of every instrumented future: most of the
                // enter/exit cost of a hook event. Nothing here reads
                // `opentelemetry::Context::current()`: parents come from the
                // tracing span tree, and trace context is taken from spans
                // explicitly (`propagation`).
                .with_context_activation(false)
                .with_filter(export_filter)
                .boxed(),
        );
        // The per-hook-call span is built on the tracer directly (see
        // `hook_span`); it finds the tracer here. Before `ReleaseOffThread`,
        // so dropped before it, for the reason given there.
        layers.push(
            HookTracer(provider.tracer_with_scope(scope()))
                .with_filter(LevelFilter::OFF)
                .boxed(),
        );
        // Last in the list, so dropped after the export layer: see
        // `ReleaseOffThread`. Filtered to nothing, it sees no span or event
        // and leaves interest and the max level to the layers above.
        layers.push(
            ReleaseOffThread(Some(provider.clone()))
                .with_filter(LevelFilter::OFF)
                .boxed(),
        );
    }

    Ok((Registry::default().with(layers), Telemetry { provider }))
}

/// Every span's instrumentation scope.
fn scope() -> InstrumentationScope {
    InstrumentationScope::builder("hookwire")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

/// The subscriber's last handle on the tracer provider, released on a thread
/// of its own when the subscriber is dropped.
///
/// tracing-core can drop a subscriber while it holds its global dispatcher
/// lock: `Dispatch::new` on another thread briefly upgrades every registered
/// subscriber and may end up holding the last reference. If the provider's
/// last handle went with it, the provider's `Drop` would run under that lock:
/// a shutdown that can block on export, and SDK log events whose first use
/// registers a callsite, which takes the same lock (a deadlock, seen as a
/// hanging unit test). The export layer's own handle is dropped before this
/// one, so this one is the last the subscriber holds.
struct ReleaseOffThread(Option<SdkTracerProvider>);

impl<S: tracing::Subscriber> Layer<S> for ReleaseOffThread {}

impl Drop for ReleaseOffThread {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take() {
            // If no thread can be spawned, the handle is dropped here: the
            // hazard above, but nothing better is left to do.
            let _ = std::thread::Builder::new()
                .name("otel-release".into())
                .spawn(move || drop(provider));
        }
    }
}

fn tracer_provider(
    opts: &TelemetryOptions,
    endpoint: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    // tonic's lazy channel spawns its connection task on the current runtime.
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(TelemetryError::NoRuntime);
    }
    let exporter = OtlpExporter::new(&ExportSettings {
        endpoint: endpoint.to_owned(),
        timeout: opts.otlp_timeout,
        headers: opts.otlp_headers.clone(),
    })
    .map_err(|source| TelemetryError::Exporter {
        endpoint: crate::config::redact_url(endpoint),
        source,
    })?;
    let mut batch = BatchConfigBuilder::default();
    if let Some(delay) = opts.batch_delay {
        batch = batch.with_scheduled_delay(delay);
    }
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch.build())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(opts.sampling.to_sampler())
        .with_resource(resource(opts))
        .build())
}

fn resource(opts: &TelemetryOptions) -> Resource {
    // builder_empty: the default builder reads OTEL_SERVICE_NAME and
    // OTEL_RESOURCE_ATTRIBUTES itself, behind our precedence rules' back.
    Resource::builder_empty()
        .with_detector(Box::new(TelemetryResourceDetector))
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attributes(
            opts.resource_attributes
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .with_service_name(opts.service_name.clone())
        .build()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn resolve(cfg: &TelemetryConfig, vars: &[(&str, &str)]) -> TelemetryOptions {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TelemetryOptions::resolve(cfg, LogFormat::Text, |k| vars.get(k).cloned())
    }

    #[test]
    fn defaults_export_nothing() {
        let o = resolve(&TelemetryConfig::default(), &[]);
        assert_eq!(o, TelemetryOptions::new(LogFormat::Text));
        assert_eq!(o.otlp_endpoint, None);
        assert_eq!(o.service_name, "hookwire");
        assert_eq!(o.log_filter, "info");
    }

    #[test]
    fn env_endpoint_overrides_config_and_signal_specific_wins() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("http://from-config:4317".into()),
            ..Default::default()
        };
        assert_eq!(
            resolve(&cfg, &[]).otlp_endpoint.as_deref(),
            Some("http://from-config:4317")
        );
        let o = resolve(&cfg, &[(env::OTEL_EXPORTER_OTLP_ENDPOINT, "jaeger:4317")]);
        assert_eq!(o.otlp_endpoint.as_deref(), Some("http://jaeger:4317"));
        let o = resolve(
            &cfg,
            &[
                (env::OTEL_EXPORTER_OTLP_ENDPOINT, "http://generic:4317"),
                (
                    env::OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
                    "http://traces:4317",
                ),
            ],
        );
        assert_eq!(o.otlp_endpoint.as_deref(), Some("http://traces:4317"));
        // Empty means unset.
        let o = resolve(&cfg, &[(env::OTEL_EXPORTER_OTLP_ENDPOINT, " ")]);
        assert_eq!(o.otlp_endpoint.as_deref(), Some("http://from-config:4317"));
    }

    #[test]
    fn export_can_be_switched_off_by_env() {
        let cfg = TelemetryConfig {
            otlp_endpoint: Some("http://c:4317".into()),
            ..Default::default()
        };
        assert_eq!(
            resolve(&cfg, &[(env::OTEL_SDK_DISABLED, "TRUE")]).otlp_endpoint,
            None
        );
        assert_eq!(
            resolve(&cfg, &[(env::OTEL_TRACES_EXPORTER, "none")]).otlp_endpoint,
            None
        );
        let o = resolve(&cfg, &[(env::OTEL_TRACES_EXPORTER, "zipkin")]);
        assert!(o.otlp_endpoint.is_some());
        assert_eq!(o.warnings.len(), 1);
    }

    #[test]
    fn service_name_precedence() {
        let cfg = TelemetryConfig {
            service_name: Some("cfg-name".into()),
            ..Default::default()
        };
        assert_eq!(resolve(&cfg, &[]).service_name, "cfg-name");
        let res = (
            env::OTEL_RESOURCE_ATTRIBUTES,
            "service.name=res-name,team=ai%20ops",
        );
        let o = resolve(&cfg, &[res]);
        assert_eq!(o.service_name, "res-name");
        assert!(o
            .resource_attributes
            .contains(&("team".into(), "ai ops".into())));
        assert_eq!(
            resolve(&cfg, &[res, (env::OTEL_SERVICE_NAME, "env-name")]).service_name,
            "env-name"
        );
    }

    #[test]
    fn malformed_resource_attributes_are_discarded_whole() {
        let o = resolve(
            &TelemetryConfig::default(),
            &[(env::OTEL_RESOURCE_ATTRIBUTES, "a=1,oops,b=2")],
        );
        assert!(o.resource_attributes.is_empty());
        assert_eq!(o.warnings.len(), 1);
        assert!(o.warnings[0].contains("oops"));
    }

    #[test]
    fn sampler_from_env_then_config() {
        let cfg = TelemetryConfig {
            sampling_ratio: Some(0.25),
            ..Default::default()
        };
        assert_eq!(
            resolve(&cfg, &[]).sampling,
            Sampling::ParentBasedRatio(0.25)
        );
        let o = resolve(
            &cfg,
            &[
                (env::OTEL_TRACES_SAMPLER, "traceidratio"),
                (env::OTEL_TRACES_SAMPLER_ARG, "0.5"),
            ],
        );
        assert_eq!(o.sampling, Sampling::TraceIdRatio(0.5));
        let o = resolve(&cfg, &[(env::OTEL_TRACES_SAMPLER, "always_off")]);
        assert_eq!(o.sampling, Sampling::AlwaysOff);
        // A missing or bad argument samples everything, with a warning.
        let o = resolve(
            &cfg,
            &[(env::OTEL_TRACES_SAMPLER, "parentbased_traceidratio")],
        );
        assert_eq!(o.sampling, Sampling::ParentBasedRatio(1.0));
        assert_eq!(o.warnings.len(), 1);
        // An unknown sampler keeps the configured one.
        let o = resolve(&cfg, &[(env::OTEL_TRACES_SAMPLER, "xray")]);
        assert_eq!(o.sampling, Sampling::ParentBasedRatio(0.25));
        assert_eq!(o.warnings.len(), 1);
    }

    #[test]
    fn rust_log_goes_to_the_log_filter() {
        let o = resolve(
            &TelemetryConfig::default(),
            &[(env::RUST_LOG, "warn,hookwire=debug")],
        );
        assert_eq!(o.log_filter, "warn,hookwire=debug");
    }

    #[test]
    fn export_headers_and_timeout_come_from_the_signal_variable_first() {
        let o = resolve(
            &TelemetryConfig::default(),
            &[
                (env::OTEL_EXPORTER_OTLP_HEADERS, "x-general=1"),
                (
                    env::OTEL_EXPORTER_OTLP_TRACES_HEADERS,
                    "Authorization=Bearer%20t,x-tenant=a",
                ),
                (env::OTEL_EXPORTER_OTLP_TIMEOUT, "3000"),
                (env::OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, "2500"),
            ],
        );
        assert_eq!(
            o.otlp_headers,
            vec![
                ("Authorization".to_owned(), "Bearer t".to_owned()),
                ("x-tenant".to_owned(), "a".to_owned())
            ]
        );
        assert_eq!(o.otlp_timeout, Duration::from_millis(2500));
        assert!(o.warnings.is_empty(), "{:?}", o.warnings);
        let o = resolve(
            &TelemetryConfig::default(),
            &[(env::OTEL_EXPORTER_OTLP_HEADERS, "x-general=1")],
        );
        assert_eq!(
            o.otlp_headers,
            vec![("x-general".to_owned(), "1".to_owned())]
        );
        assert_eq!(o.otlp_timeout, otlp_export::DEFAULT_TIMEOUT);
    }

    #[test]
    fn bad_export_headers_timeout_or_compression_warn_and_keep_the_defaults() {
        let o = resolve(
            &TelemetryConfig::default(),
            &[
                (env::OTEL_EXPORTER_OTLP_HEADERS, "novalue"),
                (env::OTEL_EXPORTER_OTLP_TIMEOUT, "10s"),
                (env::OTEL_EXPORTER_OTLP_COMPRESSION, "gzip"),
            ],
        );
        assert!(o.otlp_headers.is_empty());
        assert_eq!(o.otlp_timeout, otlp_export::DEFAULT_TIMEOUT);
        let w = o.warnings.join("\n");
        assert!(
            w.contains("OTEL_EXPORTER_OTLP_HEADERS ignored: an entry is not key=value"),
            "{w}"
        );
        assert!(
            !w.contains("novalue"),
            "a header entry may be a credential: {w}"
        );
        assert!(w.contains("OTEL_EXPORTER_OTLP_TIMEOUT=10s"), "{w}");
        assert!(
            w.contains("OTEL_EXPORTER_OTLP_COMPRESSION=gzip is not supported"),
            "{w}"
        );
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%20b%2Cc"), "a b,c");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[tokio::test]
    async fn https_endpoints_get_tls_with_the_webpki_roots() {
        // tonic keeps the root choice private; its Debug shows the flag,
        // which also disappears if the `tls-webpki-roots` feature is lost.
        let tls =
            otlp_export::collector_tls("https://collector.example:4317").expect("TLS for https");
        assert!(
            format!("{tls:?}").contains("with_webpki_roots: true"),
            "{tls:?}"
        );
        assert!(otlp_export::collector_tls("http://collector.example:4317").is_none());
        let mut o = TelemetryOptions::new(LogFormat::Text);
        o.otlp_endpoint = Some("https://collector.invalid:4317".into());
        let (_dispatch, telemetry) = build(&o, BoxMakeWriter::new(std::io::sink)).unwrap();
        assert!(telemetry.is_exporting());
        // Nothing was exported and the channel is lazy: shutdown is quick.
        telemetry.shutdown().await;
    }

    #[test]
    fn export_outside_a_runtime_is_an_error_not_a_panic() {
        let mut o = TelemetryOptions::new(LogFormat::Text);
        o.otlp_endpoint = Some("http://127.0.0.1:1".into());
        let err = build(&o, BoxMakeWriter::new(std::io::sink)).unwrap_err();
        assert!(matches!(err, TelemetryError::NoRuntime), "{err}");
    }
}
