//! The OTLP/gRPC span exporter: `TraceService/Export` on a tonic channel,
//! with the request body written by [`super::otlp_wire`] (why: there).
//!
//! Behaves as `opentelemetry-otlp`'s tonic exporter did for hookwire:
//! - a lazy channel to the endpoint (TLS with the webpki roots for
//!   `https://`), its connection task on the runtime it was built on (the
//!   batch processor exports from a thread of its own, outside the runtime);
//! - the export timeout bounds every attempt and the retries between them
//!   (`OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, then `OTEL_EXPORTER_OTLP_TIMEOUT`,
//!   in ms; 10 s);
//! - headers from `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, then
//!   `OTEL_EXPORTER_OTLP_HEADERS` (`key=value,...`, values
//!   percent-encoded); the `user-agent` is `hookwire/VERSION`;
//! - the OTLP retry policy: the retryable codes (UNAVAILABLE, CANCELLED,
//!   DEADLINE_EXCEEDED, ABORTED, OUT_OF_RANGE, DATA_LOSS, and
//!   RESOURCE_EXHAUSTED when the server says when to retry) up to 3 retries,
//!   100 ms doubling to 1.6 s plus up to 100 ms of jitter, a server's
//!   `RetryInfo` delay honoured (at most 30 s), all within the timeout;
//! - a failed export's error names the gRPC code only: a collector's
//!   message can echo credentials, so it is logged at debug level.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::{MetadataKey, MetadataMap};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};
use tonic_types::StatusExt;

use super::otlp_wire::{encode_request, encode_resource, EncodedResource};

/// How long one export may take, retries included, by default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

const MAX_RETRIES: u32 = 3;
const INITIAL_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_millis(1600);
const MAX_JITTER_MS: u64 = 100;
/// The longest wait a collector's `RetryInfo` can ask for.
const MAX_THROTTLE: Duration = Duration::from_secs(30);

/// Where and how spans are exported.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportSettings {
    pub endpoint: String,
    pub timeout: Duration,
    /// gRPC metadata on every export.
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportSetupError {
    #[error("invalid endpoint: {0}")]
    Endpoint(#[source] tonic::transport::Error),
    #[error("TLS for the collector: {0}")]
    Tls(#[source] tonic::transport::Error),
    /// By position: a malformed entry may hold a credential.
    #[error("export header {0} (counted from 1) is not a valid gRPC metadata key or value")]
    Header(usize),
}

pub struct OtlpExporter {
    channel: Channel,
    metadata: MetadataMap,
    timeout: Duration,
    resource: EncodedResource,
    shut_down: AtomicBool,
}

impl std::fmt::Debug for OtlpExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OtlpExporter")
    }
}

impl OtlpExporter {
    /// Builds the exporter; must run inside a Tokio runtime (the lazy
    /// channel's connection task is spawned there).
    pub fn new(settings: &ExportSettings) -> Result<OtlpExporter, ExportSetupError> {
        let mut endpoint = Endpoint::from_shared(settings.endpoint.clone())
            .and_then(|e| e.user_agent(concat!("hookwire/", env!("CARGO_PKG_VERSION"))))
            .map_err(ExportSetupError::Endpoint)?
            .timeout(settings.timeout);
        if let Some(tls) = collector_tls(&settings.endpoint) {
            endpoint = endpoint.tls_config(tls).map_err(ExportSetupError::Tls)?;
        }
        let mut metadata = MetadataMap::new();
        for (i, (k, v)) in settings.headers.iter().enumerate() {
            let bad = ExportSetupError::Header(i + 1);
            let Ok(key) = MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes()) else {
                return Err(bad);
            };
            let Ok(value) = v.parse() else {
                return Err(bad);
            };
            metadata.append(key, value);
        }
        Ok(OtlpExporter {
            channel: endpoint.connect_lazy(),
            metadata,
            timeout: settings.timeout,
            resource: EncodedResource::default(),
            shut_down: AtomicBool::new(false),
        })
    }

    async fn attempt(&self, body: &prost::bytes::Bytes) -> Result<(), Status> {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| Status::unavailable(format!("collector not ready: {e}")))?;
        let mut req = tonic::Request::new(body.clone());
        *req.metadata_mut() = self.metadata.clone();
        let path = http::uri::PathAndQuery::from_static(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
        );
        let resp = grpc.unary(req, path, RawCodec).await?.into_inner();
        if let Some(p) = resp.partial_success {
            if p.rejected_spans > 0 || !p.error_message.is_empty() {
                tracing::warn!(
                    target: "hookwire::telemetry::export",
                    rejected_spans = p.rejected_spans,
                    "the OTLP collector rejected spans"
                );
                // Its text may echo credentials (a gateway's "invalid key
                // …"): not logged even at debug.
                tracing::debug!(target: "hookwire::telemetry::export", message_bytes = p.error_message.len(), "the collector's partial-success message is not shown");
            }
        }
        Ok(())
    }
}

