//! Graceful drain of the real binary: SIGTERM with a run in flight flips
//! health to NOT_SERVING and readiness to 503, refuses new runs with
//! UNAVAILABLE, lets the run finish, and exits 0 within the grace period.

mod support;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hookwire::hook_server::Reply;
use hookwire::pb;
use support::*;
use tokio::io::AsyncBufReadExt;

async fn readyz(port: u16) -> String {
    http_get(([127, 0, 0, 1], port).into(), "/readyz").await
}

/// The gRPC and admin ports from hookwire's `listening` log line (JSON).
fn listening_ports(line: &str) -> Option<(u16, u16)> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let f = &v["fields"];
    if f["message"] != "listening" {
        return None;
    }
    let port = |k: &str| f[k].as_str()?.rsplit(':').next()?.parse().ok();
    Some((port("grpc")?, port("admin")?))
}

/// A hook whose run_start waits for a permit of the returned semaphore;
/// the Notify fires as each run reaches it.
async fn held_run_start() -> (
    TestHook,
    Arc<tokio::sync::Semaphore>,
    Arc<tokio::sync::Notify>,
) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(tokio::sync::Notify::new());
    let (g, e) = (gate.clone(), entered.clone());
    let hook = FnHook::new("slow", &[pb::EventKind::RunStart])
        .on_run_start(move |_, _| {
            let (g, e) = (g.clone(), e.clone());
            async move {
                e.notify_one();
                let _p = g.acquire().await;
                Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    (hook, gate, entered)
}

/// `hookwire serve` with one held hook (`slow`, 30 s deadline) and a
/// 120 s grace, on ports read back from its JSON log.
struct Serving {
    child: tokio::process::Child,
    grpc: u16,
    admin: u16,
    /// Every log line, once the process exited.
    logs: tokio::task::JoinHandle<String>,
    _dir: tempfile::TempDir,
}

impl Serving {
    async fn start(hook: &str) -> Serving {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("hookwire.yaml");
        let yaml = config(&[("slow", hook, "timeout: 30s")], "event_budget: 30s")
            .replace("hooks:\n", "server:\n  shutdown_grace: 120s\nhooks:\n");
        std::fs::write(&cfg, yaml).unwrap();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
            .args(["serve", "--config"])
            .arg(&cfg)
            // Port 0: the ports bound are read back from the log.
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--log-format", "json"])
            .env("HOOKWIRE_DATA_DIR", dir.path())
            .env_remove("HOOKWIRE_STORE")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let mut logs = String::new();
        let (grpc, admin) = loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("hookwire exited before listening:\n{logs}"));
            logs.push_str(&line);
            logs.push('\n');
            if let Some(ports) = listening_ports(&line) {
                break ports;
            }
        };
        // Keep reading, so the log pipe never fills; the rest is checked
        // at exit.
        let logs = tokio::spawn(async move {
            while let Some(line) = lines.next_line().await.unwrap() {
                logs.push_str(&line);
                logs.push('\n');
            }
            logs
        });
        Serving {
            child,
            grpc,
            admin,
            logs,
            _dir: dir,
        }
    }

    fn signal(&self, which: &str) {
        let pid = self.child.id().unwrap().to_string();
        assert!(std::process::Command::new("kill")
            .args([which, &pid])
            .status()
            .unwrap()
            .success());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_runs_and_exits_cleanly() {
    let (hook, gate, entered) = held_run_start().await;
    let Serving {
        mut child,
        grpc,
        admin,
        logs: rest,
        _dir,
    } = Serving::start(&hook.addr).await;
    let server = TestServer::from_parts(
        format!("http://127.0.0.1:{grpc}"),
        tokio::spawn(async { Ok(()) }),
    );
    let mut c = server.client().await;
    assert!(readyz(admin).await.starts_with("HTTP/1.1 200"));
    let s = session(&mut c, "a").await;
    let mut c2 = c.clone();
    let s2 = s.clone();
    let run = tokio::spawn(async move { invoke(&mut c2, &s2, "hello").await });
    entered.notified().await;

    let pid = child.id().unwrap().to_string();
    let started = Instant::now();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());

    // Health flips: Watch streams each status change. The Watch stays open
    // to the end, like a mesh's or load balancer's would: it must not keep
    // the process alive after the drain.
    let ch = tonic::transport::Endpoint::from_shared(server.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
    let mut watch = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(r) = watch.message().await.unwrap() {
            if r.status == not_serving {
                return;
            }
        }
        panic!("health stream ended while serving");
    })
    .await
    .expect("health went NOT_SERVING");
    assert!(
        readyz(admin).await.starts_with("HTTP/1.1 503"),
        "readiness fails while draining"
    );

    // New work is refused while draining.
    let err = c
        .create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    let s3 = s.clone();
    let err = c
        .invoke(pb::RunRequest {
            session_id: s3,
            input: "again".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(err.message().contains("shutting down"));

    // The in-flight run completes.
    gate.add_permits(1);
    let r = run.await.unwrap();
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);

    drop(c);
    drop(health);
    // The drain ends with the last run, not with the 120 s grace; open
    // connections get 2 s more. Only waiting out the grace reaches 60 s.
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("exits once drained, long before the grace period ends")
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
    assert!(started.elapsed() < Duration::from_secs(60));
    let logs = rest.await.unwrap();
    assert!(
        logs.lines().all(|l| l.starts_with('{')),
        "JSON logs: {logs}"
    );
    assert!(logs.contains("drained"));
}

/// A second SIGINT or SIGTERM during the drain exits at once (status 130):
/// the second Ctrl-C was swallowed, and the operator waited out the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_the_drain_exits_at_once() {
    let (hook, _gate, entered) = held_run_start().await;
    let mut serving = Serving::start(&hook.addr).await;
    let server = TestServer::from_parts(
        format!("http://127.0.0.1:{}", serving.grpc),
        tokio::spawn(async { Ok(()) }),
    );
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let _run = tokio::spawn(async move { invoke(&mut c, &s, "hello").await });
    entered.notified().await;
    serving.signal("-TERM");
    // The first signal was taken: the drain has begun.
    tokio::time::timeout(Duration::from_secs(10), async {
        while !readyz(serving.admin).await.starts_with("HTTP/1.1 503") {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("readiness fails while draining");
    serving.signal("-INT");
    // The held run would keep the drain going for its hook's 30 s deadline.
    let status = tokio::time::timeout(Duration::from_secs(60), serving.child.wait())
        .await
        .expect("exits")
        .unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
    let logs = serving.logs.await.unwrap();
    assert!(logs.contains("second shutdown signal"), "{logs}");
}
