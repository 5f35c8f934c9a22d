//! The judgement: turns what Describe, health and the recorded streams say
//! into rows. Free of IO. Verdicts are judged by the engine's own rule book
//! (`hooks::dispatch::accept_verdict`) and classified with its failure
//! classes, so a FAIL here reads like the hook failure hookwire would log.

use std::time::Duration;

use crate::conformance::args::Schema;
use crate::conformance::report::Row;
use crate::conformance::transcript::{
    Arrival, Health, SentEvent, StreamEnd, StreamLog, ToolCallLog,
};
use crate::event::EventKind;
use crate::hooks::dispatch::judge_alone;
use crate::hooks::failure::{FailureClass, Fault};
use crate::hooks::verdict::{Action, ToolCallAction, Verdict};
use crate::hooks::wire::event_kind_from_wire;
use crate::message::ToolSpec;
use crate::pb;

const DESCRIBE: &str = "describe";

fn ms(d: Duration) -> String {
    if d < Duration::from_millis(10) {
        format!("{:.1} ms", d.as_secs_f64() * 1000.0)
    } else {
        format!("{} ms", d.as_millis())
    }
}

fn fault(f: &Fault) -> String {
    format!("{}: {}", f.class, f.detail)
}

/// Cuts long content for a table cell.
fn short(s: &str) -> String {
    let one_line = s.replace('\n', " ");
    if one_line.chars().count() <= 60 {
        one_line
    } else {
        format!("{}…", one_line.chars().take(60).collect::<String>())
    }
}

pub fn describe_failed(endpoint: &str, f: &Fault) -> Row {
    let hint = match f.class {
        FailureClass::Connect => " (is the server running and listening there?)",
        FailureClass::Tls => " (https:// endpoints need a certificate trusted by the webpki roots)",
        _ => "",
    };
    Row::fail(
        DESCRIBE,
        "answers",
        format!("{endpoint}: {}{hint}", fault(f)),
    )
}

/// Describe's answer: who, which events, which tools.
pub fn describe(d: &pb::DescribeResponse, took: Duration) -> Vec<Row> {
    let mut rows = vec![Row::pass(DESCRIBE, "answers", format!("in {}", ms(took)))];
    rows.push(if d.name.trim().is_empty() {
        Row::fail(
            DESCRIBE,
            "name",
            "name is empty; hookwire shows it in ListHooks and logs",
        )
    } else {
        Row::pass(
            DESCRIBE,
            "name",
            format!("{} {}", d.name, d.version).trim_end().to_string(),
        )
    });
    // Kinds this hookwire does not know: a server built against a newer
    // contract may list them (hookwire ignores them, and a newer hookwire
    // sends them), so they are noted, not failed. Only 0 is no kind at all.
    let unknown: Vec<String> = d
        .events
        .iter()
        .filter(|v| **v != 0 && event_kind_from_wire(**v).is_none())
        .map(|v| v.to_string())
        .collect();
    let known: Vec<&str> = d
        .events
        .iter()
        .filter_map(|v| event_kind_from_wire(*v))
        .map(EventKind::name)
        .collect();
    let newer = if unknown.is_empty() {
        String::new()
    } else {
        format!(
            "; kind(s) {} are unknown to this hookwire (newer?), which ignores them",
            unknown.join(", ")
        )
    };
    rows.push(if d.events.contains(&0) {
        Row::fail(
            DESCRIBE,
            "events",
            "lists EVENT_KIND_UNSPECIFIED (0), which is no event; leave it out",
        )
    } else if known.is_empty() && !unknown.is_empty() {
        Row::pass(
            DESCRIBE,
            "events",
            format!("none this hookwire knows{newer}"),
        )
    } else if known.is_empty() {
        Row::pass(
            DESCRIBE,
            "events",
            "none: owns tools only, Process is never opened",
        )
    } else {
        Row::pass(DESCRIBE, "events", format!("{}{newer}", known.join(", ")))
    });
    let mut problems = Vec::new();
    for (i, t) in d.tools.iter().enumerate() {
        if t.name.trim().is_empty() {
            problems.push(format!("tool #{i} has no name"));
        } else if d.tools[..i].iter().any(|o| o.name == t.name) {
            problems.push(format!("tool `{}` is listed twice", t.name));
        }
    }
    rows.push(if !problems.is_empty() {
        Row::fail(DESCRIBE, "tools", problems.join("; "))
    } else if d.tools.is_empty() {
        Row::pass(DESCRIBE, "tools", "none")
    } else {
        Row::pass(
            DESCRIBE,
            "tools",
            d.tools
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        )
    });
    rows
}

