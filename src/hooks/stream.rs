//! One `Process` stream of one hook for one run: events out, verdicts
//! matched back by `seq`. Anything that is not exactly one verdict per
//! blocking event (late, duplicate, spurious, reset) is classified here,
//! with the event it was seen after (a verdict answering an observe event:
//! with that event, however late it was read). Late verdicts are counted
//! when they arrive, for as long as the connection lives (after the run
//! too).

use crate::lock::LockExt;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

use crate::event::EventKind;
use crate::hooks::client::open_process;
use crate::hooks::failure::{FailureClass, Fault};
use crate::hooks::failure_log::FailureLog;
use crate::hooks::pool::{Lease, Pool};
use crate::hooks::wire::event_kind_from_wire;
use crate::hooks::wire_event::WireEvent;
use crate::pb;
use crate::telemetry::Metrics;

type Waiter = oneshot::Sender<Result<pb::HookVerdict, Fault>>;

#[derive(Default)]
struct Routing {
    next_seq: u64,
    // Ordered maps: a run's sequence numbers are few and increasing, and
    // SipHash plus the hash table's regrowth as `answered` fills cost more
    // per event than a B-tree's few comparisons (callgrind, figure 10).
    /// Blocking events awaiting their verdict, with their kind.
    waiting: BTreeMap<u64, (Waiter, i32)>,
    answered: BTreeMap<u64, i32>,
    expired: BTreeSet<u64>,
    poisoned: Option<Fault>,
    /// Whether the poison fault already failed some event.
    delivered: bool,
    /// The kind of the last event sent (or being sent).
    last_sent: i32,
    /// The latest observe events' seqs and kinds, so a verdict answering
    /// one is reported against the event it answers, however late it is
    /// read (bounded: an older one is reported after the last event sent).
    observed: VecDeque<(u64, i32)>,
    late: u64,
    closing: bool,
    /// Still waiting for a free stream slot on the hook's connections.
    queued: bool,
}

impl Routing {
    /// Breaks the stream with `fault`, seen after the event `after` (a wire
    /// kind; the last event sent when `None`). Returns whether this was the
    /// stream's first fault.
    fn poison(&mut self, mut fault: Fault, after: Option<i32>) -> bool {
        fault.seen_after = event_kind_from_wire(after.unwrap_or(self.last_sent));
        let first = self.poisoned.is_none();
        if first {
            self.poisoned = Some(fault.clone());
        }
        for (_, (w, _)) in std::mem::take(&mut self.waiting) {
            self.delivered |= w.send(Err(fault.clone())).is_ok();
        }
        first
    }
}

/// What a stream's reader task holds. If the task panics (a bug in
/// hookwire), dropping it on the way out fails the events waiting for a
/// verdict at once, and the stream with them: unwound without it, the
/// reader would leave them to wait for their deadlines.
struct Reader {
    routing: Arc<Mutex<Routing>>,
    owner: Arc<Owner>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The panic's text is not logged here: it may quote content.
            tracing::error!(hook = %self.owner.hook, "a hook stream's reader panicked; the stream is failed");
            self.routing.locked().poison(
                Fault::new(
                    FailureClass::StreamReset,
                    "hookwire's stream reader stopped on a bug",
                ),
                None,
            );
        }
    }
}

/// Whose stream this is, for what is counted and logged when nobody waits.
struct Owner {
    hook: String,
    metrics: Arc<Metrics>,
    /// The hook's warning budget, shared with its failures seen in runs.
    failure_log: Arc<Mutex<FailureLog>>,
}

/// An event waiting in a stream's queue, behind a pointer: tokio's channel
/// allocates its slots 32 at a time, and 32 inline events (472 bytes each)
/// made ~15 KB per stream at its creation, a quarter of what an in-flight
/// run with two hooks held (BENCHMARKS.md, figure 9). Shared rather than
/// boxed: an event stays in `Outbound::taken` until the server accepted the
/// stream, and is sent again from there if it refused it.
type Queued = Arc<WireEvent>;

pub struct RunStream {
    tx: Mutex<Option<mpsc::Sender<Queued>>>,
    routing: Arc<Mutex<Routing>>,
    /// Tells the reader that the run half-closed the stream, so that from
    /// then on the close grace bounds its wait for the server.
    closed: Arc<Notify>,
    reader: tokio::task::JoinHandle<()>,
    /// Shared with the reader: [`RunStream::close`] reports a fault no
    /// step reported.
    owner: Arc<Owner>,
}

/// A blocking event in flight.
pub struct Pending {
    seq: u64,
    rx: oneshot::Receiver<Result<pb::HookVerdict, Fault>>,
}

/// A blocking event handed to the stream ([`RunStream::send_blocking`]).
pub enum Sent<'a> {
    Queued(Pending),
    /// The stream's queue is full: the hook reads slower than events come.
    Full(Full<'a>),
}

/// An event waiting for room in its stream's queue.
pub struct Full<'a> {
    stream: &'a RunStream,
    tx: mpsc::Sender<Queued>,
    event: Queued,
    pending: Pending,
}

impl Full<'_> {
    /// Waits for room until `deadline`; an event the hook did not take by
    /// then fails with a deadline fault and never reaches it.
    pub async fn until(self, deadline: Instant) -> Result<Pending, Fault> {
        let Full {
            stream,
            tx,
            event,
            pending,
        } = self;
        match tokio::time::timeout_at(deadline, tx.send(event)).await {
            Ok(Ok(())) => Ok(pending),
            Ok(Err(_)) => Err(stream.fault_or(FailureClass::StreamReset, "stream closed")),
            Err(_) => {
                stream.expire(pending.seq);
                Err(Fault::new(
                    FailureClass::Deadline,
                    "hook did not read the event before the deadline",
                ))
            }
        }
    }
}

/// How long a stream may linger after hookwire half-closed it, waiting for
/// the hook to end its side.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

