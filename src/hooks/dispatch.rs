//! Calls a run's hooks at one event and applies the failure policy. The
//! meaning of the verdicts together is decided by `compose`; this module
//! does the IO, the deadlines and the bookkeeping.

use crate::lock::LockExt;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Span;

use crate::agent::tools::validate_call;
use crate::config::FailurePolicy;
use crate::event::EventKind;
use crate::hooks::client::HookClient;
use crate::hooks::compose::{self, ChainEvent, Merged, Step};
use crate::hooks::failure::{FailureClass, Fault, HookFailure};
use crate::hooks::payload::{EventContext, Payload};
use crate::hooks::provenance::VerdictRecord;
use crate::hooks::registry::{compile_schema, HookRegistry};
use crate::hooks::stream::{RunStream, Sent};
use crate::hooks::verdict::{
    Action, ModelRequestAction, ScratchOp, ToolCallAction, Verdict, VerdictKind,
};
use crate::hooks::wire;
use crate::hooks::wire_event::{RunContext, WireEvent};
use crate::message::{ToolCall, ToolSpec};
use crate::model::ModelRequest;
use crate::pb;
use crate::telemetry::metrics::ActiveGuard;
use crate::telemetry::{propagation, HookSpan, Instruments};

struct RunHook {
    client: Arc<HookClient>,
    /// The run's stream to this hook, with its active-streams gauge share.
    stream: Mutex<Option<(Arc<RunStream>, ActiveGuard)>>,
    detached: AtomicBool,
    /// Set when the hook failed with `failure: closed`: the run is over, and
    /// the hook is never called again in it (not even on a fresh stream).
    failed: Mutex<Option<HookFailure>>,
}

impl RunHook {
    fn failed(&self) -> Option<HookFailure> {
        self.failed.locked().clone()
    }
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
    /// `ctx`'s fields that no event changes, encoded once for every event,
    /// at the first (many session events call no hook).
    wire_ctx: OnceLock<RunContext>,
    scratchpad: Mutex<BTreeMap<String, Vec<u8>>>,
    run_deadline: Instant,
    event_budget: Duration,
    inst: Instruments,
    pub stats: DispatchStats,
    /// Where tools' compiled argument schemas are cached (`None`: compiled
    /// at each check), for `rewrite_args` verdicts.
    schemas: Option<Arc<HookRegistry>>,
    /// The records of an event a closed hook failed (the verdicts of the
    /// hooks before it in a chain, the failed-open ones): the event's
    /// failure ends the run, and [`RunHooks::check_faults`] hands them to
    /// its last check, so its report keeps them.
    orphaned: Mutex<Vec<VerdictRecord>>,
}

impl RunHooks {
    pub fn new(
        clients: Vec<Arc<HookClient>>,
        ctx: EventContext,
        run_deadline: Instant,
        event_budget: Duration,
        inst: Instruments,
    ) -> RunHooks {
        RunHooks {
            wire_ctx: OnceLock::new(),
            hooks: clients
                .into_iter()
                .map(|client| RunHook {
                    client,
                    stream: Mutex::new(None),
                    detached: AtomicBool::new(false),
                    failed: Mutex::new(None),
                })
                .collect(),
            ctx,
            scratchpad: Mutex::new(BTreeMap::new()),
            run_deadline,
            event_budget,
            inst,
            stats: DispatchStats::default(),
            schemas: None,
            orphaned: Mutex::new(Vec::new()),
        }
    }

    /// `failure` ends the run: `records`, the event's records so far, go
    /// to its last check instead of being lost with the event.
    fn orphan(&self, failure: HookFailure, records: &mut Vec<VerdictRecord>) -> HookFailure {
        self.orphaned.locked().append(records);
        failure
    }

    /// Checks rewritten tool arguments with the registry's compiled
    /// schemas instead of compiling the tool's schema at each check.
    pub fn with_schemas(mut self, registry: Arc<HookRegistry>) -> RunHooks {
        self.schemas = Some(registry);
        self
    }

    /// A `rewrite_args` verdict must leave arguments the tool accepts (a
    /// JSON object that matches its schema), as the model's own call had
    /// to: the rewritten call goes to `CallTool` with no later check. One
    /// that does not is an invalid verdict, under the hook's policy (open:
    /// the rewrite is ignored, as if the hook said continue).
    fn check_rewrite(&self, payload: &Payload, verdict: &Verdict) -> Result<(), Fault> {
        check_rewrite(payload, verdict, self.schemas.as_deref())
    }

    pub fn is_empty(&self) -> bool {
        self.hooks.is_empty()
    }

    pub fn context(&self) -> &EventContext {
        &self.ctx
    }

    pub fn scratchpad(&self) -> BTreeMap<String, Vec<u8>> {
        self.scratchpad.locked().clone()
    }

    /// Wire context for CallTool and events.
    pub fn wire_context(&self, turn: u32, remaining: Duration) -> pb::EventContext {
        let mut ctx = self.ctx.clone();
        ctx.turn = turn;
        wire::context_to_wire(&ctx, &self.scratchpad.locked(), remaining)
    }

