//! Drives the machine: performs each step's IO (hooks, model, tools) under
//! the run's cancellation and deadline, and streams events to the client.
//! `Run` and `Invoke` share this one loop.

use crate::lock::LockExt;
use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::agent::approvals::{Approvals, Decision};
use crate::agent::batch::{run_batch, BatchStop, CallOutcome};
use crate::agent::client_queue::{ClientQueue, Refused, Unwritable};
use crate::agent::events::{QueuedEvent, RunEvent, RunReport};
use crate::agent::guard::Guarded;
use crate::agent::ledger::Ledger;
use crate::agent::machine::*;
use crate::agent::outcome::RunOutcome;
use crate::agent::tools::{process_call, screen_call};
use crate::config::{AgentConfig, StreamDeltas};
use crate::event::EventKind;
use crate::hooks::compose::{
    self, Merged, ModelResponseChain, ResponseStop, RunStartChain, TurnEndChain, TurnEndStop,
};
use crate::hooks::dispatch::RunHooks;
use crate::hooks::failure::HookFailure;
use crate::hooks::payload::Payload;
use crate::hooks::provenance::VerdictRecord;
use crate::hooks::registry::HookRegistry;
use crate::hooks::verdict::Ask;
use crate::message::{Message, ToolCall, ToolSpec};
use crate::model::{ModelProvider, ModelRequest, ModelResponse};
use crate::telemetry::{spans, ContentView, Instruments};
use tracing::{Instrument, Span};

/// A configured agent with its model.
pub struct AgentRuntime {
    pub config: AgentConfig,
    pub model: Arc<dyn ModelProvider>,
}

impl AgentRuntime {
    /// The agent's tools as currently declared by their owning hook servers.
    pub fn tools(&self, registry: &HookRegistry) -> Vec<ToolSpec> {
        self.config
            .tools
            .iter()
            .filter_map(|name| {
                let found = registry.tool_owner(name).map(|(_, spec)| spec);
                if found.is_none() {
                    tracing::warn!(agent = %self.config.name, tool = %name, "tool has no described owner; not offered");
                }
                found
            })
            .collect()
    }
}

/// Everything one run needs while it is driven.
pub struct Run {
    pub run_id: String,
    pub session_id: String,
    pub agent: Arc<AgentRuntime>,
    pub hooks: RunHooks,
    pub registry: Arc<HookRegistry>,
    pub approvals: Arc<Approvals>,
    pub deadline: Instant,
    pub cancel: CancellationToken,
    /// Fired once the run is over on this replica, its end recorded and
    /// its hooks closed (set by the engine as the run leaves).
    pub left: CancellationToken,
    /// Why the run was stopped from outside (cancelled, or interrupted).
    cancel_reason: Mutex<Option<Stop>>,
    /// Bounded (`server.run_event_buffer`): see [`Run::emit`].
    events: ClientQueue,
    records: Mutex<Vec<VerdictRecord>>,
    /// Text deltas held back until model_response hooks accept the turn
    /// (a final answer's, under blocking turn_end hooks, until those do).
    held: Mutex<Vec<String>>,
    /// The tool-call ids of the run's accepted turns: approvals are
    /// addressed by (run, call id), so a later turn never reuses one.
    call_ids: Mutex<HashSet<String>>,
    /// The calls that asked for approval: an answer for any other call of
    /// the run came before its question (see [`Run::has_asked`]).
    asked: Mutex<HashSet<String>>,
    pub inst: Instruments,
    /// Where the run records what it commits, under its lease.
    pub ledger: Ledger,
    /// What this run's spans show of its content (sticky redactions).
    pub content: ContentView,
}

