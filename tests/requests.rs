//! What a client request may carry, over real gRPC and on every store:
//! NUL characters (which PostgreSQL cannot keep in TEXT) and fields over
//! their size limits are refused with INVALID_ARGUMENT naming the field,
//! never INTERNAL, and never with a message that quotes what was refused;
//! a listing of sessions stays within what clients receive by default.

mod support;

use std::collections::HashMap;

use hookwire::pb;
use support::*;
use tonic::Code;

/// A server whose agent `a` asks before every get_weather call; `store` is
/// a `store:` line (empty: the default, memory).
struct Rig {
    server: TestServer,
    _hooks: Vec<TestHook>,
}

async fn rig(store: &str) -> Rig {
    let owner = weather_owner().start().await;
    let asker = asker("may I?", 0).start().await;
    let mut yaml = config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]",
    );
    yaml.push_str(store);
    Rig {
        server: TestServer::start(&yaml).await,
        _hooks: vec![owner, asker],
    }
}

/// A run of `session` paused on an approval: (run id, call id, its stream).
async fn paused_run(
    c: &mut pb::agent_service_client::AgentServiceClient<tonic::transport::Channel>,
    session: &str,
) -> (String, String, tonic::Streaming<pb::RunEvent>) {
    let mut stream = c
        .run(pb::RunRequest {
            session_id: session.into(),
            input: "weather".into(),
        })
        .await
        .unwrap()
        .into_inner();
    while let Some(ev) = stream.message().await.unwrap() {
        if let Some(pb::run_event::Event::ApprovalRequested(a)) = &ev.event {
            return (ev.run_id.clone(), a.call.clone().unwrap().id, stream);
        }
    }
    panic!("the run never asked for approval");
}

/// `r` is INVALID_ARGUMENT whose message names `field` (and says `also`),
/// short enough for any client's metadata limit.
#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, tonic::Status>, field: &str, also: &str) {
    let s = r.expect_err("the request is refused");
    assert_eq!(s.code(), Code::InvalidArgument, "{field}: {s:?}");
    assert!(
        s.message().contains(&format!("`{field}`")) && s.message().contains(also),
        "names `{field}` and {also:?}: {}",
        s.message()
    );
    assert!(
        s.message().len() < 1024,
        "short: {} bytes",
        s.message().len()
    );
    assert!(!s.message().contains('\0'), "{:?}", s.message());
}

fn nul(id: &str) -> String {
    format!("{id}\0x")
}

async fn nul_characters_are_refused_naming_the_field_on(store: &str) {
    const NUL: &str = "NUL";
    let rig = rig(store).await;
    let mut c = rig.server.client().await;
    let s = session(&mut c, "a").await;

    // The audit's two cases: an id and an approval's note.
    refused(
        c.get_session(pb::GetSessionRequest {
            session_id: "a\0b".into(),
        })
        .await,
        "session_id",
        NUL,
    );
    let (run_id, call_id, mut stream) = paused_run(&mut c, &s).await;
    refused(
        c.resolve_approval(pb::ResolveApprovalRequest {
            run_id: run_id.clone(),
            call_id: call_id.clone(),
            approve: false,
            note: "no\0".into(),
        })
        .await,
        "note",
        NUL,
    );
    // Refused before anything was recorded: the approval is still pending.
    c.resolve_approval(pb::ResolveApprovalRequest {
        run_id: run_id.clone(),
        call_id: call_id.clone(),
        approve: false,
        note: "no".into(),
    })
    .await
    .expect("the approval is still pending");
    let mut last = None;
    while let Some(ev) = stream.message().await.unwrap() {
        last = Some(ev);
    }
    assert!(
        matches!(
            last.and_then(|e| e.event),
            Some(pb::run_event::Event::Finished(_))
        ),
        "the run went on to its end"
    );

    // Every other string a request carries.
    refused(
        c.resolve_approval(pb::ResolveApprovalRequest {
            run_id: nul(&run_id),
            call_id: call_id.clone(),
            ..Default::default()
        })
        .await,
        "run_id",
        NUL,
    );
    refused(
        c.resolve_approval(pb::ResolveApprovalRequest {
            run_id: run_id.clone(),
            call_id: nul(&call_id),
            ..Default::default()
        })
        .await,
        "call_id",
        NUL,
    );
    refused(
        c.delete_session(pb::DeleteSessionRequest {
            session_id: nul(&s),
        })
        .await,
        "session_id",
        NUL,
    );
    refused(
        c.invoke(pb::RunRequest {
            session_id: nul(&s),
            input: "hi".into(),
        })
        .await,
        "session_id",
        NUL,
    );
    refused(
        c.run(pb::RunRequest {
            session_id: nul(&s),
            input: "hi".into(),
        })
        .await,
        "session_id",
        NUL,
    );
    refused(
        c.cancel_run(pb::CancelRunRequest {
            run_id: nul(&run_id),
        })
        .await,
        "run_id",
        NUL,
    );
    refused(
        c.list_sessions(pb::ListSessionsRequest {
            agent: "a\0".into(),
            ..Default::default()
        })
        .await,
        "agent",
        NUL,
    );
    refused(
        c.list_sessions(pb::ListSessionsRequest {
            page_token: format!("1.{}", nul(&s)),
            ..Default::default()
        })
        .await,
        "page_token",
        NUL,
    );
    refused(
        c.create_session(pb::CreateSessionRequest {
            agent: "a\0".into(),
            ..Default::default()
        })
        .await,
        "agent",
        NUL,
    );
    refused(
        c.create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            extra_hooks: vec!["asker\0".into()],
            ..Default::default()
        })
        .await,
        "extra_hooks",
        NUL,
    );
    for (k, v) in [("k\0", "v"), ("k", "v\0")] {
        refused(
            c.create_session(pb::CreateSessionRequest {
                agent: "a".into(),
                metadata: HashMap::from([(k.to_string(), v.to_string())]),
                ..Default::default()
            })
            .await,
            "metadata",
            NUL,
        );
    }

    // The input is content, not a name: it is taken as it is (the store
    // keeps messages as JSON, where a NUL is escaped).
    let r = invoke(&mut c, &s, "hi\0there").await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(
        r.final_text.ends_with("user=hi\0there"),
        "{:?}",
        r.final_text
    );
    let got = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.run_count, 2);
    rig.server.stop().await;
}

