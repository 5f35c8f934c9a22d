//! Which of a hook server's HTTP/2 connections a new stream goes on, when
//! to open another connection and when one may close. Pure bookkeeping (no
//! IO, time passed in), so the rules are tested without sockets.
//!
//! - A new stream goes on the least loaded connection that has room below
//!   its limit (spreading runs over the connections, and so over the pods
//!   behind a load balancer).
//! - A connection's limit is what the server advertised in its SETTINGS
//!   (or learned from a refused stream), capped by the configured
//!   `max_streams_per_connection` (1 000 by default, also when the server
//!   sets no limit). Until the server has said it, only the
//!   stream that opens the connection goes on it: nothing is queued or
//!   refused beyond a limit nobody knows yet. A connection whose server
//!   says nothing (not within the connect timeout, or before its opener
//!   gave up) is forgotten, so it cannot hold the pool back.
//! - Another connection is opened only when every connection is full (at
//!   most one connecting at a time), up to the configured maximum; past
//!   that, streams wait for a free slot.
//! - When the streams would fit in one connection fewer at half load, the
//!   newest connection stops taking new streams (drains); a surplus
//!   connection that carried no stream for the idle timeout closes. One
//!   connection always stays.

use std::time::{Duration, Instant};

use crate::hooks::peer_settings::Advertised;

/// The limit assumed for a connection whose SETTINGS could not be read (the
/// connection ended first, or its first frame was not SETTINGS): RFC 9113
/// recommends servers allow no fewer than 100 streams, and common proxies
/// allow 100-128. A server that allows fewer refuses the surplus, which
/// lowers the limit.
pub const ASSUMED_LIMIT: usize = 100;

pub type ConnId = u64;

/// What is known of a connection's concurrent-stream limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// Connecting: the server has not said yet.
    Unknown,
    /// SETTINGS_MAX_CONCURRENT_STREAMS, or learned from a refusal.
    Advertised(usize),
    /// The server advertised none.
    Unlimited,
}

#[derive(Debug)]
struct Conn {
    id: ConnId,
    streams: usize,
    limit: Limit,
    draining: bool,
    idle_since: Option<Instant>,
}

/// Where a stream goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// On this existing connection (its stream count already taken).
    Use(ConnId),
    /// On a connection just added for it: the caller connects it.
    Open(ConnId),
    /// Nowhere yet: every connection is full (or one is still connecting).
    Wait,
}

#[derive(Debug)]
pub struct Placement {
    conns: Vec<Conn>,
    next_id: ConnId,
    max_conns: usize,
    /// The configured `max_streams_per_connection`.
    cap: usize,
    idle: Duration,
}

impl Placement {
    pub fn new(max_conns: usize, cap: usize, idle: Duration) -> Placement {
        Placement {
            conns: Vec::new(),
            next_id: 1,
            max_conns: max_conns.max(1),
            cap: cap.max(1),
            idle,
        }
    }

    fn capacity(&self, c: &Conn) -> usize {
        match c.limit {
            // The stream that opens the connection.
            Limit::Unknown => 1,
            Limit::Advertised(n) => n.min(self.cap),
            Limit::Unlimited => self.cap,
        }
    }

    fn room(&self, c: &Conn) -> bool {
        c.streams < self.capacity(c)
    }

    /// Takes a stream slot.
    pub fn place(&mut self) -> Choice {
        let best = self
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| !c.draining && self.room(c))
            .min_by_key(|(_, c)| c.streams)
            .map(|(i, _)| i);
        // A draining connection with room is better than a new one.
        let best = best.or_else(|| self.conns.iter().position(|c| c.draining && self.room(c)));
        if let Some(i) = best {
            let c = &mut self.conns[i];
            c.draining = false;
            c.streams += 1;
            c.idle_since = None;
            return Choice::Use(c.id);
        }
        // One connection at a time learns its limit before another opens.
        if self.conns.iter().any(|c| c.limit == Limit::Unknown)
            || self.conns.len() >= self.max_conns
        {
            return Choice::Wait;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.conns.push(Conn {
            id,
            streams: 1,
            limit: Limit::Unknown,
            draining: false,
            idle_since: None,
        });
        Choice::Open(id)
    }

    fn conn(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.conns.iter_mut().find(|c| c.id == id)
    }

    /// A stream on `id` ended.
    pub fn release(&mut self, id: ConnId, now: Instant) {
        if let Some(c) = self.conn(id) {
            c.streams = c.streams.saturating_sub(1);
            if c.streams == 0 {
                c.idle_since = Some(now);
            }
        }
        self.rebalance();
    }

    /// What the server's SETTINGS said.
    pub fn learned(&mut self, id: ConnId, advertised: Advertised) {
        if let Some(c) = self.conn(id) {
            c.limit = match advertised {
                Advertised::Limit(n) => Limit::Advertised(n),
                Advertised::NoLimit => Limit::Unlimited,
                Advertised::Unreadable => Limit::Advertised(ASSUMED_LIMIT),
            };
        }
    }