impl Run {
    /// `streaming`: the client reads the run's events (`Run`), or only its
    /// report (`Invoke`). Nothing else about the run depends on it (hooks
    /// are told it in their events' context).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        run_id: String,
        session_id: String,
        agent: Arc<AgentRuntime>,
        hooks: RunHooks,
        registry: Arc<HookRegistry>,
        streaming: bool,
        approvals: Arc<Approvals>,
        deadline: Instant,
        events: mpsc::Sender<QueuedEvent>,
        inst: Instruments,
        ledger: Ledger,
    ) -> Run {
        Run {
            run_id,
            session_id,
            agent,
            hooks,
            registry,
            approvals,
            deadline,
            cancel: CancellationToken::new(),
            left: CancellationToken::new(),
            cancel_reason: Mutex::new(None),
            events: {
                let q = ClientQueue::new(events, crate::config::DEFAULT_CLIENT_STALL_TIMEOUT);
                if streaming {
                    q
                } else {
                    q.report_only()
                }
            },
            records: Mutex::new(Vec::new()),
            held: Mutex::new(Vec::new()),
            call_ids: Mutex::default(),
            asked: Mutex::default(),
            content: ContentView::new(inst.content),
            inst,
            ledger,
        }
    }

    /// How long the run waits for a client that reads none of its events
    /// before it gives up (`server.client_stall_timeout`).
    pub fn with_client_stall(mut self, stall: Duration) -> Run {
        self.events = self.events.with_stall(stall);
        self
    }

    pub fn cancel(&self, reason: &str) {
        self.stop_from_outside(Stop::Cancelled(reason.to_string()));
    }

    /// Whether call `call_id` of the run asked for approval (it may have
    /// been answered or withdrawn since). One that did not may still ask:
    /// the hook that asks can tell its approver before hookwire has its
    /// `ask`.
    pub fn has_asked(&self, call_id: &str) -> bool {
        self.asked.locked().contains(call_id)
    }

    /// Stops the run because this replica can no longer record it.
    pub fn interrupt(&self, reason: &str) {
        self.stop_from_outside(Stop::Interrupted(reason.to_string()));
    }

    /// Stops the run for `stop` (the first reason given stands).
    pub fn stop_from_outside(&self, stop: Stop) {
        self.cancel_reason.locked().get_or_insert(stop);
        self.cancel.cancel();
    }

    /// Queues an event for the client without waiting. The queue is
    /// bounded ([`ClientQueue`]), and the runner waits for it to be at most
    /// half full before every step ([`Run::wait_for_room`]), so a slow
    /// reader slows the run down. Text deltas that find it full are merged
    /// and sent later; any other event that finds it full (a step with more
    /// events than half the queue, for a client that is not reading) ends
    /// the run as cancelled, naming the limit.
    pub fn emit(&self, ev: RunEvent) {
        if !self.events.wants(&ev) {
            if self.events.is_closed() {
                self.cancel_once("client disconnected");
            }
            return;
        }
        match self.events.push(ev) {
            Ok(()) => {}
            // A client that went away cannot see the result: stop spending
            // model and hook time on it.
            Err(Refused::Closed) => self.cancel_once("client disconnected"),
            Err(Refused::Full) => self.cancel_once(&format!(
                "the client did not read the run's events: {} unread (server.run_event_buffer)",
                self.events.capacity()
            )),
        }
    }

    /// The run's client went away (seen by the server, not by an event).
    pub fn client_gone(&self, reason: &str) {
        self.cancel_once(reason);
    }

    fn cancel_once(&self, reason: &str) {
        if !self.cancel.is_cancelled() {
            self.cancel(reason);
        }
    }

    /// Waits for room for `n` events, until the run is cancelled or out of
    /// time; a client that reads nothing for the stall timeout ends the run.
    async fn room(&self, n: usize) -> Option<tokio::sync::mpsc::PermitIterator<'_, QueuedEvent>> {
        // Checked in the order of the `select!` below, which is only built
        // when the client has fallen behind: arming its two timers for
        // every step cost more than the rest of this call.
        if self.cancel.is_cancelled() || Instant::now() >= self.deadline {
            return None;
        }
        let r = match self.events.try_reserve(n) {
            Some(r) => r,
            // Boxed: only a client that fell behind waits here, and inline
            // this wait (two timers and the queue's reserve) made every
            // step's future, and so the run's, larger.
            None => Box::pin(self.wait_room(n)).await?,
        };
        match r {
            Ok(p) => Some(p),
            Err(Unwritable::Closed) => {
                self.cancel_once("client disconnected");
                None
            }
            Err(Unwritable::Stalled) => {
                self.cancel_once(&format!(
                    "the client read none of the run's events for {:?} (server.client_stall_timeout)",
                    self.events.stall_timeout()
                ));
                None
            }
        }
    }

    /// Waits for room for `n` events; `None` when the run is cancelled or
    /// out of time first.
    async fn wait_room(
        &self,
        n: usize,
    ) -> Option<Result<tokio::sync::mpsc::PermitIterator<'_, QueuedEvent>, Unwritable>> {
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => None,
            _ = tokio::time::sleep_until(self.deadline) => None,
            r = self.events.reserve(n) => Some(r),
        }
    }

    /// Queues an event, waiting for room if the client reads slowly.
    pub async fn deliver(&self, ev: RunEvent) {
        if !self.events.wants(&ev) {
            return self.emit(ev);
        }
        match self.room(1).await.as_mut().and_then(|p| p.next()) {
            Some(p) => p.send(Box::new(ev)),
            None => self.emit(ev),
        }
    }

    /// Sends a run's last events ([`Driven::tail`]), once its end is
    /// recorded: each waits for room in the client's queue, as long as the
    /// client keeps reading.
    pub async fn deliver_tail(&self, tail: Vec<RunEvent>) {
        for ev in tail {
            self.deliver_last(ev).await;
        }
    }

    /// Queues one of the run's last events (a retraction, a verdict of the
    /// last fault check, `Finished`), any
    /// held delta ahead of it, waiting for room for as long as the client
    /// keeps reading: unlike [`Run::deliver`], not cut short by the cancel
    /// or deadline that may have ended the run. A run that ended while its
    /// client was behind (a slow reader, a model streaming faster than it
    /// reads) would otherwise drop them, and the client could not tell
    /// that deltas it has were void. Bounded by the stall timeout (not
    /// waited for at all once the client stalled or left).
    async fn deliver_last(&self, ev: RunEvent) {
        if !self.events.wants(&ev) || self.events.stalled() || self.events.is_closed() {
            return self.emit(ev);
        }
        match self.events.reserve(1).await {
            Ok(mut p) => {
                if let Some(p) = p.next() {
                    p.send(Box::new(ev));
                }
            }
            Err(Unwritable::Closed) => self.cancel_once("client disconnected"),
            Err(Unwritable::Stalled) => self.cancel_once(&format!(
                "the client read none of the run's events for {:?} (server.client_stall_timeout)",
                self.events.stall_timeout()
            )),
        }
    }

    /// The notable verdicts so far (for a report built outside the drive
    /// loop, e.g. after a panic: a poisoned lock still yields its records).
    pub fn verdict_records(&self) -> Vec<VerdictRecord> {
        self.records.locked().clone()
    }

    /// Waits until at least half of the client's event queue is free, so
    /// the events of the next step fit without waiting: this is how a slow
    /// client slows the run down.
    pub async fn wait_for_room(&self) {
        // The permits are given back at once: only the room matters.
        let _ = self.room(self.events.capacity() / 2).await;
    }

    pub fn emit_records(&self, records: &[VerdictRecord]) {
        for r in records.iter().filter(|r| r.is_notable()) {
            self.records.locked().push(r.clone());
            self.emit(RunEvent::HookVerdict(r.clone()));
        }
    }

    /// Pauses a call for approval; `None` means approved. The request is
    /// withdrawn when the batch stops (the call is then `Halted`), and
    /// however else the wait ends.
    ///
    /// The same for `Run` and `Invoke`: the request is recorded (in the
    /// store, so ResolveApproval works from any replica, and here) and
    /// waited for either way. Only the `approval_requested` event differs:
    /// an Invoke caller reads just the report, so the hook that asked
    /// routes the question to whoever answers (it has the run and call ids).
    pub async fn ask_approval(
        &self,
        turn: u32,
        index: u32,
        call: &ToolCall,
        hook: &str,
        ask: Ask,
        stop: &BatchStop,
    ) -> Option<CallOutcome> {
        let denied = |content: String| {
            Some(CallOutcome::Result(crate::message::ToolResult {
                call_id: call.id.clone(),
                name: call.name.clone(),
                content,
                is_error: true,
            }))
        };
        if stop.is_stopped() {
            return Some(CallOutcome::Halted);
        }
        let timeout = ask.timeout.unwrap_or(self.agent.config.approval_timeout);
        // Waiting locally before the request is recorded, so an answer
        // delivered right after it is never missed. The local request is
        // withdrawn when dropped, however the wait ends (answered, timed
        // out, batch stopped, or the run cancelled or out of time mid-wait);
        // the store's record of a request left pending is denied when the
        // run's end is recorded.
        // Registered before it counts as asked: an answer checking the
        // other way round (asked, then pending) never finds it asked and
        // not pending while it is being registered.
        let mut pending =
            self.approvals
                .register(&self.run_id, &call.id, Some(stop.token().clone()));
        self.asked.locked().insert(call.id.clone());
        if let Err(s) = self.ledger.request_approval(&call.id).await {
            return Some(CallOutcome::Stop(s));
        }
        // The batch may have stopped during the store write: the client
        // must then never see the request, and the store's record of it is
        // withdrawn (a ResolveApproval for it answers NOT_FOUND).
        if stop.is_stopped() {
            drop(pending);
            // Withdrawn: the call never runs, whatever the store says.
            let _ = self.ledger.expire_approval(&call.id).await;
            return Some(CallOutcome::Halted);
        }
        self.emit(RunEvent::ApprovalRequested {
            turn,
            index,
            call: call.clone(),
            question: ask.question.clone(),
            hook: hook.to_string(),
            timeout,
        });
        // The hook's timeout is a number from the hook: never past the run.
        let until = Instant::now()
            .checked_add(timeout)
            .map_or(self.deadline, |t| t.min(self.deadline));
        let waited = tokio::select! {
            biased;
            _ = stop.stopped() => None,
            d = tokio::time::timeout_at(until, &mut pending.answer) => Some(d),
        };
        drop(pending);
        let decision = match waited {
            // The batch stopped: the request is withdrawn in the store too,
            // so a ResolveApproval on any replica now answers NOT_FOUND.
            None => {
                let _ = self.ledger.expire_approval(&call.id).await;
                return Some(CallOutcome::Halted);
            }
            Some(Ok(Ok(d))) => Some(d),
            // Timed out: unless an answer was recorded at the last moment
            // (the store decides which came first), it is denied; a
            // timeout the store cannot record stops the run.
            Some(_) => match self.ledger.expire_approval(&call.id).await {
                Ok(d) => d,
                Err(s) => return Some(CallOutcome::Stop(s)),
            },
        };
        match decision {
            Some(Decision { approve: true, .. }) => None,
            // Whoever answered: the session's owner, or an approver.
            Some(Decision {
                approve: false,
                note,
            }) => denied(if note.is_empty() {
                format!("approval for tool `{}` was denied", call.name)
            } else {
                format!("approval for tool `{}` was denied: {note}", call.name)
            }),
            _ => denied(format!(
                "approval for tool `{}` timed out after {} and was denied",
                call.name,
                humantime_serde::re::humantime::format_duration(timeout)
            )),
        }
    }

    /// Faults that broke a hook's stream since the last check (a duplicate
    /// or spurious verdict, ...): failed-open records go to the client; a
    /// closed hook's fault is the run's failure.
    pub fn check_faults(&self, fallback: EventKind) -> Result<(), HookFailure> {
        let mut records = Vec::new();
        let checked = self.hooks.check_faults(&mut records, fallback);
        self.emit_records(&records);
        checked
    }

    /// Runs a step's IO, ending it early on cancellation or the run deadline
    /// ([`Guarded`]: checked in that order, before the step).
    fn guarded<T, F: Future<Output = Result<T, Stop>>>(
        &self,
        fut: F,
    ) -> Guarded<'_, F, impl Fn() -> Stop + '_> {
        Guarded::new(self.cancel.cancelled(), self.deadline, fut, || {
            self.cancel_stop()
        })
    }

    /// Why the run was stopped from outside, once it was.
    fn cancel_stop(&self) -> Stop {
        self.cancel_reason
            .locked()
            .clone()
            .unwrap_or_else(|| Stop::Cancelled("cancelled".into()))
    }

    /// `Some(why)` once the run was cancelled or interrupted: for a step
    /// that must not start anything after that even within the poll that
    /// cancelled it (an `emit` can), before [`Guarded`] sees the cancel.
    pub fn stopped_from_outside(&self) -> Option<Stop> {
        self.cancel.is_cancelled().then(|| self.cancel_stop())
    }
}

