//! Tool-batch rules: every call screened before any starts, bounded
//! concurrency, a turn-wide stop signal, drain of in-flight calls, and the
//! lowest call index deciding the reported stop. Generic over the per-call
//! work so the rules are tested without IO.

use std::future::Future;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio_util::sync::CancellationToken;

use crate::agent::machine::{BatchDecision, Stop};
use crate::message::ToolResult;

#[derive(Debug)]
pub enum CallOutcome {
    Result(ToolResult),
    /// Re-ask the model (invalid_tool_call retry): stops the batch.
    Retry(String),
    Stop(Stop),
    /// The call saw the batch's stop signal before its next step (a hook
    /// call, an approval request, `CallTool`) and took no further step. It
    /// has no result: the batch failed because of the call that stopped it.
    Halted,
}

/// A batch's stop signal, fired by the first call that stops the batch
/// (a terminate, a closed hook failure, ...). Every call checks it before
/// each step that would start something new.
#[derive(Clone, Debug, Default)]
pub struct BatchStop(CancellationToken);

impl BatchStop {
    pub fn is_stopped(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Resolves once the batch is stopped.
    pub async fn stopped(&self) {
        self.0.cancelled().await
    }

    /// The underlying token (for code that takes one, e.g. hook chains and
    /// approvals).
    pub fn token(&self) -> &CancellationToken {
        &self.0
    }

    fn fire(&self) {
        self.0.cancel()
    }
}

/// Runs calls `0..count` in two phases.
///
/// 1. `screen(i)`, for every call in call order, before any call starts
///    (validation and `invalid_tool_call` hooks): `Some` decides the call
///    without executing it. A `Retry` or `Stop` ends the batch there, so
///    a retry never discards a call that already had a side effect.
/// 2. `call(i, stop)` for the calls screening left open, at most
///    `concurrency` at once. The first outcome that is not a result fires
///    `stop`: nothing new starts after it (calls check `stop` before each
///    step), in-flight steps finish (they are never detached), and the stop
///    of the lowest call index is reported.
pub async fn run_batch<S, SFut, F, Fut>(
    count: usize,
    concurrency: usize,
    mut screen: S,
    call: F,
) -> Result<BatchDecision, Stop>
where
    S: FnMut(usize) -> SFut,
    SFut: Future<Output = Option<CallOutcome>>,
    F: Fn(usize, BatchStop) -> Fut,
    Fut: Future<Output = CallOutcome>,
{
    let mut outcomes: Vec<Option<CallOutcome>> = Vec::with_capacity(count);
    for i in 0..count {
        match screen(i).await {
            Some(CallOutcome::Stop(s)) => return Err(s),
            Some(CallOutcome::Retry(f)) => return Ok(BatchDecision::Retry(f)),
            decided => outcomes.push(decided),
        }
    }
    let open: Vec<usize> = (0..count).filter(|&i| outcomes[i].is_none()).collect();
    let stop = BatchStop::default();
    let mut in_flight = FuturesUnordered::new();
    let mut next = open.iter().copied();
    loop {
        while !stop.is_stopped() && in_flight.len() < concurrency.max(1) {
            let Some(i) = next.next() else { break };
            let fut = call(i, stop.clone());
            let stop = stop.clone();
            in_flight.push(async move {
                let outcome = fut.await;
                // Fired as the call ends, before any sibling is polled again.
                if !matches!(outcome, CallOutcome::Result(_)) {
                    stop.fire();
                }
                (i, outcome)
            });
        }
        let Some((i, outcome)) = in_flight.next().await else {
            break;
        };
        outcomes[i] = Some(outcome);
    }
    decide(outcomes)
}

/// The batch's decision from its outcomes (`None`: never started).
fn decide(mut outcomes: Vec<Option<CallOutcome>>) -> Result<BatchDecision, Stop> {
    let mut retry = None;
    for o in outcomes.iter_mut() {
        match o.take() {
            Some(CallOutcome::Stop(s)) => return Err(s),
            Some(CallOutcome::Retry(f)) if retry.is_none() => retry = Some(f),
            other => *o = other,
        }
    }
    if let Some(f) = retry {
        return Ok(BatchDecision::Retry(f));
    }
    let mut results = Vec::with_capacity(outcomes.len());
    for o in outcomes {
        match o {
            Some(CallOutcome::Result(r)) => results.push(r),
            // A call halts or stays unstarted only after another stopped the
            // batch, and that stop was returned above; never commit a batch
            // with a call missing its result.
            _ => {
                return Err(Stop::Failed(
                    "internal error: a tool batch ended with a call that has no result".into(),
                ))
            }
        }
    }
    Ok(BatchDecision::Settled(results))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::LockExt;
    use std::sync::{Arc, Mutex};
    use tokio::sync::Notify;

    fn res(i: usize) -> CallOutcome {
        CallOutcome::Result(ToolResult {
            call_id: i.to_string(),
            name: "t".into(),
            content: format!("r{i}"),
            is_error: false,
        })
    }

    async fn none(_: usize) -> Option<CallOutcome> {
        None
    }

    fn term(i: usize) -> CallOutcome {
        CallOutcome::Stop(Stop::Terminate {
            hook: "h".into(),
            reason: format!("stop at {i}"),
            reply: None,
        })
    }

    #[tokio::test]
    async fn results_come_back_in_call_order_despite_completion_order() {
        let gates: Vec<Arc<Notify>> = (0..3).map(|_| Arc::new(Notify::new())).collect();
        let g = gates.clone();
        let batch = run_batch(3, 3, none, move |i, _| {
            let g = g.clone();
            async move {
                if i < 2 {
                    g[i].notified().await;
                } else {
                    g[1].notify_one();
                }
                if i == 1 {
                    g[0].notify_one();
                }
                res(i)
            }
        });
        let Ok(BatchDecision::Settled(results)) = batch.await else {
            panic!()
        };
        let ids: Vec<_> = results.iter().map(|r| r.call_id.as_str()).collect();
        assert_eq!(ids, ["0", "1", "2"]);
    }

    #[tokio::test]
    async fn sequential_terminate_stops_later_calls() {
        let ran = Arc::new(Mutex::new(Vec::new()));
        let r = ran.clone();
        let out = run_batch(4, 1, none, move |i, _| {
            let r = r.clone();
            async move {
                r.locked().push(i);
                if i == 1 {
                    term(i)
                } else {
                    res(i)
                }
            }
        })
        .await;
        assert_eq!(
            *ran.locked(),
            [0, 1],
            "calls after the terminate never start"
        );
        assert!(matches!(out, Err(Stop::Terminate { reason, .. }) if reason == "stop at 1"));
    }

    #[tokio::test]
    async fn concurrent_terminate_drains_in_flight_and_reports_lowest_index() {
        let started = Arc::new(Mutex::new(Vec::new()));
        let finished = Arc::new(Mutex::new(Vec::new()));
        // Calls 0 and 1 stay in flight until call 3 terminates, so the first
        // completions are the terminates of 2 and 3.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (s, f, g) = (started.clone(), finished.clone(), gate.clone());
        let out = run_batch(6, 4, none, move |i, _| {
            let (s, f, g) = (s.clone(), f.clone(), g.clone());
            async move {
                s.locked().push(i);
                let o = match i {
                    0 | 1 => {
                        let _p = g.acquire().await;
                        res(i)
                    }
                    3 => {
                        g.add_permits(2);
                        term(i)
                    }
                    2 => term(i),
                    _ => res(i),
                };
                f.locked().push(i);
                o
            }
        })
        .await;
        let mut started = started.locked().clone();
        started.sort();
        assert_eq!(started, [0, 1, 2, 3], "calls 4 and 5 never start");
        let finished = finished.locked().clone();
        assert!(
            finished.contains(&0) && finished.contains(&1),
            "in-flight calls were drained: {finished:?}"
        );
        assert!(matches!(out, Err(Stop::Terminate { reason, .. }) if reason == "stop at 2"));
    }

    #[tokio::test]
    async fn retry_is_reported_when_nothing_terminated() {
        let out = run_batch(2, 2, none, |i, _| async move {
            if i == 1 {
                CallOutcome::Retry("use a real tool".into())
            } else {
                res(i)
            }
        })
        .await;
        assert!(matches!(out, Ok(BatchDecision::Retry(f)) if f == "use a real tool"));
    }

    #[tokio::test]
    async fn every_call_is_screened_before_any_starts_and_a_retry_starts_none() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (l1, l2) = (log.clone(), log.clone());
        let out = run_batch(
            3,
            3,
            move |i| {
                let l = l1.clone();
                async move {
                    l.locked().push(format!("screen {i}"));
                    (i == 2).then(|| CallOutcome::Retry("fix call 2".into()))
                }
            },
            move |i, _| {
                let l = l2.clone();
                async move {
                    l.locked().push(format!("start {i}"));
                    res(i)
                }
            },
        )
        .await;
        assert!(matches!(out, Ok(BatchDecision::Retry(f)) if f == "fix call 2"));
        assert_eq!(
            *log.locked(),
            ["screen 0", "screen 1", "screen 2"],
            "no call had a side effect the retry discards"
        );
    }

