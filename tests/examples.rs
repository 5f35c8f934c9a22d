//! The example hook servers' own tests, so `make test` covers them: the
//! Python self-test and the Go tests (`go vet` + `go test`). Both fail,
//! rather than skip, when their toolchain is missing: `make deps` installs
//! them.

mod support;

use support::command_output;

#[tokio::test]
async fn python_selftest_passes() {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/hooks/python/selftest.py"
    );
    let python = support::python::interpreter();
    let (ok, text) = command_output(tokio::process::Command::new(python).arg(script)).await;
    assert!(
        ok,
        "selftest.py failed ({}):\n{text}",
        support::python::DEPS_HINT
    );
    assert!(text.contains(" 0 failed"), "{text}");
}

#[tokio::test]
async fn go_tests_pass() {
    let text = support::go::make("test").await;
    assert!(text.contains("\nok "), "{text}");
}