fn terminate(hook: String, t: crate::hooks::verdict::Terminate) -> Stop {
    Stop::Terminate {
        hook,
        reason: t.reason,
        reply: t.reply,
    }
}

/// A run driven to its end: its report, and the events its client is yet
/// to get (the last step's, a retraction, the last check's verdicts,
/// `Finished`): see [`Run::deliver_tail`].
pub struct Driven {
    pub report: RunReport,
    pub tail: Vec<RunEvent>,
}

/// Drives one run to its end and returns its report (also the last event
/// of its tail), up to the run's last events: its end recorded, its hooks
/// told, the client's last events not sent yet ([`Run::deliver_tail`]).
/// Whoever owns the run's span ends it before sending them: they may wait
/// for a slow client (past a drain's grace, until the process exits).
/// `transcript` is the session's committed history, shared (with the
/// transcript cache and every model request of the run), never copied.
pub async fn drive_to_end(run: Arc<Run>, transcript: Arc<Vec<Message>>, input: String) -> Driven {
    let cfg = &run.agent.config;
    let tools = Arc::new(run.agent.tools(&run.registry));
    let template = RequestTemplate {
        model: run.agent.model.model_name().to_string(),
        system_prompt: cfg.system_prompt.clone(),
        context: cfg.context.clone(),
        tools: (*tools).clone(),
        temperature: cfg.temperature,
        max_tokens: cfg.max_tokens,
    };
    let mut machine = Machine::new(template, cfg.max_turns, transcript, input);
    // With blocking turn_end hooks, a final answer waits for them.
    let review_final = run.hooks.has_blocking(EventKind::TurnEnd);
    machine.review_final_answers(review_final);
    let mut step = machine.start();
    // The turn whose deltas the client has seen provisionally (pass mode)
    // while it is not accepted yet, or a tool-call turn it was shown while
    // the transcript does not hold it; retracted if it never is.
    let mut provisional: Option<u32> = None;
    // The last tool batch, until its turn is in the transcript.
    let mut batch: Option<PendingBatch> = None;
    // Telemetry for the model call in flight: the model_request hooks'
    // redaction (input content), and the chat span kept open until the
    // model_response hooks decided what the output content is.
    let mut input_redaction: Option<String> = None;
    let mut chat_span: Option<Span> = None;
    // A final answer's chat span and finish reason, awaiting the blocking
    // turn_end hooks: its output is recorded only once they accepted it
    // (with their redaction), and never when one rejected it.
    let mut final_output: Option<(Span, String)> = None;
    // The tools offered to the model call in flight (the agent's, narrowed
    // by model_request patches): its tool calls may only name these.
    let mut offered = tools.clone();
    let ending = loop {
        // The last step's events (a final answer, its results) go
        // with the run's last ones, once its end is recorded: a client
        // that is behind must not keep the session busy.
        if let Step::Finish(ending) = step {
            break ending;
        }
        for ev in machine.drain_events() {
            run.deliver(ev).await;
        }
        run.wait_for_room().await;
        let turn = machine.turn();
        // A protocol violation detected since the last step stops the run
        // here, not at its end.
        if let Some(kind) = step.event() {
            if let Err(f) = run.check_faults(kind) {
                step = machine.abort(Stop::HookFailed(f));
                continue;
            }
        }
        if matches!(step, Step::ModelRequest(_)) {
            // Until a model call narrows them (a hook's `respond` replaces
            // the call): the agent's tools.
            offered = tools.clone();
        }
        let feed = match step {
            // Not reached: a finished run leaves at the top of the loop.
            Step::Finish(ending) => break ending,
            Step::RunStart(input) => Feed::RunStart(
                run.guarded(async {
                    let out = run
                        .hooks
                        .chain::<RunStartChain>(0, input, |i| Payload::RunStart {
                            input: i.clone(),
                        })
                        .await
                        .map_err(Stop::HookFailed)?;
                    run.emit_records(&out.records);
                    if out.redaction.is_some() && run.content.is_enabled() {
                        // The user message the machine commits for this input.
                        let committed = Message::user(out.payload.clone());
                        run.content.redact_message(&committed, out.redaction);
                    }
                    match out.stop {
                        Some((hook, t)) => Err(terminate(hook, t)),
                        None => Ok(out.payload),
                    }
                })
                .await,
            ),
            Step::ModelRequest(base) => Feed::ModelRequest(
                run.guarded(async {
                    let out = run
                        .hooks
                        .model_request(turn, &base)
                        .await
                        .map_err(Stop::HookFailed)?;
                    run.emit_records(&out.records);
                    if let Some(r) = &out.redaction {
                        // Sticky: the messages of this input stay redacted
                        // in later calls' records.
                        let patched = match &out.merged {
                            Merged::Request { request, .. }
                                if !request.history.shares_prefix_with(&base.history) =>
                            {
                                Some(request.history.iter())
                            }
                            _ => None,
                        };
                        run.content.redact_input(
                            base.history.iter().chain(patched.into_iter().flatten()),
                            r,
                        );
                    }
                    input_redaction = out.redaction;
                    match out.merged {
                        Merged::Terminate { hook, terminate: t } => Err(terminate(hook, t)),
                        Merged::Respond { response, .. } => Ok(RequestDecision::Respond(response)),
                        Merged::Request {
                            request,
                            records,
                            removed,
                        } => {
                            compose::validate_effective(&request, &records, &removed).map_err(
                                |e| Stop::Failed(format!("invalid effective model request: {e}")),
                            )?;
                            Ok(RequestDecision::Call(request))
                        }
                    }
                })
                .await,
            ),
            Step::CallModel(request) => {
                offered = Arc::new(request.tools.clone());
                let (r, sent, span) =
                    call_model(&run, turn, &request, input_redaction.take(), review_final).await;
                provisional = sent.then_some(turn);
                chat_span = Some(span);
                Feed::Model(r)
            }
            Step::ModelResponse(response) => {
                let r = run
                    .guarded(review_response(
                        &run,
                        turn,
                        response,
                        &mut provisional,
                        review_final,
                        chat_span.take(),
                        &mut final_output,
                    ))
                    .await;
                Feed::ModelResponse(r)
            }
            Step::ToolBatch(message) => {
                // The turn is recorded as in flight before any tool starts:
                // if this replica dies, its calls get synthetic results
                // rather than vanish (and are never replayed).
                let staged = run.ledger.stage_turn(Some(&message)).await;
                batch = Some(PendingBatch {
                    turn,
                    staged: staged.is_ok(),
                    settled: false,
                });
                let calls: Vec<ToolCall> = message.tool_calls().cloned().collect();
                let concurrency = cfg.tool_concurrency;
                let r = match staged {
                    Err(stop) => Err(stop),
                    Ok(()) => {
                        run.guarded(run_batch(
                            calls.len(),
                            concurrency,
                            |i| screen_call(&run, turn, &calls[i], &offered),
                            |i, stop| {
                                let span = spans::execute_tool(&calls[i].name, &calls[i].id);
                                process_call(
                                    run.clone(),
                                    turn,
                                    i as u32,
                                    calls[i].clone(),
                                    offered.clone(),
                                    stop,
                                )
                                .instrument(span)
                            },
                        ))
                        .await
                    }
                };
                match &r {
                    Ok(BatchDecision::Retry(_)) => retract(
                        &run,
                        &mut provisional,
                        "retried by an invalid_tool_call hook",
                    ),
                    // The turn commits with its results (the next append,
                    // or the run's end).
                    Ok(BatchDecision::Settled(_)) => {
                        batch = batch.map(|b| PendingBatch { settled: true, ..b })
                    }
                    // The run ends and the batch commits nothing; whether
                    // the session keeps the turn depends on how it ends
                    // (see the retraction after the loop).
                    Err(_) => {}
                }
                Feed::ToolBatch(r)
            }
            Step::TurnEnd(message) => {
                let output = final_output.take();
                let r = run
                    .guarded(async {
                        let out = run
                            .hooks
                            .chain::<TurnEndChain>(turn, message, |m| Payload::TurnEnd(m.clone()))
                            .await
                            .map_err(Stop::HookFailed)?;
                        run.emit_records(&out.records);
                        run.content.redact_message(&out.payload, out.redaction);
                        let decision = match out.stop {
                            None => EndDecision::Finish,
                            Some((_, TurnEndStop::ContinueRun(m))) => EndDecision::ContinueRun(m),
                            // A rejected answer is never recorded; its span
                            // ends without output.
                            Some((hook, TurnEndStop::Terminate(t))) => {
                                return Err(terminate(hook, t))
                            }
                        };
                        // Accepted: the answer's output, once, as every
                        // hook that reviewed it left it.
                        if let Some((span, finish_reason)) = output {
                            run.content
                                .record_response(&span, &out.payload, &finish_reason);
                        }
                        Ok(decision)
                    })
                    .await;
                // The answer is accepted (deltas held for turn_end go out
                // now), or it never reaches the client.
                let held = std::mem::take(&mut *run.held.locked());
                match &r {
                    Ok(_) => {
                        for text in held {
                            run.emit(RunEvent::TextDelta { turn, text });
                        }
                        provisional = None;
                    }
                    Err(Stop::Terminate { .. }) => {
                        retract(&run, &mut provisional, "rejected by a turn_end hook")
                    }
                    Err(_) => {}
                }
                Feed::TurnEnd(r)
            }
        };
        step = machine.feed(feed);
        // Record what this step committed before the next one starts (the
        // last step's commit goes with the run's end).
        if !matches!(step, Step::Finish(_)) && !machine.unrecorded().is_empty() {
            // Marked recorded only once the store has it: a refused append
            // (transcript full, lease lost, session deleted) is dropped by
            // the abort, not reported to the client as committed.
            match run.ledger.append(machine.unrecorded()).await {
                Ok(()) => {
                    machine.mark_recorded();
                    // A settled batch's turn is in the transcript now.
                    if batch.take_if(|b| b.settled).is_some() {
                        provisional = None;
                    }
                }
                Err(stop) => {
                    // The abort drops the settled batch's commit too.
                    if let Some(b) = batch.as_mut() {
                        b.settled = false;
                    }
                    step = machine.abort(stop);
                }
            }
        }
    };
    // A final answer whose turn_end never ran (the run stopped first) ends
    // its span now, without output.
    drop(final_output);
    let shown = provisional.take();
    // Before the end is recorded, so the store records the outcome the
    // client is told. A fault seen after it is counted and logged as the
    // hook streams close, and the outcome stands.
    let mut ending = ending;
    let faults = last_faults(&run, &mut ending);
    let ending = record_end(&run, &mut machine, ending).await;
    // Deltas of a turn that was never accepted (a hook failure, a timeout,
    // a cancel after they were streamed) are withdrawn too, and so is a
    // tool-call turn the transcript does not hold (known only now that the
    // end is recorded, or not).
    let retraction = shown.and_then(|turn| {
        let reason = match batch.filter(|b| b.turn == turn) {
            Some(b) if b.kept(ending.outcome) => return None,
            Some(_) => "committed",
            None => "accepted",
        };
        Some(RunEvent::DeltasRetracted {
            turn,
            reason: format!(
                "the run ended ({}) before the turn was {reason}",
                ending.outcome
            ),
        })
    });
    // Before the client's last events: once its end is recorded and its
    // hooks had run_end, the run is done but for a client that may be
    // slow (a drain past its grace does not wait for that).
    let report = finish(&run, ending);
    // Sent once the end is recorded, so a client that is behind never
    // keeps the session busy. What the last check found (failed-open
    // faults) waits for room like the rest: the queue may be full.
    // The last step's events first: a retraction voids what was sent of
    // its turn, them included.
    let tail = machine
        .drain_events()
        .chain(retraction)
        .chain(faults.into_iter().map(RunEvent::HookVerdict))
        .chain([RunEvent::Finished(report.clone())])
        .collect();
    Driven { report, tail }
}

