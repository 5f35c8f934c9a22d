//! The Node.js example hook server (examples/hooks/node) as a real process,
//! and scripts run with its packages. Fails (never skips) without Node.js or
//! the packages: the dependency step installs them (`npm ci` there).

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/hooks/node");

/// What to run when Node.js or the example's packages are missing.
pub const DEPS_HINT: &str =
    "install Node.js and the example's packages: run `make deps` (npm ci in examples/hooks/node)";

pub struct NodeHook {
    pub addr: String,
    pub child: Child,
}

impl NodeHook {
    /// Starts the example (`server.js --port 0`) and waits for its
    /// `listening on PORT` line.
    pub async fn start() -> NodeHook {
        Self::script(&format!("{DIR}/server.js"), &["--port", "0"]).await
    }

    /// Runs `node SCRIPT ARGS` from the example's directory (so it finds the
    /// example's packages) and waits for `listening on PORT`.
    pub async fn script(script: &str, args: &[&str]) -> NodeHook {
        assert!(
            std::path::Path::new(&format!("{DIR}/node_modules/@grpc/grpc-js")).exists(),
            "examples/hooks/node has no node_modules: {DEPS_HINT}"
        );
        let mut child = Command::new("node")
            .arg(script)
            .args(args)
            .current_dir(DIR)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run node ({e}): {DEPS_HINT}"));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = tokio::time::timeout(std::time::Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(p) = line.strip_prefix("listening on ") {
                    return p.trim().to_string();
                }
            }
            panic!("{script} exited before listening ({DEPS_HINT})");
        })
        .await
        .expect("the Node hook server did not start within 60s");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        NodeHook {
            addr: format!("http://127.0.0.1:{port}"),
            child,
        }
    }
}
