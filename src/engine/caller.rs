//! When the caller of a run stops waiting, by the deadline it sent (gRPC's
//! `grpc-timeout`, read at the server's edge), so a run it abandoned at
//! that deadline says so instead of "client disconnected" alone.

use std::time::Duration;

use tokio::time::Instant;

/// A caller that leaves this close to its deadline (or after it) left
/// because of it: its clock started before the request was sent, ours
/// when it arrived.
const SLACK: Duration = Duration::from_millis(100);

/// When a caller stops waiting, by the timeout it sent.
#[derive(Clone, Copy, Debug)]
pub struct CallerDeadline {
    at: Instant,
    timeout: Duration,
}

impl CallerDeadline {
    /// A caller that said it waits `timeout` from now (`None` past the
    /// clock's range: as good as no deadline).
    pub fn after(timeout: Duration) -> Option<CallerDeadline> {
        Some(CallerDeadline {
            at: Instant::now().checked_add(timeout)?,
            timeout,
        })
    }
}

/// Why a run is cancelled when its caller went away: at its deadline, or
/// otherwise.
pub fn gone_reason(deadline: Option<CallerDeadline>) -> String {
    match deadline {
        Some(CallerDeadline { at, timeout }) if Instant::now() + SLACK >= at => format!(
            "client disconnected at its deadline (grpc-timeout {})",
            humantime_serde::re::humantime::format_duration(timeout)
        ),
        _ => "client disconnected".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_caller_gone_at_its_deadline_is_told_from_one_gone_before() {
        let deadline = CallerDeadline::after(Duration::from_secs(1));
        assert_eq!(gone_reason(deadline), "client disconnected");
        tokio::time::advance(Duration::from_millis(950)).await;
        assert_eq!(
            gone_reason(deadline),
            "client disconnected at its deadline (grpc-timeout 1s)"
        );
        assert_eq!(gone_reason(None), "client disconnected");
    }
}
