//! A replica's copy of the transcripts it used recently, so a run on a long
//! session does not read and parse its whole history again.
//!
//! Committed messages are never changed and are numbered from 0 without
//! gaps (one row per message, appended in order, all of a commit or none),
//! so a copy of a transcript's first `n` messages stays true whatever any
//! replica appends later. A load therefore reads only the messages from
//! position `n` on ([`SessionStore::transcript_after`]): nothing when this
//! replica ran the session's last run and nobody appended since, just what
//! was appended when another replica ran it (or the reaper closed a lost
//! run). There is nothing to invalidate; a deleted session is forgotten
//! here, and one deleted on another replica can no longer be read or run
//! (the store says so first) and ages out.
//!
//! The copy is one `Arc`: a run shares it with every model request it
//! builds ([`crate::history::History`]). It grows in place when no run holds
//! it, else the next load copies it once.

use crate::lock::LockExt;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use super::{SessionStore, StoreError};
use crate::message::{Block, Message};

/// Default memory budget: transcripts beyond it are dropped, least recently
/// used first (a session larger than the whole budget is not kept).
pub const DEFAULT_CACHE_BYTES: usize = 64 * 1024 * 1024;

pub struct TranscriptCache {
    budget: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Arc<str>, Entry>,
    /// The entries' session ids by last use, oldest first, so an eviction
    /// takes the first instead of scanning every entry. With short
    /// sessions the budget holds tens of thousands of them, and once it was
    /// full the scan ran at every run start under this lock, which
    /// serialised a replica's runs (figure 4 fell from ~16 000 to ~3 000
    /// runs/s in its third round, and a hook's 5 s deadline passed behind
    /// the lock; BENCHMARKS.md).
    by_use: BTreeMap<u64, Arc<str>>,
    bytes: usize,
    clock: u64,
    /// Sessions forgotten lately (deleted), numbered by `forgets`: a load
    /// that read the store before a delete and finishes after it must not
    /// put the deleted transcript back.
    forgotten: VecDeque<(u64, Arc<str>)>,
    forgets: u64,
}

/// How many recent deletes a load in flight can be checked against; a
/// load that outlived more keeps nothing.
const FORGOTTEN_KEPT: usize = 256;

struct Entry {
    messages: Arc<Vec<Message>>,
    bytes: usize,
    used: u64,
}