/// Records the run's end with its last commit (the ledger retries a store
/// that is unavailable for up to a lease). When it cannot be recorded, the
/// client hears what the session will hold: the run `interrupted`, with
/// only what was recorded before — a replica that lost the lease records
/// nothing more, and a run whose end was never written is ended
/// `interrupted` by a reaper once its lease expires. The client is never
/// given an answer its transcript lacks.
async fn record_end(run: &Run, machine: &mut Machine, mut ending: Ending) -> Ending {
    let tail = machine.take_committed().to_vec();
    let end = crate::store::RunEnd {
        outcome: ending.outcome,
        reason: ending.reason.clone(),
        usage: ending.usage,
        turns: ending.turns,
    };
    if let Err(e) = run.ledger.end(&tail, &end).await {
        run.ledger.warn("cannot record the run's end", &e);
        let keep = ending.messages.len().saturating_sub(tail.len());
        ending.messages.truncate(keep);
        ending.outcome = RunOutcome::Interrupted;
        ending.reason = match crate::agent::ledger::stop_for(&e) {
            Stop::Interrupted(reason) => reason,
            _ => format!(
                "the run's end could not be recorded ({e}); the session records it interrupted once its lease expires"
            ),
        };
        ending.final_text.clear();
        // Nor is it shown what was not recorded (its final answer).
        machine.drain_events().for_each(drop);
    }
    ending
}

