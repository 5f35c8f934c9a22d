//! A scriptable misbehaving hook server: on one event kind it breaks the
//! protocol in a chosen way; on every other event it answers continue.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use hookwire::pb;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Misbehave {
    /// Never answers.
    Hang,
    /// Answers after this delay.
    Late(Duration),
    /// Fails the stream with a gRPC error status.
    Status,
    /// Ends its side of the stream without answering.
    CloseStream,
    /// Answers a verdict of another event kind.
    WrongKind,
    /// Answers the right kind with an invalid body (bad JSON arguments,
    /// terminate without a reason).
    Invalid,
    /// Answers every event twice.
    Duplicate,
    /// Sends a verdict for a seq never sent, then the right one.
    Spurious,
    /// Refuses to open Process (UNIMPLEMENTED).
    RefuseStream,
    /// Opens Process, then never reads an event nor answers, with a small
    /// HTTP/2 window so unread events back up into hookwire quickly.
    Deaf,
    /// Answers an observe-only event (`on` is text_delta, run_end or
    /// session_end), which expects no verdict.
    AnswerObserve,
    /// Leaves `on` out of its Describe (configured, so hookwire expects it)
    /// and answers every event it gets.
    Unsubscribed,
    /// Keeps "the current event" in one place per stream: once this many
    /// events of kind `on` are in flight, answers each of them with the seq
    /// of the latest (the bug of a handler that is not ready for several
    /// events at once).
    LatestSeq(usize),
    /// Answers `on`, then ends its side of the stream with OK at once,
    /// before the run is over (events still to come are never read).
    AnswerThenEnd,
}

impl Misbehave {
    pub fn class(self) -> &'static str {
        match self {
            Misbehave::Hang | Misbehave::Late(_) | Misbehave::Deaf => "deadline",
            Misbehave::Status => "status",
            Misbehave::CloseStream | Misbehave::AnswerThenEnd => "stream_reset",
            Misbehave::WrongKind => "wrong_kind",
            Misbehave::Invalid => "invalid_verdict",
            Misbehave::Duplicate | Misbehave::LatestSeq(_) => "duplicate",
            Misbehave::Spurious | Misbehave::AnswerObserve => "spurious",
            Misbehave::RefuseStream => "stream_refused",
            Misbehave::Unsubscribed => "unsubscribed",
        }
    }
}

#[derive(Clone)]
pub struct FaultHook {
    pub events: Vec<pb::EventKind>,
    pub on: pb::EventKind,
    pub how: Misbehave,
    /// Blocking events received, all kinds.
    pub received: Arc<AtomicUsize>,
    /// Events of kind `on` it misbehaved on, observe ones included
    /// (counted once the misbehaviour was sent).
    pub faulted: Arc<AtomicUsize>,
    /// Signalled after each misbehaviour was sent.
    pub fault_sent: Arc<tokio::sync::Notify>,
    /// Streams opened.
    pub streams: Arc<AtomicUsize>,
    /// With `Duplicate`: the second verdict waits for this.
    pub release: Option<Arc<tokio::sync::Notify>>,
    /// With a tool event: misbehave only on this call index.
    pub only_index: Option<u32>,
}

pub fn proceed(kind: pb::EventKind) -> pb::hook_verdict::Verdict {
    use pb::hook_verdict::Verdict as V;
    let c = pb::Continue {};
    match kind {
        pb::EventKind::SessionStart => V::SessionStart(pb::SessionStartVerdict {
            action: Some(pb::session_start_verdict::Action::Proceed(c)),
        }),
        pb::EventKind::RunStart => V::RunStart(pb::RunStartVerdict {
            action: Some(pb::run_start_verdict::Action::Proceed(c)),
        }),
        pb::EventKind::ModelRequest => V::ModelRequest(pb::ModelRequestVerdict {
            action: Some(pb::model_request_verdict::Action::Proceed(c)),
        }),
        pb::EventKind::ModelResponse => V::ModelResponse(pb::ModelResponseVerdict {
            action: Some(pb::model_response_verdict::Action::Proceed(c)),
        }),
        pb::EventKind::InvalidToolCall => V::InvalidToolCall(pb::InvalidToolCallVerdict {
            action: Some(pb::invalid_tool_call_verdict::Action::Proceed(c)),
        }),
        pb::EventKind::ToolCall => V::ToolCall(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::Proceed(c)),
        }),
        pb::EventKind::ToolResult => V::ToolResult(pb::ToolResultVerdict {
            action: Some(pb::tool_result_verdict::Action::Proceed(c)),
        }),
        pb::EventKind::TurnEnd => V::TurnEnd(pb::TurnEndVerdict {
            action: Some(pb::turn_end_verdict::Action::Proceed(c)),
        }),
        other => panic!("{other:?} takes no verdict"),
    }
}

