//! The generated `hookwire.v1` protobuf and gRPC code.
//!
//! Generated code stays in this one private module; the rest of the crate
//! reaches it as `crate::pb` and converts to domain types at the boundary
//! (`hooks::wire`, `server::convert`). Domain modules never import it.

#[allow(clippy::all, clippy::pedantic, missing_docs)]
#[allow(deprecated)] // the generated code touches its own deprecated fields
mod generated {
    tonic::include_proto!("hookwire.v1");
}

pub use generated::*;

pub mod codec;

/// Encoded file descriptor set of `proto/`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("hookwire_descriptor");
