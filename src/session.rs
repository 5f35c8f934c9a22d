//! Sessions and where they live. The store is a trait so persistence can
//! replace the in-memory map without touching the engine.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::message::Message;

#[derive(Clone, Debug, PartialEq)]
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
    pub transcript: Vec<Message>,
    pub run_count: u32,
    pub active_run: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SessionError {
    #[error("session `{0}` not found (it may have been deleted)")]
    NotFound(String),
    #[error("session `{session}` already has a run in progress (`{run}`); wait for it or cancel it with CancelRun")]
    Busy { session: String, run: String },
}

pub trait SessionStore: Send + Sync + 'static {
    fn insert(&self, session: Session);
    fn get(&self, id: &str) -> Option<Session>;
    /// Every session, or only those `owner` owns, oldest first.
    fn list(&self, owner: Option<&str>) -> Vec<Session>;
    /// How many sessions `owner` owns (quota `max_sessions`).
    fn count_owned(&self, owner: &str) -> usize;
    fn remove(&self, id: &str) -> Option<Session>;
    /// Marks a run active; returns the transcript the run starts from.
    fn begin_run(&self, id: &str, run_id: &str) -> Result<Session, SessionError>;
    /// Appends a finished run's messages and clears the active run.
    fn end_run(&self, id: &str, run_id: &str, messages: Vec<Message>);
}

#[derive(Default)]
pub struct MemoryStore {
    sessions: Mutex<HashMap<String, Session>>,
}

impl SessionStore for MemoryStore {
    fn insert(&self, session: Session) {
        self.sessions
            .lock()
            .unwrap()
            .insert(session.id.clone(), session);
    }

    fn get(&self, id: &str) -> Option<Session> {
        self.sessions.lock().unwrap().get(id).cloned()
    }

    fn list(&self, owner: Option<&str>) -> Vec<Session> {
        let mut v: Vec<Session> = self
            .sessions
            .lock()
            .unwrap()
            .values()
            .filter(|s| owner.is_none_or(|o| s.owner == o))
            .cloned()
            .collect();
        v.sort_by(|a, b| (a.created_at_unix_ms, &a.id).cmp(&(b.created_at_unix_ms, &b.id)));
        v
    }

    fn count_owned(&self, owner: &str) -> usize {
        self.sessions
            .lock()
            .unwrap()
            .values()
            .filter(|s| s.owner == owner)
            .count()
    }

    fn remove(&self, id: &str) -> Option<Session> {
        self.sessions.lock().unwrap().remove(id)
    }

    fn begin_run(&self, id: &str, run_id: &str) -> Result<Session, SessionError> {
        let mut g = self.sessions.lock().unwrap();
        let s = g
            .get_mut(id)
            .ok_or_else(|| SessionError::NotFound(id.to_string()))?;
        if let Some(run) = &s.active_run {
            return Err(SessionError::Busy {
                session: id.to_string(),
                run: run.clone(),
            });
        }
        s.active_run = Some(run_id.to_string());
        s.run_count += 1;
        Ok(s.clone())
    }

    fn end_run(&self, id: &str, run_id: &str, messages: Vec<Message>) {
        let mut g = self.sessions.lock().unwrap();
        if let Some(s) = g.get_mut(id) {
            if s.active_run.as_deref() == Some(run_id) {
                s.active_run = None;
                s.transcript.extend(messages);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_run_at_a_time_and_commit_on_end() {
        let store = MemoryStore::default();
        store.insert(Session {
            id: "s".into(),
            agent: "a".into(),
            owner: "o".into(),
            extra_hooks: vec![],
            metadata: Default::default(),
            created_at_unix_ms: 0,
            transcript: vec![],
            run_count: 0,
            active_run: None,
        });
        store.begin_run("s", "r1").unwrap();
        assert_eq!(
            store.begin_run("s", "r2").unwrap_err(),
            SessionError::Busy {
                session: "s".into(),
                run: "r1".into()
            }
        );
        store.end_run("s", "r1", vec![Message::user("x")]);
        let s = store.get("s").unwrap();
        assert_eq!(s.transcript.len(), 1);
        assert_eq!(s.active_run, None);
        assert_eq!(s.run_count, 1);
        assert_eq!(store.list(Some("o")).len(), 1);
        assert_eq!(store.list(Some("other")).len(), 0);
        assert_eq!(store.list(None).len(), 1);
        assert_eq!(store.count_owned("o"), 1);
        assert!(matches!(
            store.begin_run("nope", "r"),
            Err(SessionError::NotFound(_))
        ));
    }
}
