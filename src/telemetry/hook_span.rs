//! The per-hook-call span, `hook {hook} {event}`, built directly on the
//! OpenTelemetry tracer instead of through `tracing`.
//!
//! Why: it is made at every blocking hook call, and as a tracing span it
//! cost ~22k instructions per event before export (callgrind,
//! BENCHMARKS.md): a registry slot, every layer's `on_new_span`, a field
//! visitor, tracing-opentelemetry's owned builder, an enter and a close.
//! None of that buys anything here: no log line is formatted inside it (the
//! log layer filtered it out), and nothing is instrumented with it.
//!
//! It stays in the run's trace: its parent is the OTel context of the
//! tracing span current at the call (the run's, a `chat` or an
//! `execute_tool`), and it is started by the same tracer (provider,
//! sampler, instrumentation scope) as every other span. That tracer is
//! found on the current subscriber ([`HookTracer`], a layer that does
//! nothing), so pipelines built with [`super::build`] keep coexisting in
//! one process. Without an exporter there is no such layer and no span.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _};
use opentelemetry::KeyValue;
use opentelemetry_sdk::trace::{SdkTracer, Span as SdkSpan};
use tracing::Subscriber;
use tracing_subscriber::Layer;

use super::{attrs, propagation};

/// The attributes a hook span starts with (kind, hook, event) and the most
/// its result adds (verdict, outcome, latency, `error.type`).
const START_ATTRIBUTES: usize = 3;
const RESULT_ATTRIBUTES: usize = 4;

/// Carries the export tracer on the subscriber for [`HookSpan::start`].
/// Installed (filtered to nothing, so it sees no span or event and leaves
/// interest to the other layers) by the telemetry setup when spans are
/// exported.
pub struct HookTracer(pub SdkTracer);

impl<S: Subscriber> Layer<S> for HookTracer {}

/// One `hook {hook} {event}` span (CLIENT: a call to a remote hook server,
/// whose own spans join the trace through the propagated `traceparent`).
/// Only blocking calls get one (observe deliveries are fire-and-forget),
/// and a blocking hook can stop or rewrite the run, so its OpenInference
/// kind is `GUARDRAIL`.
///
/// Every recorder must be called at most once per span (the SDK appends
/// duplicate keys). The span is exported when dropped, with the end time
/// [`HookSpan::end_now`] took, so the failure policy can still add its
/// events after the call itself ended.
#[must_use = "a hook span records nothing once dropped"]
pub struct HookSpan {
    span: Option<SdkSpan>,
    ended: Option<SystemTime>,
}

impl HookSpan {
    /// Starts the span as a child of the current tracing span. A no-op span
    /// when nothing exports.
    pub fn start(hook: &str, event: &'static str) -> HookSpan {
        // The current span is looked up by id on the thread's subscriber
        // (where `Span::current` finds it too) rather than through a
        // `Span` handle: cloning and dropping a handle is a registry
        // reference taken and released for nothing (~0.5k instructions
        // per call, callgrind).
        let span = tracing::dispatcher::get_default(|dispatch| {
            let tracer = &dispatch.downcast_ref::<HookTracer>()?.0;
            let parent = match dispatch.current_span().id() {
                Some(id) => {
                    tracing_opentelemetry::get_otel_context(id, dispatch).unwrap_or_default()
                }
                None => opentelemetry::Context::new(),
            };
            // Sized up front: `format!` starts this name empty and grows it
            // three times, and the span's attribute list would grow when the
            // result is recorded (~2k instructions per call, callgrind).
            let mut name = String::with_capacity("hook  ".len() + hook.len() + event.len());
            name.push_str("hook ");
            name.push_str(hook);
            name.push(' ');
            name.push_str(event);
            let mut attributes = Vec::with_capacity(START_ATTRIBUTES + RESULT_ATTRIBUTES);
            attributes.extend([
                KeyValue::new(
                    attrs::OPENINFERENCE_SPAN_KIND,
                    attrs::openinference_kind::GUARDRAIL,
                ),
                KeyValue::new(attrs::HOOKWIRE_HOOK_NAME, hook.to_owned()),
                KeyValue::new(attrs::HOOKWIRE_HOOK_EVENT, event),
            ]);
            Some(
                tracer
                    .span_builder(name)
                    .with_kind(SpanKind::Client)
                    // A `Vec` is taken as it is, capacity included.
                    .with_attributes(attributes)
                    .start_with_context(tracer, &parent),
            )
        });
        HookSpan { span, ended: None }
    }

