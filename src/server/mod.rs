//! The gRPC server: AgentService, grpc.health.v1 and reflection on one
//! listener, plus graceful drain on shutdown.

mod caller_deadline;
mod convert;
mod grpc;
mod limits;
pub mod preflight;
mod request;
mod status;

pub use status::unauthenticated;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::net::TcpListener;
use tonic::transport::Server;

use crate::auth::layer::AuthLayer;
use crate::config::{Config, StoreSetting};
use crate::cork::Corked;
use crate::engine::EngineSetupError;
use crate::hooks::registry::RegistryError;
use crate::model::{ModelProvider, ModelSetupError};
use crate::pb;
use crate::pb::agent_service_server::AgentServiceServer;
use crate::telemetry::{self, Instruments};
use crate::tls::tls_incoming;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Model(#[from] ModelSetupError),
    #[error(transparent)]
    Setup(#[from] EngineSetupError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("reflection setup: {0}")]
    Reflection(String),
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("store `{setting}`: {source}")]
    Store {
        setting: String,
        #[source]
        source: crate::store::StoreError,
    },
    #[error(transparent)]
    Auth(#[from] crate::auth::AuthSetupError),
    #[error("{0}")]
    Tls(#[from] crate::tls::ReloadError),
    #[error("cannot read the listener's address: {0}")]
    Listener(std::io::Error),
}

/// Builds every configured model.
pub fn build_models(
    config: &Config,
) -> Result<HashMap<String, Arc<dyn ModelProvider>>, ServeError> {
    let mut out: HashMap<String, Arc<dyn ModelProvider>> = HashMap::new();
    for m in &config.models {
        out.insert(m.name.clone(), crate::model::build(m)?);
    }
    Ok(out)
}

/// How long connections may stay open once runs drained at shutdown.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Runs the service on `listener` until `shutdown` resolves, then drains:
/// health goes NOT_SERVING, new runs are refused with UNAVAILABLE, in-flight
/// runs get `server.shutdown_grace` to finish before they are cancelled.
pub async fn serve(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_with_admin(listener, None, config, shutdown).await
}

/// [`serve`], plus the admin HTTP port (`/metrics`, `/healthz`, `/readyz`)
/// on `admin` when given.
pub async fn serve_with_admin(
    listener: TcpListener,
    admin: Option<TcpListener>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let models = build_models(&config)?;
    serve_with_models(listener, admin, config, models, shutdown).await
}

/// [`serve_with_admin`] with the model providers given rather than built
/// from `config.models` (one per configured model name): the seam for tests
/// and embedders that bring a provider of their own.
pub async fn serve_with_models(
    listener: TcpListener,
    admin: Option<TcpListener>,
    config: Config,
    models: HashMap<String, Arc<dyn ModelProvider>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let inst = Instruments::new(&config.telemetry);
    let local = listener.local_addr().map_err(ServeError::Listener)?;
    let (auth, tls) = preflight::security(&config, local)?;
    let auth = Arc::new(auth);
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (admin_stop_tx, admin_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let admin_task = admin.map(|l| {
        let (metrics, ready) = (inst.metrics.clone(), ready.clone());
        tokio::spawn(telemetry::serve_admin(l, metrics, ready, async {
            let _ = admin_stop_rx.await;
        }))
    });
    let engine = preflight::engine_with_models(
        &config,
        models,
        inst,
        Some(preflight::STARTUP_DESCRIBE),
        preflight::StoreUse::Open,
    )
    .await?;
    engine.start_background();
    engine.registry().start();

    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<AgentServiceServer<grpc::AgentApi>>()
        .await;
    reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;

    let grace = config.server.shutdown_grace;
    let drain_engine = engine.clone();
    let drain_ready = ready.clone();
    // With a shared store, clients are told to move (HTTP/2 GOAWAY, and
    // the listener closes) as the drain begins: their runs in flight go
    // on, and everything else (new runs, approvals, cancels) is served by
    // the other replicas. A client with a long-lived channel otherwise
    // stayed here, refused UNAVAILABLE until the drain was over. Alone on
    // its store, a replica keeps its connections to the end of the drain:
    // an approval for a run it holds can only be answered here.
    let move_early = config.store.as_ref().is_some_and(StoreSetting::is_shared);
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let (go_away_tx, go_away_rx) = tokio::sync::oneshot::channel::<()>();
    let draining = tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutdown requested; draining");
        drain_ready.store(false, std::sync::atomic::Ordering::SeqCst);
        reporter
            .set_not_serving::<AgentServiceServer<grpc::AgentApi>>()
            .await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        drain_engine.stop_accepting();
        let mut go_away = Some(go_away_tx);
        if move_early {
            if let Some(tx) = go_away.take() {
                let _ = tx.send(());
            }
        }
        drain_engine.drain(grace).await;
        tracing::info!("drained");
        let _ = drained_tx.send(());
        // Dropped unsent here (alone on the store): the connections are
        // told to go now.
        drop(go_away);
    });
    // Either sent or dropped.
    let signal = async move {
        let _ = go_away_rx.await;
    };

    tracing::info!(
        agents = config.agents.len(),
        hooks = config.hooks.len(),
        auth = ?auth.mode(),
        tls = tls.is_some(),
        "hookwire serving"
    );
    // Ready only now: config loaded, hooks described, listeners bound.
    ready.store(true, std::sync::atomic::Ordering::SeqCst);
    let router = Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .layer(AuthLayer::new(auth))
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(limits::CheckedRequests::new(
            AgentServiceServer::new(grpc::AgentApi {
                engine: engine.clone(),
            })
            .max_decoding_message_size(limits::decode_limit(config.server.max_input_bytes)),
            config.server.max_input_bytes,
        ));
    let server: Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> =
        match tls {
            Some(tls) => {
                // Corked, with a preface deadline, as the plain ones are
                // (`accept::plain`).
                let incoming = tls_incoming(listener, tls)
                    .map(|s| s.map(|s| Corked::new(crate::accept::Preface::new(s))));
                Box::pin(router.serve_with_incoming_shutdown(incoming, signal))
            }
            None => {
                let incoming = crate::accept::plain(listener);
                Box::pin(router.serve_with_incoming_shutdown(incoming, signal))
            }
        };
    // After the drain, tonic still waits for every open stream to end, and
    // some never do (a health Watch, an idle client's stream): give the last
    // responses a moment to flush, then close what is left.
    let lingered = async {
        if drained_rx.await.is_ok() {
            tokio::time::sleep(CLOSE_LINGER).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let served = tokio::select! {
        served = server => served,
        () = lingered => {
            tracing::info!("closing connections still open after the drain");
            Ok(())
        }
    };
    // With a shared store the connections may all have closed before the
    // last run ended: the drain (bounded by the grace) finishes first. A
    // server that failed outright was never asked to shut down: nothing
    // to wait for.
    if served.is_err() {
        draining.abort();
    }
    if let Err(e) = draining.await {
        if e.is_panic() {
            tracing::warn!("the drain panicked; closing anyway");
        }
    }
    let _ = admin_stop_tx.send(());
    if let Some(t) = admin_task {
        let _ = t.await;
    }
    // Outcomes were recorded during the drain; close connections last.
    engine.stop_background().await;
    engine.store().close().await;
    served?;
    Ok(())
}

/// Reflection lists only the services this server answers; the contract's
/// other types (HookService, which hook servers implement) stay resolvable
/// by symbol, so `grpcurl describe hookwire.v1.HookService` still works.
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("hookwire.v1.AgentService")
        .with_service_name("grpc.health.v1.Health")
}
