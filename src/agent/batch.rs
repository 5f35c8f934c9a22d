//! Tool-batch rules: bounded concurrency, turn-wide fail-fast, drain of
//! in-flight calls, and the lowest call index deciding the reported stop.
//! Generic over the per-call work so the rules are tested without IO.

use std::future::Future;

use futures::stream::{FuturesUnordered, StreamExt};

use crate::agent::machine::{BatchDecision, Stop};
use crate::message::ToolResult;

#[derive(Debug)]
pub enum CallOutcome {
    Result(ToolResult),
    /// Re-ask the model (invalid_tool_call retry): stops the batch.
    Retry(String),
    Stop(Stop),
}

/// Runs calls `0..count` with at most `concurrency` in flight. After a call
/// stops the batch, nothing new starts, in-flight calls finish (they are
/// never detached), and the stop of the lowest call index is reported.
pub async fn run_batch<F, Fut>(
    count: usize,
    concurrency: usize,
    call: F,
) -> Result<BatchDecision, Stop>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = CallOutcome>,
{
    let mut outcomes: Vec<Option<CallOutcome>> = (0..count).map(|_| None).collect();
    let mut in_flight = FuturesUnordered::new();
    let mut next = 0;
    let mut stopped = false;
    loop {
        while !stopped && next < count && in_flight.len() < concurrency.max(1) {
            let i = next;
            let fut = call(i);
            in_flight.push(async move { (i, fut.await) });
            next += 1;
        }
        let Some((i, outcome)) = in_flight.next().await else {
            break;
        };
        if !matches!(outcome, CallOutcome::Result(_)) {
            stopped = true;
        }
        outcomes[i] = Some(outcome);
    }
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
    Ok(BatchDecision::Settled(
        outcomes
            .into_iter()
            .map(|o| match o {
                Some(CallOutcome::Result(r)) => r,
                _ => unreachable!("every call ran to a result when nothing stopped"),
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let batch = run_batch(3, 3, move |i| {
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
        let out = run_batch(4, 1, move |i| {
            let r = r.clone();
            async move {
                r.lock().unwrap().push(i);
                if i == 1 {
                    term(i)
                } else {
                    res(i)
                }
            }
        })
        .await;
        assert_eq!(
            *ran.lock().unwrap(),
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
        let out = run_batch(6, 4, move |i| {
            let (s, f, g) = (s.clone(), f.clone(), g.clone());
            async move {
                s.lock().unwrap().push(i);
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
                f.lock().unwrap().push(i);
                o
            }
        })
        .await;
        let mut started = started.lock().unwrap().clone();
        started.sort();
        assert_eq!(started, [0, 1, 2, 3], "calls 4 and 5 never start");
        let finished = finished.lock().unwrap().clone();
        assert!(
            finished.contains(&0) && finished.contains(&1),
            "in-flight calls were drained: {finished:?}"
        );
        assert!(matches!(out, Err(Stop::Terminate { reason, .. }) if reason == "stop at 2"));
    }

    #[tokio::test]
    async fn retry_is_reported_when_nothing_terminated() {
        let out = run_batch(2, 2, |i| async move {
            if i == 1 {
                CallOutcome::Retry("use a real tool".into())
            } else {
                res(i)
            }
        })
        .await;
        assert!(matches!(out, Ok(BatchDecision::Retry(f)) if f == "use a real tool"));
    }
}
