//! The run as an IO-free state machine. It decides what happens next; the
//! runner performs each step (hooks, model, tools) and feeds the result
//! back. Every rule about turns, retries, commits and outcomes lives here,
//! so it is tested without sockets.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::agent::events::RunEvent;
use crate::agent::outcome::RunOutcome;
use crate::event::EventKind;
use crate::history::History;
use crate::hooks::failure::HookFailure;
use crate::message::{Block, Message, ToolResult, ToolSpec, Usage};
use crate::model::{ModelRequest, ModelResponse, ToolChoice};

/// The agent facts a run's requests are built from.
#[derive(Clone, Debug, Default)]
pub struct RequestTemplate {
    pub model: String,
    pub system_prompt: String,
    pub context: Vec<String>,
    pub tools: Vec<ToolSpec>,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
}

/// Why a step ended the run early.
#[derive(Clone, Debug, PartialEq)]
pub enum Stop {
    Terminate {
        hook: String,
        reason: String,
        reply: Option<String>,
    },
    HookFailed(HookFailure),
    /// A local error (e.g. an invalid effective request).
    Failed(String),
    ModelFailed(String),
    Cancelled(String),
    TimedOut,
    /// The run's replica can no longer record it (its lease was lost).
    Interrupted(String),
}

#[derive(Debug)]
pub enum RequestDecision {
    Call(ModelRequest),
    /// A hook answered in place of the model.
    Respond(ModelResponse),
}

#[derive(Debug)]
pub enum ResponseDecision {
    Accept(ModelResponse),
    Retry(String),
}

#[derive(Debug)]
pub enum BatchDecision {
    /// One result per call, in call order.
    Settled(Vec<ToolResult>),
    /// An invalid_tool_call hook asked to re-ask the model.
    Retry(String),
}

#[derive(Debug)]
pub enum EndDecision {
    Finish,
    ContinueRun(String),
}

pub enum Feed {
    RunStart(Result<String, Stop>),
    ModelRequest(Result<RequestDecision, Stop>),
    Model(Result<ModelResponse, Stop>),
    ModelResponse(Result<ResponseDecision, Stop>),
    ToolBatch(Result<BatchDecision, Stop>),
    TurnEnd(Result<EndDecision, Stop>),
}

#[derive(Debug, PartialEq)]
pub enum Step {
    /// Fire run_start hooks on the input.
    RunStart(String),
    /// Fire model_request hooks on this baseline request.
    ModelRequest(ModelRequest),
    /// Call the model with the effective request.
    CallModel(ModelRequest),
    /// Fire model_response hooks.
    ModelResponse(ModelResponse),
    /// Run the turn's tool calls (validation, hooks, execution).
    ToolBatch(Message),
    /// Fire turn_end hooks on the final answer.
    TurnEnd(Message),
    Finish(Ending),
}

