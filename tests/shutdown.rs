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
use tokio::io::AsyncReadExt;

async fn readyz(port: u16) -> String {
    http_get(([127, 0, 0, 1], port).into(), "/readyz").await
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
    let (grpc, admin) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("hookwire.yaml");
    let yaml = config(&[("slow", &hook.addr, "timeout: 30s")], "event_budget: 30s")
        .replace("hooks:\n", "server:\n  shutdown_grace: 10s\nhooks:\n");
    std::fs::write(&cfg, yaml).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .args([
            "--listen",
            &format!("127.0.0.1:{grpc}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
        ])
        .args(["--log-format", "json"])
        .env("HOOKWIRE_DATA_DIR", dir.path())
        .env_remove("HOOKWIRE_STORE")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
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
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("exits within the grace period")
        .unwrap();
    assert!(status.success(), "exit status {status:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let mut logs = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut logs)
        .await
        .unwrap();
    assert!(
        logs.lines().all(|l| l.starts_with('{')),
        "JSON logs: {logs}"
    );
    assert!(logs.contains("drained"));
}
