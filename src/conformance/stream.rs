//! One `Process` stream as the checker drives it: opened exactly as
//! hookwire opens one (lazily, with the first event already queued, from a
//! task of its own), recording every verdict with its arrival time.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::hooks::client::HookChannel;

use crate::conformance::transcript::{Arrival, SentEvent, StreamEnd, StreamLog};
use crate::event::EventKind;
use crate::hooks::failure::Fault;
use crate::hooks::payload::Payload;
use crate::hooks::stream::classify_status;
use crate::pb;
use crate::pb::hook_service_client::HookServiceClient;

enum Inbound {
    Verdict(Box<pb::HookVerdict>, Instant),
    End {
        result: Result<(), Fault>,
        at: Instant,
        opening: bool,
    },
}

/// The scripted runs send far fewer events than this per stream, so a send
/// never waits for room.
const QUEUE: usize = 64;

pub struct Recorder {
    name: String,
    client: HookServiceClient<HookChannel>,
    tx: Option<mpsc::Sender<pb::HookEvent>>,
    inbound: Option<mpsc::UnboundedReceiver<Inbound>>,
    task: Option<tokio::task::JoinHandle<()>>,
    next_seq: u64,
    events: Vec<SentEvent>,
    arrivals: Vec<Arrival>,
    end: Option<StreamEnd>,
    half_closed_at: Option<Instant>,
    together: Vec<Vec<u64>>,
}

impl Recorder {
    pub fn new(name: impl Into<String>, client: HookServiceClient<HookChannel>) -> Recorder {
        Recorder {
            name: name.into(),
            client,
            tx: None,
            inbound: None,
            task: None,
            next_seq: 1,
            events: Vec::new(),
            arrivals: Vec::new(),
            end: None,
            half_closed_at: None,
            together: Vec::new(),
        }
    }

    /// Records that these events were all in flight before any of their
    /// verdicts was awaited.
    pub fn in_flight_together(&mut self, seqs: Vec<u64>) {
        if seqs.len() > 1 {
            self.together.push(seqs);
        }
    }

    /// Sends one event (opening the stream with it if it is the first) and
    /// returns its seq.
    pub fn send(
        &mut self,
        kind: EventKind,
        subject: String,
        context: pb::EventContext,
        payload: pb::hook_event::Payload,
        judged_on: Option<Payload>,
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let deadline = Duration::from_millis(context.deadline_remaining_ms);
        let traceparent = context.traceparent.clone();
        let scratchpad = judged_on.as_ref().map(|_| {
            context
                .scratchpad
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        });
        let event = pb::HookEvent {
            seq,
            kind: pb::EventKind::from(kind) as i32,
            context: Some(context),
            expects_verdict: kind.is_blocking(),
            payload: Some(payload),
        };
        match &self.tx {
            Some(tx) => {
                // A full or closed queue means the stream is gone; its end
                // (recorded by the reader) explains the missing verdict.
                let _ = tx.try_send(event);
            }
            None if self.task.is_none() => self.open(event, traceparent),
            None => {}
        }
        self.events.push(SentEvent {
            seq,
            kind,
            subject,
            expects_verdict: kind.is_blocking(),
            deadline,
            sent_at: Instant::now(),
            waited: Duration::ZERO,
            payload: judged_on,
            scratchpad,
        });
        seq
    }

