//! A panic inside a run ends that run, never the service or the session.
//!
//! Whatever panics while a run is driven (a bug in hookwire, a provider, a
//! number from a model or a hook that slipped past a clamp) ends *that* run
//! with outcome `failed` and reason [`INTERNAL_ERROR`]: it is logged at error
//! with the run id and counted in `hookwire_run_panics_total`, its pending
//! approvals are withdrawn, `run_end` goes to its hooks and their streams
//! are closed, and the client's `Run` stream / `Invoke` call gets the
//! result. The caller (the engine) then releases the session as after any
//! other ending. This relies on unwinding: never build hookwire with
//! `panic = "abort"`.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;

use crate::agent::events::{RunEvent, RunReport};
use crate::agent::outcome::RunOutcome;
use crate::agent::runner::{drive, Run};
use crate::event::EventKind;
use crate::hooks::payload::Payload;
use crate::message::{Message, Usage};

/// The reason a panicked run reports. The details stay in the server log:
/// a panic message may quote anything, content included.
pub const INTERNAL_ERROR: &str =
    "internal error: the run stopped on a bug in hookwire (the server log has details under this run id)";

/// [`drive`], with any panic contained to the run.
pub async fn drive_contained(run: Arc<Run>, transcript: Vec<Message>, input: String) -> RunReport {
    contain(run.clone(), drive(run, transcript, input)).await
}

/// Runs a run's driver; a panic in it becomes a `failed` report.
pub async fn contain(
    run: Arc<Run>,
    driver: impl std::future::Future<Output = RunReport>,
) -> RunReport {
    match AssertUnwindSafe(driver).catch_unwind().await {
        Ok(report) => report,
        Err(payload) => panicked(&run, payload.as_ref()),
    }
}

/// Ends a run whose driver panicked. The driver's future is already dropped,
/// so its own guards ran; what is left is made safe here, each part on its
/// own so that a second panic (a poisoned lock, say) cannot keep the client
/// from its result nor the session from being released.
fn panicked(run: &Run, payload: &(dyn Any + Send)) -> RunReport {
    let agent = run.agent.config.name.as_str();
    tracing::error!(
        run_id = %run.run_id,
        session_id = %run.session_id,
        agent,
        "run panicked; ended with outcome failed (internal error)"
    );
    tracing::debug!(run_id = %run.run_id, panic = %panic_text(payload), "panic payload");
    run.inst.metrics.run_panicked(agent);
    // Nothing may start for this run any more.
    run.cancel.cancel();
    run.approvals.withdraw_run(&run.run_id);
    let report = RunReport {
        run_id: run.run_id.clone(),
        session_id: run.session_id.clone(),
        outcome: RunOutcome::Failed,
        final_text: String::new(),
        reason: INTERNAL_ERROR.to_string(),
        usage: Usage::default(),
        turns: 0,
        // The machine's state went with the panic: commit nothing rather than
        // a transcript that might hold a tool call without its result.
        messages: Vec::new(),
        hook_verdicts: quietly(|| run.verdict_records()).unwrap_or_default(),
        finish_reason: String::new(),
    };
    quietly(|| {
        run.hooks.observe(0, EventKind::RunEnd, || Payload::RunEnd {
            outcome: report.outcome,
            reason: report.reason.clone(),
            final_text: String::new(),
            usage: report.usage,
            turns: 0,
        })
    });
    quietly(|| run.hooks.close());
    quietly(|| run.emit(RunEvent::Finished(report.clone())));
    report
}

/// Runs a clean-up step; a panic in it is logged and otherwise ignored.
fn quietly<T>(step: impl FnOnce() -> T) -> Option<T> {
    match std::panic::catch_unwind(AssertUnwindSafe(step)) {
        Ok(v) => Some(v),
        Err(p) => {
            tracing::error!("clean-up after a run panic panicked too");
            tracing::debug!(panic = %panic_text(p.as_ref()), "panic payload");
            None
        }
    }
}

