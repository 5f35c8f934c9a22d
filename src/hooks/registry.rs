//! All configured hook servers, shared by every session and run.

use crate::lock::LockExt;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::hooks::client::HookClient;
use crate::message::ToolSpec;

pub struct HookRegistry {
    clients: Vec<Arc<HookClient>>,
    by_name: HashMap<String, Arc<HookClient>>,
    cancel: CancellationToken,
    /// Compiled argument schemas by schema text (None: the schema itself is
    /// unusable, so arguments are only checked to be a JSON object).
    schemas: Mutex<SchemaCache>,
}

/// Compiled schemas, at most [`MAX_CACHED_SCHEMAS`]: hook servers that
/// change their tools' schemas on every Describe must not grow it without
/// end. The oldest entry goes first; an evicted schema is compiled again if
/// it is still in use.
#[derive(Default)]
struct SchemaCache {
    by_text: HashMap<String, Option<Arc<jsonschema::Validator>>>,
    order: VecDeque<String>,
}

/// Far more than the tools of any configuration.
pub const MAX_CACHED_SCHEMAS: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{0}")]
    Endpoint(String),
    #[error("tool `{tool}` is owned by two hook servers: `{first}` and `{second}`; rename one or drop it from one server")]
    DuplicateTool {
        tool: String,
        first: String,
        second: String,
    },
}

impl HookRegistry {
    pub fn new(config: &Config) -> Result<HookRegistry, RegistryError> {
        let mut clients = Vec::new();
        let mut by_name = HashMap::new();
        for (i, h) in config.hooks.iter().enumerate() {
            let c = HookClient::new(i, h.clone(), config.server.reload_interval)
                .map_err(RegistryError::Endpoint)?;
            by_name.insert(h.name.clone(), c.clone());
            clients.push(c);
        }
        Ok(HookRegistry {
            clients,
            by_name,
            cancel: CancellationToken::new(),
            schemas: Mutex::new(SchemaCache::default()),
        })
    }

    /// Starts the Describe loops (start-up and reconnects).
    pub fn start(&self) {
        for c in &self.clients {
            tokio::spawn(c.clone().maintain(self.cancel.clone()));
        }
    }

    /// Describes every hook once now, waiting at most `timeout` each.
    pub async fn describe_all(&self, timeout: std::time::Duration) {
        let futs = self.clients.iter().map(|c| c.describe(timeout));
        let _ = futures::future::join_all(futs).await;
    }

    pub fn stop(&self) {
        self.cancel.cancel();
    }

    pub fn get(&self, name: &str) -> Option<&Arc<HookClient>> {
        self.by_name.get(name)
    }

    pub fn all(&self) -> &[Arc<HookClient>] {
        &self.clients
    }

    /// The hook that owns `tool`, with the tool's declaration.
    pub fn tool_owner(&self, tool: &str) -> Option<(Arc<HookClient>, ToolSpec)> {
        self.clients.iter().find_map(|c| {
            c.description()
                .and_then(|d| d.tools.into_iter().find(|t| t.name == tool))
                .map(|t| (c.clone(), t))
        })
    }

    /// The compiled validator of a tool's argument schema, compiled once.
    pub fn validator(&self, spec: &ToolSpec) -> Option<Arc<jsonschema::Validator>> {
        if spec.parameters_json_schema.trim().is_empty() {
            return None;
        }
        let mut cache = self.schemas.locked();
        if let Some(v) = cache.by_text.get(&spec.parameters_json_schema) {
            return v.clone();
        }
        let compiled = match compile_schema(&spec.parameters_json_schema) {
            Ok(v) => Some(Arc::new(v)),
            Err(e) => {
                tracing::warn!(tool = %spec.name, error = %e, "tool declares an unusable argument schema; only checking for a JSON object");
                None
            }
        };
        while cache.order.len() >= MAX_CACHED_SCHEMAS {
            if let Some(old) = cache.order.pop_front() {
                cache.by_text.remove(&old);
            }
        }
        cache.order.push_back(spec.parameters_json_schema.clone());
        cache
            .by_text
            .insert(spec.parameters_json_schema.clone(), compiled.clone());
        compiled
    }

    /// Compiled schemas held (for tests and diagnostics).
    pub fn cached_schemas(&self) -> usize {
        self.schemas.locked().by_text.len()
    }

    /// A tool declared by two servers is ambiguous: refuse rather than guess.
    pub fn check_tool_ownership(&self) -> Result<(), RegistryError> {
        let mut owners: HashMap<String, String> = HashMap::new();
        for c in &self.clients {
            for t in c.description().map(|d| d.tools).unwrap_or_default() {
                if let Some(first) = owners.insert(t.name.clone(), c.name().to_string()) {
                    return Err(RegistryError::DuplicateTool {
                        tool: t.name,
                        first,
                        second: c.name().to_string(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// Compiles a tool's argument schema (JSON text). Fails when the text is not
/// JSON or not a valid JSON Schema (checked against its meta-schema).
pub fn compile_schema(text: &str) -> Result<jsonschema::Validator, String> {
    let value = serde_json::from_str::<serde_json::Value>(text)
        .map_err(|e| format!("not valid JSON: {e}"))?;
    jsonschema::validator_for(&value).map_err(|e| format!("not a valid JSON Schema: {e}"))
}

impl Drop for HookRegistry {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_cache_is_bounded() {
        let cfg = crate::config::Config::parse(
            "agents: [{name: a, model: m}]\nmodels: [{name: m, provider: scripted}]\n",
            "test",
        )
        .unwrap();
        let r = HookRegistry::new(&cfg).unwrap();
        let spec = |i: usize| ToolSpec {
            name: "t".into(),
            description: String::new(),
            parameters_json_schema: format!(
                r#"{{"type":"object","properties":{{"p{i}":{{"type":"integer"}}}},"required":["p{i}"]}}"#
            ),
        };
        for i in 0..MAX_CACHED_SCHEMAS * 3 {
            assert!(r.validator(&spec(i)).is_some());
        }
        assert_eq!(r.cached_schemas(), MAX_CACHED_SCHEMAS);
        // An evicted schema still validates (compiled again).
        let v = r.validator(&spec(0)).unwrap();
        assert!(v.is_valid(&serde_json::json!({"p0": 1})));
        assert!(!v.is_valid(&serde_json::json!({"p0": "x"})));
        assert_eq!(r.cached_schemas(), MAX_CACHED_SCHEMAS);
    }
}