fn invalid(kind: pb::EventKind) -> pb::hook_verdict::Verdict {
    use pb::hook_verdict::Verdict as V;
    let t = pb::Terminate {
        reason: String::new(),
        reply: None,
    };
    match kind {
        pb::EventKind::ToolCall => V::ToolCall(pb::ToolCallVerdict {
            action: Some(pb::tool_call_verdict::Action::RewriteArgs(
                pb::RewriteArgs {
                    arguments_json: "{\"city\": ".into(),
                },
            )),
        }),
        pb::EventKind::ModelRequest => V::ModelRequest(pb::ModelRequestVerdict {
            action: Some(pb::model_request_verdict::Action::PatchRequest(
                pb::RequestPatch {
                    active_tools: Some(pb::ToolNames {
                        names: vec!["not_offered".into()],
                    }),
                    ..Default::default()
                },
            )),
        }),
        pb::EventKind::RunStart => V::RunStart(pb::RunStartVerdict {
            action: Some(pb::run_start_verdict::Action::Terminate(t)),
        }),
        pb::EventKind::ModelResponse => V::ModelResponse(pb::ModelResponseVerdict {
            action: Some(pb::model_response_verdict::Action::Terminate(t)),
        }),
        pb::EventKind::InvalidToolCall => V::InvalidToolCall(pb::InvalidToolCallVerdict {
            action: Some(pb::invalid_tool_call_verdict::Action::Terminate(t)),
        }),
        pb::EventKind::ToolResult => V::ToolResult(pb::ToolResultVerdict { action: None }),
        pb::EventKind::TurnEnd => V::TurnEnd(pb::TurnEndVerdict {
            action: Some(pb::turn_end_verdict::Action::Terminate(t)),
        }),
        pb::EventKind::SessionStart => V::SessionStart(pb::SessionStartVerdict { action: None }),
        other => panic!("{other:?} takes no verdict"),
    }
}

fn wrong(kind: pb::EventKind) -> pb::hook_verdict::Verdict {
    if kind == pb::EventKind::RunStart {
        proceed(pb::EventKind::ToolCall)
    } else {
        proceed(pb::EventKind::RunStart)
    }
}

type Out = Pin<Box<dyn Stream<Item = Result<pb::HookVerdict, Status>> + Send>>;

/// Counts a misbehaviour, and signals it, once it was sent (at the end of
/// its scope, `return` included).
struct Faulted(Arc<AtomicUsize>, Arc<tokio::sync::Notify>);

impl Drop for Faulted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
        self.1.notify_waiters();
    }
}

#[tonic::async_trait]
impl pb::hook_service_server::HookService for FaultHook {
    async fn describe(
        &self,
        _: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        let events: Vec<pb::EventKind> = self
            .events
            .iter()
            .copied()
            .filter(|e| !(self.how == Misbehave::Unsubscribed && *e == self.on))
            .collect();
        Ok(Response::new(hookwire::hook_server::describe(
            "fault", &events,
        )))
    }

    type ProcessStream = Out;

