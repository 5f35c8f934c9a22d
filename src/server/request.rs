//! AgentService request messages to the engine's checked requests
//! (`crate::request`): every string a client sends is bounded and free of
//! NUL characters before it reaches the engine, the store or a status
//! message. The limits of the client API are all here; README ("Limits")
//! and proto/hookwire/v1/agent.proto document them.

use std::collections::{BTreeMap, HashSet};

use crate::hooks::wire::MAX_VERDICT_NAME;
use crate::pb;
use crate::request::{CreateSession, ResolveApproval, RunRef, SessionRef, StartRun};
use crate::store::SessionFilter;

/// Longest `session_id` or `run_id`. hookwire makes both (UUIDs, 36
/// bytes); the room above that is for no id hookwire made, and keeps an id
/// that a NOT_FOUND message quotes small.
pub const MAX_ID_BYTES: usize = 128;
/// Longest name: `agent`, each of `extra_hooks`, and `call_id`. A tool
/// call's id comes from the model (providers use ~30–70 bytes) or from a
/// hook, which may make ids as long as a verdict's names: this limit is
/// that one, so every call a hook asks about can be answered.
pub const MAX_NAME_BYTES: usize = MAX_VERDICT_NAME;
/// Longest `page_token`. The tokens hookwire hands out are a time and a
/// session id (under 60 bytes).
pub const MAX_PAGE_TOKEN_BYTES: usize = 256;
/// Most `metadata` entries of a session.
pub const MAX_METADATA_ENTRIES: usize = 64;
/// Longest `metadata` key.
pub const MAX_METADATA_KEY_BYTES: usize = 256;
/// Longest `metadata` value.
pub const MAX_METADATA_VALUE_BYTES: usize = 4 * 1024;
/// Most `metadata` bytes, keys plus values. Every GetSession and
/// ListSessions answer and every session_start hook call carries a
/// session's metadata: unbounded, one principal's sessions made an admin's
/// listing too large for clients to receive.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;
/// Longest ResolveApproval `note` (it goes to the model with a denial).
pub const MAX_NOTE_BYTES: usize = 4 * 1024;

/// Why a request is refused before the engine sees it. Messages never quote
/// a value over its limit or one with a NUL character.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidRequest {
    #[error("`{0}` is required")]
    Missing(&'static str),
    #[error("{what} is {size} bytes; the limit is {max} bytes")]
    TooLong {
        what: String,
        size: usize,
        max: usize,
    },
    #[error("{what} contains a NUL character, which no request string may carry")]
    Nul { what: String },
    #[error("`metadata` has {count} entries; the limit is {MAX_METADATA_ENTRIES}")]
    TooManyEntries { count: usize },
    #[error("`extra_hooks` lists `{0}` more than once")]
    DuplicateHook(String),
    #[error("`page_size` must not be negative (0 means the default, 100)")]
    NegativePageSize,
}

/// `s` as the value of `what`: at most `max` bytes, no NUL character. The
/// length is checked first, so that no message ever has to describe an
/// oversized value.
fn check(what: impl FnOnce() -> String, s: &str, max: usize) -> Result<(), InvalidRequest> {
    if s.len() > max {
        return Err(InvalidRequest::TooLong {
            what: what(),
            size: s.len(),
            max,
        });
    }
    if s.contains('\0') {
        return Err(InvalidRequest::Nul { what: what() });
    }
    Ok(())
}

fn field(name: &'static str) -> impl FnOnce() -> String {
    move || format!("`{name}`")
}

/// A field that must be set.
fn required(name: &'static str, s: String, max: usize) -> Result<String, InvalidRequest> {
    if s.is_empty() {
        return Err(InvalidRequest::Missing(name));
    }
    check(field(name), &s, max)?;
    Ok(s)
}