impl RunStream {
    /// Opens the stream without waiting for it: the call is made from a
    /// background task so events can be queued at once (grpcio servers only
    /// send headers with their first reply) and so opening never blocks a
    /// run past its deadline. Open failures surface on the first wait.
    ///
    /// The task first takes a slot on one of the hook's connections
    /// (waiting at most `slot_wait` while all are full). A stream the server
    /// refuses (REFUSED_STREAM: it did not process it) is opened again on
    /// another slot with the events it had taken, so a server's stream limit
    /// never fails a run.
    pub fn open(
        pool: Pool,
        capacity: usize,
        metadata: Vec<(&'static str, String)>,
        slot_wait: Duration,
        hook: String,
        metrics: Arc<Metrics>,
        failure_log: Arc<Mutex<FailureLog>>,
    ) -> RunStream {
        let owner = Owner {
            hook,
            metrics,
            failure_log,
        };
        Self::open_with(pool, capacity, metadata, slot_wait, CLOSE_GRACE, owner)
    }

    /// [`RunStream::open`] with the close grace given (tests shorten it).
    fn open_with(
        pool: Pool,
        capacity: usize,
        metadata: Vec<(&'static str, String)>,
        slot_wait: Duration,
        close_grace: Duration,
        owner: Owner,
    ) -> RunStream {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let routing = Arc::new(Mutex::new(Routing {
            next_seq: 1,
            queued: true,
            ..Default::default()
        }));
        let r = routing.clone();
        let closed = Arc::new(Notify::new());
        let half_closed = closed.clone();
        let owner = Arc::new(owner);
        let reader_owner = owner.clone();
        let reader = tokio::spawn(async move {
            let guard = Reader {
                routing: r,
                owner: reader_owner,
            };
            let (r, owner) = (&guard.routing, &guard.owner);
            // Boxed: the open phase's futures are larger than the reading
            // loop's, and inline they would stay in the task for the
            // run's whole life.
            let mut open = Box::pin(open_on_pool(pool, rx, metadata, slot_wait, r.clone()));
            // Registered once for the stream's life, not per message: the
            // close is seen whether the reader waits or routes a verdict.
            let half_closed = half_closed.notified();
            tokio::pin!(half_closed);
            // One deadline for the whole close, from the moment the close
            // is first seen: a grace per message would let a hook that
            // keeps sending (anything, more often than the grace) keep the
            // stream and its slot for good.
            let mut close_by: Option<Instant> = None;
            // A server that has not answered the call when the run ends
            // gets the close grace to do so, no more: a hung server would
            // otherwise keep the stream and its slot for good.
            let opened = tokio::select! {
                biased;
                o = &mut open => o,
                () = half_closed.as_mut() => {
                    let by = Instant::now() + close_grace;
                    close_by = Some(by);
                    tokio::time::timeout_at(by, &mut open).await.ok().flatten()
                }
            };
            drop(open);
            let Some((_lease, mut inbound)) = opened else {
                return;
            };
            loop {
                // Also checked here, not only by the select below: with
                // messages always ready, the biased select never polls the
                // close notification.
                if close_by.is_none() && r.locked().closing {
                    close_by = Some(Instant::now() + close_grace);
                }
                let next = if let Some(by) = close_by {
                    match tokio::time::timeout_at(by, inbound.message()).await {
                        Ok(m) => m,
                        Err(_) => return,
                    }
                } else {
                    tokio::select! {
                        biased;
                        m = inbound.message() => m,
                        // Half-closed while waiting: wait again, bounded.
                        () = half_closed.as_mut() => {
                            close_by = Some(Instant::now() + close_grace);
                            continue;
                        }
                    }
                };
                match next {
                    Ok(Some(v)) => route(r, v, owner),
                    Ok(None) => {
                        let mut g = r.locked();
                        if !g.closing || !g.waiting.is_empty() {
                            g.poison(
                                Fault::new(
                                    FailureClass::StreamReset,
                                    "hook server ended the stream before the run ended",
                                ),
                                None,
                            );
                        }
                        return;
                    }
                    Err(status) => {
                        let mut g = r.locked();
                        if !g.closing || !g.waiting.is_empty() {
                            g.poison(classify_status(&status, false), None);
                        }
                        return;
                    }
                }
            }
        });
        RunStream {
            tx: Mutex::new(Some(tx)),
            routing,
            closed,
            reader,
            owner,
        }
    }

    fn sender(&self) -> Option<mpsc::Sender<Queued>> {
        self.tx.locked().clone()
    }

    /// Sends a blocking event: queued at once when the stream has room,
    /// which is the common case; [`Sent::Full`] when the hook is slow to
    /// read, to wait for room with [`Full::until`]. Not an `async fn`: its
    /// future would hold the event (~750 bytes) for its whole life, and it
    /// is part of every hook call's future.
    pub fn send_blocking(&self, mut event: WireEvent) -> Result<Sent<'_>, Fault> {
        let (wtx, rx) = oneshot::channel();
        let seq = {
            let mut g = self.routing.locked();
            g.last_sent = event.event.kind;
            if let Some(f) = g.poisoned.clone() {
                g.delivered = true;
                return Err(f);
            }
            let seq = g.next_seq;
            g.next_seq += 1;
            g.waiting.insert(seq, (wtx, event.event.kind));
            seq
        };
        event.event.seq = seq;
        event.event.expects_verdict = true;
        let Some(tx) = self.sender() else {
            return Err(Fault::new(
                FailureClass::StreamReset,
                "stream already closed",
            ));
        };
        let pending = Pending { seq, rx };
        match tx.try_send(Arc::new(event)) {
            Ok(()) => Ok(Sent::Queued(pending)),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                Err(self.fault_or(FailureClass::StreamReset, "stream closed"))
            }
            Err(mpsc::error::TrySendError::Full(event)) => Ok(Sent::Full(Full {
                stream: self,
                tx,
                event,
                pending,
            })),
        }
    }

    /// Queues an observe event without waiting; returns false when it was
    /// dropped because the bounded queue is full.
    pub fn send_observe(&self, mut event: WireEvent) -> bool {
        {
            let mut g = self.routing.locked();
            g.last_sent = event.event.kind;
            if g.poisoned.is_some() {
                return false;
            }
            event.event.seq = g.next_seq;
            g.next_seq += 1;
            if g.observed.len() == OBSERVED_KEPT {
                g.observed.pop_front();
            }
            g.observed.push_back((event.event.seq, event.event.kind));
        }
        event.event.expects_verdict = false;
        match self.sender() {
            Some(tx) => tx.try_send(Arc::new(event)).is_ok(),
            None => false,
        }
    }

