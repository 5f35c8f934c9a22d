//! An in-test OTLP/gRPC trace collector on 127.0.0.1:0 (the
//! `opentelemetry-proto` crate's generated `TraceService`), and an in-memory
//! log writer. Together they see everything hookwire emits, so leak tests can
//! search both for a sentinel.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use tokio::sync::{oneshot, Notify};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

/// One exported span, flattened out of its resource and scope.
#[derive(Clone, Debug)]
pub struct CollectedSpan {
    pub name: String,
    /// `internal`, `server`, `client`, `producer`, `consumer`, `unspecified`.
    pub kind: &'static str,
    /// Lower-case hex, as in `traceparent`.
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// Every attribute, duplicates included (the SDK appends duplicate keys,
    /// and seeing them is the point of some tests).
    pub attributes: Vec<(String, String)>,
    pub events: Vec<CollectedEvent>,
    /// `unset`, `ok` or `error`.
    pub status: &'static str,
    pub resource: Vec<(String, String)>,
}

#[derive(Clone, Debug)]
pub struct CollectedEvent {
    pub name: String,
    pub attributes: Vec<(String, String)>,
}

impl CollectedSpan {
    /// The value of `key` (the first one, if duplicated).
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// How many times `key` was set.
    pub fn attr_count(&self, key: &str) -> usize {
        self.attributes.iter().filter(|(k, _)| k == key).count()
    }

    pub fn resource_attr(&self, key: &str) -> Option<&str> {
        self.resource
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn event(&self, name: &str) -> Option<&CollectedEvent> {
        self.events.iter().find(|e| e.name == name)
    }
}

impl CollectedEvent {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct Store {
    requests: Mutex<Vec<ExportTraceServiceRequest>>,
    /// Each request re-encoded to protobuf. String fields are encoded
    /// verbatim, so a byte search here finds any string that was on the wire.
    raw: Mutex<Vec<Vec<u8>>>,
    arrived: Notify,
}

struct Receiver(Arc<Store>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let request = request.into_inner();
        self.0.raw.lock().unwrap().push(request.encode_to_vec());
        self.0.requests.lock().unwrap().push(request);
        self.0.arrived.notify_waiters();
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The collector. Stops serving when dropped.
pub struct Collector {
    addr: SocketAddr,
    store: Arc<Store>,
    shutdown: Option<oneshot::Sender<()>>,
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // tonic's serve_with_incoming ignores tcp_nodelay; without it every
        // export waits out Nagle + delayed ACK (tens of ms).
        let incoming = TcpListenerStream::new(listener).map(|conn| {
            if let Ok(stream) = &conn {
                let _ = stream.set_nodelay(true);
            }
            conn
        });
        let store = Arc::new(Store::default());
        let (tx, rx) = oneshot::channel::<()>();
        let service = TraceServiceServer::new(Receiver(store.clone()));
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = rx.await;
                })
                .await
                .expect("test collector");
        });
        Collector {
            addr,
            store,
            shutdown: Some(tx),
        }
    }

    /// `http://127.0.0.1:PORT`, for `TelemetryOptions::otlp_endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<ExportTraceServiceRequest> {
        self.store.requests.lock().unwrap().clone()
    }

    /// Every span received so far, in arrival order.
    pub fn spans(&self) -> Vec<CollectedSpan> {
        let requests = self.store.requests.lock().unwrap();
        let mut out = Vec::new();
        for resource_spans in requests.iter().flat_map(|r| &r.resource_spans) {
            let resource = resource_spans
                .resource
                .as_ref()
                .map(|r| flatten(&r.attributes))
                .unwrap_or_default();
            for scope_spans in &resource_spans.scope_spans {
                for span in &scope_spans.spans {
                    out.push(CollectedSpan {
                        name: span.name.clone(),
                        kind: kind_name(span.kind),
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: flatten(&span.attributes),
                        events: span
                            .events
                            .iter()
                            .map(|e| CollectedEvent {
                                name: e.name.clone(),
                                attributes: flatten(&e.attributes),
                            })
                            .collect(),
                        status: match span.status.as_ref().map(|s| s.code) {
                            Some(1) => "ok",
                            Some(2) => "error",
                            _ => "unset",
                        },
                        resource: resource.clone(),
                    });
                }
            }
        }
        out
    }

    pub fn span(&self, name: &str) -> Option<CollectedSpan> {
        self.spans().into_iter().find(|s| s.name == name)
    }

    /// Whether `needle` occurs anywhere in any export request received.
    pub fn raw_contains(&self, needle: &[u8]) -> bool {
        self.store
            .raw
            .lock()
            .unwrap()
            .iter()
            .any(|raw| raw.windows(needle.len()).any(|w| w == needle))
    }

    /// Waits (on the arrival signal, no polling) until a span named `name`
    /// has arrived; panics after `timeout` listing what did arrive.
    pub async fn wait_for_span(&self, name: &str, timeout: Duration) -> CollectedSpan {
        self.wait_until(timeout, |spans| spans.iter().any(|s| s.name == name))
            .await;
        self.span(name).expect("just seen")
    }

    /// Waits until `done(spans)` holds; panics after `timeout`.
    pub async fn wait_until(&self, timeout: Duration, done: impl Fn(&[CollectedSpan]) -> bool) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Register interest before looking, so an export landing between
            // the check and the await still wakes us.
            let arrived = self.store.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let spans = self.spans();
            if done(&spans) {
                return;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                let names: Vec<_> = spans.iter().map(|s| s.name.as_str()).collect();
                panic!("collector: condition not met within {timeout:?}; spans seen: {names:?}");
            }
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

fn kind_name(kind: i32) -> &'static str {
    match SpanKind::try_from(kind) {
        Ok(SpanKind::Internal) => "internal",
        Ok(SpanKind::Server) => "server",
        Ok(SpanKind::Client) => "client",
        Ok(SpanKind::Producer) => "producer",
        Ok(SpanKind::Consumer) => "consumer",
        _ => "unspecified",
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn flatten(attributes: &[KeyValue]) -> Vec<(String, String)> {
    attributes
        .iter()
        .map(|kv| (kv.key.clone(), render(kv.value.as_ref())))
        .collect()
}

/// Scalars as themselves; arrays as `[a,b]`.
fn render(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        None => String::new(),
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(any_value::Value::ArrayValue(a)) => {
            let items: Vec<String> = a.values.iter().map(|v| render(Some(v))).collect();
            format!("[{}]", items.join(","))
        }
        Some(other) => format!("{other:?}"),
    }
}

/// Log output captured in memory: pass [`LogCapture::writer`] to
/// `hookwire::telemetry::build`.
#[derive(Clone, Default)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

struct LogCaptureWriter(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogCaptureWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    pub fn writer(&self) -> BoxMakeWriter {
        let buf = self.0.clone();
        BoxMakeWriter::new(move || LogCaptureWriter(buf.clone()))
    }

    pub fn contents(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}
