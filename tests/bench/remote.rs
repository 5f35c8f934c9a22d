//! What `--profile ... --remote` measures: hookwire's own instructions, with
//! the hook server and the OTLP collector in a child process (this same
//! binary with `--serve-remote`), so `valgrind --tool=callgrind` on the
//! parent counts hookwire (and the client) but neither the hook server nor
//! the collector. The exporter is on: spans are batched, encoded and sent
//! to the collector, which drops them.

use std::process::Stdio;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio_stream::StreamExt;

use crate::hook::{self, Steady};

struct Sink;

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        _: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// The child: the `steady` hook, a collector, the floor's echo server and
/// a hook that owns no tool (for merged hooks), each on port 0; prints
/// `remote HOOK_ADDR OTLP_ADDR FLOOR_ADDR FAN_ADDR` and serves until stdin
/// closes.
pub async fn serve() {
    let steady = hook::start(Steady::new("steady", true)).await;
    let fan = hook::start(Steady::new("fan", false)).await;
    let (floor, _stop_floor) = crate::floor::serve_echo().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let otlp = format!("http://{}", listener.local_addr().unwrap());
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
        if let Ok(s) = &s {
            let _ = s.set_nodelay(true);
        }
        s
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Sink))
            .serve_with_incoming(incoming),
    );
    println!("remote {} {otlp} {floor} {}", steady.addr, fan.addr);
    // Until the parent closes our stdin (it exits, or drops the child).
    let _ = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
            line.clear();
        }
    })
    .await;
}

/// The child process, with the addresses it serves on.
pub struct Remote {
    pub hook: String,
    pub otlp: String,
    pub floor: String,
    pub fan: String,
    _child: Child,
}

impl Remote {
    pub async fn start() -> Remote {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .args(["--serve-remote", "--no-telemetry"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the bench binary starts itself");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the remote child answers within 30 s")
            .unwrap()
            .expect("the remote child prints its addresses");
        let mut parts = line.split_whitespace().skip(1);
        let mut next = || parts.next().unwrap().to_string();
        let (hook, otlp, floor, fan) = (next(), next(), next(), next());
        Remote {
            hook,
            otlp,
            floor,
            fan,
            _child: child,
        }
    }
}
