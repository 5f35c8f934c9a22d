//! The one place where domain errors become gRPC status codes.

use tonic::{Code, Status};

use crate::agent::contain::INTERNAL_ERROR;
use crate::auth::AuthError;
use crate::engine::EngineError;
use crate::server::request::InvalidRequest;
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
        StoreError::ApprovalNotAsked { .. } => Code::NotFound,
        StoreError::TranscriptFull { .. } => Code::ResourceExhausted,
        StoreError::LeaseLost(_) => Code::Aborted,
        // A run's own write, refused; it ends the run rather than reaching
        // a caller.
        StoreError::RunCancelled { .. } => Code::Aborted,
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

/// A request refused at the boundary: the caller's mistake, and the message
/// names the field (and the limit) without quoting what was refused.
impl From<InvalidRequest> for Status {
    fn from(e: InvalidRequest) -> Status {
        Status::invalid_argument(e.to_string())
    }
}

/// A run's task that ended without its report: it panicked outside the
/// run's own containment, or the runtime is going away. Whatever the task
/// error says (a panic's message may quote content) is not the client's:
/// it gets the fixed text a contained panic reports.
pub fn run_task_lost() -> Status {
    Status::internal(INTERNAL_ERROR)
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

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// `Status::name(` or `Code::Name` as a path of its own (not, say,
    /// `ServingStatus::Serving`), outside comments.
    fn builds_a_status(line: &str) -> bool {
        let code = line.split("//").next().unwrap_or("");
        ["Status::", "Code::"].iter().any(|pat| {
            code.match_indices(pat).any(|(i, _)| {
                let before = code[..i].chars().next_back();
                let after = code[i + pat.len()..].chars().next();
                let own_path = !before.is_some_and(|c| c.is_alphanumeric() || c == '_');
                let constructor = *pat == "Code::" || after.is_some_and(|c| c.is_lowercase());
                own_path && constructor
            })
        })
    }

    /// What AgentService answers is chosen in this file only: the rest of
    /// the server and the auth layer in front of it build no Status and
    /// pick no Code themselves (they convert domain errors, or call the
    /// constructors here).
    #[test]
    fn statuses_are_built_only_in_this_file() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        rust_files(&src.join("server"), &mut files);
        rust_files(&src.join("auth"), &mut files);
        assert!(files.len() > 5, "the scan found the sources: {files:?}");
        let mut found = Vec::new();
        for f in files.iter().filter(|f| !f.ends_with("server/status.rs")) {
            let text = std::fs::read_to_string(f).unwrap();
            // A file's tests (its last part) may look at codes.
            let code = text.lines().take_while(|l| l.trim() != "#[cfg(test)]");
            for (n, line) in code.enumerate() {
                if builds_a_status(line) {
                    found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                }
            }
        }
        assert!(
            found.is_empty(),
            "statuses built outside src/server/status.rs:\n{}",
            found.join("\n")
        );
    }

    #[test]
    fn the_scan_tells_a_status_built_from_lookalikes() {
        assert!(builds_a_status(
            r#"Err(e) => Err(Status::internal(format!("{e}"))),"#
        ));
        assert!(builds_a_status("let c = tonic::Code::NotFound;"));
        assert!(!builds_a_status(
            ".set_service_status(\"\", tonic_health::ServingStatus::Serving)"
        ));
        assert!(!builds_a_status("// Status::internal is not built here"));
        assert!(!builds_a_status(
            "-> Result<Response<pb::Session>, Status> {"
        ));
    }
}