    pub async fn wait(
        &self,
        pending: Pending,
        deadline: Instant,
    ) -> Result<pb::HookVerdict, Fault> {
        match tokio::time::timeout_at(deadline, pending.rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => {
                self.routing.locked().delivered = true;
                Err(self.fault_or(FailureClass::StreamReset, "stream ended"))
            }
            Err(_) => {
                self.expire(pending.seq);
                if self.routing.locked().queued {
                    // The event never left hookwire (and now never will:
                    // the stream's body skips it), so the hook was not
                    // called.
                    Err(Fault::new(
                        FailureClass::Deadline,
                        "no verdict before the deadline: the stream was still waiting for a free slot on the hook's connections (every one at the server's stream limit; see connections.max)",
                    )
                    .unsent())
                } else {
                    Err(Fault::new(
                        FailureClass::Deadline,
                        "no verdict before the deadline",
                    ))
                }
            }
        }
    }

    fn expire(&self, seq: u64) {
        let mut g = self.routing.locked();
        if g.waiting.remove(&seq).is_some() {
            g.expired.insert(seq);
        }
    }

    fn fault_or(&self, class: FailureClass, detail: &str) -> Fault {
        self.routing
            .locked()
            .poisoned
            .clone()
            .unwrap_or_else(|| Fault::new(class, detail))
    }

    /// The fault that broke this stream, if any.
    pub fn poisoned(&self) -> Option<Fault> {
        self.routing.locked().poisoned.clone()
    }

    /// A fault that broke the stream between events (a duplicate or spurious
    /// verdict, a reset with nothing in flight) and has not failed any event
    /// yet. Taking it marks it reported.
    pub fn take_unreported(&self) -> Option<Fault> {
        let mut g = self.routing.locked();
        if g.delivered {
            return None;
        }
        let f = g.poisoned.clone()?;
        g.delivered = true;
        Some(f)
    }

    /// Broken, and its fault already failed an event: replace it.
    pub fn is_spent(&self) -> bool {
        let g = self.routing.locked();
        g.poisoned.is_some() && g.delivered
    }

    /// Verdicts that arrived after their deadline and were discarded.
    pub fn late_count(&self) -> u64 {
        self.routing.locked().late
    }

    /// Half-closes the stream (after run_end); the reader lingers at most
    /// [`CLOSE_GRACE`] in all (however much the hook still sends) for the
    /// hook to end its side, then resets the stream and gives its slot
    /// back.
    pub fn close(&self) {
        {
            let mut g = self.routing.locked();
            g.closing = true;
            // A fault that broke the stream after the run's last check (it
            // ran `check_faults` just before) and failed no event: no step
            // is left to report it, and the reader reports only faults seen
            // after the close. Under the lock, so it is reported once.
            report_unreported(&mut g, &self.owner);
        }
        self.tx.locked().take();
        // A permit if the reader is not waiting yet: it sees it next.
        self.closed.notify_one();
    }
}

impl Drop for RunStream {
    fn drop(&mut self) {
        // A closed stream's reader ends by itself within the close grace.
        if !self.routing.locked().closing {
            self.reader.abort();
        }
    }
}

/// Observe events remembered per stream for [`Routing::observed`].
const OBSERVED_KEPT: usize = 16;

/// Refused streams opened again on another slot before the run fails.
const MAX_REFUSALS: u32 = 8;

/// The events of a run's stream, as the request body of one attempt to
/// open it. Until the server has accepted the stream, the events an attempt
/// took are kept, so a refused attempt's events go out again on the next.
/// Takes a slot on one of the hook's connections and opens the stream
/// there with the events queued so far; a stream the server refuses is
/// opened again on another slot (at most [`MAX_REFUSALS`] times). `None`
/// when it could not be opened: the stream is poisoned with why.
async fn open_on_pool(
    pool: Pool,
    rx: mpsc::Receiver<Queued>,
    metadata: Vec<(&'static str, String)>,
    slot_wait: Duration,
    r: Arc<Mutex<Routing>>,
) -> Option<(Lease, tonic::Streaming<pb::HookVerdict>)> {
    let outbound = Outbound::new(rx, r.clone());
    let mut refusals = 0;
    loop {
        let lease = match pool.acquire(Instant::now() + slot_wait).await {
            Ok(l) => l,
            Err(fault) => {
                r.locked().poison(fault, None);
                return None;
            }
        };
        r.locked().queued = false;
        // Dropped with this attempt, also when the reader gives up on it.
        let _attempt = Attempt(lease.clone());
        let set_metadata = |md: &mut tonic::metadata::MetadataMap| {
            for (k, v) in &metadata {
                if let Ok(v) = v.parse() {
                    md.insert(*k, v);
                }
            }
        };
        let body = outbound.body(lease.clone());
        match open_process(lease.channel(), body, set_metadata).await {
            Ok(inbound) => {
                outbound.confirmed();
                lease.opened();
                return Some((lease, inbound));
            }
            Err(status) if is_refused(&status) && refusals < MAX_REFUSALS => {
                refusals += 1;
                lease.refused();
                outbound.rewind();
                r.locked().queued = true;
            }
            Err(status) => {
                lease.failed();
                let fault = classify_status(&status, true);
                r.locked().poison(fault, None);
                return None;
            }
        }
    }
}

/// One attempt to open the stream on a slot. Dropped before the attempt
/// ended (the run ended while the server had not answered), it tells the
/// pool ([`Lease::abandoned`]): a connection whose server never said a
/// word would otherwise keep the pool from opening any other. Once the
/// attempt ended, the limit is known and this changes nothing.
struct Attempt(Lease);

impl Drop for Attempt {
    fn drop(&mut self) {
        self.0.abandoned();
    }
}

struct Outbound {
    state: Arc<Mutex<OutState>>,
    routing: Arc<Mutex<Routing>>,
}

struct OutState {
    rx: mpsc::Receiver<Queued>,
    /// Taken by the current attempt before the server accepted the stream.
    taken: Vec<Queued>,
    /// To send before anything new: a refused attempt's events.
    replay: VecDeque<Queued>,
    accepted: bool,
    /// Which attempt may read: a refused attempt's body, if h2 still polls
    /// it, ends instead of taking events meant for the next.
    attempt: u32,
}

impl Outbound {
    fn new(rx: mpsc::Receiver<Queued>, routing: Arc<Mutex<Routing>>) -> Outbound {
        Outbound {
            routing,
            state: Arc::new(Mutex::new(OutState {
                rx,
                taken: Vec::new(),
                replay: VecDeque::new(),
                accepted: false,
                attempt: 0,
            })),
        }
    }

    fn body(&self, lease: Lease) -> Body {
        Body {
            state: self.state.clone(),
            routing: self.routing.clone(),
            attempt: self.state.locked().attempt,
            _lease: lease,
        }
    }

    fn confirmed(&self) {
        let mut s = self.state.locked();
        s.accepted = true;
        s.taken = Vec::new();
    }

    fn rewind(&self) {
        let mut s = self.state.locked();
        s.attempt += 1;
        let mut replay: VecDeque<_> = std::mem::take(&mut s.taken).into();
        replay.append(&mut s.replay);
        s.replay = replay;
    }
}

/// One attempt's request body. It holds the stream's slot: h2 counts the
/// stream until both sides ended, and this side ends when the body does.
struct Body {
    state: Arc<Mutex<OutState>>,
    /// The stream's routing, to skip events whose caller gave up.
    routing: Arc<Mutex<Routing>>,
    attempt: u32,
    _lease: Lease,
}

impl futures::Stream for Body {
    type Item = Queued;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Queued>> {
        let this = self.get_mut();
        let Ok(mut s) = this.state.lock() else {
            return Poll::Ready(None);
        };
        if s.attempt != this.attempt {
            return Poll::Ready(None);
        }
        let next = loop {
            let next = match s.replay.pop_front() {
                Some(e) => Some(e),
                None => match s.rx.poll_recv(cx) {
                    Poll::Ready(e) => e,
                    Poll::Pending => return Poll::Pending,
                },
            };
            // A blocking event whose deadline passed while it waited here
            // (for a slot, or for the hook to read) failed already: sent
            // now, it would have the hook act on an event the run has
            // given up on. Forgotten, so a verdict for it is spurious.
            match next {
                Some(e)
                    if e.event.expects_verdict
                        && this.routing.locked().expired.remove(&e.event.seq) => {}
                next => break next,
            }
        };
        if let (Some(e), false) = (&next, s.accepted) {
            s.taken.push(e.clone());
        }
        Poll::Ready(next)
    }
}

/// Whether the server refused the stream before processing it
/// (REFUSED_STREAM), which makes opening it again safe.
fn is_refused(status: &tonic::Status) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(e) = src {
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        src = e.source();
    }
    false
}

