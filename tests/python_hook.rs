//! hookwire with the Python example hook server as a real process: its
//! redactor rewrites input and results, its policy narrows tools and denies,
//! and it executes its own tools — alongside an in-process Rust hook.

mod support;

use hookwire::hook_server::{self, Reply};
use hookwire::pb;
use support::python::PythonHook;
use support::*;

const RULES: &str = r#"
models:
  - name: m
    provider: scripted
    rules:
      - when: { last_user_contains: "customer" }
        tool_calls: [ { name: lookup_customer, arguments: { id: "C-1001" } } ]
      - when: { last_user_contains: "weather" }
        tool_calls: [ { name: get_weather, arguments: { city: "Paris" } } ]
      - when: { last_user_contains: "wipe" }
        tool_calls: [ { name: delete_file, arguments: { path: "/" } } ]
      - when: { last_tool_result_contains: "" }
        text: "Tool said: {{last_tool_result}}"
      - text: "sys={{system}} user={{last_user}}"
"#;

fn cfg(py: &str, rust: Option<&str>, tools: &str) -> String {
    let mut y = format!("{RULES}hooks:\n  - name: py\n    endpoint: {py}\n    priority: 10\n");
    let mut hooks = vec!["py"];
    if let Some(r) = rust {
        y.push_str(&format!("  - name: rust\n    endpoint: {r}\n"));
        hooks.push("rust");
    }
    y.push_str(&format!(
        "agents:\n  - name: a\n    model: m\n    system_prompt: base\n    hooks: [{}]\n    tools: [{tools}]\n",
        hooks.join(", ")
    ));
    y
}

#[tokio::test]
async fn python_rewrites_input_and_rust_patches_the_request_with_provenance() {
    let py = PythonHook::start(&["--features", "redactor"]).await;
    let rust = FnHook::new("rust", &[pb::EventKind::ModelRequest])
        .on_model_request(|_, _| async {
            Reply::new(hook_server::patch_request(pb::RequestPatch {
                extra_context: vec!["ctx-from-rust".into()],
                ..Default::default()
            }))
        })
        .start()
        .await;
    let server = TestServer::start(&cfg(&py.addr, Some(&rust.addr), "")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let events = run_events(&mut c, &s, "my key is sk-live1234567890 ok").await;
    let r = result_of(&events);
    assert_eq!(
        pb::RunOutcome::try_from(r.outcome).unwrap(),
        pb::RunOutcome::Completed,
        "{}",
        r.reason
    );
    assert_eq!(
        r.final_text,
        "sys=base\n\nctx-from-rust user=my key is [REDACTED:api_key] ok"
    );
    let sess = c
        .get_session(pb::GetSessionRequest { session_id: s })
        .await
        .unwrap()
        .into_inner();
    assert!(
        !format!("{:?}", sess.transcript).contains("sk-live"),
        "the secret never entered history"
    );
    let v = verdicts(&events);
    assert!(v.iter().any(|v| v.hook == "py"
        && v.verdict_kind() == pb::VerdictKind::RewriteInput
        && v.fields_changed == ["input"]));
    assert!(v.iter().any(|v| v.hook == "rust"
        && v.verdict_kind() == pb::VerdictKind::PatchRequest
        && v.fields_changed == ["extra_context"]));
    server.stop().await;
}

#[tokio::test]
async fn python_owns_and_executes_tools_and_redacts_their_results() {
    let py = PythonHook::start(&[]).await;
    let server = TestServer::start(&cfg(&py.addr, None, "get_weather, lookup_customer")).await;
    let mut c = server.client().await;
    let s = session(&mut c, "a").await;
    let r = invoke(&mut c, &s, "what's the weather?").await;
    assert_eq!(
        pb::RunOutcome::try_from(r.outcome).unwrap(),
        pb::RunOutcome::Completed,
        "{}",
        r.reason
    );
    assert!(
        r.final_text.starts_with("Tool said: ") && r.final_text.contains("in Paris"),
        "{}",
        r.final_text
    );

    let r = invoke(&mut c, &s, "customer record please").await;
    assert_eq!(
        pb::RunOutcome::try_from(r.outcome).unwrap(),
        pb::RunOutcome::Completed,
        "{}",
        r.reason
    );
    let all = format!("{:?}", r.messages);
    assert!(all.contains("[REDACTED:secret]"), "{all}");
    assert!(
        !all.contains("SECRET-"),
        "the tool's secret was rewritten before the model saw it"
    );
    server.stop().await;
}
