//! One tool call from the model to its result: validation
//! (invalid_tool_call) before any call of the batch starts, then tool_call
//! hooks, approval, execution on the owning hook server, tool_result hooks,
//! each step only while the batch is not stopped.

use std::sync::Arc;

use tokio::time::Instant;

use crate::agent::batch::{BatchStop, CallOutcome};
use crate::agent::events::RunEvent;
use crate::agent::machine::Stop;
use crate::agent::runner::Run;
use crate::hooks::compose::{
    InvalidCallStop, InvalidToolCallChain, ToolCallChain, ToolCallStop, ToolResultChain,
};
use crate::hooks::failure::Fault;
use crate::hooks::payload::{CallProblem, Payload};
use crate::message::{ToolCall, ToolResult, ToolSpec};
use crate::telemetry::spans;
use tracing::{Instrument, Span};

/// Checks a call against the tools offered for its model call (the agent's
/// tools, narrowed by `model_request` patches) and the tool's argument
/// schema; `Some` describes the problem.
pub fn validate_call(
    call: &ToolCall,
    tools: &[ToolSpec],
    schema: impl Fn(&ToolSpec) -> Option<Arc<jsonschema::Validator>>,
) -> Option<(CallProblem, String)> {
    let Some(spec) = tools.iter().find(|t| t.name == call.name) else {
        return Some((
            CallProblem::UnknownTool,
            format!("unknown tool `{}`", call.name),
        ));
    };
    match serde_json::from_str::<serde_json::Value>(&call.arguments_json) {
        Ok(args @ serde_json::Value::Object(_)) => {
            let validator = schema(spec)?;
            let errors: Vec<String> = validator
                .iter_errors(&args)
                .take(5)
                .map(|e| schema_error(&e))
                .collect();
            (!errors.is_empty()).then(|| {
                (
                    CallProblem::InvalidArguments,
                    format!(
                        "arguments do not match the schema of `{}`: {}",
                        call.name,
                        errors.join("; ")
                    ),
                )
            })
        }
        Ok(_) => Some((
            CallProblem::InvalidArguments,
            "arguments must be a JSON object".into(),
        )),
        Err(e) => Some((
            CallProblem::InvalidArguments,
            format!("arguments are not valid JSON: {e}"),
        )),
    }
}

/// One schema error, in words that quote nothing of the arguments.
/// jsonschema's own text quotes the offending value (`["…"] is not of type
/// "string"`) and names unexpected keys, and its instance path names the
/// arguments' keys; this text becomes the call's error result, which
/// telemetry records in later chat spans even when a hook redacted the
/// arguments. The schema's location of the rule broken (names the tool's
/// author chose) and the rule are enough for the model to fix its call.
fn schema_error(e: &jsonschema::ValidationError<'_>) -> String {
    use jsonschema::error::ValidationErrorKind as Kind;
    let rule = match e.kind() {
        Kind::AdditionalProperties { unexpected } => {
            format!("{} unexpected properties", unexpected.len())
        }
        Kind::UnevaluatedProperties { unexpected } => {
            format!("{} unevaluated properties", unexpected.len())
        }
        Kind::PropertyNames { .. } => "a property name does not match the schema".into(),
        _ => e.masked().to_string(),
    };
    let at = e.schema_path().to_string();
    if at.is_empty() {
        rule
    } else {
        format!("{at}: {rule}")
    }
}

fn result(call: &ToolCall, content: String, is_error: bool) -> ToolResult {
    ToolResult {
        call_id: call.id.clone(),
        name: call.name.clone(),
        content,
        is_error,
    }
}

fn terminate(hook: String, t: crate::hooks::verdict::Terminate) -> CallOutcome {
    CallOutcome::Stop(Stop::Terminate {
        hook,
        reason: t.reason,
        reply: t.reply,
    })
}

/// Phase one for one call, before any call of its batch starts: a call to
/// a tool not offered for this model call, or with arguments that fail the
/// tool's schema, goes through the `invalid_tool_call` hooks and is decided
/// here (under its own `execute_tool` span). `None`: valid, it will execute.
pub async fn screen_call(
    run: &Run,
    turn: u32,
    call: &ToolCall,
    offered: &[ToolSpec],
) -> Option<CallOutcome> {
    let (problem, error) = validate_call(call, offered, |s| run.registry.validator(s))?;
    let available: Vec<String> = offered.iter().map(|t| t.name.clone()).collect();
    let out = match run
        .hooks
        .chain::<InvalidToolCallChain>(turn, call.clone(), |c| Payload::InvalidToolCall {
            call: c.clone(),
            problem,
            error: error.clone(),
            available: available.clone(),
        })
        .instrument(spans::execute_tool(&call.name, &call.id))
        .await
    {
        Ok(o) => o,
        Err(f) => return Some(CallOutcome::Stop(Stop::HookFailed(f))),
    };
    run.emit_records(&out.records);
    run.content.redact_arguments(call, out.redaction);
    Some(match out.stop {
        None => CallOutcome::Result(result(
            call,
            format!(
                "error: {error}. Available tools: {}",
                if available.is_empty() {
                    "(none)".to_string()
                } else {
                    available.join(", ")
                }
            ),
            true,
        )),
        Some((_, InvalidCallStop::Retry(f))) => CallOutcome::Retry(f),
        Some((_, InvalidCallStop::Skip(s))) => {
            CallOutcome::Result(result(call, s.result, s.is_error))
        }
        Some((hook, InvalidCallStop::Terminate(t))) => terminate(hook, t),
    })
}

