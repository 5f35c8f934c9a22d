//! The one place where domain errors become gRPC status codes.

use tonic::{Code, Status};

use crate::agent::approvals::ApprovalError;
use crate::auth::AuthError;
use crate::engine::EngineError;
use crate::session::SessionError;

impl From<EngineError> for Status {
    fn from(e: EngineError) -> Status {
        let code = match &e {
            EngineError::UnknownAgent { .. } => Code::NotFound,
            EngineError::Session(SessionError::NotFound(_)) => Code::NotFound,
            EngineError::Session(SessionError::Busy { .. }) => Code::FailedPrecondition,
            EngineError::UnknownHook(_) => Code::InvalidArgument,
            EngineError::EmptyInput => Code::InvalidArgument,
            EngineError::InputTooLarge { .. } => Code::InvalidArgument,
            EngineError::SessionRejected { .. } => Code::PermissionDenied,
            EngineError::SessionHookFailed(_) => Code::Unavailable,
            EngineError::UnknownRun(_) => Code::NotFound,
            EngineError::Approval(ApprovalError::NotPending { .. }) => Code::NotFound,
            EngineError::ShuttingDown => Code::Unavailable,
            EngineError::AgentDenied { .. } => Code::PermissionDenied,
            EngineError::Quota(_) => Code::ResourceExhausted,
        };
        Status::new(code, e.to_string())
    }
}

/// A required request field was empty.
pub fn missing(field: &str) -> Status {
    Status::invalid_argument(format!("`{field}` is required"))
}

/// A call the auth layer refused.
pub fn unauthenticated(e: &AuthError) -> Status {
    Status::unauthenticated(e.to_string())
}

/// A call that reached a service without passing the auth layer: a wiring
/// bug, refused rather than served as nobody in particular.
pub fn no_principal() -> Status {
    Status::unauthenticated("no authenticated principal on this call")
}