    /// A stream opened (or failed to) on `id` while its limit was still
    /// unknown: the server's SETTINGS went unread.
    pub fn opened(&mut self, id: ConnId) {
        if let Some(c) = self.conn(id) {
            if c.limit == Limit::Unknown {
                c.limit = Limit::Advertised(ASSUMED_LIMIT);
            }
        }
    }

    /// Removes `id` if its server has still said nothing of its limit
    /// (no SETTINGS: TCP accepted, but not a byte back, as from a stopped
    /// process or a proxy whose backend is gone); returns whether it did.
    /// Another connection is opened only once no limit is unknown, so one
    /// such connection, kept, would stop the pool from ever growing, and
    /// with no stream on it, it would take the next stream and hang it too.
    /// Streams still on it keep their slots' channel; their ends are no-ops.
    pub fn forget_unknown(&mut self, id: ConnId) -> bool {
        let Some(i) = self
            .conns
            .iter()
            .position(|c| c.id == id && c.limit == Limit::Unknown)
        else {
            return false;
        };
        self.conns.remove(i);
        self.rebalance();
        true
    }

    /// Streams of ours on `id` now.
    pub fn streams_on(&self, id: ConnId) -> usize {
        self.conns
            .iter()
            .find(|c| c.id == id)
            .map_or(0, |c| c.streams)
    }

    /// The server refused a stream on `id` (REFUSED_STREAM) that was
    /// placed when `id` carried `seen` streams of ours, it included: the
    /// server had fewer than that open when it refused, so its limit is
    /// below `seen`. (Not below what `id` carries now: streams that ended
    /// since the refusal would lower the limit for good.)
    pub fn refused(&mut self, id: ConnId, seen: usize) {
        if let Some(c) = self.conn(id) {
            let below = seen.saturating_sub(1).max(1);
            c.limit = match c.limit {
                Limit::Advertised(n) => Limit::Advertised(n.min(below)),
                _ => Limit::Advertised(below),
            };
        }
    }

    /// Drains the newest connection when the streams would fit in one
    /// fewer at half load.
    fn rebalance(&mut self) {
        if self.conns.iter().any(|c| c.limit == Limit::Unknown) {
            return;
        }
        let active: Vec<usize> = (0..self.conns.len())
            .filter(|&i| !self.conns[i].draining)
            .collect();
        if active.len() < 2 {
            return;
        }
        let each = active
            .iter()
            .map(|&i| self.capacity(&self.conns[i]))
            .min()
            .unwrap_or(usize::MAX);
        let total: usize = self.conns.iter().map(|c| c.streams).sum();
        if total.saturating_mul(2) <= (active.len() - 1).saturating_mul(each) {
            if let Some(&newest) = active.last() {
                self.conns[newest].draining = true;
            }
        }
    }

    /// Closes surplus connections idle for the idle timeout; returns their
    /// ids. One connection always stays.
    pub fn sweep(&mut self, now: Instant) -> Vec<ConnId> {
        let mut closed = Vec::new();
        let idle = self.idle;
        while self.conns.len() > 1 {
            let Some(i) = self.conns.iter().rposition(|c| {
                c.streams == 0 && c.idle_since.is_some_and(|t| now.duration_since(t) >= idle)
            }) else {
                break;
            };
            closed.push(self.conns.remove(i).id);
        }
        closed
    }

    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    pub fn streams(&self) -> usize {
        self.conns.iter().map(|c| c.streams).sum()
    }