impl Step {
    /// The lifecycle event the step is about (`None` for `Finish`).
    pub fn event(&self) -> Option<EventKind> {
        Some(match self {
            Step::RunStart(_) => EventKind::RunStart,
            Step::ModelRequest(_) | Step::CallModel(_) => EventKind::ModelRequest,
            Step::ModelResponse(_) => EventKind::ModelResponse,
            Step::ToolBatch(_) => EventKind::ToolCall,
            Step::TurnEnd(_) => EventKind::TurnEnd,
            Step::Finish(_) => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Ending {
    pub outcome: RunOutcome,
    pub reason: String,
    pub final_text: String,
    /// Messages the run commits to the transcript.
    pub messages: Vec<Message>,
    pub usage: Usage,
    pub turns: u32,
    /// The provider's finish reason of the last accepted model turn.
    pub finish_reason: String,
}

#[derive(Debug)]
enum State {
    Start(String),
    /// Holds the input as received, to tell whether hooks rewrote it.
    AwaitRunStart(String),
    AwaitModelRequest,
    AwaitModel,
    AwaitModelResponse,
    AwaitBatch(Message),
    AwaitTurnEnd(Message),
    Done,
}

pub struct Machine {
    template: RequestTemplate,
    max_turns: u32,
    /// Transcript before the run (shared, never copied), then the run's
    /// committed messages.
    history: History,
    run_from: usize,
    /// History before this index is recorded in the store.
    flushed: usize,
    turn: u32,
    usage: Usage,
    finish_reason: String,
    state: State,
    events: VecDeque<RunEvent>,
    /// Whether blocking turn_end hooks review final answers: the answer is
    /// shown (its `AssistantMessage`) only once they accepted it.
    review_final: bool,
    /// The final answer's event, held while turn_end hooks decide.
    pending_answer: Option<RunEvent>,
}

impl Machine {
    pub fn new(
        template: RequestTemplate,
        max_turns: u32,
        transcript: Arc<Vec<Message>>,
        input: String,
    ) -> Machine {
        let run_from = transcript.len();
        Machine {
            template,
            max_turns,
            history: History::new(transcript),
            run_from,
            flushed: run_from,
            turn: 0,
            usage: Usage::default(),
            finish_reason: String::new(),
            state: State::Start(input),
            events: VecDeque::new(),
            review_final: false,
            pending_answer: None,
        }
    }

    /// With blocking turn_end hooks: a final answer reaches the client only
    /// once they accepted it (a turn_end terminate never follows an answer
    /// the client already has).
    pub fn review_final_answers(&mut self, yes: bool) {
        self.review_final = yes;
    }

    pub fn turn(&self) -> u32 {
        self.turn
    }

    /// Events produced by the last transition, for the client.
    pub fn drain_events(&mut self) -> impl Iterator<Item = RunEvent> + '_ {
        self.events.drain(..)
    }

    /// Messages committed to history since the last call, for the runner
    /// to record; each is handed out once.
    pub fn take_committed(&mut self) -> &[Message] {
        let from = self.flushed;
        self.flushed = self.history.len();
        // Only the run's own messages are ever committed (`flushed` starts
        // at the end of the transcript).
        self.history.after_prefix(from).unwrap_or_default()
    }

    /// Messages committed to history and not yet recorded, without handing
    /// them out: the runner records them, then calls
    /// [`Machine::mark_recorded`]. One that cannot be recorded is dropped
    /// by [`Machine::abort`], so the run's report never holds a message the
    /// transcript lacks.
    pub fn unrecorded(&self) -> &[Message] {
        self.history.after_prefix(self.flushed).unwrap_or_default()
    }

    /// What [`Machine::unrecorded`] returned is now in the store.
    pub fn mark_recorded(&mut self) {
        self.flushed = self.history.len();
    }

    /// The first step. `Started` is the run's first event, before any hook
    /// decided anything.
    pub fn start(&mut self) -> Step {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Start(input) => {
                self.events.push_back(RunEvent::Started);
                self.state = State::AwaitRunStart(input.clone());
                Step::RunStart(input)
            }
            other => panic!("start called twice (state {other:?})"),
        }
    }

    /// Feeds the result of the current step; returns the next one.
    pub fn feed(&mut self, feed: Feed) -> Step {
        let state = std::mem::replace(&mut self.state, State::Done);
        match (state, feed) {
            (State::AwaitRunStart(received), Feed::RunStart(r)) => match r {
                Ok(input) => {
                    self.events.push_back(RunEvent::InputCommitted {
                        rewritten: input != received,
                        input: input.clone(),
                    });
                    self.history.push(Message::user(input));
                    self.next_turn()
                }
                Err(stop) => self.stop(stop),
            },
            (State::AwaitModelRequest, Feed::ModelRequest(r)) => match r {
                Ok(RequestDecision::Call(req)) => {
                    self.state = State::AwaitModel;
                    Step::CallModel(req)
                }
                Ok(RequestDecision::Respond(resp)) => {
                    self.state = State::AwaitModelResponse;
                    Step::ModelResponse(resp)
                }
                Err(stop) => self.stop(stop),
            },
            (State::AwaitModel, Feed::Model(r)) => match r {
                Ok(resp) => {
                    self.usage.add(resp.usage);
                    self.state = State::AwaitModelResponse;
                    Step::ModelResponse(resp)
                }
                Err(stop) => self.stop(stop),
            },
            (State::AwaitModelResponse, Feed::ModelResponse(r)) => match r {
                Ok(ResponseDecision::Accept(resp)) => {
                    let message = resp.message();
                    self.finish_reason = resp.finish_reason.clone();
                    let shown = RunEvent::AssistantMessage {
                        turn: self.turn,
                        message: message.clone(),
                        finish_reason: resp.finish_reason.clone(),
                        usage: resp.usage,
                    };
                    let calls: Vec<_> = message.tool_calls().cloned().collect();
                    if calls.is_empty() && self.review_final {
                        self.pending_answer = Some(shown);
                    } else {
                        self.events.push_back(shown);
                    }
                    if calls.is_empty() {
                        self.state = State::AwaitTurnEnd(message.clone());
                        Step::TurnEnd(message)
                    } else {
                        for (i, c) in calls.into_iter().enumerate() {
                            self.events.push_back(RunEvent::ToolCallRequested {
                                turn: self.turn,
                                index: i as u32,
                                call: c,
                            });
                        }
                        self.state = State::AwaitBatch(message.clone());
                        Step::ToolBatch(message)
                    }
                }
                Ok(ResponseDecision::Retry(feedback)) => {
                    self.history.push(Message::user(feedback));
                    self.next_turn()
                }
                Err(stop) => self.stop(stop),
            },
            (State::AwaitBatch(message), Feed::ToolBatch(r)) => match r {
                Ok(BatchDecision::Settled(results)) => {
                    // The assistant turn and its results commit together, in
                    // call order, only now that the whole batch settled.
                    for (i, r) in results.iter().enumerate() {
                        self.events.push_back(RunEvent::ToolResult {
                            turn: self.turn,
                            index: i as u32,
                            result: r.clone(),
                        });
                    }
                    self.history.push(message);
                    self.history.push(Message::tool_results(results));
                    self.next_turn()
                }
                Ok(BatchDecision::Retry(feedback)) => {
                    self.history.push(Message::user(feedback));
                    self.next_turn()
                }
                Err(stop) => self.stop(stop),
            },
            (State::AwaitTurnEnd(message), Feed::TurnEnd(r)) => match r {
                // turn_end accepted the answer: now the client sees it.
                Ok(_) if self.pending_answer.is_some() => {
                    self.events.extend(self.pending_answer.take());
                    self.state = State::AwaitTurnEnd(message);
                    self.feed(Feed::TurnEnd(r))
                }
                Ok(EndDecision::Finish) => {
                    let final_text = message.text();
                    self.history.push(message);
                    self.finish(RunOutcome::Completed, String::new(), final_text)
                }
                Ok(EndDecision::ContinueRun(msg)) => {
                    self.history.push(message);
                    self.history.push(Message::user(msg));
                    self.next_turn()
                }
                Err(stop) => self.stop(stop),
            },
            (state, _) => panic!("feed does not match the pending step (state {state:?})"),
        }
    }

    /// Ends the run from whatever step is pending (e.g. a hook's protocol
    /// violation detected between steps, or a write the store refused):
    /// that step's work is discarded as if it had returned `stop`, and
    /// nothing committed after the last [`Machine::take_committed`] or
    /// [`Machine::mark_recorded`] is kept (it could not be recorded).
    pub fn abort(&mut self, stop: Stop) -> Step {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Done => self.finish(
                RunOutcome::Failed,
                "internal error: run aborted after it ended".into(),
                String::new(),
            ),
            _ => {
                self.history.truncate(self.flushed);
                // Nor does the client hear of it (the results of a batch
                // whose commit was refused, a turn after it). A turn whose
                // start goes unheard never began: the report counts the
                // turns the client saw begin.
                let current = self.turn;
                if self
                    .events
                    .iter()
                    .any(|e| matches!(e, RunEvent::TurnStarted { turn } if *turn == current))
                {
                    self.turn -= 1;
                }
                self.events.clear();
                self.stop(stop)
            }
        }
    }

    fn next_turn(&mut self) -> Step {
        if self.turn >= self.max_turns {
            return self.finish(
                RunOutcome::MaxTurns,
                format!("reached max_turns ({})", self.max_turns),
                String::new(),
            );
        }
        self.turn += 1;
        self.events
            .push_back(RunEvent::TurnStarted { turn: self.turn });
        self.state = State::AwaitModelRequest;
        Step::ModelRequest(self.baseline())
    }

    /// The request before hooks: agent template plus the run's history (the
    /// transcript shared, only the run's own messages copied).
    fn baseline(&self) -> ModelRequest {
        let t = &self.template;
        ModelRequest {
            model: t.model.clone(),
            system_prompt: t.system_prompt.clone(),
            extra_context: t.context.clone(),
            history: self.history.clone(),
            tools: t.tools.clone(),
            temperature: t.temperature,
            max_tokens: t.max_tokens,
            tool_choice: ToolChoice::Auto,
            additional_params: Default::default(),
        }
    }

    fn stop(&mut self, stop: Stop) -> Step {
        match stop {
            Stop::Terminate {
                hook,
                reason,
                reply,
            } => {
                let final_text = reply.clone().unwrap_or_default();
                if let Some(reply) = reply {
                    self.history.push(Message::assistant_text(reply));
                }
                self.finish(
                    RunOutcome::Terminated,
                    format!("terminated by hook `{hook}`: {reason}"),
                    final_text,
                )
            }
            Stop::HookFailed(f) => {
                self.finish(RunOutcome::HookFailed, f.to_string(), String::new())
            }
            Stop::Failed(r) => self.finish(RunOutcome::Failed, r, String::new()),
            Stop::ModelFailed(r) => self.finish(RunOutcome::ModelFailed, r, String::new()),
            Stop::Cancelled(r) => self.finish(RunOutcome::Cancelled, r, String::new()),
            Stop::TimedOut => self.finish(
                RunOutcome::TimedOut,
                "run exceeded its run_timeout".into(),
                String::new(),
            ),
            Stop::Interrupted(r) => self.finish(RunOutcome::Interrupted, r, String::new()),
        }
    }

    fn finish(&mut self, outcome: RunOutcome, reason: String, final_text: String) -> Step {
        self.state = State::Done;
        Step::Finish(Ending {
            outcome,
            reason,
            final_text,
            messages: self
                .history
                .after_prefix(self.run_from)
                .unwrap_or_default()
                .to_vec(),
            usage: self.usage,
            turns: self.turn,
            finish_reason: self.finish_reason.clone(),
        })
    }

    /// Whether the message holds tool calls (helper for runners).
    pub fn has_tool_calls(message: &Message) -> bool {
        message
            .blocks
            .iter()
            .any(|b| matches!(b, Block::ToolCall(_)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Role, ToolCall};

    fn machine(max_turns: u32) -> Machine {
        Machine::new(
            RequestTemplate {
                model: "m".into(),
                system_prompt: "sys".into(),
                ..Default::default()
            },
            max_turns,
            Arc::new(vec![
                Message::user("old"),
                Message::assistant_text("old answer"),
            ]),
            "hi".into(),
        )
    }

    fn text_response(t: &str) -> ModelResponse {
        ModelResponse {
            message: Some(Message::assistant_text(t)),
            finish_reason: "stop".into(),
            usage: Usage {
                input_tokens: 3,
                output_tokens: 2,
                estimated: false,
            },
            model: "m".into(),
            ..Default::default()
        }
    }

    fn call_response() -> ModelResponse {
        ModelResponse {
            message: Some(Message {
                role: Role::Assistant,
                blocks: vec![
                    Block::ToolCall(ToolCall {
                        id: "a".into(),
                        name: "t".into(),
                        arguments_json: "{}".into(),
                    }),
                    Block::ToolCall(ToolCall {
                        id: "b".into(),
                        name: "t".into(),
                        arguments_json: "{}".into(),
                    }),
                ],
            }),
            finish_reason: "tool_calls".into(),
            ..Default::default()
        }
    }

    fn result(id: &str) -> ToolResult {
        ToolResult {
            call_id: id.into(),
            name: "t".into(),
            content: format!("r{id}"),
            is_error: false,
        }
    }

    /// A run up to its first tool batch, driven as the runner does: the
    /// input recorded after its step, the events heard before the next.
    fn at_tool_batch() -> Machine {
        let mut m = machine(4);
        m.start();
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        assert_eq!(m.take_committed(), &[Message::user("hi")]);
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(call_response()))) else {
            panic!()
        };
        let Step::ToolBatch(_) = m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))))
        else {
            panic!()
        };
        m.drain_events().for_each(drop);
        m
    }

    fn finish(step: Step) -> Ending {
        match step {
            Step::Finish(e) => e,
            other => panic!("expected finish, got {other:?}"),
        }
    }

    #[test]
    fn simple_run_commits_input_and_answer() {
        let mut m = machine(4);
        assert_eq!(m.start(), Step::RunStart("hi".into()));
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi!".into()))) else {
            panic!()
        };
        assert_eq!(base.history.len(), 3, "transcript + rewritten input");
        assert_eq!(base.history[2], Message::user("hi!"));
        let Step::CallModel(_) = m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base)))) else {
            panic!()
        };
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(text_response("yo")))) else {
            panic!()
        };
        let Step::TurnEnd(msg) = m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))))
        else {
            panic!()
        };
        let e = finish(m.feed(Feed::TurnEnd(Ok(EndDecision::Finish))));
        assert_eq!(e.outcome, RunOutcome::Completed);
        assert_eq!(e.final_text, "yo");
        assert_eq!(e.messages, vec![Message::user("hi!"), msg]);
        assert_eq!(e.usage.output_tokens, 2);
        assert_eq!(e.turns, 1);
    }

    #[test]
    fn every_request_shares_the_transcript_instead_of_copying_it() {
        let transcript = Arc::new(vec![
            Message::user("old"),
            Message::assistant_text("old answer"),
        ]);
        let mut m = Machine::new(
            RequestTemplate::default(),
            4,
            transcript.clone(),
            "hi".into(),
        );
        m.start();
        let Step::ModelRequest(first) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(first.clone()))));
        m.feed(Feed::Model(Ok(text_response("bad"))));
        let Step::ModelRequest(second) = m.feed(Feed::ModelResponse(Ok(ResponseDecision::Retry(
            "again".into(),
        )))) else {
            panic!()
        };
        let shared = History::new(transcript.clone());
        assert!(first.history.shares_prefix_with(&shared));
        assert!(second.history.shares_prefix_with(&shared));
        assert_eq!(second.history.len(), 4, "old, old answer, hi, again");
        assert_eq!(
            transcript.len(),
            2,
            "the transcript itself is never changed"
        );
    }

    #[test]
    fn tool_turn_commits_message_and_results_in_call_order() {
        let mut m = machine(4);
        m.start();
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(call_response()))) else {
            panic!()
        };
        let Step::ToolBatch(msg) = m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))))
        else {
            panic!()
        };
        let evs: Vec<_> = m.drain_events().collect();
        assert!(evs
            .iter()
            .any(|e| matches!(e, RunEvent::ToolCallRequested { index: 1, .. })));
        let Step::ModelRequest(next) = m.feed(Feed::ToolBatch(Ok(BatchDecision::Settled(vec![
            result("a"),
            result("b"),
        ])))) else {
            panic!()
        };
        let n = next.history.len();
        assert_eq!(next.history[n - 2], msg);
        let ids: Vec<_> = next.history[n - 1]
            .tool_results_iter()
            .map(|r| r.call_id.as_str())
            .collect();
        assert_eq!(ids, ["a", "b"]);
    }

    #[test]
    fn failed_batch_commits_nothing_of_the_turn() {
        let mut m = machine(4);
        m.start();
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(call_response()))) else {
            panic!()
        };
        m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))));
        let e = finish(m.feed(Feed::ToolBatch(Err(Stop::Terminate {
            hook: "guard".into(),
            reason: "no".into(),
            reply: Some("Sorry, I can't do that.".into()),
        }))));
        assert_eq!(e.outcome, RunOutcome::Terminated);
        assert_eq!(e.final_text, "Sorry, I can't do that.");
        assert!(e.reason.contains("`guard`"));
        assert_eq!(
            e.messages,
            vec![
                Message::user("hi"),
                Message::assistant_text("Sorry, I can't do that.")
            ],
            "no dangling tool call is committed"
        );
    }

    #[test]
    fn retry_and_continue_run_are_bounded_by_max_turns() {
        let mut m = machine(2);
        m.start();
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        m.feed(Feed::Model(Ok(text_response("bad"))));
        let Step::ModelRequest(base) = m.feed(Feed::ModelResponse(Ok(ResponseDecision::Retry(
            "be nicer".into(),
        )))) else {
            panic!()
        };
        assert_eq!(base.history.last(), Some(&Message::user("be nicer")));
        assert!(
            !base.history.iter().any(|m| m.text() == "bad"),
            "the discarded turn is not committed"
        );
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(text_response("good")))) else {
            panic!()
        };
        m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))));
        let e = finish(m.feed(Feed::TurnEnd(Ok(EndDecision::ContinueRun("more".into())))));
        assert_eq!(e.outcome, RunOutcome::MaxTurns);
        assert_eq!(e.turns, 2);
    }

    #[test]
    fn respond_skips_the_model() {
        let mut m = machine(2);
        m.start();
        let Step::ModelRequest(_) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        let step = m.feed(Feed::ModelRequest(Ok(RequestDecision::Respond(
            text_response("canned"),
        ))));
        assert!(matches!(step, Step::ModelResponse(_)));
    }

    #[test]
    fn commits_are_handed_out_once_per_step_and_abort_keeps_only_recorded_ones() {
        let mut m = machine(4);
        m.start();
        assert!(
            m.take_committed().is_empty(),
            "the old transcript is not new"
        );
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        assert_eq!(m.take_committed(), &[Message::user("hi")]);
        assert!(m.take_committed().is_empty());
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(call_response()))) else {
            panic!()
        };
        let Step::ToolBatch(msg) = m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))))
        else {
            panic!()
        };
        assert!(
            m.take_committed().is_empty(),
            "a turn commits with its batch"
        );
        m.feed(Feed::ToolBatch(Ok(BatchDecision::Settled(vec![
            result("a"),
            result("b"),
        ]))));
        // The batch is committed in the machine but its recording failed.
        let e = finish(m.abort(Stop::Interrupted("lease lost".into())));
        assert_eq!(e.outcome, RunOutcome::Interrupted);
        assert_eq!(
            e.messages,
            vec![Message::user("hi")],
            "{msg:?} was never recorded"
        );
    }

    #[test]
    fn abort_ends_the_run_from_any_step_and_commits_nothing_of_the_turn() {
        let failure = || {
            Stop::HookFailed(HookFailure {
                hook: "guard".into(),
                event: EventKind::RunStart,
                fault: crate::hooks::failure::Fault::new(
                    crate::hooks::failure::FailureClass::Duplicate,
                    "second verdict for seq 1",
                ),
            })
        };
        // Before the tool batch: the assistant turn with its calls is not
        // committed (no call without its result).
        let m = &mut at_tool_batch();
        let e = finish(m.abort(failure()));
        assert_eq!(e.outcome, RunOutcome::HookFailed);
        assert!(
            e.reason.contains("failed on run_start: duplicate"),
            "{}",
            e.reason
        );
        assert_eq!(e.messages, vec![Message::user("hi")]);
        assert_eq!(e.turns, 1);
        // A settled batch whose commit is refused: the next turn, begun
        // and unheard, is not counted.
        let m = &mut at_tool_batch();
        let settled = BatchDecision::Settled(vec![result("a"), result("b")]);
        let Step::ModelRequest(_) = m.feed(Feed::ToolBatch(Ok(settled))) else {
            panic!()
        };
        assert_eq!(m.turn(), 2);
        let e = finish(m.abort(Stop::Failed("transcript full".into())));
        assert_eq!(e.turns, 1, "the second turn's start was never heard");
        assert_eq!(e.messages, vec![Message::user("hi")]);
        assert_eq!(m.drain_events().count(), 0);
        // Before run_start's result is fed: the input is not committed.
        let mut m = machine(4);
        m.start();
        let e = finish(m.abort(failure()));
        assert!(e.messages.is_empty());
        assert_eq!(e.turns, 0);
        // After the end: nothing to abort, and it says so.
        let e = finish(m.abort(failure()));
        assert_eq!(e.outcome, RunOutcome::Failed);
    }

    #[test]
    fn a_reviewed_final_answer_is_shown_only_once_turn_end_accepted_it() {
        let answer_shown = |m: &mut Machine| {
            m.drain_events()
                .any(|e| matches!(e, RunEvent::AssistantMessage { .. }))
        };
        for accepted in [true, false] {
            let mut m = machine(4);
            m.review_final_answers(true);
            m.start();
            let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
                panic!()
            };
            m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
            let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(text_response("yo")))) else {
                panic!()
            };
            let Step::TurnEnd(_) = m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))))
            else {
                panic!()
            };
            assert!(!answer_shown(&mut m), "not before turn_end decided");
            let end = if accepted {
                Ok(EndDecision::Finish)
            } else {
                Err(Stop::Terminate {
                    hook: "h".into(),
                    reason: "no".into(),
                    reply: None,
                })
            };
            let e = finish(m.feed(Feed::TurnEnd(end)));
            assert_eq!(answer_shown(&mut m), accepted);
            assert_eq!(e.final_text, if accepted { "yo" } else { "" });
        }
        // Tool-call turns are not final answers: shown at once.
        let mut m = machine(4);
        m.review_final_answers(true);
        m.start();
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(call_response()))) else {
            panic!()
        };
        m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))));
        assert!(answer_shown(&mut m));
    }

    #[test]
    fn started_comes_first_and_the_committed_input_after_run_start() {
        let mut m = machine(2);
        m.start();
        let first: Vec<_> = m.drain_events().collect();
        assert_eq!(first, vec![RunEvent::Started], "before any hook ran");
        m.feed(Feed::RunStart(Ok("hi [masked]".into())));
        let next: Vec<_> = m.drain_events().collect();
        assert_eq!(
            next[0],
            RunEvent::InputCommitted {
                input: "hi [masked]".into(),
                rewritten: true
            }
        );
        let mut m = machine(2);
        m.start();
        m.feed(Feed::RunStart(Ok("hi".into())));
        assert!(m.drain_events().any(|e| e
            == RunEvent::InputCommitted {
                input: "hi".into(),
                rewritten: false
            }));
    }

    #[test]
    fn the_last_accepted_turn_gives_the_finish_reason() {
        let mut m = machine(2);
        m.start();
        let Step::ModelRequest(base) = m.feed(Feed::RunStart(Ok("hi".into()))) else {
            panic!()
        };
        m.feed(Feed::ModelRequest(Ok(RequestDecision::Call(base))));
        let mut cut = text_response("half an ans");
        cut.finish_reason = "length".into();
        let Step::ModelResponse(r) = m.feed(Feed::Model(Ok(cut))) else {
            panic!()
        };
        m.feed(Feed::ModelResponse(Ok(ResponseDecision::Accept(r))));
        let e = finish(m.feed(Feed::TurnEnd(Ok(EndDecision::Finish))));
        assert_eq!(e.outcome, RunOutcome::Completed);
        assert_eq!(e.finish_reason, "length");
    }

    #[test]
    fn run_start_terminate_commits_only_the_reply() {
        let mut m = machine(2);
        m.start();
        let e = finish(m.feed(Feed::RunStart(Err(Stop::Terminate {
            hook: "h".into(),
            reason: "blocked".into(),
            reply: None,
        }))));
        assert_eq!(e.outcome, RunOutcome::Terminated);
        assert!(e.messages.is_empty(), "rejected input never enters history");
        assert_eq!(e.turns, 0);
    }
}
