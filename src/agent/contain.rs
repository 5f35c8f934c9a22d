//! A panic inside a run ends that run, never the service or the session.
//!
//! Whatever panics while a run is driven (a bug in hookwire, a provider, a
//! number from a model or a hook that slipped past a clamp) ends *that* run
//! with outcome `failed` and reason [`INTERNAL_ERROR`]: it is logged at error
//! with the run id and counted in `hookwire_run_panics_total`, its pending
//! approvals are withdrawn, `run_end` goes to its hooks and their streams
//! are closed, the run's end is recorded in the store (which frees the
//! session, ends the lease and denies the run's approvals there too, for
//! every replica), and the client's `Run` stream / `Invoke` call gets the
//! result. This relies on unwinding: never build hookwire with
//! `panic = "abort"`.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;

use crate::agent::events::{RunEvent, RunReport};
use crate::agent::outcome::RunOutcome;
use crate::agent::runner::{drive_to_end, Driven, Run};
use crate::event::EventKind;
use crate::hooks::payload::Payload;
use crate::message::{Message, Usage};
use crate::store::{RunEnd, StoreError};

/// The reason a panicked run reports. The details stay in the server log:
/// a panic message may quote anything, content included.
pub const INTERNAL_ERROR: &str =
    "internal error: the run stopped on a bug in hookwire (the server log has details under this run id)";

/// [`drive_to_end`], with any panic contained to the run (a panicked run's
/// client has its report already: its tail is empty).
pub async fn drive_contained(
    run: Arc<Run>,
    transcript: Arc<Vec<Message>>,
    input: String,
) -> Driven {
    // Boxed: the driver's future is large (every await of the run, hook
    // calls included), and inline it made the spawned run task that size,
    // which the compiler may then copy whole on spawn and on each poll of
    // the task (callgrind: up to ~120k instructions of memcpy per run).
    let driver = Box::pin(drive_to_end(run.clone(), transcript, input));
    let mut tail = Vec::new();
    let report = contain(run, async {
        let driven = driver.await;
        tail = driven.tail;
        driven.report
    })
    .await;
    Driven { report, tail }
}

/// Runs a run's driver; a panic in it becomes a `failed` report.
pub async fn contain(
    run: Arc<Run>,
    driver: impl std::future::Future<Output = RunReport>,
) -> RunReport {
    match AssertUnwindSafe(driver).catch_unwind().await {
        Ok(report) => report,
        // Boxed: inline, this rare path's state (two reports and the store
        // write) made every run's task 1 088 bytes instead of ~400, copied
        // whole when the task is spawned and again when it completes.
        Err(payload) => Box::pin(recover(run, payload)).await,
    }
}

/// What is left of a run whose driver panicked: its end recorded, then
/// announced.
async fn recover(run: Arc<Run>, payload: Box<dyn Any + Send>) -> RunReport {
    let report = panicked(&run, payload.as_ref());
    record_end(&run, &report).await;
    announce(&run, &report);
    report
}