/// Phase two for a screened call. Nothing new starts once `stop` fired:
/// it is checked before each hook call, before an approval is requested,
/// and before `CallTool` both before and after the wait for a connection
/// slot to the tool's owner (the call is then `Halted`).
pub async fn process_call(
    run: Arc<Run>,
    turn: u32,
    index: u32,
    call: ToolCall,
    tools: Arc<Vec<ToolSpec>>,
    stop: BatchStop,
) -> CallOutcome {
    let hooks = &run.hooks;
    let spec = tools
        .iter()
        .find(|t| t.name == call.name)
        .cloned()
        .unwrap_or_default();
    let out = match hooks
        .chain_until::<ToolCallChain>(
            turn,
            call.clone(),
            |c| Payload::ToolCall {
                call: c.clone(),
                index,
                tool: spec.clone(),
            },
            stop.token(),
        )
        .await
    {
        Ok(Some(o)) => o,
        Ok(None) => return CallOutcome::Halted,
        Err(f) => return CallOutcome::Stop(Stop::HookFailed(f)),
    };
    run.emit_records(&out.records);
    let effective = out.payload;
    // Argument content, once, after every tool_call hook ran (the effective
    // arguments or a hook's redaction, which also covers the call in later
    // chat inputs); never on terminate.
    run.content.redact_arguments(&call, out.redaction);
    if !matches!(out.stop, Some((_, ToolCallStop::Terminate(_)))) {
        run.content
            .record_arguments(&Span::current(), &call, &effective);
    }
    let record_result = |r: &ToolResult| run.content.record_result(&Span::current(), r);
    match out.stop {
        None => {}
        Some((_, ToolCallStop::Skip(s))) => {
            let r = result(&effective, s.result, s.is_error);
            record_result(&r);
            return CallOutcome::Result(r);
        }
        Some((hook, ToolCallStop::Terminate(t))) => return terminate(hook, t),
        Some((hook, ToolCallStop::Ask(ask))) => {
            if let Some(denied) = run
                .ask_approval(turn, index, &effective, &hook, ask, &stop)
                .await
            {
                if let CallOutcome::Result(r) = &denied {
                    record_result(r);
                }
                return denied;
            }
        }
    }

    // Whether the call may still start: not once the batch stopped, nor
    // once a closed hook broke its protocol since the last step (a
    // duplicate verdict, say), nor while a closed hook's broken stream is
    // failing another call of the batch that has not stopped it yet.
    let gate = || {
        if stop.is_stopped() {
            return Some(CallOutcome::Halted);
        }
        run.check_faults(crate::event::EventKind::ToolCall)
            .err()
            .or_else(|| run.hooks.broken_closed(crate::event::EventKind::ToolCall))
            .map(|f| CallOutcome::Stop(Stop::HookFailed(f)))
    };
    if let Some(halted) = gate() {
        return halted;
    }
    let owner = run.registry.tool_owner(&effective.name).map(|(o, _)| o);
    // A slot on the owner's connections may take up to the tool's timeout
    // to free (every connection at its stream limit): a stop meanwhile
    // ends the wait, and the checks are made again once the slot is there,
    // so a call that waited never sends its `CallTool` after a stop.
    let slot = match &owner {
        Some(owner) => {
            let deadline = (Instant::now()
                + owner.config.timeout_for(crate::event::EventKind::ToolCall))
            .min(run.deadline);
            // A slot free now: nothing was awaited since the checks above,
            // so nothing can have stopped meanwhile (and the common case
            // pays for no cancellation waiters).
            if let Some(slot) = owner.try_tool_slot() {
                Some((Ok(slot), deadline))
            } else {
                let slot = tokio::select! {
                    biased;
                    _ = stop.stopped() => return CallOutcome::Halted,
                    _ = run.cancel.cancelled() => {
                        return run
                            .stopped_from_outside()
                            .map_or(CallOutcome::Halted, CallOutcome::Stop)
                    }
                    slot = owner.tool_slot(deadline) => slot,
                };
                if let Some(halted) = gate() {
                    return halted;
                }
                Some((slot, deadline))
            }
        }
        None => None,
    };
    run.emit(RunEvent::ToolStarted {
        turn,
        index,
        call: effective.clone(),
    });
    // The emit can itself cancel the run (the client went away, or its
    // queue is full), and the request below would go out in this same poll.
    if let Some(s) = run.stopped_from_outside() {
        return CallOutcome::Stop(s);
    }
    let failed = |f: Fault| {
        (
            format!(
                "tool `{}` failed to execute: {}: {}",
                effective.name, f.class, f.detail
            ),
            true,
        )
    };
    // Nothing is awaited between the checks above and the request going out.
    let (content, is_error) = match slot {
        Some((Ok(slot), deadline)) => {
            // The time left is measured by the call, as the request goes
            // out (after any wait for its connection).
            let ctx = hooks.wire_context(turn, std::time::Duration::ZERO);
            slot.call(ctx, &effective, deadline)
                .await
                .unwrap_or_else(failed)
        }
        Some((Err(f), _)) => failed(f),
        None => (
            format!("tool `{}` has no reachable owner", effective.name),
            true,
        ),
    };
    let raw = result(&effective, content, is_error);
    let out = match hooks
        .chain_until::<ToolResultChain>(
            turn,
            raw,
            |r| Payload::ToolResult {
                call: effective.clone(),
                index,
                result: r.clone(),
            },
            stop.token(),
        )
        .await
    {
        Ok(Some(o)) => o,
        Ok(None) => return CallOutcome::Halted,
        Err(f) => return CallOutcome::Stop(Stop::HookFailed(f)),
    };
    run.emit_records(&out.records);
    match out.stop {
        // A terminated result is not recorded at all.
        Some((hook, t)) => terminate(hook, t),
        None => {
            run.content.redact_result(&out.payload, out.redaction);
            record_result(&out.payload);
            CallOutcome::Result(out.payload)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_problem() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"]
        });
        let validator = Arc::new(jsonschema::validator_for(&schema).unwrap());
        let tools = vec![ToolSpec {
            name: "get_weather".into(),
            parameters_json_schema: schema.to_string(),
            ..Default::default()
        }];
        let validate_call =
            |c: &ToolCall, t: &[ToolSpec]| validate_call(c, t, |_| Some(validator.clone()));
        let call = |name: &str, args: &str| ToolCall {
            id: "1".into(),
            name: name.into(),
            arguments_json: args.into(),
        };
        assert_eq!(
            validate_call(&call("get_weather", r#"{"city":"Paris"}"#), &tools),
            None
        );
        let (problem, error) =
            validate_call(&call("get_weather", r#"{"city":3}"#), &tools).unwrap();
        assert_eq!(problem, CallProblem::InvalidArguments);
        assert!(
            error.contains("/city") && error.contains("string"),
            "{error}"
        );
        assert!(validate_call(&call("get_weather", "{}"), &tools)
            .unwrap()
            .1
            .contains("city"));
        assert_eq!(
            validate_call(&call("nope", r#"{"city":"x"}"#), &tools)
                .unwrap()
                .0,
            CallProblem::UnknownTool
        );
        assert_eq!(
            validate_call(&call("get_weather", "[1]"), &tools)
                .unwrap()
                .0,
            CallProblem::InvalidArguments
        );
        assert_eq!(
            validate_call(&call("get_weather", "{"), &tools).unwrap().0,
            CallProblem::InvalidArguments
        );
    }

    #[test]
    fn schema_errors_quote_nothing_of_the_arguments() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
                "meta": {"type": "object", "propertyNames": {"maxLength": 3}}
            },
            "additionalProperties": false
        });
        let validator = Arc::new(jsonschema::validator_for(&schema).unwrap());
        let tools = vec![ToolSpec {
            name: "t".into(),
            parameters_json_schema: schema.to_string(),
            ..Default::default()
        }];
        let args = serde_json::json!({
            "city": ["SECRET-VALUE"],
            "SECRET-KEY": 1,
            "tags": {"SECRET-TAG": "x"},
            "meta": {"SECRET-NAME": 1}
        });
        let call = ToolCall {
            id: "1".into(),
            name: "t".into(),
            arguments_json: args.to_string(),
        };
        let (_, error) = validate_call(&call, &tools, |_| Some(validator.clone())).unwrap();
        assert!(!error.contains("SECRET"), "{error}");
        // Each rule broken is still named, where the schema states it.
        for expected in [
            "/properties/city/type",
            "/additionalProperties: 1 unexpected properties",
            "/properties/tags/additionalProperties/type",
            "/properties/meta/propertyNames",
        ] {
            assert!(error.contains(expected), "{expected} in {error}");
        }
    }
}