fn route(r: &Mutex<Routing>, v: pb::HookVerdict, owner: &Owner) {
    let mut g = r.locked();
    let seq = v.seq;
    if let Some((w, kind)) = g.waiting.remove(&seq) {
        g.answered.insert(seq, kind);
        if w.send(Ok(v)).is_err() {
            // Nobody waits any more: the run's deadline (or its end) came
            // first. Late, like one after its own deadline.
            late(&mut g, owner);
        }
        return;
    }
    if g.expired.remove(&seq) {
        late(&mut g, owner);
        return;
    }
    let (fault, after) = match g.answered.get(&seq) {
        Some(&kind) => (
            Fault::new(
                FailureClass::Duplicate,
                format!("second verdict for seq {seq}"),
            ),
            Some(kind),
        ),
        None => (
            Fault::new(
                FailureClass::Spurious,
                format!("verdict for seq {seq}, which was never sent or expects no verdict"),
            ),
            g.observed
                .iter()
                .find(|(s, _)| *s == seq)
                .map(|&(_, kind)| kind),
        ),
    };
    if !g.poison(fault, after) {
        return; // already broken: the first fault is the one reported
    }
    let Some(first) = g.poisoned.clone() else {
        return;
    };
    let event = first.seen_after.map_or("unknown", EventKind::name);
    tracing::debug!(hook = %owner.hook, class = %first.class, after = event, "hook stream fault; the run fails at its next step");
    if g.closing {
        report_unreported(&mut g, owner);
    }
}

/// The run is over, so no step will report the fault that broke the
/// stream if it failed no event yet: count and log it now, once.
fn report_unreported(g: &mut Routing, owner: &Owner) {
    if g.delivered {
        return;
    }
    let Some(first) = g.poisoned.clone() else {
        return;
    };
    g.delivered = true;
    let event = first.seen_after.map_or("unknown", EventKind::name);
    owner
        .metrics
        .hook_failure(&owner.hook, event, first.class.name());
    // Thinned like every hook failure warning (a hook that answers every
    // run twice must not flood the log).
    let admitted = owner
        .failure_log
        .locked()
        .admit(first.class, Instant::now().into_std());
    if let Some(suppressed) = admitted {
        tracing::warn!(
            hook = %owner.hook,
            event = %event,
            class = %first.class,
            detail = %first.log_detail(),
            suppressed,
            "hook stream failed after its run's last step; counted, the run's outcome stands"
        );
    }
}

fn late(g: &mut Routing, owner: &Owner) {
    g.late += 1;
    owner.metrics.hook_late_verdict(&owner.hook);
    tracing::debug!(hook = %owner.hook, "late verdict discarded");
}

/// What the transport errors under a status say, by type rather than by
/// message text (rustls, for one, never says "tls").
#[derive(Default)]
struct TransportCause {
    tls: bool,
    /// What did not match, when a TLS error says (expired, unknown CA...).
    tls_detail: Option<String>,
    refused: bool,
    timeout: bool,
    text: String,
}

