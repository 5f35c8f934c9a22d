//! fakellm (PyPI `fakellm`, a third-party OpenAI-compatible mock server with
//! rule-based YAML scripts) as a real process on a free port. Required, not
//! optional: a missing install fails and says to run `make deps`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

pub const FAKELLM_HINT: &str =
    "run `make deps` (installs fakellm==0.3.5 from deploy/requirements-dev.txt into .venv/)";

pub fn python() -> String {
    super::python::interpreter()
}

/// A fakellm server process with its own rules file; killed on drop.
pub struct FakeLlm {
    child: Child,
    pub port: u16,
    log: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl FakeLlm {
    pub fn start(rules_yaml: &str) -> FakeLlm {
        let py = python();
        let probe = Command::new(&py)
            .args(["-c", "import fakellm"])
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run `{py}` ({e}); fakellm needs Python: {FAKELLM_HINT}")
            });
        assert!(
            probe.status.success(),
            "fakellm is not installed for `{py}`: {FAKELLM_HINT} (or point PYTHON at a Python that has it)\n{}",
            String::from_utf8_lossy(&probe.stderr)
        );

        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("fakellm.yaml");
        std::fs::write(&config, rules_yaml).unwrap();
        // Port 0: uvicorn binds a free port and logs the one it got, so there
        // is no window in which another process can take it.
        let mut child = Command::new(&py)
            .args([
                "-m",
                "fakellm.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
            ])
            .arg("--config")
            .arg(&config)
            .current_dir(dir.path())
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start fakellm: {e}"));

        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let log_w = log.clone();
        // Keeps draining stderr for the life of the process (so it never
        // blocks on a full pipe) and reports the bound port once.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log_w.lock().unwrap().push_str(&format!("{line}\n"));
                if let Some(rest) = line.split("Uvicorn running on http://127.0.0.1:").nth(1) {
                    let port: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    let _ = tx.send(port.parse::<u16>().ok());
                }
            }
        });
        let port = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Some(port)) => port,
            other => {
                let _ = child.kill();
                let status = child.wait().ok();
                panic!(
                    "fakellm did not start ({other:?}, exit {status:?}); is it installed? {FAKELLM_HINT}\n{}",
                    log.lock().unwrap()
                );
            }
        };
        FakeLlm {
            child,
            port,
            log,
            _dir: dir,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// fakellm's request counts by matched rule.
    pub async fn rule_hits(&self) -> Value {
        let stats: Value = reqwest::get(format!("http://127.0.0.1:{}/_fakellm/stats", self.port))
            .await
            .unwrap()
            .error_for_status()
            .unwrap()
            .bytes()
            .await
            .map(|b| serde_json::from_slice(&b).unwrap())
            .unwrap();
        stats["by_rule"].clone()
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("fakellm log:\n{}", self.log.lock().unwrap());
        }
    }
}

/// What fakellm answers (its documented deterministic echo) for a request
/// whose body is exactly `body`, computed by fakellm's own code.
pub fn echo(body: &Value) -> String {
    use std::io::Write;
    let mut child = Command::new(python())
        .args([
            "-c",
            "import json,sys; from fakellm._util import deterministic_echo; print(deterministic_echo(json.load(sys.stdin)), end='')",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "fingerprint helper failed");
    String::from_utf8(out.stdout).unwrap()
}
