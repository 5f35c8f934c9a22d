//! The proto is a promise: `buf lint` and `buf breaking` (buf from PyPI's
//! buf-bin, installed into .venv/ by `make deps`) against the committed image
//! of the last released contract, proto/released/. Each test copies proto/
//! to a temporary directory, edits the copy and runs the same check `make
//! proto-check` runs. A missing buf fails the tests; it never skips them.

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const RELEASED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/proto/released/hookwire-v0.1.0.binpb"
);

/// `.venv/bin/buf` (what `make deps` installs), else `buf` on PATH.
fn buf() -> PathBuf {
    let venv = Path::new(ROOT).join(".venv/bin/buf");
    if venv.exists() {
        venv
    } else {
        PathBuf::from("buf")
    }
}

/// Runs buf; returns (success, stdout + stderr).
fn run_buf(args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new(buf())
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?} ({e}): run `make deps`", buf()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A copy of proto/ (buf.yaml and the .proto files, not the released images).
fn proto_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(ROOT).join("proto");
    std::fs::copy(src.join("buf.yaml"), dir.path().join("buf.yaml")).unwrap();
    let v1 = dir.path().join("hookwire/v1");
    std::fs::create_dir_all(&v1).unwrap();
    for entry in std::fs::read_dir(src.join("hookwire/v1")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, v1.join(path.file_name().unwrap())).unwrap();
    }
    dir
}

/// Replaces `from` (which must occur) with `to` in the copy's `file`.
fn edit(dir: &Path, file: &str, from: &str, to: &str) {
    let path = dir.join("hookwire/v1").join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(from), "{file} no longer contains {from:?}");
    std::fs::write(&path, text.replacen(from, to, 1)).unwrap();
}

fn breaking(dir: &Path) -> (bool, String) {
    run_buf(&["breaking", ".", "--against", RELEASED], dir)
}

#[test]
fn the_contract_passes_buf_lint_and_the_breaking_check() {
    let proto = Path::new(ROOT).join("proto");
    let (ok, text) = run_buf(&["lint", "."], &proto);
    assert!(ok, "buf lint proto:\n{text}");
    let (ok, text) = breaking(&proto);
    assert!(ok, "buf breaking proto against {RELEASED}:\n{text}");
}

#[test]
fn renaming_a_field_is_a_breaking_change() {
    let copy = proto_copy();
    edit(
        copy.path(),
        "hook.proto",
        "message RewriteInput {\n  string input = 1;\n}",
        "message RewriteInput {\n  string text = 1;\n}",
    );
    let (ok, text) = breaking(copy.path());
    assert!(!ok, "a renamed field passed:\n{text}");
    assert!(
        text.contains(
            r#"Field "1" on message "RewriteInput" changed name from "input" to "text"."#
        ),
        "{text}"
    );
}

#[test]
fn renumbering_a_field_is_a_breaking_change() {
    let copy = proto_copy();
    edit(
        copy.path(),
        "hook.proto",
        "message RewriteArgs {\n  string arguments_json = 1;\n}",
        "message RewriteArgs {\n  string arguments_json = 2;\n}",
    );
    let (ok, text) = breaking(copy.path());
    assert!(!ok, "a renumbered field passed:\n{text}");
    assert!(
        text.contains(
            r#"Previously present field "1" with name "arguments_json" on message "RewriteArgs" was deleted."#
        ),
        "{text}"
    );
}

#[test]
fn removing_a_field_or_an_enum_value_is_a_breaking_change() {
    let copy = proto_copy();
    edit(
        copy.path(),
        "hook.proto",
        "message ContinueRun {\n  string message = 1;\n}",
        "message ContinueRun {}",
    );
    edit(
        copy.path(),
        "common.proto",
        "  RUN_OUTCOME_TIMED_OUT = 8;\n",
        "",
    );
    let (ok, text) = breaking(copy.path());
    assert!(!ok, "a removed field passed:\n{text}");
    assert!(
        text.contains(
            r#"Previously present field "1" with name "message" on message "ContinueRun" was deleted."#
        ),
        "{text}"
    );
    assert!(
        text.contains(r#"Previously present enum value "8" on enum "RunOutcome" was deleted."#),
        "{text}"
    );
}

/// What wave 2 does to the contract: new fields, enum values, oneof cases,
/// messages and RPCs. None of it may trip the check.
#[test]
fn additions_pass_the_breaking_check_and_lint() {
    let copy = proto_copy();
    edit(
        copy.path(),
        "common.proto",
        "  RUN_OUTCOME_TIMED_OUT = 8;\n",
        "  RUN_OUTCOME_TIMED_OUT = 8;\n  // Added later.\n  RUN_OUTCOME_SUSPENDED = 10;\n",
    );
    edit(
        copy.path(),
        "common.proto",
        "  bool estimated = 3;\n",
        "  bool estimated = 3;\n  // Added later.\n  uint64 cached_input_tokens = 4;\n",
    );
    edit(
        copy.path(),
        "hook.proto",
        "    Terminate terminate = 5;\n  }\n}",
        "    Terminate terminate = 5;\n    // Added later.\n    Defer defer = 6;\n  }\n}\n\n// Added later.\nmessage Defer {\n  uint64 delay_ms = 1;\n}",
    );
    edit(
        copy.path(),
        "hook.proto",
        "  rpc CallTool(CallToolRequest) returns (CallToolResponse);\n",
        "  rpc CallTool(CallToolRequest) returns (CallToolResponse);\n  // Added later.\n  rpc Ping(PingRequest) returns (PingResponse);\n",
    );
    edit(
        copy.path(),
        "hook.proto",
        "message CallToolRequest {",
        "message PingRequest {}\n\nmessage PingResponse {}\n\nmessage CallToolRequest {",
    );
    let (ok, text) = breaking(copy.path());
    assert!(ok, "an additive change failed the breaking check:\n{text}");
    let (ok, text) = run_buf(&["lint", "."], copy.path());
    assert!(ok, "an additive change failed lint:\n{text}");
}

/// `hookwire --version` names the release and the commit it was built from,
/// so a bug report or a running pod can be traced to its source.
#[test]
fn version_names_the_crate_version_and_the_git_commit() {
    let out = Command::new(env!("CARGO_BIN_EXE_hookwire"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    // The build script reran at the last commit, so HEAD is what was built
    // (unless the commit was given to the build, as image builds do).
    let head = std::env::var("HOOKWIRE_GIT_COMMIT").ok().or_else(|| {
        Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .current_dir(ROOT)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    });
    let head = head.unwrap_or_else(|| "unknown".into());
    assert_eq!(
        text.trim(),
        format!("hookwire {} (commit {head})", env!("CARGO_PKG_VERSION"))
    );
}
