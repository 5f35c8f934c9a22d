//! Calls a run's hooks at one event and applies the failure policy. The
//! meaning of the verdicts together is decided by `compose`; this module
//! does the IO, the deadlines and the bookkeeping.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::FailurePolicy;
use crate::event::EventKind;
use crate::hooks::breaker::Admit;
use crate::hooks::client::HookClient;
use crate::hooks::compose::{self, ChainEvent, Merged, Step};
use crate::hooks::failure::{FailureClass, Fault, HookFailure};
use crate::hooks::payload::{EventContext, Payload};
use crate::hooks::provenance::VerdictRecord;
use crate::hooks::stream::RunStream;
use crate::hooks::verdict::{Action, ModelRequestAction, ScratchOp, Verdict};
use crate::hooks::wire;
use crate::model::ModelRequest;
use crate::pb;

struct RunHook {
    client: Arc<HookClient>,
    stream: Mutex<Option<Arc<RunStream>>>,
    detached: AtomicBool,
}

/// Counters a run's hooks produce, for metrics and tests.
#[derive(Default, Debug)]
pub struct DispatchStats {
    pub observe_dropped: AtomicU64,
}

/// Result of a chain event.
pub struct ChainOutcome<E: ChainEvent> {
    /// The payload after every applied rewrite.
    pub payload: E::Payload,
    /// The terminal verdict that stopped the chain, with its hook.
    pub stop: Option<(String, E::Stop)>,
    pub records: Vec<VerdictRecord>,
    /// The last telemetry-only redaction given in the chain.
    pub redaction: Option<String>,
}

pub struct MergeOutcome {
    pub merged: Merged,
    pub records: Vec<VerdictRecord>,
    pub redaction: Option<String>,
}

/// The hooks of one run (or of one session event), in firing order.
pub struct RunHooks {
    hooks: Vec<RunHook>,
    ctx: EventContext,
    scratchpad: Mutex<BTreeMap<String, Vec<u8>>>,
    run_deadline: Instant,
    event_budget: Duration,
    pub stats: DispatchStats,
}