fn metadata(
    m: std::collections::HashMap<String, String>,
) -> Result<BTreeMap<String, String>, InvalidRequest> {
    if m.len() > MAX_METADATA_ENTRIES {
        return Err(InvalidRequest::TooManyEntries { count: m.len() });
    }
    // Sorted, so that of several bad entries the same one is named on every
    // try (a HashMap's order changes from process to process).
    let m: BTreeMap<String, String> = m.into_iter().collect();
    let mut total = 0;
    for (k, v) in &m {
        check(|| "a `metadata` key".to_string(), k, MAX_METADATA_KEY_BYTES)?;
        // The key passed its own checks, so the message may quote it.
        check(
            || format!("`metadata` value of `{k}`"),
            v,
            MAX_METADATA_VALUE_BYTES,
        )?;
        total += k.len() + v.len();
    }
    if total > MAX_METADATA_BYTES {
        return Err(InvalidRequest::TooLong {
            what: "`metadata` (keys plus values)".to_string(),
            size: total,
            max: MAX_METADATA_BYTES,
        });
    }
    Ok(m)
}

fn extra_hooks(hooks: Vec<String>) -> Result<Vec<String>, InvalidRequest> {
    // Distinct names, each configured (the engine's check): the list is
    // never longer than the configuration's hooks.
    let mut seen = HashSet::new();
    for h in &hooks {
        check(|| "an `extra_hooks` entry".to_string(), h, MAX_NAME_BYTES)?;
        if !seen.insert(h.as_str()) {
            return Err(InvalidRequest::DuplicateHook(h.clone()));
        }
    }
    Ok(hooks)
}

impl TryFrom<pb::CreateSessionRequest> for CreateSession {
    type Error = InvalidRequest;
    fn try_from(r: pb::CreateSessionRequest) -> Result<Self, Self::Error> {
        Ok(CreateSession {
            agent: required("agent", r.agent, MAX_NAME_BYTES)?,
            extra_hooks: extra_hooks(r.extra_hooks)?,
            metadata: metadata(r.metadata)?,
        })
    }
}

impl TryFrom<pb::GetSessionRequest> for SessionRef {
    type Error = InvalidRequest;
    fn try_from(r: pb::GetSessionRequest) -> Result<Self, Self::Error> {
        Ok(SessionRef {
            session_id: required("session_id", r.session_id, MAX_ID_BYTES)?,
        })
    }
}

impl TryFrom<pb::DeleteSessionRequest> for SessionRef {
    type Error = InvalidRequest;
    fn try_from(r: pb::DeleteSessionRequest) -> Result<Self, Self::Error> {
        Ok(SessionRef {
            session_id: required("session_id", r.session_id, MAX_ID_BYTES)?,
        })
    }
}

impl TryFrom<pb::ListSessionsRequest> for SessionFilter {
    type Error = InvalidRequest;
    fn try_from(r: pb::ListSessionsRequest) -> Result<Self, Self::Error> {
        let page_size = u32::try_from(r.page_size).map_err(|_| InvalidRequest::NegativePageSize)?;
        check(field("agent"), &r.agent, MAX_NAME_BYTES)?;
        check(field("page_token"), &r.page_token, MAX_PAGE_TOKEN_BYTES)?;
        Ok(SessionFilter {
            // Whose sessions the caller sees is the engine's decision.
            owner: None,
            agent: (!r.agent.is_empty()).then_some(r.agent),
            page_size,
            page_token: r.page_token,
        })
    }
}

impl TryFrom<pb::RunRequest> for StartRun {
    type Error = InvalidRequest;
    fn try_from(r: pb::RunRequest) -> Result<Self, Self::Error> {
        // `input` is content: NUL characters pass (the store keeps messages
        // as JSON, where they are escaped) and its size limit is the
        // engine's (server.max_input_bytes).
        Ok(StartRun {
            session_id: required("session_id", r.session_id, MAX_ID_BYTES)?,
            input: r.input,
        })
    }
}

impl TryFrom<pb::CancelRunRequest> for RunRef {
    type Error = InvalidRequest;
    fn try_from(r: pb::CancelRunRequest) -> Result<Self, Self::Error> {
        Ok(RunRef {
            run_id: required("run_id", r.run_id, MAX_ID_BYTES)?,
        })
    }
}

