//! The agent loop: an IO-free machine (`machine`, `batch`) driven by a
//! runner (`runner`, `tools`) that performs hook calls, model calls and tool
//! executions.

pub mod approvals;
pub mod batch;
pub mod client_queue;
pub mod contain;
pub mod early_answer;
pub mod events;
pub mod guard;
pub mod ledger;
pub mod machine;
pub mod outcome;
pub mod runner;
pub mod store_warnings;
pub mod tools;
