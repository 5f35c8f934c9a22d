//! The example hook servers' own tests, so `make test` covers them: the
//! Python self-test and the Go tests (`go vet` + `go test`). Both fail,
//! rather than skip, when their toolchain is missing: CI installs them with
//! examples/hooks/install-deps.sh.

mod support;

use support::command_output;

#[tokio::test]
async fn python_selftest_passes() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/hooks/python/selftest.py"
    );
    // `assert` vanishes under python -O (PYTHONOPTIMIZE): a self-test made of
    // them passes whatever the server does. Its checks must be explicit.
    let source = std::fs::read_to_string(script).unwrap();
    let bare: Vec<&str> = source
        .lines()
        .filter(|l| l.trim_start().starts_with("assert "))
        .collect();
    assert!(bare.is_empty(), "bare asserts in selftest.py: {bare:?}");
    let (ok, text) = command_output(tokio::process::Command::new("python3").arg(script)).await;
    assert!(
        ok,
        "selftest.py failed (deps: bash examples/hooks/install-deps.sh python):\n{text}"
    );
    assert!(text.contains(" 0 failed"), "{text}");
}

#[tokio::test]
async fn go_tests_pass() {
    let text = support::go::make("test").await;
    assert!(text.contains("\nok "), "{text}");
}
