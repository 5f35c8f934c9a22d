//! A bounded pool of HTTP/2 connections to one hook server. Every call and
//! every run's `Process` stream takes a [`Lease`] on one connection for as
//! long as its HTTP/2 stream lives, so no connection ever carries more
//! streams than the server allows: streams beyond a connection's limit would
//! otherwise be queued by h2 until another ended (minutes, for runs) or
//! refused by the server. The rules of where a stream goes are in
//! [`placement`](crate::hooks::placement).

use crate::lock::LockExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::agent::contain::contained;
use crate::config::ConnectionsConfig;
use crate::hooks::client::HookChannel;
use crate::hooks::failure::{FailureClass, Fault};
use crate::hooks::peer_settings::Report;
use crate::hooks::placement::{Choice, ConnId, Placement};
use crate::telemetry::metrics::PoolMetrics;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Makes the channel of one new connection (lazy: it connects on its first
/// call), whose connector reports the server's advertised limit.
pub type Connect = Box<dyn Fn(Report) -> HookChannel + Send + Sync>;

struct State {
    placement: Placement,
    channels: HashMap<ConnId, HookChannel>,
    /// Whether a task is closing idle connections.
    sweeping: bool,
}

struct Inner {
    hook: String,
    state: Mutex<State>,
    /// A slot freed, a limit learned or a connection closed.
    changed: Notify,
    connect: Connect,
    idle: Duration,
    /// How long a new connection may go without its server's SETTINGS
    /// before it leaves the pool ([`Placement::forget_unknown`]).
    settings_wait: Duration,
    metrics: OnceLock<PoolMetrics>,
}

/// Cheap to clone; all clones share the pool.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

/// One stream slot on one connection, released when the last clone drops.
/// A run's stream holds one clone in the task that reads the stream and one
/// in the body that writes it, so the slot stays taken while either side
/// of the HTTP/2 stream is open (as the server counts it).
#[derive(Clone)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

struct LeaseInner {
    pool: Arc<Inner>,
    conn: ConnId,
    /// Streams of ours on `conn` when this one was placed (it included).
    seen: usize,
    channel: HookChannel,
}

impl Drop for LeaseInner {
    fn drop(&mut self) {
        self.pool
            .update(|p| p.release(self.conn, std::time::Instant::now()));
    }
}

impl Lease {
    pub fn channel(&self) -> HookChannel {
        self.inner.channel.clone()
    }

    /// The stream opened: a connection whose SETTINGS went unread gets the
    /// assumed limit (`placement::ASSUMED_LIMIT`).
    pub fn opened(&self) {
        self.inner.pool.update(|p| p.opened(self.inner.conn));
    }

    /// The server refused this stream (REFUSED_STREAM): its limit is below
    /// what this connection carries.
    pub fn refused(&self) {
        tracing::debug!(hook = %self.inner.pool.hook, "hook server refused a stream; lowering the connection's limit");
        if let Some(m) = self.inner.pool.metrics.get() {
            m.refused.inc();
        }
        self.inner
            .pool
            .update(|p| p.refused(self.inner.conn, self.inner.seen));
    }

    /// Opening failed before the server said anything (cannot connect):
    /// waiting for its limit would wait forever.
    pub fn failed(&self) {
        self.opened();
    }

    /// The attempt to open a stream on this slot was given up before it
    /// ended (its run ended first). If the server has still said nothing
    /// of its limit, the connection leaves the pool: it may never answer,
    /// and the next stream dials a new one rather than wait for it.
    pub fn abandoned(&self) {
        self.inner.pool.forget_unknown(self.inner.conn);
    }
}

impl Pool {
    /// `settings_wait`: how long a new connection may go without its
    /// server's SETTINGS (the connect timeout) before it is given up.
    pub fn new(
        hook: &str,
        config: &ConnectionsConfig,
        settings_wait: Duration,
        connect: Connect,
    ) -> Pool {
        Pool {
            inner: Arc::new(Inner {
                hook: hook.to_string(),
                state: Mutex::new(State {
                    placement: Placement::new(
                        config.max,
                        config.max_streams_per_connection,
                        config.idle_timeout,
                    ),
                    channels: HashMap::new(),
                    sweeping: false,
                }),
                changed: Notify::new(),
                connect,
                idle: config.idle_timeout,
                settings_wait,
                metrics: OnceLock::new(),
            }),
        }
    }

    /// Connection and stream gauges for this hook (set once).
    pub fn attach_metrics(&self, metrics: PoolMetrics) {
        let _ = self.inner.metrics.set(metrics);
        self.inner.update(|_| {});
    }

    /// A stream slot, waiting (until `deadline`) while every connection is
    /// full or one is still learning its limit.
    pub async fn acquire(&self, deadline: Instant) -> Result<Lease, Fault> {
        let mut waited = false;
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(lease) = self.try_acquire() {
                return Ok(lease);
            }
            if !waited {
                waited = true;
                if let Some(m) = self.inner.metrics.get() {
                    m.waits.inc();
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                let (conns, streams) = {
                    let s = self.inner.state.locked();
                    (s.placement.connections(), s.placement.streams())
                };
                // Nothing went to the hook server: not its failure.
                return Err(Fault::new(
                    FailureClass::Deadline,
                    format!(
                        "no free stream to the hook server before the deadline: {conns} connection(s) carry {streams} stream(s), each at its limit (raise connections.max)"
                    ),
                )
                .unsent());
            }
        }
    }

    /// A slot if one is free now (or a connection may be opened for it).
    pub fn try_acquire(&self) -> Option<Lease> {
        let mut s = self.inner.state.locked();
        let choice = s.placement.place();
        let conn = match choice {
            Choice::Wait => return None,
            Choice::Use(id) => id,
            Choice::Open(id) => {
                let pool = Arc::downgrade(&self.inner);
                let report: Report = Arc::new(move |limit| {
                    if let Some(p) = pool.upgrade() {
                        p.update(|pl| pl.learned(id, limit));
                    }
                });
                let channel = (self.inner.connect)(report);
                s.channels.insert(id, channel);
                // Bounds the one thing that stops the pool from growing: a
                // limit nobody knows yet. A healthy server's SETTINGS come
                // right after the connect; one slower than the connect
                // timeout costs at most an extra connection.
                tokio::spawn(forget_if_silent(
                    Arc::downgrade(&self.inner),
                    id,
                    self.inner.settings_wait,
                ));
                if s.placement.connections() > 1 && !s.sweeping {
                    s.sweeping = true;
                    tokio::spawn(sweep(Arc::downgrade(&self.inner)));
                }
                id
            }
        };
        let channel = s.channels.get(&conn)?.clone();
        let seen = s.placement.streams_on(conn);
        self.inner.publish(&s);
        drop(s);
        Some(Lease {
            inner: Arc::new(LeaseInner {
                pool: self.inner.clone(),
                conn,
                seen,
                channel,
            }),
        })
    }

    /// Open connections and streams (for tests and diagnostics).
    pub fn load(&self) -> (usize, usize) {
        let s = self.inner.state.locked();
        (s.placement.connections(), s.placement.streams())
    }
}

impl Inner {
    /// Changes the placement, then wakes waiters and refreshes the gauges.
    /// Taken even when poisoned (`crate::lock`): a lease dropped after a
    /// panic elsewhere must still free its slot, or the hook's streams would
    /// leak until every run waits for a slot that never frees.
    fn update(&self, f: impl FnOnce(&mut Placement)) {
        let mut s = self.state.locked();
        f(&mut s.placement);
        self.publish(&s);
        drop(s);
        self.changed.notify_waiters();
    }

    /// [`Placement::forget_unknown`], and the connection's channel with it
    /// (closed once the streams still on it end).
    fn forget_unknown(&self, id: ConnId) {
        let mut s = self.state.locked();
        if !s.placement.forget_unknown(id) {
            return;
        }
        s.channels.remove(&id);
        self.publish(&s);
        drop(s);
        self.changed.notify_waiters();
        tracing::debug!(hook = %self.hook, "hook server sent no HTTP/2 SETTINGS on a new connection; it takes no more streams");
    }

    fn publish(&self, s: &State) {
        if let Some(m) = self.metrics.get() {
            m.connections
                .set(i64::try_from(s.placement.connections()).unwrap_or(i64::MAX));
            m.streams
                .set(i64::try_from(s.placement.streams()).unwrap_or(i64::MAX));
        }
    }
}

/// Gives up connection `id` if its server has not said its limit within
/// `wait` of its opening.
async fn forget_if_silent(pool: Weak<Inner>, id: ConnId, wait: Duration) {
    tokio::time::sleep(wait).await;
    if let Some(p) = pool.upgrade() {
        p.forget_unknown(id);
    }
}

/// Closes connections idle for the idle timeout while the pool has more
/// than one; ends when it is down to one (the next growth starts another).
async fn sweep(pool: Weak<Inner>) {
    loop {
        let period = match pool.upgrade() {
            Some(p) => (p.idle / 2).clamp(Duration::from_millis(50), Duration::from_secs(30)),
            None => return,
        };
        tokio::time::sleep(period).await;
        let Some(p) = pool.upgrade() else { return };
        // A panic (a bug) is logged and the next pass comes: unwound, the
        // sweep would end with `sweeping` set, and the pool would keep its
        // idle connections for good.
        let done = contained("hook pool idle sweep", async { sweep_once(&p) }).await;
        if done == Some(true) {
            return;
        }
    }
}

/// One pass of [`sweep`]; whether the pool is down to one connection.
fn sweep_once(p: &Inner) -> bool {
    let mut s = p.state.locked();
    let closed = s.placement.sweep(std::time::Instant::now());
    for id in &closed {
        // No lease holds it (it carried no stream): dropping the last
        // channel handle closes the connection.
        s.channels.remove(id);
    }
    let done = s.placement.connections() <= 1;
    if done {
        s.sweeping = false;
    }
    p.publish(&s);
    drop(s);
    if !closed.is_empty() {
        tracing::debug!(hook = %p.hook, closed = closed.len(), "closed idle hook connections");
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::HookCredentials;
    use crate::hooks::client::Dialer;
    use crate::hooks::credentials::Credentials;
    use tonic::service::interceptor::InterceptedService;

    /// A pool of one connection carrying one stream, to a server never
    /// dialled (the channel is lazy and no call is made).
    fn one_slot() -> Pool {
        let dialer = Dialer::new("http://127.0.0.1:9", Duration::from_secs(1), None).unwrap();
        let credentials =
            Credentials::new("h", &HookCredentials::default(), Duration::MAX).unwrap();
        let closed = Arc::new(Notify::new());
        let connect: Connect = Box::new(move |report| {
            InterceptedService::new(dialer.channel(closed.clone(), report), credentials.clone())
        });
        let config = ConnectionsConfig {
            max: 1,
            max_streams_per_connection: 1,
            idle_timeout: Duration::from_secs(60),
        };
        Pool::new("h", &config, Duration::from_secs(1), connect)
    }

    #[tokio::test]
    async fn a_slot_is_freed_after_a_panic_while_the_pool_was_locked() {
        let pool = one_slot();
        let lease = pool
            .acquire(Instant::now() + Duration::from_secs(5))
            .await
            .expect("the free slot");
        lease.opened();
        assert_eq!(pool.load(), (1, 1));

        let inner = pool.inner.clone();
        let panicked = std::thread::spawn(move || {
            let _held = inner.state.lock().unwrap();
            panic!("a holder of the pool's lock panics");
        })
        .join();
        assert!(panicked.is_err());
        assert!(pool.inner.state.is_poisoned());

        drop(lease);
        assert_eq!(pool.load(), (1, 0), "the dropped lease freed its slot");
        pool.acquire(Instant::now() + Duration::from_secs(5))
            .await
            .expect("the freed slot is taken again");
    }
}
