//! Telemetry: logs, OpenTelemetry traces (GenAI conventions, OTLP/gRPC
//! export), W3C trace context for hook servers, and Prometheus metrics on the
//! admin port.

pub mod attrs;
pub mod propagation;
pub mod setup;
pub mod spans;

pub use setup::{build, init, LogFormat, Sampling, Telemetry, TelemetryError, TelemetryOptions};
pub use spans::ContentCapture;