/// `--events` may only narrow Describe's list, like a hook's `events:` in
/// hookwire's config; asking for more is reported, not silently dropped.
pub fn requested_events(requested: &[EventKind], described: &[EventKind]) -> Vec<Row> {
    requested
        .iter()
        .filter(|e| !described.contains(e))
        .map(|e| {
            Row::fail(
                DESCRIBE,
                format!("subscribes to {e}"),
                format!("--events asks for {e}, which Describe does not list; hookwire would never send it"),
            )
        })
        .collect()
}

pub fn health(service: &str, answer: &Health) -> Row {
    let subject = "health";
    let check = if service.is_empty() {
        "Check(\"\")".to_string()
    } else {
        format!("Check({service})")
    };
    use tonic_health::pb::health_check_response::ServingStatus;
    match answer {
        Health::Status(s) if *s == ServingStatus::Serving as i32 => {
            Row::pass(subject, check, "SERVING")
        }
        Health::Status(s) => {
            let name = ServingStatus::try_from(*s)
                .map(|s| s.as_str_name().to_string())
                .unwrap_or_else(|_| s.to_string());
            Row::fail(subject, check, format!("{name}, not SERVING"))
        }
        Health::NotServed => Row::skip(
            subject,
            check,
            "grpc.health.v1 not served (recommended for Kubernetes probes)",
        ),
        Health::UnknownService => Row::fail(
            subject,
            check,
            "NOT_FOUND: health is served but does not know this service; report SERVING for it",
        ),
        Health::Failed(f) => Row::fail(subject, check, fault(f)),
    }
}

fn tool_subject(name: &str) -> String {
    format!("tool {name}")
}

pub fn tool_schema(spec: &ToolSpec, schema: &Schema) -> Row {
    let s = tool_subject(&spec.name);
    match schema {
        Schema::Any => Row::pass(s, "schema", "empty: any JSON object"),
        Schema::Valid(..) => Row::pass(s, "schema", "a valid JSON Schema for an object"),
        Schema::Invalid(e) => Row::fail(s, "schema", format!("parameters_json_schema is {e}")),
    }
}

/// Where the arguments came from, for the reason text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgsSource {
    Flag,
    Schema,
}

pub fn tool_arguments(
    spec: &ToolSpec,
    args: &str,
    source: ArgsSource,
    valid: &Result<(), String>,
) -> Row {
    let s = tool_subject(&spec.name);
    match (valid, source) {
        (Ok(()), ArgsSource::Flag) => Row::pass(s, "arguments", format!("{args} (from --tool-args)")),
        (Ok(()), ArgsSource::Schema) => {
            Row::pass(s, "arguments", format!("{args} (derived from the schema)"))
        }
        (Err(e), ArgsSource::Flag) => Row::fail(s, "arguments", format!("--tool-args: {e}")),
        (Err(e), ArgsSource::Schema) => Row::fail(
            s,
            "arguments",
            format!(
                "cannot derive valid arguments ({e}); add `examples` to the schema or pass --tool-args {}='{{...}}'",
                spec.name
            ),
        ),
    }
}

