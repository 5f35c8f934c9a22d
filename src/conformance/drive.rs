//! The checker's IO: Describe, health, and the scripted session and run
//! played against the hook server the way hookwire plays them (same event
//! order, contexts, deadlines, scratchpad threading, stream opening and
//! closing). Accepted verdicts are applied with the engine's own chain rules
//! so later events carry the rewrites, as in a real run; judging is left to
//! `checks`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::hooks::channel::Channel;
use tokio::time::Instant;

use crate::hooks::client::HookChannel;

use crate::conformance::script::Scenario;
use crate::conformance::stream::Recorder;
use crate::conformance::transcript::{Health, ToolCallLog, Transcript};
use crate::event::EventKind;
use crate::hooks::compose::{
    ChainEvent, InvalidCallStop, InvalidToolCallChain, ModelResponseChain, RunStartChain, Step,
    ToolCallChain, ToolCallStop, ToolResultChain,
};
use crate::hooks::dispatch::{judge_alone, scratchpad_after};
use crate::hooks::failure::{FailureClass, Fault};
use crate::hooks::payload::{EventContext, Payload};
use crate::hooks::stream::classify_status;
use crate::hooks::verdict::Verdict;
use crate::hooks::wire;
use crate::message::{Message, ToolCall, ToolResult};
use crate::pb;
use crate::pb::hook_service_client::HookServiceClient;

/// How long the checker gives the hook server.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Sent as `deadline_remaining_ms`; also the CallTool and Describe limit.
    pub deadline: Duration,
    /// Extra wait past a deadline, so a late verdict is seen (and reported
    /// as late) rather than mistaken for none.
    pub grace: Duration,
    /// How long a stream may stay open after the half-close.
    pub close: Duration,
}

impl Timing {
    pub fn new(deadline: Duration) -> Timing {
        Timing {
            deadline,
            grace: deadline.clamp(Duration::from_secs(1), Duration::from_secs(2)),
            close: deadline.max(Duration::from_secs(1)),
        }
    }
}

pub async fn describe(
    mut client: HookServiceClient<HookChannel>,
    timeout: Duration,
) -> Result<(pb::DescribeResponse, Duration), Fault> {
    let mut req = tonic::Request::new(pb::DescribeRequest {
        hookwire_version: env!("CARGO_PKG_VERSION").into(),
    });
    req.set_timeout(timeout);
    let started = Instant::now();
    match tokio::time::timeout(timeout, client.describe(req)).await {
        Ok(Ok(r)) => Ok((r.into_inner(), started.elapsed())),
        Ok(Err(status)) => Err(classify_status(&status, false)),
        Err(_) => Err(Fault::new(
            FailureClass::Deadline,
            format!("no answer within {} ms", timeout.as_millis()),
        )),
    }
}

/// `grpc.health.v1.Health/Check` for `service`.
pub async fn health(channel: Channel, service: &str, timeout: Duration) -> Health {
    use tonic_health::pb::health_client::HealthClient;
    let mut req = tonic::Request::new(tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    });
    req.set_timeout(timeout);
    match tokio::time::timeout(timeout, HealthClient::new(channel).check(req)).await {
        Ok(Ok(r)) => Health::Status(r.into_inner().status),
        Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => Health::NotServed,
        Ok(Err(s)) if s.code() == tonic::Code::NotFound => Health::UnknownService,
        Ok(Err(s)) => Health::Failed(classify_status(&s, false)),
        Err(_) => Health::Failed(Fault::new(
            FailureClass::Deadline,
            format!("no answer within {} ms", timeout.as_millis()),
        )),
    }
}

/// Plays the session and the run; `hook` is the name the session lists.
pub async fn run(
    scenario: &Scenario,
    client: HookServiceClient<HookChannel>,
    hook: &str,
    timing: Timing,
) -> Transcript {
    let mut d = Driver {
        sc: scenario,
        client,
        timing,
        scratchpad: BTreeMap::new(),
        transcript: Transcript::default(),
    };
    if scenario.subscribes(EventKind::SessionStart) {
        let mut s = Recorder::new("session_start stream", d.client.clone());
        let ctx = scenario.session_context();
        d.blocking(&mut s, "session_start", ctx, scenario.session_start(hook))
            .await;
        d.finish(s).await;
    }
    // The run's scratchpad starts empty; session events do not share it.
    d.scratchpad.clear();
    d.run().await;
    if scenario.subscribes(EventKind::SessionEnd) {
        let mut s = Recorder::new("session_end stream", d.client.clone());
        let ctx = scenario.session_context();
        d.observe(&mut s, "session_end", ctx, scenario.session_end());
        d.finish(s).await;
    }
    d.transcript
}

/// A blocking event sent and not yet judged.
struct Pending {
    seq: u64,
    kind: EventKind,
    payload: Payload,
}

struct Driver<'a> {
    sc: &'a Scenario,
    client: HookServiceClient<HookChannel>,
    timing: Timing,
    scratchpad: BTreeMap<String, Vec<u8>>,
    transcript: Transcript,
}

