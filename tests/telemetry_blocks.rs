//! The telemetry building blocks through the real pipeline: tracing spans ->
//! tracing-opentelemetry -> batch processor -> OTLP/gRPC exporter -> an
//! in-test collector on port 0. Each test builds its own pipeline (no global
//! subscriber), so they run in parallel in one process.

#[path = "support/otlp.rs"]
mod otlp;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hookwire::telemetry::spans::{self, ContentCapture};
use hookwire::telemetry::{
    attrs, build, propagation, serve_admin, HookSpan, LogFormat, Metrics, Sampling, Telemetry,
    TelemetryError, TelemetryOptions,
};
use opentelemetry_proto::tonic::common::v1::any_value;
use otlp::{CollectedSpan, Collector, LogCapture};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::dispatcher::with_default;
use tracing::Dispatch;

const WAIT: Duration = Duration::from_secs(10);

struct Pipeline {
    collector: Collector,
    dispatch: Dispatch,
    telemetry: Telemetry,
    logs: LogCapture,
}

async fn pipeline(configure: impl FnOnce(&mut TelemetryOptions)) -> Pipeline {
    let collector = Collector::start().await;
    let mut opts = TelemetryOptions::new(LogFormat::Text);
    opts.otlp_endpoint = Some(collector.endpoint());
    opts.service_name = "hookwire-test".into();
    configure(&mut opts);
    let logs = LogCapture::default();
    let (dispatch, telemetry) = build(&opts, logs.writer()).expect("telemetry pipeline");
    assert!(telemetry.is_exporting());
    Pipeline {
        collector,
        dispatch,
        telemetry,
        logs,
    }
}

impl Pipeline {
    async fn flush(&self) {
        self.telemetry.flush().await.expect("flush");
    }

    fn only(&self, name: &str) -> CollectedSpan {
        let matching: Vec<_> = self
            .collector
            .spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect();
        assert_eq!(
            matching.len(),
            1,
            "expected one `{name}` span: {matching:#?}"
        );
        matching.into_iter().next().unwrap()
    }
}