pub fn tool_call(spec: &ToolSpec, log: Option<&ToolCallLog>) -> Row {
    let s = tool_subject(&spec.name);
    let Some(log) = log else {
        return Row::skip(s, "CallTool", "not called: no valid arguments");
    };
    let rewritten = if log.rewritten {
        " (arguments as rewritten by its tool_call verdict)"
    } else {
        ""
    };
    match &log.result {
        Err(f) => Row::fail(s, "CallTool", format!("{}{rewritten}", fault(f))),
        Ok(r) if r.is_error => Row::fail(
            s,
            "CallTool",
            format!(
                "is_error result for valid arguments {}{rewritten}: {}",
                log.arguments_json,
                short(&r.content)
            ),
        ),
        Ok(_) if log.latency > log.deadline => Row::fail(
            s,
            "CallTool",
            format!(
                "deadline: answered after {}, past the {} deadline",
                ms(log.latency),
                ms(log.deadline)
            ),
        ),
        Ok(r) => Row::pass(
            s,
            "CallTool",
            format!(
                "ok in {}{rewritten}: {}",
                ms(log.latency),
                short(&r.content)
            ),
        ),
    }
}

/// Every check of one recorded stream, in the order things happened.
pub fn stream(log: &StreamLog) -> Vec<Row> {
    let mut rows = Vec::new();
    if let StreamEnd::Failed {
        fault: f,
        opening: true,
        ..
    } = &log.end
    {
        rows.push(Row::fail(&log.name, "opens", fault(f)));
        for ev in &log.events {
            rows.push(Row::skip(
                &ev.subject,
                "delivered",
                "not delivered: the stream did not open",
            ));
        }
        return rows;
    }
    rows.push(Row::pass(
        &log.name,
        "opens",
        "Process opened with the first event queued, as hookwire opens it",
    ));
    for ev in &log.events {
        let answers: Vec<&Arrival> = log
            .arrivals
            .iter()
            .filter(|a| a.verdict.seq == ev.seq)
            .collect();
        if ev.expects_verdict {
            rows.extend(blocking(ev, &answers, &log.end));
        } else if answers.is_empty() {
            rows.push(Row::pass(
                &ev.subject,
                "no verdict",
                "not answered (observe-only)",
            ));
        } else {
            rows.push(Row::fail(
                &ev.subject,
                "no verdict",
                format!(
                    "spurious: answered {} (seq {}), which expects no verdict",
                    ev.kind, ev.seq
                ),
            ));
        }
    }
    for group in &log.together {
        rows.push(together(log, group));
    }
    let mut unknown: Vec<u64> = log
        .arrivals
        .iter()
        .map(|a| a.verdict.seq)
        .filter(|seq| !log.events.iter().any(|e| e.seq == *seq))
        .collect();
    unknown.dedup();
    rows.push(if unknown.is_empty() {
        Row::pass(
            &log.name,
            "verdict seqs",
            "every verdict echoed a seq that was sent",
        )
    } else {
        Row::fail(
            &log.name,
            "verdict seqs",
            format!(
                "spurious: verdict for seq {}, which was never sent",
                unknown
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    });
    rows.push(closing(&log.name, &log.end));
    rows
}

fn blocking(ev: &SentEvent, answers: &[&Arrival], end: &StreamEnd) -> Vec<Row> {
    let deadline = ms(ev.deadline);
    let Some(first) = answers.first() else {
        let why = match end {
            StreamEnd::Early { at } | StreamEnd::Failed { at, .. }
                if *at <= ev.sent_at + ev.waited =>
            {
                format!(
                    "stream_reset: no verdict for seq {}; the stream ended first ({})",
                    ev.seq,
                    end_text(end)
                )
            }
            _ => format!(
                "deadline: no verdict for seq {} within {} (deadline sent: {deadline})",
                ev.seq,
                ms(ev.waited)
            ),
        };
        return vec![
            Row::fail(&ev.subject, "answered in time", why),
            Row::skip(&ev.subject, "verdict", "no verdict to judge"),
            Row::skip(&ev.subject, "one verdict", "no verdict to count"),
        ];
    };
    let took = first.at.saturating_duration_since(ev.sent_at);
    let timely = if took <= ev.deadline {
        Row::pass(
            &ev.subject,
            "answered in time",
            format!("in {} (deadline {deadline})", ms(took)),
        )
    } else {
        Row::fail(
            &ev.subject,
            "answered in time",
            format!(
                "deadline: verdict for seq {} came after {}, past the {deadline} deadline it was sent; hookwire discards it",
                ev.seq,
                ms(took)
            ),
        )
    };
    let judged = match judge_alone(
        ev.kind,
        first.verdict.clone(),
        ev.payload.as_ref(),
        ev.scratchpad.as_ref(),
    ) {
        Ok(v) => Row::pass(&ev.subject, "verdict", verdict_text(&v)),
        Err(f) => Row::fail(&ev.subject, "verdict", fault(&f)),
    };
    let once = if answers.len() == 1 {
        Row::pass(
            &ev.subject,
            "one verdict",
            format!("seq {} answered once", ev.seq),
        )
    } else {
        Row::fail(
            &ev.subject,
            "one verdict",
            format!("duplicate: {} verdicts for seq {}", answers.len(), ev.seq),
        )
    };
    vec![timely, judged, once]
}

/// Several events in flight at once on one stream (hookwire's concurrent
/// tool calls): each must get exactly one verdict, by its own seq.
fn together(log: &StreamLog, seqs: &[u64]) -> Row {
    let check = "concurrent events";
    let kinds: Vec<&str> = seqs
        .iter()
        .filter_map(|seq| log.events.iter().find(|e| e.seq == *seq))
        .map(|e| e.kind.name())
        .collect();
    let kind = if kinds.windows(2).all(|w| w[0] == w[1]) {
        kinds.first().copied().unwrap_or("blocking")
    } else {
        "blocking"
    };
    let problems: Vec<String> = seqs
        .iter()
        .filter_map(|seq| {
            match log
                .arrivals
                .iter()
                .filter(|a| a.verdict.seq == *seq)
                .count()
            {
                1 => None,
                0 => Some(format!("seq {seq} got no verdict")),
                n => Some(format!("seq {seq} got {n} verdicts")),
            }
        })
        .collect();
    if problems.is_empty() {
        Row::pass(
            &log.name,
            check,
            format!(
                "{} {kind} events in flight at once, each answered once by its own seq",
                seqs.len()
            ),
        )
    } else {
        Row::fail(
            &log.name,
            check,
            format!(
                "{} {kind} events in flight at once (as with tool_concurrency > 1): {}; read every event as it arrives and answer each by its own seq, in any order",
                seqs.len(),
                problems.join(", ")
            ),
        )
    }
}

fn verdict_text(v: &Verdict) -> String {
    let mut s = v.action.kind_name().to_string();
    if let Action::ToolCall(ToolCallAction::Ask(ask)) = &v.action {
        s.push_str(&format!(
            " \"{}\" (approved by the checker, as a client would)",
            short(&ask.question)
        ));
    }
    if !v.meta.reason.is_empty() {
        s.push_str(&format!(" — {}", short(&v.meta.reason)));
    }
    s
}

fn end_text(end: &StreamEnd) -> String {
    match end {
        StreamEnd::Early { .. } => "the hook server ended it with OK".into(),
        StreamEnd::Failed { fault: f, .. } => fault(f),
        StreamEnd::Clean { .. } => "ended with OK".into(),
        StreamEnd::NotClosed { .. } => "still open".into(),
    }
}

fn closing(name: &str, end: &StreamEnd) -> Row {
    let check = "closes cleanly";
    match end {
        StreamEnd::Clean { after } => Row::pass(
            name,
            check,
            format!("ended with OK {} after the half-close", ms(*after)),
        ),
        StreamEnd::Early { .. } => Row::fail(
            name,
            check,
            "stream_reset: the hook server ended the stream before hookwire half-closed it; end your side only when the event stream ends",
        ),
        StreamEnd::Failed { fault: f, .. } => Row::fail(name, check, fault(f)),
        StreamEnd::NotClosed { waited } => Row::fail(
            name,
            check,
            format!(
                "still open {} after the half-close; return from the handler when the event stream ends",
                ms(*waited)
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    fn event(seq: u64, kind: EventKind) -> SentEvent {
        SentEvent {
            seq,
            kind,
            subject: kind.name().into(),
            expects_verdict: kind.is_blocking(),
            deadline: Duration::from_millis(100),
            sent_at: Instant::now(),
            waited: Duration::from_millis(150),
            payload: None,
            scratchpad: None,
        }
    }

    fn proceed_run_start(seq: u64) -> pb::HookVerdict {
        pb::HookVerdict {
            seq,
            verdict: Some(pb::hook_verdict::Verdict::RunStart(pb::RunStartVerdict {
                action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
            })),
            ..Default::default()
        }
    }

    fn log(events: Vec<SentEvent>, arrivals: Vec<(pb::HookVerdict, Duration)>) -> StreamLog {
        let t0 = events[0].sent_at;
        StreamLog {
            name: "run stream".into(),
            arrivals: arrivals
                .into_iter()
                .map(|(verdict, after)| Arrival {
                    verdict,
                    at: t0 + after,
                })
                .collect(),
            events,
            end: StreamEnd::Clean {
                after: Duration::from_millis(1),
            },
            half_closed_at: None,
            together: Vec::new(),
        }
    }

    fn find<'a>(rows: &'a [Row], subject: &str, check: &str) -> &'a Row {
        rows.iter()
            .find(|r| r.subject == subject && r.check == check)
            .unwrap_or_else(|| panic!("no row {subject}/{check} in {rows:#?}"))
    }

    /// A kind this hookwire does not know (a server built against a newer
    /// contract) is noted, not failed: hookwire ignores it. Only 0 fails.
    #[test]
    fn describe_notes_newer_event_kinds_and_fails_only_unspecified() {
        use crate::conformance::report::Status;
        let newer = pb::DescribeResponse {
            name: "h".into(),
            events: vec![pb::EventKind::RunStart as i32, 999],
            ..Default::default()
        };
        let row = describe(&newer, Duration::ZERO)
            .into_iter()
            .find(|r| r.check == "events")
            .unwrap();
        assert_eq!(row.status, Status::Pass, "{row:?}");
        assert!(
            row.reason.starts_with("run_start; kind(s) 999 are unknown"),
            "{row:?}"
        );
        let unspecified = pb::DescribeResponse {
            events: vec![0, pb::EventKind::RunStart as i32],
            ..newer
        };
        let row = describe(&unspecified, Duration::ZERO)
            .into_iter()
            .find(|r| r.check == "events")
            .unwrap();
        assert_eq!(row.status, Status::Fail, "{row:?}");
    }

    #[test]
    fn a_good_exchange_passes_everything() {
        let rows = stream(&log(
            vec![event(1, EventKind::RunStart), event(2, EventKind::RunEnd)],
            vec![(proceed_run_start(1), Duration::from_millis(5))],
        ));
        assert!(
            rows.iter()
                .all(|r| r.status == crate::conformance::report::Status::Pass),
            "{rows:#?}"
        );
        assert_eq!(find(&rows, "run_start", "verdict").reason, "continue");
    }

    #[test]
    fn late_duplicate_spurious_and_observe_answers_fail_with_their_class() {
        let mut observe_answer = proceed_run_start(2);
        observe_answer.seq = 2;
        let rows = stream(&log(
            vec![event(1, EventKind::RunStart), event(2, EventKind::RunEnd)],
            vec![
                (proceed_run_start(1), Duration::from_millis(130)),
                (proceed_run_start(1), Duration::from_millis(131)),
                (proceed_run_start(77), Duration::from_millis(132)),
                (observe_answer, Duration::from_millis(133)),
            ],
        ));
        let late = find(&rows, "run_start", "answered in time");
        assert!(
            late.reason
                .starts_with("deadline: verdict for seq 1 came after 130 ms"),
            "{}",
            late.reason
        );
        assert!(find(&rows, "run_start", "one verdict")
            .reason
            .starts_with("duplicate: 2 verdicts"));
        assert!(find(&rows, "run stream", "verdict seqs")
            .reason
            .contains("seq 77"));
        assert!(find(&rows, "run_end", "no verdict")
            .reason
            .starts_with("spurious: answered run_end"));
    }

    #[test]
    fn events_in_flight_together_must_each_get_their_own_verdict() {
        let mut l = log(
            vec![
                event(1, EventKind::RunStart),
                event(2, EventKind::RunStart),
                event(3, EventKind::RunStart),
            ],
            vec![
                (proceed_run_start(1), Duration::from_millis(1)),
                (proceed_run_start(2), Duration::from_millis(2)),
                (proceed_run_start(3), Duration::from_millis(3)),
            ],
        );
        l.together = vec![vec![1, 2, 3]];
        let row = find(&stream(&l), "run stream", "concurrent events").clone();
        assert_eq!(row.status, crate::conformance::report::Status::Pass);
        assert!(row
            .reason
            .starts_with("3 run_start events in flight at once"));
        // A server that answers the latest event's seq for each of them.
        l.arrivals.iter_mut().for_each(|a| a.verdict.seq = 3);
        let row = find(&stream(&l), "run stream", "concurrent events").clone();
        assert_eq!(row.status, crate::conformance::report::Status::Fail);
        assert!(
            row.reason
                .contains("seq 1 got no verdict, seq 2 got no verdict, seq 3 got 3 verdicts"),
            "{}",
            row.reason
        );
    }

    #[test]
    fn wrong_kind_reads_like_the_engine() {
        let rows = stream(&log(
            vec![event(1, EventKind::ToolCall)],
            vec![(proceed_run_start(1), Duration::from_millis(1))],
        ));
        assert_eq!(
            find(&rows, "tool_call", "verdict").reason,
            "wrong_kind: answered a run_start verdict to a tool_call event"
        );
    }

    #[test]
    fn no_answer_is_a_deadline_or_a_reset() {
        let rows = stream(&log(vec![event(1, EventKind::RunStart)], vec![]));
        assert!(find(&rows, "run_start", "answered in time")
            .reason
            .starts_with("deadline: no verdict for seq 1"));
        let mut l = log(vec![event(1, EventKind::RunStart)], vec![]);
        l.end = StreamEnd::Failed {
            fault: Fault::new(FailureClass::Status, "Internal: boom"),
            at: l.events[0].sent_at,
            opening: false,
        };
        let rows = stream(&l);
        assert!(find(&rows, "run_start", "answered in time")
            .reason
            .contains("stream ended first (status: Internal: boom)"));
        assert_eq!(
            find(&rows, "run stream", "closes cleanly").reason,
            "status: Internal: boom"
        );
    }

    #[test]
    fn health_serving_passes_and_not_served_only_skips() {
        use crate::conformance::report::Status as S;
        assert_eq!(health("", &Health::Status(1)).status, S::Pass);
        assert_eq!(
            health("", &Health::Status(2)).reason,
            "NOT_SERVING, not SERVING"
        );
        assert_eq!(health("", &Health::NotServed).status, S::Skip);
        let r = health("hookwire.v1.HookService", &Health::UnknownService);
        assert_eq!(
            (r.status, r.check.as_str()),
            (S::Fail, "Check(hookwire.v1.HookService)")
        );
    }

    #[test]
    fn describe_flags_unknown_events_and_nameless_servers() {
        let d = pb::DescribeResponse {
            name: " ".into(),
            events: vec![2, 99],
            ..Default::default()
        };
        let rows = describe(&d, Duration::from_millis(1));
        assert!(find(&rows, "describe", "name")
            .reason
            .starts_with("name is empty"));
        assert!(find(&rows, "describe", "events").reason.contains("99"));
        let rows = requested_events(&[EventKind::TurnEnd], &[EventKind::RunStart]);
        assert_eq!(rows[0].check, "subscribes to turn_end");
    }
}
