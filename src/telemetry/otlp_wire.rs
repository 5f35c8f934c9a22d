//! OTLP's `ExportTraceServiceRequest`, written straight from the SDK's
//! [`SpanData`] into protobuf bytes.
//!
//! Why not `opentelemetry-otlp`'s exporter: per exported span it clones the
//! span for a possible retry, converts it into `opentelemetry-proto`'s owned
//! message tree (a new `String` per attribute key and value, the
//! instrumentation scope hashed per span), and prost then measures every
//! nested message once per level above it while encoding: ~14k instructions
//! per hook span, a fifth of a hook event's cost (callgrind; BENCHMARKS.md,
//! figure 10). Here each length is computed from the borrowed span and
//! written once, and the resource is encoded once per exporter.
//!
//! The bytes are the ones prost writes for the crate's own conversion, field
//! for field and in the same (tag) order (the tests decode and compare both, and
//! compare the bytes), so a collector cannot tell the two apart.

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanId, SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::trace::SpanData;
use opentelemetry_sdk::Resource;

// Wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// `flags` bit: whether the parent is remote is known (OTLP `SpanFlags`).
const HAS_IS_REMOTE: u32 = 0x100;
/// `flags` bit: the parent is remote.
const IS_REMOTE: u32 = 0x200;

/// The request for one batch: the resource (encoded once, see
/// [`encode_resource`]) and the batch's spans grouped by instrumentation
/// scope, scopes in order of first appearance, spans in batch order (as
/// `opentelemetry-proto`'s `group_spans_by_resource_and_scope` does).
pub fn encode_request(resource: &EncodedResource, spans: &[SpanData]) -> Vec<u8> {
    let mut scopes: Vec<(&InstrumentationScope, Vec<&SpanData>)> = Vec::new();
    for span in spans {
        let scope = &span.instrumentation_scope;
        match scopes.iter_mut().find(|(s, _)| *s == scope) {
            Some((_, group)) => group.push(span),
            None => scopes.push((scope, vec![span])),
        }
    }
    let scope_lens: Vec<(usize, Vec<usize>)> = scopes
        .iter()
        .map(|(scope, group)| {
            let span_lens: Vec<usize> = group.iter().map(|s| span_len(s)).collect();
            (scope_spans_len(scope, &span_lens), span_lens)
        })
        .collect();
    let mut resource_spans = field_len(1, resource.attributes.len());
    resource_spans += scope_lens
        .iter()
        .map(|(len, _)| field_len(2, *len))
        .sum::<usize>();
    resource_spans += string_len(3, &resource.schema_url);

    let mut w = Writer(Vec::with_capacity(field_len(1, resource_spans)));
    w.key(1, LEN);
    w.varint(resource_spans as u64);
    w.bytes_field(1, &resource.attributes);
    for ((scope, group), (len, span_lens)) in scopes.iter().zip(&scope_lens) {
        w.key(2, LEN);
        w.varint(*len as u64);
        w.scope_spans(scope, group, span_lens);
    }
    w.string(3, &resource.schema_url);
    w.0
}

/// A resource's `Resource` message body and schema URL, encoded once.
#[derive(Clone, Debug, Default)]
pub struct EncodedResource {
    attributes: Vec<u8>,
    schema_url: String,
}

pub fn encode_resource(resource: &Resource) -> EncodedResource {
    let attributes: Vec<KeyValue> = resource
        .iter()
        .map(|(k, v)| KeyValue::new(k.clone(), v.clone()))
        .collect();
    let mut w = Writer(Vec::new());
    w.attributes(1, &attributes);
    EncodedResource {
        attributes: w.0,
        schema_url: resource.schema_url().unwrap_or_default().to_owned(),
    }
}

fn varint_len(v: u64) -> usize {
    // 7 bits per byte; at least one byte.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn key_len(tag: u32) -> usize {
    varint_len(u64::from(tag) << 3)
}

/// A length-delimited field of `len` bytes, always written.
fn field_len(tag: u32, len: usize) -> usize {
    key_len(tag) + varint_len(len as u64) + len
}

/// A string or bytes field, left out when empty (proto3).
fn string_len(tag: u32, s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        field_len(tag, s.len())
    }
}

fn uint_len(tag: u32, v: u64) -> usize {
    if v == 0 {
        0
    } else {
        key_len(tag) + varint_len(v)
    }
}

fn fixed64_len(tag: u32, v: u64) -> usize {
    if v == 0 {
        0
    } else {
        key_len(tag) + 8
    }
}