#[tokio::test]
async fn span_tree_names_kinds_and_attributes_are_exported() {
    let p = pipeline(|o| {
        o.resource_attributes = vec![("deployment.environment.name".into(), "test".into())];
    })
    .await;

    with_default(&p.dispatch, || {
        let run = spans::invoke_agent("support", "openai", "sess-1", "run-1");
        run.in_scope(|| {
            let chat = spans::chat("gpt-x", "openai");
            spans::record_chat_response(
                &chat,
                "gpt-x-0613",
                "chatcmpl-9",
                &["tool_calls"],
                Some(42),
                Some(7),
            );
            drop(chat);

            let tool = spans::execute_tool("lookup", "call-1");
            tool.in_scope(|| {
                let mut hook = HookSpan::start("redact", "tool_result");
                hook.record_result("rewrite_result", "ok", Duration::from_micros(2500));
                hook.add_event(
                    "hook.failed_open",
                    &[
                        (attrs::HOOKWIRE_HOOK_NAME, "redact"),
                        (attrs::HOOKWIRE_HOOK_EVENT, "tool_result"),
                        ("hookwire.hook.failure_class", "deadline"),
                    ],
                );
            });
        });
        spans::record_run_outcome(&run, "hook_failed", Some("hook_failed"));
    });
    p.flush().await;

    let run = p.only("invoke_agent support");
    let chat = p.only("chat gpt-x");
    let tool = p.only("execute_tool lookup");
    let hook = p.only("hook redact tool_result");

    // Kinds and structure: one trace, run at the root.
    assert_eq!(run.kind, "internal");
    assert_eq!(chat.kind, "client");
    assert_eq!(tool.kind, "internal");
    assert_eq!(hook.kind, "client");
    assert_eq!(run.parent_span_id, "");
    assert_eq!(chat.parent_span_id, run.span_id);
    assert_eq!(tool.parent_span_id, run.span_id);
    assert_eq!(hook.parent_span_id, tool.span_id);
    for s in [&chat, &tool, &hook] {
        assert_eq!(s.trace_id, run.trace_id);
    }

    // invoke_agent
    assert_eq!(run.attr(attrs::GEN_AI_OPERATION_NAME), Some("invoke_agent"));
    assert_eq!(run.attr(attrs::GEN_AI_PROVIDER_NAME), Some("openai"));
    assert_eq!(run.attr(attrs::GEN_AI_AGENT_NAME), Some("support"));
    assert_eq!(run.attr(attrs::GEN_AI_CONVERSATION_ID), Some("sess-1"));
    assert_eq!(run.attr(attrs::HOOKWIRE_RUN_ID), Some("run-1"));
    assert_eq!(run.attr(attrs::HOOKWIRE_RUN_OUTCOME), Some("hook_failed"));
    assert_eq!(run.attr(attrs::ERROR_TYPE), Some("hook_failed"));
    assert_eq!(run.status, "error");

    // chat
    assert_eq!(chat.attr(attrs::GEN_AI_OPERATION_NAME), Some("chat"));
    assert_eq!(chat.attr(attrs::GEN_AI_REQUEST_MODEL), Some("gpt-x"));
    assert_eq!(chat.attr(attrs::GEN_AI_RESPONSE_MODEL), Some("gpt-x-0613"));
    assert_eq!(chat.attr(attrs::GEN_AI_RESPONSE_ID), Some("chatcmpl-9"));
    assert_eq!(
        chat.attr(attrs::GEN_AI_RESPONSE_FINISH_REASONS),
        Some("[tool_calls]")
    );
    assert_eq!(chat.attr(attrs::GEN_AI_USAGE_INPUT_TOKENS), Some("42"));
    assert_eq!(chat.attr(attrs::GEN_AI_USAGE_OUTPUT_TOKENS), Some("7"));
    assert_eq!(chat.status, "unset");
    // Token counts are ints on the wire (u64 fields would arrive as strings).
    let chat_attr_type = |key: &str| {
        p.collector
            .requests()
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|rs| &rs.scope_spans)
            .flat_map(|ss| &ss.spans)
            .filter(|s| s.name == "chat gpt-x")
            .flat_map(|s| &s.attributes)
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.clone()?.value)
    };
    assert!(matches!(
        chat_attr_type(attrs::GEN_AI_USAGE_INPUT_TOKENS),
        Some(any_value::Value::IntValue(42))
    ));
    assert!(matches!(
        chat_attr_type(attrs::GEN_AI_RESPONSE_FINISH_REASONS),
        Some(any_value::Value::ArrayValue(_))
    ));

    // execute_tool
    assert_eq!(
        tool.attr(attrs::GEN_AI_OPERATION_NAME),
        Some("execute_tool")
    );
    assert_eq!(tool.attr(attrs::GEN_AI_TOOL_NAME), Some("lookup"));
    assert_eq!(tool.attr(attrs::GEN_AI_TOOL_CALL_ID), Some("call-1"));

    // hook
    assert_eq!(hook.attr(attrs::HOOKWIRE_HOOK_NAME), Some("redact"));
    assert_eq!(hook.attr(attrs::HOOKWIRE_HOOK_EVENT), Some("tool_result"));
    assert_eq!(
        hook.attr(attrs::HOOKWIRE_HOOK_VERDICT),
        Some("rewrite_result")
    );
    assert_eq!(hook.attr(attrs::HOOKWIRE_HOOK_OUTCOME), Some("ok"));
    assert_eq!(hook.attr(attrs::HOOKWIRE_HOOK_LATENCY_MS), Some("2.5"));
    let event = hook.event("hook.failed_open").expect("span event");
    assert_eq!(event.attr("hookwire.hook.failure_class"), Some("deadline"));

    // The kinds OpenInference backends (Phoenix) group spans by.
    for (span, kind) in [
        (&run, "AGENT"),
        (&chat, "LLM"),
        (&tool, "TOOL"),
        (&hook, "GUARDRAIL"),
    ] {
        assert_eq!(
            span.attr(attrs::OPENINFERENCE_SPAN_KIND),
            Some(kind),
            "{}",
            span.name
        );
    }

    // No per-span poll bookkeeping (tracing-opentelemetry's busy/idle
    // timings) next to the real attributes.
    for s in [&run, &chat, &tool, &hook] {
        for noise in ["busy_ns", "idle_ns"] {
            assert_eq!(s.attr(noise), None, "{noise} on {}", s.name);
        }
    }

    // No attribute is set twice on any span.
    for s in [&run, &chat, &tool, &hook] {
        for (key, _) in &s.attributes {
            assert_eq!(s.attr_count(key), 1, "{key} duplicated on {}", s.name);
        }
    }

    // Resource: service name and OTEL_RESOURCE_ATTRIBUTES-style extras.
    assert_eq!(run.resource_attr("service.name"), Some("hookwire-test"));
    assert_eq!(
        run.resource_attr("deployment.environment.name"),
        Some("test")
    );
    assert!(run.resource_attr("service.version").is_some());

    p.telemetry.shutdown().await;
}

