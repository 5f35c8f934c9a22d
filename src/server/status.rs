//! The one place where domain errors become gRPC status codes.

use tonic::{Code, Status};

use crate::auth::AuthError;
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
            EngineError::AgentDenied { .. } => Code::PermissionDenied,
            EngineError::Quota(_) => Code::ResourceExhausted,
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

/// Replaces a status tonic produced while decoding an AgentService request
/// (before the service ran) with what hookwire answers for bad requests:
/// INVALID_ARGUMENT naming the limit or the problem. `None` for any other
/// status. Matches tonic's (0.14) and prost's own texts; a test pins them.
pub fn decode_rejection(s: &Status, max_input_bytes: usize) -> Option<Status> {
    const TOO_LARGE: &str = "Error, decoded message length too large: found ";
    const UNDECODABLE: &str = "failed to decode Protobuf message";
    match s.code() {
        Code::OutOfRange if s.message().starts_with(TOO_LARGE) => {
            // "… found N bytes, the limit is: M bytes"
            let numbers: Vec<&str> = s
                .message()
                .split(|c: char| !c.is_ascii_digit())
                .filter(|w| !w.is_empty())
                .collect();
            let size = match numbers.as_slice() {
                [found, limit, ..] => format!("{found} bytes, over the {limit}-byte message limit"),
                _ => "over the message size limit".to_string(),
            };
            Some(Status::invalid_argument(format!(
                "request is {size}; user input is limited to {max_input_bytes} bytes (server.max_input_bytes)"
            )))
        }
        Code::Internal if s.message().starts_with(UNDECODABLE) => {
            Some(Status::invalid_argument(format!(
                "request is not a valid message for this method: {}",
                s.message()
            )))
        }
        _ => None,
    }
}

/// A required request field was empty.
pub fn missing(field: &str) -> Status {
    Status::invalid_argument(format!("`{field}` is required"))
}

/// A request field with a value no request may carry.
pub fn invalid(field: &str, why: &str) -> Status {
    Status::invalid_argument(format!("`{field}` {why}"))
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
