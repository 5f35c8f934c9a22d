//! The agent loop.

pub mod outcome;
