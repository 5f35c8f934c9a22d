//! The queue of one run's events to its client, bounded
//! (`server.run_event_buffer`) so a slow or stuck `Run` reader can never
//! make hookwire buffer without end.
//!
//! - The runner waits for room between steps ([`ClientQueue::reserve`]):
//!   a slow reader slows the run down.
//! - Within a step, events are pushed without waiting
//!   ([`ClientQueue::push`]). Text deltas that find the queue full are
//!   merged into one held delta, sent ahead of anything else once there is
//!   room: a model streaming faster than the client reads costs at most its
//!   answer's text again (itself bounded), never a growing queue. Any other
//!   event that finds the queue full is refused.
//! - A reader that reads nothing while the runner waits for
//!   `server.client_stall_timeout` is reported as stalled (and remembered:
//!   [`ClientQueue::stalled`]).
//! - An `Invoke` caller reads only the run's report
//!   ([`ClientQueue::report_only`]): nothing else is queued, and a caller
//!   that left is still noticed ([`ClientQueue::is_closed`]).

use crate::lock::LockExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::mpsc::{self, error::TrySendError, PermitIterator};

use crate::agent::events::{QueuedEvent, RunEvent};

/// Why an event could not be queued without waiting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The client is gone.
    Closed,
    /// The queue is full (and the event is not a text delta).
    Full,
}

/// Why waiting for room ended without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unwritable {
    Closed,
    /// The client read nothing for the stall timeout.
    Stalled,
}

pub struct ClientQueue {
    tx: mpsc::Sender<QueuedEvent>,
    /// Deltas (turn, merged text) that found the queue full.
    held: Mutex<Option<(u32, String)>>,
    stall: Duration,
    /// A wait for room ended stalled: the run is ending for it, and its
    /// last events must not wait a second stall timeout.
    stalled: AtomicBool,
    /// The client reads only the run's report (`Invoke`).
    report_only: bool,
}

impl ClientQueue {
    pub fn new(tx: mpsc::Sender<QueuedEvent>, stall: Duration) -> Self {
        ClientQueue {
            tx,
            held: Mutex::new(None),
            stall,
            stalled: AtomicBool::new(false),
            report_only: false,
        }
    }

    /// A queue for a client that reads only the run's report (`Invoke`):
    /// [`Self::wants`] turns every other event away before it is queued,
    /// as each one queued woke the caller's handler only to be dropped.
    pub fn report_only(mut self) -> Self {
        self.report_only = true;
        self
    }

    pub fn with_stall(mut self, stall: Duration) -> Self {
        self.stall = stall;
        self
    }

    /// Whether the client reads `ev`; an event it does not read is not
    /// queued (but a client that left still has to be noticed:
    /// [`Self::is_closed`]).
    pub fn wants(&self, ev: &RunEvent) -> bool {
        !self.report_only || matches!(ev, RunEvent::Finished(_))
    }

    /// Whether the client reads events as they happen (not only the report).
    pub fn streams(&self) -> bool {
        !self.report_only
    }

    /// The client is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// How many events the queue holds.
    pub fn capacity(&self) -> usize {
        self.tx.max_capacity()
    }

    pub fn stall_timeout(&self) -> Duration {
        self.stall
    }

    /// A wait for room already ended because the client read nothing.
    pub fn stalled(&self) -> bool {
        self.stalled.load(Ordering::Relaxed)
    }

