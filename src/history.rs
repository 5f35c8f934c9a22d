//! The history a model call is sent: the session's committed transcript,
//! shared, followed by what came after it.
//!
//! A run builds a request before every model call, and a long session's
//! transcript is most of each request. Copying it every time made a run's
//! cost grow with the session's length (15× on a 1 000-message session);
//! here the transcript before the run is one `Arc` shared by the transcript
//! cache, the run and each of its requests, and only the run's own messages
//! (a handful) are copied. A hook's `history` patch replaces the whole
//! history for one call: it becomes the tail of an empty prefix, so nothing
//! is shared with, or written back to, the transcript.

use std::fmt;
use std::ops::Index;
use std::sync::Arc;

use crate::message::Message;

#[derive(Clone, Default)]
pub struct History {
    /// The committed transcript before the run; never modified.
    prefix: Arc<Vec<Message>>,
    /// Everything after it.
    tail: Vec<Message>,
}

impl History {
    /// A history starting with `prefix` (shared, not copied).
    pub fn new(prefix: Arc<Vec<Message>>) -> History {
        History {
            prefix,
            tail: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.prefix.len() + self.tail.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every message, in order.
    pub fn iter(
        &self,
    ) -> std::iter::Chain<std::slice::Iter<'_, Message>, std::slice::Iter<'_, Message>> {
        self.prefix.iter().chain(self.tail.iter())
    }

    pub fn get(&self, i: usize) -> Option<&Message> {
        match i.checked_sub(self.prefix.len()) {
            None => self.prefix.get(i),
            Some(j) => self.tail.get(j),
        }
    }

    pub fn last(&self) -> Option<&Message> {
        self.tail.last().or_else(|| self.prefix.last())
    }

    pub fn push(&mut self, m: Message) {
        self.tail.push(m);
    }

    /// The messages from position `from` on, when they all come after the
    /// shared prefix (a run's own messages); `None` otherwise.
    pub fn after_prefix(&self, from: usize) -> Option<&[Message]> {
        from.checked_sub(self.prefix.len())
            .and_then(|j| self.tail.get(j..))
    }

    /// Keeps the first `len` messages. Cutting into the shared prefix
    /// copies what is kept of it (never done by a run: it only cuts its own
    /// messages).
    pub fn truncate(&mut self, len: usize) {
        match len.checked_sub(self.prefix.len()) {
            Some(j) => self.tail.truncate(j),
            None => {
                self.prefix = Arc::new(self.prefix[..len].to_vec());
                self.tail.clear();
            }
        }
    }

    /// A copy of every message (for callers that need to own them).
    pub fn to_vec(&self) -> Vec<Message> {
        self.iter().cloned().collect()
    }

    /// Whether the two share the same prefix allocation: a copy of a
    /// run's history does, a history a hook's patch replaced does not.
    pub fn shares_prefix_with(&self, other: &History) -> bool {
        Arc::ptr_eq(&self.prefix, &other.prefix)
    }
}

impl From<Vec<Message>> for History {
    fn from(tail: Vec<Message>) -> History {
        History {
            prefix: Arc::default(),
            tail,
        }
    }
}

impl Index<usize> for History {
    type Output = Message;
    fn index(&self, i: usize) -> &Message {
        match i.checked_sub(self.prefix.len()) {
            None => &self.prefix[i],
            Some(j) => &self.tail[j],
        }
    }
}

impl<'a> IntoIterator for &'a History {
    type Item = &'a Message;
    type IntoIter = std::iter::Chain<std::slice::Iter<'a, Message>, std::slice::Iter<'a, Message>>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Equal when the messages are, however they are split.
impl PartialEq for History {
    fn eq(&self, other: &History) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl PartialEq<Vec<Message>> for History {
    fn eq(&self, other: &Vec<Message>) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl PartialEq<History> for Vec<Message> {
    fn eq(&self, other: &History) -> bool {
        other == self
    }
}

impl fmt::Debug for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> History {
        History::new(Arc::new(vec![
            Message::user("a"),
            Message::assistant_text("b"),
        ]))
    }

    #[test]
    fn reads_across_the_prefix_and_the_tail() {
        let mut h = shared();
        h.push(Message::user("c"));
        assert_eq!(h.len(), 3);
        assert_eq!(h[0], Message::user("a"));
        assert_eq!(h[2], Message::user("c"));
        assert_eq!(h.get(1), Some(&Message::assistant_text("b")));
        assert_eq!(h.get(3), None);
        assert_eq!(h.last(), Some(&Message::user("c")));
        assert_eq!(h.iter().next_back(), Some(&Message::user("c")));
        assert_eq!(h.after_prefix(2), Some(&[Message::user("c")][..]));
        assert_eq!(h.after_prefix(3), Some(&[][..]));
        assert_eq!(h.after_prefix(1), None);
        assert_eq!(
            h,
            vec![
                Message::user("a"),
                Message::assistant_text("b"),
                Message::user("c")
            ]
        );
        assert_eq!(h, History::from(h.to_vec()), "equal however split");
    }

    #[test]
    fn clones_share_the_prefix_and_copy_only_the_tail() {
        let mut h = shared();
        h.push(Message::user("c"));
        let mut copy = h.clone();
        assert!(copy.shares_prefix_with(&h));
        copy.push(Message::user("d"));
        assert_eq!(h.len(), 3, "the original is untouched");
        assert_eq!(copy.len(), 4);
    }

    #[test]
    fn truncating_into_the_prefix_copies_what_is_kept() {
        let base = shared();
        let mut h = base.clone();
        h.push(Message::user("c"));
        h.truncate(2);
        assert_eq!(h, base);
        assert!(h.shares_prefix_with(&base));
        h.truncate(1);
        assert_eq!(h, vec![Message::user("a")]);
        assert_eq!(base.len(), 2, "the shared transcript is never changed");
    }
}