/// Records the panicked run's end in the store, before anyone hears of it:
/// a client that got the result may start the next run at once. Messages
/// the run recorded before the panic (settled steps) stay; a tool batch in
/// flight was staged, not committed, so the transcript stays valid.
async fn record_end(run: &Run, report: &RunReport) {
    let end = RunEnd {
        outcome: report.outcome,
        reason: report.reason.clone(),
        usage: report.usage,
        turns: report.turns,
    };
    match AssertUnwindSafe(run.ledger.end(&[], &end))
        .catch_unwind()
        .await
    {
        Ok(Ok(())) => {}
        // Already ended (the panic came after the end was recorded) or
        // taken over by another replica: nothing of ours to record.
        Ok(Err(StoreError::LeaseLost(_))) => {}
        // The lease then expires and a replica's reaper ends the run
        // `interrupted`, as for a lost replica.
        Ok(Err(e)) => {
            tracing::error!(run_id = %run.run_id, error = %e, "cannot record the end of a panicked run; its lease will expire")
        }
        Err(p) => {
            tracing::error!(run_id = %run.run_id, "recording the end of a panicked run panicked too; its lease will expire");
            tracing::debug!(panic = %panic_text(p.as_ref()), "panic payload");
        }
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
    quietly(|| run.inst.metrics.run_panicked(agent));
    // Nothing may start for this run any more.
    run.cancel.cancel();
    quietly(|| run.approvals.withdraw_run(&run.run_id));
    RunReport {
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
    }
}

/// run_end to the run's hooks, their streams closed, the result to the
/// client.
fn announce(run: &Run, report: &RunReport) {
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
}

/// Sends a run's last events (`send`: [`Run::deliver_tail`]) after its
/// end was recorded; a panic there is logged and counted as the run's, and
/// ends only the sending. The run's task still returns its report, which a
/// `Run` client then gets once the run's event queue closes, and the run
/// still leaves its replica (a drain would otherwise wait for it).
pub async fn contain_tail(run: &Run, send: impl std::future::Future<Output = ()>) {
    if let Err(p) = AssertUnwindSafe(send).catch_unwind().await {
        tracing::error!(
            run_id = %run.run_id,
            "sending a run's last events panicked; its client gets the report without them"
        );
        tracing::debug!(panic = %panic_text(p.as_ref()), "panic payload");
        quietly(|| run.inst.metrics.run_panicked(&run.agent.config.name));
    }
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

/// One pass of a replica's background work (lease renewal, the reaper,
/// signal delivery, a hook's Describe, a hook pool's idle sweep): a panic
/// in it is logged and the pass counts as failed (`None`), so the loop
/// around it goes on. Unwound,
/// a loop would stop for the life of the process: no lease renewed, no
/// lost run reaped, no cancel delivered.
pub async fn contained<T>(
    what: &'static str,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(v) => Some(v),
        Err(p) => {
            tracing::error!(
                work = what,
                "background work panicked; it runs again at its next pass"
            );
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
    use crate::agent::ledger::Ledger;
    use crate::agent::runner::AgentRuntime;
    use crate::config::Config;
    use crate::hooks::dispatch::RunHooks;
    use crate::hooks::payload::EventContext;
    use crate::hooks::registry::HookRegistry;
    use crate::store::{MemoryStore, NewSession, SessionStore};
    use crate::telemetry::Instruments;
    use tokio::sync::mpsc;
    use tokio::time::{Duration, Instant};

    /// A run of session `s1` begun in `store`, as the engine begins one.
    async fn run(
        approvals: Arc<Approvals>,
        store: Arc<dyn SessionStore>,
    ) -> (Arc<Run>, mpsc::Receiver<crate::agent::events::QueuedEvent>) {
        store
            .create_session(&NewSession {
                id: "s1".into(),
                agent: "a".into(),
                owner: "o".into(),
                extra_hooks: vec![],
                metadata: Default::default(),
            })
            .await
            .unwrap();
        let lease = store.begin_run("s1", "r1", "me").await.unwrap();
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
            Ledger::new(store, lease),
        );
        (Arc::new(run), rx)
    }

    #[tokio::test]
    async fn a_panic_ends_the_run_failed_withdraws_its_approvals_and_tells_the_client() {
        let approvals = Arc::new(Approvals::default());
        let store: Arc<dyn SessionStore> = Arc::new(MemoryStore::default());
        let (run, mut events) = run(approvals.clone(), store.clone()).await;
        let other = approvals.register("another-run", "c1", None);
        let r = run.clone();
        let report = contain(run.clone(), async move {
            // A call of this run waits for approval when the run panics (its
            // request guard forgotten, to check the sweep on its own).
            std::mem::forget(r.approvals.register(&r.run_id, "c1", None));
            r.ledger.request_approval("c1").await.unwrap();
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
        // The store has the end too, for every replica: the session is
        // free, the run no longer active, its approval no longer pending.
        let s = store.get_session("s1").await.unwrap();
        assert_eq!(s.active_run, None, "the session is released in the store");
        assert!(matches!(
            store.run_session("r1").await,
            Err(crate::store::StoreError::RunNotFound(_))
        ));
        assert!(matches!(
            store.resolve_approval("r1", "c1", &approve()).await,
            Err(crate::store::StoreError::ApprovalNotPending { .. })
        ));
        store
            .begin_run("s1", "r2", "me")
            .await
            .expect("the session takes a new run");
        match events.recv().await.map(|e| *e) {
            Some(RunEvent::Finished(r)) => assert_eq!(r, report),
            other => panic!("expected the report, got {other:?}"),
        }
        assert!(run
            .inst
            .metrics
            .encode()
            .contains(r#"hookwire_run_panics_total{agent="a"} 1"#));
    }

    /// A panic while the last events are sent ends the sending only: the
    /// run's task goes on (to return its report and leave the replica),
    /// and the panic is counted.
    #[tokio::test]
    async fn a_panic_sending_the_last_events_ends_only_the_sending() {
        let store: Arc<dyn SessionStore> = Arc::new(MemoryStore::default());
        let (run, _events) = run(Arc::new(Approvals::default()), store).await;
        contain_tail(&run, async {
            tokio::task::yield_now().await;
            panic!("injected");
        })
        .await;
        assert!(run
            .inst
            .metrics
            .encode()
            .contains(r#"hookwire_run_panics_total{agent="a"} 1"#));
        contain_tail(&run, async {}).await;
        assert!(run
            .inst
            .metrics
            .encode()
            .contains(r#"hookwire_run_panics_total{agent="a"} 1"#));
    }

    #[tokio::test]
    async fn a_driver_that_does_not_panic_is_untouched() {
        let store: Arc<dyn SessionStore> = Arc::new(MemoryStore::default());
        let (run, _events) = run(Arc::new(Approvals::default()), store.clone()).await;
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
        assert_eq!(
            store.get_session("s1").await.unwrap().active_run.as_deref(),
            Some("r1"),
            "the driver's own recording is left to it"
        );
        assert!(!run
            .inst
            .metrics
            .encode()
            .contains("hookwire_run_panics_total{"));
    }
}
