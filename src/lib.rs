//! hookwire: runs LLM agent sessions and calls remote hook servers over
//! streaming gRPC at every lifecycle event of a run.
#![forbid(unsafe_code)]

pub mod accept;
pub mod agent;
pub mod auth;
pub mod cli;
pub mod config;
pub mod conformance;
pub mod cork;
pub mod demo;
pub mod engine;
pub mod event;
pub mod history;
pub mod hook_server;
pub mod hooks;
pub mod lock;
pub mod message;
pub mod model;
pub mod pb;
pub mod request;
pub mod server;
pub mod session;
pub mod store;
pub mod telemetry;
pub mod tls;