#[tokio::test]
async fn content_capture_off_exports_no_content_attribute() {
    const SECRET: &str = "sentinel-off-7d1c";
    let p = pipeline(|_| {}).await;
    let capture = ContentCapture::new(false);

    with_default(&p.dispatch, || {
        let chat = spans::chat("m", "scripted");
        capture.record(&chat, attrs::GEN_AI_INPUT_MESSAGES, SECRET);
        capture.record(&chat, attrs::GEN_AI_OUTPUT_MESSAGES, SECRET);
        capture.record(&chat, attrs::GEN_AI_SYSTEM_INSTRUCTIONS, SECRET);
        let tool = spans::execute_tool("t", "c1");
        capture.record(&tool, attrs::GEN_AI_TOOL_CALL_ARGUMENTS, SECRET);
        capture.record(&tool, attrs::GEN_AI_TOOL_CALL_RESULT, SECRET);
    });
    p.flush().await;

    let spans = p.collector.spans();
    assert_eq!(spans.len(), 2);
    for span in &spans {
        for key in attrs::CONTENT_KEYS {
            assert_eq!(span.attr_count(key), 0, "{key} on {}", span.name);
        }
    }
    assert!(!p.collector.raw_contains(SECRET.as_bytes()));
    assert!(!p.logs.contents().contains(SECRET));
    p.telemetry.shutdown().await;
}

#[tokio::test]
async fn content_capture_on_sets_each_key_exactly_once_and_never_logs_it() {
    const SECRET: &str = "sentinel-on-55ab";
    let p = pipeline(|_| {}).await;
    let capture = ContentCapture::new(true);

    with_default(&p.dispatch, || {
        let chat = spans::chat("m", "scripted");
        tracing::info!("chat started");
        capture.record(&chat, attrs::GEN_AI_INPUT_MESSAGES, &format!("in {SECRET}"));
        capture.record(&chat, attrs::GEN_AI_OUTPUT_MESSAGES, "out");
        capture.record(&chat, attrs::GEN_AI_SYSTEM_INSTRUCTIONS, "sys");
        chat.in_scope(|| tracing::info!("chat finished"));
        let tool = spans::execute_tool("t", "c1");
        capture.record(&tool, attrs::GEN_AI_TOOL_CALL_ARGUMENTS, "{\"q\":1}");
        capture.record(&tool, attrs::GEN_AI_TOOL_CALL_RESULT, "[redacted]");
        tool.in_scope(|| tracing::info!("tool finished"));
    });
    p.flush().await;

    let chat = p.only("chat m");
    let tool = p.only("execute_tool t");
    for key in [
        attrs::GEN_AI_INPUT_MESSAGES,
        attrs::GEN_AI_OUTPUT_MESSAGES,
        attrs::GEN_AI_SYSTEM_INSTRUCTIONS,
    ] {
        assert_eq!(chat.attr_count(key), 1, "{key}");
    }
    assert_eq!(
        chat.attr(attrs::GEN_AI_INPUT_MESSAGES),
        Some(format!("in {SECRET}").as_str())
    );
    assert_eq!(tool.attr_count(attrs::GEN_AI_TOOL_CALL_ARGUMENTS), 1);
    assert_eq!(
        tool.attr(attrs::GEN_AI_TOOL_CALL_RESULT),
        Some("[redacted]")
    );
    assert_eq!(tool.attr_count(attrs::GEN_AI_TOOL_CALL_RESULT), 1);
    assert!(p.collector.raw_contains(SECRET.as_bytes()), "capture is on");

    // Content goes to the span only: log lines inside the span show its
    // declared fields, never content.
    let logs = p.logs.contents();
    assert!(logs.contains("chat finished"), "{logs}");
    assert!(!logs.contains(SECRET), "{logs}");
    assert!(!logs.contains("[redacted]"), "{logs}");
    p.telemetry.shutdown().await;
}

fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[tokio::test]
async fn traceparent_is_w3c_and_names_the_hook_span() {
    let p = pipeline(|_| {}).await;

    let (traceparent, tracestate) = with_default(&p.dispatch, || {
        let run = spans::invoke_agent("a", "scripted", "s", "r");
        run.in_scope(|| {
            let hook = HookSpan::start("audit", "run_start");
            // (That it is what the W3C propagator writes is a unit test of
            // `propagation`.)
            hook.trace_context()
        })
    });
    p.flush().await;

    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent}");
    assert_eq!(parts[0], "00");
    assert!(is_lower_hex(parts[1], 32) && parts[1] != "0".repeat(32));
    assert!(is_lower_hex(parts[2], 16) && parts[2] != "0".repeat(16));
    assert_eq!(parts[3], "01", "sampled");
    assert_eq!(tracestate, "");

    let hook = p.only("hook audit run_start");
    assert_eq!(parts[1], hook.trace_id);
    assert_eq!(
        parts[2], hook.span_id,
        "the hook server's spans become children of the hook span"
    );
    p.telemetry.shutdown().await;
}

#[tokio::test]
async fn remote_parent_from_metadata_is_honoured() {
    const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const PARENT: &str = "00f067aa0ba902b7";
    let p = pipeline(|_| {}).await;
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert(
        propagation::TRACEPARENT,
        format!("00-{TRACE}-{PARENT}-01").parse().unwrap(),
    );

    let set = with_default(&p.dispatch, || {
        let run = spans::invoke_agent("a", "scripted", "s", "r");
        propagation::set_parent_from_metadata(&run, &md)
    });
    assert!(set);
    p.flush().await;

    let run = p.only("invoke_agent a");
    assert_eq!(run.trace_id, TRACE);
    assert_eq!(run.parent_span_id, PARENT);
    p.telemetry.shutdown().await;
}

#[tokio::test]
async fn sampler_off_exports_nothing_and_propagates_unsampled() {
    let p = pipeline(|o| o.sampling = Sampling::AlwaysOff).await;
    let traceparent = with_default(&p.dispatch, || {
        let run = spans::invoke_agent("a", "scripted", "s", "r");
        propagation::current_trace_context(&run).0
    });
    p.flush().await;
    assert!(traceparent.ends_with("-00"), "{traceparent}");
    assert!(p.collector.spans().is_empty());
    p.telemetry.shutdown().await;
}

#[tokio::test]
async fn rust_log_warn_does_not_drop_exported_info_spans() {
    let p = pipeline(|o| o.log_filter = "warn".into()).await;

    with_default(&p.dispatch, || {
        let run = spans::invoke_agent("quiet", "scripted", "s", "r");
        // Only hookwire's own events become span events (the exporter's
        // tonic/h2 events must not feed back into it), hence the targets.
        run.in_scope(|| {
            tracing::info!(target: "hookwire::engine", "info line, filtered from logs");
            tracing::warn!(target: "hookwire::engine", "warn line, logged");
        });
    });
    p.flush().await;

    let run = p.only("invoke_agent quiet");
    // The info event still reaches the trace as a span event.
    assert!(
        run.event("info line, filtered from logs").is_some(),
        "{run:#?}"
    );
    let logs = p.logs.contents();
    assert!(logs.contains("warn line, logged"), "{logs}");
    assert!(!logs.contains("info line"), "{logs}");
    p.telemetry.shutdown().await;
}