impl SpanExporter for OtlpExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        if self.shut_down.load(Ordering::Relaxed) {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        let body = prost::bytes::Bytes::from(encode_request(&self.resource, &batch));
        drop(batch);
        let start = Instant::now();
        let mut retries = 0;
        let mut delay = INITIAL_DELAY;
        let mut cap = MAX_DELAY;
        loop {
            let status = match self.attempt(&body).await {
                Ok(()) => return Ok(()),
                Err(s) => s,
            };
            let wait = match classify(&status) {
                Retry::No => None,
                Retry::After(server) if retries < MAX_RETRIES => {
                    let server = server.min(MAX_THROTTLE);
                    if server > cap {
                        cap = MAX_THROTTLE;
                    }
                    delay = delay.max(server);
                    Some(delay)
                }
                Retry::Backoff if retries < MAX_RETRIES => Some(delay),
                _ => None,
            };
            let wait = wait.map(|d| (d + jitter()).min(cap));
            match wait {
                Some(w) if w < self.timeout.saturating_sub(start.elapsed()) => {
                    retries += 1;
                    sleep(w).await;
                    delay = (delay * 2).min(cap);
                }
                _ => return Err(failed(&status)),
            }
        }
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        if self.shut_down.swap(true, Ordering::Relaxed) {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = encode_resource(resource);
    }
}

/// TLS for an `https://` collector, trusting the webpki roots (tonic's
/// default TLS config trusts none: every handshake would fail).
pub fn collector_tls(endpoint: &str) -> Option<ClientTlsConfig> {
    endpoint
        .starts_with("https://")
        .then(|| ClientTlsConfig::new().with_enabled_roots())
}

enum Retry {
    No,
    Backoff,
    After(Duration),
}

/// The OTLP specification's retryable gRPC codes.
fn classify(status: &Status) -> Retry {
    let hint = status
        .get_details_retry_info()
        .and_then(|r| r.retry_delay)
        .filter(|d| !d.is_zero());
    match status.code() {
        Code::ResourceExhausted => hint.map_or(Retry::No, Retry::After),
        Code::Unavailable => hint.map_or(Retry::Backoff, Retry::After),
        Code::Cancelled
        | Code::DeadlineExceeded
        | Code::Aborted
        | Code::OutOfRange
        | Code::DataLoss => Retry::Backoff,
        _ => Retry::No,
    }
}

/// The SDK logs this at error level: the code, and for a failure tonic made
/// itself (connect, TLS, DNS) its cause; never the collector's message.
fn failed(status: &Status) -> OTelSdkError {
    // The collector's message may echo credentials: its size only.
    tracing::debug!(target: "hookwire::telemetry::export", code = ?status.code(), message_bytes = status.message().len(), "OTLP export failed");
    let mut text = format!("OTLP export failed with gRPC code {:?}", status.code());
    let mut source = std::error::Error::source(status);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    OTelSdkError::InternalFailure(text)
}

/// Up to [`MAX_JITTER_MS`], from the clock's nanoseconds: enough to keep
/// replicas that failed together from retrying in step.
fn jitter() -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    Duration::from_millis(u64::from(nanos) % (MAX_JITTER_MS + 1))
}

/// The batch processor exports from its own thread, outside any runtime.
async fn sleep(d: Duration) {
    if tokio::runtime::Handle::try_current().is_ok() {
        tokio::time::sleep(d).await;
    } else {
        std::thread::sleep(d);
    }
}

/// `ExportTraceServiceResponse`: only the partial success is read.
#[derive(Clone, PartialEq, prost::Message)]
struct ExportResponse {
    #[prost(message, optional, tag = "1")]
    partial_success: Option<PartialSuccess>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PartialSuccess {
    #[prost(int64, tag = "1")]
    rejected_spans: i64,
    #[prost(string, tag = "2")]
    error_message: String,
}

/// Sends the request bytes as they are; decodes the response with prost.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = prost::bytes::Bytes;
    type Decode = ExportResponse;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = prost::bytes::Bytes;
    type Error = Status;

