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
use std::collections::HashMap;
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
    entries: HashMap<String, Entry>,
    bytes: usize,
    clock: u64,
}

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
        let known = {
            let mut g = self.lock();
            g.clock += 1;
            let now = g.clock;
            g.entries.get_mut(session_id).map(|e| {
                e.used = now;
                e.messages.clone()
            })
        };
        let from = known.as_ref().map_or(0, |k| k.len());
        let newer = store
            .transcript_after(session_id, u64::try_from(from).unwrap_or(u64::MAX))
            .await?;
        match known {
            Some(k) if newer.is_empty() => Ok(k),
            known => Ok(self.extend(session_id, known, from, newer)),
        }
    }

    /// Adds `newer` (the messages from position `from` on) to the copy,
    /// which another load may have changed meanwhile.
    fn extend(
        &self,
        session_id: &str,
        known: Option<Arc<Vec<Message>>>,
        from: usize,
        newer: Vec<Message>,
    ) -> Arc<Vec<Message>> {
        let mut g = self.lock();
        let g = &mut *g;
        let taken = g.entries.remove(session_id);
        if let Some(e) = &taken {
            g.bytes = g.bytes.saturating_sub(e.bytes);
        }
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
        if bytes <= self.budget {
            g.bytes += bytes;
            g.entries.insert(
                session_id.to_string(),
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

    /// Drops the session's copy (it was deleted).
    pub fn forget(&self, session_id: &str) {
        let mut g = self.lock();
        if let Some(e) = g.entries.remove(session_id) {
            g.bytes = g.bytes.saturating_sub(e.bytes);
        }
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
    /// Drops the least recently used copies (never `keep`) until the total
    /// fits. A linear scan per eviction: evictions are rare, and the map
    /// holds at most a few thousand sessions.
    fn evict_beyond(&mut self, budget: usize, keep: &str) {
        while self.bytes > budget {
            let Some(oldest) = self
                .entries
                .iter()
                .filter(|(id, _)| id.as_str() != keep)
                .min_by_key(|(_, e)| e.used)
                .map(|(id, _)| id.clone())
            else {
                return;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes = self.bytes.saturating_sub(e.bytes);
            }
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
            let mut k: Vec<String> = g.entries.keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(held, ["a", "c"], "b was the least recently used");
        let huge = cache.load(&store, "huge").await.unwrap();
        assert_eq!(huge.len(), 1, "still returned");
        assert_eq!(cache.held().0, 2, "but not kept");
        assert!(!cache.lock().entries.contains_key("huge"));
    }
}
