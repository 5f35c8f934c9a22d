//! Client commands: a readable run timeline, sessions and hooks.

use std::io::{IsTerminal, Write};

use crate::cli::connection::{connect, ServerOpts};
use crate::cli::SessionsAction;
use crate::pb;

fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

fn event_name(v: i32) -> String {
    pb::EventKind::try_from(v)
        .map(|k| {
            k.as_str_name()
                .trim_start_matches("EVENT_KIND_")
                .to_lowercase()
        })
        .unwrap_or_else(|_| v.to_string())
}

fn verdict_name(v: i32) -> String {
    pb::VerdictKind::try_from(v)
        .map(|k| {
            k.as_str_name()
                .trim_start_matches("VERDICT_KIND_")
                .to_lowercase()
        })
        .unwrap_or_else(|_| v.to_string())
}

/// `completed`, `hook_failed`, ...; a value this build does not know as
/// `unknown(N)` (a newer server).
pub(crate) fn outcome_name(v: i32) -> String {
    pb::RunOutcome::try_from(v)
        .map(|k| {
            k.as_str_name()
                .trim_start_matches("RUN_OUTCOME_")
                .to_lowercase()
        })
        .unwrap_or_else(|_| format!("unknown({v})"))
}

#[allow(clippy::too_many_arguments)]
pub async fn run(
    addr: &str,
    opts: &ServerOpts,
    agent: &str,
    session: Option<String>,
    hooks: Vec<String>,
    json: bool,
    prompt: String,
) -> anyhow::Result<()> {
    let mut client = connect(addr, opts).await?;
    let session_id = match session {
        Some(id) => id,
        None => {
            client
                .create_session(pb::CreateSessionRequest {
                    agent: agent.to_string(),
                    extra_hooks: hooks,
                    metadata: Default::default(),
                })
                .await
                .map_err(status_err)?
                .into_inner()
                .id
        }
    };
    let mut stream = client
        .run(pb::RunRequest {
            session_id: session_id.clone(),
            input: prompt,
        })
        .await
        .map_err(status_err)?
        .into_inner();
    let mut out = std::io::stdout();
    let mut mid_line = false;
    let mut final_outcome = None;
    let json_lines = if json {
        Some(super::json::ProtoJson::new("hookwire.v1.RunEvent")?)
    } else {
        None
    };
    while let Some(ev) = stream.message().await.map_err(status_err)? {
        if let Some(j) = &json_lines {
            writeln!(out, "{}", j.line(&ev)?)?;
        }
        let Some(e) = ev.event else { continue };
        use pb::run_event::Event as E;
        if let E::Finished(f) = &e {
            final_outcome = f.result.as_ref().map(|r| r.outcome);
        }
        if let E::ApprovalRequested(a) = &e {
            let answer = ask_approval(a, json)?;
            if let Some((approve, note)) = answer {
                let call_id = a.call.as_ref().map(|c| c.id.clone()).unwrap_or_default();
                client
                    .resolve_approval(pb::ResolveApprovalRequest {
                        run_id: ev.run_id.clone(),
                        call_id,
                        approve,
                        note,
                    })
                    .await
                    .map_err(status_err)?;
            }
        }
        if json {
            continue;
        }
        let nl = |mid: &mut bool, out: &mut std::io::Stdout| -> std::io::Result<()> {
            if *mid {
                writeln!(out)?;
                *mid = false;
            }
            Ok(())
        };
        match e {
            E::Started(s) => {
                writeln!(
                    out,
                    "▶ run {} · session {} · agent {}",
                    ev.run_id, s.session_id, s.agent
                )?;
            }
            E::InputCommitted(c) => {
                if c.rewritten {
                    writeln!(out, "  ✎ input as committed: {}", c.input)?;
                }
            }
            E::TurnStarted(t) => {
                nl(&mut mid_line, &mut out)?;
                writeln!(out, "── turn {}", t.turn)?;
            }
            E::TextDelta(d) => {
                write!(out, "{}", d.text)?;
                out.flush()?;
                mid_line = true;
            }
            E::DeltasRetracted(r) => {
                nl(&mut mid_line, &mut out)?;
                writeln!(out, "  ✗ text above retracted: {}", r.reason)?;
            }
            E::AssistantMessage(_) => nl(&mut mid_line, &mut out)?,
            E::ToolCall(c) => {
                nl(&mut mid_line, &mut out)?;
                if let Some(call) = c.call {
                    writeln!(
                        out,
                        "  → #{} {}({})",
                        c.call_index, call.name, call.arguments_json
                    )?;
                }
            }
            E::ToolStarted(c) => {
                if let Some(call) = c.call {
                    writeln!(
                        out,
                        "  ⚙ #{} executing {}({})",
                        c.call_index, call.name, call.arguments_json
                    )?;
                }
            }
            E::ToolResult(r) => {
                if let Some(res) = r.result {
                    let tag = if res.is_error { "error" } else { "result" };
                    writeln!(out, "  ← #{} {tag}: {}", r.call_index, res.content)?;
                }
            }
            E::HookVerdict(h) => {
                nl(&mut mid_line, &mut out)?;
                let mut line = format!(
                    "  ⚑ hook {} · {} · {}",
                    h.hook,
                    event_name(h.event),
                    verdict_name(h.verdict_kind)
                );
                if !h.fields_changed.is_empty() {
                    line.push_str(&format!(" [{}]", h.fields_changed.join(", ")));
                }
                for c in &h.conflicts {
                    line.push_str(&format!(
                        " (conflict on {}: {} kept over {})",
                        c.field, c.winner, c.loser
                    ));
                }
                if !h.failed_open.is_empty() {
                    line.push_str(&format!(" (failed open: {})", h.failed_open));
                }
                if !h.reason.is_empty() {
                    line.push_str(&format!(" — {}", h.reason));
                }
                writeln!(out, "{line}")?;
            }
            E::ApprovalRequested(_) => {}
            E::Finished(f) => {
                nl(&mut mid_line, &mut out)?;
                if let Some(r) = f.result {
                    let usage = r.usage.unwrap_or_default();
                    let mark = if r.outcome == pb::RunOutcome::Completed as i32 {
                        "✔"
                    } else {
                        "■"
                    };
                    writeln!(
                        out,
                        "{mark} {}{} · {} turn(s) · {} in / {} out tokens{}",
                        outcome_name(r.outcome),
                        if r.truncated { " (truncated)" } else { "" },
                        r.turns,
                        usage.input_tokens,
                        usage.output_tokens,
                        if usage.estimated { " (estimated)" } else { "" }
                    )?;
                    if r.truncated {
                        writeln!(
                            out,
                            "  ⚠ the answer is cut off: the model stopped at its token limit (finish_reason {}); raise max_tokens",
                            r.finish_reason
                        )?;
                    }
                    if !r.reason.is_empty() {
                        writeln!(out, "  reason: {}", r.reason)?;
                    }
                    if r.outcome != pb::RunOutcome::Completed as i32 && !r.final_text.is_empty() {
                        writeln!(out, "  reply: {}", r.final_text)?;
                    }
                }
            }
        }
    }
    match final_outcome {
        Some(o) if o == pb::RunOutcome::Completed as i32 => Ok(()),
        Some(o) => anyhow::bail!("run ended {}", outcome_name(o)),
        None => anyhow::bail!("the stream ended without a result"),
    }
}

