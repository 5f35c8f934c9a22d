//! What `serve` checks before it answers anyone, in one place, so
//! `hookwire config check` checks exactly the same: every model is built
//! (URLs, headers, API key variables), every hook endpoint parsed, and the
//! hook servers that answer `Describe` within the start-up wait are asked
//! for their tools, which must not be owned twice.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::auth::Authenticator;
use crate::config::Config;
use crate::engine::Engine;
use crate::model::ModelProvider;
use crate::server::{build_models, ServeError};
use crate::telemetry::Instruments;
use crate::tls::ServerTlsConfig;

/// How long start-up waits for hook servers to answer Describe before the
/// service reports SERVING; unreachable hooks keep being retried after.
pub const STARTUP_DESCRIBE: Duration = Duration::from_secs(3);

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
) -> Result<Arc<Engine>, ServeError> {
    engine_with_models(config, build_models(config)?, inst, describe).await
}

/// [`engine`] with the model providers given rather than built from
/// `config.models` (see `serve_with_models`).
pub async fn engine_with_models(
    config: &Config,
    models: HashMap<String, Arc<dyn ModelProvider>>,
    inst: Instruments,
    describe: Option<Duration>,
) -> Result<Arc<Engine>, ServeError> {
    let engine = Arc::new(Engine::new(config.clone(), models, inst)?);
    if let Some(wait) = describe {
        engine.registry().describe_all(wait).await;
        engine.registry().check_tool_ownership()?;
    }
    Ok(engine)
}