    fn encode(&mut self, item: prost::bytes::Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = ExportResponse;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<ExportResponse>, Status> {
        prost::Message::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(format!("bad ExportTraceServiceResponse: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
        TraceService, TraceServiceServer,
    };
    use opentelemetry_proto::tonic::collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
    };
    use tokio_stream::wrappers::TcpListenerStream;

    use super::*;

    /// A collector answering each export with the next scripted status (OK
    /// once the script is used up), recording what it was sent.
    #[derive(Clone, Default)]
    struct Scripted {
        answers: Arc<Mutex<VecDeque<Status>>>,
        seen: Arc<Mutex<Vec<(MetadataMap, ExportTraceServiceRequest)>>>,
    }

    #[tonic::async_trait]
    impl TraceService for Scripted {
        async fn export(
            &self,
            req: tonic::Request<ExportTraceServiceRequest>,
        ) -> Result<tonic::Response<ExportTraceServiceResponse>, Status> {
            let (metadata, _, body) = req.into_parts();
            self.seen.lock().unwrap().push((metadata, body));
            match self.answers.lock().unwrap().pop_front() {
                Some(status) => Err(status),
                None => Ok(tonic::Response::new(ExportTraceServiceResponse::default())),
            }
        }
    }

    async fn collector(answers: Vec<Status>) -> (Scripted, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = Scripted {
            answers: Arc::new(Mutex::new(answers.into())),
            ..Default::default()
        };
        let server =
            tonic::transport::Server::builder().add_service(TraceServiceServer::new(svc.clone()));
        tokio::spawn(server.serve_with_incoming(TcpListenerStream::new(listener)));
        (svc, format!("http://{addr}"))
    }

    fn exporter(endpoint: String, headers: &[(&str, &str)]) -> OtlpExporter {
        let mut e = OtlpExporter::new(&ExportSettings {
            endpoint,
            timeout: Duration::from_secs(10),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        })
        .unwrap();
        e.set_resource(&Resource::builder_empty().with_service_name("svc").build());
        e
    }

    fn one_span() -> Vec<SpanData> {
        use opentelemetry::trace::{
            SpanContext, SpanId, SpanKind, TraceFlags, TraceId, TraceState,
        };
        vec![SpanData {
            span_context: SpanContext::new(
                TraceId::from(1),
                SpanId::from(2),
                TraceFlags::SAMPLED,
                false,
                TraceState::default(),
            ),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: "invoke_agent demo".into(),
            start_time: std::time::SystemTime::now(),
            end_time: std::time::SystemTime::now(),
            attributes: vec![opentelemetry::KeyValue::new("gen_ai.agent.name", "demo")],
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: opentelemetry::trace::Status::Unset,
            instrumentation_scope: opentelemetry::InstrumentationScope::builder("hookwire").build(),
        }]
    }

    #[tokio::test]
    async fn spans_arrive_with_the_resource_the_headers_and_hookwires_user_agent() {
        let (svc, endpoint) = collector(vec![]).await;
        let e = exporter(
            endpoint,
            &[("Authorization", "Bearer abc"), ("x-tenant", "t1")],
        );
        e.export(one_span()).await.unwrap();
        let seen = svc.seen.lock().unwrap();
        let (md, req) = &seen[0];
        assert_eq!(md.get("authorization").unwrap(), "Bearer abc");
        assert_eq!(md.get("x-tenant").unwrap(), "t1");
        let ua = md.get("user-agent").unwrap().to_str().unwrap();
        assert!(
            ua.starts_with(concat!("hookwire/", env!("CARGO_PKG_VERSION"))),
            "{ua}"
        );
        let rs = &req.resource_spans[0];
        let resource = rs.resource.as_ref().unwrap();
        assert_eq!(resource.attributes[0].key, "service.name");
        assert_eq!(rs.scope_spans[0].spans[0].name, "invoke_agent demo");
    }

    #[tokio::test]
    async fn a_retryable_failure_is_retried_and_the_spans_arrive() {
        let (svc, endpoint) = collector(vec![
            Status::unavailable("collector restarting"),
            Status::aborted("try again"),
        ])
        .await;
        exporter(endpoint, &[]).export(one_span()).await.unwrap();
        assert_eq!(svc.seen.lock().unwrap().len(), 3);
    }

    #[tokio::test]
    async fn a_rejected_export_fails_at_once_naming_the_code_but_not_the_message() {
        let (svc, endpoint) = collector(vec![Status::unauthenticated(
            "bad token: Bearer s3cret-token",
        )])
        .await;
        let err = exporter(endpoint, &[])
            .export(one_span())
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("Unauthenticated"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        assert_eq!(svc.seen.lock().unwrap().len(), 1, "not retried");
    }

    #[tokio::test]
    async fn retries_stop_within_the_timeout() {
        let (svc, endpoint) =
            collector((0..10).map(|_| Status::unavailable("down")).collect()).await;
        let mut e = exporter(endpoint, &[]);
        // 100 ms, then 200 ms (+ jitter) would pass 250 ms: two attempts.
        e.timeout = Duration::from_millis(250);
        let err = e.export(one_span()).await.unwrap_err();
        assert!(err.to_string().contains("Unavailable"), "{err}");
        assert_eq!(svc.seen.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn an_exporter_shut_down_exports_nothing() {
        let (svc, endpoint) = collector(vec![]).await;
        let e = exporter(endpoint, &[]);
        e.shutdown().unwrap();
        assert!(e.export(one_span()).await.is_err());
        assert!(e.shutdown().is_err());
        assert!(svc.seen.lock().unwrap().is_empty());
    }

    #[test]
    fn a_header_that_is_not_metadata_is_a_setup_error_naming_its_position() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let _g = rt.enter();
        let err = OtlpExporter::new(&ExportSettings {
            endpoint: "http://127.0.0.1:4317".into(),
            timeout: DEFAULT_TIMEOUT,
            headers: vec![
                ("x-ok".into(), "v".into()),
                ("Bearer s3cret".into(), "v".into()),
            ],
        })
        .unwrap_err();
        assert!(err.to_string().contains("export header 2 "), "{err}");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }
}