/// Nanoseconds since the epoch in OTLP's fixed64, as the crate converts
/// them (a `u64` holds them until the year 2554).
fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn id_len(tag: u32, id: &[u8]) -> usize {
    field_len(tag, id.len())
}

fn kind_code(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

fn status_parts(status: &Status) -> (u64, &str) {
    match status {
        Status::Unset => (0, ""),
        Status::Ok => (1, ""),
        Status::Error { description } => (2, description),
    }
}

fn flags(is_remote: bool, trace_flags: u8) -> u32 {
    let mut f = u32::from(trace_flags) | HAS_IS_REMOTE;
    if is_remote {
        f |= IS_REMOTE;
    }
    f
}

/// An attribute value as OTLP's `AnyValue` body. Strings are borrowed:
/// nothing is allocated for the common types.
enum Any<'a> {
    Str(&'a str),
    Bool(bool),
    Int(i64),
    Double(f64),
    /// An `ArrayValue` body of the given length, from an array.
    Array(&'a Array),
    /// A value type newer than this encoder: its text.
    Other(String),
}

fn any_value(v: &Value) -> Any<'_> {
    match v {
        Value::Bool(b) => Any::Bool(*b),
        Value::I64(i) => Any::Int(*i),
        Value::F64(f) => Any::Double(*f),
        Value::String(s) => Any::Str(s.as_str()),
        Value::Array(a) => Any::Array(a),
        #[allow(unreachable_patterns)]
        other => Any::Other(other.to_string()),
    }
}

fn array_body_len(a: &Array) -> usize {
    // Each element is an `AnyValue` in field 1 of `ArrayValue`.
    match a {
        Array::Bool(v) => v.len() * field_len(1, 2),
        Array::I64(v) => v
            .iter()
            .map(|i| field_len(1, 1 + varint_len(*i as u64)))
            .sum(),
        Array::F64(v) => v.len() * field_len(1, 9),
        Array::String(v) => v
            .iter()
            .map(|s| field_len(1, field_len(1, s.as_str().len())))
            .sum(),
        #[allow(unreachable_patterns)]
        other => field_len(1, field_len(1, other.to_string().len())),
    }
}

/// The `AnyValue` body's length: its one-of field is always written.
fn any_len(v: &Any<'_>) -> usize {
    match v {
        Any::Str(s) => field_len(1, s.len()),
        Any::Other(s) => field_len(1, s.len()),
        Any::Bool(_) => 2,
        // protobuf's int64: the two's-complement bits as a varint.
        Any::Int(i) => 1 + varint_len(*i as u64),
        Any::Double(_) => 9,
        Any::Array(a) => field_len(5, array_body_len(a)),
    }
}

fn kv_len(kv: &KeyValue) -> usize {
    string_len(1, kv.key.as_str()) + field_len(2, any_len(&any_value(&kv.value)))
}

fn attributes_len(tag: u32, attrs: &[KeyValue]) -> usize {
    attrs.iter().map(|kv| field_len(tag, kv_len(kv))).sum()
}

fn event_len(e: &opentelemetry::trace::Event) -> usize {
    fixed64_len(1, nanos(e.timestamp))
        + string_len(2, &e.name)
        + attributes_len(3, &e.attributes)
        + uint_len(4, u64::from(e.dropped_attributes_count))
}

fn link_len(l: &opentelemetry::trace::Link) -> usize {
    let ctx = &l.span_context;
    id_len(1, &ctx.trace_id().to_bytes())
        + id_len(2, &ctx.span_id().to_bytes())
        + string_len(3, &ctx.trace_state().header())
        + attributes_len(4, &l.attributes)
        + uint_len(5, u64::from(l.dropped_attributes_count))
        + key_len(6)
        + 4
}

fn status_len(status: &Status) -> usize {
    let (code, message) = status_parts(status);
    string_len(2, message) + uint_len(3, code)
}

fn span_len(s: &SpanData) -> usize {
    let ctx = &s.span_context;
    let parent = if s.parent_span_id != SpanId::INVALID {
        id_len(4, &s.parent_span_id.to_bytes())
    } else {
        0
    };
    id_len(1, &ctx.trace_id().to_bytes())
        + id_len(2, &ctx.span_id().to_bytes())
        + string_len(3, &ctx.trace_state().header())
        + parent
        + key_len(16)
        + 4
        + string_len(5, &s.name)
        + key_len(6)
        + 1
        + fixed64_len(7, nanos(s.start_time))
        + fixed64_len(8, nanos(s.end_time))
        + attributes_len(9, &s.attributes)
        + uint_len(10, u64::from(s.dropped_attributes_count))
        + s.events
            .events
            .iter()
            .map(|e| field_len(11, event_len(e)))
            .sum::<usize>()
        + uint_len(12, u64::from(s.events.dropped_count))
        + s.links
            .links
            .iter()
            .map(|l| field_len(13, link_len(l)))
            .sum::<usize>()
        + uint_len(14, u64::from(s.links.dropped_count))
        + field_len(15, status_len(&s.status))
}

fn scope_len(scope: &InstrumentationScope) -> usize {
    let attrs: Vec<KeyValue> = scope.attributes().cloned().collect();
    string_len(1, scope.name())
        + string_len(2, scope.version().unwrap_or_default())
        + attributes_len(3, &attrs)
}

fn scope_spans_len(scope: &InstrumentationScope, span_lens: &[usize]) -> usize {
    field_len(1, scope_len(scope))
        + span_lens.iter().map(|l| field_len(2, *l)).sum::<usize>()
        + string_len(3, scope.schema_url().unwrap_or_default())
}

struct Writer(Vec<u8>);

impl Writer {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, tag: u32, wire: u32) {
        self.varint(u64::from((tag << 3) | wire));
    }

    fn bytes_field(&mut self, tag: u32, b: &[u8]) {
        self.key(tag, LEN);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn string(&mut self, tag: u32, s: &str) {
        if !s.is_empty() {
            self.bytes_field(tag, s.as_bytes());
        }
    }

    fn uint(&mut self, tag: u32, v: u64) {
        if v != 0 {
            self.key(tag, VARINT);
            self.varint(v);
        }
    }

    fn fixed64(&mut self, tag: u32, v: u64) {
        if v != 0 {
            self.key(tag, FIXED64);
            self.0.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn fixed32(&mut self, tag: u32, v: u32) {
        self.key(tag, FIXED32);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn any(&mut self, v: &Any<'_>) {
        match v {
            Any::Str(s) => self.bytes_field(1, s.as_bytes()),
            Any::Other(s) => self.bytes_field(1, s.as_bytes()),
            Any::Bool(b) => {
                self.key(2, VARINT);
                self.varint(u64::from(*b));
            }
            Any::Int(i) => {
                self.key(3, VARINT);
                self.varint(*i as u64);
            }
            Any::Double(f) => {
                self.key(4, FIXED64);
                self.0.extend_from_slice(&f.to_bits().to_le_bytes());
            }
            Any::Array(a) => {
                self.key(5, LEN);
                self.varint(array_body_len(a) as u64);
                self.array(a);
            }
        }
    }

    fn array(&mut self, a: &Array) {
        let element = |w: &mut Writer, v: Any<'_>| {
            w.key(1, LEN);
            w.varint(any_len(&v) as u64);
            w.any(&v);
        };
        match a {
            Array::Bool(v) => v.iter().for_each(|b| element(self, Any::Bool(*b))),
            Array::I64(v) => v.iter().for_each(|i| element(self, Any::Int(*i))),
            Array::F64(v) => v.iter().for_each(|f| element(self, Any::Double(*f))),
            Array::String(v) => v.iter().for_each(|s| element(self, Any::Str(s.as_str()))),
            #[allow(unreachable_patterns)]
            other => element(self, Any::Other(other.to_string())),
        }
    }

    fn attributes(&mut self, tag: u32, attrs: &[KeyValue]) {
        for kv in attrs {
            let value = any_value(&kv.value);
            let value_len = any_len(&value);
            let key = kv.key.as_str();
            self.key(tag, LEN);
            self.varint((string_len(1, key) + field_len(2, value_len)) as u64);
            self.string(1, key);
            self.key(2, LEN);
            self.varint(value_len as u64);
            self.any(&value);
        }
    }

    fn scope_spans(&mut self, scope: &InstrumentationScope, spans: &[&SpanData], lens: &[usize]) {
        let attrs: Vec<KeyValue> = scope.attributes().cloned().collect();
        self.key(1, LEN);
        self.varint(scope_len(scope) as u64);
        self.string(1, scope.name());
        self.string(2, scope.version().unwrap_or_default());
        self.attributes(3, &attrs);
        for (span, len) in spans.iter().zip(lens) {
            self.key(2, LEN);
            self.varint(*len as u64);
            self.span(span);
        }
        self.string(3, scope.schema_url().unwrap_or_default());
    }

    fn span(&mut self, s: &SpanData) {
        let ctx = &s.span_context;
        self.bytes_field(1, &ctx.trace_id().to_bytes());
        self.bytes_field(2, &ctx.span_id().to_bytes());
        self.string(3, &ctx.trace_state().header());
        if s.parent_span_id != SpanId::INVALID {
            self.bytes_field(4, &s.parent_span_id.to_bytes());
        }
        self.string(5, &s.name);
        self.uint(6, kind_code(&s.span_kind));
        self.fixed64(7, nanos(s.start_time));
        self.fixed64(8, nanos(s.end_time));
        self.attributes(9, &s.attributes);
        self.uint(10, u64::from(s.dropped_attributes_count));
        for e in &s.events.events {
            self.key(11, LEN);
            self.varint(event_len(e) as u64);
            self.fixed64(1, nanos(e.timestamp));
            self.string(2, &e.name);
            self.attributes(3, &e.attributes);
            self.uint(4, u64::from(e.dropped_attributes_count));
        }
        self.uint(12, u64::from(s.events.dropped_count));
        for l in &s.links.links {
            let ctx = &l.span_context;
            self.key(13, LEN);
            self.varint(link_len(l) as u64);
            self.bytes_field(1, &ctx.trace_id().to_bytes());
            self.bytes_field(2, &ctx.span_id().to_bytes());
            self.string(3, &ctx.trace_state().header());
            self.attributes(4, &l.attributes);
            self.uint(5, u64::from(l.dropped_attributes_count));
            self.fixed32(6, flags(ctx.is_remote(), ctx.trace_flags().to_u8()));
        }
        self.uint(14, u64::from(s.links.dropped_count));
        let (code, message) = status_parts(&s.status);
        self.key(15, LEN);
        self.varint(status_len(&s.status) as u64);
        self.string(2, message);
        self.uint(3, code);
        // prost writes fields in tag order.
        self.fixed32(
            16,
            flags(s.parent_span_is_remote, ctx.trace_flags().to_u8()),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::time::Duration;

    use opentelemetry::trace::{Event, Link, SpanContext, TraceFlags, TraceId, TraceState};
    use opentelemetry::{StringValue, Value};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use proptest::prelude::*;
    use prost::Message;

    use super::*;

    /// What `opentelemetry-otlp`'s tonic exporter puts on the wire.
    fn reference(resource: &Resource, spans: &[SpanData]) -> Vec<u8> {
        let attrs = ResourceAttributesWithSchema::from(resource);
        ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(spans.to_vec(), &attrs),
        }
        .encode_to_vec()
    }

    fn assert_same(resource: &Resource, spans: &[SpanData]) {
        let ours = encode_request(&encode_resource(resource), spans);
        let theirs = reference(resource, spans);
        if ours != theirs {
            // Decoded first: a readable difference when the fields differ.
            assert_eq!(
                ExportTraceServiceRequest::decode(&ours[..]).map_err(|e| e.to_string()),
                ExportTraceServiceRequest::decode(&theirs[..]).map_err(|e| e.to_string()),
            );
            assert_eq!(ours, theirs, "same fields, different bytes");
        }
    }

    fn context(trace: u128, span: u64, sampled: bool, remote: bool, state: &str) -> SpanContext {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let state = if state.is_empty() {
            TraceState::default()
        } else {
            TraceState::from_key_value([("vendor", state)]).expect("valid trace state")
        };
        SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            flags,
            remote,
            state,
        )
    }

    fn span(name: &str, attributes: Vec<KeyValue>, scope: &InstrumentationScope) -> SpanData {
        SpanData {
            span_context: context(7, 9, true, false, ""),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Owned(name.to_owned()),
            start_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789),
            end_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_223_456_789),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: scope.clone(),
        }
    }

    fn hookwire_scope() -> InstrumentationScope {
        InstrumentationScope::builder("hookwire")
            .with_version("0.1.0")
            .build()
    }

    #[test]
    fn a_hook_span_is_written_as_the_crate_writes_it() {
        let resource = Resource::builder_empty()
            .with_service_name("hookwire")
            .with_attribute(KeyValue::new("service.version", "0.1.0"))
            .build();
        let mut s = span(
            "hook redactor tool_call",
            vec![
                KeyValue::new("hookwire.hook.name", "redactor"),
                KeyValue::new("hookwire.hook.verdict", "rewrite_input"),
                KeyValue::new("hookwire.hook.latency_ms", 1.25),
                KeyValue::new("hookwire.hook.attempt", 1_i64),
                KeyValue::new("hookwire.hook.blocking", true),
            ],
            &hookwire_scope(),
        );
        s.parent_span_id = SpanId::from(3);
        s.status = Status::error("hook_failed");
        s.events.events.push(Event::new(
            "hook.failed_open",
            UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            vec![KeyValue::new("error.type", "deadline")],
            0,
        ));
        assert_same(&resource, &[s.clone(), s]);
    }

    #[test]
    fn an_empty_batch_and_an_empty_resource_are_written_as_the_crate_writes_them() {
        assert_same(&Resource::builder_empty().build(), &[]);
    }

    #[test]
    fn spans_of_two_scopes_are_grouped_in_order_of_first_appearance() {
        let other = InstrumentationScope::builder("other")
            .with_schema_url("https://opentelemetry.io/schemas/1.30.0")
            .with_attributes([KeyValue::new("lib", "x")])
            .build();
        let a = span("a", vec![], &hookwire_scope());
        let b = span("b", vec![], &other);
        let resource = Resource::builder_empty()
            .with_schema_url([KeyValue::new("k", "v")], "https://example.com/schema")
            .build();
        assert_same(&resource, &[b.clone(), a.clone(), b, a]);
    }

    fn value() -> impl Strategy<Value = Value> {
        let s = || "[a-zé\\-]{0,12}".prop_map(StringValue::from);
        prop_oneof![
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::I64),
            any::<f64>().prop_map(Value::F64),
            s().prop_map(Value::String),
            prop::collection::vec(any::<bool>(), 0..3).prop_map(|v| Value::Array(Array::Bool(v))),
            prop::collection::vec(any::<i64>(), 0..3).prop_map(|v| Value::Array(Array::I64(v))),
            prop::collection::vec(any::<f64>(), 0..3).prop_map(|v| Value::Array(Array::F64(v))),
            prop::collection::vec(s(), 0..3).prop_map(|v| Value::Array(Array::String(v))),
        ]
    }

    fn attributes() -> impl Strategy<Value = Vec<KeyValue>> {
        prop::collection::vec(("[a-z.]{0,10}", value()), 0..5)
            .prop_map(|kvs| kvs.into_iter().map(|(k, v)| KeyValue::new(k, v)).collect())
    }

    prop_compose! {
        fn any_span()(
            ids in (any::<u128>(), any::<u64>(), any::<u64>()),
            bits in (any::<bool>(), any::<bool>(), any::<bool>(), 0..5u8, 0..3u8),
            name in "[a-z ]{0,20}",
            state in "[a-z]{0,6}",
            times in (any::<u64>(), any::<u64>()),
            attributes in attributes(),
            dropped in (0..3u32, 0..3u32, 0..3u32),
            events in prop::collection::vec(("[a-z]{0,8}", any::<u64>(), attributes(), 0..2u32), 0..3),
            links in prop::collection::vec((any::<u128>(), any::<u64>(), any::<bool>(), attributes(), 0..2u32), 0..2),
            description in "[a-z ]{0,12}",
            other_scope in any::<bool>(),
        ) -> SpanData {
            let (sampled, remote, parent_remote, kind, status) = bits;
            let scope = if other_scope {
                InstrumentationScope::builder("other").build()
            } else {
                hookwire_scope()
            };
            let mut s = span(&name, attributes, &scope);
            s.span_context = context(ids.0, ids.1, sampled, remote, &state);
            s.parent_span_id = SpanId::from(ids.2);
            s.parent_span_is_remote = parent_remote;
            s.span_kind = [SpanKind::Internal, SpanKind::Server, SpanKind::Client, SpanKind::Producer, SpanKind::Consumer][kind as usize].clone();
            s.status = match status {
                0 => Status::Unset,
                1 => Status::Ok,
                _ => Status::error(description),
            };
            s.start_time = UNIX_EPOCH + Duration::from_nanos(times.0);
            s.end_time = UNIX_EPOCH + Duration::from_nanos(times.1);
            s.dropped_attributes_count = dropped.0;
            s.events.dropped_count = dropped.1;
            s.links.dropped_count = dropped.2;
            for (name, at, attrs, dropped) in events {
                s.events.events.push(Event::new(name, UNIX_EPOCH + Duration::from_nanos(at), attrs, dropped));
            }
            for (trace, span, sampled, attrs, dropped) in links {
                s.links.links.push(Link::new(context(trace, span, sampled, true, ""), attrs, dropped));
            }
            s
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn any_batch_is_written_as_the_crate_writes_it(
            spans in prop::collection::vec(any_span(), 0..4),
            resource in attributes(),
        ) {
            let resource = Resource::builder_empty().with_attributes(resource).build();
            let ours = encode_request(&encode_resource(&resource), &spans);
            prop_assert_eq!(ours, reference(&resource, &spans));
        }
    }
}
