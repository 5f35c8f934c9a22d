//! Remote hooks: configuration-ordered hook servers called at every
//! lifecycle event over per-run gRPC streams.

pub mod breaker;
pub mod channel;
pub mod client;
pub mod codec;
pub mod compose;
pub mod connector;
pub mod credentials;
pub mod dispatch;
pub mod failure;
pub mod failure_log;
pub mod payload;
pub mod peer_settings;
pub mod placement;
pub mod pool;
pub mod provenance;
pub mod registry;
pub mod spawner;
pub mod stream;
pub mod verdict;
pub mod wire;
pub mod wire_event;
