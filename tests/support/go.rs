//! The Go example hook server (examples/hooks/go) as a real process.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/hooks/go");

/// Runs `make -C examples/hooks/go TARGET` and returns its output; fails
/// (never skips) when Go or the packages are missing, because CI installs
/// them.
pub async fn make(target: &str) -> String {
    let (ok, text) = super::command_output(Command::new("make").args(["-C", DIR, target])).await;
    assert!(
        ok,
        "`make -C examples/hooks/go {target}` failed; install the Go toolchain and packages with `make deps`:\n{text}"
    );
    text
}

pub struct GoHook {
    pub addr: String,
    pub child: Child,
}

impl GoHook {
    /// Builds the server, starts `bin/hook-server --port 0 <args>` and waits
    /// for its `listening on PORT` line.
    pub async fn start(args: &[&str]) -> GoHook {
        // Once per test process: tests run in parallel, and two makes in one
        // directory would race on the generated stubs.
        static BUILT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
        BUILT
            .get_or_init(|| async {
                make("build").await;
            })
            .await;
        let mut child = Command::new(format!("{DIR}/bin/hook-server"))
            .args(["--port", "0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the Go hook server was just built");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let port = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(p) = line.strip_prefix("listening on ") {
                    return p.trim().to_string();
                }
            }
            panic!("the Go hook server exited before listening");
        })
        .await
        .expect("the Go hook server did not start within 30s");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        GoHook {
            addr: format!("http://127.0.0.1:{port}"),
            child,
        }
    }
}
