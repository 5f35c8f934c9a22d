//! A step's IO under the run's cancellation and deadline.
//!
//! A hand-written future rather than an `async fn` around `select!`: an
//! async fn keeps its future argument and the copy it moved into the
//! `select!` both in its state, so every guarded step carried its IO twice
//! (a `review_response` step 6.1 KiB instead of 3.1 KiB), and the run's
//! future, sized by its largest step, was copied whole into its box at
//! start. At hundreds of concurrent runs those copies land in memory no
//! longer in cache (BENCHMARKS.md, "The run's future").

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFuture;

use crate::agent::machine::Stop;

pin_project_lite::pin_project! {
    /// Polls, in this order, the cancellation, the deadline and the step:
    /// a step that finishes in the same poll as a cancel or the deadline
    /// still ends as cancelled or timed out (fail closed).
    pub struct Guarded<'a, F, C> {
        #[pin]
        cancelled: WaitForCancellationFuture<'a>,
        #[pin]
        deadline: Sleep,
        #[pin]
        step: F,
        // Why the run was cancelled, read once it is.
        reason: C,
    }
}

impl<'a, F, C> Guarded<'a, F, C> {
    pub fn new(
        cancelled: WaitForCancellationFuture<'a>,
        deadline: Instant,
        step: F,
        reason: C,
    ) -> Self {
        Guarded {
            cancelled,
            deadline: tokio::time::sleep_until(deadline),
            step,
            reason,
        }
    }
}

impl<'a, T, F, C> Future for Guarded<'a, F, C>
where
    F: Future<Output = Result<T, Stop>>,
    C: Fn() -> Stop,
{
    type Output = Result<T, Stop>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if this.cancelled.poll(cx).is_ready() {
            return Poll::Ready(Err((this.reason)()));
        }
        if this.deadline.poll(cx).is_ready() {
            return Poll::Ready(Err(Stop::TimedOut));
        }
        this.step.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;

    fn guard<'a, F: Future<Output = Result<u8, Stop>> + 'a>(
        token: &'a CancellationToken,
        deadline: Instant,
        step: F,
    ) -> impl Future<Output = Result<u8, Stop>> + 'a {
        Guarded::new(token.cancelled(), deadline, step, || {
            Stop::Cancelled("by the test".into())
        })
    }

    fn cancelled() -> Result<u8, Stop> {
        Err(Stop::Cancelled("by the test".into()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_step_that_ends_in_time_gives_its_result() {
        let token = CancellationToken::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let step = async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok(7)
        };
        assert_eq!(guard(&token, deadline, step).await, Ok(7));
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_ends_a_step_that_outlives_it() {
        let token = CancellationToken::new();
        let deadline = Instant::now() + Duration::from_secs(1);
        let step = std::future::pending();
        assert_eq!(guard(&token, deadline, step).await, Err(Stop::TimedOut));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancel_ends_a_step_mid_way() {
        let token = CancellationToken::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let cancel = token.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            cancel.cancel();
        });
        let step = std::future::pending();
        assert_eq!(guard(&token, deadline, step).await, cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn a_step_ready_after_a_cancel_or_the_deadline_does_not_count() {
        // Fail closed: when the run is cancelled or out of time, a step's
        // result that is ready in the same poll is not taken.
        let token = CancellationToken::new();
        token.cancel();
        let deadline = Instant::now() + Duration::from_secs(10);
        let ready = async { Ok(1) };
        assert_eq!(guard(&token, deadline, ready).await, cancelled());
        let token = CancellationToken::new();
        let deadline = Instant::now() + Duration::from_secs(1);
        tokio::time::advance(Duration::from_secs(2)).await;
        let ready = async { Ok(1) };
        assert_eq!(guard(&token, deadline, ready).await, Err(Stop::TimedOut));
    }
}