    #[tokio::test]
    async fn screening_stops_at_the_first_stop_and_decided_calls_keep_call_order() {
        let started = Arc::new(Mutex::new(Vec::new()));
        let s = started.clone();
        let out = run_batch(
            3,
            1,
            |i| async move { (i == 1).then(|| term(i)) },
            move |i, _| {
                let s = s.clone();
                async move {
                    s.locked().push(i);
                    res(i)
                }
            },
        )
        .await;
        assert!(matches!(out, Err(Stop::Terminate { reason, .. }) if reason == "stop at 1"));
        assert!(started.locked().is_empty());

        // A call decided by screening (e.g. skipped) keeps its place.
        let out = run_batch(
            3,
            2,
            |i| async move {
                (i == 1).then(|| {
                    CallOutcome::Result(ToolResult {
                        call_id: "1".into(),
                        name: "t".into(),
                        content: "skipped".into(),
                        is_error: true,
                    })
                })
            },
            |i, _| async move { res(i) },
        )
        .await;
        let Ok(BatchDecision::Settled(results)) = out else {
            panic!("{out:?}")
        };
        let contents: Vec<_> = results.iter().map(|r| r.content.as_str()).collect();
        assert_eq!(contents, ["r0", "skipped", "r2"]);
    }

    /// Call 0 stops the batch while call 1 is mid-way (between two steps)
    /// and call 2 waits (as on an approval): both see the signal at once,
    /// take no further step, and call 0's stop is reported.
    #[tokio::test]
    async fn the_first_stop_fires_the_signal_every_call_checks() {
        for concurrency in [2, 3, 4] {
            let steps = Arc::new(Mutex::new(Vec::new()));
            let call1_mid = Arc::new(Notify::new());
            let (st, mid) = (steps.clone(), call1_mid.clone());
            let out = run_batch(4, concurrency, none, move |i, stop| {
                let (st, mid) = (st.clone(), mid.clone());
                async move {
                    let step = |what: &str| st.locked().push(format!("{i} {what}"));
                    match i {
                        0 => {
                            mid.notified().await;
                            step("terminates");
                            term(0)
                        }
                        1 => {
                            step("first step");
                            mid.notify_one();
                            // Its first step is in flight until the stop.
                            stop.stopped().await;
                            if stop.is_stopped() {
                                return CallOutcome::Halted;
                            }
                            step("second step");
                            res(1)
                        }
                        _ => {
                            // Waits on something only the stop ends.
                            stop.stopped().await;
                            if stop.is_stopped() {
                                return CallOutcome::Halted;
                            }
                            step("tool runs");
                            res(i)
                        }
                    }
                }
            })
            .await;
            assert!(
                matches!(&out, Err(Stop::Terminate { reason, .. }) if reason == "stop at 0"),
                "concurrency {concurrency}: {out:?}"
            );
            assert_eq!(
                *steps.locked(),
                ["1 first step", "0 terminates"],
                "concurrency {concurrency}: nothing new after the stop"
            );
        }
    }

    #[test]
    fn a_call_without_a_result_never_settles_a_batch() {
        let out = decide(vec![Some(res(0)), Some(CallOutcome::Halted), None]);
        assert!(matches!(out, Err(Stop::Failed(r)) if r.contains("internal error")));
    }
}