/// A tool batch whose model turn the transcript does not hold yet.
#[derive(Clone, Copy, Debug)]
struct PendingBatch {
    turn: u32,
    /// Recorded in the store as executing before any of its tools started.
    staged: bool,
    /// Settled, and its commit not refused: it lands with the next append
    /// or with the run's end.
    settled: bool,
}

impl PendingBatch {
    /// Whether the session keeps the turn once the run ended with
    /// `outcome` (as recorded, or as the client is told when it could not
    /// be): a settled batch commits with the end, and an `interrupted` end
    /// closes a staged batch with "outcome unknown" results, whichever
    /// replica records it (a run whose end could not be recorded is ended
    /// `interrupted` by a reaper). Any other end drops a batch that failed.
    fn kept(&self, outcome: RunOutcome) -> bool {
        self.settled || (self.staged && outcome == RunOutcome::Interrupted)
    }
}

/// Tells the client that the deltas of the provisional turn (pass mode) do
/// not stand, once.
fn retract(run: &Run, provisional: &mut Option<u32>, reason: &str) {
    if let Some(turn) = provisional.take() {
        run.emit(RunEvent::DeltasRetracted {
            turn,
            reason: reason.to_string(),
        });
    }
}

/// Calls the model under its `chat` span, streaming or holding deltas.
/// Returns whether deltas reached the client provisionally, and the span
/// (still open: output content is recorded after the model_response hooks,
/// and for a final answer under blocking turn_end hooks, after those).
/// `review_final`: blocking turn_end hooks review final answers.
async fn call_model(
    run: &Run,
    turn: u32,
    request: &ModelRequest,
    redaction: Option<String>,
    review_final: bool,
) -> (Result<ModelResponse, Stop>, bool, Span) {
    let model = run.agent.model.clone();
    let provider = model.provider_name();
    let span = spans::chat(model.model_name(), provider);
    // Input content, once, from the request every model_request hook shaped.
    run.content
        .record_request(&span, request, redaction.as_deref());
    let started = std::time::Instant::now();
    let hold = run.agent.config.stream_deltas == StreamDeltas::Hold
        && (review_final || run.hooks.has_blocking(EventKind::ModelResponse));
    let sent = std::sync::atomic::AtomicBool::new(false);
    let held: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let on_delta = |chunk: &str| {
        run.hooks.observe(turn, EventKind::TextDelta, || {
            Payload::TextDelta(chunk.to_string())
        });
        if !run.events.streams() {
            // An Invoke caller reads only the report.
            return;
        }
        if hold {
            held.locked().push(chunk.to_string());
        } else {
            sent.store(true, std::sync::atomic::Ordering::Relaxed);
            run.emit(RunEvent::TextDelta {
                turn,
                text: chunk.to_string(),
            });
        }
    };
    let r = run
        .guarded(
            async {
                model
                    .complete(request, &on_delta)
                    .await
                    .map_err(|e| Stop::ModelFailed(e.to_string()))
            }
            .instrument(span.clone()),
        )
        .await;
    match &r {
        Ok(resp) => {
            spans::record_chat_response(
                &span,
                &resp.model,
                &resp.id,
                &[resp.finish_reason.as_str()],
                Some(resp.usage.input_tokens),
                Some(resp.usage.output_tokens),
            );
            run.inst.metrics.model_call(
                model.model_name(),
                provider,
                started.elapsed(),
                Some(resp.usage.input_tokens),
                Some(resp.usage.output_tokens),
                resp.usage.estimated,
            );
        }
        Err(_) => {
            spans::record_error(&span, "model_failed");
            run.inst.metrics.model_call(
                model.model_name(),
                provider,
                started.elapsed(),
                None,
                None,
                false,
            );
        }
    }
    let sent = sent.load(std::sync::atomic::Ordering::Relaxed);
    if hold {
        // Poison-tolerant like every other lock (crate::lock): the deltas a
        // panicking holder left are still whole strings.
        *run.held.locked() = held
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
    }
    (r, sent, span)
}