    /// A span that records nothing.
    pub fn none() -> HookSpan {
        HookSpan {
            span: None,
            ended: None,
        }
    }

    /// `(traceparent, tracestate)` naming this span, for the hook server;
    /// empty strings when there is no span. An unsampled span still has a
    /// valid context, with the sampled flag off, so the hook server does not
    /// sample either.
    pub fn trace_context(&self) -> (String, String) {
        match &self.span {
            Some(span) => propagation::trace_headers(span.span_context()),
            None => Default::default(),
        }
    }

    /// The call's result: the verdict kind (`continue`, `rewrite_args`,
    /// ...; empty for none), the outcome (`ok`, `timeout`, a failure class,
    /// `failed_open`) and its wall time. Static values: nothing is copied.
    pub fn record_result(
        &mut self,
        verdict_kind: &'static str,
        outcome: &'static str,
        latency: Duration,
    ) {
        let Some(span) = self.recording() else {
            return;
        };
        if !verdict_kind.is_empty() {
            span.set_attribute(KeyValue::new(attrs::HOOKWIRE_HOOK_VERDICT, verdict_kind));
        }
        span.set_attribute(KeyValue::new(attrs::HOOKWIRE_HOOK_OUTCOME, outcome));
        span.set_attribute(KeyValue::new(
            attrs::HOOKWIRE_HOOK_LATENCY_MS,
            latency.as_secs_f64() * 1000.0,
        ));
    }

    /// `error.type` and an error status. `error_type` is a failure class,
    /// never a hook server's words.
    pub fn record_error(&mut self, error_type: &'static str) {
        let Some(span) = self.recording() else {
            return;
        };
        span.set_attribute(KeyValue::new(attrs::ERROR_TYPE, error_type));
        span.set_status(Status::error(error_type));
    }

    /// A span event (e.g. `hook.failed_open` with hook, event and class).
    /// Never put content in `attributes`.
    pub fn add_event(&mut self, name: &'static str, attributes: &[(&'static str, &str)]) {
        let Some(span) = self.recording() else {
            return;
        };
        let attributes = attributes
            .iter()
            .map(|(k, v)| KeyValue::new(*k, v.to_string()))
            .collect();
        span.add_event(Cow::Borrowed(name), attributes);
    }

    /// The call ended now: the span's end time, whenever it is exported.
    pub fn end_now(&mut self) {
        if self.span.is_some() && self.ended.is_none() {
            self.ended = Some(SystemTime::now());
        }
    }

    fn recording(&mut self) -> Option<&mut SdkSpan> {
        self.span.as_mut().filter(|s| s.is_recording())
    }
}

impl Drop for HookSpan {
    fn drop(&mut self) {
        if let Some(mut span) = self.span.take() {
            span.end_with_timestamp(self.ended.unwrap_or_else(SystemTime::now));
        }
    }
}

impl std::fmt::Debug for HookSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookSpan")
            .field(
                "recording",
                &self.span.as_ref().is_some_and(|s| s.is_recording()),
            )
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::Registry;

    use super::*;

    #[test]
    fn without_an_exporting_subscriber_there_is_no_span_and_no_context() {
        tracing::subscriber::with_default(Registry::default(), || {
            let run = tracing::info_span!("run");
            let _g = run.enter();
            let mut span = HookSpan::start("h", "tool_call");
            assert!(span.span.is_none());
            assert_eq!(span.trace_context(), (String::new(), String::new()));
            span.record_result("continue", "ok", Duration::ZERO);
            span.end_now();
        });
        assert!(HookSpan::start("h", "tool_call").span.is_none());
    }

    // That the span is exported as a child of the current span, with its
    // attributes and a traceparent naming it: tests/telemetry_blocks.rs,
    // through the real pipeline and an OTLP collector.
}
