//! A session: a conversation with one configured agent. Where sessions are
//! kept is the store's business (`crate::store`).

use std::collections::BTreeMap;

use crate::message::Message;

/// The principal that owns sessions created without authentication.
pub use crate::auth::ANONYMOUS;

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Session {
    pub id: String,
    pub agent: String,
    /// The principal that created it (`anonymous` when auth is off); only
    /// it (and admins) may see or act on it.
    pub owner: String,
    /// Extra hooks enabled for this session (after the agent's own).
    pub extra_hooks: Vec<String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at_unix_ms: i64,
    /// Last run start, commit or end; idle expiry counts from here.
    pub last_active_unix_ms: i64,
    /// Committed messages; filled only where the transcript was asked for.
    pub transcript: Vec<Message>,
    pub run_count: u32,
    pub active_run: Option<String>,
}
