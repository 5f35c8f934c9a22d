//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so a fresh
//! machine needs no system `protoc`. The encoded descriptor set is kept for
//! gRPC server reflection. Also records the git commit `hookwire --version`
//! prints.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rustc-env=HOOKWIRE_COMMIT={}", git_commit());
    let files = [
        "proto/hookwire/v1/common.proto",
        "proto/hookwire/v1/hook.proto",
        "proto/hookwire/v1/agent.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("hookwire_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // prost's codec with 1 KiB starting buffers (src/pb/codec.rs).
        .codec_path("crate::pb::codec::SmallBufferCodec")
        .compile_fds(fds)?;
    Ok(())
}

/// `HOOKWIRE_GIT_COMMIT` when set (image builds whose context has no .git),
/// else `git rev-parse --short HEAD`, else "unknown": a build never fails
/// for want of git.
fn git_commit() -> String {
    println!("cargo:rerun-if-env-changed=HOOKWIRE_GIT_COMMIT");
    if let Some(commit) = std::env::var("HOOKWIRE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
    {
        return commit.trim().to_string();
    }
    // Run again when HEAD moves: the HEAD file (a checkout) and the branch
    // it names (a commit). Asked of git, so worktrees (.git is a file) and
    // packed refs work too; a path that does not exist is not named, since
    // cargo would then rerun this script on every build.
    let mut watched = vec![git(&["rev-parse", "--git-path", "HEAD"])];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(git(&["rev-parse", "--git-path", &branch]));
        watched.push(git(&["rev-parse", "--git-path", "packed-refs"]));
    }
    for path in watched.into_iter().flatten() {
        if Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into())
}

/// A git command's trimmed output, or None when git is missing or fails
/// (a source tarball, a build context without .git).
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}
