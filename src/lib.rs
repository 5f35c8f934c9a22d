//! hookwire: runs LLM agent sessions and calls remote hook servers over
//! streaming gRPC at every lifecycle event of a run.
#![forbid(unsafe_code)]

pub mod config;
pub mod event;
pub mod message;
pub mod model;
pub mod pb;
pub mod agent;
pub mod hooks;
pub mod session;
pub mod engine;
pub mod server;
pub mod cli;
pub mod hook_server;
