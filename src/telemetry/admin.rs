//! The admin HTTP port: `/metrics`, `/healthz`, `/readyz`.
//!
//! Plain HTTP/1 on its own listener, so scrapes and kubelet probes never
//! queue behind agent traffic on the gRPC port.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use super::metrics::Metrics;

/// Prometheus' classic text format. The body is OpenMetrics text, which
/// Prometheus parses under this type too; clients that ask for OpenMetrics
/// get it labelled as such.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone)]
struct AdminState {
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
}

/// Serves the admin endpoints on `listener` until `shutdown` resolves.
/// `/readyz` answers 200 while `ready` is true and 503 otherwise (flip it off
/// at the start of a graceful shutdown so the Service stops routing here).
pub async fn serve_admin(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, ready))
        .with_graceful_shutdown(shutdown)
        .await
}

fn router(metrics: Arc<Metrics>, ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(AdminState { metrics, ready })
}

async fn metrics_handler(State(state): State<AdminState>, headers: HeaderMap) -> impl IntoResponse {
    let wants_openmetrics = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|accept| accept.contains("application/openmetrics-text"));
    let content_type = if wants_openmetrics {
        OPENMETRICS_TEXT
    } else {
        PROMETHEUS_TEXT
    };
    state.metrics.runtime_tasks(
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks(),
    );
    (
        [(header::CONTENT_TYPE, content_type)],
        state.metrics.encode(),
    )
}

async fn readyz(State(state): State<AdminState>) -> (StatusCode, &'static str) {
    if state.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}