impl RunHooks {
    pub fn new(
        clients: Vec<Arc<HookClient>>,
        ctx: EventContext,
        run_deadline: Instant,
        event_budget: Duration,
    ) -> RunHooks {
        RunHooks {
            hooks: clients
                .into_iter()
                .map(|client| RunHook {
                    client,
                    stream: Mutex::new(None),
                    detached: AtomicBool::new(false),
                })
                .collect(),
            ctx,
            scratchpad: Mutex::new(BTreeMap::new()),
            run_deadline,
            event_budget,
            stats: DispatchStats::default(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.hooks.is_empty()
    }

    pub fn context(&self) -> &EventContext {
        &self.ctx
    }

    pub fn scratchpad(&self) -> BTreeMap<String, Vec<u8>> {
        self.scratchpad.lock().unwrap().clone()
    }

    /// Wire context for CallTool and events.
    pub fn wire_context(&self, turn: u32, remaining: Duration) -> pb::EventContext {
        let mut ctx = self.ctx.clone();
        ctx.turn = turn;
        wire::context_to_wire(&ctx, &self.scratchpad.lock().unwrap(), remaining)
    }

    /// Whether any hook of this run may steer `kind` (used to decide whether
    /// text deltas must be held back).
    pub fn has_blocking(&self, kind: EventKind) -> bool {
        self.hooks.iter().any(|h| {
            !h.client.is_observe()
                && h.client
                    .subscriptions()
                    .map(|s| s.contains(&kind))
                    .unwrap_or(true)
        })
    }

    fn event_deadline(&self) -> Instant {
        (Instant::now() + self.event_budget).min(self.run_deadline)
    }

    /// Decides whether `hook` takes part in `kind`. An undescribed hook with
    /// no configured events is described now; failing that is a connect
    /// failure of the event.
    async fn participates(
        &self,
        hook: &RunHook,
        kind: EventKind,
        deadline: Instant,
    ) -> Result<bool, Fault> {
        if hook.detached.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let subs = match hook.client.subscriptions() {
            Some(s) => s,
            None => {
                let budget = deadline
                    .saturating_duration_since(Instant::now())
                    .min(hook.client.config.timeout);
                hook.client.describe(budget).await?;
                hook.client.subscriptions().unwrap_or_default()
            }
        };
        Ok(subs.contains(&kind))
    }

    /// The hook's stream for this run, opened at its first event. A stream
    /// broken by an already reported fault is replaced, so a hook that is
    /// still attached (fail-open without detach) gets a fresh stream.
    fn stream(&self, hook: &RunHook) -> Arc<RunStream> {
        let mut g = hook.stream.lock().unwrap();
        if g.as_ref().is_some_and(|s| s.is_spent()) {
            if let Some(old) = g.take() {
                old.close();
            }
        }
        g.get_or_insert_with(|| {
            let mut md = Vec::new();
            if !self.ctx.traceparent.is_empty() {
                md.push(("traceparent", self.ctx.traceparent.clone()));
            }
            if !self.ctx.tracestate.is_empty() {
                md.push(("tracestate", self.ctx.tracestate.clone()));
            }
            Arc::new(hook.client.open_stream(md))
        })
        .clone()
    }

    fn wire_event(&self, turn: u32, payload: &Payload, deadline: Instant) -> pb::HookEvent {
        pb::HookEvent {
            seq: 0,
            kind: pb::EventKind::from(payload.kind()) as i32,
            context: Some(
                self.wire_context(turn, deadline.saturating_duration_since(Instant::now())),
            ),
            expects_verdict: false,
            payload: Some(wire::payload_to_wire(payload)),
        }
    }

    /// One blocking call: send, wait, convert. Every failure is a `Fault`.
    async fn call(
        &self,
        hook: &RunHook,
        turn: u32,
        payload: &Payload,
        event_deadline: Instant,
    ) -> Result<Verdict, Fault> {
        let kind = payload.kind();
        let deadline = (Instant::now() + hook.client.config.timeout_for(kind)).min(event_deadline);
        if deadline <= Instant::now() {
            return Err(Fault::new(
                FailureClass::Deadline,
                "event budget or run deadline exhausted before the hook was called",
            ));
        }
        if hook.client.admit() == Admit::Reject {
            return Err(Fault::new(
                FailureClass::CircuitOpen,
                "circuit breaker open after repeated failures",
            ));
        }
        let result = async {
            let stream = self.stream(hook);
            if let Some(f) = stream.take_unreported() {
                return Err(f);
            }
            let pending = stream
                .send_blocking(self.wire_event(turn, payload, deadline), deadline)
                .await?;
            let v = stream.wait(pending, deadline).await?;
            Verdict::try_from(v)
                .map_err(|e| Fault::new(FailureClass::InvalidVerdict, e.to_string()))
        }
        .await;
        hook.client.record(result.is_ok());
        if let Err(f) = &result {
            hook.client.note_fault(f);
        }
        result
    }

    /// Applies the hook's failure policy. Closed: the failure ends the run.
    /// Open: recorded, optionally detached, and the event proceeds.
    fn policy(
        &self,
        hook: &RunHook,
        kind: EventKind,
        fault: Fault,
        records: &mut Vec<VerdictRecord>,
    ) -> Result<(), HookFailure> {
        let cfg = &hook.client.config;
        tracing::warn!(
            hook = %cfg.name,
            event = %kind,
            class = %fault.class,
            detail = %fault.detail,
            policy = ?cfg.failure,
            "hook failed"
        );
        if cfg.failure == FailurePolicy::Closed && !hook.client.is_observe() {
            return Err(HookFailure {
                hook: cfg.name.clone(),
                event: kind,
                fault,
            });
        }
        if cfg.detach_on_failure {
            hook.detached.store(true, Ordering::Relaxed);
        }
        let mut rec = VerdictRecord::new(&cfg.name, kind, "continue", &fault.detail);
        rec.failed_open = Some(fault.class);
        records.push(rec);
        Ok(())
    }

    fn apply_scratchpad(&self, ops: Vec<ScratchOp>) {
        let mut pad = self.scratchpad.lock().unwrap();
        for op in ops {
            match op {
                ScratchOp::Set(k, v) => {
                    pad.insert(k, v);
                }
                ScratchOp::Delete(k) => {
                    pad.remove(&k);
                }
            }
        }
    }

    /// Sends `payload` to observe-mode hooks subscribed to it, without waiting.
    fn notify_observers(&self, turn: u32, payload: &Payload, only_observe_mode: bool) {
        let kind = payload.kind();
        let deadline = self.event_deadline();
        for hook in &self.hooks {
            if only_observe_mode && !hook.client.is_observe() {
                continue;
            }
            if hook.detached.load(Ordering::Relaxed) {
                continue;
            }
            let subscribed = hook
                .client
                .subscriptions()
                .map(|s| s.contains(&kind))
                .unwrap_or(false);
            if subscribed {
                let ev = self.wire_event(turn, payload, deadline);
                if !self.stream(hook).send_observe(ev) {
                    self.stats.observe_dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(hook = %hook.client.name(), event = %kind, "observe event dropped");
                }
            }
        }
    }

    /// An observe event (text_delta, run_end, session_end): delivered to
    /// subscribers without waiting; never fails the run.
    pub fn observe(&self, turn: u32, payload: &Payload) {
        self.notify_observers(turn, payload, false);
    }

    /// Runs a chain event through every subscribed blocking hook in order.
    pub async fn chain<E: ChainEvent>(
        &self,
        turn: u32,
        mut payload: E::Payload,
        to_wire: impl Fn(&E::Payload) -> Payload,
    ) -> Result<ChainOutcome<E>, HookFailure> {
        let kind = E::KIND;
        let event_deadline = self.event_deadline();
        let mut records = Vec::new();
        let mut redaction = None;
        for hook in &self.hooks {
            if hook.client.is_observe() {
                continue;
            }
            match self.participates(hook, kind, event_deadline).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(f) => {
                    self.policy(hook, kind, f, &mut records)?;
                    continue;
                }
            }
            let verdict = match self
                .call(hook, turn, &to_wire(&payload), event_deadline)
                .await
            {
                Ok(v) => v,
                Err(f) => {
                    self.policy(hook, kind, f, &mut records)?;
                    continue;
                }
            };
            let name = hook.client.name().to_string();
            let verdict_name = verdict.action.kind_name();
            let Verdict { meta, action } = verdict;
            match E::apply(&mut payload, action) {
                Err(wrong) => {
                    let f = Fault::new(
                        FailureClass::WrongKind,
                        format!("answered a {wrong} verdict to a {kind} event"),
                    );
                    hook.client.record(false);
                    self.policy(hook, kind, f, &mut records)?;
                }
                Ok(step) => {
                    self.apply_scratchpad(meta.scratchpad);
                    if meta.telemetry_redaction.is_some() {
                        redaction = meta.telemetry_redaction;
                    }
                    let mut rec = VerdictRecord::new(&name, kind, verdict_name, &meta.reason);
                    match step {
                        Step::Continue { changed } => {
                            rec.fields_changed = changed.iter().map(|s| s.to_string()).collect();
                            records.push(rec);
                        }
                        Step::Stop(stop) => {
                            records.push(rec);
                            self.notify_observers(turn, &to_wire(&payload), true);
                            return Ok(ChainOutcome {
                                payload,
                                stop: Some((name, stop)),
                                records,
                                redaction,
                            });
                        }
                    }
                }
            }
        }
        self.notify_observers(turn, &to_wire(&payload), true);
        Ok(ChainOutcome {
            payload,
            stop: None,
            records,
            redaction,
        })
    }

    /// `model_request`: every subscribed hook is called concurrently on the
    /// same baseline; verdicts are merged in firing order.
    pub async fn model_request(
        &self,
        turn: u32,
        baseline: &ModelRequest,
    ) -> Result<MergeOutcome, HookFailure> {
        let kind = EventKind::ModelRequest;
        let event_deadline = self.event_deadline();
        let payload = Payload::ModelRequest(baseline.clone());
        let calls = self.hooks.iter().map(|hook| {
            let payload = &payload;
            async move {
                if hook.client.is_observe() {
                    return None;
                }
                match self.participates(hook, kind, event_deadline).await {
                    Ok(true) => Some(self.call(hook, turn, payload, event_deadline).await),
                    Ok(false) => None,
                    Err(f) => Some(Err(f)),
                }
            }
        });
        let results = futures::future::join_all(calls).await;
        let mut records = Vec::new();
        let mut failed_open = Vec::new();
        let mut actions = Vec::new();
        let mut redaction = None;
        for (hook, result) in self.hooks.iter().zip(results) {
            let Some(result) = result else { continue };
            let verdict = match result {
                Ok(v) => v,
                Err(f) => {
                    self.policy(hook, kind, f, &mut failed_open)?;
                    continue;
                }
            };
            let Verdict { meta, action } = verdict;
            let action = match action {
                Action::ModelRequest(a) => a,
                other => {
                    let f = Fault::new(
                        FailureClass::WrongKind,
                        format!("answered a {} verdict to a {kind} event", other.event()),
                    );
                    hook.client.record(false);
                    self.policy(hook, kind, f, &mut failed_open)?;
                    continue;
                }
            };
            if let ModelRequestAction::Patch(p) = &action {
                if let Err(e) = compose::validate_patch(baseline, p) {
                    hook.client.record(false);
                    self.policy(
                        hook,
                        kind,
                        Fault::new(FailureClass::InvalidVerdict, e),
                        &mut failed_open,
                    )?;
                    continue;
                }
            }
            self.apply_scratchpad(meta.scratchpad);
            if meta.telemetry_redaction.is_some() {
                redaction = meta.telemetry_redaction;
            }
            actions.push((hook.client.name().to_string(), action, meta.reason));
        }
        let reasons: Vec<(String, String)> = actions
            .iter()
            .map(|(h, _, r)| (h.clone(), r.clone()))
            .collect();
        let merged = compose::merge(
            baseline,
            actions.into_iter().map(|(h, a, _)| (h, a)).collect(),
        );
        match &merged {
            Merged::Request { records: recs, .. } => {
                for r in recs {
                    let mut r = r.clone();
                    if let Some((_, reason)) = reasons.iter().find(|(h, _)| *h == r.hook) {
                        r.reason = reason.clone();
                    }
                    records.push(r);
                }
            }
            Merged::Terminate { hook, terminate } => {
                records.push(VerdictRecord::new(
                    hook,
                    kind,
                    "terminate",
                    &terminate.reason,
                ));
            }
            Merged::Respond { hook, .. } => {
                let reason = reasons
                    .iter()
                    .find(|(h, _)| h == hook)
                    .map(|(_, r)| r.as_str())
                    .unwrap_or("");
                records.push(VerdictRecord::new(hook, kind, "respond", reason));
            }
        }
        records.extend(failed_open);
        self.notify_observers(turn, &payload, true);
        Ok(MergeOutcome {
            merged,
            records,
            redaction,
        })
    }

    /// The first protocol violation (duplicate / spurious verdict, reset)
    /// seen on a fail-closed hook's stream, so a run does not complete as if
    /// nothing happened.
    pub fn violation(&self, event: EventKind) -> Option<HookFailure> {
        self.hooks.iter().find_map(|h| {
            if h.client.config.failure != FailurePolicy::Closed || h.client.is_observe() {
                return None;
            }
            let stream = h.stream.lock().unwrap().clone()?;
            let fault = stream.take_unreported()?;
            matches!(
                fault.class,
                FailureClass::Duplicate | FailureClass::Spurious
            )
            .then(|| HookFailure {
                hook: h.client.name().to_string(),
                event,
                fault,
            })
        })
    }

    /// Verdicts that arrived after their deadline, over all streams.
    pub fn late_verdicts(&self) -> u64 {
        self.hooks
            .iter()
            .filter_map(|h| h.stream.lock().unwrap().clone())
            .map(|s| s.late_count())
            .sum()
    }

    /// Half-closes every open stream (after run_end / session events).
    pub fn close(&self) {
        for h in &self.hooks {
            if let Some(s) = h.stream.lock().unwrap().take() {
                s.close();
            }
        }
    }
}