    /// Whether any hook of this run may steer `kind` (used to decide whether
    /// text deltas must be held back).
    pub fn has_blocking(&self, kind: EventKind) -> bool {
        self.hooks.iter().any(|h| {
            !h.client.is_observe()
                && (h.client.subscribes(kind).unwrap_or(true) || h.client.unsubscribed(kind))
        })
    }

    fn event_deadline(&self) -> Instant {
        (Instant::now() + self.event_budget).min(self.run_deadline)
    }

    /// Decides whether `hook` takes part in `kind`. An undescribed hook with
    /// no configured events is described now; failing that is a connect
    /// failure of the event. A configured event its server's Describe no
    /// longer lists is a failure of its own (`unsubscribed`), never a skip.
    async fn participates(
        &self,
        hook: &RunHook,
        kind: EventKind,
        deadline: Instant,
    ) -> Result<bool, Fault> {
        if hook.detached.load(Ordering::Relaxed) {
            return Ok(false);
        }
        if hook.client.unsubscribed(kind) {
            return Err(Fault::new(
                FailureClass::Unsubscribed,
                format!("the hook server's Describe no longer lists {kind}, which the hook's config names"),
            ));
        }
        match hook.client.subscribes(kind) {
            Some(subscribed) => Ok(subscribed),
            None => {
                let budget = deadline
                    .saturating_duration_since(Instant::now())
                    .min(hook.client.config.timeout);
                // Boxed: a hook not described yet is rare, and this call
                // inline made every hook event's future 1.9 KiB larger.
                Box::pin(hook.client.describe(budget)).await?;
                Ok(hook.client.subscribes(kind).unwrap_or(false))
            }
        }
    }

    /// The hook's stream for this run, opened at its first event. A stream
    /// broken by an already reported fault is replaced, so a hook that is
    /// still attached (fail-open without detach) gets a fresh stream.
    fn stream(&self, hook: &RunHook, trace: &(String, String)) -> Arc<RunStream> {
        let mut g = hook.stream.locked();
        if g.as_ref().is_some_and(|(s, _)| s.is_spent()) {
            if let Some((old, _)) = g.take() {
                self.retire(hook, &old);
            }
        }
        g.get_or_insert_with(|| {
            // The opening call's trace context, so the hook server's stream
            // handler joins the run's trace.
            let mut md = Vec::new();
            if !trace.0.is_empty() {
                md.push((propagation::TRACEPARENT, trace.0.clone()));
            }
            if !trace.1.is_empty() {
                md.push((propagation::TRACESTATE, trace.1.clone()));
            }
            (
                Arc::new(hook.client.open_stream(md, self.inst.metrics.clone())),
                self.inst.metrics.active_hook_stream(),
            )
        })
        .0
        .clone()
    }

    /// Half-closes a stream (its late verdicts are counted as they come).
    fn retire(&self, _hook: &RunHook, stream: &RunStream) {
        stream.close();
    }

    fn wire_event(
        &self,
        turn: u32,
        payload: &Payload,
        deadline: Instant,
        (traceparent, tracestate): (String, String),
    ) -> WireEvent {
        // The rest of the context is the run's, in `wire_ctx`; the time
        // left is measured when the event is sent, not now (it may wait).
        let context = pb::EventContext {
            turn,
            scratchpad: wire::scratchpad_to_wire(&self.scratchpad.locked()),
            traceparent,
            tracestate,
            ..Default::default()
        };
        let event = pb::HookEvent {
            seq: 0,
            kind: pb::EventKind::from(payload.kind()) as i32,
            context: None,
            expects_verdict: false,
            payload: Some(wire::payload_to_wire(payload)),
        };
        let run = self.wire_ctx.get_or_init(|| RunContext::new(&self.ctx));
        WireEvent::new(event, run, context).with_deadline(deadline)
    }

    /// One blocking call under its `hook {hook} {event}` span: send, wait,
    /// then [`accept_verdict`] and, for a `rewrite_args`, the tool's schema
    /// ([`RunHooks::check_rewrite`]). Every failure is a `Fault`.
    async fn call(
        &self,
        hook: &RunHook,
        turn: u32,
        payload: &Payload,
        event_deadline: Instant,
    ) -> (Result<Verdict, Fault>, HookSpan) {
        let kind = payload.kind();
        let name = hook.client.name();
        let mut span = HookSpan::start(name, kind.name());
        let started = Instant::now();
        // The breaker's leave to call; only a call that reached the hook has
        // an outcome for the breaker (and a dropped one records nothing).
        let mut permit = None;
        let result = async {
            let deadline = (started + hook.client.config.timeout_for(kind)).min(event_deadline);
            if deadline <= started {
                return Err(Fault::new(
                    FailureClass::Deadline,
                    "event budget or run deadline exhausted before the hook was called",
                ));
            }
            permit = Some(hook.client.admit().ok_or_else(|| {
                Fault::new(
                    FailureClass::CircuitOpen,
                    "circuit breaker open after repeated failures",
                )
            })?);
            let trace = span.trace_context();
            let stream = self.stream(hook, &trace);
            // A fault that broke the stream since the last check.
            if let Some(f) = stream.take_unreported() {
                return Err(f);
            }
            let event = self.wire_event(turn, payload, deadline, trace);
            let pending = match stream.send_blocking(event)? {
                Sent::Queued(p) => p,
                // Boxed: a hook that reads slower than events come is rare,
                // and this wait inline made every hook call's future larger.
                Sent::Full(full) => Box::pin(full.until(deadline)).await?,
            };
            let v = stream.wait(pending, deadline).await?;
            let baseline = match payload {
                Payload::ModelRequest(r) => Some(r),
                _ => None,
            };
            let v = accept_verdict(kind, v, baseline)?;
            self.check_rewrite(payload, &v)?;
            Ok(v)
        }
        .await;
        // The span ends with the call even when it lives on for the failure
        // policy or the merge.
        span.end_now();
        let latency = started.elapsed();
        let m = &self.inst.metrics;
        match &result {
            Ok(v) => {
                span.record_result(v.action.kind_name(), "ok", latency);
                hook.client.record_call(m, kind, "ok", latency);
            }
            Err(f) => {
                span.record_result("none", f.class.name(), latency);
                span.record_error(f.class.name());
                hook.client.record_call(m, kind, f.class.name(), latency);
                m.hook_failure(name, f.event(kind).name(), f.class.name());
                hook.client.note_fault(f);
            }
        }
        match (permit, &result) {
            // The event waited for a free stream slot until its deadline and
            // never reached the hook: dropped without an outcome, the
            // permit holds nothing against it (a busy pool would otherwise
            // open the breaker of a healthy hook server).
            (Some(_), Err(f)) if f.unsent => {}
            (Some(permit), _) => permit.record(result.is_ok()),
            (None, _) => {}
        }
        (result, span)
    }

