//! `hookwire serve` without a config (what `make run` starts), as the real
//! binary: the built-in demo hook server runs beside it and is called over
//! gRPC, so the first `hookwire run` shows a redaction, a remote tool call
//! and a denied tool, each attributed to the hook; `--no-demo-hooks` leaves
//! it out. Sessions go to SQLite in the data directory, so they outlive a
//! restart (each test gives its servers a data directory of its own).

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_hookwire");

/// A `hookwire serve` process on free ports; killed on drop.
struct Served {
    addr: String,
    _child: Child,
}

/// Starts `hookwire serve ARGS` with its data in `data_dir` and waits for
/// its "hookwire serving" log line (hooks described, ready), reading the
/// gRPC address it logged.
async fn serve(data_dir: &std::path::Path, args: &[&str]) -> Served {
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(args)
        .env("RUST_LOG", "info")
        .env_remove("HOOKWIRE_CONFIG")
        .env_remove("HOOKWIRE_STORE")
        .env("HOOKWIRE_DATA_DIR", data_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("hookwire serve starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addr = None;
    let mut seen = String::new();
    while let Some(line) = lines.next_line().await.unwrap() {
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.split("listening grpc=").nth(1) {
            addr = rest
                .split_whitespace()
                .next()
                .map(|a| format!("http://{a}"));
        }
        if line.contains("hookwire serving") {
            break;
        }
    }
    let addr = addr.unwrap_or_else(|| panic!("no listening line in:\n{seen}"));
    // Keep draining its logs so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Served {
        addr,
        _child: child,
    }
}

async fn run(addr: &str, prompt: &str) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["run", "--addr", addr, prompt])
        .stdin(Stdio::null())
        .output()
        .await
        .expect("hookwire run");
    (
        out.status.success(),
        format!(
            "{}\n(stderr: {})",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn ordered(text: &str, parts: &[&str]) {
    let mut at = 0;
    for p in parts {
        match text[at..].find(p) {
            Some(i) => at += i + p.len(),
            None => panic!("`{p}` missing or out of order in:\n{text}"),
        }
    }
}

#[tokio::test]
async fn the_default_run_shows_a_redaction_a_tool_call_and_a_denial() {
    let data = tempfile::tempdir().unwrap();
    let served = serve(data.path(), &[]).await;
    let key = "sk-live-4f9a8b7c6d5e4f3a";
    let (ok, out) = run(
        &served.addr,
        &format!("my key is {key} what's the weather in Paris?"),
    )
    .await;
    assert!(ok, "{out}");
    ordered(
        &out,
        &[
            "agent demo",
            "⚑ hook demo-guard · run_start · rewrite_input [input] — redacted 1 API key",
            "✎ input as committed: my key is [REDACTED:api_key] what's the weather in Paris?",
            "── turn 1",
            "→ #0 get_weather({\"city\":\"Paris\"})",
            "⚙ #0 executing get_weather({\"city\":\"Paris\"})",
            "← #0 result: sunny, 21°C in Paris (demo data)",
            "── turn 2",
            "✔ completed · 2 turn(s)",
        ],
    );
    assert!(!out.contains(key), "the key never comes back:\n{out}");

    let (ok, out) = run(&served.addr, "please delete my notes").await;
    assert!(ok, "{out}");
    ordered(
        &out,
        &[
            "→ #0 delete_file({\"path\":\"notes.txt\"})",
            "⚑ hook demo-guard · tool_call · skip — delete_* tools are denied",
            "← #0 error: The tool `delete_file` is denied by policy",
            "✔ completed",
        ],
    );
    assert!(
        !out.contains("⚙ #0 executing"),
        "a denied tool never runs:\n{out}"
    );
}

#[tokio::test]
async fn no_demo_hooks_serves_the_bare_agent() {
    let data = tempfile::tempdir().unwrap();
    let served = serve(data.path(), &["--no-demo-hooks"]).await;
    let (ok, out) = run(&served.addr, "my key is sk-live-4f9a8b7c6d5e4f3a").await;
    assert!(ok, "{out}");
    assert!(!out.contains("⚑"), "no hook is called:\n{out}");
    assert!(
        out.contains("You said: my key is sk-live-4f9a8b7c6d5e4f3a"),
        "{out}"
    );
}

async fn hookwire(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("hookwire");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "hookwire {args:?}: {text}\n(stderr: {})",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// What `make run`, a run, Ctrl-C, `make run` again does: the demo hooks and
/// the SQLite default together, the session and its transcript (as the
/// demo hook rewrote it) still there after the restart.
#[tokio::test]
async fn the_default_keeps_sessions_in_the_data_dir_across_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let first = serve(data.path(), &[]).await;
    let (ok, out) = run(
        &first.addr,
        "my key is sk-live-4f9a8b7c6d5e4f3a, weather in Paris?",
    )
    .await;
    assert!(ok, "{out}");
    assert!(out.contains("⚑ hook demo-guard"), "{out}");
    let listed = hookwire(&["sessions", "--addr", &first.addr, "list"]).await;
    let id = listed
        .split_whitespace()
        .next()
        .unwrap_or_else(|| panic!("no session listed: {listed}"))
        .to_string();
    assert!(
        data.path().join("hookwire.db").is_file(),
        "the SQLite file is in the data directory"
    );
    drop(first);

    let second = serve(data.path(), &[]).await;
    let shown = hookwire(&["sessions", "--addr", &second.addr, "show", &id]).await;
    ordered(
        &shown,
        &[
            &format!("session {id} · agent demo · 1 run(s)"),
            "user: my key is [REDACTED:api_key], weather in Paris?",
            "get_weather",
            "sunny, 21°C in Paris (demo data)",
        ],
    );
}
