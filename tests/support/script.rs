//! A hook server scripted at the wire level: it keeps every event of every
//! `Process` stream as received (seq, kind, context, expects_verdict), and
//! sends whatever verdicts the test's closure returns for each event, so a
//! test can read streams and sequence numbers, and send verdicts a
//! well-behaved server never would (late, for another seq, to an observe
//! event).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::Stream;
use hookwire::pb;
use tokio::sync::{mpsc, oneshot, Notify};
use tonic::{Request, Response, Status, Streaming};

use super::fault::proceed;

type Answer = Arc<dyn Fn(&pb::HookEvent) -> Vec<pb::HookVerdict> + Send + Sync>;

/// One `Process` stream as the hook server saw it.
#[derive(Clone, Debug, Default)]
pub struct StreamLog {
    pub events: Vec<pb::HookEvent>,
    /// hookwire ended its side of the stream.
    pub half_closed: bool,
}

impl StreamLog {
    pub fn kinds(&self) -> Vec<String> {
        self.events.iter().map(|e| kind_name(e.kind)).collect()
    }
    pub fn seqs(&self) -> Vec<u64> {
        self.events.iter().map(|e| e.seq).collect()
    }
    pub fn run_ids(&self) -> Vec<String> {
        self.events
            .iter()
            .map(|e| {
                e.context
                    .as_ref()
                    .map(|c| c.run_id.clone())
                    .unwrap_or_default()
            })
            .collect()
    }
}

pub fn kind_name(kind: i32) -> String {
    pb::EventKind::try_from(kind)
        .map(|k| {
            k.as_str_name()
                .trim_start_matches("EVENT_KIND_")
                .to_lowercase()
        })
        .unwrap_or_else(|_| format!("unknown({kind})"))
}

/// A continue verdict for a blocking event; nothing for an observe one.
pub fn continue_blocking(ev: &pb::HookEvent) -> Vec<pb::HookVerdict> {
    if !ev.expects_verdict {
        return vec![];
    }
    let kind = pb::EventKind::try_from(ev.kind).expect("a known event kind");
    vec![pb::HookVerdict {
        seq: ev.seq,
        verdict: Some(proceed(kind)),
        ..Default::default()
    }]
}

#[derive(Clone)]
pub struct ScriptHook {
    describe: pb::DescribeResponse,
    answer: Answer,
    log: Arc<Mutex<Vec<StreamLog>>>,
    /// Describe calls answered.
    pub describes: Arc<AtomicUsize>,
    changed: Arc<Notify>,
}

impl ScriptHook {
    /// Subscribed to `events`; `answer` decides what to send for each event.
    pub fn new(
        name: &str,
        events: &[pb::EventKind],
        answer: impl Fn(&pb::HookEvent) -> Vec<pb::HookVerdict> + Send + Sync + 'static,
    ) -> ScriptHook {
        ScriptHook {
            describe: hookwire::hook_server::describe(name, events),
            answer: Arc::new(answer),
            log: Default::default(),
            describes: Default::default(),
            changed: Default::default(),
        }
    }

    /// Every stream opened so far, in opening order.
    pub fn streams(&self) -> Vec<StreamLog> {
        self.log.lock().unwrap().clone()
    }

    /// Waits until `done` holds for the streams (checked after every event,
    /// stream end and Describe).
    pub async fn wait_until(&self, done: impl Fn(&[StreamLog]) -> bool) {
        loop {
            let changed = self.changed.notified();
            if done(&self.log.lock().unwrap()) {
                return;
            }
            changed.await;
        }
    }

    /// Waits until Describe was called.
    pub async fn wait_described(&self) {
        loop {
            let changed = self.changed.notified();
            if self.describes.load(Ordering::SeqCst) > 0 {
                return;
            }
            changed.await;
        }
    }

    /// Serves on `listener` until the returned server is stopped.
    pub fn serve(&self, listener: tokio::net::TcpListener) -> ScriptServer {
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let svc = pb::hook_service_server::HookServiceServer::new(self.clone());
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = rx.await;
                    },
                )
                .await;
        });
        ScriptServer {
            addr,
            stop: Some(tx),
            task,
        }
    }

    /// Serves on 127.0.0.1:0.
    pub async fn start(&self) -> ScriptServer {
        self.serve(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap())
    }
}

pub struct ScriptServer {
    pub addr: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptServer {
    /// Graceful shutdown: open connections get GOAWAY; returns once the
    /// server is gone.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for ScriptServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Out = Pin<Box<dyn Stream<Item = Result<pb::HookVerdict, Status>> + Send>>;

#[tonic::async_trait]
impl pb::hook_service_server::HookService for ScriptHook {
    async fn describe(
        &self,
        _: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        let d = self.describe.clone();
        self.describes.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
        Ok(Response::new(d))
    }

    type ProcessStream = Out;

    async fn process(
        &self,
        req: Request<Streaming<pb::HookEvent>>,
    ) -> Result<Response<Out>, Status> {
        let index = {
            let mut log = self.log.lock().unwrap();
            log.push(StreamLog::default());
            log.len() - 1
        };
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(ev)) => {
                        let answers = (this.answer)(&ev);
                        this.log.lock().unwrap()[index].events.push(ev);
                        this.changed.notify_waiters();
                        for v in answers {
                            let _ = tx.send(Ok(v)).await;
                        }
                    }
                    Ok(None) => {
                        this.log.lock().unwrap()[index].half_closed = true;
                        break;
                    }
                    // Reset, not half-closed.
                    Err(_) => break,
                }
            }
            this.changed.notify_waiters();
            // Dropping tx ends our side too.
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
