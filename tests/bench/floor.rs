//! The floor every latency figure is divided by: a raw tonic bidirectional
//! ping-pong on `HookService.Process` with a real hook event out and a
//! continue verdict back, and nothing of hookwire in between. Client and
//! server are set up like hookwire's hook channel and `hook_server::serve`
//! (TCP_NODELAY on both ends, the same keepalive, the same codec).

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use hookwire::pb;
use hookwire::pb::hook_service_client::HookServiceClient;
use hookwire::pb::hook_service_server::{HookService, HookServiceServer};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status, Streaming};

/// Answers each event with a continue verdict straight from the response
/// stream: no task, no channel.
struct Echo;

type Verdicts = Pin<Box<dyn Stream<Item = Result<pb::HookVerdict, Status>> + Send>>;

fn verdict(seq: u64) -> pb::HookVerdict {
    pb::HookVerdict {
        seq,
        verdict: Some(pb::hook_verdict::Verdict::ToolResult(
            pb::ToolResultVerdict {
                action: Some(pb::tool_result_verdict::Action::Proceed(pb::Continue {})),
            },
        )),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl HookService for Echo {
    async fn describe(
        &self,
        _: Request<pb::DescribeRequest>,
    ) -> Result<Response<pb::DescribeResponse>, Status> {
        Ok(Response::new(pb::DescribeResponse::default()))
    }

    type ProcessStream = Verdicts;

    async fn process(
        &self,
        req: Request<Streaming<pb::HookEvent>>,
    ) -> Result<Response<Verdicts>, Status> {
        let inbound = req.into_inner();
        Ok(Response::new(Box::pin(
            inbound.map(|ev| ev.map(|e| verdict(e.seq))),
        )))
    }

    async fn call_tool(
        &self,
        _: Request<pb::CallToolRequest>,
    ) -> Result<Response<pb::CallToolResponse>, Status> {
        Err(Status::unimplemented("floor server owns no tools"))
    }
}

/// The echo server and a channel to it, set up like a hook's.
pub struct Floor {
    channel: Channel,
    event: pb::HookEvent,
    _stop: Option<oneshot::Sender<()>>,
}

/// The echo server on port 0: its address, and what stops it when dropped.
pub async fn serve_echo() -> (String, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
        if let Ok(s) = &s {
            let _ = s.set_nodelay(true);
        }
        s
    });
    let (stop, rx) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HookServiceServer::new(Echo))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = rx.await;
            }),
    );
    (addr, stop)
}

impl Floor {
    /// Serves on port 0; every ping carries `event`.
    pub async fn start(event: pb::HookEvent) -> Floor {
        let (addr, stop) = serve_echo().await;
        let mut floor = Floor::connect(addr, event);
        floor._stop = Some(stop);
        floor
    }