/// model_response hooks; releases held deltas only for an accepted turn
/// (for a final answer under blocking turn_end hooks, only once those
/// accepted it too). `provisional`: the turn whose deltas were streamed
/// provisionally (pass mode).
async fn review_response(
    run: &Run,
    turn: u32,
    response: ModelResponse,
    provisional: &mut Option<u32>,
    review_final: bool,
    mut chat: Option<Span>,
    final_output: &mut Option<(Span, String)>,
) -> Result<ResponseDecision, Stop> {
    let original_text = response.message().text();
    let out = run
        .hooks
        .chain::<ModelResponseChain>(turn, response, |r| Payload::ModelResponse(r.clone()))
        .await;
    let held = std::mem::take(&mut *run.held.locked());
    let mut out = out.map_err(Stop::HookFailed)?;
    run.emit_records(&out.records);
    if let Some(m) = out.payload.message.as_mut() {
        m.normalize_call_ids(
            &call_id_prefix(&run.run_id, turn),
            crate::hooks::wire::MAX_VERDICT_NAME,
            &run.call_ids.locked(),
        );
    }
    let rewritten = out.payload.message().text() != original_text;
    match out.stop {
        None => {
            let release = if rewritten {
                retract(run, provisional, "rewritten by a model_response hook");
                let text = out.payload.message().text();
                (!text.is_empty()).then_some(text).into_iter().collect()
            } else {
                held
            };
            let calls = Machine::has_tool_calls(&out.payload.message());
            let await_turn_end = review_final && !calls;
            if await_turn_end && run.agent.config.stream_deltas == StreamDeltas::Hold {
                *run.held.locked() = release;
            } else {
                let sent = !release.is_empty();
                for text in release {
                    run.emit(RunEvent::TextDelta { turn, text });
                }
                if calls && run.events.streams() {
                    // The client is shown a tool-call turn now (its deltas,
                    // assistant_message and tool_call events), but it
                    // commits only with its settled batch: an
                    // invalid_tool_call retry discards it, and the client
                    // has to hear so (see the ToolBatch step).
                    *provisional = Some(turn);
                } else if !await_turn_end {
                    *provisional = None;
                } else if sent {
                    *provisional = Some(turn);
                }
            }
            // Output content, once, now that every model_response hook ran
            // (never for a retried or rejected turn); a final answer under
            // blocking turn_end hooks waits for those too, its span open.
            // A redaction covers the message from here on (later chat
            // inputs included).
            if let Some(m) = &out.payload.message {
                let mut ids = m.tool_calls().map(|c| c.id.clone()).peekable();
                if ids.peek().is_some() {
                    run.call_ids.locked().extend(ids);
                }
            }
            // (The span's extent does not depend on content capture.)
            if await_turn_end {
                *final_output = chat
                    .take()
                    .map(|span| (span, out.payload.finish_reason.clone()));
            }
            if run.content.is_enabled() {
                let message = out.payload.message();
                run.content.redact_message(&message, out.redaction);
                if let Some(span) = chat {
                    run.content
                        .record_response(&span, &message, &out.payload.finish_reason);
                }
            }
            Ok(ResponseDecision::Accept(out.payload))
        }
        Some((_, ResponseStop::Retry(f))) => {
            retract(run, provisional, "retried by a model_response hook");
            Ok(ResponseDecision::Retry(f))
        }
        Some((hook, ResponseStop::Terminate(t))) => {
            retract(run, provisional, "rejected by a model_response hook");
            Err(terminate(hook, t))
        }
    }
}

/// Ids hookwire gives tool calls that came without one: unique per run
/// (a run-id fragment) and turn, short, letters, digits and `_` only.
fn call_id_prefix(run_id: &str, turn: u32) -> String {
    let short: String = run_id
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    format!("hw_{short}_{turn}_")
}

/// The last check for the hooks' protocol faults since the run's last
/// step: a run that ended well does not end so when a closed hook broke
/// its protocol; any other ending keeps its reason, and the fault is
/// counted and logged either way. The notable records, also kept for the
/// run's report.
fn last_faults(run: &Run, ending: &mut Ending) -> Vec<VerdictRecord> {
    let mut records = Vec::new();
    let checked = run.hooks.check_faults(&mut records, EventKind::RunEnd);
    records.retain(VerdictRecord::is_notable);
    run.records.locked().extend(records.iter().cloned());
    if let Err(f) = checked {
        if matches!(ending.outcome, RunOutcome::Completed | RunOutcome::MaxTurns) {
            ending.outcome = RunOutcome::HookFailed;
            ending.reason = f.to_string();
        }
    }
    records
}

