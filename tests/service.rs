//! The service end to end over real gRPC: runs, parity of Run and Invoke,
//! sessions, health, reflection and precise statuses for bad requests.

mod support;

use hookwire::pb;
use support::*;
use tonic::Code;

fn demo() -> String {
    config(&[], "tools: []")
}

#[tokio::test]
async fn run_streams_text_deltas_that_add_up_to_the_answer() {
    let server = TestServer::start(&demo()).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "hello").await;
    let deltas: String = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(pb::run_event::Event::TextDelta(d)) => Some(d.text.clone()),
            _ => None,
        })
        .collect();
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
    assert_eq!(r.final_text, "sys=base temp= user=hello");
    assert_eq!(deltas, r.final_text);
    assert!(
        events
            .iter()
            .filter(|e| matches!(e.event, Some(pb::run_event::Event::TextDelta(_))))
            .count()
            > 1
    );
    assert!(matches!(
        events[0].event,
        Some(pb::run_event::Event::Started(_))
    ));
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
    assert!(r.usage.unwrap().output_tokens > 0);
    server.stop().await;
}

#[tokio::test]
async fn run_and_invoke_commit_the_same_transcript() {
    let server = TestServer::start(&demo()).await;
    let mut c = server.client().await;
    let (s1, s2) = (session(&mut c, "a").await, session(&mut c, "a").await);
    for input in ["first", "second"] {
        let streamed = result_of(&run_events(&mut c, &s1, input).await);
        let invoked = invoke(&mut c, &s2, input).await;
        assert_eq!(streamed.outcome, invoked.outcome);
        assert_eq!(streamed.final_text, invoked.final_text);
        assert_eq!(streamed.messages, invoked.messages);
        assert_eq!(streamed.turns, invoked.turns);
    }
    let t1 = c
        .get_session(pb::GetSessionRequest { session_id: s1 })
        .await
        .unwrap()
        .into_inner();
    let t2 = c
        .get_session(pb::GetSessionRequest { session_id: s2 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(t1.transcript, t2.transcript);
    assert_eq!(t1.transcript.len(), 4, "two user inputs and two answers");
    assert_eq!(t1.run_count, 2);
    server.stop().await;
}

#[tokio::test]
async fn sessions_list_get_delete() {
    let server = TestServer::start(&demo()).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.sessions.len(), 1);
    assert!(
        list.sessions[0].transcript.is_empty(),
        "list omits transcripts"
    );
    c.delete_session(pb::DeleteSessionRequest {
        session_id: s.clone(),
    })
    .await
    .unwrap();
    let err = c
        .get_session(pb::GetSessionRequest {
            session_id: s.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .run(pb::RunRequest {
            session_id: s,
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "run on a deleted session");
    assert!(err.message().contains("not found"));
    server.stop().await;
}

#[tokio::test]
async fn bad_requests_get_precise_statuses() {
    let server = TestServer::start(&demo()).await;
    let mut c = server.client().await;
    let err = c
        .create_session(pb::CreateSessionRequest {
            agent: "aa".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(
        err.message().contains("unknown agent `aa`"),
        "{}",
        err.message()
    );
    let err = c
        .create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            extra_hooks: vec!["http://evil:1".into()],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Code::InvalidArgument,
        "sessions cannot name arbitrary endpoints"
    );
    let err = c
        .create_session(pb::CreateSessionRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    let s = session(&mut c, "a").await;
    let err = c
        .invoke(pb::RunRequest {
            session_id: s.clone(),
            input: "  ".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("empty"));
    let huge = "x".repeat(hookwire::config::DEFAULT_MAX_INPUT_BYTES + 1);
    let err = c
        .invoke(pb::RunRequest {
            session_id: s.clone(),
            input: huge,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("limit"));
    let err = c
        .invoke(pb::RunRequest {
            session_id: "nope".into(),
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .cancel_run(pb::CancelRunRequest {
            run_id: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = c
        .resolve_approval(pb::ResolveApprovalRequest {
            run_id: "r".into(),
            call_id: "c".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    server.stop().await;
}

#[tokio::test]
async fn second_concurrent_run_is_refused_and_cancel_ends_the_first() {
    // Closed until released; stays open afterwards (permits return on drop).
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let entered = std::sync::Arc::new(tokio::sync::Notify::new());
    let (g, e) = (gate.clone(), entered.clone());
    let hook = FnHook::new("slow", &[pb::EventKind::RunStart])
        .on_run_start(move |_, _| {
            let (g, e) = (g.clone(), e.clone());
            async move {
                e.notify_one();
                let _permit = g.acquire().await;
                hookwire::hook_server::Reply::new(pb::RunStartVerdict {
                    action: Some(pb::run_start_verdict::Action::Proceed(pb::Continue {})),
                })
            }
        })
        .start()
        .await;
    let server = TestServer::start(&config(&[("slow", &hook.addr, "timeout: 30s")], "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let mut c2 = c.clone();
    let s2 = s.clone();
    let first = tokio::spawn(async move { run_events(&mut c2, &s2, "one").await });
    entered.notified().await;
    let err = c
        .invoke(pb::RunRequest {
            session_id: s.clone(),
            input: "two".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("already has a run in progress"));
    let active = c
        .get_session(pb::GetSessionRequest {
            session_id: s.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    c.cancel_run(pb::CancelRunRequest {
        run_id: active.active_run_id,
    })
    .await
    .unwrap();
    let r = result_of(&first.await.unwrap());
    assert_eq!(outcome(&r), pb::RunOutcome::Cancelled);
    assert!(r.reason.contains("cancelled by client"));
    gate.add_permits(1);
    // The session is usable again.
    let r = invoke(&mut c, &s, "three").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);
    server.stop().await;
}

#[tokio::test]
async fn health_reports_serving_and_reflection_lists_services() {
    let server = TestServer::start(&demo()).await;
    let _ = server.client().await;
    let ch = tonic::transport::Endpoint::from_shared(server.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    for service in ["", "hookwire.v1.AgentService"] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    }
    // v1 for current tools, v1alpha for grpcurl 1.8.6: both list exactly the
    // services served here and resolve the whole contract by symbol.
    use tonic_reflection::pb::{v1, v1alpha};
    let ask = |m: v1::server_reflection_request::MessageRequest| {
        let ch = ch.clone();
        async move {
            let mut c = v1::server_reflection_client::ServerReflectionClient::new(ch);
            let req = v1::ServerReflectionRequest {
                host: String::new(),
                message_request: Some(m),
            };
            let mut resp = c
                .server_reflection_info(tokio_stream::iter(vec![req]))
                .await
                .unwrap()
                .into_inner();
            resp.message().await.unwrap().unwrap().message_response
        }
    };
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) = ask(
        v1::server_reflection_request::MessageRequest::ListServices(String::new()),
    )
    .await
    else {
        panic!("v1 list_services")
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(
        names,
        ["grpc.health.v1.Health", "hookwire.v1.AgentService"],
        "HookService is implemented by hook servers, not served here"
    );
    let found = ask(
        v1::server_reflection_request::MessageRequest::FileContainingSymbol(
            "hookwire.v1.HookService".into(),
        ),
    )
    .await;
    assert!(
        matches!(
            found,
            Some(v1::server_reflection_response::MessageResponse::FileDescriptorResponse(_))
        ),
        "HookService resolves by symbol: {found:?}"
    );

    let mut alpha = v1alpha::server_reflection_client::ServerReflectionClient::new(ch);
    let req = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    };
    let msg = alpha
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    let Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        msg.message_response
    else {
        panic!("v1alpha list_services")
    };
    assert!(
        list.service
            .iter()
            .any(|s| s.name == "hookwire.v1.AgentService"),
        "{:?}",
        list.service
    );
    server.stop().await;
}

/// Awaits `f`, failing (not hanging) the test if it never ends: a hang
/// detector, not a timing assertion.
async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(60), f)
        .await
        .expect("the run never ended: a panic wedged it")
}

/// A model that panics when the user says "boom", as any bug inside a run
/// might; otherwise the scripted model answers.
struct Panicky(std::sync::Arc<dyn hookwire::model::ModelProvider>);

impl hookwire::model::ModelProvider for Panicky {
    fn provider_name(&self) -> &'static str {
        self.0.provider_name()
    }
    fn model_name(&self) -> &str {
        self.0.model_name()
    }
    fn complete<'a>(
        &'a self,
        request: &'a hookwire::model::ModelRequest,
        on_delta: hookwire::model::DeltaSink<'a>,
    ) -> hookwire::model::BoxFuture<
        'a,
        Result<hookwire::model::ModelResponse, hookwire::model::ModelError>,
    > {
        let boom = request.history.last().is_some_and(|m| m.text() == "boom");
        Box::pin(async move {
            if boom {
                panic!("injected panic in the model provider");
            }
            self.0.complete(request, on_delta).await
        })
    }
}

#[tokio::test]
async fn a_panic_inside_a_run_ends_that_run_failed_and_frees_everything() {
    let (logs, _guard) = logwatch::LogWatch::install("info");
    let watcher = FnHook::new("watcher", &[pb::EventKind::RunStart, pb::EventKind::RunEnd])
        .start()
        .await;
    let yaml = config(&[("watcher", &watcher.addr, "")], "");
    let scripted =
        hookwire::server::build_models(&hookwire::config::Config::parse(&yaml, "t").unwrap())
            .unwrap()["m"]
            .clone();
    let (server, admin) =
        TestServer::start_with_models(&yaml, vec![("m", std::sync::Arc::new(Panicky(scripted)))])
            .await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;

    // Run: the stream ends with the run's result.
    let events = bounded(run_events(&mut c, &s, "boom")).await;
    let r = result_of(&events);
    assert_eq!(outcome(&r), pb::RunOutcome::Failed);
    assert!(r.reason.starts_with("internal error"), "{}", r.reason);
    assert!(
        r.messages.is_empty(),
        "nothing of the panicked run is committed"
    );
    // Logged at error with the run id; the panic text stays out of it.
    let errors = logs.lines_with(&["ERROR", "run panicked", &r.run_id]);
    assert_eq!(errors.len(), 1, "{}", logs.contents());
    assert!(!errors[0].contains("injected panic"), "{}", errors[0]);

    // The session is released: not wedged with an active run.
    let got = c
        .get_session(pb::GetSessionRequest {
            session_id: s.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.active_run_id, "");

    // Invoke gets the result too, then the session runs normally.
    let r = bounded(invoke(&mut c, &s, "boom")).await;
    assert_eq!(outcome(&r), pb::RunOutcome::Failed);
    let r = invoke(&mut c, &s, "hello").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);

    // The hooks were told (run_end, outcome failed) and their streams closed.
    watcher.hook.wait_for_count("run_end", 3).await;
    let failed_ends = watcher
        .hook
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|e| {
            matches!(&e.payload, Some(pb::hook_event::Payload::RunEnd(end))
                if end.outcome == pb::RunOutcome::Failed as i32)
        })
        .count();
    assert_eq!(failed_ends, 2);
    let metrics = http_get(admin, "/metrics").await;
    for series in [
        r#"hookwire_run_panics_total{agent="a"} 2"#,
        r#"hookwire_runs_total{agent="a",outcome="failed"} 2"#,
        "hookwire_active_hook_streams 0",
        "hookwire_active_runs 0",
    ] {
        assert!(metrics.contains(series), "no `{series}` in\n{metrics}");
    }
    server.stop().await;
}

/// An `Invoke` caller that leaves while its run waits (here for a hook that
/// does not answer) ends the run at once, not when the wait is over: the
/// server drops the call's handler, which stops the run.
#[tokio::test]
async fn an_invoke_caller_that_leaves_ends_the_run_at_once() {
    use hookwire::hook_server::Reply;
    let arrived = std::sync::Arc::new(tokio::sync::Notify::new());
    let a = arrived.clone();
    let stuck = FnHook::new("stuck", &[pb::EventKind::RunStart])
        .on_run_start(move |_, _| {
            let a = a.clone();
            async move {
                a.notify_one();
                std::future::pending::<()>().await;
                Reply::new(pb::RunStartVerdict::default())
            }
        })
        .start()
        .await;
    let watcher = FnHook::new("watcher", &[pb::EventKind::RunEnd])
        .start()
        .await;
    let yaml = config(
        &[
            ("stuck", &stuck.addr, "timeout: 60s"),
            ("watcher", &watcher.addr, ""),
        ],
        "event_budget: 60s",
    );
    let server = TestServer::start(&yaml).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let call = tokio::spawn({
        let (mut c, s) = (c.clone(), s.clone());
        async move { invoke(&mut c, &s, "hello").await }
    });
    arrived.notified().await;
    // The caller leaves: its HTTP/2 stream is reset.
    call.abort();
    // Well before the hook's timeout and the event's budget (60 s), which
    // would end it too.
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        watcher.hook.wait_for_count("run_end", 1),
    )
    .await
    .expect("the run ended when its caller left");
    let got = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.active_run_id, "");
    server.stop().await;
}