#[tokio::test]
async fn debug_spans_and_other_crates_are_not_exported() {
    let p = pipeline(|o| o.log_filter = "trace".into()).await;
    with_default(&p.dispatch, || {
        let _debug = tracing::debug_span!("debug_detail").entered();
        let _foreign = tracing::info_span!(target: "h2", "foreign").entered();
        let _run = spans::invoke_agent("a", "scripted", "s", "r").entered();
    });
    p.flush().await;
    let names: Vec<String> = p.collector.spans().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["invoke_agent a"]);
    p.telemetry.shutdown().await;
}

#[tokio::test]
async fn batches_arrive_without_a_flush() {
    let p = pipeline(|o| o.batch_delay = Some(Duration::from_millis(20))).await;
    with_default(&p.dispatch, || {
        let _s = spans::execute_tool("scheduled", "c").entered();
    });
    let span = p
        .collector
        .wait_for_span("execute_tool scheduled", WAIT)
        .await;
    assert_eq!(span.attr(attrs::GEN_AI_TOOL_CALL_ID), Some("c"));
    p.telemetry.shutdown().await;
}

/// Shutdown blocks in the SDK until the export (which runs on this runtime,
/// through tonic) is done. It must not deadlock, whatever the runtime.
async fn shutdown_exports_pending_spans() {
    let p = pipeline(|_| {}).await;
    with_default(&p.dispatch, || {
        let _s = HookSpan::start("late", "run_end");
    });
    // No flush: the span sits in the batch queue (5 s schedule).
    let Pipeline {
        collector,
        telemetry,
        dispatch,
        ..
    } = p;
    tokio::time::timeout(WAIT, telemetry.shutdown())
        .await
        .expect("shutdown finished");
    assert_eq!(collector.spans().len(), 1);
    assert_eq!(collector.spans()[0].name, "hook late run_end");
    drop(dispatch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_flushes_on_a_multi_thread_runtime() {
    shutdown_exports_pending_spans().await;
}

#[tokio::test(flavor = "current_thread")]
async fn shutdown_flushes_on_a_current_thread_runtime() {
    shutdown_exports_pending_spans().await;
}

#[tokio::test]
async fn init_installs_the_global_subscriber_once() {
    // The only test touching global state: the others build their own
    // Dispatch, which shadows the global one on their thread.
    let cfg = hookwire::config::TelemetryConfig::default();
    let first = hookwire::telemetry::init(&cfg, LogFormat::Text).expect("first init");
    let second = hookwire::telemetry::init(&cfg, LogFormat::Text);
    assert!(matches!(second, Err(TelemetryError::AlreadyInstalled(_))));
    first.shutdown().await;
}

#[tokio::test]
async fn no_endpoint_means_no_export_and_no_trace_context() {
    let logs = LogCapture::default();
    let (dispatch, telemetry) =
        build(&TelemetryOptions::new(LogFormat::Text), logs.writer()).unwrap();
    assert!(!telemetry.is_exporting());
    let (tp, ts) = with_default(&dispatch, || {
        let run = spans::invoke_agent("a", "scripted", "s", "r");
        run.in_scope(|| tracing::info!("still logged"));
        propagation::current_trace_context(&run)
    });
    assert_eq!((tp.as_str(), ts.as_str()), ("", ""));
    assert!(logs.contents().contains("still logged"));
    telemetry.flush().await.unwrap();
    telemetry.shutdown().await;
}

#[tokio::test]
async fn json_logs_are_one_object_per_line() {
    let logs = LogCapture::default();
    let (dispatch, telemetry) =
        build(&TelemetryOptions::new(LogFormat::Json), logs.writer()).unwrap();
    with_default(&dispatch, || {
        let run = spans::invoke_agent("a", "scripted", "s", "r-9");
        run.in_scope(|| tracing::info!(turn = 1, "model called"));
    });
    let text = logs.contents();
    let line = text.lines().next().expect("a log line");
    let v: serde_json::Value = serde_json::from_str(line).expect(line);
    assert_eq!(v["fields"]["message"], "model called");
    assert_eq!(v["level"], "INFO");
    assert_eq!(v["span"][attrs::HOOKWIRE_RUN_ID], "r-9");
    telemetry.shutdown().await;
}

// --- metrics and admin -------------------------------------------------------

struct HttpResponse {
    status: u16,
    content_type: String,
    body: String,
}

/// A minimal HTTP/1.1 GET (the crate has no HTTP client, and this is all the
/// admin port needs).
async fn get(addr: std::net::SocketAddr, path: &str, accept: Option<&str>) -> HttpResponse {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let accept = accept
        .map(|a| format!("Accept: {a}\r\n"))
        .unwrap_or_default();
    let request =
        format!("GET {path} HTTP/1.1\r\nHost: admin\r\n{accept}Connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await.unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("http response");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let content_type = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_default();
    HttpResponse {
        status,
        content_type,
        body: body.to_owned(),
    }
}

#[tokio::test]
async fn admin_endpoints_answer_and_metrics_move() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let metrics = Arc::new(Metrics::new());
    let ready = Arc::new(AtomicBool::new(false));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_admin(
        listener,
        metrics.clone(),
        ready.clone(),
        async {
            let _ = stopped.await;
        },
    ));

    let health = get(addr, "/healthz", None).await;
    assert_eq!((health.status, health.body.as_str()), (200, "ok"));

    assert_eq!(get(addr, "/readyz", None).await.status, 503);
    ready.store(true, Ordering::Release);
    assert_eq!(get(addr, "/readyz", None).await.status, 200);

    let before = get(addr, "/metrics", None).await;
    assert_eq!(before.status, 200);
    assert_eq!(
        before.content_type,
        "text/plain; version=0.0.4; charset=utf-8"
    );
    assert!(before.body.contains("# TYPE hookwire_active_runs gauge"));
    assert!(!before.body.contains("hookwire_hook_fail_open_total{"));

    let run = metrics.active_run();
    metrics.hook_call(
        "redact",
        "tool_result",
        "failed_open",
        Duration::from_millis(7),
    );
    metrics.hook_fail_open("redact", "tool_result");
    metrics.hook_failure("redact", "tool_result", "deadline");
    let after = get(addr, "/metrics", None).await;
    assert!(
        after.body.contains("hookwire_active_runs 1"),
        "{}",
        after.body
    );
    assert!(after
        .body
        .contains(r#"hookwire_hook_fail_open_total{hook="redact",event="tool_result"} 1"#));
    assert!(after.body.contains(
        r#"hookwire_hook_call_duration_seconds_count{hook="redact",event="tool_result",outcome="failed_open"} 1"#
    ));
    drop(run);
    assert!(get(addr, "/metrics", None)
        .await
        .body
        .contains("hookwire_active_runs 0"));

    let om = get(
        addr,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0"),
    )
    .await;
    assert!(om.content_type.starts_with("application/openmetrics-text"));
    assert!(om.body.ends_with("# EOF\n"));

    assert_eq!(get(addr, "/nope", None).await.status, 404);

    stop.send(()).unwrap();
    tokio::time::timeout(WAIT, server)
        .await
        .expect("admin server stopped")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn hook_call_spans_are_exported_but_not_formatted_into_logs() {
    let p = pipeline(|_| {}).await;
    with_default(&p.dispatch, || {
        let run = spans::invoke_agent("a", "scripted", "s", "run-ctx");
        run.in_scope(|| {
            let _hook = HookSpan::start("audit", "run_start");
            tracing::warn!(target: "hookwire::hooks", "inside the hook call");
        });
    });
    p.flush().await;
    assert!(!p.only("hook audit run_start").parent_span_id.is_empty());
    let logs = p.logs.contents();
    // The run's context stays in the line; the per-event hook span, which
    // the log layer would format at every hook call, does not.
    assert!(logs.contains("inside the hook call"), "{logs}");
    assert!(logs.contains("run-ctx"), "{logs}");
    assert!(!logs.contains("hook{"), "{logs}");
    p.telemetry.shutdown().await;
}