    async fn process(
        &self,
        req: Request<Streaming<pb::HookEvent>>,
    ) -> Result<Response<Out>, Status> {
        if self.how == Misbehave::RefuseStream {
            return Err(Status::unimplemented("Process is not implemented here"));
        }
        self.streams.fetch_add(1, Ordering::SeqCst);
        let mut inbound = req.into_inner();
        if self.how == Misbehave::Deaf {
            let (tx, rx) = mpsc::channel::<Result<pb::HookVerdict, Status>>(1);
            tokio::spawn(async move {
                // Both directions stay open, and nothing is ever read.
                let _held = (inbound, tx);
                std::future::pending::<()>().await;
            });
            return Ok(Response::new(Box::pin(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            )));
        }
        let (tx, rx) = mpsc::channel(16);
        let this = self.clone();
        tokio::spawn(async move {
            let mut in_flight = 0;
            while let Ok(Some(ev)) = inbound.message().await {
                if !ev.expects_verdict {
                    // An observe event (observe-only kind, or a hook with
                    // mode: observe): the same misbehaviour where it applies.
                    if ev.kind != this.on as i32 {
                        continue;
                    }
                    let _faulted = Faulted(this.faulted.clone(), this.fault_sent.clone());
                    let answer = pb::HookVerdict {
                        seq: ev.seq,
                        verdict: Some(proceed(pb::EventKind::TurnEnd)),
                        ..Default::default()
                    };
                    match this.how {
                        Misbehave::Status => {
                            let _ = tx.send(Err(Status::internal("injected failure"))).await;
                            return;
                        }
                        Misbehave::CloseStream => return,
                        Misbehave::AnswerObserve
                        | Misbehave::WrongKind
                        | Misbehave::Invalid
                        | Misbehave::Spurious => {
                            let _ = tx.send(Ok(answer)).await;
                        }
                        Misbehave::Duplicate => {
                            let _ = tx.send(Ok(answer.clone())).await;
                            let _ = tx.send(Ok(answer)).await;
                        }
                        Misbehave::Hang
                        | Misbehave::Late(_)
                        | Misbehave::RefuseStream
                        | Misbehave::Deaf
                        | Misbehave::LatestSeq(_)
                        | Misbehave::Unsubscribed
                        | Misbehave::AnswerThenEnd => {}
                    }
                    continue;
                }
                this.received.fetch_add(1, Ordering::SeqCst);
                let kind = pb::EventKind::try_from(ev.kind).unwrap();
                let ok = pb::HookVerdict {
                    seq: ev.seq,
                    verdict: Some(proceed(kind)),
                    ..Default::default()
                };
                let index = match &ev.payload {
                    Some(pb::hook_event::Payload::ToolCall(t)) => Some(t.call_index),
                    Some(pb::hook_event::Payload::ToolResult(t)) => Some(t.call_index),
                    _ => None,
                };
                let other_call = this.only_index.is_some() && index != this.only_index;
                if kind != this.on || other_call {
                    let _ = tx.send(Ok(ok)).await;
                    continue;
                }
                let _faulted = Faulted(this.faulted.clone(), this.fault_sent.clone());
                match this.how {
                    Misbehave::Hang
                    | Misbehave::RefuseStream
                    | Misbehave::Deaf
                    | Misbehave::AnswerObserve => {}
                    Misbehave::Unsubscribed => {
                        let _ = tx.send(Ok(ok)).await;
                    }
                    Misbehave::Late(d) => {
                        let tx = tx.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(d).await;
                            let _ = tx.send(Ok(ok)).await;
                        });
                    }
                    Misbehave::Status => {
                        let _ = tx.send(Err(Status::internal("injected failure"))).await;
                        return;
                    }
                    Misbehave::CloseStream => return,
                    Misbehave::AnswerThenEnd => {
                        let _ = tx.send(Ok(ok)).await;
                        return;
                    }
                    Misbehave::WrongKind => {
                        let _ = tx
                            .send(Ok(pb::HookVerdict {
                                seq: ev.seq,
                                verdict: Some(wrong(kind)),
                                ..Default::default()
                            }))
                            .await;
                    }
                    Misbehave::Invalid => {
                        let _ = tx
                            .send(Ok(pb::HookVerdict {
                                seq: ev.seq,
                                verdict: Some(invalid(kind)),
                                ..Default::default()
                            }))
                            .await;
                    }
                    Misbehave::Duplicate => {
                        let _ = tx.send(Ok(ok.clone())).await;
                        match &this.release {
                            None => {
                                let _ = tx.send(Ok(ok)).await;
                            }
                            Some(release) => {
                                let (tx, release) = (tx.clone(), release.clone());
                                tokio::spawn(async move {
                                    release.notified().await;
                                    let _ = tx.send(Ok(ok)).await;
                                });
                            }
                        }
                    }
                    Misbehave::LatestSeq(n) => {
                        in_flight += 1;
                        if in_flight == n {
                            for _ in 0..n {
                                let _ = tx.send(Ok(ok.clone())).await;
                            }
                            in_flight = 0;
                        }
                    }
                    Misbehave::Spurious => {
                        let bogus = pb::HookVerdict {
                            seq: ev.seq + 1000,
                            verdict: Some(proceed(kind)),
                            ..Default::default()
                        };
                        let _ = tx.send(Ok(bogus)).await;
                        let _ = tx.send(Ok(ok)).await;
                    }
                }
            }
            // hookwire half-closed the stream: end ours (after any late
            // verdict still pending, whose task holds a sender).
            drop(tx);
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn call_tool(
        &self,
        _: Request<pb::CallToolRequest>,
    ) -> Result<Response<pb::CallToolResponse>, Status> {
        Err(Status::unimplemented("owns no tools"))
    }
}

impl FaultHook {
    /// Waits until it misbehaved `n` times in all.
    pub async fn wait_faulted(&self, n: usize) {
        loop {
            let sent = self.fault_sent.notified();
            if self.faulted.load(Ordering::SeqCst) >= n {
                return;
            }
            sent.await;
        }
    }

    pub fn new(on: pb::EventKind, how: Misbehave, also: &[pb::EventKind]) -> FaultHook {
        let mut events = vec![on];
        events.extend_from_slice(also);
        FaultHook {
            events,
            on,
            how,
            received: Default::default(),
            faulted: Default::default(),
            fault_sent: Default::default(),
            streams: Default::default(),
            release: None,
            only_index: None,
        }
    }

    /// Serves on 127.0.0.1:0; returns the endpoint URL.
    pub async fn start(self) -> (String, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        // The smallest windows HTTP/2 allows make a deaf hook's unread
        // events stall hookwire's sender after ~64 KiB instead of ~1 MiB.
        let window = (self.how == Misbehave::Deaf).then_some(65_535);
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .initial_stream_window_size(window)
                .initial_connection_window_size(window)
                .add_service(pb::hook_service_server::HookServiceServer::new(self))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        (addr, task)
    }
}