impl TryFrom<pb::ResolveApprovalRequest> for ResolveApproval {
    type Error = InvalidRequest;
    fn try_from(r: pb::ResolveApprovalRequest) -> Result<Self, Self::Error> {
        let run_id = required("run_id", r.run_id, MAX_ID_BYTES)?;
        let call_id = required("call_id", r.call_id, MAX_NAME_BYTES)?;
        check(field("note"), &r.note, MAX_NOTE_BYTES)?;
        Ok(ResolveApproval {
            run_id,
            call_id,
            approve: r.approve,
            note: r.note,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create(metadata: &[(&str, String)], extra: &[&str]) -> Result<CreateSession, String> {
        CreateSession::try_from(pb::CreateSessionRequest {
            agent: "a".into(),
            extra_hooks: extra.iter().map(|s| s.to_string()).collect(),
            metadata: metadata
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        })
        .map_err(|e| e.to_string())
    }

    #[test]
    fn metadata_is_bounded_per_entry_in_count_and_in_total() {
        let at = |n: usize| "v".repeat(n);
        assert!(create(&[("k", at(MAX_METADATA_VALUE_BYTES))], &[]).is_ok());
        let e = create(&[("env", at(MAX_METADATA_VALUE_BYTES + 1))], &[]).unwrap_err();
        assert_eq!(
            e,
            format!(
                "`metadata` value of `env` is {} bytes; the limit is {MAX_METADATA_VALUE_BYTES} bytes",
                MAX_METADATA_VALUE_BYTES + 1
            )
        );
        let long_key = "k".repeat(MAX_METADATA_KEY_BYTES + 1);
        let e = create(&[(&long_key, at(1))], &[]).unwrap_err();
        assert!(e.starts_with("a `metadata` key is 257 bytes"), "{e}");
        assert!(!e.contains(&long_key), "an oversized key is not quoted");

        let keys: Vec<String> = (0..=MAX_METADATA_ENTRIES)
            .map(|i| format!("k{i}"))
            .collect();
        let many: Vec<(&str, String)> = keys.iter().map(|k| (k.as_str(), at(1))).collect();
        assert!(create(&many[..MAX_METADATA_ENTRIES], &[]).is_ok());
        let e = create(&many, &[]).unwrap_err();
        assert!(e.contains("65 entries; the limit is 64"), "{e}");

        // Five values of 4000 bytes: each within its limit, together not.
        let big: Vec<(&str, String)> = keys[..5].iter().map(|k| (k.as_str(), at(4000))).collect();
        let e = create(&big, &[]).unwrap_err();
        assert!(
            e.starts_with("`metadata` (keys plus values) is 20010 bytes; the limit is 16384"),
            "{e}"
        );
    }

    #[test]
    fn nul_characters_are_refused_naming_the_field_without_quoting_it() {
        let e = create(&[("k\0", "v".into())], &[]).unwrap_err();
        assert!(e.starts_with("a `metadata` key contains a NUL"), "{e}");
        let e = create(&[("k", "v\0".into())], &[]).unwrap_err();
        assert!(
            e.starts_with("`metadata` value of `k` contains a NUL"),
            "{e}"
        );
        let e = create(&[], &["h\0"]).unwrap_err();
        assert!(
            e.starts_with("an `extra_hooks` entry contains a NUL"),
            "{e}"
        );
        let e = SessionRef::try_from(pb::GetSessionRequest {
            session_id: "a\0b".into(),
        })
        .unwrap_err();
        assert_eq!(
            e,
            InvalidRequest::Nul {
                what: "`session_id`".into()
            }
        );
        let e = SessionFilter::try_from(pb::ListSessionsRequest {
            page_token: "1.a\0".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("`page_token` contains"), "{e}");
    }

    #[test]
    fn extra_hooks_are_distinct() {
        assert!(create(&[], &["h", "g"]).is_ok());
        assert_eq!(
            create(&[], &["h", "g", "h"]).unwrap_err(),
            "`extra_hooks` lists `h` more than once"
        );
    }

    #[test]
    fn ids_over_their_limit_are_refused_with_a_short_message() {
        let id = "x".repeat(20_000);
        let e = SessionRef::try_from(pb::GetSessionRequest { session_id: id })
            .unwrap_err()
            .to_string();
        assert_eq!(e, "`session_id` is 20000 bytes; the limit is 128 bytes");
        assert!(SessionRef::try_from(pb::GetSessionRequest {
            session_id: "x".repeat(MAX_ID_BYTES),
        })
        .is_ok());
        let e = ResolveApproval::try_from(pb::ResolveApprovalRequest {
            run_id: "r".into(),
            call_id: "c".repeat(MAX_NAME_BYTES + 1),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("`call_id` is 1025 bytes"), "{e}");
    }
}
