//! The Python example hook server (examples/hooks/python) as a real process.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// The Python the suite runs: `$PYTHON` (the Makefile sets it), else the
/// project's virtualenv that `make deps` made, else `python3` on PATH. So a
/// plain `cargo test` after `make deps` uses the same packages as `make test`.
pub fn interpreter() -> String {
    if let Ok(py) = std::env::var("PYTHON") {
        return py;
    }
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python");
    if std::path::Path::new(venv).exists() {
        return venv.into();
    }
    "python3".into()
}

/// What to run when a Python package is missing.
pub const DEPS_HINT: &str = "run `make deps` (installs the suite's Python packages into .venv/)";

pub struct PythonHook {
    pub addr: String,
    pub child: Child,
    /// Its log lines (stderr), when started with [`PythonHook::start_logged`].
    pub log: Option<tokio::sync::mpsc::UnboundedReceiver<String>>,
}

impl PythonHook {
    /// Starts `server.py --port 0 <args>` and waits for its
    /// `listening on PORT` line. Fails with a clear message when the Python
    /// packages are missing (`make deps` installs them).
    pub async fn start(args: &[&str]) -> PythonHook {
        let mut all = vec!["--port", "0"];
        all.extend_from_slice(args);
        Self::start_on(&all).await
    }

    /// Like `start`, with the caller choosing `--port`.
    pub async fn start_on(args: &[&str]) -> PythonHook {
        Self::spawn(args, false).await
    }

    /// Like `start`, for another script that takes server.py's flags (a
    /// test fixture built on the example), with extra environment.
    #[allow(dead_code)]
    pub async fn start_script(script: &str, args: &[&str], env: &[(&str, &str)]) -> PythonHook {
        let mut all = vec!["--port", "0"];
        all.extend_from_slice(args);
        Self::spawn_script(script, &all, env, false).await
    }

    /// Like `start`, with its log lines delivered to `log` (and echoed to
    /// the test's stderr).
    #[allow(dead_code)] // not every test binary reads logs
    pub async fn start_logged(args: &[&str]) -> PythonHook {
        let mut all = vec!["--port", "0"];
        all.extend_from_slice(args);
        Self::spawn(&all, true).await
    }

    /// Like `start_logged`, with the caller choosing `--port`.
    #[allow(dead_code)]
    pub async fn start_logged_on(args: &[&str]) -> PythonHook {
        Self::spawn(args, true).await
    }

    async fn spawn(args: &[&str], logged: bool) -> PythonHook {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/hooks/python/server.py"
        );
        Self::spawn_script(script, args, &[], logged).await
    }

    async fn spawn_script(
        script: &str,
        args: &[&str],
        env: &[(&str, &str)],
        logged: bool,
    ) -> PythonHook {
        let python = interpreter();
        let mut child = Command::new(&python)
            .arg(script)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(if logged {
                Stdio::piped()
            } else {
                Stdio::inherit()
            })
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {python} ({e}): {DEPS_HINT}"));
        let log = child.stderr.take().map(|stderr| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    eprintln!("[python hook] {line}");
                    let _ = tx.send(line);
                }
            });
            rx
        });
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let port = tokio::time::timeout(std::time::Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                if let Some(p) = line.strip_prefix("listening on ") {
                    return p.trim().to_string();
                }
            }
            panic!("python hook exited before listening: {DEPS_HINT}");
        })
        .await
        .expect("python hook did not start within 60s");
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        PythonHook {
            addr: format!("http://127.0.0.1:{port}"),
            child,
            log,
        }
    }
}
