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
    // `assert` vanishes under python -O (PYTHONOPTIMIZE): a self-test made of
    // them passes whatever the server does. Its checks must be explicit.
    let source = std::fs::read_to_string(script).unwrap();
    let bare: Vec<&str> = source
        .lines()
        .filter(|l| l.trim_start().starts_with("assert "))
        .collect();
    assert!(bare.is_empty(), "bare asserts in selftest.py: {bare:?}");
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

/// The Python example's README says the directory can be copied out of the
/// tree with HOOKWIRE_PROTO_DIR set. A copy in a shallow directory (/tmp/X,
/// too shallow for the in-tree default `../../../proto` to exist) must read
/// the variable, generate its stubs from there and pass its self-test;
/// without the variable it must say to set it rather than crash.
#[tokio::test]
async fn python_example_copied_to_a_shallow_directory_uses_hookwire_proto_dir() {
    let root = env!("CARGO_MANIFEST_DIR");
    let copy = tempfile::Builder::new()
        .prefix("hookwire-py")
        .tempdir_in("/tmp")
        .unwrap();
    assert_eq!(
        copy.path().ancestors().count(),
        3,
        "the copy must sit at /tmp/X to be too shallow for the default"
    );
    for entry in std::fs::read_dir(format!("{root}/examples/hooks/python")).unwrap() {
        let path = entry.unwrap().path();
        // The sources only: generated/ must be made again from the variable.
        if path.is_file() {
            std::fs::copy(&path, copy.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let python = support::python::interpreter();

    let (ok, text) = command_output(
        tokio::process::Command::new(&python)
            .arg("hookproto.py")
            .current_dir(copy.path())
            .env_remove("HOOKWIRE_PROTO_DIR"),
    )
    .await;
    assert!(!ok, "{text}");
    assert!(text.contains("set HOOKWIRE_PROTO_DIR"), "{text}");

    let (ok, text) = command_output(
        tokio::process::Command::new(&python)
            .arg("selftest.py")
            .current_dir(copy.path())
            .env("HOOKWIRE_PROTO_DIR", format!("{root}/proto")),
    )
    .await;
    assert!(ok, "selftest.py of the copy failed:\n{text}");
    assert!(text.contains(" 0 failed"), "{text}");
    assert!(copy
        .path()
        .join("generated/hookwire/v1/hook_pb2.py")
        .exists());
}