    /// A failure found without calling the hook (it could not be described,
    /// or its Describe dropped the event): counted, with a `hook {hook}
    /// {event}` span of its own for the policy to mark.
    fn not_called(&self, hook: &RunHook, kind: EventKind, fault: &Fault) -> HookSpan {
        let name = hook.client.name();
        let class = fault.class.name();
        let mut span = HookSpan::start(name, kind.name());
        span.record_result("none", class, Duration::ZERO);
        span.record_error(class);
        span.end_now();
        self.inst.metrics.hook_failure(name, kind.name(), class);
        span
    }

    /// Applies the hook's failure policy. Closed: the failure ends the run.
    /// Open: recorded, optionally detached, and the event proceeds.
    fn policy(
        &self,
        hook: &RunHook,
        kind: EventKind,
        fault: Fault,
        records: &mut Vec<VerdictRecord>,
        span: &mut HookSpan,
    ) -> Result<(), HookFailure> {
        // A fault that broke the stream names the event it was seen after.
        let kind = fault.event(kind);
        let cfg = &hook.client.config;
        // One line per hook and class per interval (the rest are counted in
        // `suppressed`); the hook server's own words only at debug.
        if let Some(suppressed) = hook.client.log_failure(fault.class) {
            tracing::warn!(
                hook = %cfg.name,
                event = %kind,
                class = %fault.class,
                detail = %fault.log_detail(),
                policy = ?cfg.failure,
                run_id = %self.ctx.run_id,
                suppressed,
                "hook failed"
            );
        }
        tracing::debug!(
            hook = %cfg.name,
            event = %kind,
            class = %fault.class,
            detail = %fault.detail,
            run_id = %self.ctx.run_id,
            "hook failure detail"
        );
        if cfg.failure == FailurePolicy::Closed && !hook.client.is_observe() {
            let failure = HookFailure {
                hook: cfg.name.clone(),
                event: kind,
                fault,
            };
            hook.failed.locked().get_or_insert_with(|| failure.clone());
            return Err(failure);
        }
        if cfg.detach_on_failure {
            hook.detached.store(true, Ordering::Relaxed);
        }
        self.inst.metrics.hook_fail_open(&cfg.name, kind.name());
        span.add_event(
            "hook.failed_open",
            &[
                (
                    crate::telemetry::attrs::HOOKWIRE_HOOK_NAME,
                    cfg.name.as_str(),
                ),
                (crate::telemetry::attrs::HOOKWIRE_HOOK_EVENT, kind.name()),
                (crate::telemetry::attrs::ERROR_TYPE, fault.class.name()),
            ],
        );
        let mut rec = VerdictRecord::new(&cfg.name, kind, VerdictKind::Continue, &fault.detail);
        rec.failed_open = Some(fault.class);
        records.push(rec);
        Ok(())
    }

    /// Applies a verdict's scratchpad updates, all or none
    /// ([`scratchpad_after`]).
    fn apply_scratchpad(&self, ops: Vec<ScratchOp>) -> Result<(), Fault> {
        if ops.is_empty() {
            return Ok(());
        }
        let mut pad = self.scratchpad.locked();
        *pad = scratchpad_after(pad.clone(), ops)?;
        Ok(())
    }

