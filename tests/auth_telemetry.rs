//! Credentials never reach logs or spans: callers' bearer tokens (valid or
//! not), JWTs and the token hookwire sends to a hook, with every log level
//! on (h2, hyper and tonic included) and spans exported to an in-test
//! collector.
//!
//! Its own test binary: the tracing subscriber is process-global.

mod support;

#[path = "support/otlp.rs"]
mod otlp;

use std::time::Duration;

use hookwire::pb;
use hookwire::telemetry::{build, LogFormat, TelemetryOptions};
use otlp::{Collector, LogCapture};
use support::auth::{self as sa, Tokens, ALICE};
use support::certs::write_pem;
use support::jwt::{self, Signer};
use support::*;

const HOOK_TOKEN: &str = "hook-bearer-SENTINEL-5150";
const WRONG_TOKEN: &str = "wrong-token-SENTINEL-8086";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_jwts_never_appear_in_logs_or_spans() {
    let collector = Collector::start().await;
    let mut opts = TelemetryOptions::new(LogFormat::Json);
    opts.otlp_endpoint = Some(collector.endpoint());
    opts.log_filter = "trace".into();
    let logs = LogCapture::default();
    let (dispatch, telemetry) = build(&opts, logs.writer()).unwrap();
    tracing::dispatcher::set_global_default(dispatch).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let hook_token = write_pem(dir.path(), "hook-token", HOOK_TOKEN);
    let hook = FnHook::new("h", &[pb::EventKind::RunStart]).start().await;
    let hook_yaml = format!(
        "credentials: {{bearer_token_file: {}}}",
        hook_token.display()
    );

    // Tokens mode.
    let tokens = Tokens::write();
    let mut yaml = config(&[("h", &hook.addr, &hook_yaml)], "");
    yaml.push_str(&tokens.auth_yaml());
    let server = TestServer::start(&yaml).await;
    let mut alice = sa::client(&server.addr, Some(ALICE)).await;
    let s = sa::new_session(&mut alice, "a").await.unwrap();
    alice
        .invoke(pb::RunRequest {
            session_id: s,
            input: "hello".into(),
        })
        .await
        .unwrap();
    let mut wrong = sa::client(&server.addr, Some(WRONG_TOKEN)).await;
    assert!(wrong
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .is_err());
    server.stop().await;

    // JWT mode.
    let signer = Signer::new("k1");
    let jwks = write_pem(dir.path(), "jwks.json", &jwt::jwks(&[&signer]));
    let good_jwt = signer.token("carol", &["user"], true, |_| {});
    let expired_jwt = signer.token("carol", &[], true, |c| c["exp"] = serde_json::json!(1));
    let mut yaml = config(&[("h", &hook.addr, &hook_yaml)], "");
    yaml.push_str(&jwt::auth_yaml(&jwks));
    let server = TestServer::start(&yaml).await;
    let mut carol = sa::client(&server.addr, Some(&good_jwt)).await;
    let s = sa::new_session(&mut carol, "a").await.unwrap();
    carol
        .invoke(pb::RunRequest {
            session_id: s,
            input: "hello".into(),
        })
        .await
        .unwrap();
    let mut late = sa::client(&server.addr, Some(&expired_jwt)).await;
    assert!(late
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .is_err());
    server.stop().await;

    collector
        .wait_until(Duration::from_secs(20), |spans| {
            spans.iter().filter(|s| s.name == "invoke_agent a").count() >= 2
        })
        .await;
    let text = logs.contents();
    // The capture works: refusals and hook calls are in it.
    assert!(
        text.contains("call refused: not authenticated"),
        "log capture is empty?"
    );
    assert!(text.contains("hook"), "log capture has the hook calls");
    let jwt_signature = |t: &str| t.rsplit('.').next().unwrap().to_string();
    for (what, secret) in [
        ("alice's token", ALICE.to_string()),
        ("a wrong token", WRONG_TOKEN.to_string()),
        ("the hook's token", HOOK_TOKEN.to_string()),
        ("a JWT", good_jwt.clone()),
        ("a JWT's signature", jwt_signature(&good_jwt)),
        ("an expired JWT", expired_jwt.clone()),
    ] {
        assert!(!text.contains(&secret), "{what} is in the logs");
        assert!(
            !collector.raw_contains(secret.as_bytes()),
            "{what} is in the exported spans"
        );
    }
    telemetry.shutdown().await;
}
