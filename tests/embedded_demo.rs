//! `hookwire serve` without a config (what `make run` starts), as the real
//! binary: the built-in demo hook server runs beside it and is called over
//! gRPC, so the first `hookwire run` shows a redaction, a remote tool call
//! and a denied tool, each attributed to the hook; `--no-demo-hooks` leaves
//! it out.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_hookwire");

/// A `hookwire serve` process on free ports; killed on drop.
struct Served {
    addr: String,
    _child: Child,
}

/// Starts `hookwire serve ARGS` and waits for its "hookwire serving" log
/// line (hooks described, ready), reading the gRPC address it logged.
async fn serve(args: &[&str]) -> Served {
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
    let served = serve(&[]).await;
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
    let served = serve(&["--no-demo-hooks"]).await;
    let (ok, out) = run(&served.addr, "my key is sk-live-4f9a8b7c6d5e4f3a").await;
    assert!(ok, "{out}");
    assert!(!out.contains("⚑"), "no hook is called:\n{out}");
    assert!(
        out.contains("You said: my key is sk-live-4f9a8b7c6d5e4f3a"),
        "{out}"
    );
}
