//! W3C trace context for hook servers: in each event's context and in the
//! `Process` stream's gRPC metadata, so a hook server's own spans (any
//! language, standard OTel gRPC instrumentation) join the run's trace.
//!
//! This is a boundary module (it knows tonic's `MetadataMap`). It uses the
//! W3C `TraceContextPropagator` directly rather than the global propagator:
//! the hook protocol promises `traceparent`, whatever else is installed
//! globally, and tests need no global state.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// `(traceparent, tracestate)` of `span`; empty strings when the span has no
/// valid OTel context (export off, or the span is disabled). A span dropped
/// by the sampler still has a valid context, with the sampled flag off, so
/// the hook server does not sample either.
pub fn current_trace_context(span: &Span) -> (String, String) {
    // No subscriber took the span: there is no trace to propagate.
    if span.is_disabled() {
        return Default::default();
    }
    use opentelemetry::trace::TraceContextExt as _;
    let cx = span.context();
    let otel_span = cx.span();
    trace_headers(otel_span.span_context())
}

/// `(traceparent, tracestate)` for `sc`; empty strings when it is not
/// valid. What TraceContextPropagator writes, formatted directly: this runs
/// at every hook call, and the propagator's carrier map cost more than the
/// formatting itself (tests hold the two equal).
pub fn trace_headers(sc: &opentelemetry::trace::SpanContext) -> (String, String) {
    use opentelemetry::trace::TraceFlags;
    if !sc.is_valid() {
        return Default::default();
    }
    // Hex by hand into one exact-size buffer: `format!` through the ids'
    // `LowerHex` cost about as much again (callgrind, BENCHMARKS.md).
    let mut traceparent = String::with_capacity(TRACEPARENT_LEN);
    traceparent.push_str("00-");
    push_hex(&mut traceparent, &sc.trace_id().to_bytes());
    traceparent.push('-');
    push_hex(&mut traceparent, &sc.span_id().to_bytes());
    traceparent.push('-');
    push_hex(
        &mut traceparent,
        &[(sc.trace_flags() & TraceFlags::SAMPLED).to_u8()],
    );
    (traceparent, sc.trace_state().header())
}

/// `00-` + 32 + `-` + 16 + `-` + 2.
const TRACEPARENT_LEN: usize = 55;

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
}

/// Adds `traceparent` (and `tracestate`, when non-empty) of `span` to
/// outgoing gRPC metadata. Does nothing without a valid context.
pub fn inject_metadata(span: &Span, metadata: &mut MetadataMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut MetadataInjector(metadata));
}

/// Makes `span` a child of the remote context in incoming metadata (a
/// client's `traceparent` on `Run`/`Invoke`). Must be called before the span
/// is first entered; returns whether a valid remote parent was set.
pub fn set_parent_from_metadata(span: &Span, metadata: &MetadataMap) -> bool {
    let cx = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    use opentelemetry::trace::TraceContextExt as _;
    if !cx.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(cx).is_ok()
}

/// Like [`set_parent_from_metadata`], from header values already read
/// (empty `traceparent` means none).
pub fn set_parent_from_headers(span: &Span, traceparent: &str, tracestate: &str) -> bool {
    if traceparent.is_empty() {
        return false;
    }
    let mut carrier = HashMap::new();
    carrier.insert(TRACEPARENT.to_string(), traceparent.to_string());
    if !tracestate.is_empty() {
        carrier.insert(TRACESTATE.to_string(), tracestate.to_string());
    }
    let cx = TraceContextPropagator::new().extract(&carrier);
    use opentelemetry::trace::TraceContextExt as _;
    if !cx.span().span_context().is_valid() {
        return false;
    }
    span.set_parent(cx).is_ok()
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator always writes `tracestate`, often empty: an empty
        // header is noise. It only produces valid ASCII keys and values; one
        // that is not (a malformed tracestate) is dropped rather than sent.
        if value.is_empty() {
            return;
        }
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::Registry;

    use super::*;

    #[test]
    fn no_context_means_empty_strings_and_no_metadata() {
        // No OTel layer: nothing to propagate, and nothing is invented.
        tracing::subscriber::with_default(Registry::default(), || {
            let span = tracing::info_span!("x");
            assert_eq!(current_trace_context(&span), (String::new(), String::new()));
            let mut md = MetadataMap::new();
            inject_metadata(&span, &mut md);
            assert!(md.is_empty());
        });
        assert_eq!(
            current_trace_context(&Span::none()),
            (String::new(), String::new())
        );
    }

    /// The direct formatting says exactly what the W3C propagator would.
    #[test]
    fn trace_context_matches_the_propagator() {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = Registry::default()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("t")));
        tracing::subscriber::with_default(subscriber, || {
            for (flags, state) in [("01", "vendor=a,other=b"), ("00", ""), ("01", "")] {
                let span = tracing::info_span!("hook");
                let parent =
                    format!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}");
                assert!(set_parent_from_headers(&span, &parent, state));
                let mut carrier = HashMap::new();
                TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
                let (tp, ts) = current_trace_context(&span);
                assert_eq!(Some(&tp), carrier.get(TRACEPARENT), "{flags} {state}");
                assert_eq!(Some(&ts), carrier.get(TRACESTATE), "{flags} {state}");
                assert!(tp.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
            }
        });
    }

    #[test]
    fn extractor_reads_traceparent() {
        let mut md = MetadataMap::new();
        md.insert(
            TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let cx = TraceContextPropagator::new().extract(&MetadataExtractor(&md));
        use opentelemetry::trace::TraceContextExt as _;
        let sc = cx.span().span_context().clone();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
    }
}