fn transport_cause(status: &tonic::Status, said: &Said) -> Option<TransportCause> {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    src?;
    let mut cause = TransportCause::default();
    let mut text = said.sources.iter();
    while let Some(e) = src {
        if let Some(t) = e.downcast_ref::<crate::tls::HookTlsError>() {
            cause.tls = true;
            cause.tls_detail.get_or_insert_with(|| t.message.clone());
        }
        if let Some(r) = e.downcast_ref::<rustls::Error>() {
            cause.tls = true;
            cause
                .tls_detail
                .get_or_insert_with(|| crate::tls::describe_tls_error(r));
        }
        // The channel's own timer for the call's `grpc-timeout`: the same
        // deadline hookwire waits for, so the same class.
        if e.downcast_ref::<tonic::TimeoutExpired>().is_some() {
            cause.timeout = true;
        }
        if e.is::<crate::hooks::channel::ConnectTimedOut>() {
            cause.refused = true;
        }
        // TLS ended the call's connection after the handshake (a late
        // refusal, an alert): as the channel tells the call, or as the
        // connection's IO error, itself or as h2 hands it to each stream.
        let io = e
            .downcast_ref::<std::io::Error>()
            .or_else(|| e.downcast_ref::<h2::Error>().and_then(h2::Error::get_io));
        let failure = e
            .downcast_ref::<crate::tls::TlsFailure>()
            .map(|f| f.why.clone())
            .or_else(|| io.and_then(crate::tls::TlsFailure::find));
        if let Some(why) = failure {
            cause.tls = true;
            cause.tls_detail.get_or_insert(why);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if let Some(r) = io
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            {
                cause.tls = true;
                cause
                    .tls_detail
                    .get_or_insert_with(|| crate::tls::describe_tls_error(r));
            }
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::AddrNotAvailable
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
            ) {
                cause.refused = true;
            }
        }
        // Our words for it: text the peer chose (a GOAWAY's debug data)
        // must not steer the class either.
        if let Some(t) = text.next() {
            cause.text.push_str(&t.to_lowercase());
            cause.text.push_str(": ");
        }
        src = e.source();
    }
    Some(cause)
}

/// A status' message and the errors under it, outermost first, in words
/// that carry nothing the peer chose: the debug data of a GOAWAY the hook
/// server (or a proxy in front of it) sent is its own text and can quote
/// anything, so the GOAWAY is told by its reason alone, wherever its error
/// is quoted (tonic quotes an h2 error in the status message too).
struct Said {
    message: String,
    sources: Vec<String>,
    /// What those errors said with the peer's text in, for the debug log
    /// only.
    withheld: Vec<String>,
}

fn said(status: &tonic::Status) -> Said {
    let mut sources = Vec::new();
    let mut swaps: Vec<(String, String)> = Vec::new();
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(e) = src {
        let text = e.to_string();
        match e
            .downcast_ref::<h2::Error>()
            .and_then(|h2| go_away_told(h2, &text))
        {
            Some(ours) => {
                sources.push(ours.clone());
                swaps.push((text, ours));
            }
            None => sources.push(text),
        }
        src = e.source();
    }
    // Wrappers outside the GOAWAY's error may quote it: every quote goes.
    let scrub = |s: &str| {
        swaps.iter().fold(s.to_string(), |s, (raw, ours)| {
            s.replace(raw.as_str(), ours)
        })
    };
    Said {
        message: scrub(status.message()),
        sources: sources.iter().map(|s| scrub(s)).collect(),
        withheld: swaps.into_iter().map(|(raw, _)| raw).collect(),
    }
}

/// A GOAWAY with debug data from the peer (`text`: the error's own
/// `Display`, which appends that data), in our words: who sent it, its
/// reason, and the size of the data left out. `None` for any other h2
/// error: a reset has only a reason code, a GOAWAY without debug data only
/// h2's words, and one h2 itself sent only h2's own debug data.
fn go_away_told(e: &h2::Error, text: &str) -> Option<String> {
    let reason = e.reason()?;
    if !e.is_go_away() || e.is_library() || text.ends_with(&reason.to_string()) {
        return None;
    }
    let who = if e.is_remote() {
        "the server ended the connection"
    } else {
        "hookwire ended the connection"
    };
    let told = format!("{who} (GOAWAY {reason:?}: {reason})");
    // h2 says `<its words>: <reason> (b"<debug data>")`, with the data
    // escaped as `Bytes` prints it.
    Some(match debug_data_len(text) {
        Some(n) => format!("{told}; its {n}-byte debug data is logged at debug only"),
        None => format!("{told}; its debug data is logged at debug only"),
    })
}

/// How many bytes the debug data h2 quotes at the end of a GOAWAY's text
/// (`... (b"a\"b\x00")`) had: the escapes (`\xNN`, `\n`, `\"`...) are one
/// byte each.
fn debug_data_len(text: &str) -> Option<usize> {
    let start = text.find(" (b\"")? + 4;
    let quoted = text.get(start..)?.strip_suffix("\")")?;
    let mut n = 0;
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        if c == '\\' && chars.next()? == 'x' {
            chars.next()?;
            chars.next()?;
        }
        n += 1;
    }
    Some(n)
}

/// Maps a gRPC status to a failure class. Statuses with a transport source
/// come from the connection, not from the hook's own answer.
pub fn classify_status(status: &tonic::Status, opening: bool) -> Fault {
    let said = said(status);
    if !said.withheld.is_empty() {
        tracing::debug!(error = ?said.withheld, "a hook connection ended with GOAWAY debug data (left out of the failure's detail)");
    }
    let cause = transport_cause(status, &said);
    let class = match &cause {
        Some(c) if c.timeout => FailureClass::Deadline,
        Some(c) if c.tls || c.text.contains("certificate") || c.text.contains("handshake") => {
            FailureClass::Tls
        }
        Some(c)
            if c.refused
                || c.text.contains("tcp connect")
                || c.text.contains("dns")
                || c.text.contains("failed to lookup") =>
        {
            FailureClass::Connect
        }
        Some(_) => FailureClass::StreamReset,
        None if opening && status.code() == tonic::Code::Unimplemented => {
            FailureClass::StreamRefused
        }
        None if status.code() == tonic::Code::DeadlineExceeded => FailureClass::Deadline,
        None => FailureClass::Status,
    };
    match &cause {
        // The hook's own answer: its message is the hook server's text.
        None if status.message().is_empty() => Fault::new(class, format!("{:?}", status.code())),
        None => Fault::quoting_hook(
            class,
            format!("{:?}: {}", status.code(), status.message()),
            format!(
                "{:?} (the hook's {}-byte status message is logged at debug only)",
                status.code(),
                status.message().len()
            ),
        ),
        // Say what did not match first (a TLS failure names it).
        Some(TransportCause {
            tls_detail: Some(d),
            ..
        }) => Fault::new(class, d.clone()),
        Some(_) => Fault::new(
            class,
            format!("{:?}: {}", status.code(), error_chain(&said)),
        ),
    }
}

