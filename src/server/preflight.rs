//! What `serve` checks before it answers anyone, in one place, so
//! `hookwire config check` checks exactly the same: every model is built
//! (URLs, headers, API key variables), every hook endpoint parsed, the store
//! setting checked (a Postgres URL the driver accepts, its password
//! variable set, a SQLite path that can hold the file), and the hook
//! servers that answer `Describe` within the start-up wait are asked for
//! their tools, which must not be owned twice. Only `serve` then opens the
//! store (connects, migrates): `config check` never touches a database.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::auth::Authenticator;
use crate::config::{Config, StoreSetting};
use crate::engine::Engine;
use crate::model::ModelProvider;
use crate::server::{build_models, ServeError};
use crate::store::{MemoryStore, SessionStore, StoreOptions};
use crate::telemetry::Instruments;
use crate::tls::ServerTlsConfig;

/// How long start-up waits for hook servers to answer Describe before the
/// service reports SERVING; unreachable hooks keep being retried after.
pub const STARTUP_DESCRIBE: Duration = Duration::from_secs(3);

/// What to do with the configured store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreUse {
    /// Open it (create, migrate, connect): `serve`.
    Open,
    /// Check the setting without touching the database; the engine gets a
    /// memory store it never serves from: `config check`.
    CheckOnly,
}

/// The store a config names; the library's [`crate::server::serve`]
/// defaults to memory (the binary resolves the SQLite default first).
pub fn store_setting(config: &Config) -> StoreSetting {
    config.store.clone().unwrap_or(StoreSetting::Memory)
}

/// Caller authentication and the port's TLS, as `serve` sets them up on
/// `listening`: reads the tokens, JWKS and certificate files, and refuses
/// `auth.mode: none` off loopback. First of the checks: a server that cannot
/// authenticate callers (or would be open on the network) must not start.
pub fn security(
    config: &Config,
    listening: std::net::SocketAddr,
) -> Result<(Authenticator, Option<ServerTlsConfig>), ServeError> {
    let auth = Authenticator::new(config, listening)?;
    let tls = match &config.tls {
        Some(t) => Some(ServerTlsConfig::new(t, config.server.reload_interval)?),
        None => None,
    };
    Ok((auth, tls))
}

/// `config` without the files its security settings name (for checking a
/// file away from where it runs: certificates and tokens live in the pod).
/// TLS to hooks falls back to the webpki roots, credentials to none.
pub fn without_files(config: &Config) -> Config {
    let mut c = config.clone();
    c.tls = None;
    c.auth = Default::default();
    for h in &mut c.hooks {
        h.tls = Default::default();
        h.credentials = Default::default();
    }
    c
}

/// The engine `serve` runs, after every start-up check. `describe`: how
/// long to wait for hook servers (`None` skips contacting them, and with it
/// the tool ownership check).
pub async fn engine(
    config: &Config,
    inst: Instruments,
    describe: Option<Duration>,
    store: StoreUse,
) -> Result<Arc<Engine>, ServeError> {
    engine_with_models(config, build_models(config)?, inst, describe, store).await
}

/// [`engine`] with the model providers given rather than built from
/// `config.models` (see `serve_with_models`).
pub async fn engine_with_models(
    config: &Config,
    models: HashMap<String, Arc<dyn ModelProvider>>,
    inst: Instruments,
    describe: Option<Duration>,
    store: StoreUse,
) -> Result<Arc<Engine>, ServeError> {
    let setting = store_setting(config);
    let store_error = |source| ServeError::Store {
        setting: setting.to_string(),
        source,
    };
    crate::store::check(&setting).map_err(store_error)?;
    let options = StoreOptions {
        lease: config.server.run_lease,
        max_transcript_bytes: config.server.max_transcript_bytes,
    };
    let store: Arc<dyn SessionStore> = match store {
        StoreUse::Open => {
            let s = crate::store::open(&setting, options)
                .await
                .map_err(store_error)?;
            tracing::info!(store = %setting, "session store open");
            s
        }
        StoreUse::CheckOnly => Arc::new(MemoryStore::new(options)),
    };
    let engine = Arc::new(Engine::new(config.clone(), models, inst, store)?);
    if let Some(wait) = describe {
        engine.registry().describe_all(wait).await;
        engine.registry().check_tool_ownership()?;
    }
    Ok(engine)
}
