//! Call credentials for hook servers: a bearer token sent as
//! `authorization: Bearer …` metadata on every call (Describe, Process,
//! CallTool), from a file re-read when it changes (projected service
//! account tokens and Secrets rotate) or from an environment variable read
//! at start-up. The metadata value is marked sensitive so HTTP/2 tracing
//! never prints it.

use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;

use crate::config::HookCredentials;
use crate::tls::Reloading;

enum Source {
    Static(MetadataValue<Ascii>),
    File(Reloading<MetadataValue<Ascii>>),
}

/// The interceptor every hook client goes through; empty when the hook has
/// no credentials.
#[derive(Clone, Default)]
pub struct Credentials {
    source: Option<Arc<Source>>,
}

fn header(token: &str) -> Result<MetadataValue<Ascii>, String> {
    let token = token.trim();
    if token.is_empty() {
        return Err("the token is empty".into());
    }
    let mut v: MetadataValue<Ascii> = format!("Bearer {token}")
        .parse()
        .map_err(|_| "the token has characters not allowed in a header".to_string())?;
    v.set_sensitive(true);
    Ok(v)
}

impl Credentials {
    /// `owner` names the hook in errors (`hooks[0] (py-guard)`).
    pub fn new(
        owner: &str,
        c: &HookCredentials,
        reload_interval: Duration,
    ) -> Result<Credentials, String> {
        Credentials::with_env(owner, c, reload_interval, |k| std::env::var(k).ok())
    }

    pub fn with_env(
        owner: &str,
        c: &HookCredentials,
        reload_interval: Duration,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Credentials, String> {
        let source = match (&c.bearer_token_file, &c.bearer_token_env) {
            (Some(f), _) => Some(Source::File(
                Reloading::new(
                    "hook_token",
                    format!("{owner} credentials.bearer_token_file"),
                    vec![f.clone()],
                    reload_interval,
                    |b| header(&String::from_utf8_lossy(&b[0])),
                )
                .map_err(|e| e.to_string())?,
            )),
            (None, Some(var)) => {
                let name = crate::config::secret_env::shown(var);
                let token = env(var).ok_or_else(|| {
                    format!("{owner} credentials.bearer_token_env: environment variable {name} is not set")
                })?;
                Some(Source::Static(header(&token).map_err(|e| {
                    format!("{owner} credentials.bearer_token_env: {name}: {e}")
                })?))
            }
            (None, None) => None,
        };
        Ok(Credentials {
            source: source.map(Arc::new),
        })
    }

    /// A fixed token (the `hooks check` command line).
    pub fn bearer(token: &str) -> Result<Credentials, String> {
        Ok(Credentials {
            source: Some(Arc::new(Source::Static(header(token)?))),
        })
    }

    pub fn is_set(&self) -> bool {
        self.source.is_some()
    }

    fn current(&self) -> Option<MetadataValue<Ascii>> {
        match self.source.as_deref()? {
            Source::Static(v) => Some(v.clone()),
            Source::File(r) => Some((*r.current()).clone()),
        }
    }
}

impl Interceptor for Credentials {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = self.current() {
            req.metadata_mut().insert("authorization", v);
        }
        Ok(req)
    }
}
