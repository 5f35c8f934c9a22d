//! Authenticated callers and session ownership: every AgentService method
//! by every kind of caller, against a real server in tokens mode.

mod support;

use hookwire::pb;
use support::auth::{self as sa, Client, Tokens, ALICE, BOB, CAROL, ROOT};
use support::*;
use tonic::Code;

/// The callers of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    NoCredentials,
    WrongToken,
    /// bob: authenticated, but not the session's owner.
    Other,
    /// alice: the session's owner.
    Owner,
    /// root: role admin.
    Admin,
    /// carol: role approver.
    Approver,
}

const ALL: [Who; 6] = [
    Who::NoCredentials,
    Who::WrongToken,
    Who::Other,
    Who::Owner,
    Who::Admin,
    Who::Approver,
];

impl Who {
    fn token(self) -> Option<&'static str> {
        match self {
            Who::NoCredentials => None,
            Who::WrongToken => Some("not-a-known-token"),
            Who::Other => Some(BOB),
            Who::Owner => Some(ALICE),
            Who::Admin => Some(ROOT),
            Who::Approver => Some(CAROL),
        }
    }
}

struct Rig {
    server: TestServer,
    _tokens: Tokens,
    _hooks: Vec<TestHook>,
}

impl Rig {
    async fn start() -> Rig {
        Rig::start_on("").await
    }

    /// With `store` (a `store:` line; empty: the library's default, memory).
    async fn start_on(store: &str) -> Rig {
        let tokens = Tokens::write();
        let owner = weather_owner().start().await;
        let asker = asker("may I?", 0).start().await;
        let mut yaml = config(
            &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
            "tools: [get_weather]",
        );
        yaml.push_str(&tokens.auth_yaml());
        yaml.push_str(store);
        let server = TestServer::start(&yaml).await;
        Rig {
            server,
            _tokens: tokens,
            _hooks: vec![owner, asker],
        }
    }

    async fn as_(&self, who: Who) -> Client {
        sa::client(&self.server.addr, who.token()).await
    }
}

