//! Compiles `proto/` with protox (a pure-Rust protobuf compiler), so a fresh
//! machine needs no system `protoc`. The encoded descriptor set is kept for
//! gRPC server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
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
        .compile_fds(fds)?;
    Ok(())
}