    /// Sends the payload `make` builds to the hooks subscribed to `kind`
    /// (only observe-mode ones when asked), without waiting. The payload is
    /// built only when some hook takes it: this runs after every event.
    fn notify_observers(
        &self,
        turn: u32,
        kind: EventKind,
        make: impl FnOnce() -> Payload,
        only_observe_mode: bool,
    ) {
        let mut make = Some(make);
        let mut payload = None;
        let mut deadline = None;
        for hook in &self.hooks {
            if only_observe_mode && !hook.client.is_observe() {
                continue;
            }
            if hook.detached.load(Ordering::Relaxed) {
                continue;
            }
            if hook.client.subscribes(kind).unwrap_or(false) {
                let payload: &Payload = payload.get_or_insert_with(|| (make.take().unwrap())());
                let deadline = *deadline.get_or_insert_with(|| self.event_deadline());
                let trace = propagation::current_trace_context(&Span::current());
                let stream = if hook.failed().is_some() {
                    // A hook that failed closed gets no fresh stream; an
                    // intact one still carries run_end.
                    match hook.stream.locked().as_ref() {
                        Some((s, _)) if s.poisoned().is_none() => s.clone(),
                        _ => continue,
                    }
                } else {
                    self.stream(hook, &trace)
                };
                let ev = self.wire_event(turn, payload, deadline, trace);
                if !stream.send_observe(ev) {
                    self.stats.observe_dropped.fetch_add(1, Ordering::Relaxed);
                    self.inst.metrics.observe_dropped(hook.client.name());
                    tracing::debug!(hook = %hook.client.name(), event = %kind, "observe event dropped");
                }
            }
        }
    }

    /// An observe event (text_delta, run_end, session_end): delivered to
    /// subscribers without waiting; never fails the run. `make` builds the
    /// payload, only if some hook subscribes to `kind`.
    pub fn observe(&self, turn: u32, kind: EventKind, make: impl FnOnce() -> Payload) {
        self.notify_observers(turn, kind, make, false);
    }

    /// Runs a chain event through every subscribed blocking hook in order.
    pub async fn chain<E: ChainEvent>(
        &self,
        turn: u32,
        payload: E::Payload,
        to_wire: impl Fn(&E::Payload) -> Payload,
    ) -> Result<ChainOutcome<E>, HookFailure> {
        match self.run_chain(turn, payload, to_wire, None).await? {
            Some(out) => Ok(out),
            None => unreachable!("a chain without a stop signal never halts"),
        }
    }

    /// [`RunHooks::chain`] that checks `stop` before each hook call: `None`
    /// when it was stopped before calling every hook (the caller's batch is
    /// over; the payload is dropped).
    pub async fn chain_until<E: ChainEvent>(
        &self,
        turn: u32,
        payload: E::Payload,
        to_wire: impl Fn(&E::Payload) -> Payload,
        stop: &CancellationToken,
    ) -> Result<Option<ChainOutcome<E>>, HookFailure> {
        self.run_chain(turn, payload, to_wire, Some(stop)).await
    }

