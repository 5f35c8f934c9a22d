//! The executor hyper spawns a hook connection's per-stream tasks on.
//!
//! hyper hands its HTTP/2 client executor one enum for every future it
//! spawns: the connection's task and, per request, a task that sends the
//! request body and one that waits for the response head. The enum is the
//! size of its largest variant, the connection (1 552 bytes), while a
//! stream's two variants need ~150 bytes each. Spawned as they are, each
//! run's `Process` stream allocated two tasks of 1 664 bytes and tokio
//! copied the whole enum into each on spawn and again when each completed:
//! writes to memory that, with hundreds of runs in flight, is no longer in
//! cache (callgrind's cache simulation: hyper's spawns were the largest
//! share of the copies left per run; BENCHMARKS.md, figure 4). Boxed first,
//! the enum is copied once, into its box, and the task holds a pointer.

use std::future::Future;

/// Spawns each future on the current tokio runtime, boxed. Generic in the
/// future, so hyper's sealed executor traits accept it for any connection.
#[derive(Clone, Copy, Debug, Default)]
pub struct BoxedSpawner;

impl<F> hyper::rt::Executor<F> for BoxedSpawner
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, future: F) {
        tokio::spawn(Box::pin(future));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Executor;

    #[tokio::test]
    async fn a_spawned_future_runs_to_its_end() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        BoxedSpawner.execute(async move {
            tx.send(7).unwrap();
        });
        assert_eq!(rx.await.unwrap(), 7);
    }
}