#[tokio::test]
async fn nul_characters_are_refused_naming_the_field() {
    nul_characters_are_refused_naming_the_field_on("").await;
}

#[tokio::test]
async fn nul_characters_are_refused_naming_the_field_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("store: 'sqlite://{}/hookwire.db'\n", dir.path().display());
    nul_characters_are_refused_naming_the_field_on(&store).await;
}

// PostgreSQL refuses NUL in TEXT: unchecked, these became INTERNAL
// ("invalid byte sequence for encoding UTF8: 0x00").
#[tokio::test]
async fn nul_characters_are_refused_naming_the_field_on_postgres() {
    let store = format!("store: '{}'\n", support::postgres::database());
    nul_characters_are_refused_naming_the_field_on(&store).await;
}

#[tokio::test]
async fn fields_over_their_limits_are_refused_naming_the_limit() {
    let rig = rig("").await;
    let mut c = rig.server.client().await;
    let s = session(&mut c, "a").await;
    let creator = c.clone();
    let create = |metadata: Vec<(String, String)>, extra_hooks: Vec<&str>| {
        let mut c = creator.clone();
        let extra_hooks: Vec<String> = extra_hooks.into_iter().map(String::from).collect();
        async move {
            c.create_session(pb::CreateSessionRequest {
                agent: "a".into(),
                extra_hooks,
                metadata: metadata.into_iter().collect(),
            })
            .await
        }
    };
    let kv = |k: &str, n: usize| (k.to_string(), "v".repeat(n));

    // The audit's two cases: 3 MiB of metadata per session (two made a
    // listing too large for clients), a 20 000-byte id quoted back in
    // NOT_FOUND (too large for grpcio clients' metadata limit).
    refused(
        create(vec![kv("blob", 3 * 1024 * 1024)], vec![]).await,
        "metadata",
        "the limit is 4096 bytes",
    );
    refused(
        c.get_session(pb::GetSessionRequest {
            session_id: "x".repeat(20_000),
        })
        .await,
        "session_id",
        "the limit is 128 bytes",
    );

    // metadata: per value, per key, entries, in total; at the limits, taken.
    create(vec![kv("k", 4096)], vec![])
        .await
        .expect("a value of 4 KiB");
    refused(
        create(vec![kv(&"k".repeat(257), 1)], vec![]).await,
        "metadata",
        "the limit is 256 bytes",
    );
    let entries = |n: usize| (0..n).map(|i| kv(&format!("k{i}"), 1)).collect::<Vec<_>>();
    create(entries(64), vec![]).await.expect("64 entries");
    refused(
        create(entries(65), vec![]).await,
        "metadata",
        "the limit is 64",
    );
    let total = |n: usize| {
        (0..n)
            .map(|i| kv(&format!("k{i}"), 4000))
            .collect::<Vec<_>>()
    };
    create(total(4), vec![]).await.expect("16 008 bytes in all");
    refused(
        create(total(5), vec![]).await,
        "metadata",
        "the limit is 16384 bytes",
    );

    // extra_hooks: distinct names, each a name's length at most.
    refused(
        create(vec![], vec!["asker", "owner", "asker"]).await,
        "extra_hooks",
        "more than once",
    );
    refused(
        create(vec![], vec![&"h".repeat(1025)]).await,
        "extra_hooks",
        "the limit is 1024 bytes",
    );
    refused(
        c.create_session(pb::CreateSessionRequest {
            agent: "a".repeat(1025),
            ..Default::default()
        })
        .await,
        "agent",
        "the limit is 1024 bytes",
    );

    // Ids: a session or run id is hookwire's (a UUID); a call id may be a
    // hook's, as long as a verdict's names.
    let not_found = c
        .get_session(pb::GetSessionRequest {
            session_id: "x".repeat(128),
        })
        .await
        .unwrap_err();
    assert_eq!(
        not_found.code(),
        Code::NotFound,
        "an id at the limit is looked up"
    );
    for r in [
        c.delete_session(pb::DeleteSessionRequest {
            session_id: "x".repeat(129),
        })
        .await
        .map(|_| ()),
        c.invoke(pb::RunRequest {
            session_id: "x".repeat(129),
            input: "hi".into(),
        })
        .await
        .map(|_| ()),
    ] {
        refused(r, "session_id", "the limit is 128 bytes");
    }
    refused(
        c.cancel_run(pb::CancelRunRequest {
            run_id: "r".repeat(20_000),
        })
        .await,
        "run_id",
        "the limit is 128 bytes",
    );
    let (run_id, call_id, mut stream) = paused_run(&mut c, &s).await;
    refused(
        c.resolve_approval(pb::ResolveApprovalRequest {
            run_id: run_id.clone(),
            call_id: "c".repeat(1025),
            ..Default::default()
        })
        .await,
        "call_id",
        "the limit is 1024 bytes",
    );
    refused(
        c.resolve_approval(pb::ResolveApprovalRequest {
            run_id: run_id.clone(),
            call_id: call_id.clone(),
            approve: false,
            note: "n".repeat(4097),
        })
        .await,
        "note",
        "the limit is 4096 bytes",
    );
    c.resolve_approval(pb::ResolveApprovalRequest {
        run_id,
        call_id,
        approve: false,
        note: "n".repeat(4096),
    })
    .await
    .expect("a note of 4 KiB");
    while stream.message().await.unwrap().is_some() {}
    refused(
        c.list_sessions(pb::ListSessionsRequest {
            page_token: "1.".to_string() + &"x".repeat(300),
            ..Default::default()
        })
        .await,
        "page_token",
        "the limit is 256 bytes",
    );
    rig.server.stop().await;
}