impl TranscriptCache {
    /// A cache holding about `budget` bytes of message text.
    pub fn new(budget: usize) -> TranscriptCache {
        TranscriptCache {
            budget,
            inner: Mutex::new(Inner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.locked()
    }

    /// The session's committed transcript: this replica's copy, completed
    /// with what was committed after it.
    pub async fn load(
        &self,
        store: &dyn SessionStore,
        session_id: &str,
    ) -> Result<Arc<Vec<Message>>, StoreError> {
        let (known, forgets) = {
            let mut g = self.lock();
            (g.touch(session_id), g.forgets)
        };
        let from = known.as_ref().map_or(0, |k| k.len());
        let newer = store
            .transcript_after(session_id, u64::try_from(from).unwrap_or(u64::MAX))
            .await?;
        match known {
            Some(k) if newer.is_empty() => Ok(k),
            known => Ok(self.extend(session_id, known, from, newer, forgets)),
        }
    }

    /// Adds `newer` (the messages from position `from` on) to the copy,
    /// which another load may have changed meanwhile. `forgets`: the count
    /// of forgotten sessions when the load began; a session forgotten since
    /// is not kept.
    fn extend(
        &self,
        session_id: &str,
        known: Option<Arc<Vec<Message>>>,
        from: usize,
        newer: Vec<Message>,
        forgets: u64,
    ) -> Arc<Vec<Message>> {
        let mut g = self.lock();
        let deleted_since = g.forgets != forgets
            && (g.forgets - forgets > FORGOTTEN_KEPT as u64
                || g.forgotten
                    .iter()
                    .any(|(n, id)| *n > forgets && &**id == session_id));
        let taken = g.take(session_id);
        // Both are true prefixes of the transcript: the longer one wins.
        let (mut messages, mut bytes) = match (taken, known) {
            (Some(e), _) if e.messages.len() >= from => (e.messages, e.bytes),
            (_, Some(k)) => {
                let b = approx_bytes(&k);
                (k, b)
            }
            (_, None) => (Arc::new(Vec::new()), 0),
        };
        let have = messages.len();
        let end = from + newer.len();
        if end > have {
            // In place unless a run still holds this copy.
            let tail = newer.into_iter().skip(have - from);
            let list = Arc::make_mut(&mut messages);
            for m in tail {
                bytes += approx_bytes(std::slice::from_ref(&m));
                list.push(m);
            }
        }
        g.clock += 1;
        let used = g.clock;
        if bytes <= self.budget && !deleted_since {
            g.put(
                session_id,
                Entry {
                    messages: messages.clone(),
                    bytes,
                    used,
                },
            );
            g.evict_beyond(self.budget, session_id);
        }
        messages
    }

    /// Drops the session's copy (it was deleted), and keeps a load that
    /// read it before from putting it back.
    pub fn forget(&self, session_id: &str) {
        let mut g = self.lock();
        g.take(session_id);
        g.forgets += 1;
        let n = g.forgets;
        if g.forgotten.len() == FORGOTTEN_KEPT {
            g.forgotten.pop_front();
        }
        g.forgotten.push_back((n, Arc::from(session_id)));
    }

    /// Sessions and bytes held (for tests and metrics).
    pub fn held(&self) -> (usize, usize) {
        let g = self.lock();
        (g.entries.len(), g.bytes)
    }
}

impl Default for TranscriptCache {
    fn default() -> Self {
        TranscriptCache::new(DEFAULT_CACHE_BYTES)
    }
}

impl Inner {
    /// The session's copy, now its most recently used.
    fn touch(&mut self, session_id: &str) -> Option<Arc<Vec<Message>>> {
        self.clock += 1;
        let now = self.clock;
        let e = self.entries.get_mut(session_id)?;
        let before = std::mem::replace(&mut e.used, now);
        let messages = e.messages.clone();
        if let Some(id) = self.by_use.remove(&before) {
            self.by_use.insert(now, id);
        }
        Some(messages)
    }

    fn take(&mut self, session_id: &str) -> Option<Entry> {
        let e = self.entries.remove(session_id)?;
        self.by_use.remove(&e.used);
        self.bytes = self.bytes.saturating_sub(e.bytes);
        Some(e)
    }

    /// Adds a copy the caller took out first (ids are unique).
    fn put(&mut self, session_id: &str, e: Entry) {
        let id: Arc<str> = Arc::from(session_id);
        self.bytes += e.bytes;
        self.by_use.insert(e.used, id.clone());
        self.entries.insert(id, e);
    }

    /// Drops the least recently used copies (never `keep`) until the total
    /// fits.
    fn evict_beyond(&mut self, budget: usize, keep: &str) {
        while self.bytes > budget {
            let Some(oldest) = self.by_use.values().find(|id| &***id != keep).cloned() else {
                return;
            };
            self.take(&oldest);
        }
    }
}

/// About how much memory the messages' text takes.
fn approx_bytes(messages: &[Message]) -> usize {
    const OVERHEAD: usize = 48;
    messages
        .iter()
        .map(|m| {
            OVERHEAD
                + m.blocks
                    .iter()
                    .map(|b| {
                        OVERHEAD
                            + match b {
                                Block::Text { text } | Block::Reasoning { text } => text.len(),
                                Block::ToolCall(c) => {
                                    c.id.len() + c.name.len() + c.arguments_json.len()
                                }
                                Block::ToolResult(r) => {
                                    r.call_id.len() + r.name.len() + r.content.len()
                                }
                            }
                    })
                    .sum::<usize>()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::outcome::RunOutcome;
    use crate::store::{MemoryStore, NewSession, RunEnd};

    async fn session_with(store: &MemoryStore, id: &str, text: &str) {
        store
            .create_session(&NewSession {
                id: id.into(),
                agent: "a".into(),
                owner: "o".into(),
                extra_hooks: vec![],
                metadata: Default::default(),
            })
            .await
            .unwrap();
        let lease = store.begin_run(id, &format!("r-{id}"), "A").await.unwrap();
        let end = RunEnd {
            outcome: RunOutcome::Completed,
            reason: String::new(),
            usage: Default::default(),
            turns: 1,
        };
        store
            .end_run(&lease, &[Message::user(text)], &end)
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn the_least_recently_used_copies_go_first_and_nothing_beyond_the_budget_is_kept() {
        let store = MemoryStore::new(Default::default());
        let one = approx_bytes(&[Message::user("x".repeat(100))]);
        for id in ["a", "b", "c"] {
            session_with(&store, id, &"x".repeat(100)).await;
        }
        session_with(&store, "huge", &"x".repeat(1000)).await;
        let cache = TranscriptCache::new(2 * one);
        cache.load(&store, "a").await.unwrap();
        cache.load(&store, "b").await.unwrap();
        cache.load(&store, "a").await.unwrap();
        assert_eq!(cache.held(), (2, 2 * one));
        cache.load(&store, "c").await.unwrap();
        let held: Vec<String> = {
            let g = cache.lock();
            let mut k: Vec<String> = g.entries.keys().map(|k| k.to_string()).collect();
            k.sort();
            k
        };
        assert_eq!(held, ["a", "c"], "b was the least recently used");
        let huge = cache.load(&store, "huge").await.unwrap();
        assert_eq!(huge.len(), 1, "still returned");
        assert_eq!(cache.held().0, 2, "but not kept");
        assert!(!cache.lock().entries.contains_key("huge"));
    }

    #[test]
    fn a_load_that_finishes_after_its_session_was_deleted_keeps_nothing() {
        let cache = TranscriptCache::new(DEFAULT_CACHE_BYTES);
        // Both loads read the store before the delete.
        let forgets = cache.lock().forgets;
        cache.forget("gone");
        let back = cache.extend("gone", None, 0, vec![Message::user("secret")], forgets);
        assert_eq!(back.len(), 1, "the caller still gets what it read");
        assert!(!cache.lock().entries.contains_key("gone"), "not kept");
        // Another session's load is not affected.
        cache.extend("kept", None, 0, vec![Message::user("x")], forgets);
        assert!(cache.lock().entries.contains_key("kept"));
        // One that outlived more deletes than are remembered keeps nothing.
        for i in 0..=FORGOTTEN_KEPT {
            cache.forget(&format!("other{i}"));
        }
        cache.extend("late", None, 0, vec![Message::user("y")], forgets);
        assert!(!cache.lock().entries.contains_key("late"));
    }

    #[tokio::test]
    async fn with_many_sessions_the_copies_kept_are_the_most_recently_used() {
        let store = MemoryStore::new(Default::default());
        let one = approx_bytes(&[Message::user("x".repeat(10))]);
        let ids: Vec<String> = (0..40).map(|i| format!("s{i:02}")).collect();
        for id in &ids {
            session_with(&store, id, &"x".repeat(10)).await;
        }
        let cache = TranscriptCache::new(8 * one);
        // Every session once, then every third one again, newest last.
        let mut order: Vec<&String> = ids.iter().collect();
        order.extend(ids.iter().step_by(3));
        for id in &order {
            cache.load(&store, id).await.unwrap();
        }
        let mut expected: Vec<String> = Vec::new();
        for id in order.iter().rev() {
            if !expected.contains(id) && expected.len() < 8 {
                expected.push(id.to_string());
            }
        }
        expected.sort();
        let g = cache.lock();
        let mut held: Vec<String> = g.entries.keys().map(|k| k.to_string()).collect();
        held.sort();
        assert_eq!(held, expected);
        // The use index matches the entries, one for one.
        assert_eq!(g.by_use.len(), g.entries.len());
        for (used, id) in &g.by_use {
            assert_eq!(g.entries[&**id].used, *used, "{id}");
        }
        drop(g);
        cache.forget("s39");
        let g = cache.lock();
        assert_eq!((g.by_use.len(), g.entries.len()), (7, 7));
        assert_eq!(g.bytes, 7 * one);
    }
}
