//! Warnings about failed store writes, thinned across an engine's runs.

use std::sync::{Arc, Mutex};

use crate::hooks::failure_log::FailureLog;
use crate::lock::LockExt;
use crate::store::StoreError;

/// Warnings about store writes that failed, thinned across an engine's
/// runs. In a database outage every run fails the same way, and a line per
/// run (a renewal every 10 s each, an end each) would flood the log, as
/// sqlx's per-call warning did. The first failure of a kind is logged at
/// once; the others within [`LOG_INTERVAL`](crate::hooks::failure_log::LOG_INTERVAL)
/// only at debug, and the next warning of that kind says how many it left
/// out.
#[derive(Clone, Default)]
pub struct StoreWarnings(Arc<Mutex<FailureLog<&'static str>>>);

impl StoreWarnings {
    /// `what` failed for `run` with `error`.
    pub fn warn(&self, what: &'static str, run: &str, error: &StoreError) {
        match self.admit(what) {
            Some(left_out) => tracing::warn!(run, error = %error, left_out, "{what}"),
            None => tracing::debug!(run, error = %error, "{what}"),
        }
    }

    /// `what`, a replica's own periodic work (every 0.5 s for some), failed
    /// with `error`.
    pub fn warn_replica(&self, what: &'static str, error: &StoreError) {
        match self.admit(what) {
            Some(left_out) => tracing::warn!(error = %error, left_out, "{what}"),
            None => tracing::debug!(error = %error, "{what}"),
        }
    }

    fn admit(&self, what: &'static str) -> Option<u64> {
        self.0.locked().admit(what, std::time::Instant::now())
    }
}
