//! Per-deployment endpoint overrides from the environment.
//!
//! One config file (a ConfigMap) serves several clusters; what differs
//! between them is where hook servers and model APIs live. Rather than
//! templating the file, a deployment sets
//! `HOOKWIRE_HOOK_<NAME>_ENDPOINT` or `HOOKWIRE_MODEL_<NAME>_BASE_URL`, where
//! `<NAME>` is the configured name upper-cased with every character outside
//! `A-Z0-9` turned into `_` (`py-guard` → `HOOKWIRE_HOOK_PY_GUARD_ENDPOINT`).
//! An override goes through the same validation as the file's value; a
//! variable that names nothing configured is an error, so a typo cannot
//! silently leave the file's endpoint in place.

use std::collections::BTreeMap;

use super::{Config, ProviderKind};
use crate::event::nearest;

const HOOK_PREFIX: &str = "HOOKWIRE_HOOK_";
const HOOK_SUFFIX: &str = "_ENDPOINT";
const MODEL_PREFIX: &str = "HOOKWIRE_MODEL_";
const MODEL_SUFFIX: &str = "_BASE_URL";

/// The variable that overrides hook `name`'s endpoint.
fn hook_endpoint_var(name: &str) -> String {
    format!("{HOOK_PREFIX}{}{HOOK_SUFFIX}", env_name(name))
}

/// The variable that overrides model `name`'s base URL.
fn model_base_url_var(name: &str) -> String {
    format!("{MODEL_PREFIX}{}{MODEL_SUFFIX}", env_name(name))
}

fn env_name(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// Where each applied override went: config path → variable.
pub(super) type Applied = BTreeMap<String, String>;

/// An override that cannot be applied: the variable and what is wrong.
pub(super) struct Rejected {
    pub var: String,
    pub message: String,
}

/// Applies every `HOOKWIRE_HOOK_*_ENDPOINT` / `HOOKWIRE_MODEL_*_BASE_URL`
/// among `vars` to `config`.
pub(super) fn apply(
    config: &mut Config,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<Applied, Rejected> {
    let hooks: Vec<(String, usize)> = config
        .hooks
        .iter()
        .enumerate()
        .map(|(i, h)| (hook_endpoint_var(&h.name), i))
        .collect();
    let models: Vec<(String, usize)> = config
        .models
        .iter()
        .enumerate()
        .map(|(i, m)| (model_base_url_var(&m.name), i))
        .collect();
    let mut applied = Applied::new();
    // Sorted, so the first error reported does not depend on env order.
    let vars: BTreeMap<String, String> = vars.into_iter().collect();
    for (var, value) in vars {
        if var.starts_with(HOOK_PREFIX) && var.ends_with(HOOK_SUFFIX) {
            let i = target(&var, &hooks, "hook")?;
            config.hooks[i].endpoint = value;
            applied.insert(format!("hooks[{i}].endpoint"), var);
        } else if var.starts_with(MODEL_PREFIX) && var.ends_with(MODEL_SUFFIX) {
            let i = target(&var, &models, "model")?;
            if config.models[i].provider != ProviderKind::Openai {
                return Err(Rejected {
                    message: format!(
                        "model `{}` is not provider: openai and has no base_url to override; unset it",
                        config.models[i].name
                    ),
                    var,
                });
            }
            config.models[i].base_url = Some(value);
            applied.insert(format!("models[{i}].base_url"), var);
        }
    }
    Ok(applied)
}

fn target(var: &str, known: &[(String, usize)], what: &str) -> Result<usize, Rejected> {
    let mut matches = known.iter().filter(|(v, _)| v == var).map(|(_, i)| *i);
    match (matches.next(), matches.next()) {
        (Some(i), None) => return Ok(i),
        // Two names that map to one variable (`a-b`, `a_b`) cannot be told apart.
        (Some(i), Some(j)) => {
            return Err(Rejected {
                var: var.to_string(),
                message: format!("matches both {what}s[{i}] and {what}s[{j}]; rename one of them"),
            })
        }
        _ => {}
    }
    let hint = match nearest(var, known.iter().map(|(v, _)| v.as_str())) {
        Some(n) => format!("; did you mean {n}?"),
        None if known.is_empty() => format!("; no {what}s are configured"),
        None => format!(
            "; the {what}s' variables are {}",
            known
                .iter()
                .map(|(v, _)| v.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    Err(Rejected {
        var: var.to_string(),
        message: format!("names no configured {what}{hint}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_upper_snake_case() {
        assert_eq!(
            hook_endpoint_var("py-guard"),
            "HOOKWIRE_HOOK_PY_GUARD_ENDPOINT"
        );
        assert_eq!(
            model_base_url_var("gpt.4o"),
            "HOOKWIRE_MODEL_GPT_4O_BASE_URL"
        );
    }
}