/// Sessions at the metadata limit, more than 4 MiB of them: a page of up to
/// 1000 still reaches a client with gRPC's default 4 MiB receive limit, and
/// paging on returns every session once.
#[tokio::test]
async fn a_listing_of_large_sessions_fits_a_clients_default_receive_limit() {
    let rig = rig("").await;
    let mut c = rig.server.client().await;
    let metadata: HashMap<String, String> = (0..4)
        .map(|i| (format!("k{i}"), "v".repeat(4094)))
        .collect();
    let mut created = std::collections::HashSet::new();
    for _ in 0..300 {
        let s = c
            .create_session(pb::CreateSessionRequest {
                agent: "a".into(),
                metadata: metadata.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        created.insert(s.id);
    }
    let mut listed = Vec::new();
    let mut pages = 0;
    let mut token = String::new();
    loop {
        let page = c
            .list_sessions(pb::ListSessionsRequest {
                page_size: 1000,
                page_token: token,
                ..Default::default()
            })
            .await
            .expect("the page fits the client's receive limit")
            .into_inner();
        pages += 1;
        assert!(!page.sessions.is_empty(), "every page advances");
        listed.extend(page.sessions.into_iter().map(|s| s.id));
        token = page.next_page_token;
        if token.is_empty() {
            break;
        }
    }
    assert!(pages > 1, "300 sessions of 16 KiB take more than one page");
    assert_eq!(listed.len(), 300, "each session once");
    assert_eq!(
        listed.into_iter().collect::<std::collections::HashSet<_>>(),
        created
    );
    rig.server.stop().await;
}