/// Wrappers that add no words of their own to the error they carry.
const GENERIC_ERRORS: [&str; 2] = ["transport error", "error"];

/// A status message and its error sources as one line, each piece once:
/// tonic, hyper and the OS tend to repeat each other ("tcp connect error
/// (transport error: tcp connect error: tcp connect error: connection
/// refused)" becomes "tcp connect error: connection refused").
fn error_chain(said: &Said) -> String {
    let parts = std::iter::once(&said.message).chain(&said.sources);
    // From the innermost cause outwards; a piece already said is dropped, and
    // a piece that ends by quoting what follows keeps only its own words.
    let mut out = String::new();
    for part in parts.rev() {
        let part = part.trim().trim_end_matches(':').trim();
        let part = part
            .strip_suffix(out.as_str())
            .map(|p| p.trim_end().trim_end_matches(':').trim_end())
            .filter(|_| !out.is_empty())
            .unwrap_or(part);
        if part.is_empty() || GENERIC_ERRORS.contains(&part) || out.contains(part) {
            continue;
        }
        out = if out.is_empty() {
            part.to_string()
        } else {
            format!("{part}: {out}")
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::wire_event::RunContext;

    fn event() -> WireEvent {
        let event = pb::HookEvent {
            kind: pb::EventKind::ModelRequest as i32,
            ..Default::default()
        };
        WireEvent::new(event, &RunContext::default(), pb::EventContext::default())
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_waits_for_room_until_its_deadline_and_never_reaches_the_hook_after() {
        // A stream whose queue holds one event, and a hook that reads none.
        let (tx, mut rx) = mpsc::channel(1);
        let s = RunStream {
            tx: Mutex::new(Some(tx)),
            routing: Arc::new(Mutex::new(Routing {
                next_seq: 1,
                ..Default::default()
            })),
            closed: Arc::default(),
            reader: tokio::spawn(async {}),
            owner: Arc::new(owner()),
        };
        assert!(matches!(s.send_blocking(event()), Ok(Sent::Queued(_))));
        let Ok(Sent::Full(full)) = s.send_blocking(event()) else {
            panic!("the queue is full: the event has to wait")
        };
        let fault = full
            .until(Instant::now() + Duration::from_millis(50))
            .await
            .err()
            .expect("nobody read");
        assert_eq!(fault.class, FailureClass::Deadline);
        assert!(s.routing.locked().expired.contains(&2));
        // Only the first event is in the queue: the late one was dropped.
        assert_eq!(rx.recv().await.map(|e| e.event.seq), Some(1));
        assert!(rx.try_recv().is_err());
        // Room again: queued at once.
        assert!(matches!(s.send_blocking(event()), Ok(Sent::Queued(_))));
        // The hook's side went away: the stream is reset.
        drop(rx);
        let Err(fault) = s.send_blocking(event()) else {
            panic!("a closed stream takes no event")
        };
        assert_eq!(fault.class, FailureClass::StreamReset);
    }

    fn owner() -> Owner {
        Owner {
            hook: "h".into(),
            metrics: Arc::new(Metrics::new()),
            failure_log: Arc::default(),
        }
    }

    /// A bug that panics in a stream's reader task fails the events
    /// waiting for a verdict at once (not at their deadlines) and the
    /// stream with them, so later events do not go to it.
    #[tokio::test]
    async fn a_reader_that_panics_fails_its_waiting_events_at_once() {
        let routing = Arc::new(Mutex::new(Routing::default()));
        let (tx, mut rx) = oneshot::channel();
        routing
            .locked()
            .waiting
            .insert(1, (tx, pb::EventKind::ToolCall as i32));
        let reader = Reader {
            routing: routing.clone(),
            owner: Arc::new(owner()),
        };
        let task = tokio::spawn(async move {
            let _reader = reader;
            // Held across an await, as the real reader holds it.
            tokio::task::yield_now().await;
            panic!("a bug in the reader");
        });
        assert!(task.await.unwrap_err().is_panic());
        let fault = rx
            .try_recv()
            .expect("answered when the reader panicked")
            .unwrap_err();
        assert_eq!(fault.class, FailureClass::StreamReset);
        assert!(routing.locked().poisoned.is_some(), "the stream is broken");
    }

    /// A hook server whose `Process` stream sends a verdict every 20 ms
    /// for as long as the stream lives, whatever hookwire sends or closes;
    /// `sent` counts them.
    struct Chatty {
        sent: Arc<std::sync::atomic::AtomicUsize>,
        more: Arc<Notify>,
    }

    #[tonic::async_trait]
    impl pb::hook_service_server::HookService for Chatty {
        async fn describe(
            &self,
            _: tonic::Request<pb::DescribeRequest>,
        ) -> Result<tonic::Response<pb::DescribeResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not asked"))
        }
        type ProcessStream =
            Pin<Box<dyn futures::Stream<Item = Result<pb::HookVerdict, tonic::Status>> + Send>>;
        async fn process(
            &self,
            _: tonic::Request<tonic::Streaming<pb::HookEvent>>,
        ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
            let (sent, more) = (self.sent.clone(), self.more.clone());
            let verdicts = futures::stream::unfold(0u64, move |n| {
                let (sent, more) = (sent.clone(), more.clone());
                async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    more.notify_waiters();
                    Some((Ok(verdict(1000 + n)), n + 1))
                }
            });
            Ok(tonic::Response::new(Box::pin(verdicts)))
        }
        async fn call_tool(
            &self,
            _: tonic::Request<pb::CallToolRequest>,
        ) -> Result<tonic::Response<pb::CallToolResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("no tools"))
        }
    }

    /// A pool of one connection to the hook server at `addr`, which gives
    /// up a connection whose server has not said its limit within
    /// `settings_wait`.
    fn pool_to(addr: std::net::SocketAddr, settings_wait: Duration) -> Pool {
        use crate::config::{ConnectionsConfig, HookCredentials};
        use crate::hooks::client::Dialer;
        use crate::hooks::credentials::Credentials;
        let dialer = Dialer::new(&format!("http://{addr}"), Duration::from_secs(5), None).unwrap();
        let credentials =
            Credentials::new("h", &HookCredentials::default(), Duration::MAX).unwrap();
        let closed = Arc::new(Notify::new());
        let connect: crate::hooks::pool::Connect = Box::new(move |report| {
            tonic::service::interceptor::InterceptedService::new(
                dialer.channel(closed.clone(), report),
                credentials.clone(),
            )
        });
        let config = ConnectionsConfig {
            max: 1,
            max_streams_per_connection: 10,
            idle_timeout: Duration::from_secs(60),
        };
        Pool::new("h", &config, settings_wait, connect)
    }

    /// The close grace bounds the whole close, not each message: a hook
    /// that keeps sending after its run ended (more often than the grace)
    /// still has its stream reset and its slot given back within the
    /// grace. Timed per message, the reader would wait for ever, and
    /// across runs the hook's slots would fill.
    #[tokio::test]
    async fn a_hook_that_keeps_sending_after_the_run_gives_its_slot_back_within_the_grace() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let more = Arc::new(Notify::new());
        let hook = Chatty {
            sent: sent.clone(),
            more: more.clone(),
        };
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(pb::hook_service_server::HookServiceServer::new(hook))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        let pool = pool_to(addr, Duration::from_secs(5));
        let grace = Duration::from_millis(200);
        let mut s = RunStream::open_with(
            pool.clone(),
            8,
            Vec::new(),
            Duration::from_secs(5),
            grace,
            owner(),
        );
        // The stream is open and the hook is sending.
        loop {
            let next = more.notified();
            if sent.load(std::sync::atomic::Ordering::SeqCst) >= 3 {
                break;
            }
            next.await;
        }
        assert_eq!(pool.load(), (1, 1));
        s.close();
        // Many graces, against a slow machine; without one deadline for the
        // close it is never.
        tokio::time::timeout(grace * 25, &mut s.reader)
            .await
            .expect("the reader ends within the close grace, however much the hook sends")
            .unwrap();
        assert!(
            sent.load(std::sync::atomic::Ordering::SeqCst) > 3,
            "the hook kept sending while the reader waited"
        );
        // The request body's share of the slot goes when hyper drops it,
        // a moment after the reset.
        tokio::time::timeout(Duration::from_secs(5), async {
            while pool.load().1 != 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the slot is given back");
        server.abort();
    }

    /// A stream given up (its run ended) while the server had not sent a
    /// byte takes its connection out of the pool: kept, that connection's
    /// unknown limit would hold back every stream that needs another one,
    /// and the next stream would go on it and hang as well.
    #[tokio::test]
    async fn a_stream_given_up_before_the_server_said_a_word_takes_its_connection_out() {
        // Accepts connections and never says a word (nor closes them).
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let accepted = Arc::new(Notify::new());
        let held = tokio::spawn({
            let accepted = accepted.clone();
            async move {
                let mut held = Vec::new();
                while let Ok((s, _)) = silent.accept().await {
                    held.push(s);
                    accepted.notify_one();
                }
            }
        });
        // Long enough that only the stream's giving up can forget it.
        let pool = pool_to(addr, Duration::from_secs(3600));
        let mut s = RunStream::open_with(
            pool.clone(),
            8,
            Vec::new(),
            Duration::from_secs(5),
            Duration::from_millis(50),
            owner(),
        );
        accepted.notified().await;
        assert_eq!(pool.load(), (1, 1));
        s.close();
        tokio::time::timeout(Duration::from_secs(5), &mut s.reader)
            .await
            .expect("the reader gives up on the open within the close grace")
            .unwrap();
        assert_eq!(pool.load().0, 0, "the silent connection left the pool");
        let next = pool.try_acquire().expect("the next stream opens another");
        assert_eq!(pool.load(), (1, 1));
        drop(next);
        held.abort();
    }

    /// A hook server that answers every blocking event at once, and keeps
    /// the seqs of the events it got.
    struct Echo {
        seen: Arc<Mutex<Vec<u64>>>,
    }

    #[tonic::async_trait]
    impl pb::hook_service_server::HookService for Echo {
        async fn describe(
            &self,
            _: tonic::Request<pb::DescribeRequest>,
        ) -> Result<tonic::Response<pb::DescribeResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("not asked"))
        }
        type ProcessStream =
            tokio_stream::wrappers::ReceiverStream<Result<pb::HookVerdict, tonic::Status>>;
        async fn process(
            &self,
            events: tonic::Request<tonic::Streaming<pb::HookEvent>>,
        ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
            let mut events = events.into_inner();
            let (tx, rx) = mpsc::channel(8);
            let seen = self.seen.clone();
            tokio::spawn(async move {
                while let Ok(Some(e)) = events.message().await {
                    seen.locked().push(e.seq);
                    if e.expects_verdict && tx.send(Ok(verdict(e.seq))).await.is_err() {
                        return;
                    }
                }
            });
            Ok(tonic::Response::new(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
        }
        async fn call_tool(
            &self,
            _: tonic::Request<pb::CallToolRequest>,
        ) -> Result<tonic::Response<pb::CallToolResponse>, tonic::Status> {
            Err(tonic::Status::unimplemented("no tools"))
        }
    }

    /// An event whose deadline passed while its stream waited for a free
    /// slot never reached the hook: its failure is marked unsent (not held
    /// against the hook by the breaker), and once a slot frees, the stream
    /// opens without it rather than have the hook act on an event the run
    /// gave up on.
    #[tokio::test]
    async fn an_event_that_expired_waiting_for_a_slot_never_reaches_the_hook() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook = Echo { seen: seen.clone() };
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(pb::hook_service_server::HookServiceServer::new(hook))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        let pool = pool_to(addr, Duration::from_secs(3600));
        // The pool's one slot is taken.
        let taken = pool.try_acquire().expect("the free slot");
        let s = RunStream::open_with(
            pool.clone(),
            8,
            Vec::new(),
            Duration::from_secs(60),
            CLOSE_GRACE,
            owner(),
        );
        let Ok(Sent::Queued(first)) = s.send_blocking(event()) else {
            panic!("queued")
        };
        let fault = s
            .wait(first, Instant::now() + Duration::from_millis(50))
            .await
            .expect_err("no slot, no verdict");
        assert_eq!(fault.class, FailureClass::Deadline);
        assert!(fault.unsent, "{}", fault.detail);
        drop(taken);
        let Ok(Sent::Queued(second)) = s.send_blocking(event()) else {
            panic!("queued")
        };
        let v = s
            .wait(second, Instant::now() + Duration::from_secs(5))
            .await
            .expect("answered once the stream opened");
        assert_eq!(v.seq, 2);
        // Events go in order: had the first been sent, it would be here.
        assert_eq!(*seen.locked(), vec![2], "the expired event was not sent");
        s.close();
        server.abort();
    }

    /// A fault that broke the stream after the run's last check
    /// (`check_faults` at run_end) but before the run closed it failed no
    /// event, and no step is left to: closing the stream counts it, once,
    /// as the reader counts one that comes after the close.
    #[tokio::test]
    async fn a_fault_between_the_last_check_and_the_close_is_counted_once() {
        let metrics = Arc::new(Metrics::new());
        let (tx, _rx) = mpsc::channel(1);
        let s = RunStream {
            tx: Mutex::new(Some(tx)),
            routing: Arc::new(Mutex::new(Routing {
                next_seq: 2,
                last_sent: pb::EventKind::RunEnd as i32,
                ..Default::default()
            })),
            closed: Arc::default(),
            reader: tokio::spawn(async {}),
            owner: Arc::new(Owner {
                hook: "h".into(),
                metrics: metrics.clone(),
                failure_log: Arc::default(),
            }),
        };
        // The hook server ended the stream with nothing in flight, after
        // the run's last check.
        s.routing.locked().poison(
            Fault::new(FailureClass::StreamReset, "hook server ended the stream"),
            None,
        );
        let series =
            r#"hookwire_hook_failures_total{hook="h",event="run_end",class="stream_reset"} "#;
        let count = || {
            metrics
                .encode()
                .lines()
                .find_map(|l| l.strip_prefix(series).map(str::to_owned))
        };
        assert_eq!(count(), None);
        s.close();
        assert_eq!(count().as_deref(), Some("1"));
        assert!(s.take_unreported().is_none(), "reported already");
        // A later fault on the broken stream is not counted again.
        route(&s.routing, verdict(9), &s.owner);
        s.close();
        assert_eq!(count().as_deref(), Some("1"));
    }

    fn verdict(seq: u64) -> pb::HookVerdict {
        pb::HookVerdict {
            seq,
            ..Default::default()
        }
    }

    #[test]
    fn a_verdict_answering_an_observe_event_is_reported_against_that_event() {
        let r = Mutex::new(Routing {
            next_seq: 3,
            // run_start (seq 1) went out as an observe event; another event
            // was sent before its answer was read.
            last_sent: pb::EventKind::ModelRequest as i32,
            observed: VecDeque::from([(1, pb::EventKind::RunStart as i32)]),
            ..Default::default()
        });
        route(&r, verdict(1), &owner());
        let fault = r.locked().poisoned.clone().expect("the stream broke");
        assert_eq!(fault.class, FailureClass::Spurious);
        assert_eq!(fault.seen_after, Some(EventKind::RunStart));
        // A seq never sent: after the last event sent.
        let r = Mutex::new(Routing {
            last_sent: pb::EventKind::ModelRequest as i32,
            ..Default::default()
        });
        route(&r, verdict(9), &owner());
        let fault = r.locked().poisoned.clone().unwrap();
        assert_eq!(fault.seen_after, Some(EventKind::ModelRequest));
    }

    #[tokio::test]
    async fn a_refused_connection_is_said_once() {
        // Bind then drop: a port nobody listens on.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        // hookwire's own channel, as every hook call uses it.
        let channel = crate::hooks::client::connect(
            &format!("http://127.0.0.1:{port}"),
            std::time::Duration::from_secs(5),
            None,
            Default::default(),
        )
        .unwrap();
        let status = pb::hook_service_client::HookServiceClient::new(channel)
            .describe(pb::DescribeRequest::default())
            .await
            .unwrap_err();
        let f = classify_status(&status, false);
        assert_eq!(f.class, FailureClass::Connect);
        assert_eq!(
            f.detail.matches("tcp connect error").count(),
            1,
            "{}",
            f.detail
        );
        assert!(
            f.detail.to_lowercase().contains("connection refused"),
            "{}",
            f.detail
        );
        assert!(!f.detail.contains("transport error"), "{}", f.detail);
    }

    #[test]
    fn the_channels_own_timeout_is_a_deadline_not_a_reset() {
        // What tonic's own channel answers when a call's `grpc-timeout`
        // expires before the response (hookwire's channel has no such timer,
        // its callers keep their own deadlines): were one to reach a hook
        // call, it is the same deadline, and must land in the same class.
        let status = tonic::Status::from_error(Box::new(tonic::TimeoutExpired(())));
        assert_eq!(status.code(), tonic::Code::Cancelled);
        assert_eq!(
            classify_status(&status, false).class,
            FailureClass::Deadline
        );
    }

    #[test]
    fn a_goaways_debug_data_is_measured_in_bytes_not_in_its_escapes() {
        // As h2 prints a GOAWAY that carried `a"b\0\xff\n` and `x`.
        let text = r#"connection error received: not a result of an error (b"a\"b\0\xff\n")"#;
        assert_eq!(debug_data_len(text), Some(6));
        assert_eq!(debug_data_len(r#"... (b"x")"#), Some(1));
        assert_eq!(
            debug_data_len("connection error received: unknown reason"),
            None
        );
    }

    #[test]
    fn a_hooks_status_message_stays_out_of_the_quiet_detail() {
        let status = tonic::Status::internal("cannot parse the SSN 078-05-1120");
        let f = classify_status(&status, false);
        assert_eq!(f.class, FailureClass::Status);
        assert!(f.detail.contains("078-05-1120"), "the client still sees it");
        assert!(
            !f.log_detail().contains("078-05-1120"),
            "{}",
            f.log_detail()
        );
        assert!(f.log_detail().starts_with("Internal"), "{}", f.log_detail());
        let bare = classify_status(&tonic::Status::internal(""), false);
        assert_eq!(bare.log_detail(), "Internal");
    }
}