    /// Streams per connection, oldest first (for tests and diagnostics).
    pub fn loads(&self) -> Vec<usize> {
        self.conns.iter().map(|c| c.streams).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(60);

    fn id(c: Choice) -> ConnId {
        match c {
            Choice::Use(id) | Choice::Open(id) => id,
            Choice::Wait => panic!("expected a slot, got Wait"),
        }
    }

    #[test]
    fn a_connection_takes_one_stream_until_its_limit_is_known() {
        let mut p = Placement::new(8, usize::MAX, IDLE);
        let first = p.place();
        assert!(matches!(first, Choice::Open(_)));
        assert_eq!(p.place(), Choice::Wait, "others wait for the limit");
        p.learned(id(first), Advertised::Limit(100));
        for _ in 1..100 {
            assert_eq!(p.place(), Choice::Use(id(first)));
        }
        assert!(
            matches!(p.place(), Choice::Open(_)),
            "the 101st opens another"
        );
        assert_eq!(p.loads(), vec![100, 1]);
    }

    #[test]
    fn streams_spread_over_connections_and_never_exceed_the_smaller_limit() {
        let mut p = Placement::new(8, 3, IDLE);
        let a = id(p.place());
        p.learned(a, Advertised::Limit(100));
        p.place();
        p.place();
        let b = id(p.place());
        p.learned(b, Advertised::NoLimit);
        p.place();
        // Both full at the configured cap of 3.
        assert_eq!(p.loads(), vec![3, 2]);
        p.place();
        assert_eq!(p.loads(), vec![3, 3]);
        p.release(a, Instant::now());
        assert_eq!(p.place(), Choice::Use(a), "the least loaded takes it");
    }

    #[test]
    fn an_unreadable_limit_is_taken_as_100() {
        let mut p = Placement::new(8, usize::MAX, IDLE);
        let a = id(p.place());
        p.learned(a, Advertised::Unreadable);
        for _ in 1..ASSUMED_LIMIT {
            assert_eq!(p.place(), Choice::Use(a));
        }
        assert!(matches!(p.place(), Choice::Open(_)));
    }

    #[test]
    fn the_pool_is_bounded_and_then_streams_wait() {
        let mut p = Placement::new(2, usize::MAX, IDLE);
        let a = id(p.place());
        p.learned(a, Advertised::Limit(1));
        let b = id(p.place());
        p.learned(b, Advertised::Limit(1));
        assert_eq!(p.place(), Choice::Wait);
        p.release(b, Instant::now());
        assert_eq!(p.place(), Choice::Use(b));
    }

    #[test]
    fn a_draining_connection_is_reused_before_another_opens() {
        let t0 = Instant::now();
        let mut p = Placement::new(8, 2, IDLE);
        let a = id(p.place());
        p.learned(a, Advertised::NoLimit);
        p.place();
        let b = id(p.place());
        p.learned(b, Advertised::NoLimit);
        p.release(b, t0);
        assert_eq!(p.loads(), vec![2, 0]);
        p.release(a, t0);
        // 1 stream of 4: b drains; a takes the next one.
        assert_eq!(p.place(), Choice::Use(a));
        assert_eq!(p.place(), Choice::Use(b), "a is full: b is taken back");
        assert_eq!(p.connections(), 2);
    }

    #[test]
    fn a_connection_whose_limit_never_came_is_forgotten_and_another_opens() {
        let mut p = Placement::new(8, usize::MAX, IDLE);
        let silent = id(p.place());
        assert_eq!(p.place(), Choice::Wait, "waits for the limit");
        assert!(p.forget_unknown(silent));
        assert_eq!(p.connections(), 0);
        let next = p.place();
        assert!(matches!(next, Choice::Open(n) if n != silent), "{next:?}");
        // The forgotten connection's stream ends: nothing to count.
        p.release(silent, Instant::now());
        assert_eq!(p.loads(), vec![1]);
        // A connection whose limit is known stays.
        p.learned(id(next), Advertised::Limit(10));
        assert!(!p.forget_unknown(id(next)));
        assert_eq!(p.connections(), 1);
    }

    #[test]
    fn a_refusal_lowers_the_limit_below_what_was_open() {
        let mut p = Placement::new(8, usize::MAX, IDLE);
        let a = id(p.place());
        p.opened(a);
        for _ in 0..9 {
            assert_eq!(p.place(), Choice::Use(a), "100 assumed while unread");
        }
        p.refused(a, p.streams_on(a));
        p.release(a, Instant::now());
        assert_eq!(p.loads(), vec![9]);
        // Limit 9 now: the next stream opens another connection.
        assert!(matches!(p.place(), Choice::Open(_)));
    }

    #[test]
    fn streams_that_ended_before_a_refusal_was_seen_do_not_lower_the_limit_further() {
        let mut p = Placement::new(8, usize::MAX, IDLE);
        let a = id(p.place());
        p.opened(a);
        for _ in 0..9 {
            p.place();
        }
        // The tenth stream was placed with ten on the connection; five
        // ended before its refusal came back.
        let seen = p.streams_on(a);
        for _ in 0..5 {
            p.release(a, Instant::now());
        }
        p.refused(a, seen);
        p.release(a, Instant::now());
        assert_eq!(p.loads(), vec![4]);
        // Limit 9, not 4: five more fit before another connection opens.
        for _ in 0..5 {
            assert_eq!(p.place(), Choice::Use(a));
        }
        assert!(matches!(p.place(), Choice::Open(_)));
    }

    #[test]
    fn surplus_connections_drain_and_close_after_the_idle_timeout() {
        let t0 = Instant::now();
        let mut p = Placement::new(8, usize::MAX, IDLE);
        let a = id(p.place());
        p.learned(a, Advertised::Limit(2));
        p.place();
        let b = id(p.place());
        p.learned(b, Advertised::Limit(2));
        p.place();
        let c = id(p.place());
        p.learned(c, Advertised::Limit(2));
        assert_eq!(p.loads(), vec![2, 2, 1]);
        // Load falls to 2 of 6: the newest drains.
        p.release(c, t0);
        p.release(b, t0);
        p.release(b, t0);
        assert_eq!(p.loads(), vec![2, 0, 0]);
        assert_eq!(p.place(), Choice::Use(b), "not the draining one");
        p.release(b, t0);
        assert_eq!(
            p.sweep(t0 + IDLE / 2),
            Vec::<ConnId>::new(),
            "not idle long enough"
        );
        assert_eq!(p.sweep(t0 + IDLE), vec![c, b], "newest first");
        assert_eq!(p.connections(), 1);
        p.release(a, t0);
        p.release(a, t0);
        assert_eq!(
            p.sweep(t0 + IDLE * 10),
            Vec::<ConnId>::new(),
            "one always stays"
        );
    }
}
