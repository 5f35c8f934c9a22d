//! Remote hooks: configuration-ordered hook servers called at every
//! lifecycle event over per-run gRPC streams.

pub mod compose;
pub mod failure;
pub mod payload;
pub mod provenance;
pub mod verdict;
pub mod wire;