fn panic_text(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(not a string)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::approvals::{ApprovalError, Approvals, Decision};
    use crate::agent::runner::AgentRuntime;
    use crate::config::Config;
    use crate::hooks::dispatch::RunHooks;
    use crate::hooks::payload::EventContext;
    use crate::hooks::registry::HookRegistry;
    use crate::telemetry::Instruments;
    use tokio::sync::mpsc;
    use tokio::time::{Duration, Instant};

    fn run(approvals: Arc<Approvals>) -> (Arc<Run>, mpsc::Receiver<RunEvent>) {
        let config = Config::parse(
            "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\n",
            "test",
        )
        .unwrap();
        let models = crate::server::build_models(&config).unwrap();
        let agent = Arc::new(AgentRuntime {
            config: config.agents[0].clone(),
            model: models["m"].clone(),
        });
        let inst = Instruments::new(&config.telemetry);
        let deadline = Instant::now() + Duration::from_secs(60);
        let hooks = RunHooks::new(
            vec![],
            EventContext::default(),
            deadline,
            Duration::from_secs(5),
            inst.clone(),
        );
        let (tx, rx) = mpsc::channel(16);
        let run = Run::new(
            "r1".into(),
            "s1".into(),
            agent,
            hooks,
            Arc::new(HookRegistry::new(&config).unwrap()),
            true,
            approvals,
            deadline,
            tx,
            inst,
        );
        (Arc::new(run), rx)
    }

    #[tokio::test]
    async fn a_panic_ends_the_run_failed_withdraws_its_approvals_and_tells_the_client() {
        let approvals = Arc::new(Approvals::default());
        let (run, mut events) = run(approvals.clone());
        let other = approvals.register("another-run", "c1", None);
        let r = run.clone();
        let report = contain(run.clone(), async move {
            // A call of this run waits for approval when the run panics (its
            // request guard forgotten, to check the sweep on its own).
            std::mem::forget(r.approvals.register(&r.run_id, "c1", None));
            tokio::task::yield_now().await;
            panic!("injected");
        })
        .await;
        assert_eq!(report.outcome, RunOutcome::Failed);
        assert_eq!(report.reason, INTERNAL_ERROR);
        assert!(report.messages.is_empty(), "nothing half-done is committed");
        assert!(run.cancel.is_cancelled(), "nothing new starts for the run");
        let approve = || Decision {
            approve: true,
            note: String::new(),
        };
        assert_eq!(
            approvals.resolve("r1", "c1", approve()),
            Err(ApprovalError::NotPending {
                run_id: "r1".into(),
                call_id: "c1".into()
            }),
            "the panicked run's approval is withdrawn"
        );
        assert_eq!(approvals.resolve("another-run", "c1", approve()), Ok(()));
        drop(other);
        match events.recv().await {
            Some(RunEvent::Finished(r)) => assert_eq!(r, report),
            other => panic!("expected the report, got {other:?}"),
        }
        assert!(run
            .inst
            .metrics
            .encode()
            .contains(r#"hookwire_run_panics_total{agent="a"} 1"#));
    }

    #[tokio::test]
    async fn a_driver_that_does_not_panic_is_untouched() {
        let (run, _events) = run(Arc::new(Approvals::default()));
        let report = contain(run.clone(), async {
            RunReport {
                run_id: "r1".into(),
                session_id: "s1".into(),
                outcome: RunOutcome::Completed,
                final_text: "ok".into(),
                reason: String::new(),
                usage: Usage::default(),
                turns: 1,
                messages: vec![],
                hook_verdicts: vec![],
                finish_reason: "stop".into(),
            }
        })
        .await;
        assert_eq!(report.outcome, RunOutcome::Completed);
        assert!(!run.cancel.is_cancelled());
        assert!(!run
            .inst
            .metrics
            .encode()
            .contains("hookwire_run_panics_total{"));
    }
}
