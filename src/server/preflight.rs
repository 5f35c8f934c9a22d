//! What `serve` checks before it answers anyone, in one place, so
//! `hookwire config check` checks exactly the same: every model is built
//! (URLs, headers, API key variables), every hook endpoint parsed, the store
//! setting checked (a Postgres URL the driver accepts, its password
//! variable set, a SQLite path that can hold the file), and the hook
//! servers that answer `Describe` within the start-up wait are asked for
//! their tools, which must not be owned twice. Only `serve` then opens the
//! store (connects, migrates): `config check` never touches a database.

use std::sync::Arc;
use std::time::Duration;

use crate::config::{Config, StoreSetting};
use crate::engine::Engine;
use crate::server::{build_models, ServeError};
use crate::store::{MemoryStore, SessionStore, StoreOptions};
use crate::telemetry::Instruments;

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

/// The engine `serve` runs, after every start-up check. `describe`: how
/// long to wait for hook servers (`None` skips contacting them, and with it
/// the tool ownership check).
pub async fn engine(
    config: &Config,
    inst: Instruments,
    describe: Option<Duration>,
    store: StoreUse,
) -> Result<Arc<Engine>, ServeError> {
    let models = build_models(config)?;
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
