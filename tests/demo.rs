//! `make demo` end to end: runs examples/demo/run.sh itself (with this
//! build's binary), so the demo's config, script and the Python example
//! cannot drift apart unnoticed. The timeline must show the redaction, the
//! denied tool and the tool the remote hook server executed.

use std::process::Stdio;
use std::time::Duration;

#[tokio::test]
async fn make_demo_shows_redaction_denial_and_remote_tool() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut child = tokio::process::Command::new("bash")
        .arg(format!("{root}/examples/demo/run.sh"))
        .env("HOOKWIRE_BIN", env!("CARGO_BIN_EXE_hookwire"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("bash must be installed");
    let pid = child.id().unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let read = |mut r: Box<dyn tokio::io::AsyncRead + Unpin + Send>| async move {
        let mut s = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut r, &mut s)
            .await
            .unwrap();
        s
    };
    let (out, err) = (
        tokio::spawn(read(Box::new(stdout))),
        tokio::spawn(read(Box::new(stderr))),
    );
    let status = match tokio::time::timeout(Duration::from_secs(120), child.wait()).await {
        Ok(s) => s.unwrap(),
        Err(_) => {
            // TERM, not KILL: the script's trap stops what it started.
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            panic!("the demo did not finish within 120 s");
        }
    };
    let (out, err) = (out.await.unwrap(), err.await.unwrap());
    assert!(status.success(), "demo failed:\n{out}\n{err}");

    assert!(out.contains("examples/demo/hookwire.yaml: ok"), "{out}");
    assert!(
        out.contains("py-guard") && out.contains("state=connected"),
        "{out}"
    );
    // Everything after the command line (which echoes the prompt) is the
    // run's timeline.
    let timeline = out
        .split_once("── hookwire run")
        .and_then(|(_, t)| t.split_once('\n'))
        .map(|(_, t)| t)
        .unwrap_or_else(|| panic!("no run in:\n{out}"));
    // The redaction: the API key never reaches history or the model.
    assert!(
        timeline.contains("run_start · rewrite_input [input] — redacted 1 api_key"),
        "{timeline}"
    );
    assert!(timeline.contains("[REDACTED:api_key]"), "{timeline}");
    assert!(!timeline.contains("sk-live-"), "{timeline}");
    // The denial: hidden from the model; called anyway, it is an unknown
    // tool for that call (never executed), which the policy skips.
    assert!(
        timeline.contains(
            "model_request · patch_request [active_tools] — hid denied tools: lookup_customer"
        ),
        "{timeline}"
    );
    assert!(
        timeline.contains("invalid_tool_call · skip — tool lookup_customer is denied by policy"),
        "{timeline}"
    );
    assert!(
        timeline.contains("← #1 error: The tool 'lookup_customer' is not allowed by policy."),
        "{timeline}"
    );
    // The remote tool: executed by the Python hook server via CallTool.
    assert!(
        timeline.contains("⚙ #0 executing get_weather({\"city\":\"Paris\"})"),
        "{timeline}"
    );
    assert!(
        timeline.contains("← #0 result: sunny, 21C in Paris"),
        "{timeline}"
    );
    assert!(timeline.contains("✔ completed · 2 turn(s)"), "{timeline}");
}