    /// Queues `first` before calling `Process`, from a task of its own: a
    /// grpcio server sends its response headers only with its first reply,
    /// so awaiting the call before sending would hang (DESIGN.md).
    fn open(&mut self, first: pb::HookEvent, traceparent: String) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let _ = tx.try_send(first);
        let (in_tx, in_rx) = mpsc::unbounded_channel();
        let mut client = self.client.clone();
        self.task = Some(tokio::spawn(async move {
            let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
            if let Ok(v) = traceparent.parse() {
                req.metadata_mut().insert("traceparent", v);
            }
            let mut stream = match client.process(req).await {
                Ok(r) => r.into_inner(),
                Err(status) => {
                    let _ = in_tx.send(Inbound::End {
                        result: Err(classify_status(&status, true)),
                        at: Instant::now(),
                        opening: true,
                    });
                    return;
                }
            };
            loop {
                let next = stream.message().await;
                let at = Instant::now();
                let end = match next {
                    Ok(Some(v)) => {
                        let _ = in_tx.send(Inbound::Verdict(Box::new(v), at));
                        continue;
                    }
                    Ok(None) => Ok(()),
                    Err(status) => Err(classify_status(&status, false)),
                };
                let _ = in_tx.send(Inbound::End {
                    result: end,
                    at,
                    opening: false,
                });
                return;
            }
        }));
        self.tx = Some(tx);
        self.inbound = Some(in_rx);
    }

    fn record(&mut self, msg: Inbound) {
        match msg {
            Inbound::Verdict(verdict, at) => self.arrivals.push(Arrival {
                verdict: *verdict,
                at,
            }),
            Inbound::End {
                result,
                at,
                opening,
            } => {
                self.end = Some(match (result, self.half_closed_at) {
                    // Only an end after the half-close is clean: one that
                    // came before it (read from the queue only now) left
                    // events unread, which hookwire takes as a broken
                    // stream.
                    (Ok(()), Some(closed)) if at >= closed => StreamEnd::Clean {
                        after: at.saturating_duration_since(closed),
                    },
                    (Ok(()), _) => StreamEnd::Early { at },
                    (Err(fault), _) => StreamEnd::Failed { fault, at, opening },
                });
                self.tx = None;
            }
        }
    }

    fn first_answer(&self, seq: u64) -> Option<Arrival> {
        self.arrivals.iter().find(|a| a.verdict.seq == seq).cloned()
    }

    /// Waits for the first verdict of `seq` until `patience` after it was
    /// sent; everything else that arrives meanwhile is recorded too. The
    /// flag says whether it came within the event's deadline.
    pub async fn wait(&mut self, seq: u64, patience: Duration) -> Option<(Arrival, bool)> {
        let (sent_at, deadline) = self
            .events
            .iter()
            .find(|e| e.seq == seq)
            .map(|e| (e.sent_at, e.deadline))?;
        let until = sent_at + patience;
        let found = loop {
            if let Some(a) = self.first_answer(seq) {
                break Some(a);
            }
            if self.end.is_some() {
                break None;
            }
            let Some(inbound) = self.inbound.as_mut() else {
                break None;
            };
            match tokio::time::timeout_at(until, inbound.recv()).await {
                Ok(Some(msg)) => self.record(msg),
                Ok(None) | Err(_) => break None,
            }
        };
        if let Some(ev) = self.events.iter_mut().find(|e| e.seq == seq) {
            ev.waited = Instant::now().saturating_duration_since(sent_at);
        }
        found.map(|a| {
            let in_time = a.at.saturating_duration_since(sent_at) <= deadline;
            (a, in_time)
        })
    }

    /// Half-closes (as hookwire does after run_end or a session event) and
    /// waits up to `patience` for the hook server to end its side. `None`
    /// when the stream was never opened.
    pub async fn close(mut self, patience: Duration) -> Option<StreamLog> {
        self.task.as_ref()?;
        // Before the half-close goes out: the server's end, stamped on
        // another worker, can come before this thread runs again, and an
        // end stamped before the half-close is taken for an early one.
        let closed = Instant::now();
        self.tx = None;
        if self.end.is_none() {
            self.half_closed_at = Some(closed);
        }
        while self.end.is_none() {
            let Some(inbound) = self.inbound.as_mut() else {
                break;
            };
            match tokio::time::timeout_at(closed + patience, inbound.recv()).await {
                Ok(Some(msg)) => self.record(msg),
                Ok(None) => break,
                Err(_) => {
                    self.end = Some(StreamEnd::NotClosed { waited: patience });
                }
            }
        }
        Some(StreamLog {
            name: std::mem::take(&mut self.name),
            events: std::mem::take(&mut self.events),
            arrivals: std::mem::take(&mut self.arrivals),
            end: self
                .end
                .take()
                .unwrap_or(StreamEnd::NotClosed { waited: patience }),
            half_closed_at: self.half_closed_at,
            together: std::mem::take(&mut self.together),
        })
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}