/// Ends the run with its hooks (run_end, their streams closed) and builds
/// its report.
fn finish(run: &Run, ending: Ending) -> RunReport {
    run.hooks
        .observe(ending.turns, EventKind::RunEnd, || Payload::RunEnd {
            outcome: ending.outcome,
            reason: ending.reason.clone(),
            final_text: ending.final_text.clone(),
            usage: ending.usage,
            turns: ending.turns,
        });
    run.hooks.close();
    RunReport {
        run_id: run.run_id.clone(),
        session_id: run.session_id.clone(),
        outcome: ending.outcome,
        final_text: ending.final_text,
        reason: ending.reason,
        usage: ending.usage,
        turns: ending.turns,
        messages: ending.messages,
        hook_verdicts: run.records.locked().clone(),
        finish_reason: ending.finish_reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::hooks::payload::EventContext;
    use crate::session::Session;
    use crate::store::{
        ClaimedRun, MemoryStore, NewSession, OwnerUsage, RunEnd, RunLease, SessionFilter,
        SessionPage, SessionStore, Signal, StoreError,
    };
    use tokio::sync::{broadcast, Notify};

    /// A tool-call turn stays in the session only through its settled
    /// batch's commit or an interrupted end of its staged batch; a batch
    /// that failed any other way (or was never staged) leaves no trace.
    #[test]
    fn a_batch_turn_is_kept_only_by_its_commit_or_an_interrupted_end() {
        let b = |staged, settled| PendingBatch {
            turn: 1,
            staged,
            settled,
        };
        assert!(b(true, true).kept(RunOutcome::MaxTurns));
        assert!(b(true, true).kept(RunOutcome::Interrupted));
        assert!(b(true, false).kept(RunOutcome::Interrupted));
        for outcome in [
            RunOutcome::Terminated,
            RunOutcome::HookFailed,
            RunOutcome::Cancelled,
            RunOutcome::TimedOut,
            RunOutcome::Failed,
        ] {
            assert!(!b(true, false).kept(outcome), "{outcome}");
        }
        assert!(
            !b(false, false).kept(RunOutcome::Interrupted),
            "never staged: nothing to close"
        );
    }

    /// A memory store whose `request_approval` says when it started and
    /// finishes only when let go (if `held`), and whose first
    /// `expiry_failures` approval timeouts answer UNAVAILABLE.
    struct HeldApprovals {
        inner: MemoryStore,
        held: bool,
        entered: Notify,
        release: Notify,
        expiry_failures: std::sync::atomic::AtomicUsize,
    }

    impl HeldApprovals {
        fn new(held: bool, expiry_failures: usize) -> HeldApprovals {
            HeldApprovals {
                inner: MemoryStore::default(),
                held,
                entered: Notify::new(),
                release: Notify::new(),
                expiry_failures: expiry_failures.into(),
            }
        }
    }

    #[async_trait::async_trait]
    impl SessionStore for HeldApprovals {
        fn engine(&self) -> &'static str {
            self.inner.engine()
        }
        async fn create_session(&self, s: &NewSession) -> Result<Session, StoreError> {
            self.inner.create_session(s).await
        }
        async fn get_session(&self, id: &str) -> Result<Session, StoreError> {
            self.inner.get_session(id).await
        }
        async fn list_sessions(&self, f: &SessionFilter) -> Result<SessionPage, StoreError> {
            self.inner.list_sessions(f).await
        }
        async fn run_session(&self, run: &str) -> Result<Session, StoreError> {
            self.inner.run_session(run).await
        }
        async fn owner_usage(
            &self,
            owner: &str,
            window: Duration,
            cap: u64,
        ) -> Result<OwnerUsage, StoreError> {
            self.inner.owner_usage(owner, window, cap).await
        }
        async fn delete_session(&self, id: &str) -> Result<Session, StoreError> {
            self.inner.delete_session(id).await
        }
        async fn transcript(&self, id: &str) -> Result<Vec<Message>, StoreError> {
            self.inner.transcript(id).await
        }
        async fn transcript_after(&self, id: &str, from: u64) -> Result<Vec<Message>, StoreError> {
            self.inner.transcript_after(id, from).await
        }
        async fn begin_run(&self, s: &str, r: &str, rep: &str) -> Result<RunLease, StoreError> {
            self.inner.begin_run(s, r, rep).await
        }
        async fn renew(&self, l: &RunLease) -> Result<(), StoreError> {
            self.inner.renew(l).await
        }
        async fn append(&self, l: &RunLease, m: &[Message]) -> Result<(), StoreError> {
            self.inner.append(l, m).await
        }
        async fn stage_turn(&self, l: &RunLease, t: Option<&Message>) -> Result<(), StoreError> {
            self.inner.stage_turn(l, t).await
        }
        async fn check_run(&self, l: &RunLease) -> Result<(), StoreError> {
            self.inner.check_run(l).await
        }
        async fn end_run(&self, l: &RunLease, m: &[Message], e: &RunEnd) -> Result<(), StoreError> {
            self.inner.end_run(l, m, e).await
        }
        async fn request_approval(&self, l: &RunLease, c: &str) -> Result<(), StoreError> {
            if self.held {
                let release = self.release.notified();
                self.entered.notify_one();
                release.await;
            }
            self.inner.request_approval(l, c).await
        }
        async fn resolve_approval(&self, r: &str, c: &str, d: &Decision) -> Result<(), StoreError> {
            self.inner.resolve_approval(r, c, d).await
        }
        async fn expire_approval(
            &self,
            l: &RunLease,
            c: &str,
        ) -> Result<Option<Decision>, StoreError> {
            use std::sync::atomic::Ordering;
            let fail = self
                .expiry_failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if fail {
                return Err(StoreError::Unavailable("cut off (test)".into()));
            }
            self.inner.expire_approval(l, c).await
        }
        async fn request_cancel(&self, run: &str, reason: &str) -> Result<(), StoreError> {
            self.inner.request_cancel(run, reason).await
        }
        async fn signals(
            &self,
            replica: &str,
            waiting: &[(String, String)],
        ) -> Result<Vec<Signal>, StoreError> {
            self.inner.signals(replica, waiting).await
        }
        async fn claim_expired(
            &self,
            replica: &str,
            limit: u32,
        ) -> Result<Vec<ClaimedRun>, StoreError> {
            self.inner.claim_expired(replica, limit).await
        }
        async fn expire_sessions(
            &self,
            ttl: Duration,
            limit: u32,
        ) -> Result<Vec<Session>, StoreError> {
            self.inner.expire_sessions(ttl, limit).await
        }
        fn subscribe(&self) -> broadcast::Receiver<String> {
            self.inner.subscribe()
        }
        async fn close(&self) {
            self.inner.close().await
        }
    }

    /// Session `s1` in `store`, and its run `r1` begun.
    async fn begun(store: &dyn SessionStore) -> RunLease {
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
        store.begin_run("s1", "r1", "me").await.unwrap()
    }

    /// A run `r1` of session `s1` on `store`, and its client's events.
    async fn run_on(
        store: Arc<HeldApprovals>,
    ) -> (Arc<Run>, mpsc::Receiver<crate::agent::events::QueuedEvent>) {
        let lease = begun(&*store).await;
        let config = Config::parse(
            "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\n",
            "test",
        )
        .unwrap();
        let agent = Arc::new(AgentRuntime {
            config: config.agents[0].clone(),
            model: crate::server::build_models(&config).unwrap()["m"].clone(),
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
        let (tx, events) = mpsc::channel(16);
        let run = Arc::new(Run::new(
            "r1".into(),
            "s1".into(),
            agent,
            hooks,
            Arc::new(HookRegistry::new(&config).unwrap()),
            true,
            Arc::new(Approvals::default()),
            deadline,
            tx,
            inst,
            Ledger::new(store.clone(), lease),
        ));
        (run, events)
    }

    /// `run` asks for approval of a call `c1` of tool `t`, as a `tool_call`
    /// hook's `ask` with `timeout`.
    async fn ask(
        run: &Arc<Run>,
        stop: &BatchStop,
        timeout: Option<Duration>,
    ) -> Option<CallOutcome> {
        let call = ToolCall {
            id: "c1".into(),
            name: "t".into(),
            arguments_json: "{}".into(),
        };
        let ask = Ask {
            question: "run t?".into(),
            timeout,
        };
        run.ask_approval(1, 0, &call, "h", ask, stop).await
    }

    /// The batch stops while the approval request is being recorded: the
    /// client never hears of it, and the store's record is withdrawn.
    #[tokio::test]
    async fn no_approval_request_is_sent_once_the_batch_stopped_during_its_store_write() {
        let store = Arc::new(HeldApprovals::new(true, 0));
        let (run, mut events) = run_on(store.clone()).await;
        let stop = BatchStop::default();
        let asking = tokio::spawn({
            let (run, stop) = (run.clone(), stop.clone());
            async move { ask(&run, &stop, None).await }
        });
        store.entered.notified().await;
        // Another call of the batch terminates while the request is written.
        stop.token().cancel();
        store.release.notify_one();
        let outcome = asking.await.unwrap();
        assert!(matches!(outcome, Some(CallOutcome::Halted)), "{outcome:?}");
        while let Ok(ev) = events.try_recv() {
            assert!(
                !matches!(*ev, RunEvent::ApprovalRequested { .. }),
                "an approval request reached the client after the batch stopped"
            );
        }
        let approve = Decision {
            approve: true,
            note: String::new(),
        };
        assert!(
            matches!(
                store.resolve_approval("r1", "c1", &approve).await,
                Err(StoreError::ApprovalNotPending { .. })
            ),
            "the request is withdrawn in the store"
        );
    }

    /// An approval that timed out, where the store could not record the
    /// timeout: taken for a denial, it left the request pending in the
    /// store, and a later ResolveApproval recorded an approval (answered
    /// OK) for a call this run had denied. The run now stops instead.
    #[tokio::test(start_paused = true)]
    async fn an_approval_timeout_the_store_cannot_record_stops_the_run() {
        let store = Arc::new(HeldApprovals::new(false, usize::MAX));
        let (run, _events) = run_on(store.clone()).await;
        let outcome = ask(&run, &BatchStop::default(), Some(Duration::from_millis(10))).await;
        let Some(CallOutcome::Stop(Stop::Failed(why))) = outcome else {
            panic!("{outcome:?}")
        };
        assert!(why.contains("could not be recorded"), "{why}");
    }

    /// A store that answers again within the retry window records the
    /// timeout, and the call is denied as usual.
    #[tokio::test(start_paused = true)]
    async fn an_approval_timeout_is_recorded_once_the_store_answers_again() {
        let store = Arc::new(HeldApprovals::new(false, 2));
        let (run, _events) = run_on(store.clone()).await;
        let outcome = ask(&run, &BatchStop::default(), Some(Duration::from_millis(10))).await;
        let Some(CallOutcome::Result(r)) = outcome else {
            panic!("{outcome:?}")
        };
        assert!(r.is_error && r.content.contains("timed out"), "{r:?}");
        assert_eq!(
            store
                .resolve_approval(
                    "r1",
                    "c1",
                    &Decision {
                        approve: true,
                        note: String::new()
                    }
                )
                .await,
            Err(StoreError::ApprovalNotPending {
                run_id: "r1".into(),
                call_id: "c1".into()
            }),
            "the timeout is recorded: a late answer is refused"
        );
    }

    /// Streams `chunks` as deltas, says it is about to fail, then fails.
    struct FailsMidStream {
        chunks: Vec<String>,
        failing: Arc<Notify>,
    }

    impl crate::model::ModelProvider for FailsMidStream {
        fn provider_name(&self) -> &'static str {
            "test"
        }
        fn model_name(&self) -> &str {
            "m"
        }
        fn complete<'a>(
            &'a self,
            _request: &'a ModelRequest,
            on_delta: crate::model::DeltaSink<'a>,
        ) -> futures::future::BoxFuture<'a, Result<ModelResponse, crate::model::ModelError>>
        {
            Box::pin(async move {
                for c in &self.chunks {
                    on_delta(c);
                }
                self.failing.notify_one();
                Err(crate::model::ModelError {
                    provider: "test",
                    model: "m".into(),
                    status: Some(500),
                    message: "connection reset mid-stream".into(),
                })
            })
        }
    }

    /// The model streams faster than the client reads (later deltas merge
    /// into the queue's held delta), then fails: the client still gets all
    /// the streamed text, then the retraction, then `Finished`, although
    /// the queue was full when the run ended.
    #[tokio::test(start_paused = true)]
    async fn a_run_that_fails_mid_stream_with_its_queue_full_still_retracts_the_deltas() {
        let store = Arc::new(MemoryStore::default());
        let lease = begun(&*store).await;
        let config = Config::parse(
            "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m, stream_deltas: pass}]\n",
            "test",
        )
        .unwrap();
        let chunks: Vec<String> = (0..40).map(|i| format!("w{i} ")).collect();
        let failing = Arc::new(Notify::new());
        let agent = Arc::new(AgentRuntime {
            config: config.agents[0].clone(),
            model: Arc::new(FailsMidStream {
                chunks: chunks.clone(),
                failing: failing.clone(),
            }),
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
        let (tx, mut events) = mpsc::channel(16);
        let run = Arc::new(Run::new(
            "r1".into(),
            "s1".into(),
            agent,
            hooks,
            Arc::new(HookRegistry::new(&config).unwrap()),
            true,
            Arc::new(Approvals::default()),
            deadline,
            tx,
            inst,
            Ledger::new(store.clone(), lease),
        ));
        let driving = tokio::spawn(async move {
            let driven = drive_to_end(run.clone(), Arc::new(vec![]), "hi".into()).await;
            run.deliver_tail(driven.tail).await;
            driven.report
        });
        // Nothing is read until the model has failed: by then the queue is
        // full and the deltas past it are held.
        failing.notified().await;
        let mut got = Vec::new();
        while let Some(ev) = events.recv().await {
            got.push(*ev);
        }
        let report = driving.await.unwrap();
        assert_eq!(report.outcome, RunOutcome::ModelFailed);
        let retracted = got
            .iter()
            .position(|e| matches!(e, RunEvent::DeltasRetracted { turn: 1, .. }))
            .unwrap_or_else(|| panic!("no retraction reached the client: {got:?}"));
        let streamed: String = got[..retracted]
            .iter()
            .filter_map(|e| match e {
                RunEvent::TextDelta { turn: 1, text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(streamed, chunks.concat(), "every streamed chunk, in order");
        assert!(
            matches!(got.last(), Some(RunEvent::Finished(r)) if r.outcome == RunOutcome::ModelFailed),
            "Finished is the last event: {:?}",
            got.last()
        );
        assert_eq!(
            retracted,
            got.len() - 2,
            "the retraction comes right before it"
        );
    }
}
