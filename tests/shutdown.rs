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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_runs_and_exits_cleanly() {
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
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("hookwire.yaml");
    let yaml = config(&[("slow", &hook.addr, "timeout: 30s")], "event_budget: 30s")
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
    // Keep reading, so the log pipe never fills; the rest is checked at exit.
    let rest = tokio::spawn(async move {
        while let Some(line) = lines.next_line().await.unwrap() {
            logs.push_str(&line);
            logs.push('\n');
        }
        logs
    });
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