/// Starts alice's run that pauses on an approval; returns (run id, call id,
/// the stream to keep it alive).
async fn paused_run(
    alice: &mut Client,
    session: &str,
) -> (String, String, tonic::Streaming<pb::RunEvent>) {
    let mut stream = alice
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

fn code<T>(r: &Result<T, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// What `who` gets for each method on alice's session / run.
fn expected(who: Who, method: &str) -> Code {
    match who {
        Who::NoCredentials | Who::WrongToken => Code::Unauthenticated,
        Who::Owner | Who::Admin => Code::Ok,
        Who::Other => match method {
            "CreateSession" | "ListSessions" | "ListHooks" => Code::Ok,
            _ => Code::NotFound,
        },
        Who::Approver => match method {
            "CreateSession" | "ListSessions" | "ListHooks" | "ResolveApproval" => Code::Ok,
            _ => Code::NotFound,
        },
    }
}

#[tokio::test]
async fn every_method_by_every_caller() {
    every_method_by_every_caller_on("").await;
}

// Ownership is the store's too: the same table with sessions, runs and
// approvals in SQLite and in a real PostgreSQL (owner column, List
// filtered in SQL, grants read from the stored owner, CancelRun and
// ResolveApproval checked against the run's stored session).
#[tokio::test]
async fn every_method_by_every_caller_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("store: 'sqlite://{}/hookwire.db'\n", dir.path().display());
    every_method_by_every_caller_on(&store).await;
}

#[tokio::test]
async fn every_method_by_every_caller_on_postgres() {
    let store = format!("store: '{}'\n", support::postgres::database());
    every_method_by_every_caller_on(&store).await;
}

async fn every_method_by_every_caller_on(store: &str) {
    let rig = Rig::start_on(store).await;
    let mut alice = rig.as_(Who::Owner).await;
    let mut report = Vec::new();
    for who in ALL {
        let mut c = rig.as_(who).await;
        let mut check = |method: &str, got: Code, detail: String| {
            let want = expected(who, method);
            if got != want {
                report.push(format!(
                    "{who:?} {method}: got {got:?}, want {want:?} ({detail})"
                ));
            }
        };

        let r = sa::new_session(&mut c, "a").await;
        check("CreateSession", code(&r), format!("{r:?}"));

        let s = sa::new_session(&mut alice, "a").await.unwrap();
        let r = c
            .get_session(pb::GetSessionRequest {
                session_id: s.clone(),
            })
            .await;
        check("GetSession", code(&r), format!("{:?}", r.as_ref().err()));
        if who == Who::Other {
            // A foreign session answers exactly like a missing one.
            let missing = "00000000-0000-0000-0000-000000000000";
            let m = c
                .get_session(pb::GetSessionRequest {
                    session_id: missing.into(),
                })
                .await
                .unwrap_err();
            let f = r.as_ref().unwrap_err();
            assert_eq!(
                f.message().replace(&s, "ID"),
                m.message().replace(missing, "ID")
            );
        }

        let r = c.list_sessions(pb::ListSessionsRequest::default()).await;
        check("ListSessions", code(&r), String::new());
        if let Ok(list) = &r {
            let sees_alices = list.get_ref().sessions.iter().any(|x| x.id == s);
            assert_eq!(
                sees_alices,
                matches!(who, Who::Owner | Who::Admin),
                "{who:?} listing alice's session"
            );
        }

        let r = c
            .invoke(pb::RunRequest {
                session_id: s.clone(),
                input: "hello".into(),
            })
            .await;
        check("Invoke", code(&r), format!("{:?}", r.as_ref().err()));

        let r = c
            .run(pb::RunRequest {
                session_id: s.clone(),
                input: "hello".into(),
            })
            .await;
        let r = match r {
            Ok(resp) => {
                let mut st = resp.into_inner();
                while st.message().await.unwrap().is_some() {}
                Ok(())
            }
            Err(e) => Err(e),
        };
        check("Run", code(&r), format!("{:?}", r.as_ref().err()));

        // A run of alice's that waits for approval.
        let (run_id, call_id, mut stream) = paused_run(&mut alice, &s).await;
        let r = c
            .resolve_approval(pb::ResolveApprovalRequest {
                run_id: run_id.clone(),
                call_id: call_id.clone(),
                approve: false,
                note: String::new(),
            })
            .await;
        check(
            "ResolveApproval",
            code(&r),
            format!("{:?}", r.as_ref().err()),
        );
        if who == Who::Other {
            let unknown = c
                .cancel_run(pb::CancelRunRequest {
                    run_id: "no-such-run".into(),
                })
                .await
                .unwrap_err();
            let f = r.as_ref().unwrap_err();
            assert_eq!(
                f.message().replace(&run_id, "ID"),
                "run `ID` not found (it may have finished)"
            );
            assert_eq!(
                unknown.message(),
                "run `no-such-run` not found (it may have finished)"
            );
        }
        // Whatever happened, end the run before the next one.
        let _ = alice.cancel_run(pb::CancelRunRequest { run_id }).await;
        while stream.message().await.unwrap().is_some() {}

        let (run_id, _, mut stream) = paused_run(&mut alice, &s).await;
        let r = c
            .cancel_run(pb::CancelRunRequest {
                run_id: run_id.clone(),
            })
            .await;
        check("CancelRun", code(&r), format!("{:?}", r.as_ref().err()));
        if r.is_err() {
            // Not cancelled by `who`: still waiting; alice ends it.
            alice
                .cancel_run(pb::CancelRunRequest { run_id })
                .await
                .unwrap();
        }
        let last = loop {
            let ev = stream
                .message()
                .await
                .unwrap()
                .expect("the run ends with finished");
            if let Some(pb::run_event::Event::Finished(f)) = ev.event {
                break pb::RunOutcome::try_from(f.result.unwrap().outcome).unwrap();
            }
        };
        assert_eq!(last, pb::RunOutcome::Cancelled);

        let r = c.list_hooks(pb::ListHooksRequest {}).await;
        check("ListHooks", code(&r), String::new());

        // Wait until alice's run let go of the session, then delete.
        let deleted = c
            .delete_session(pb::DeleteSessionRequest {
                session_id: s.clone(),
            })
            .await;
        check(
            "DeleteSession",
            code(&deleted),
            format!("{:?}", deleted.as_ref().err()),
        );
        let after = alice
            .get_session(pb::GetSessionRequest { session_id: s })
            .await;
        if deleted.is_ok() {
            assert_eq!(code(&after), Code::NotFound, "{who:?} deleted it");
        } else {
            assert_eq!(
                code(&after),
                Code::Ok,
                "a refused delete leaves the session"
            );
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
    rig.server.stop().await;
}

#[tokio::test]
async fn unauthenticated_messages_say_what_to_send_and_health_needs_nothing() {
    let rig = Rig::start().await;
    let mut none = rig.as_(Who::NoCredentials).await;
    let e = none
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("authorization: Bearer"), "{e:?}");
    let mut wrong = rig.as_(Who::WrongToken).await;
    let e = wrong
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.message(), "invalid credentials: unknown bearer token");
    assert!(!e.message().contains("not-a-known-token"));
    // Reflection needs credentials too; health does not (sa::client waited
    // on it without any).
    let ch = tonic::transport::Channel::from_shared(rig.server.addr.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut refl =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(ch);
    let req = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let e = refl
        .server_reflection_info(futures::stream::iter(vec![req]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    rig.server.stop().await;
}

#[tokio::test]
async fn agents_may_be_restricted_to_principals_and_roles() {
    let tokens = Tokens::write();
    let yaml = format!(
        "models: [{{name: m, provider: scripted}}]\nagents:\n  - name: open\n    model: m\n  - name: staff\n    model: m\n    allow: {{principals: [alice], roles: [approver]}}\n{}",
        tokens.auth_yaml()
    );
    let server = TestServer::start(&yaml).await;
    let mut bob = sa::client(&server.addr, Some(BOB)).await;
    let e = sa::new_session(&mut bob, "staff").await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert_eq!(
        e.message(),
        "principal `bob` may not use agent `staff` (agents[].allow)"
    );
    assert!(sa::new_session(&mut bob, "open").await.is_ok());
    for t in [ALICE, CAROL, ROOT] {
        let mut c = sa::client(&server.addr, Some(t)).await;
        assert!(sa::new_session(&mut c, "staff").await.is_ok());
    }
    server.stop().await;
}

#[tokio::test]
async fn hooks_see_the_callers_principal_and_selected_claims() {
    let tokens = Tokens::write();
    let hook = FnHook::new(
        "who",
        &[pb::EventKind::SessionStart, pb::EventKind::RunStart],
    )
    .start()
    .await;
    let mut yaml = config(&[("who", &hook.addr, "")], "");
    yaml.push_str(&tokens.auth_yaml());
    let server = TestServer::start(&yaml).await;
    let mut alice = sa::client(&server.addr, Some(ALICE)).await;
    let s = sa::new_session(&mut alice, "a").await.unwrap();
    // An admin running in alice's session: the hook sees who is calling.
    let mut root = sa::client(&server.addr, Some(ROOT)).await;
    root.invoke(pb::RunRequest {
        session_id: s,
        input: "hi".into(),
    })
    .await
    .unwrap();
    hook.hook.wait_for("run_start").await;
    let seen = hook.hook.seen.lock().unwrap().clone();
    let ctx = |i: usize| seen[i].context.clone().unwrap();
    assert_eq!(ctx(0).principal, "alice");
    assert_eq!(
        ctx(0).principal_claims.get("tenant").map(String::as_str),
        Some("acme")
    );
    assert_eq!(
        ctx(0).principal_claims.get("roles").map(String::as_str),
        Some("user")
    );
    // `team` is a claim of alice's too, but not in auth.forward_claims.
    assert!(!ctx(0).principal_claims.contains_key("team"));
    assert_eq!(ctx(1).principal, "root");
    assert_eq!(
        ctx(1).principal_claims.get("roles").map(String::as_str),
        Some("admin")
    );
    assert!(!ctx(1).principal_claims.contains_key("tenant"));
    server.stop().await;
}

#[tokio::test]
async fn auth_none_is_refused_off_loopback() {
    let config = hookwire::config::Config::parse(
        "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\n",
        "t",
    )
    .unwrap();
    // Any non-loopback local address will do; 0.0.0.0 binds every interface.
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let err = hookwire::server::serve(listener, config, async {})
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("auth.mode: none (no authentication) is only allowed when listening on a loopback address"), "{msg}");
    assert!(
        msg.contains("set auth.mode to tokens, mtls or jwt"),
        "{msg}"
    );
}

/// A server with token auth and `quotas`, where a "weather" run of agent
/// `a` waits for approval (the asker hook); the hooks live as long as it.
struct QuotaServer {
    server: TestServer,
    admin: std::net::SocketAddr,
    _kept: (Tokens, TestHook, TestHook),
}

async fn quota_server(quotas: &str) -> QuotaServer {
    let tokens = Tokens::write();
    let asker = asker("may I?", 0).start().await;
    let owner = weather_owner().start().await;
    let mut yaml = config(
        &[("owner", &owner.addr, ""), ("asker", &asker.addr, "")],
        "tools: [get_weather]",
    );
    yaml.push_str(&tokens.auth_yaml());
    yaml.push_str(&format!("quotas: {quotas}\n"));
    let (server, admin) = TestServer::start_with_admin(&yaml).await;
    QuotaServer {
        server,
        admin,
        _kept: (tokens, asker, owner),
    }
}

#[tokio::test]
async fn quotas_are_hit_per_principal_and_recover() {
    let QuotaServer {
        server,
        admin,
        _kept,
    } = quota_server("{max_sessions: 2, max_concurrent_runs: 1, runs_per_minute: 3}").await;
    let mut alice = sa::client(&server.addr, Some(ALICE)).await;
    let mut bob = sa::client(&server.addr, Some(BOB)).await;

    // max_sessions
    let s1 = sa::new_session(&mut alice, "a").await.unwrap();
    let s2 = sa::new_session(&mut alice, "a").await.unwrap();
    let e = sa::new_session(&mut alice, "a").await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(
        e.message()
            .starts_with("quota `max_sessions` reached (2) for principal `alice`"),
        "{e:?}"
    );
    let b1 = sa::new_session(&mut bob, "a")
        .await
        .expect("bob has his own quota");
    alice
        .delete_session(pb::DeleteSessionRequest { session_id: s2 })
        .await
        .unwrap();
    let s2 = sa::new_session(&mut alice, "a")
        .await
        .expect("a slot was freed");

    // max_concurrent_runs: alice's first run waits for approval.
    let (run_id, _, mut stream) = paused_run(&mut alice, &s1).await;
    let e = alice
        .invoke(pb::RunRequest {
            session_id: s2.clone(),
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(
        e.message()
            .contains("quota `max_concurrent_runs` reached (1)"),
        "{e:?}"
    );
    bob.invoke(pb::RunRequest {
        session_id: b1,
        input: "hi".into(),
    })
    .await
    .expect("bob's runs are counted apart");
    alice
        .cancel_run(pb::CancelRunRequest { run_id })
        .await
        .unwrap();
    while stream.message().await.unwrap().is_some() {}
    alice
        .invoke(pb::RunRequest {
            session_id: s2.clone(),
            input: "hi".into(),
        })
        .await
        .expect("the run slot is free again");

    // runs_per_minute: two runs so far; the third starts, the fourth not.
    alice
        .invoke(pb::RunRequest {
            session_id: s2.clone(),
            input: "hi".into(),
        })
        .await
        .unwrap();
    let e = alice
        .invoke(pb::RunRequest {
            session_id: s2.clone(),
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(
        e.message().contains("quota `runs_per_minute` reached (3)"),
        "{e:?}"
    );
    // Deleting the sessions those runs ran in does not lower the rate.
    for session_id in [s1, s2] {
        alice
            .delete_session(pb::DeleteSessionRequest { session_id })
            .await
            .unwrap();
    }
    let s3 = sa::new_session(&mut alice, "a").await.unwrap();
    let e = alice
        .invoke(pb::RunRequest {
            session_id: s3,
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(
        e.message().contains("quota `runs_per_minute` reached (3)"),
        "after deleting the sessions: {e:?}"
    );

    let metrics = http_get(admin, "/metrics").await;
    for line in [
        r#"hookwire_quota_rejections_total{limit="max_sessions",class="user"} 1"#,
        r#"hookwire_quota_rejections_total{limit="max_concurrent_runs",class="user"} 1"#,
        r#"hookwire_quota_rejections_total{limit="runs_per_minute",class="user"} 2"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    assert!(!metrics.contains("alice"), "metrics never name a principal");
    server.stop().await;
}

/// A second run on a session whose run is still active is refused as busy
/// (FAILED_PRECONDITION, retry after the run), not as over quota: the
/// active run counts toward `max_concurrent_runs`, and the quota used to
/// be checked first, answering RESOURCE_EXHAUSTED for a busy session.
#[tokio::test]
async fn a_run_on_a_busy_session_is_refused_as_busy_not_over_quota() {
    let QuotaServer {
        server,
        admin,
        _kept,
    } = quota_server("{max_concurrent_runs: 1}").await;
    let mut alice = sa::client(&server.addr, Some(ALICE)).await;
    let s = sa::new_session(&mut alice, "a").await.unwrap();
    let (run_id, _, mut stream) = paused_run(&mut alice, &s).await;
    let e = alice
        .invoke(pb::RunRequest {
            session_id: s.clone(),
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message()
            .contains(&format!("already has a run in progress (`{run_id}`)")),
        "{e:?}"
    );
    let metrics = http_get(admin, "/metrics").await;
    assert!(
        !metrics.contains("hookwire_quota_rejections_total{limit=\"max_concurrent_runs\""),
        "a busy session is no quota rejection:\n{metrics}"
    );
    alice
        .cancel_run(pb::CancelRunRequest { run_id })
        .await
        .unwrap();
    while stream.message().await.unwrap().is_some() {}
    server.stop().await;
}

/// Run quotas are the session owner's, whoever starts the run: the store
/// counts a run for its session's owner, so an admin's runs in alice's
/// sessions take alice's slots, and an admin's and alice's starts together
/// cannot run more than alice's limit.
#[tokio::test]
async fn an_admins_runs_in_a_users_sessions_count_for_that_user() {
    let QuotaServer {
        server,
        admin,
        _kept,
    } = quota_server("{max_concurrent_runs: 1}").await;
    let mut alice = sa::client(&server.addr, Some(ALICE)).await;
    let mut root = sa::client(&server.addr, Some(ROOT)).await;
    let s1 = sa::new_session(&mut alice, "a").await.unwrap();
    let s2 = sa::new_session(&mut alice, "a").await.unwrap();

    // root's run in alice's first session waits for approval.
    let (run_id, _, mut stream) = paused_run(&mut root, &s1).await;
    for (who, c) in [("root", &mut root), ("alice", &mut alice)] {
        let e = c
            .invoke(pb::RunRequest {
                session_id: s2.clone(),
                input: "hi".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{who}: {e:?}");
        assert!(
            e.message()
                .contains("quota `max_concurrent_runs` reached (1) for principal `alice`"),
            "{who}: {e:?}"
        );
    }
    // root's own sessions are root's.
    let r1 = sa::new_session(&mut root, "a").await.unwrap();
    root.invoke(pb::RunRequest {
        session_id: r1,
        input: "hi".into(),
    })
    .await
    .expect("root's own quota");
    root.cancel_run(pb::CancelRunRequest { run_id })
        .await
        .unwrap();
    while stream.message().await.unwrap().is_some() {}
    alice
        .invoke(pb::RunRequest {
            session_id: s2,
            input: "hi".into(),
        })
        .await
        .expect("alice's slot is free again");
    let metrics = http_get(admin, "/metrics").await;
    for line in [
        r#"hookwire_quota_rejections_total{limit="max_concurrent_runs",class="admin"} 1"#,
        r#"hookwire_quota_rejections_total{limit="max_concurrent_runs",class="user"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    server.stop().await;
}

mod jwt_mode {
    use super::*;
    use support::certs::write_atomic;
    use support::jwt::{self, Signer};

    #[tokio::test]
    async fn jwts_are_verified_against_the_jwks_file() {
        let dir = tempfile::tempdir().unwrap();
        let k1 = Signer::new("k1");
        let k2 = Signer::new("k2");
        let jwks_file = dir.path().join("jwks.json");
        write_atomic(&jwks_file, &jwt::jwks(&[&k1]));
        let hook = FnHook::new("who", &[pb::EventKind::RunStart]).start().await;
        let mut yaml = config(&[("who", &hook.addr, "")], "");
        yaml.push_str(&jwt::auth_yaml(&jwks_file));
        let server = TestServer::start(&yaml).await;

        let call = |token: String| {
            let addr = server.addr.clone();
            async move {
                let mut c = sa::client(&addr, Some(&token)).await;
                c.list_sessions(pb::ListSessionsRequest::default())
                    .await
                    .map(|_| ())
            }
        };
        let good = k1.token("alice", &["user"], true, |_| {});
        assert!(call(good.clone()).await.is_ok());
        // One key in the JWKS: a token without kid is fine.
        assert!(call(k1.token("alice", &[], false, |_| {})).await.is_ok());
        let refused = [
            (
                "expired",
                k1.token("alice", &[], true, |c| {
                    c["exp"] = serde_json::json!(1_000_000)
                }),
                "JWT expired",
            ),
            (
                "other audience",
                k1.token("alice", &[], true, |c| c["aud"] = "someone-else".into()),
                "JWT audience not accepted",
            ),
            (
                "other issuer",
                k1.token("alice", &[], true, |c| {
                    c["iss"] = "https://evil.test".into()
                }),
                "JWT issuer not accepted",
            ),
            (
                "no exp",
                k1.token("alice", &[], true, |c| {
                    c.as_object_mut().unwrap().remove("exp");
                }),
                "JWT lacks required claim `exp`",
            ),
            (
                "unknown key",
                k2.token("alice", &[], true, |_| {}),
                "JWT signed by a key (kid) not in the JWKS",
            ),
            (
                "hs256",
                jwt::hs256_token("alice"),
                "JWT algorithm HS256 is not accepted",
            ),
            ("garbage", "not.a.jwt".to_string(), "malformed JWT"),
        ];
        for (case, token, want) in refused {
            let e = call(token).await.unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated, "{case}");
            assert!(e.message().contains(want), "{case}: {}", e.message());
        }
        // A forged signature: k2's signature under k1's kid.
        let mut parts: Vec<String> = k1
            .token("alice", &["admin"], true, |_| {})
            .split('.')
            .map(str::to_string)
            .collect();
        parts[2] = k2
            .token("alice", &["admin"], true, |_| {})
            .split('.')
            .nth(2)
            .unwrap()
            .to_string();
        let e = call(parts.join(".")).await.unwrap_err();
        assert!(
            e.message().contains("JWT signature does not verify"),
            "{}",
            e.message()
        );

        // The issuer rotates: k2 is published next to k1 (file rewritten).
        write_atomic(&jwks_file, &jwt::jwks(&[&k1, &k2]));
        assert!(call(k2.token("bob", &[], true, |_| {})).await.is_ok());
        // Several keys: a token must say which one signed it.
        let e = call(k1.token("alice", &[], false, |_| {}))
            .await
            .unwrap_err();
        assert!(
            e.message()
                .contains("JWT has no kid and the JWKS holds several keys"),
            "{}",
            e.message()
        );
        // A broken JWKS keeps the last good one.
        write_atomic(&jwks_file, "{not json");
        assert!(call(good.clone()).await.is_ok());

        // Roles and claims from the token reach hooks.
        let mut root = sa::client(
            &server.addr,
            Some(&k1.token("root", &["admin"], true, |_| {})),
        )
        .await;
        let s = sa::new_session(&mut root, "a").await.unwrap();
        root.invoke(pb::RunRequest {
            session_id: s,
            input: "hi".into(),
        })
        .await
        .unwrap();
        hook.hook.wait_for("run_start").await;
        let ctx = hook.hook.seen.lock().unwrap()[0].context.clone().unwrap();
        assert_eq!(ctx.principal, "root");
        assert_eq!(
            ctx.principal_claims.get("roles").map(String::as_str),
            Some("admin")
        );
        assert_eq!(
            ctx.principal_claims.get("tenant").map(String::as_str),
            Some("acme")
        );
        assert!(
            !ctx.principal_claims.contains_key("iss"),
            "only forward_claims"
        );
        server.stop().await;
    }
}

#[tokio::test]
async fn the_kubernetes_base_config_refuses_unauthenticated_calls_and_separates_principals() {
    let tokens = Tokens::write();
    let yaml = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/k8s/base/config.yaml"
    ))
    .unwrap()
    .replace(
        "/etc/hookwire/auth/tokens.yaml",
        tokens.file.to_str().unwrap(),
    );
    assert!(
        yaml.contains(&tokens.file.display().to_string()),
        "the base config reads its tokens from the Secret's file"
    );
    let config = hookwire::config::Config::parse(&yaml, "deploy/k8s/base/config.yaml").unwrap();
    // As in the pod: every interface.
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let addr = format!("http://127.0.0.1:{}", listener.local_addr().unwrap().port());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(hookwire::server::serve(listener, config, async {
        let _ = rx.await;
    }));
    let mut anon = sa::client(&addr, None).await;
    let e = anon
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let mut alice = sa::client(&addr, Some(ALICE)).await;
    let mut bob = sa::client(&addr, Some(BOB)).await;
    let s = sa::new_session(&mut alice, "demo").await.unwrap();
    let e = bob
        .invoke(pb::RunRequest {
            session_id: s.clone(),
            input: "hi".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(alice
        .invoke(pb::RunRequest {
            session_id: s,
            input: "hi".into()
        })
        .await
        .is_ok());
    let _ = tx.send(());
    task.await.unwrap().unwrap();
}

#[tokio::test]
async fn config_check_makes_the_security_start_up_checks() {
    let dir = tempfile::tempdir().unwrap();
    let check = |yaml: &str, args: &[&str]| {
        let f = dir.path().join(format!("c{}.yaml", yaml.len()));
        std::fs::write(&f, yaml).unwrap();
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"));
        cmd.args(["config", "check", "--offline"])
            .args(args)
            .arg(&f);
        cmd
    };
    let base = "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\n";
    let open = format!("listen: 0.0.0.0:50051\n{base}");
    let (ok, out) = command_output(&mut check(&open, &[])).await;
    assert!(
        !ok && out.contains("auth.mode: none (no authentication) is only allowed"),
        "{out}"
    );
    let missing = format!("{base}auth: {{mode: tokens, tokens_file: /nonexistent/tokens.yaml}}\n");
    let (ok, out) = command_output(&mut check(&missing, &[])).await;
    assert!(
        !ok && out.contains("auth.tokens_file: cannot read /nonexistent/tokens.yaml"),
        "{out}"
    );
    // Away from the pod: the settings are checked, the files are not read.
    let (ok, out) = command_output(&mut check(&missing, &["--skip-files"])).await;
    assert!(ok, "{out}");
}
