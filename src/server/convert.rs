//! Domain values to their `pb` messages for the client API.

use crate::agent::events::{RunEvent, RunReport};
use crate::hooks::client::HookSnapshot;
use crate::hooks::provenance::VerdictRecord;
use crate::hooks::verdict::VerdictKind;
use crate::pb;
use crate::session::Session;

/// `hooks`: every hook enabled on the session, in firing order.
pub fn session(s: &Session, hooks: Vec<String>, with_transcript: bool) -> pb::Session {
    pb::Session {
        id: s.id.clone(),
        agent: s.agent.clone(),
        hooks,
        metadata: s
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        created_at_unix_ms: s.created_at_unix_ms,
        transcript: if with_transcript {
            s.transcript.iter().map(Into::into).collect()
        } else {
            vec![]
        },
        run_count: s.run_count,
        active_run_id: s.active_run.clone().unwrap_or_default(),
        owner: s.owner.clone(),
        last_active_unix_ms: s.last_active_unix_ms,
    }
}

impl From<VerdictKind> for pb::VerdictKind {
    fn from(k: VerdictKind) -> Self {
        match k {
            VerdictKind::Continue => pb::VerdictKind::Continue,
            VerdictKind::RewriteInput => pb::VerdictKind::RewriteInput,
            VerdictKind::PatchRequest => pb::VerdictKind::PatchRequest,
            VerdictKind::Respond => pb::VerdictKind::Respond,
            VerdictKind::RewriteResponse => pb::VerdictKind::RewriteResponse,
            VerdictKind::Retry => pb::VerdictKind::Retry,
            VerdictKind::Skip => pb::VerdictKind::Skip,
            VerdictKind::RewriteArgs => pb::VerdictKind::RewriteArgs,
            VerdictKind::Ask => pb::VerdictKind::Ask,
            VerdictKind::RewriteResult => pb::VerdictKind::RewriteResult,
            VerdictKind::ContinueRun => pb::VerdictKind::ContinueRun,
            VerdictKind::Terminate => pb::VerdictKind::Terminate,
        }
    }
}

// The deprecated string `verdict` is still filled for older clients.
#[allow(deprecated)]
pub fn verdict(r: &VerdictRecord) -> pb::HookVerdictApplied {
    pb::HookVerdictApplied {
        hook: r.hook.clone(),
        event: pb::EventKind::from(r.event) as i32,
        verdict: r.verdict.name().to_string(),
        verdict_kind: pb::VerdictKind::from(r.verdict) as i32,
        fields_changed: r.fields_changed.clone(),
        conflicts: r
            .conflicts
            .iter()
            .map(|c| pb::PatchConflict {
                field: c.field.clone(),
                winner: c.winner.clone(),
                loser: c.loser.clone(),
            })
            .collect(),
        reason: r.reason.clone(),
        failed_open: r
            .failed_open
            .map(|c| c.name().to_string())
            .unwrap_or_default(),
    }
}

pub fn report(r: &RunReport) -> pb::RunResult {
    pb::RunResult {
        run_id: r.run_id.clone(),
        session_id: r.session_id.clone(),
        outcome: pb::RunOutcome::from(r.outcome) as i32,
        final_text: r.final_text.clone(),
        reason: r.reason.clone(),
        usage: Some(r.usage.into()),
        turns: r.turns,
        messages: r.messages.iter().map(Into::into).collect(),
        hook_verdicts: r.hook_verdicts.iter().map(verdict).collect(),
        finish_reason: r.finish_reason.clone(),
        truncated: r.truncated(),
    }
}

pub fn run_event(
    run_id: &str,
    seq: u64,
    ev: &RunEvent,
    session_id: &str,
    agent: &str,
) -> pb::RunEvent {
    use pb::run_event::Event as E;
    let event = match ev {
        // `input` is deprecated and left empty: see `input_committed`.
        RunEvent::Started => E::Started(pb::RunStarted {
            session_id: session_id.to_string(),
            agent: agent.to_string(),
            ..Default::default()
        }),
        RunEvent::InputCommitted { input, rewritten } => E::InputCommitted(pb::InputCommitted {
            input: input.clone(),
            rewritten: *rewritten,
        }),
        RunEvent::TurnStarted { turn } => E::TurnStarted(pb::TurnStarted { turn: *turn }),
        RunEvent::TextDelta { turn, text } => E::TextDelta(pb::TextDelta {
            turn: *turn,
            text: text.clone(),
        }),
        RunEvent::DeltasRetracted { turn, reason } => E::DeltasRetracted(pb::DeltasRetracted {
            turn: *turn,
            reason: reason.clone(),
        }),
        RunEvent::AssistantMessage {
            turn,
            message,
            finish_reason,
            usage,
        } => E::AssistantMessage(pb::AssistantMessage {
            turn: *turn,
            message: Some(message.into()),
            finish_reason: finish_reason.clone(),
            usage: Some((*usage).into()),
        }),
        RunEvent::ToolCallRequested { turn, index, call } => E::ToolCall(pb::ToolCallRequested {
            turn: *turn,
            call_index: *index,
            call: Some(call.into()),
        }),
        RunEvent::ToolStarted { turn, index, call } => E::ToolStarted(pb::ToolExecutionStarted {
            turn: *turn,
            call_index: *index,
            call: Some(call.into()),
        }),
        RunEvent::ToolResult {
            turn,
            index,
            result,
        } => E::ToolResult(pb::ToolResultReady {
            turn: *turn,
            call_index: *index,
            result: Some(result.into()),
        }),
        RunEvent::HookVerdict(r) => E::HookVerdict(verdict(r)),
        RunEvent::ApprovalRequested {
            turn,
            index,
            call,
            question,
            hook,
            timeout,
        } => E::ApprovalRequested(pb::ApprovalRequested {
            turn: *turn,
            call_index: *index,
            call: Some(call.into()),
            question: question.clone(),
            hook: hook.clone(),
            timeout_ms: timeout.as_millis() as u64,
        }),
        RunEvent::Finished(r) => E::Finished(pb::RunFinished {
            result: Some(report(r)),
        }),
    };
    pb::RunEvent {
        run_id: run_id.to_string(),
        seq,
        event: Some(event),
    }
}

pub fn hook_info(h: &HookSnapshot) -> pb::HookInfo {
    let d = h.description.clone().unwrap_or_default();
    pb::HookInfo {
        name: h.config.name.clone(),
        endpoint: h.config.endpoint.clone(),
        state: h.state.to_string(),
        events: h
            .events
            .iter()
            .map(|e| pb::EventKind::from(*e) as i32)
            .collect(),
        tools: d.tools.iter().map(Into::into).collect(),
        priority: h.config.priority,
        failure: match h.config.failure {
            crate::config::FailurePolicy::Closed => "closed".into(),
            crate::config::FailurePolicy::Open => "open".into(),
        },
        mode: match h.config.mode {
            crate::config::HookMode::Blocking => "blocking".into(),
            crate::config::HookMode::Observe => "observe".into(),
        },
        server_name: d.name,
        server_version: d.version,
        last_error: h.last_error.clone().unwrap_or_default(),
        unsubscribed_events: h
            .unsubscribed
            .iter()
            .map(|e| pb::EventKind::from(*e) as i32)
            .collect(),
    }
}
