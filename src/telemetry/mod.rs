//! Telemetry: logs, OpenTelemetry traces (GenAI conventions, OTLP/gRPC
//! export), W3C trace context for hook servers, and Prometheus metrics on the
//! admin port.
//!
//! The engine uses it like this:
//! - start-up: [`init`] once (keep the [`Telemetry`] guard), [`Metrics::new`],
//!   [`admin::serve_admin`];
//! - per run / model call / tool call: a constructor from [`spans`], then
//!   its `record_*` helpers once each; per blocking hook call, a
//!   [`HookSpan`] (built on the tracer directly, see [`hook_span`]);
//! - content (prompts, answers, tool arguments and results): only through
//!   the run's [`ContentView`] (GenAI message shapes, sticky redactions),
//!   which records through [`ContentCapture::record`], once per key per
//!   span, after the event's hooks ran;
//! - to a hook server: [`HookSpan::trace_context`] (blocking calls) or
//!   [`propagation::current_trace_context`] (observe events) into the event
//!   context and [`propagation::inject_metadata`] on the `Process` call;
//! - shutdown: [`Telemetry::shutdown`]`.await`.
//!
//! Logs never carry content above debug level; `#[instrument]` on anything
//! that handles content uses `skip_all`.

pub mod admin;
pub mod attrs;
pub mod content;
pub mod hook_span;
pub mod metrics;
pub mod otlp_export;
pub mod otlp_wire;
pub mod panic_log;
pub mod propagation;
pub mod setup;
pub mod spans;

pub use admin::serve_admin;
pub use content::ContentView;
pub use hook_span::HookSpan;
pub use metrics::Metrics;
pub use setup::{build, init, LogFormat, Sampling, Telemetry, TelemetryError, TelemetryOptions};
pub use spans::ContentCapture;

use std::sync::Arc;

/// What the engine records into: metrics and the content-capture switch.
#[derive(Clone)]
pub struct Instruments {
    pub metrics: Arc<Metrics>,
    pub content: ContentCapture,
}

impl Instruments {
    pub fn new(cfg: &crate::config::TelemetryConfig) -> Self {
        Instruments {
            metrics: Arc::new(Metrics::new()),
            content: ContentCapture::from_config(cfg),
        }
    }
}
