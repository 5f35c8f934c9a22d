//! Client requests as the engine takes them. `server::request` builds these
//! from the wire messages and refuses, before anything reaches the engine or
//! the store, what no request may carry: a missing id, a string with a NUL
//! character (PostgreSQL cannot store one in TEXT), a field over its size
//! limit. Whatever holds one of these was checked.

use std::collections::BTreeMap;

/// CreateSession.
#[derive(Clone, Debug, PartialEq)]
pub struct CreateSession {
    pub agent: String,
    /// Distinct configured hook names (whether they are configured is the
    /// engine's check).
    pub extra_hooks: Vec<String>,
    pub metadata: BTreeMap<String, String>,
}

/// GetSession and DeleteSession: a session by id.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionRef {
    pub session_id: String,
}

/// Run and Invoke. The input's own limit (`server.max_input_bytes`) is the
/// engine's, as it comes from the configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct StartRun {
    pub session_id: String,
    pub input: String,
}

/// CancelRun: a run by id.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRef {
    pub run_id: String,
}

/// ResolveApproval.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolveApproval {
    pub run_id: String,
    pub call_id: String,
    pub approve: bool,
    pub note: String,
}