impl Driver<'_> {
    async fn finish(&mut self, stream: Recorder) {
        if let Some(log) = stream.close(self.timing.close).await {
            self.transcript.streams.push(log);
        }
    }

    fn wire_context(&self, ctx: &EventContext) -> pb::EventContext {
        wire::context_to_wire(ctx, &self.scratchpad, self.timing.deadline)
    }

    /// Sends a blocking event; returns the verdict when hookwire would have
    /// accepted it (in time and valid), after applying its scratchpad.
    async fn blocking(
        &mut self,
        stream: &mut Recorder,
        subject: &str,
        ctx: EventContext,
        payload: Payload,
    ) -> Option<Verdict> {
        let pending = self.send_blocking(stream, subject, ctx, payload)?;
        self.verdict(stream, pending).await
    }

    /// Sends a blocking event without waiting for its verdict (`None` when
    /// the server does not subscribe to it).
    fn send_blocking(
        &mut self,
        stream: &mut Recorder,
        subject: &str,
        ctx: EventContext,
        payload: Payload,
    ) -> Option<Pending> {
        let kind = payload.kind();
        if !self.sc.subscribes(kind) {
            return None;
        }
        let seq = stream.send(
            kind,
            subject.to_string(),
            self.wire_context(&ctx),
            wire::payload_to_wire(&payload),
            Some(payload.clone()),
        );
        Some(Pending { seq, kind, payload })
    }

    /// The verdict of a sent event, as [`Driver::blocking`] returns it.
    async fn verdict(&mut self, stream: &mut Recorder, sent: Pending) -> Option<Verdict> {
        let Pending { seq, kind, payload } = sent;
        let patience = self.timing.deadline + self.timing.grace;
        let (arrival, in_time) = stream.wait(seq, patience).await?;
        // hookwire discards a late verdict: the event proceeds without it.
        if !in_time {
            return None;
        }
        let verdict = judge_alone(kind, arrival.verdict, Some(&payload), None).ok()?;
        // hookwire refuses the whole verdict when its updates overflow the
        // run's scratchpad (the check's row says so).
        self.scratchpad = scratchpad_after(
            self.scratchpad.clone(),
            verdict.meta.scratchpad.iter().cloned(),
        )
        .ok()?;
        Some(verdict)
    }

    fn observe(
        &mut self,
        stream: &mut Recorder,
        subject: &str,
        ctx: EventContext,
        payload: Payload,
    ) {
        let kind = payload.kind();
        if self.sc.subscribes(kind) {
            stream.send(
                kind,
                subject.to_string(),
                self.wire_context(&ctx),
                wire::payload_to_wire(&payload),
                None,
            );
        }
    }

    /// Applies an accepted verdict to a chain payload with the engine's
    /// rules; `Some` is the chain's terminal verdict.
    fn thread<E: ChainEvent>(
        payload: &mut E::Payload,
        verdict: Option<Verdict>,
    ) -> Option<E::Stop> {
        match E::apply(payload, verdict?.action) {
            Ok(Step::Stop(stop)) => Some(stop),
            _ => None,
        }
    }

    async fn run(&mut self) {
        let sc = self.sc;
        let mut s = Recorder::new("run stream", self.client.clone());

        let mut input = crate::conformance::script::INPUT.to_string();
        let v = self
            .blocking(
                &mut s,
                "run_start",
                sc.run_context(0),
                Payload::RunStart {
                    input: input.clone(),
                },
            )
            .await;
        Self::thread::<RunStartChain>(&mut input, v);
        let mut history = vec![Message::user(input)];

        // Turn 1: the model calls the tools.
        let request = sc.request(history.clone());
        self.blocking(
            &mut s,
            "model_request (turn 1)",
            sc.run_context(1),
            Payload::ModelRequest(request),
        )
        .await;
        let response = sc.tool_turn();
        self.blocking(
            &mut s,
            "model_response (turn 1)",
            sc.run_context(1),
            Payload::ModelResponse(response.clone()),
        )
        .await;
        let mut results = self.tools(&mut s).await;
        if sc.subscribes(EventKind::InvalidToolCall) {
            let call = sc.unknown_call();
            let v = self
                .blocking(
                    &mut s,
                    &format!("invalid_tool_call {}", call.name),
                    sc.run_context(1),
                    sc.invalid_call(&call),
                )
                .await;
            let mut unused = call.clone();
            results.push(match Self::thread::<InvalidToolCallChain>(&mut unused, v) {
                Some(InvalidCallStop::Skip(skip)) => ToolResult {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    content: skip.result,
                    is_error: skip.is_error,
                },
                _ => sc.invalid_call_result(&call),
            });
        }
        history.push(response.message());
        history.push(Message::tool_results(results.clone()));

        // Turn 2: the final answer, streamed.
        let request = sc.request(history);
        self.blocking(
            &mut s,
            "model_request (turn 2)",
            sc.run_context(2),
            Payload::ModelRequest(request),
        )
        .await;
        let text = sc.answer_text(&results);
        for (i, chunk) in Scenario::deltas(&text).into_iter().enumerate() {
            self.observe(
                &mut s,
                &format!("text_delta #{}", i + 1),
                sc.run_context(2),
                Payload::TextDelta(chunk),
            );
        }
        let mut answer = sc.answer(&text);
        let v = self
            .blocking(
                &mut s,
                "model_response (turn 2)",
                sc.run_context(2),
                Payload::ModelResponse(answer.clone()),
            )
            .await;
        Self::thread::<ModelResponseChain>(&mut answer, v);
        let message = answer.message();
        self.blocking(
            &mut s,
            "turn_end",
            sc.run_context(2),
            Payload::TurnEnd(message.clone()),
        )
        .await;
        self.observe(
            &mut s,
            "run_end",
            sc.run_context(2),
            sc.run_end(&message.text()),
        );
        self.finish(s).await;
    }

    /// Turn 1's tool calls as hookwire runs a batch with `tool_concurrency`
    /// above 1: every tool_call event is sent before any verdict is awaited
    /// (several events in flight on one stream, answered by seq in any
    /// order), then the calls execute (CallTool for owned tools, the
    /// checker's stand-ins for the others), then every tool_result event is
    /// sent at once the same way. A skipped call gets no tool_result event
    /// (its result came from a hook); an `ask` is approved, as a client
    /// would, and the call goes on.
    async fn tools(&mut self, s: &mut Recorder) -> Vec<ToolResult> {
        let sc = self.sc;
        let planned = sc.calls();
        let mut calls: Vec<ToolCall> = planned.iter().map(|p| p.call.clone()).collect();
        let sent: Vec<Option<Pending>> = planned
            .iter()
            .enumerate()
            .map(|(index, p)| {
                self.send_blocking(
                    s,
                    &format!("tool_call {}", p.call.name),
                    sc.run_context(1),
                    Payload::ToolCall {
                        call: p.call.clone(),
                        index: index as u32,
                        tool: p.spec.clone(),
                    },
                )
            })
            .collect();
        s.in_flight_together(sent.iter().flatten().map(|p| p.seq).collect());
        let mut stops = Vec::with_capacity(calls.len());
        for (call, pending) in calls.iter_mut().zip(sent) {
            let v = match pending {
                Some(p) => self.verdict(s, p).await,
                None => None,
            };
            stops.push(Self::thread::<ToolCallChain>(call, v));
        }

        let mut results = Vec::with_capacity(calls.len());
        for ((p, call), stop) in planned.iter().zip(&calls).zip(&stops) {
            // Owned tools are always executed, even when a tool_call verdict
            // skipped them (hookwire would not), so every tool gets checked.
            let executed = if p.owned {
                self.call_tool(call, call.arguments_json != p.call.arguments_json)
                    .await
            } else {
                sc.local_result(call)
            };
            results.push(match stop {
                Some(ToolCallStop::Skip(skip)) => ToolResult {
                    call_id: call.id.clone(),
                    name: call.name.clone(),
                    content: skip.result.clone(),
                    is_error: skip.is_error,
                },
                _ => executed,
            });
        }

        let sent: Vec<Option<Pending>> = calls
            .iter()
            .zip(&stops)
            .zip(&results)
            .enumerate()
            .map(|(index, ((call, stop), result))| {
                if matches!(stop, Some(ToolCallStop::Skip(_))) {
                    return None;
                }
                self.send_blocking(
                    s,
                    &format!("tool_result {}", call.name),
                    sc.run_context(1),
                    Payload::ToolResult {
                        call: call.clone(),
                        index: index as u32,
                        result: result.clone(),
                    },
                )
            })
            .collect();
        s.in_flight_together(sent.iter().flatten().map(|p| p.seq).collect());
        for (result, pending) in results.iter_mut().zip(sent) {
            if let Some(p) = pending {
                let v = self.verdict(s, p).await;
                Self::thread::<ToolResultChain>(result, v);
            }
        }
        results
    }

    async fn call_tool(&mut self, call: &ToolCall, rewritten: bool) -> ToolResult {
        let deadline = self.timing.deadline;
        let mut req = tonic::Request::new(pb::CallToolRequest {
            context: Some(self.wire_context(&self.sc.run_context(1))),
            call: Some(call.into()),
        });
        req.set_timeout(deadline);
        let started = Instant::now();
        let result = match tokio::time::timeout(deadline, self.client.call_tool(req)).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err(classify_status(&status, false)),
            Err(_) => Err(Fault::new(
                FailureClass::Deadline,
                format!("CallTool did not answer within {} ms", deadline.as_millis()),
            )),
        };
        let latency = started.elapsed();
        // The text hookwire hands the model when CallTool fails.
        let (content, is_error) = match &result {
            Ok(r) => (r.content.clone(), r.is_error),
            Err(f) => (
                format!(
                    "tool `{}` failed to execute: {}: {}",
                    call.name, f.class, f.detail
                ),
                true,
            ),
        };
        self.transcript.tool_calls.push(ToolCallLog {
            tool: call.name.clone(),
            arguments_json: call.arguments_json.clone(),
            rewritten,
            deadline,
            latency,
            result,
        });
        ToolResult {
            call_id: call.id.clone(),
            name: call.name.clone(),
            content,
            is_error,
        }
    }
}