/// Prompts on an interactive terminal. With `--json` the request is left
/// open for whatever reads the stream to answer with ResolveApproval (the
/// deadline denies it otherwise); with no terminal to ask at, it is denied
/// at once rather than holding the run until the deadline.
fn ask_approval(a: &pb::ApprovalRequested, json: bool) -> anyhow::Result<Option<(bool, String)>> {
    let call = a.call.clone().unwrap_or_default();
    if json {
        eprintln!(
            "approval requested for {}({}) by hook {}: {} — answer with ResolveApproval within {} ms or it is denied",
            call.name, call.arguments_json, a.hook, a.question, a.timeout_ms
        );
        return Ok(None);
    }
    if !std::io::stdin().is_terminal() {
        outln!(
            "  ? hook {} asks: {} — {}({}) denied: no terminal to ask at",
            a.hook,
            a.question,
            call.name,
            call.arguments_json
        )?;
        return Ok(Some((false, "denied: hookwire run had no terminal".into())));
    }
    out!(
        "  ? hook {} asks: {} — allow {}({})? [y/N] ",
        a.hook,
        a.question,
        call.name,
        call.arguments_json
    )?;
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let approve = matches!(line.trim(), "y" | "Y" | "yes");
    Ok(Some((
        approve,
        if approve {
            String::new()
        } else {
            "denied at the terminal".into()
        },
    )))
}

