//! The example hook servers' own tests, so `make test` covers them: the
//! Python self-test and the Go tests (`go vet` + `go test`). Both fail,
//! rather than skip, when their toolchain is missing: CI installs them with
//! examples/hooks/install-deps.sh.

mod support;

use std::process::Stdio;

#[tokio::test]
async fn python_selftest_passes() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/hooks/python/selftest.py"
    );
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("python3 must be installed");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "selftest.py failed (deps: bash examples/hooks/install-deps.sh python):\n{text}"
    );
    assert!(text.contains(" 0 failed"), "{text}");
}

#[tokio::test]
async fn go_tests_pass() {
    let text = support::go::make("test").await;
    assert!(text.contains("\nok "), "{text}");
}
