//! TLS, mTLS and call credentials to a real hook server: the Python example
//! serving TLS, requiring a client certificate and a bearer token, with
//! certificates made per test.

mod support;

use std::sync::Arc;

use hookwire::hooks::failure::FailureClass;
use hookwire::pb;
use support::auth::{self as sa, Tokens, ALICE};
use support::certs::{write_atomic, write_pem, Ca, Use};
use support::python::PythonHook;
use support::*;

const SECRET_INPUT: &str = "My API key is sk-live-4f9a8b7c6d5e4f3a, hello";

/// `https://localhost:PORT` for a Python hook started on `http://127.0.0.1:PORT`.
fn https(hook: &PythonHook) -> String {
    hook.addr.replace("http://127.0.0.1", "https://localhost")
}

fn hook_yaml(endpoint: &str, extra: &str) -> String {
    let mut y = config(&[("py", endpoint, "events: [run_start]")], "");
    // The hook's extra settings go under it (config() writes hooks first).
    y = y.replace(
        "    events: [run_start]\n",
        &format!(
            "    events: [run_start]\n{}",
            extra
                .lines()
                .map(|l| format!("    {l}\n"))
                .collect::<String>()
        ),
    );
    y.push_str("server: {reload_interval: 0s}\n");
    y
}

async fn run_once(addr: &str, token: Option<&str>) -> pb::RunResult {
    let mut c = sa::client(addr, token).await;
    let s = sa::new_session(&mut c, "a").await.unwrap();
    c.invoke(pb::RunRequest {
        session_id: s,
        input: SECRET_INPUT.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

#[tokio::test]
async fn python_hook_over_mtls_with_a_token_sees_the_callers_principal() {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = Ca::new("hooks CA");
    let client_ca = Ca::new("hookwire clients CA");
    let (srv_crt, srv_key) = server_ca
        .leaf(Use::Server, &["localhost"], &[])
        .write(dir.path(), "srv");
    let (cli_crt, cli_key) = client_ca
        .leaf(
            Use::Client,
            &["hookwire.example"],
            &["spiffe://example.org/hookwire"],
        )
        .write(dir.path(), "cli");
    let server_ca_file = write_pem(dir.path(), "server-ca.pem", &server_ca.pem());
    let client_ca_file = write_pem(dir.path(), "client-ca.pem", &client_ca.pem());
    let token = write_pem(dir.path(), "hook-token", "hook-secret-1\n");
    let mut hook = PythonHook::start_logged(&[
        "--features",
        "redactor",
        "--tls-cert",
        srv_crt.to_str().unwrap(),
        "--tls-key",
        srv_key.to_str().unwrap(),
        "--tls-client-ca",
        client_ca_file.to_str().unwrap(),
        "--require-token-file",
        token.to_str().unwrap(),
    ])
    .await;
    let tokens = Tokens::write();
    let mut yaml = hook_yaml(
        &https(&hook),
        &format!(
            "tls: {{ca_file: {}, cert_file: {}, key_file: {}}}\ncredentials: {{bearer_token_file: {}}}",
            server_ca_file.display(),
            cli_crt.display(),
            cli_key.display(),
            token.display()
        ),
    );
    yaml.push_str(&tokens.auth_yaml());
    let server = TestServer::start(&yaml).await;
    let r = run_once(&server.addr, Some(ALICE)).await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(
        r.final_text.contains("[REDACTED:api_key]"),
        "{}",
        r.final_text
    );
    // `hookwire hooks check` connects the same way (TLS, client
    // certificate, token) and plays a session as a principal of its choice.
    let (ok, out) = command_output(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
            .args(["hooks", "check", &https(&hook)])
            .args(["--ca-file", server_ca_file.to_str().unwrap()])
            .args(["--cert-file", cli_crt.to_str().unwrap()])
            .args(["--key-file", cli_key.to_str().unwrap()])
            .args(["--principal", "checker-bob", "--claim", "tenant=acme"])
            .env("HOOKWIRE_HOOK_TOKEN", "hook-secret-1"),
    )
    .await;
    assert!(ok, "{out}");
    let (ok, out) = command_output(
        tokio::process::Command::new(env!("CARGO_BIN_EXE_hookwire"))
            .args(["hooks", "check", &https(&hook)])
            .args(["--ca-file", server_ca_file.to_str().unwrap()])
            .env("HOOKWIRE_HOOK_TOKEN", "hook-secret-1"),
    )
    .await;
    assert!(
        !ok && out.contains("tls"),
        "without the client certificate: {out}"
    );
    // The hook logs each run's summary with the caller it was told about.
    let log = hook.log.as_mut().unwrap();
    loop {
        let line = log.recv().await.expect("the hook logs the run");
        if line.contains(&format!("run {}", r.run_id)) {
            assert!(line.contains("principal alice"), "{line}");
        }
        if line.contains("principal checker-bob") {
            break;
        }
    }
    server.stop().await;
}

#[tokio::test]
async fn tls_problems_fail_closed_as_class_tls_saying_what_did_not_match() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("hooks CA");
    let other_ca = Ca::new("someone else's CA");
    let client_ca = Ca::new("clients CA");
    let ca_file = write_pem(dir.path(), "ca.pem", &ca.pem());
    let other_ca_file = write_pem(dir.path(), "other-ca.pem", &other_ca.pem());
    let client_ca_file = write_pem(dir.path(), "client-ca.pem", &client_ca.pem());
    let good = ca
        .leaf(Use::Server, &["localhost"], &[])
        .write(dir.path(), "good");
    let expired = ca
        .expired_leaf(Use::Server, &["localhost"])
        .write(dir.path(), "expired");
    let misnamed = ca
        .leaf(Use::Server, &["hooks.other.example"], &[])
        .write(dir.path(), "misnamed");
    let p = |f: &std::path::PathBuf| f.to_str().unwrap().to_string();
    // (case, server cert, server requires a client cert, hookwire's ca_file, what the reason says)
    let cases = [
        (
            "wrong CA",
            &good,
            false,
            &other_ca_file,
            "certificate signed by an unknown CA",
        ),
        ("expired", &expired, false, &ca_file, "certificate expired"),
        (
            "wrong name",
            &misnamed,
            false,
            &ca_file,
            "certificate not valid for name localhost (it is for: hooks.other.example)",
        ),
        (
            "missing client certificate",
            &good,
            true,
            &ca_file,
            "client certificate",
        ),
    ];
    let mut failures = Vec::new();
    for (case, (crt, key), mtls, ca_for_hookwire, want) in cases {
        let mut args = vec![
            "--features".to_string(),
            "redactor".into(),
            "--tls-cert".into(),
            p(crt),
            "--tls-key".into(),
            p(key),
        ];
        if mtls {
            args.extend(["--tls-client-ca".to_string(), p(&client_ca_file)]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let hook = PythonHook::start(&args).await;
        let server = TestServer::start(&hook_yaml(
            &https(&hook),
            &format!("tls: {{ca_file: {}}}", ca_for_hookwire.display()),
        ))
        .await;
        let r = run_once(&server.addr, None).await;
        let prefix = "hook `py` failed on run_start: tls: ";
        if outcome(&r) != pb::RunOutcome::HookFailed
            || !r.reason.contains(prefix)
            || !r.reason.contains(want)
        {
            failures.push(format!("{case}: {:?} {}", outcome(&r), r.reason));
        }
        assert!(
            !r.final_text.contains("sk-live"),
            "{case}: nothing got past the hook"
        );
        server.stop().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn a_tls_refusal_is_not_blamed_for_a_later_connect_failure() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("hooks CA");
    let client_ca = Ca::new("clients CA");
    let ca_file = write_pem(dir.path(), "ca.pem", &ca.pem());
    let client_ca_file = write_pem(dir.path(), "client-ca.pem", &client_ca.pem());
    let (crt, key) = ca
        .leaf(Use::Server, &["localhost"], &[])
        .write(dir.path(), "good");
    let p = |f: &std::path::PathBuf| f.to_str().unwrap().to_string();
    let (crt, key, client_ca_file) = (p(&crt), p(&key), p(&client_ca_file));
    // The server wants a client certificate hookwire does not have.
    let mut hook = PythonHook::start(&[
        "--features",
        "redactor",
        "--tls-cert",
        &crt,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &client_ca_file,
    ])
    .await;
    let server = TestServer::start(&hook_yaml(
        &https(&hook),
        &format!("tls: {{ca_file: {}}}", ca_file.display()),
    ))
    .await;
    let r = run_once(&server.addr, None).await;
    assert!(
        r.reason.contains("failed on run_start: tls: ") && r.reason.contains("client certificate"),
        "{}",
        r.reason
    );
    // Then the server is gone: nothing listens on its port any more.
    hook.child.kill().await.unwrap();
    let r = run_once(&server.addr, None).await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason.contains("failed on run_start: connect: "),
        "a refused TCP connection is class connect, not the old TLS refusal: {}",
        r.reason
    );
    server.stop().await;
}

#[tokio::test]
async fn rotated_certificates_and_tokens_are_picked_up_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("hooks CA");
    let client_ca = Ca::new("clients CA");
    let stranger = Ca::new("not the clients CA");
    let ca_file = write_pem(dir.path(), "ca.pem", &ca.pem());
    let client_ca_file = write_pem(dir.path(), "client-ca.pem", &client_ca.pem());
    let (srv_crt, srv_key) = ca
        .leaf(Use::Server, &["localhost"], &[])
        .write(dir.path(), "srv");
    // hookwire starts with a client certificate the hook does not trust.
    let (cli_crt, cli_key) = stranger
        .leaf(Use::Client, &["hookwire.example"], &[])
        .write(dir.path(), "cli");
    let hook_token = write_pem(dir.path(), "hook-side-token", "t1");
    let our_token = write_pem(dir.path(), "hookwire-side-token", "t1");
    let hook = PythonHook::start(&[
        "--features",
        "redactor",
        "--tls-cert",
        srv_crt.to_str().unwrap(),
        "--tls-key",
        srv_key.to_str().unwrap(),
        "--tls-client-ca",
        client_ca_file.to_str().unwrap(),
        "--require-token-file",
        hook_token.to_str().unwrap(),
    ])
    .await;
    let server = TestServer::start(&hook_yaml(
        &https(&hook),
        &format!(
            "tls: {{ca_file: {}, cert_file: {}, key_file: {}}}\ncredentials: {{bearer_token_file: {}}}\nbreaker: {{failures: 0}}",
            ca_file.display(),
            cli_crt.display(),
            cli_key.display(),
            our_token.display()
        ),
    ))
    .await;
    let r = run_once(&server.addr, None).await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(
        r.reason.contains("failed on run_start: tls: "),
        "{}",
        r.reason
    );

    // cert-manager renews the certificate: same files, new content.
    let renewed = client_ca.leaf(Use::Client, &["hookwire.example"], &[]);
    write_atomic(&cli_key, &renewed.key);
    write_atomic(&cli_crt, &renewed.cert);
    let r = run_once(&server.addr, None).await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    assert!(r.final_text.contains("[REDACTED:api_key]"));

    // The hook's token is rotated first: hookwire's old one is refused...
    write_atomic(&hook_token, "t2");
    let r = run_once(&server.addr, None).await;
    assert_eq!(outcome(&r), pb::RunOutcome::HookFailed);
    assert!(r.reason.contains("Unauthenticated"), "{}", r.reason);
    // ...until hookwire's copy of the Secret is updated too.
    write_atomic(&our_token, "t2");
    let r = run_once(&server.addr, None).await;
    assert_eq!(outcome(&r), pb::RunOutcome::Completed, "{}", r.reason);
    server.stop().await;
}

/// A TLS hook server, in Rust, whose connections go in two pairs. The
/// first two complete the handshake, send their HTTP/2 SETTINGS and are
/// held until [`Staged::end_first_pair`], then closed. The next two are
/// held until both have arrived, then one is refused after the handshake
/// (the server requires a client certificate, hookwire has none) and the
/// other completes it and is closed at once: two connections failing at
/// the same time, each its own way.
struct Staged {
    endpoint: String,
    end_first: tokio::sync::watch::Sender<bool>,
    first_ended: Arc<tokio::sync::Semaphore>,
}

impl Staged {
    async fn start(ca: &Ca, client_ca: &Ca) -> Staged {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let provider = || Arc::new(rustls::crypto::ring::default_provider());
        let leaf = ca.leaf(Use::Server, &["localhost"], &[]);
        let certs = hookwire::tls::load_certs("srv.crt".as_ref(), leaf.cert.as_bytes()).unwrap();
        let key = hookwire::tls::load_key("srv.key".as_ref(), leaf.key.as_bytes()).unwrap();
        let roots =
            hookwire::tls::load_roots("ca.pem".as_ref(), client_ca.pem().as_bytes()).unwrap();
        let server = |auth: bool| {
            let b = rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap();
            let b = if auth {
                let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots.clone()),
                    provider(),
                )
                .build()
                .unwrap();
                b.with_client_cert_verifier(v)
            } else {
                b.with_no_client_auth()
            };
            let mut c = b.with_single_cert(certs.clone(), key.clone_key()).unwrap();
            c.alpn_protocols = vec![b"h2".to_vec()];
            tokio_rustls::TlsAcceptor::from(Arc::new(c))
        };
        let (open, refusing) = (server(false), server(true));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (end_first, ended) = tokio::sync::watch::channel(false);
        let first_ended = Arc::new(tokio::sync::Semaphore::new(0));
        let done = first_ended.clone();
        tokio::spawn(async move {
            for _ in 0..2 {
                let (tcp, _) = listener.accept().await.unwrap();
                let (open, mut ended, done) = (open.clone(), ended.clone(), done.clone());
                tokio::spawn(async move {
                    let mut tls = open.accept(tcp).await.unwrap();
                    // An empty SETTINGS frame: no stream limit.
                    tls.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
                    tls.flush().await.unwrap();
                    let mut buf = [0u8; 4096];
                    loop {
                        tokio::select! {
                            _ = ended.wait_for(|e| *e) => break,
                            n = tls.read(&mut buf) => if !matches!(n, Ok(n) if n > 0) { break },
                        }
                    }
                    let _ = tls.shutdown().await;
                    // Until hookwire has seen the end and closed its side.
                    while matches!(tls.read(&mut buf).await, Ok(n) if n > 0) {}
                    done.add_permits(1);
                });
            }
            let (a, _) = listener.accept().await.unwrap();
            let (b, _) = listener.accept().await.unwrap();
            let refused = tokio::spawn(async move {
                let _ = refusing.accept(a).await;
            });
            if let Ok(tls) = open.accept(b).await {
                drop(tls);
            }
            let _ = refused.await;
            // Anything later: held open, never answered.
            let mut held = Vec::new();
            while let Ok((tcp, _)) = listener.accept().await {
                held.push(tcp);
            }
        });
        Staged {
            endpoint: format!("https://localhost:{port}"),
            end_first,
            first_ended,
        }
    }

    async fn end_first_pair(&self) {
        self.end_first.send_replace(true);
        let _ = self.first_ended.acquire_many(2).await.unwrap();
    }
}

/// Two connections to one TLS hook fail at the same time: one is refused
/// after the handshake (no client certificate), the other is closed by a
/// server that asked for nothing. Each failure is classified by what
/// happened on its own connection: the refusal as `tls` saying what the
/// server wanted, the close as `stream_reset`, not one blamed on the
/// other (what one connection learned of its handshake was kept per hook,
/// and each connection attempt cleared it).
#[tokio::test]
async fn two_connections_failing_at_once_each_say_their_own_cause() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, client_ca) = (Ca::new("hooks CA"), Ca::new("clients CA"));
    let ca_file = write_pem(dir.path(), "ca.pem", &ca.pem());
    let staged = Staged::start(&ca, &client_ca).await;
    // One stream per connection: two calls at once take two connections.
    let yaml = format!(
        "hooks:\n  - name: h\n    endpoint: {}\n    connections: {{max_streams_per_connection: 1}}\n    tls: {{ca_file: {}}}\nagents: [{{name: a, model: m}}]\nmodels: [{{name: m, provider: scripted}}]\n",
        staged.endpoint,
        ca_file.display()
    );
    let cfg = hookwire::config::Config::parse(&yaml, "test").unwrap();
    let client = hookwire::hooks::client::HookClient::new(
        0,
        cfg.hooks[0].clone(),
        std::time::Duration::from_secs(5),
    )
    .unwrap();
    let wait = std::time::Duration::from_millis(500);
    // The pool's two connections, made one after the other (a pool learns
    // one connection's limit before it opens the next); the server answers
    // no call on them.
    let (a, b) = tokio::join!(client.describe(wait), client.describe(wait));
    assert_eq!(a.unwrap_err().class, FailureClass::Deadline);
    assert_eq!(b.unwrap_err().class, FailureClass::Deadline);
    assert_eq!(client.pool().load().0, 2, "two connections");
    // Their server goes; the next two calls reconnect both at once.
    staged.end_first_pair().await;
    let wait = std::time::Duration::from_secs(5);
    let (a, b) = tokio::join!(client.describe(wait), client.describe(wait));
    let mut faults = [a.unwrap_err(), b.unwrap_err()];
    faults.sort_by_key(|f| f.class.name());
    let [reset, refused] = &faults;
    assert_eq!(
        (refused.class, reset.class),
        (FailureClass::Tls, FailureClass::StreamReset),
        "{faults:?}"
    );
    assert!(
        refused.detail.contains("client certificate"),
        "{}",
        refused.detail
    );
    assert!(!reset.detail.contains("certificate"), "{}", reset.detail);
}
