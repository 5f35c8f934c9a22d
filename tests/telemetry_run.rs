//! Telemetry of real runs, exported over OTLP to an in-test collector: the
//! span tree, content recorded only after hooks (rewrite and telemetry-only
//! redaction), no content with capture off or on terminate, trace context in
//! hook events, logs free of content (an `ask`'s question included), and
//! metrics on the admin port.
//!
//! One test function: the subscriber is process-global (the server spawns
//! tasks on every worker thread), so the scenarios share one pipeline and
//! tell their spans apart by trace.

mod support;

#[path = "support/otlp.rs"]
mod otlp;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use hookwire::telemetry::{attrs, build, LogFormat, TelemetryOptions};
use otlp::{CollectedSpan, Collector, LogCapture};
use pb::EventKind as K;
use support::*;

const SECRET: &str = "SENTINEL-SECRET-4242";
const TEL_SECRET: &str = "SENTINEL-TELEMETRY-7777";
/// An `ask.question`: hook text, which may quote the call's arguments.
const QUESTION: &str = "send SENTINEL-QUESTION-5151 to the weather service?";

fn secret_owner(secret: &'static str) -> FnHook {
    FnHook::new("owner", &[]).with_tool(weather_tool(), move |_, _| async move {
        pb::CallToolResponse {
            content: format!("sunny, key={secret}"),
            is_error: false,
        }
    })
}

/// The spans of the run whose invoke_agent span has this conversation id.
fn run_spans(all: &[CollectedSpan], session: &str) -> Vec<CollectedSpan> {
    let root = all
        .iter()
        .find(|s| {
            s.name.starts_with("invoke_agent")
                && s.attr(attrs::GEN_AI_CONVERSATION_ID) == Some(session)
        })
        .unwrap_or_else(|| panic!("no invoke_agent span for session {session}"));
    all.iter()
        .filter(|s| s.trace_id == root.trace_id)
        .cloned()
        .collect()
}

