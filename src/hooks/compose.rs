//! Composition rules, free of IO: hook order, chain threading, and the merge
//! of concurrent `model_request` patches. The dispatcher calls hooks; this
//! module decides what their verdicts mean together.

use crate::event::EventKind;
use crate::hooks::provenance::{Conflict, VerdictRecord};
use crate::hooks::verdict::*;
use crate::message::{Block, Message, ToolCall, ToolResult};
use crate::model::{ModelRequest, ModelResponse, ToolChoice};

/// A hook as far as ordering is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ranked {
    pub name: String,
    pub priority: i32,
}

/// Firing order: agent hooks, then session extras; within each group by
/// descending priority, ties keeping listed order. A hook listed in both
/// groups fires once, with the agent group.
pub fn firing_order(agent: &[Ranked], session: &[Ranked]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for group in [agent, session] {
        let mut g: Vec<&Ranked> = group.iter().collect();
        // Stable sort keeps listed order for equal priorities.
        g.sort_by_key(|r| std::cmp::Reverse(r.priority));
        for r in g {
            if !out.contains(&r.name) {
                out.push(r.name.clone());
            }
        }
    }
    out
}

/// What one verdict did to a chain.
#[derive(Debug, PartialEq)]
pub enum Step<S> {
    Continue { changed: Vec<&'static str> },
    Stop(S),
}

/// A chain-composed event: each hook sees the payload as rewritten by the
/// hooks before it; a terminal verdict stops the chain.
pub trait ChainEvent {
    const KIND: EventKind;
    type Payload: Clone + Send + Sync + 'static;
    type Stop: Send + 'static;
    /// Applies a verdict; `Err` names the event a wrong-kind verdict was for.
    fn apply(payload: &mut Self::Payload, action: Action) -> Result<Step<Self::Stop>, EventKind>;
}

pub struct SessionStartChain;
impl ChainEvent for SessionStartChain {
    const KIND: EventKind = EventKind::SessionStart;
    type Payload = ();
    type Stop = Terminate;
    fn apply(_: &mut (), action: Action) -> Result<Step<Terminate>, EventKind> {
        match action {
            Action::SessionStart(SessionStartAction::Continue) => Ok(unchanged()),
            Action::SessionStart(SessionStartAction::Terminate(t)) => Ok(Step::Stop(t)),
            other => Err(other.event()),
        }
    }
}

pub struct RunStartChain;
impl ChainEvent for RunStartChain {
    const KIND: EventKind = EventKind::RunStart;
    type Payload = String;
    type Stop = Terminate;
    fn apply(input: &mut String, action: Action) -> Result<Step<Terminate>, EventKind> {
        match action {
            Action::RunStart(RunStartAction::Continue) => Ok(unchanged()),
            Action::RunStart(RunStartAction::RewriteInput(new)) if new == *input => Ok(unchanged()),
            Action::RunStart(RunStartAction::RewriteInput(new)) => {
                *input = new;
                Ok(changed(&["input"]))
            }
            Action::RunStart(RunStartAction::Terminate(t)) => Ok(Step::Stop(t)),
            other => Err(other.event()),
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum ResponseStop {
    Retry(String),
    Terminate(Terminate),
}

pub struct ModelResponseChain;
impl ChainEvent for ModelResponseChain {
    const KIND: EventKind = EventKind::ModelResponse;
    type Payload = ModelResponse;
    type Stop = ResponseStop;
    fn apply(resp: &mut ModelResponse, action: Action) -> Result<Step<ResponseStop>, EventKind> {
        match action {
            Action::ModelResponse(ModelResponseAction::Continue) => Ok(unchanged()),
            Action::ModelResponse(ModelResponseAction::Rewrite(blocks))
                if resp.message().blocks == blocks =>
            {
                Ok(unchanged())
            }
            Action::ModelResponse(ModelResponseAction::Rewrite(blocks)) => {
                resp.message = Some(Message {
                    role: crate::message::Role::Assistant,
                    blocks,
                });
                Ok(changed(&["message"]))
            }
            Action::ModelResponse(ModelResponseAction::Retry(f)) => {
                Ok(Step::Stop(ResponseStop::Retry(f)))
            }
            Action::ModelResponse(ModelResponseAction::Terminate(t)) => {
                Ok(Step::Stop(ResponseStop::Terminate(t)))
            }
            other => Err(other.event()),
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum InvalidCallStop {
    Retry(String),
    Skip(Skip),
    Terminate(Terminate),
}

pub struct InvalidToolCallChain;
impl ChainEvent for InvalidToolCallChain {
    const KIND: EventKind = EventKind::InvalidToolCall;
    type Payload = ToolCall;
    type Stop = InvalidCallStop;
    fn apply(_: &mut ToolCall, action: Action) -> Result<Step<InvalidCallStop>, EventKind> {
        match action {
            Action::InvalidToolCall(InvalidToolCallAction::Continue) => Ok(unchanged()),
            Action::InvalidToolCall(InvalidToolCallAction::Retry(f)) => {
                Ok(Step::Stop(InvalidCallStop::Retry(f)))
            }
            Action::InvalidToolCall(InvalidToolCallAction::Skip(s)) => {
                Ok(Step::Stop(InvalidCallStop::Skip(s)))
            }
            Action::InvalidToolCall(InvalidToolCallAction::Terminate(t)) => {
                Ok(Step::Stop(InvalidCallStop::Terminate(t)))
            }
            other => Err(other.event()),
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum ToolCallStop {
    Skip(Skip),
    Ask(Ask),
    Terminate(Terminate),
}

pub struct ToolCallChain;
impl ChainEvent for ToolCallChain {
    const KIND: EventKind = EventKind::ToolCall;
    type Payload = ToolCall;
    type Stop = ToolCallStop;
    fn apply(call: &mut ToolCall, action: Action) -> Result<Step<ToolCallStop>, EventKind> {
        match action {
            Action::ToolCall(ToolCallAction::Continue) => Ok(unchanged()),
            Action::ToolCall(ToolCallAction::RewriteArgs(args)) => {
                let same = same_json(&call.arguments_json, &args);
                call.arguments_json = args;
                Ok(if same {
                    unchanged()
                } else {
                    changed(&["arguments"])
                })
            }
            Action::ToolCall(ToolCallAction::Skip(s)) => Ok(Step::Stop(ToolCallStop::Skip(s))),
            Action::ToolCall(ToolCallAction::Ask(a)) => Ok(Step::Stop(ToolCallStop::Ask(a))),
            Action::ToolCall(ToolCallAction::Terminate(t)) => {
                Ok(Step::Stop(ToolCallStop::Terminate(t)))
            }
            other => Err(other.event()),
        }
    }
}

pub struct ToolResultChain;
impl ChainEvent for ToolResultChain {
    const KIND: EventKind = EventKind::ToolResult;
    type Payload = ToolResult;
    type Stop = Terminate;
    fn apply(result: &mut ToolResult, action: Action) -> Result<Step<Terminate>, EventKind> {
        match action {
            Action::ToolResult(ToolResultAction::Continue) => Ok(unchanged()),
            Action::ToolResult(ToolResultAction::Rewrite { content, is_error }) => {
                let mut fields = Vec::new();
                if result.content != content {
                    result.content = content;
                    fields.push("content");
                }
                if let Some(e) = is_error.filter(|e| *e != result.is_error) {
                    result.is_error = e;
                    fields.push("is_error");
                }
                Ok(changed(&fields))
            }
            Action::ToolResult(ToolResultAction::Terminate(t)) => Ok(Step::Stop(t)),
            other => Err(other.event()),
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum TurnEndStop {
    ContinueRun(String),
    Terminate(Terminate),
}

pub struct TurnEndChain;
impl ChainEvent for TurnEndChain {
    const KIND: EventKind = EventKind::TurnEnd;
    type Payload = Message;
    type Stop = TurnEndStop;
    fn apply(_: &mut Message, action: Action) -> Result<Step<TurnEndStop>, EventKind> {
        match action {
            Action::TurnEnd(TurnEndAction::Continue) => Ok(unchanged()),
            Action::TurnEnd(TurnEndAction::ContinueRun(m)) => {
                Ok(Step::Stop(TurnEndStop::ContinueRun(m)))
            }
            Action::TurnEnd(TurnEndAction::Terminate(t)) => {
                Ok(Step::Stop(TurnEndStop::Terminate(t)))
            }
            other => Err(other.event()),
        }
    }
}

/// Arguments that parse to the same JSON value are the same arguments,
/// whatever their spacing or key order.
fn same_json(a: &str, b: &str) -> bool {
    match (
        serde_json::from_str::<serde_json::Value>(a),
        serde_json::from_str::<serde_json::Value>(b),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

fn unchanged<S>() -> Step<S> {
    Step::Continue { changed: vec![] }
}

fn changed<S>(fields: &[&'static str]) -> Step<S> {
    Step::Continue {
        changed: fields.to_vec(),
    }
}

// ------------------------------------------------------------------ merge

/// The combined answer of all `model_request` hooks.
#[derive(Debug, PartialEq)]
pub enum Merged {
    /// The first terminate in firing order (any terminate wins).
    Terminate { hook: String, terminate: Terminate },
    /// The first respond in firing order (when nobody terminated).
    Respond {
        hook: String,
        response: ModelResponse,
    },
    /// The effective request after merging every patch.
    Request {
        request: ModelRequest,
        records: Vec<VerdictRecord>,
        /// Each tool the patches' `active_tools` took out of the request,
        /// with the hook that took it out (the first in firing order whose
        /// list left it out), so a `tool_choice` it breaks is blamed on
        /// that hook ([`validate_effective`]).
        removed: Vec<Removed>,
    },
}

/// A tool a hook's `active_tools` took out of the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removed {
    pub tool: String,
    pub hook: String,
}

/// `additional_params` keys a patch may not set: what a typed patch field
/// sets (`temperature`, `max_tokens`, the tools `active_tools` leaves and their legacy
/// `functions` form, `tool_choice` and `function_call`, the `messages` built
/// from the prompt, context and history), and what hookwire owns (`model`,
/// `stream`). Merged last into the provider's body, such a key would beat
/// the typed field: a lower-priority hook's value would win with no
/// conflict recorded, skip the field's checks (the temperature range, the
/// tool choice against the active tools) and could offer tools
/// `active_tools` removed.
///
/// `max_completion_tokens` is not among them: the provider sends the typed
/// field as `max_tokens`, and models that accept only the newer name get
/// their limit this way (with `max_tokens` left unset).
pub const RESERVED_PARAMS: [&str; 9] = [
    "temperature",
    "max_tokens",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "messages",
    "model",
    "stream",
];

/// Why a patch does not fit the request it patches.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct PatchRefused {
    /// The patch's field at fault: what may be logged.
    pub field: &'static str,
    /// The whole story, quoting what the hook sent (a tool name, a call
    /// id): for the run's own client and debug logs only.
    pub detail: String,
}

fn refused(field: &'static str, detail: String) -> Result<(), PatchRefused> {
    Err(PatchRefused { field, detail })
}

/// Checks a patch against the request it patches, before merging. An
/// invalid patch is an invalid verdict (a hook failure), not a merge input.
pub fn validate_patch(baseline: &ModelRequest, patch: &RequestPatch) -> Result<(), PatchRefused> {
    if let Some(key) = patch
        .additional_params
        .iter()
        .flat_map(|p| p.keys())
        .find(|k| RESERVED_PARAMS.contains(&k.as_str()))
    {
        return refused(
            "additional_params",
            format!(
                "additional_params `{key}` is not a provider parameter a patch may set (use the patch's own field, if it has one; reserved: {})",
                RESERVED_PARAMS.join(", ")
            ),
        );
    }
    // A zero limit leaves the model no room for any answer (providers
    // reject it, or answer nothing with finish reason `length`).
    if patch.max_tokens == Some(0) {
        return refused("max_tokens", "max_tokens must be at least 1".into());
    }
    if let Some(names) = &patch.active_tools {
        for n in names {
            if !baseline.tools.iter().any(|t| &t.name == n) {
                return refused(
                    "active_tools",
                    format!(
                        "active_tools names `{n}`, which is not offered for this call (offered: {})",
                        baseline
                            .tools
                            .iter()
                            .map(|t| t.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
            }
        }
    }
    if let Some(t) = patch.temperature {
        if !(0.0..=2.0).contains(&t) || t.is_nan() {
            return refused(
                "temperature",
                format!("temperature {t} is outside 0.0..=2.0"),
            );
        }
    }
    if let Some(history) = &patch.history {
        // Only what the hook changed is judged: the request's own history
        // may hold a model's malformed call, and sending it back as it came
        // is no fault of the hook's.
        let ours: std::collections::HashSet<(&str, &str, &str)> = baseline
            .history
            .iter()
            .flat_map(Message::tool_calls)
            .map(|c| (c.id.as_str(), c.name.as_str(), c.arguments_json.as_str()))
            .collect();
        for c in history.iter().flat_map(Message::tool_calls) {
            if ours.contains(&(c.id.as_str(), c.name.as_str(), c.arguments_json.as_str())) {
                continue;
            }
            if let Err(e) = serde_json::from_str::<serde_json::Value>(&c.arguments_json) {
                return refused(
                    "history",
                    format!(
                        "history: tool call `{}` ({}) the hook added or changed has arguments_json that is not valid JSON: {e}",
                        c.id, c.name
                    ),
                );
            }
        }
    }
    Ok(())
}

/// Merges verdicts given in firing order. Precedence: any terminate, then
/// the first respond, then patches merged field by field.
pub fn merge(baseline: &ModelRequest, verdicts: Vec<(String, ModelRequestAction)>) -> Merged {
    if let Some((hook, t)) = verdicts.iter().find_map(|(h, a)| match a {
        ModelRequestAction::Terminate(t) => Some((h.clone(), t.clone())),
        _ => None,
    }) {
        return Merged::Terminate { hook, terminate: t };
    }
    if let Some((hook, r)) = verdicts.iter().find_map(|(h, a)| match a {
        ModelRequestAction::Respond(r) => Some((h.clone(), r.clone())),
        _ => None,
    }) {
        let mut blocks = Vec::new();
        if !r.text.is_empty() {
            blocks.push(Block::Text { text: r.text });
        }
        blocks.extend(r.tool_calls.into_iter().map(Block::ToolCall));
        let finish = if blocks.iter().any(|b| matches!(b, Block::ToolCall(_))) {
            "tool_calls"
        } else {
            "stop"
        };
        return Merged::Respond {
            hook: hook.clone(),
            response: ModelResponse {
                message: Some(Message {
                    role: crate::message::Role::Assistant,
                    blocks,
                }),
                finish_reason: finish.into(),
                usage: Default::default(),
                model: format!("hook:{hook}"),
                id: String::new(),
            },
        };
    }

    let mut req = baseline.clone();
    let mut records = Vec::new();
    let mut removed = Vec::new();
    // field -> hook that set it first
    let mut owners: Vec<(&'static str, String)> = Vec::new();
    let mut param_owners: Vec<(String, String)> = Vec::new();

    for (hook, action) in verdicts {
        let mut rec = VerdictRecord::new(&hook, EventKind::ModelRequest, VerdictKind::Continue, "");
        if let ModelRequestAction::Patch(p) = action {
            rec.verdict = VerdictKind::PatchRequest;
            // A field set to the value it already has is claimed (a later
            // writer still conflicts) but not reported as changed.
            let claim = |field: &'static str,
                         same: bool,
                         rec: &mut VerdictRecord,
                         owners: &mut Vec<(&'static str, String)>|
             -> bool {
                if let Some((_, winner)) = owners.iter().find(|(f, _)| *f == field) {
                    rec.conflicts.push(Conflict {
                        field: field.into(),
                        winner: winner.clone(),
                        loser: hook.clone(),
                    });
                    false
                } else {
                    owners.push((field, hook.clone()));
                    if !same {
                        rec.fields_changed.push(field.into());
                    }
                    true
                }
            };
            if !p.extra_context.is_empty() {
                req.extra_context.extend(p.extra_context);
                rec.fields_changed.push("extra_context".into());
            }
            if let Some(v) = p.system_prompt {
                let same = v == req.system_prompt;
                if claim("system_prompt", same, &mut rec, &mut owners) {
                    req.system_prompt = v;
                }
            }
            if let Some(v) = p.temperature {
                let same = req.temperature == Some(v);
                if claim("temperature", same, &mut rec, &mut owners) {
                    req.temperature = Some(v);
                }
            }
            if let Some(v) = p.max_tokens {
                let same = req.max_tokens == Some(v);
                if claim("max_tokens", same, &mut rec, &mut owners) {
                    req.max_tokens = Some(v);
                }
            }
            if let Some(v) = p.tool_choice {
                let same = v == req.tool_choice;
                if claim("tool_choice", same, &mut rec, &mut owners) {
                    req.tool_choice = v;
                }
            }
            if let Some(v) = p.history {
                let same = v == req.history;
                if claim("history", same, &mut rec, &mut owners) {
                    req.history = v.into();
                }
            }
            if let Some(names) = p.active_tools {
                let before = req.tools.len();
                req.tools.retain(|t| {
                    let keep = names.contains(&t.name);
                    if !keep {
                        removed.push(Removed {
                            tool: t.name.clone(),
                            hook: hook.clone(),
                        });
                    }
                    keep
                });
                if req.tools.len() != before {
                    rec.fields_changed.push("active_tools".into());
                }
                owners.push(("active_tools", hook.clone()));
            }
            if let Some(params) = p.additional_params {
                let mut changed = false;
                for (k, v) in params {
                    if let Some((_, winner)) = param_owners.iter().find(|(key, _)| key == &k) {
                        rec.conflicts.push(Conflict {
                            field: format!("additional_params.{k}"),
                            winner: winner.clone(),
                            loser: hook.clone(),
                        });
                    } else {
                        param_owners.push((k.clone(), hook.clone()));
                        if req.additional_params.get(&k) != Some(&v) {
                            req.additional_params.insert(k, v);
                            changed = true;
                        }
                    }
                }
                if changed {
                    rec.fields_changed.push("additional_params".into());
                }
            }
        }
        records.push(rec);
    }
    Merged::Request {
        request: req,
        records,
        removed,
    }
}

/// Checks the merged request before the provider call. The error names the
/// hook(s) whose patch caused it: the one that set `tool_choice`, and the
/// ones whose `active_tools` took out what it needs (`removed`, from
/// [`merge`]). Any hook that narrowed is not enough: one may have kept the
/// named tool that a later one left out.
pub fn validate_effective(
    request: &ModelRequest,
    records: &[VerdictRecord],
    removed: &[Removed],
) -> Result<(), String> {
    let chooser = match records
        .iter()
        .find(|r| r.fields_changed.iter().any(|f| f == "tool_choice"))
    {
        Some(r) => format!("hook `{}`", r.hook),
        None => "the agent configuration".to_string(),
    };
    match &request.tool_choice {
        ToolChoice::Required if request.tools.is_empty() => {
            // Every hook that took a tool out, in firing order.
            let mut narrowers: Vec<String> = Vec::new();
            for r in removed {
                let h = format!("hook `{}`", r.hook);
                if !narrowers.contains(&h) {
                    narrowers.push(h);
                }
            }
            let narrowed = if narrowers.is_empty() {
                "the agent configuration offers none".to_string()
            } else {
                format!("narrowed by {}", narrowers.join(", "))
            };
            Err(format!(
                "tool_choice `required` (from {chooser}) but no tool is left in the effective tool set ({narrowed})"
            ))
        }
        ToolChoice::Tool(name) if !request.tools.iter().any(|t| &t.name == name) => {
            let why = match removed.iter().find(|r| &r.tool == name) {
                Some(r) => format!("left out by the active_tools of hook `{}`", r.hook),
                None => "the agent configuration does not offer it".to_string(),
            };
            Err(format!(
                "tool_choice names tool `{name}` (from {chooser}) but it is not in the effective tool set ({why})"
            ))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::ToolSpec;
    use serde_json::json;

    fn r(name: &str, p: i32) -> Ranked {
        Ranked {
            name: name.into(),
            priority: p,
        }
    }

    #[test]
    fn order_by_priority_ties_keep_listed_order_agent_before_session() {
        let agent = [r("a", 0), r("b", 10), r("c", 0), r("d", 10)];
        let session = [r("s1", 100), r("s2", 0), r("a", 50)];
        assert_eq!(
            firing_order(&agent, &session),
            ["b", "d", "a", "c", "s1", "s2"]
        );
    }

    #[test]
    fn chain_threads_rewrites_and_records_fields() {
        let mut input = "hello".to_string();
        let s = RunStartChain::apply(
            &mut input,
            Action::RunStart(RunStartAction::RewriteInput("hi".into())),
        )
        .unwrap();
        assert_eq!(
            s,
            Step::Continue {
                changed: vec!["input"]
            }
        );
        assert_eq!(input, "hi");
    }

    #[test]
    fn rewrites_that_change_nothing_report_no_field() {
        let none = Step::<()>::Continue { changed: vec![] };
        let mut input = "hello".to_string();
        let s = RunStartChain::apply(
            &mut input,
            Action::RunStart(RunStartAction::RewriteInput("hello".into())),
        )
        .unwrap();
        assert_eq!(format!("{s:?}"), format!("{none:?}"));

        let mut call = ToolCall {
            id: "c".into(),
            name: "t".into(),
            arguments_json: r#"{"a":1,"b":"x"}"#.into(),
        };
        let s = ToolCallChain::apply(
            &mut call,
            Action::ToolCall(ToolCallAction::RewriteArgs(
                r#"{ "b": "x", "a": 1 }"#.into(),
            )),
        )
        .unwrap();
        assert_eq!(s, Step::Continue { changed: vec![] }, "same JSON value");

        let mut result = ToolResult {
            call_id: "c".into(),
            name: "t".into(),
            content: "ok".into(),
            is_error: false,
        };
        let s = ToolResultChain::apply(
            &mut result,
            Action::ToolResult(ToolResultAction::Rewrite {
                content: "ok".into(),
                is_error: Some(true),
            }),
        )
        .unwrap();
        assert_eq!(
            s,
            Step::Continue {
                changed: vec!["is_error"]
            },
            "only the flag changed"
        );

        let mut resp = ModelResponse {
            message: Some(Message::assistant_text("hi")),
            ..Default::default()
        };
        let s = ModelResponseChain::apply(
            &mut resp,
            Action::ModelResponse(ModelResponseAction::Rewrite(vec![Block::Text {
                text: "hi".into(),
            }])),
        )
        .unwrap();
        assert!(matches!(s, Step::Continue { changed } if changed.is_empty()));
    }

    #[test]
    fn a_patch_setting_current_values_changes_nothing_but_still_claims() {
        let mut base = baseline();
        base.temperature = Some(0.2);
        let merged = merge(
            &base,
            vec![
                (
                    "same".into(),
                    patch(RequestPatch {
                        system_prompt: Some("base".into()),
                        temperature: Some(0.2),
                        ..Default::default()
                    }),
                ),
                (
                    "later".into(),
                    patch(RequestPatch {
                        temperature: Some(0.9),
                        ..Default::default()
                    }),
                ),
            ],
        );
        let Merged::Request {
            request, records, ..
        } = merged
        else {
            panic!()
        };
        assert!(records[0].fields_changed.is_empty(), "{records:?}");
        assert!(!records[0].is_notable());
        assert_eq!(
            request.temperature,
            Some(0.2),
            "the first writer still wins"
        );
        assert_eq!(records[1].conflicts[0].winner, "same");
    }

    #[test]
    fn wrong_kind_is_returned_not_ignored() {
        let mut input = String::new();
        let wrong = Action::ToolCall(ToolCallAction::Continue);
        assert_eq!(
            RunStartChain::apply(&mut input, wrong).unwrap_err(),
            EventKind::ToolCall
        );
        let mut call = ToolCall {
            id: "1".into(),
            name: "t".into(),
            arguments_json: "{}".into(),
        };
        assert!(
            ToolCallChain::apply(&mut call, Action::ToolResult(ToolResultAction::Continue))
                .is_err()
        );
    }

    #[test]
    fn terminal_verdicts_stop() {
        let mut call = ToolCall {
            id: "1".into(),
            name: "t".into(),
            arguments_json: "{}".into(),
        };
        let skip = Skip {
            result: "no".into(),
            is_error: true,
        };
        assert_eq!(
            ToolCallChain::apply(
                &mut call,
                Action::ToolCall(ToolCallAction::Skip(skip.clone()))
            )
            .unwrap(),
            Step::Stop(ToolCallStop::Skip(skip))
        );
        let mut res = ToolResult {
            call_id: "1".into(),
            name: "t".into(),
            content: "secret".into(),
            is_error: false,
        };
        let s = ToolResultChain::apply(
            &mut res,
            Action::ToolResult(ToolResultAction::Rewrite {
                content: "[redacted]".into(),
                is_error: None,
            }),
        )
        .unwrap();
        assert_eq!(
            s,
            Step::Continue {
                changed: vec!["content"]
            }
        );
        assert_eq!(res.content, "[redacted]");
        assert!(!res.is_error);
    }

    fn baseline() -> ModelRequest {
        ModelRequest {
            model: "m".into(),
            system_prompt: "base".into(),
            tools: ["a", "b", "c"]
                .iter()
                .map(|n| ToolSpec {
                    name: n.to_string(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    fn patch(p: RequestPatch) -> ModelRequestAction {
        ModelRequestAction::Patch(p)
    }

    #[test]
    fn merge_applies_each_field_rule() {
        let mut params1 = serde_json::Map::new();
        params1.insert("top_p".into(), json!(0.5));
        params1.insert("seed".into(), json!(1));
        let mut params2 = serde_json::Map::new();
        params2.insert("seed".into(), json!(2));
        params2.insert("user".into(), json!("u"));
        let merged = merge(
            &baseline(),
            vec![
                (
                    "h1".into(),
                    patch(RequestPatch {
                        extra_context: vec!["doc1".into()],
                        system_prompt: Some("from h1".into()),
                        active_tools: Some(vec!["a".into(), "b".into()]),
                        additional_params: Some(params1),
                        ..Default::default()
                    }),
                ),
                ("h2".into(), ModelRequestAction::Continue),
                (
                    "h3".into(),
                    patch(RequestPatch {
                        extra_context: vec!["doc3".into()],
                        system_prompt: Some("from h3".into()),
                        temperature: Some(0.2),
                        active_tools: Some(vec!["b".into(), "c".into()]),
                        additional_params: Some(params2),
                        history: Some(vec![Message::user("short")]),
                        ..Default::default()
                    }),
                ),
            ],
        );
        let Merged::Request {
            request,
            records,
            removed,
        } = merged
        else {
            panic!("expected a request")
        };
        assert_eq!(
            request.extra_context,
            ["doc1", "doc3"],
            "append in firing order"
        );
        assert_eq!(request.system_prompt, "from h1", "first writer wins");
        assert_eq!(request.temperature, Some(0.2));
        assert_eq!(
            request
                .tools
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            ["b"],
            "intersection"
        );
        let took: Vec<(&str, &str)> = removed
            .iter()
            .map(|r| (r.tool.as_str(), r.hook.as_str()))
            .collect();
        assert_eq!(took, [("c", "h1"), ("a", "h3")], "who took out which tool");
        assert_eq!(request.additional_params["seed"], json!(1));
        assert_eq!(request.additional_params["top_p"], json!(0.5));
        assert_eq!(request.additional_params["user"], json!("u"));
        assert_eq!(request.history, vec![Message::user("short")]);
        let h3 = &records[2];
        assert_eq!(h3.verdict, VerdictKind::PatchRequest);
        assert!(h3.conflicts.contains(&Conflict {
            field: "system_prompt".into(),
            winner: "h1".into(),
            loser: "h3".into()
        }));
        assert!(h3.conflicts.contains(&Conflict {
            field: "additional_params.seed".into(),
            winner: "h1".into(),
            loser: "h3".into()
        }));
        assert!(h3.fields_changed.contains(&"temperature".to_string()));
        assert!(!h3.fields_changed.contains(&"system_prompt".to_string()));
        assert_eq!(records[1].verdict, VerdictKind::Continue);
    }

    #[test]
    fn terminate_beats_respond_beats_patch() {
        let respond = ModelRequestAction::Respond(Respond {
            text: "canned".into(),
            tool_calls: vec![],
        });
        let term = |r: &str| {
            ModelRequestAction::Terminate(Terminate {
                reason: r.into(),
                reply: None,
            })
        };
        let m = merge(
            &baseline(),
            vec![
                ("p".into(), patch(RequestPatch::default())),
                ("r".into(), respond.clone()),
                ("t1".into(), term("first")),
                ("t2".into(), term("second")),
            ],
        );
        assert_eq!(
            m,
            Merged::Terminate {
                hook: "t1".into(),
                terminate: Terminate {
                    reason: "first".into(),
                    reply: None
                }
            }
        );
        let m = merge(
            &baseline(),
            vec![
                ("p".into(), patch(RequestPatch::default())),
                ("r".into(), respond),
            ],
        );
        match m {
            Merged::Respond { hook, response } => {
                assert_eq!(hook, "r");
                assert_eq!(response.message.unwrap().text(), "canned");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn invalid_patches_are_rejected_before_merge() {
        let p = RequestPatch {
            active_tools: Some(vec!["nope".into()]),
            ..Default::default()
        };
        let e = validate_patch(&baseline(), &p).unwrap_err();
        assert!(e.detail.contains("`nope`"), "{e}");
        assert_eq!(e.field, "active_tools");
    }

    #[test]
    fn additional_params_cannot_set_what_a_typed_field_or_hookwire_sets() {
        let with_param = |key: &str, value: serde_json::Value| RequestPatch {
            additional_params: Some([(key.to_string(), value)].into_iter().collect()),
            ..Default::default()
        };
        for (key, value) in [
            ("temperature", json!(1.9)),
            ("max_tokens", json!(100_000)),
            ("tools", json!([])),
            ("tool_choice", json!("required")),
            ("functions", json!([])),
            ("function_call", json!("auto")),
            ("model", json!("other")),
            ("messages", json!([])),
            ("stream", json!(false)),
        ] {
            let err = validate_patch(&baseline(), &with_param(key, value))
                .expect_err(key)
                .to_string();
            assert!(err.contains(&format!("additional_params `{key}`")), "{err}");
        }
        // Provider parameters the patch has no field for pass.
        for key in ["top_p", "seed", "response_format", "stream_options"] {
            assert_eq!(
                validate_patch(&baseline(), &with_param(key, json!(1))),
                Ok(()),
                "{key}"
            );
        }
    }

    #[test]
    fn max_tokens_must_allow_an_answer() {
        let p = |n| RequestPatch {
            max_tokens: Some(n),
            ..Default::default()
        };
        assert_eq!(
            validate_patch(&baseline(), &p(0)).unwrap_err().field,
            "max_tokens"
        );
        assert_eq!(validate_patch(&baseline(), &p(1)), Ok(()));
    }

    /// The effective request after `verdicts`, checked.
    fn effective(verdicts: Vec<(&str, RequestPatch)>) -> Result<(), String> {
        let merged = merge(
            &baseline(),
            verdicts
                .into_iter()
                .map(|(h, p)| (h.to_string(), patch(p)))
                .collect(),
        );
        let Merged::Request {
            request,
            records,
            removed,
        } = merged
        else {
            panic!("expected a request")
        };
        validate_effective(&request, &records, &removed)
    }

    fn choose(c: ToolChoice) -> RequestPatch {
        RequestPatch {
            tool_choice: Some(c),
            ..Default::default()
        }
    }

    fn keep(names: &[&str]) -> RequestPatch {
        RequestPatch {
            active_tools: Some(names.iter().map(|n| n.to_string()).collect()),
            ..Default::default()
        }
    }

    #[test]
    fn effective_request_validation_names_the_hook() {
        let err = effective(vec![
            ("chooser", choose(ToolChoice::Tool("a".into()))),
            ("narrower", keep(&["b"])),
        ])
        .unwrap_err();
        assert!(
            err.contains("hook `chooser`") && err.contains("hook `narrower`"),
            "{err}"
        );

        // Tools {a,b,c}: `keeper` (firing first) narrowed to [a,b] and kept
        // b; `dropper` left b out. The blame is `dropper`'s alone.
        let err = effective(vec![
            ("keeper", keep(&["a", "b"])),
            ("dropper", keep(&["a"])),
            ("chooser", choose(ToolChoice::Tool("b".into()))),
        ])
        .unwrap_err();
        assert!(
            err.contains("hook `chooser`") && err.contains("hook `dropper`"),
            "{err}"
        );
        assert!(!err.contains("keeper"), "{err}");

        // A tool nobody offered: no hook took it out.
        let err = effective(vec![("chooser", choose(ToolChoice::Tool("zz".into())))]).unwrap_err();
        assert!(
            err.contains("hook `chooser`") && err.contains("agent configuration does not offer"),
            "{err}"
        );

        let err = effective(vec![(
            "req",
            RequestPatch {
                tool_choice: Some(ToolChoice::Required),
                active_tools: Some(vec![]),
                ..Default::default()
            },
        )])
        .unwrap_err();
        assert!(err.contains("`req`"), "{err}");

        // `required` with no tool left: every hook that took one out is
        // named, in firing order, and none that took out nothing.
        let err = effective(vec![
            ("first", keep(&["a", "b"])),
            ("idle", keep(&["a", "b", "c"])),
            ("second", keep(&["c"])),
            ("req", choose(ToolChoice::Required)),
        ])
        .unwrap_err();
        assert!(
            err.contains("(from hook `req`)")
                && err.contains("narrowed by hook `first`, hook `second`"),
            "{err}"
        );
        assert!(!err.contains("idle"), "{err}");
    }
}