    /// A channel to an echo server elsewhere (`serve_echo` in another
    /// process: instruction counts of the client side only).
    pub fn connect(addr: String, event: pb::HookEvent) -> Floor {
        // The settings of hookwire's HookClient.
        let channel = Endpoint::from_shared(addr)
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(300))
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(false)
            .connect_lazy();
        Floor {
            channel,
            event,
            _stop: None,
        }
    }

    /// A channel to another hook server, pinged with the same event.
    pub fn to(&self, addr: String) -> Floor {
        Floor::connect(addr, self.event.clone())
    }

    /// Opens a stream the way hookwire does (first event queued before the
    /// call is awaited) and returns it after the first round trip.
    async fn open(&self) -> PingStream {
        PingStream::open(&self.channel, &self.event).await
    }

    /// Opens `n` streams one after another, one round trip each: what a
    /// run pays per hook before its first verdict, without hookwire.
    pub async fn open_streams(&self, n: usize) {
        for _ in 0..n {
            self.open().await.close().await;
        }
    }

    /// Round-trip times of `n` sequential pings on one stream.
    pub async fn round_trips(&self, n: usize) -> Vec<Duration> {
        let mut s = self.open().await;
        for _ in 0..n.min(50) {
            s.ping().await;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            s.ping().await;
            out.push(t.elapsed());
        }
        out
    }

    /// `pings` round trips spread over `streams` streams ping-ponging at once
    /// (a fixed amount of work, for instruction counts).
    pub async fn concurrent_pings(&self, streams: usize, pings: usize) {
        let mut tasks = Vec::new();
        for _ in 0..streams {
            let mut s = self.open().await;
            tasks.push(tokio::spawn(async move {
                for _ in 0..pings / streams {
                    s.ping().await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }

    /// Round trips per second with `streams` streams ping-ponging at once on
    /// the one connection, over `window` after a short warm-up.
    pub async fn throughput(&self, streams: usize, window: Duration, verbose: bool) -> f64 {
        let tally = Tally::default();
        let mut opened = Vec::new();
        for _ in 0..streams {
            opened.push(self.open().await);
        }
        let tasks = opened
            .into_iter()
            .map(|mut s| {
                let tally = tally.clone();
                tokio::spawn(async move {
                    while tally.running() {
                        s.ping().await;
                        tally.add();
                    }
                })
            })
            .collect();
        tally.rate(tasks, window, verbose).await
    }

    /// Round trips per second with `streams` workers at once, each opening
    /// a stream, making `per_stream` round trips on it (the first is the
    /// open's) and closing it, over and over: a run's hook stream, one per
    /// run, with tonic alone. What the protocol's shape costs on this stack
    /// before hookwire or the run does anything.
    pub async fn throughput_per_stream_of(
        &self,
        streams: usize,
        per_stream: usize,
        window: Duration,
        verbose: bool,
    ) -> f64 {
        let tally = Tally::default();
        let tasks = (0..streams)
            .map(|_| {
                let (channel, event) = (self.channel.clone(), self.event.clone());
                let tally = tally.clone();
                tokio::spawn(async move {
                    while tally.running() {
                        let mut s = PingStream::open(&channel, &event).await;
                        tally.add();
                        for _ in 1..per_stream {
                            s.ping().await;
                            tally.add();
                        }
                        s.close().await;
                    }
                })
            })
            .collect();
        tally.rate(tasks, window, verbose).await
    }
}

/// Round trips counted by a floor's workers, and the flag that stops them.
#[derive(Clone, Default)]
struct Tally {
    count: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Tally {
    fn running(&self) -> bool {
        !self.stop.load(Ordering::Relaxed)
    }

    fn add(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The count's rate over the window; then stops `workers` and waits
    /// for them.
    async fn rate(self, workers: Vec<JoinHandle<()>>, window: Duration, verbose: bool) -> f64 {
        let rate = window_rate(&self.count, window, verbose).await;
        self.stop.store(true, Ordering::Relaxed);
        for w in workers {
            let _ = w.await;
        }
        rate
    }
}

/// Counts `count`'s increase per second over `window`, after a warm-up of a
/// fifth of it.
pub async fn window_rate(count: &AtomicU64, window: Duration, verbose: bool) -> f64 {
    tokio::time::sleep(window / 5).await;
    let (c0, t0, cpu0) = (count.load(Ordering::Relaxed), Instant::now(), cpu_seconds());
    tokio::time::sleep(window).await;
    let (c1, t1, cpu1) = (count.load(Ordering::Relaxed), Instant::now(), cpu_seconds());
    let secs = (t1 - t0).as_secs_f64();
    if verbose {
        eprintln!(
            "    (process CPU over the window: {:.0}%)",
            (cpu1 - cpu0) / secs * 100.0
        );
    }
    (c1 - c0) as f64 / secs
}

/// User plus system CPU time of this process so far (/proc/self/stat, in
/// clock ticks of 1/100 s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // After the command name: state is field 0, utime 11, stime 12.
    (ticks(11) + ticks(12)) / 100.0
}

struct PingStream {
    tx: mpsc::Sender<pb::HookEvent>,
    inbound: Streaming<pb::HookVerdict>,
    event: pb::HookEvent,
}

impl PingStream {
    async fn open(channel: &Channel, event: &pb::HookEvent) -> PingStream {
        let mut client =
            HookServiceClient::new(channel.clone()).max_decoding_message_size(16 * 1024 * 1024);
        let (tx, rx) = mpsc::channel(256);
        tx.send(event.clone()).await.unwrap();
        let mut inbound = client
            .process(ReceiverStream::new(rx))
            .await
            .expect("floor stream opens")
            .into_inner();
        inbound.message().await.unwrap().expect("first verdict");
        PingStream {
            tx,
            inbound,
            event: event.clone(),
        }
    }

    /// Half-closes the stream and reads it to its end, as a run's end does.
    async fn close(self) {
        drop(self.tx);
        let mut inbound = self.inbound;
        while inbound.message().await.ok().flatten().is_some() {}
    }

    async fn ping(&mut self) {
        self.tx.send(self.event.clone()).await.unwrap();
        self.inbound.message().await.unwrap().expect("verdict");
    }
}