fn one<'a>(spans: &'a [CollectedSpan], name: &str) -> &'a CollectedSpan {
    let v: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(
        v.len(),
        1,
        "expected one `{name}`: {:?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    v[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_export_genai_spans_without_leaking_content() {
    let collector = Collector::start().await;
    let mut opts = TelemetryOptions::new(LogFormat::Text);
    opts.otlp_endpoint = Some(collector.endpoint());
    opts.log_filter = "info".into();
    let logs = LogCapture::default();
    let (dispatch, telemetry) = build(&opts, logs.writer()).unwrap();
    tracing::dispatcher::set_global_default(dispatch).unwrap();

    // A: capture on, a hook rewrites the secret tool result.
    let owner = secret_owner(SECRET).start().await;
    let seen_trace = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let st = seen_trace.clone();
    let redactor = FnHook::new("redactor", &[K::ToolResult, K::RunStart])
        .on_tool_result(|_, ev| async move {
            Reply::new(hook_server::rewrite_result(
                ev.result.unwrap().content.replace(SECRET, "[redacted]"),
            ))
        })
        .on_run_start(move |ctx, _| {
            *st.lock().unwrap() = ctx.traceparent.clone();
            async {
                Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let yaml = config(
        &[("owner", &owner.addr, ""), ("redactor", &redactor.addr, "")],
        "tools: [get_weather]",
    )
    .replace("hooks:\n", "telemetry:\n  capture_content: true\nhooks:\n");
    let (server, admin_addr) = TestServer::start_with_admin(&yaml).await;
    let mut c = server.client().await;
    let before = http_get(admin_addr, "/metrics").await;
    let sa = session(&mut c, "a").await;
    let events = run_events(&mut c, &sa, "weather").await;
    assert!(
        !format!("{events:?}").contains(SECRET),
        "the rewritten secret never reached the client"
    );
    let r = result_of(&events);
    assert_eq!(r.final_text, "Tool said: sunny, key=[redacted]");

    // B: capture on, telemetry-only redaction on every content event: the
    // model sees the real value; telemetry sees only the redactions.
    let owner_b = secret_owner(TEL_SECRET).start().await;
    let tel = FnHook::new("tel", &[K::ToolResult, K::ModelRequest, K::ModelResponse])
        .on_tool_result(|_, _| async {
            Reply::new(pb::ToolResultVerdict {
                action: Some(pb::tool_result_verdict::Action::Proceed(pb::Continue {})),
            })
            .redact_telemetry("[tel-result]")
        })
        .on_model_request(|_, _| async {
            Reply::new(pb::ModelRequestVerdict {
                action: Some(pb::model_request_verdict::Action::Proceed(pb::Continue {})),
            })
            .redact_telemetry("[tel-input]")
        })
        .on_model_response(|_, _| async {
            Reply::new(pb::ModelResponseVerdict {
                action: Some(pb::model_response_verdict::Action::Proceed(pb::Continue {})),
            })
            .redact_telemetry("[tel-output]")
        })
        .start()
        .await;
    let yaml_b = config(
        &[("owner", &owner_b.addr, ""), ("tel", &tel.addr, "")],
        "tools: [get_weather]",
    )
    .replace("hooks:\n", "telemetry:\n  capture_content: true\nhooks:\n");
    let server_b = TestServer::start(&yaml_b).await;
    let mut cb = server_b.client().await;
    let sb = session(&mut cb, "a").await;
    let rb = invoke(&mut cb, &sb, "weather").await;
    assert!(
        rb.final_text.contains(TEL_SECRET),
        "telemetry-only redaction leaves the run's data alone"
    );

    // C: capture off.
    let server_c = TestServer::start(&config(
        &[("owner", &owner.addr, "")],
        "tools: [get_weather]",
    ))
    .await;
    let mut cc = server_c.client().await;
    let sc = session(&mut cc, "a").await;
    invoke(&mut cc, &sc, "weather").await;

    // D: capture on, terminate on tool_result: no result content at all.
    let term = FnHook::new("term", &[K::ToolResult])
        .on_tool_result(|_, _| async {
            Reply::new(pb::ToolResultVerdict {
                action: Some(pb::tool_result_verdict::Action::Terminate(
                    hook_server::terminate("leak", None),
                )),
            })
        })
        .start()
        .await;
    let yaml_d = config(
        &[("owner", &owner.addr, ""), ("term", &term.addr, "")],
        "tools: [get_weather]",
    )
    .replace("hooks:\n", "telemetry:\n  capture_content: true\nhooks:\n");
    let server_d = TestServer::start(&yaml_d).await;
    let mut cd = server_d.client().await;
    let sd = session(&mut cd, "a").await;
    assert_eq!(
        outcome(&invoke(&mut cd, &sd, "weather").await),
        pb::RunOutcome::Terminated
    );

    // E: capture on, an Invoke whose hook asks and nobody answers: the call
    // is denied at the ask's timeout, and the question goes nowhere.
    let ask = asker(QUESTION, 200).start().await;
    let yaml_e = config(
        &[("owner", &owner.addr, ""), ("asker", &ask.addr, "")],
        "tools: [get_weather]",
    )
    .replace("hooks:\n", "telemetry:\n  capture_content: true\nhooks:\n");
    let server_e = TestServer::start(&yaml_e).await;
    let mut ce = server_e.client().await;
    let se = session(&mut ce, "a").await;
    let re = invoke(&mut ce, &se, "weather").await;
    assert!(
        re.final_text
            .contains("approval for tool `get_weather` timed out after 200ms and was denied"),
        "{re:?}"
    );

    let after = http_get(admin_addr, "/metrics").await;
    for s in [server, server_b, server_c, server_d, server_e] {
        s.stop().await;
    }
    telemetry.flush().await.unwrap();
    let all = collector.spans();

    // The span tree of run A.
    let a = run_spans(&all, &sa);
    let root = a.iter().find(|s| s.name == "invoke_agent a").unwrap();
    assert_eq!(root.kind, "internal");
    assert_eq!(
        root.attr(attrs::GEN_AI_OPERATION_NAME),
        Some("invoke_agent")
    );
    assert_eq!(root.attr(attrs::GEN_AI_PROVIDER_NAME), Some("scripted"));
    assert_eq!(root.attr(attrs::HOOKWIRE_RUN_OUTCOME), Some("completed"));
    let chats: Vec<_> = a.iter().filter(|s| s.name == "chat m").collect();
    assert_eq!(chats.len(), 2);
    for c in &chats {
        assert_eq!(c.kind, "client");
        assert_eq!(c.parent_span_id, root.span_id);
        assert_eq!(c.attr_count(attrs::GEN_AI_INPUT_MESSAGES), 1);
        assert_eq!(c.attr_count(attrs::GEN_AI_OUTPUT_MESSAGES), 1);
        assert!(c.attr(attrs::GEN_AI_USAGE_OUTPUT_TOKENS).is_some());
    }
    let tool = one(&a, "execute_tool get_weather");
    assert_eq!(tool.parent_span_id, root.span_id);
    assert_eq!(tool.attr(attrs::GEN_AI_TOOL_NAME), Some("get_weather"));
    assert_eq!(
        tool.attr_count(attrs::GEN_AI_TOOL_CALL_RESULT),
        1,
        "set exactly once"
    );
    assert_eq!(
        tool.attr(attrs::GEN_AI_TOOL_CALL_RESULT),
        Some("sunny, key=[redacted]")
    );
    assert_eq!(
        tool.attr(attrs::GEN_AI_TOOL_CALL_ARGUMENTS),
        Some(r#"{"city":"Paris"}"#)
    );
    let hook = one(&a, "hook redactor tool_result");
    assert_eq!(
        hook.parent_span_id, tool.span_id,
        "tool hooks sit under their tool span"
    );
    assert_eq!(
        hook.attr(attrs::HOOKWIRE_HOOK_VERDICT),
        Some("rewrite_result")
    );
    let rs = one(&a, "hook redactor run_start");
    assert_eq!(rs.parent_span_id, root.span_id);
    // The hook received its own span's trace context.
    let tp = seen_trace.lock().unwrap().clone();
    assert_eq!(tp, format!("00-{}-{}-01", rs.trace_id, rs.span_id));

    // Run B: only the redactions.
    let b = run_spans(&all, &sb);
    let tool_b = one(&b, "execute_tool get_weather");
    assert_eq!(
        tool_b.attr(attrs::GEN_AI_TOOL_CALL_RESULT),
        Some("[tel-result]")
    );
    // Redactions replace the content inside the GenAI message shape.
    let text_of = |c: &CollectedSpan, key: &str| -> serde_json::Value {
        let v: serde_json::Value = serde_json::from_str(c.attr(key).unwrap()).unwrap();
        v[0]["parts"][0]["content"].clone()
    };
    let chats_b: Vec<_> = b.iter().filter(|s| s.name == "chat m").collect();
    assert_eq!(chats_b.len(), 2, "both model calls of run B");
    for c in chats_b {
        assert_eq!(
            text_of(c, attrs::GEN_AI_INPUT_MESSAGES),
            "[tel-input]",
            "{c:?}"
        );
        assert_eq!(
            text_of(c, attrs::GEN_AI_OUTPUT_MESSAGES),
            "[tel-output]",
            "{c:?}"
        );
    }

    // Run C: no content attribute at all.
    for s in run_spans(&all, &sc) {
        for key in attrs::CONTENT_KEYS {
            assert!(
                s.attr(key).is_none(),
                "{} carries {key} with capture off",
                s.name
            );
        }
    }

    // Run D: the terminated result is not recorded.
    let d = run_spans(&all, &sd);
    let tool_d = one(&d, "execute_tool get_weather");
    assert!(tool_d.attr(attrs::GEN_AI_TOOL_CALL_RESULT).is_none());
    assert_eq!(
        one(&d, "invoke_agent a").attr(attrs::HOOKWIRE_RUN_OUTCOME),
        Some("terminated")
    );

    // Nothing anywhere: not in any exported byte, not in the logs.
    assert!(
        !collector.raw_contains(SECRET.as_bytes()),
        "rewritten secret exported"
    );
    assert!(
        !collector.raw_contains(TEL_SECRET.as_bytes()),
        "telemetry-redacted secret exported"
    );
    // Run E's span tree exists, and its question is in no span or log.
    one(&run_spans(&all, &se), "execute_tool get_weather");
    assert!(
        !collector.raw_contains(QUESTION.as_bytes()),
        "an ask's question exported"
    );
    let log = logs.contents();
    assert!(
        !log.contains(SECRET) && !log.contains(TEL_SECRET),
        "content in logs"
    );
    assert!(
        !log.contains("SENTINEL-QUESTION"),
        "an ask's question in logs"
    );
    assert!(
        log.contains("hookwire serving"),
        "logs were captured at info"
    );

    // Metrics moved.
    let count = |text: &str, series: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let series = r#"hookwire_hook_call_duration_seconds_count{hook="redactor",event="tool_result",outcome="ok"}"#;
    assert_eq!(count(&before, series), 0.0);
    assert_eq!(count(&after, series), 1.0, "{after}");
    assert!(
        count(
            &after,
            r#"hookwire_runs_total{agent="a",outcome="completed"}"#
        ) >= 1.0
    );
    assert!(after.contains("hookwire_model_call_duration_seconds"));

    telemetry.shutdown().await;
}