pub async fn sessions(addr: &str, opts: &ServerOpts, action: SessionsAction) -> anyhow::Result<()> {
    let mut client = connect(addr, opts).await?;
    match action {
        SessionsAction::List { agent } => {
            // Every page, oldest first.
            let mut sessions = Vec::new();
            let mut page_token = String::new();
            loop {
                let r = client
                    .list_sessions(pb::ListSessionsRequest {
                        page_size: 0,
                        page_token: page_token.clone(),
                        agent: agent.clone().unwrap_or_default(),
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                sessions.extend(r.sessions);
                if r.next_page_token.is_empty() {
                    break;
                }
                page_token = r.next_page_token;
            }
            if sessions.is_empty() {
                outln!("no sessions")?;
            }
            for s in sessions {
                outln!(
                    "{}  agent={}  owner={}  runs={}{}",
                    s.id,
                    s.agent,
                    s.owner,
                    s.run_count,
                    if s.active_run_id.is_empty() {
                        String::new()
                    } else {
                        format!("  active_run={}", s.active_run_id)
                    }
                )?;
            }
        }
        SessionsAction::Show { id } => {
            let s = client
                .get_session(pb::GetSessionRequest { session_id: id })
                .await
                .map_err(status_err)?
                .into_inner();
            outln!(
                "session {} · agent {} · {} run(s)",
                s.id,
                s.agent,
                s.run_count
            )?;
            for m in s.transcript {
                let role = pb::Role::try_from(m.role)
                    .map(|r| r.as_str_name().trim_start_matches("ROLE_").to_lowercase())
                    .unwrap_or_default();
                for b in m.blocks {
                    use pb::block::Kind;
                    match b.kind {
                        Some(Kind::Text(t)) => outln!("{role:>9}: {}", t.text)?,
                        Some(Kind::Reasoning(t)) => outln!("{role:>9}: (reasoning) {}", t.text)?,
                        Some(Kind::ToolCall(c)) => {
                            outln!("{role:>9}: → {}({}) [{}]", c.name, c.arguments_json, c.id)?
                        }
                        Some(Kind::ToolResult(r)) => outln!(
                            "{role:>9}: ← {}{} [{}]",
                            if r.is_error { "error: " } else { "" },
                            r.content,
                            r.call_id
                        )?,
                        None => {}
                    }
                }
            }
        }
        SessionsAction::Delete { id } => {
            client
                .delete_session(pb::DeleteSessionRequest {
                    session_id: id.clone(),
                })
                .await
                .map_err(status_err)?;
            outln!("deleted {id}")?;
        }
    }
    Ok(())
}

pub async fn hooks(addr: &str, opts: &ServerOpts) -> anyhow::Result<()> {
    let mut client = connect(addr, opts).await?;
    let r = client
        .list_hooks(pb::ListHooksRequest {})
        .await
        .map_err(status_err)?
        .into_inner();
    if r.hooks.is_empty() {
        outln!("no hooks configured")?;
    }
    for h in r.hooks {
        outln!(
            "{}  {}  state={} priority={} failure={} mode={}",
            h.name,
            h.endpoint,
            h.state,
            h.priority,
            h.failure,
            h.mode
        )?;
        outln!(
            "    events: {}",
            h.events
                .iter()
                .map(|e| event_name(*e))
                .collect::<Vec<_>>()
                .join(", ")
        )?;
        if !h.tools.is_empty() {
            outln!(
                "    tools: {}",
                h.tools
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )?;
        }
        if !h.unsubscribed_events.is_empty() {
            outln!(
                "    unsubscribed: {} (configured, but not in the server's Describe: {})",
                h.unsubscribed_events
                    .iter()
                    .map(|e| event_name(*e))
                    .collect::<Vec<_>>()
                    .join(", "),
                if h.mode == "observe" {
                    "not delivered".to_string()
                } else {
                    format!("each fails under failure: {}", h.failure)
                }
            )?;
        }
        if !h.last_error.is_empty() {
            outln!("    last error: {}", h.last_error)?;
        }
    }
    Ok(())
}