    /// Queues `ev` without waiting (see the module docs).
    pub fn push(&self, ev: RunEvent) -> Result<(), Refused> {
        let mut held = self.held.locked();
        if let (RunEvent::TextDelta { turn, text }, Some((t, merged))) = (&ev, held.as_mut()) {
            if turn == t {
                merged.push_str(text);
                return Ok(());
            }
        }
        // Held deltas go first, to keep the order.
        if let Some((turn, text)) = held.take() {
            match self
                .tx
                .try_send(Box::new(RunEvent::TextDelta { turn, text }))
            {
                Ok(()) => {}
                Err(TrySendError::Closed(_)) => return Err(Refused::Closed),
                Err(TrySendError::Full(ev)) => {
                    if let RunEvent::TextDelta { turn, text } = *ev {
                        *held = Some((turn, text));
                    }
                    return Err(Refused::Full);
                }
            }
        }
        match self.tx.try_send(Box::new(ev)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Closed(_)) => Err(Refused::Closed),
            Err(TrySendError::Full(ev)) => match *ev {
                RunEvent::TextDelta { turn, text } => {
                    *held = Some((turn, text));
                    Ok(())
                }
                _ => Err(Refused::Full),
            },
        }
    }

    /// Reserves `n` slots if they are free now and no held delta must go
    /// first; `None` when the caller has to wait ([`Self::reserve`]). The
    /// common case between steps, without arming the stall timer.
    pub fn try_reserve(
        &self,
        n: usize,
    ) -> Option<Result<PermitIterator<'_, QueuedEvent>, Unwritable>> {
        if self.held.locked().is_some() {
            return None;
        }
        match self.tx.try_reserve_many(n.clamp(1, self.capacity())) {
            Ok(p) => Some(Ok(p)),
            Err(TrySendError::Closed(())) => Some(Err(Unwritable::Closed)),
            Err(TrySendError::Full(())) => None,
        }
    }

    /// Waits until `n` slots are free (after sending any held delta) and
    /// reserves them. Cancel-safe: dropping it gives the room back (a held
    /// delta being sent is then dropped, as the run is ending).
    pub async fn reserve(&self, n: usize) -> Result<PermitIterator<'_, QueuedEvent>, Unwritable> {
        let held = self.held.locked().take();
        if let Some((turn, text)) = held {
            let mut p = self.reserve_raw(1).await?;
            if let Some(p) = p.next() {
                p.send(Box::new(RunEvent::TextDelta { turn, text }));
            }
        }
        self.reserve_raw(n.clamp(1, self.capacity())).await
    }

    async fn reserve_raw(&self, n: usize) -> Result<PermitIterator<'_, QueuedEvent>, Unwritable> {
        loop {
            let free = self.tx.capacity();
            tokio::select! {
                p = self.tx.reserve_many(n) => return p.map_err(|_| Unwritable::Closed),
                _ = tokio::time::sleep(self.stall) => {
                    // Stalled only if the client read nothing meanwhile; a
                    // slow reader that makes progress is waited for.
                    if self.tx.capacity() <= free {
                        self.stalled.store(true, Ordering::Relaxed);
                        return Err(Unwritable::Stalled);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn delta(turn: u32, text: &str) -> RunEvent {
        RunEvent::TextDelta {
            turn,
            text: text.into(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn deltas_merge_when_full_and_go_first_once_there_is_room() {
        let (tx, mut rx) = mpsc::channel(2);
        let q = ClientQueue::new(tx, Duration::from_secs(60));
        q.push(RunEvent::TurnStarted { turn: 1 }).unwrap();
        q.push(delta(1, "a")).unwrap();
        for t in ["b", "c", "d"] {
            q.push(delta(1, t)).unwrap();
        }
        assert_eq!(
            q.push(RunEvent::TurnStarted { turn: 2 }),
            Err(Refused::Full),
            "anything else behind held deltas in a full queue is refused"
        );
        assert_eq!(
            rx.recv().await.map(|e| *e),
            Some(RunEvent::TurnStarted { turn: 1 })
        );
        assert_eq!(rx.recv().await.map(|e| *e), Some(delta(1, "a")));
        let mut p = q.reserve(1).await.unwrap();
        p.next()
            .unwrap()
            .send(Box::new(RunEvent::TurnStarted { turn: 2 }));
        assert_eq!(
            rx.recv().await.map(|e| *e),
            Some(delta(1, "bcd")),
            "merged, in order"
        );
        assert_eq!(
            rx.recv().await.map(|e| *e),
            Some(RunEvent::TurnStarted { turn: 2 })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_reads_nothing_is_stalled_a_slow_one_is_not() {
        let (tx, mut rx) = mpsc::channel(2);
        let q = ClientQueue::new(tx, Duration::from_secs(10));
        q.push(RunEvent::TurnStarted { turn: 1 }).unwrap();
        q.push(RunEvent::TurnStarted { turn: 2 }).unwrap();
        assert_eq!(q.reserve(1).await.err(), Some(Unwritable::Stalled));
        // A reader taking one event every 9 s is slow, not stalled.
        let mut waiting = Box::pin(q.reserve(2));
        assert!((&mut waiting).now_or_never().is_none());
        tokio::time::sleep(Duration::from_secs(9)).await;
        rx.recv().await.unwrap();
        assert!((&mut waiting).now_or_never().is_none());
        tokio::time::sleep(Duration::from_secs(9)).await;
        rx.recv().await.unwrap();
        assert!(waiting.await.is_ok());
        drop(rx);
        assert_eq!(q.push(delta(3, "x")), Err(Refused::Closed));
    }

    #[test]
    fn a_report_only_client_wants_the_report_and_nothing_else() {
        let (tx, rx) = mpsc::channel(2);
        let q = ClientQueue::new(tx, Duration::from_secs(60)).report_only();
        assert!(!q.streams());
        assert!(!q.wants(&RunEvent::Started));
        assert!(!q.wants(&delta(1, "a")));
        let report = RunEvent::Finished(crate::agent::events::RunReport {
            run_id: "r".into(),
            session_id: "s".into(),
            outcome: crate::agent::outcome::RunOutcome::Completed,
            final_text: String::new(),
            reason: String::new(),
            usage: Default::default(),
            turns: 1,
            messages: vec![],
            hook_verdicts: vec![],
            finish_reason: String::new(),
        });
        assert!(q.wants(&report));
        assert!(!q.is_closed());
        drop(rx);
        assert!(q.is_closed(), "a caller that left is still noticed");
        let (tx, _rx) = mpsc::channel(2);
        let q = ClientQueue::new(tx, Duration::from_secs(60));
        assert!(q.streams() && q.wants(&RunEvent::Started));
    }

    #[tokio::test]
    async fn room_is_taken_at_once_only_when_free_and_no_held_delta_goes_first() {
        let (tx, mut rx) = mpsc::channel(2);
        let q = ClientQueue::new(tx, Duration::from_secs(60));
        assert_eq!(q.try_reserve(2).map(|r| r.unwrap().count()), Some(2));
        q.push(RunEvent::TurnStarted { turn: 1 }).unwrap();
        assert!(q.try_reserve(2).is_none(), "one slot left: wait");
        q.push(delta(1, "a")).unwrap();
        q.push(delta(1, "b")).unwrap();
        assert_eq!(
            rx.recv().await.map(|e| *e),
            Some(RunEvent::TurnStarted { turn: 1 })
        );
        assert!(
            q.try_reserve(1).is_none(),
            "a slot is free, but the held delta goes first"
        );
        assert_eq!(rx.recv().await.map(|e| *e), Some(delta(1, "a")));
        let mut p = q.reserve(1).await.unwrap();
        p.next()
            .unwrap()
            .send(Box::new(RunEvent::TurnStarted { turn: 2 }));
        assert_eq!(rx.recv().await.map(|e| *e), Some(delta(1, "b")));
        assert_eq!(
            rx.recv().await.map(|e| *e),
            Some(RunEvent::TurnStarted { turn: 2 })
        );
        drop(rx);
        assert_eq!(
            q.try_reserve(1).map(|r| r.err()),
            Some(Some(Unwritable::Closed))
        );
    }
}
