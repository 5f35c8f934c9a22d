//! The Python example hook server (examples/hooks/python) as a child
//! process: its redactor and policy features, which continue on the bench's
//! harmless content. Its tool feature stays off, since `steady` owns
//! `get_weather` here.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub struct PythonHook {
    pub addr: String,
    _child: Child,
}

impl PythonHook {
    /// Starts `server.py --port 0` and waits for its `listening on PORT`
    /// line; the error says why it could not.
    pub async fn start() -> Result<PythonHook, String> {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/hooks/python/server.py"
        );
        let mut child = Command::new(&python)
            .arg(script)
            .args(["--port", "0", "--features", "redactor,policy"])
            // Per-run info lines would be part of the cost measured.
            .args(["--log-level", "WARNING"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {python}: {e}"))?;
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = tokio::time::timeout(Duration::from_secs(60), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(p) = line.strip_prefix("listening on ") {
                    return Ok(p.trim().to_string());
                }
            }
            Err("server.py exited before listening (run `make deps`)".to_string())
        })
        .await
        .map_err(|_| "server.py did not listen within 60 s".to_string())??;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(PythonHook {
            addr: format!("http://127.0.0.1:{port}"),
            _child: child,
        })
    }
}
