//! The one place where domain errors become gRPC status codes.

use tonic::{Code, Status};

use crate::engine::EngineError;
use crate::store::StoreError;

impl From<EngineError> for Status {
    fn from(e: EngineError) -> Status {
        let code = match &e {
            EngineError::UnknownAgent { .. } => Code::NotFound,
            EngineError::Store(s) => store_code(s),
            EngineError::UnknownHook(_) => Code::InvalidArgument,
            EngineError::EmptyInput => Code::InvalidArgument,
            EngineError::InputTooLarge { .. } => Code::InvalidArgument,
            EngineError::SessionRejected { .. } => Code::PermissionDenied,
            EngineError::SessionHookFailed(_) => Code::Unavailable,
            EngineError::ShuttingDown => Code::Unavailable,
        };
        Status::new(code, e.to_string())
    }
}

fn store_code(e: &StoreError) -> Code {
    match e {
        StoreError::SessionNotFound(_) => Code::NotFound,
        StoreError::Busy { .. } => Code::FailedPrecondition,
        StoreError::RunNotFound(_) => Code::NotFound,
        StoreError::ApprovalNotPending { .. } => Code::NotFound,
        StoreError::TranscriptFull { .. } => Code::ResourceExhausted,
        StoreError::LeaseLost(_) => Code::Aborted,
        StoreError::BadPageToken => Code::InvalidArgument,
        StoreError::Unavailable(_) => Code::Unavailable,
        StoreError::Backend(_) => Code::Internal,
    }
}

/// A required request field was empty.
pub fn missing(field: &str) -> Status {
    Status::invalid_argument(format!("`{field}` is required"))
}
