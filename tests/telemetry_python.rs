//! Trace context reaches a hook server written in another language: the
//! Python example, a real process, logs the `traceparent` of its Process
//! stream, which must name the run's trace and the exported `hook …` span
//! that opened the stream, so spans the hook server makes join the trace.
//!
//! A test binary of its own: the tracing subscriber is process-global.

mod support;

#[path = "support/otlp.rs"]
mod otlp;

use hookwire::telemetry::{attrs, build, LogFormat, TelemetryOptions};
use otlp::{Collector, LogCapture};
use support::python::PythonHook;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_hook_server_receives_the_runs_trace_context() {
    let collector = Collector::start().await;
    let mut opts = TelemetryOptions::new(LogFormat::Text);
    opts.otlp_endpoint = Some(collector.endpoint());
    let logs = LogCapture::default();
    let (dispatch, telemetry) = build(&opts, logs.writer()).unwrap();
    tracing::dispatcher::set_global_default(dispatch).unwrap();

    let mut py = PythonHook::start_logged(&["--features", "redactor"]).await;
    let server = TestServer::start(&config(&[("py", &py.addr, "")], "")).await;
    let mut c = server.client().await;
    let session_id = session(&mut c, "a").await;
    let r = invoke(&mut c, &session_id, "hello").await;
    assert_eq!(outcome(&r), hookwire::pb::RunOutcome::Completed);
    let run_id = r.run_id.clone();

    // The Python server logs its run summary once hookwire closed the stream.
    let log = py.log.as_mut().unwrap();
    let line = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while let Some(line) = log.recv().await {
            if line.contains(&format!("run {run_id} ")) && line.contains("trace=") {
                return line;
            }
        }
        panic!("the python hook exited without logging the run");
    })
    .await
    .expect("the python hook logs each run when its stream ends");
    let traceparent = line.rsplit("trace=").next().unwrap().trim().to_string();

    server.stop().await;
    telemetry.flush().await.unwrap();
    let spans = collector.spans();
    let root = spans
        .iter()
        .find(|span| {
            span.name == "invoke_agent a"
                && span.attr(attrs::GEN_AI_CONVERSATION_ID) == Some(session_id.as_str())
        })
        .unwrap_or_else(|| panic!("no invoke_agent span for the run"));
    let opener = spans
        .iter()
        .find(|s| s.trace_id == root.trace_id && s.name == "hook py run_start")
        .expect("the hook span of the stream's first event");

    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "W3C traceparent: {traceparent}");
    assert_eq!(parts[0], "00");
    assert_eq!(parts[1], root.trace_id, "the run's trace");
    assert_eq!(parts[2], opener.span_id, "parented on `hook py run_start`");
    assert_eq!(parts[3], "01", "sampled");
}
