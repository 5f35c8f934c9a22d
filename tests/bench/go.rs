//! The Go example hook server (examples/hooks/go) as a child process, with
//! its audit log on so it subscribes to every event (it answers continue to
//! the blocking ones, then appends a JSON line per event).

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/hooks/go");

pub struct GoHook {
    pub addr: String,
    _child: Child,
    _audit: tempfile::TempDir,
}

impl GoHook {
    /// Builds the server (`make -C examples/hooks/go build`, offline) and
    /// starts it on port 0; the error says why it could not.
    pub async fn start() -> Result<GoHook, String> {
        let built = Command::new("make")
            .args(["-s", "-C", DIR, "build"])
            .stdout(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("cannot run make: {e}"))?;
        if !built.status.success() {
            return Err(format!(
                "the Go example did not build (run `make deps`): {}",
                String::from_utf8_lossy(&built.stderr).trim()
            ));
        }
        let audit = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut child = Command::new(format!("{DIR}/bin/hook-server"))
            .args(["--port", "0", "--audit-log"])
            .arg(audit.path().join("audit.jsonl"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the Go hook server: {e}"))?;
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(p) = line.strip_prefix("listening on ") {
                    return Ok(p.trim().to_string());
                }
            }
            Err("the Go hook server exited before listening".to_string())
        })
        .await
        .map_err(|_| "the Go hook server did not listen within 30 s".to_string())??;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(GoHook {
            addr: format!("http://127.0.0.1:{port}"),
            _child: child,
            _audit: audit,
        })
    }
}
