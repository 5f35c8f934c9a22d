//! `hookwire serve` processes (the real binary) sharing one store, for the
//! replica and durability scenarios.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use hookwire::pb;
use hookwire::pb::agent_service_client::AgentServiceClient;
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic::transport::Channel;

/// One `hookwire serve` process.
pub struct Replica {
    pub addr: String,
    /// The admin HTTP endpoint (metrics, health).
    pub admin: std::net::SocketAddr,
    child: tokio::process::Child,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Replica {
    /// Starts `hookwire serve --config cfg` and waits until it serves.
    pub async fn start(cfg: &Path) -> Replica {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
            .args(["serve", "--config"])
            .arg(cfg)
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .env_remove("HOOKWIRE_STORE")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn hookwire serve");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (addr_tx, addr_rx) = tokio::sync::oneshot::channel::<Option<(String, String)>>();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut errs = BufReader::new(child.stderr.take().unwrap()).lines();
        let l2 = log.clone();
        tokio::spawn(async move {
            let mut addr_tx = Some(addr_tx);
            let (mut addr, mut admin) = (None, None);
            while let Ok(Some(line)) = lines.next_line().await {
                for w in line.split_whitespace() {
                    if let Some(a) = w.strip_prefix("grpc=") {
                        addr = Some(a.to_string());
                    }
                    if let Some(a) = w.strip_prefix("admin=") {
                        admin = Some(a.to_string());
                    }
                }
                if line.contains("hookwire serving") {
                    if let Some(tx) = addr_tx.take() {
                        let _ = tx.send(addr.clone().zip(admin.clone()));
                    }
                }
                l2.lock().unwrap().push(line);
            }
            if let Some(tx) = addr_tx.take() {
                let _ = tx.send(None);
            }
        });
        let l3 = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = errs.next_line().await {
                l3.lock().unwrap().push(line);
            }
        });
        let (addr, admin) = match addr_rx.await {
            Ok(Some(a)) => a,
            _ => {
                let status = child.wait().await;
                panic!(
                    "hookwire serve did not start ({status:?}):\n{}",
                    log.lock().unwrap().join("\n")
                )
            }
        };
        Replica {
            addr: format!("http://{addr}"),
            admin: admin.parse().expect("the admin address"),
            child,
            log,
        }
    }

    pub async fn client(&self) -> AgentServiceClient<Channel> {
        AgentServiceClient::connect(self.addr.clone())
            .await
            .unwrap_or_else(|e| panic!("connect {}: {e}", self.addr))
    }

    /// SIGKILL: no drain, nothing recorded at exit.
    pub async fn kill(mut self) {
        self.child.kill().await.unwrap();
    }

    /// SIGTERM and wait for the exit; whether it exited 0.
    pub async fn terminate(mut self) -> bool {
        self.sigterm().await;
        self.child.wait().await.unwrap().success()
    }

    /// SIGTERM, without waiting for the exit.
    pub async fn sigterm(&mut self) {
        let pid = self.child.id().unwrap().to_string();
        let st = tokio::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap();
        assert!(st.success());
    }

    /// Waits for the exit; whether it exited 0.
    pub async fn exited_cleanly(mut self) -> bool {
        self.child.wait().await.unwrap().success()
    }

    pub fn logs(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

/// Writes a config for agent `a` (scripted model, get_weather offered)
/// with `hooks` (name, endpoint), the store, and `server:` lines.
pub fn write_config(dir: &Path, hooks: &[(&str, &str)], store: &str, server: &str) -> PathBuf {
    let mut yaml = super::config(
        &hooks
            .iter()
            .map(|(n, e)| (*n, *e, "timeout: 30s"))
            .collect::<Vec<_>>(),
        "tools: [get_weather]\nevent_budget: 60s\napproval_timeout: 300s",
    );
    yaml.push_str(&format!("store: {store}\nserver:\n"));
    for l in server.lines().filter(|l| !l.trim().is_empty()) {
        yaml.push_str(&format!("  {}\n", l.trim()));
    }
    if server.trim().is_empty() {
        yaml.push_str("  shutdown_grace: 10s\n");
    }
    let path = dir.join(format!("hookwire-{}.yaml", uuid::Uuid::new_v4().simple()));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Streams a run on `c` until `stop(event)` says so; returns the run id and
/// the stream (still open) with the events seen.
pub async fn run_until(
    c: &mut AgentServiceClient<Channel>,
    session: &str,
    input: &str,
    stop: impl Fn(&pb::run_event::Event) -> bool,
) -> (String, tonic::Streaming<pb::RunEvent>, Vec<pb::RunEvent>) {
    let mut s = c
        .run(pb::RunRequest {
            session_id: session.into(),
            input: input.into(),
        })
        .await
        .expect("run accepted")
        .into_inner();
    let mut seen = Vec::new();
    while let Some(ev) = s.message().await.expect("run stream") {
        let hit = ev.event.as_ref().is_some_and(&stop);
        let id = ev.run_id.clone();
        seen.push(ev);
        if hit {
            return (id, s, seen);
        }
    }
    panic!("stream ended before the awaited event: {seen:?}");
}

/// Reads the rest of a run's stream; its result.
pub async fn finish(mut s: tonic::Streaming<pb::RunEvent>) -> pb::RunResult {
    let mut out = Vec::new();
    while let Some(ev) = s.message().await.expect("run stream") {
        out.push(ev);
    }
    super::result_of(&out)
}

/// Every tool call in `transcript` has exactly one result after it.
pub fn every_call_has_a_result(transcript: &[pb::Message]) -> bool {
    let mut calls = Vec::new();
    let mut results = Vec::new();
    for m in transcript {
        for b in &m.blocks {
            match &b.kind {
                Some(pb::block::Kind::ToolCall(c)) => calls.push(c.id.clone()),
                Some(pb::block::Kind::ToolResult(r)) => results.push(r.call_id.clone()),
                _ => {}
            }
        }
    }
    calls.sort();
    results.sort();
    calls == results
}