    async fn run_chain<E: ChainEvent>(
        &self,
        turn: u32,
        mut payload: E::Payload,
        to_wire: impl Fn(&E::Payload) -> Payload,
        halt: Option<&CancellationToken>,
    ) -> Result<Option<ChainOutcome<E>>, HookFailure> {
        let kind = E::KIND;
        let event_deadline = self.event_deadline();
        let mut records = Vec::new();
        let mut redaction = None;
        for hook in &self.hooks {
            if hook.client.is_observe() {
                continue;
            }
            if halt.is_some_and(CancellationToken::is_cancelled) {
                return Ok(None);
            }
            match self.participates(hook, kind, event_deadline).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(f) => {
                    let mut span = self.not_called(hook, kind, &f);
                    self.policy(hook, kind, f, &mut records, &mut span)
                        .map_err(|f| self.orphan(f, &mut records))?;
                    continue;
                }
            }
            if let Some(f) = hook.failed() {
                return Err(self.orphan(f, &mut records));
            }
            let (result, mut span) = self
                .call(hook, turn, &to_wire(&payload), event_deadline)
                .await;
            let verdict = match result {
                Ok(v) => v,
                Err(f) => {
                    self.policy(hook, kind, f, &mut records, &mut span)
                        .map_err(|f| self.orphan(f, &mut records))?;
                    continue;
                }
            };
            let name = hook.client.name().to_string();
            let verdict_kind = verdict.action.kind();
            let Verdict { meta, action } = verdict;
            if let Err(f) = self.apply_scratchpad(meta.scratchpad) {
                self.policy(hook, kind, f, &mut records, &mut span)
                    .map_err(|f| self.orphan(f, &mut records))?;
                continue;
            }
            match E::apply(&mut payload, action) {
                Err(wrong) => {
                    let f = Fault::new(
                        FailureClass::WrongKind,
                        format!("answered a {wrong} verdict to a {kind} event"),
                    );
                    self.policy(hook, kind, f, &mut records, &mut span)
                        .map_err(|f| self.orphan(f, &mut records))?;
                }
                Ok(step) => {
                    if meta.telemetry_redaction.is_some() {
                        redaction = meta.telemetry_redaction;
                    }
                    let mut rec = VerdictRecord::new(&name, kind, verdict_kind, &meta.reason);
                    match step {
                        Step::Continue { changed } => {
                            rec.fields_changed = changed.iter().map(|s| s.to_string()).collect();
                            records.push(rec);
                        }
                        Step::Stop(stop) => {
                            records.push(rec);
                            self.notify_observers(turn, kind, || to_wire(&payload), true);
                            return Ok(Some(ChainOutcome {
                                payload,
                                stop: Some((name, stop)),
                                records,
                                redaction,
                            }));
                        }
                    }
                }
            }
        }
        self.notify_observers(turn, kind, || to_wire(&payload), true);
        Ok(Some(ChainOutcome {
            payload,
            stop: None,
            records,
            redaction,
        }))
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
        // The event's payload, copied from the request only when some hook
        // is there to see it.
        let payload = (!self.hooks.is_empty()).then(|| Payload::ModelRequest(baseline.clone()));
        let calls = self.hooks.iter().map(|hook| {
            let payload = payload.as_ref().expect("built when there are hooks");
            async move {
                if hook.client.is_observe() {
                    return None;
                }
                match self.participates(hook, kind, event_deadline).await {
                    Ok(true) => Some(self.call(hook, turn, payload, event_deadline).await),
                    Ok(false) => None,
                    Err(f) => {
                        let span = self.not_called(hook, kind, &f);
                        Some((Err(f), span))
                    }
                }
            }
        });
        let results = futures::future::join_all(calls).await;
        let mut records = Vec::new();
        let mut failed_open = Vec::new();
        let mut actions = Vec::new();
        let mut redaction = None;
        for (hook, result) in self.hooks.iter().zip(results) {
            let Some((result, mut span)) = result else {
                continue;
            };
            let verdict = match result {
                Ok(v) => v,
                Err(f) => {
                    self.policy(hook, kind, f, &mut failed_open, &mut span)
                        .map_err(|f| self.orphan(f, &mut failed_open))?;
                    continue;
                }
            };
            let Verdict { meta, action } = verdict;
            let Action::ModelRequest(action) = action else {
                unreachable!("checked in call()")
            };
            if let Err(f) = self.apply_scratchpad(meta.scratchpad) {
                self.policy(hook, kind, f, &mut failed_open, &mut span)
                    .map_err(|f| self.orphan(f, &mut failed_open))?;
                continue;
            }
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
                    VerdictKind::Terminate,
                    &terminate.reason,
                ));
            }
            Merged::Respond { hook, .. } => {
                let reason = reasons
                    .iter()
                    .find(|(h, _)| h == hook)
                    .map(|(_, r)| r.as_str())
                    .unwrap_or("");
                records.push(VerdictRecord::new(hook, kind, VerdictKind::Respond, reason));
            }
        }
        records.extend(failed_open);
        self.notify_observers(
            turn,
            kind,
            || payload.unwrap_or_else(|| Payload::ModelRequest(baseline.clone())),
            true,
        );
        Ok(MergeOutcome {
            merged,
            records,
            redaction,
        })
    }

    /// Faults that broke hooks' streams between their events (a duplicate
    /// or spurious verdict, a reset with nothing in flight) and failed no
    /// event yet: each goes through its hook's failure policy now, counted
    /// and logged once, named after the event it was seen after (`fallback`
    /// if that is unknown), under a `hook {hook} {event}` span of its own.
    /// A closed blocking hook's fault is the run's failure (the first in
    /// firing order is returned); open and observe-mode ones are recorded as
    /// failed open in `records`, after the records of an event a closed hook
    /// failed (see `orphaned`). The runner calls this before every step,
    /// before every `CallTool` and once more before the run's end.
    pub fn check_faults(
        &self,
        records: &mut Vec<VerdictRecord>,
        fallback: EventKind,
    ) -> Result<(), HookFailure> {
        records.append(&mut self.orphaned.locked());
        let mut failed = None;
        for hook in &self.hooks {
            let stream = hook.stream.locked().as_ref().map(|(s, _)| s.clone());
            let Some(fault) = stream.and_then(|s| s.take_unreported()) else {
                continue;
            };
            let event = fault.event(fallback);
            let mut span = self.not_called(hook, event, &fault);
            hook.client.note_fault(&fault);
            if let Err(f) = self.policy(hook, event, fault, records, &mut span) {
                failed.get_or_insert(f);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// A closed hook whose stream broke and whose fault was handed to one
    /// of the run's waiting events, which has not applied it yet: the calls
    /// of one tool batch run in one task, polled in the order they were
    /// woken, so a call whose own verdict came first could otherwise pass
    /// its checks and send `CallTool` before the call that got the fault
    /// stops the batch. Not counted or logged here: that event does it.
    pub fn broken_closed(&self, fallback: EventKind) -> Option<HookFailure> {
        self.hooks.iter().find_map(|hook| {
            let cfg = &hook.client.config;
            if cfg.failure != FailurePolicy::Closed || hook.client.is_observe() {
                return None;
            }
            let stream = hook.stream.locked().as_ref().map(|(s, _)| s.clone())?;
            let fault = stream.poisoned()?;
            Some(HookFailure {
                hook: cfg.name.clone(),
                event: fault.event(fallback),
                fault,
            })
        })
    }

    /// Verdicts that arrived after their deadline, over all streams.
    pub fn late_verdicts(&self) -> u64 {
        self.hooks
            .iter()
            .filter_map(|h| h.stream.locked().as_ref().map(|(s, _)| s.late_count()))
            .sum()
    }

    /// Half-closes every open stream (after run_end / session events).
    pub fn close(&self) {
        for h in &self.hooks {
            // Also after a panic poisoned the lock: the stream must close.
            let taken = h.stream.locked().take();
            if let Some((s, _active)) = taken {
                self.retire(h, &s);
            }
        }
    }
}

/// How hookwire judges one wire verdict for a `kind` event: it must convert
/// (`wire`: an action set, valid JSON, sizes), be of the event's kind, and a
/// `model_request` patch must fit the request it patches (`baseline`). The
/// one rule book for the engine and for `hookwire hooks check`; the engine
/// also checks rewritten tool arguments against the tool's schema, which a
/// verdict alone does not carry ([`RunHooks::check_rewrite`]).
pub fn accept_verdict(
    kind: EventKind,
    verdict: pb::HookVerdict,
    baseline: Option<&ModelRequest>,
) -> Result<Verdict, Fault> {
    if verdict.verdict.is_none() {
        let e = wire::InvalidVerdict::MissingVerdict { expected: kind };
        return Err(Fault::new(FailureClass::InvalidVerdict, e.to_string()));
    }
    // The detail quotes the hook (a tool name, a key, a message's text),
    // which the run's client may see; logs and spans get the quiet form.
    let v = Verdict::try_from(verdict)
        .map_err(|e| Fault::quoting_hook(FailureClass::InvalidVerdict, e.to_string(), e.quiet()))?;
    let got = v.action.event();
    if got != kind {
        return Err(Fault::new(
            FailureClass::WrongKind,
            format!("answered a {got} verdict to a {kind} event"),
        ));
    }
    if let (Action::ModelRequest(ModelRequestAction::Patch(p)), Some(base)) = (&v.action, baseline)
    {
        compose::validate_patch(base, p).map_err(|e| {
            let quiet = format!(
                "the patch's {} does not fit the request it patches",
                e.field
            );
            Fault::quoting_hook(FailureClass::InvalidVerdict, e.detail, quiet)
        })?;
    }
    Ok(v)
}

/// The run's scratchpad `pad` after a verdict's updates `ops`, all or none:
/// updates that would make it larger than [`wire::MAX_SCRATCHPAD_BYTES`]
/// (keys plus values) make the verdict invalid. The engine's rule, and
/// what `hookwire hooks check` holds a server to ([`judge_alone`]).
pub fn scratchpad_after(
    mut pad: BTreeMap<String, Vec<u8>>,
    ops: impl IntoIterator<Item = ScratchOp>,
) -> Result<BTreeMap<String, Vec<u8>>, Fault> {
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
    let size = pad
        .iter()
        .fold(0usize, |n, (k, v)| n.saturating_add(k.len() + v.len()));
    if size > wire::MAX_SCRATCHPAD_BYTES {
        return Err(Fault::new(
            FailureClass::InvalidVerdict,
            format!(
                "scratchpad updates would make the run's scratchpad {size} bytes, over the {} byte limit",
                wire::MAX_SCRATCHPAD_BYTES
            ),
        ));
    }
    Ok(pad)
}

/// How hookwire judges one hook's verdict on `payload`'s event on its own:
/// [`accept_verdict`], [`check_rewrite`], and a `model_request` patch must
/// leave a request the model can be called with (the engine checks that
/// after merging every hook's patch, and fails the run whatever the hook's
/// `failure:`), and its scratchpad updates must fit the run's scratchpad
/// as the event carried it (`scratchpad`, when known). What `hookwire
/// hooks check` holds a server to.
pub fn judge_alone(
    kind: EventKind,
    verdict: pb::HookVerdict,
    payload: Option<&Payload>,
    scratchpad: Option<&BTreeMap<String, Vec<u8>>>,
) -> Result<Verdict, Fault> {
    let baseline = match payload {
        Some(Payload::ModelRequest(r)) => Some(r),
        _ => None,
    };
    let v = accept_verdict(kind, verdict, baseline)?;
    if let Some(p) = payload {
        check_rewrite(p, &v, None)?;
    }
    if let (Action::ModelRequest(patch @ ModelRequestAction::Patch(_)), Some(base)) =
        (&v.action, baseline)
    {
        if let compose::Merged::Request {
            request,
            records,
            removed,
        } = compose::merge(base, vec![("this hook".into(), patch.clone())])
        {
            compose::validate_effective(&request, &records, &removed).map_err(|e| {
                Fault::new(
                    FailureClass::InvalidVerdict,
                    format!("the patched request cannot be sent: {e}; hookwire fails every run with it, whatever the hook's `failure:`"),
                )
            })?;
        }
    }
    if let Some(pad) = scratchpad.filter(|_| !v.meta.scratchpad.is_empty()) {
        scratchpad_after(pad.clone(), v.meta.scratchpad.iter().cloned())?;
    }
    Ok(v)
}

/// A `rewrite_args` verdict must leave arguments the tool accepts (a JSON
/// object that matches its schema), as the model's own call had to: the
/// rewritten call goes to `CallTool` with no later check. `schemas`: where
/// compiled schemas are cached (`None`: compiled here).
pub fn check_rewrite(
    payload: &Payload,
    verdict: &Verdict,
    schemas: Option<&HookRegistry>,
) -> Result<(), Fault> {
    let (Payload::ToolCall { call, tool, .. }, Action::ToolCall(ToolCallAction::RewriteArgs(args))) =
        (payload, &verdict.action)
    else {
        return Ok(());
    };
    let rewritten = ToolCall {
        id: call.id.clone(),
        name: tool.name.clone(),
        arguments_json: args.clone(),
    };
    let schema = |spec: &ToolSpec| match schemas {
        Some(registry) => registry.validator(spec),
        None if spec.parameters_json_schema.trim().is_empty() => None,
        None => compile_schema(&spec.parameters_json_schema)
            .ok()
            .map(Arc::new),
    };
    match validate_call(&rewritten, std::slice::from_ref(tool), schema) {
        None => Ok(()),
        // The schema's complaint names the hook's keys (and paths into
        // them): that goes to the run's reason, not to logs above debug or
        // to spans.
        Some((_, error)) => Err(Fault::quoting_hook(
            FailureClass::InvalidVerdict,
            format!("rewrite_args: {error}"),
            "rewrite_args do not match the tool's schema",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::hooks::compose::{RunStartChain, ToolCallChain};
    use crate::message::{ToolCall, ToolSpec};
    use crate::telemetry::Instruments;

    /// A hook that failed closed is never called again in its run: a later
    /// chain fails with the same failure without calling it, and no fresh
    /// stream is opened for it (not even for run_end).
    #[tokio::test]
    async fn a_hook_that_failed_closed_is_never_called_again() {
        let config = Config::parse(
            "models: [{name: m, provider: scripted}]\nhooks: [{name: h, endpoint: 'http://127.0.0.1:1', events: [tool_call, run_end], breaker: {failures: 0}}]\nagents: [{name: a, model: m, hooks: [h]}]\n",
            "test",
        )
        .unwrap();
        let inst = Instruments::new(&config.telemetry);
        let client = HookClient::new(
            0,
            config.hooks[0].clone(),
            std::time::Duration::from_secs(5),
        )
        .unwrap();
        let hooks = RunHooks::new(
            vec![client],
            EventContext::default(),
            Instant::now() + Duration::from_secs(60),
            Duration::from_secs(30),
            inst.clone(),
        );
        let call = ToolCall {
            id: "c".into(),
            name: "t".into(),
            arguments_json: "{}".into(),
        };
        let to_wire = |c: &ToolCall| Payload::ToolCall {
            call: c.clone(),
            index: 0,
            tool: ToolSpec::default(),
        };
        let calls = || {
            let text = inst.metrics.encode();
            text.lines()
                .find(|l| {
                    l.starts_with("hookwire_hook_call_duration_seconds_count{")
                        && l.contains(r#"hook="h""#)
                })
                .and_then(|l| l.rsplit(' ').next())
                .map(str::to_owned)
        };
        let first = hooks
            .chain::<ToolCallChain>(0, call.clone(), to_wire)
            .await
            .err()
            .expect("connect failure, closed");
        assert_eq!(first.fault.class, FailureClass::Connect);
        assert_eq!(calls().as_deref(), Some("1"));
        let broken = hooks.hooks[0]
            .stream
            .locked()
            .as_ref()
            .map(|(s, _)| s.clone());
        let again = hooks
            .chain::<ToolCallChain>(0, call, to_wire)
            .await
            .err()
            .expect("still failed");
        assert_eq!(again, first);
        assert_eq!(calls().as_deref(), Some("1"), "not called again");
        hooks.observe(0, EventKind::RunEnd, || Payload::RunEnd {
            outcome: crate::agent::outcome::RunOutcome::HookFailed,
            reason: String::new(),
            final_text: String::new(),
            usage: Default::default(),
            turns: 0,
        });
        let now = hooks.hooks[0]
            .stream
            .locked()
            .as_ref()
            .map(|(s, _)| s.clone());
        assert!(
            matches!((&broken, &now), (Some(a), Some(b)) if Arc::ptr_eq(a, b)),
            "no fresh stream for the failed hook"
        );
        hooks.close();
    }

    fn client(endpoint: &str) -> Arc<HookClient> {
        let yaml = format!(
            "hooks:\n  - name: h\n    endpoint: {endpoint}\n    events: [run_start]\n    timeout: 60s\n    breaker: {{failures: 1, cooldown: 0s}}\nagents: [{{name: a, model: m}}]\nmodels: [{{name: m, provider: scripted}}]\n"
        );
        let cfg = crate::config::Config::parse(&yaml, "test").unwrap();
        HookClient::new(0, cfg.hooks[0].clone(), std::time::Duration::from_secs(5)).unwrap()
    }

    fn hooks(client: &Arc<HookClient>, run_deadline: Instant) -> RunHooks {
        RunHooks::new(
            vec![client.clone()],
            EventContext::default(),
            run_deadline,
            Duration::from_secs(60),
            Instruments::new(&Default::default()),
        )
    }

    async fn run_start(hooks: &RunHooks) -> Result<ChainOutcome<RunStartChain>, HookFailure> {
        hooks
            .chain::<RunStartChain>(0, "hi".to_string(), |i| Payload::RunStart {
                input: i.clone(),
            })
            .await
    }

    fn history_patch(history: &[crate::message::Message]) -> pb::HookVerdict {
        pb::HookVerdict {
            seq: 1,
            verdict: Some(pb::hook_verdict::Verdict::ModelRequest(
                pb::ModelRequestVerdict {
                    action: Some(pb::model_request_verdict::Action::PatchRequest(
                        pb::RequestPatch {
                            history: Some(pb::MessageList {
                                messages: history.iter().map(Into::into).collect(),
                            }),
                            ..Default::default()
                        },
                    )),
                },
            )),
            ..Default::default()
        }
    }

    #[test]
    fn a_history_patch_is_judged_on_what_the_hook_changed() {
        use crate::message::{Block, Message, Role, ToolCall};
        // A model cut off by max_tokens left a malformed call in history.
        let cut = ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments_json: r#"{"city": "Par"#.into(),
        };
        let assistant = |c: &ToolCall| Message {
            role: Role::Assistant,
            blocks: vec![Block::ToolCall(c.clone())],
        };
        let base = ModelRequest {
            history: vec![Message::user("weather?"), assistant(&cut)].into(),
            ..Default::default()
        };
        // Sent back as received (a hook that trims or reorders history).
        let same = accept_verdict(
            EventKind::ModelRequest,
            history_patch(&base.history.to_vec()),
            Some(&base),
        );
        assert!(same.is_ok(), "{same:?}");
        // A malformed call the hook wrote itself is the hook's fault.
        let mut changed = cut.clone();
        changed.arguments_json = r#"{"city": "Rom"#.into();
        let f = accept_verdict(
            EventKind::ModelRequest,
            history_patch(&[Message::user("weather?"), assistant(&changed)]),
            Some(&base),
        )
        .unwrap_err();
        assert_eq!(f.class, FailureClass::InvalidVerdict);
        assert!(f.detail.contains("not valid JSON"), "{}", f.detail);
    }

    fn rewrite_response(blocks: Vec<pb::Block>) -> pb::HookVerdict {
        pb::HookVerdict {
            seq: 1,
            verdict: Some(pb::hook_verdict::Verdict::ModelResponse(
                pb::ModelResponseVerdict {
                    action: Some(pb::model_response_verdict::Action::RewriteResponse(
                        pb::RewriteResponse { blocks },
                    )),
                },
            )),
            ..Default::default()
        }
    }

    /// A rewritten response's tool calls are screened by the run like the
    /// model's own (bad JSON goes to invalid_tool_call): echoing a call the
    /// model cut off at max_tokens is no fault of the hook's.
    #[test]
    fn a_rewrite_echoing_a_cut_off_call_is_accepted() {
        use crate::hooks::verdict::ModelResponseAction;
        use crate::message::{Block, ToolCall};
        let cut = ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments_json: r#"{"city": "Par"#.into(),
        };
        let text = Block::Text {
            text: "Let me check.".into(),
        };
        let echoed = vec![(&text).into(), (&Block::ToolCall(cut.clone())).into()];
        let v = accept_verdict(EventKind::ModelResponse, rewrite_response(echoed), None)
            .expect("accepted");
        assert_eq!(
            v.action,
            Action::ModelResponse(ModelResponseAction::Rewrite(vec![
                text,
                Block::ToolCall(cut)
            ]))
        );
    }

    /// The assistant message a rewrite_response builds is committed: a tool
    /// result in it would be an orphan tool message (or a call's second
    /// result) in every later model call of the session.
    #[test]
    fn a_rewrite_with_a_tool_result_block_is_an_invalid_verdict() {
        use crate::message::{Block, ToolResult};
        let forged = Block::ToolResult(ToolResult {
            call_id: "call_1".into(),
            name: "get_weather".into(),
            content: "sunny".into(),
            is_error: false,
        });
        let f = accept_verdict(
            EventKind::ModelResponse,
            rewrite_response(vec![(&forged).into()]),
            None,
        )
        .unwrap_err();
        assert_eq!(f.class, FailureClass::InvalidVerdict);
        assert!(f.detail.contains("tool-result block"), "{}", f.detail);
    }

    #[tokio::test]
    async fn a_budget_spent_before_the_call_is_not_the_hooks_failure() {
        let c = client("http://127.0.0.1:1");
        // The run's deadline has passed: the hook is never called.
        let h = hooks(&c, Instant::now());
        for _ in 0..3 {
            let f = run_start(&h).await.err().expect("fails closed");
            assert_eq!(f.fault.class, FailureClass::Deadline);
        }
        assert!(
            !c.breaker_open(),
            "no failure was recorded against the hook"
        );
    }

    #[tokio::test]
    async fn a_probe_dropped_mid_call_does_not_stick_the_breaker() {
        // A server that accepts connections and never says a word: a call
        // to it hangs until its caller gives up.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let accepted = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                held.push(s);
            }
        });
        let c = client(&format!("http://{addr}"));
        // Open the breaker; with a zero cool-down the next call is the probe.
        c.admit().unwrap().record(false);
        assert!(c.breaker_open());
        let h = hooks(&c, Instant::now() + Duration::from_secs(60));
        // The run is cancelled while its probe call hangs: the future is
        // dropped (as `Run::guarded` drops it).
        let cancelled = tokio::time::timeout(Duration::from_millis(200), run_start(&h)).await;
        assert!(cancelled.is_err(), "the call was still in flight");
        let probe = c.admit();
        assert!(probe.is_some(), "the next call may probe again");
        h.close();
        accepted.abort();
    }
}
