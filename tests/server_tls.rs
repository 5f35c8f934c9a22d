//! TLS and mTLS on hookwire's own port: tonic clients, the real grpcurl
//! binary and hookwire's CLI, callers identified by their certificate, and
//! a server certificate rotated on disk.

mod support;

use std::path::{Path, PathBuf};

use hookwire::config::Config;
use hookwire::pb;
use hookwire::pb::agent_service_client::AgentServiceClient;
use support::auth::{Tokens, ALICE};
use support::certs::{write_atomic, write_pem, Ca, Leaf, Use};
use support::*;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic::Code;

const ALICE_ID: &str = "spiffe://example.org/ns/team-a/sa/alice";
const BOB_ID: &str = "spiffe://example.org/ns/team-b/sa/bob";

struct TlsServer {
    addr: String,
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), hookwire::server::ServeError>>,
}

impl TlsServer {
    async fn start(yaml: &str) -> TlsServer {
        let config = Config::parse(yaml, "test config").expect("valid config");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(hookwire::server::serve(listener, config, async {
            let _ = rx.await;
        }));
        TlsServer {
            addr: format!("https://localhost:{port}"),
            port,
            stop: Some(tx),
            task,
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

struct Pki {
    dir: tempfile::TempDir,
    server_ca: PathBuf,
    client_ca: PathBuf,
    server: (PathBuf, PathBuf),
    alice: (PathBuf, PathBuf),
    bob: (PathBuf, PathBuf),
    client_ca_obj: Ca,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let sca = Ca::new("hookwire server CA");
        let cca = Ca::new("hookwire clients CA");
        let server = sca
            .leaf(Use::Server, &["localhost"], &[])
            .write(dir.path(), "server");
        let alice = cca
            .leaf(Use::Client, &[], &[ALICE_ID])
            .write(dir.path(), "alice");
        let bob = cca
            .leaf(Use::Client, &[], &[BOB_ID])
            .write(dir.path(), "bob");
        Pki {
            server_ca: write_pem(dir.path(), "server-ca.pem", &sca.pem()),
            client_ca: write_pem(dir.path(), "client-ca.pem", &cca.pem()),
            server,
            alice,
            bob,
            client_ca_obj: cca,
            dir,
        }
    }

    fn tls_yaml(&self, client_auth: &str) -> String {
        format!(
            "tls: {{cert_file: {}, key_file: {}, client_ca_file: {}, client_auth: {client_auth}}}\nserver: {{reload_interval: 0s}}\n",
            self.server.0.display(),
            self.server.1.display(),
            self.client_ca.display()
        )
    }
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

async fn tls_client(
    addr: &str,
    ca: &Path,
    identity: Option<&(PathBuf, PathBuf)>,
) -> Result<AgentServiceClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)));
    if let Some((c, k)) = identity {
        tls = tls.identity(Identity::from_pem(read(c), read(k)));
    }
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(AgentServiceClient::new(ch))
}

/// Waits until the TLS server answers health (no credentials needed).
async fn wait_tls_health(addr: &str, ca: &Path) {
    for _ in 0..400 {
        let ch = Channel::from_shared(addr.to_string())
            .unwrap()
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca))))
            .unwrap()
            .connect()
            .await;
        if let Ok(ch) = ch {
            if tonic_health::pb::health_client::HealthClient::new(ch)
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await
                .is_ok()
            {
                return;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("the TLS server never answered health");
}

const MODELS: &str = "models: [{name: m, provider: scripted}]\nagents: [{name: a, model: m}]\n";

#[tokio::test]
async fn mtls_callers_are_named_by_their_certificate() {
    let pki = Pki::new();
    let yaml = format!(
        "{MODELS}{}auth:\n  mode: mtls\n  principal_roles: {{\"{BOB_ID}\": [auditor]}}\n  forward_claims: [roles, san]\n",
        pki.tls_yaml("required")
    );
    let server = TlsServer::start(&yaml).await;
    let mut alice = loop {
        // serve() binds before it is ready: retry the first connection.
        match tls_client(&server.addr, &pki.server_ca, Some(&pki.alice)).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(25)).await,
        }
    };
    let s = alice
        .create_session(pb::CreateSessionRequest {
            agent: "a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .id;
    let r = alice
        .invoke(pb::RunRequest {
            session_id: s.clone(),
            input: "hi".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome(&r), pb::RunOutcome::Completed);

    let mut bob = tls_client(&server.addr, &pki.server_ca, Some(&pki.bob))
        .await
        .unwrap();
    let e = bob
        .get_session(pb::GetSessionRequest {
            session_id: s.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "bob cannot see alice's session");
    assert!(bob
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sessions
        .is_empty());

    // Without a client certificate the handshake itself is refused.
    let none = tls_client(&server.addr, &pki.server_ca, None).await;
    let refused = match none {
        Err(_) => true,
        Ok(mut c) => c
            .list_sessions(pb::ListSessionsRequest::default())
            .await
            .is_err(),
    };
    assert!(
        refused,
        "client_auth: required lets no one in without a certificate"
    );
    server.stop().await;
}

#[tokio::test]
async fn grpcurl_and_the_cli_speak_tls_and_mtls() {
    let pki = Pki::new();
    let tokens = Tokens::write();
    // optional client certificates, callers authenticated by token.
    let yaml = format!("{MODELS}{}{}", pki.tls_yaml("optional"), tokens.auth_yaml());
    let server = TlsServer::start(&yaml).await;
    let target = format!("localhost:{}", server.port);
    let grpcurl = |extra: &[&str], rest: &[&str]| {
        let mut cmd = tokio::process::Command::new("grpcurl");
        cmd.args(["-cacert", pki.server_ca.to_str().unwrap()]);
        cmd.args(extra);
        cmd.args(rest);
        cmd
    };
    wait_tls_health(&server.addr, &pki.server_ca).await;
    // grpcurl resolves even the health method by reflection, which needs
    // credentials (probes use gRPC's health protocol itself and need none).
    let auth = format!("authorization: Bearer {ALICE}");
    let (success, out) = command_output(&mut grpcurl(
        &["-H", &auth],
        &[&target, "grpc.health.v1.Health/Check"],
    ))
    .await;
    assert!(success && out.contains("SERVING"), "{out}");
    let cert = pki.alice.0.to_str().unwrap();
    let key = pki.alice.1.to_str().unwrap();
    // mTLS (-cert/-key) plus the token: reflection and a call.
    let (success, out) = command_output(&mut grpcurl(
        &["-cert", cert, "-key", key, "-H", &auth],
        &[&target, "list"],
    ))
    .await;
    assert!(success && out.contains("hookwire.v1.AgentService"), "{out}");
    let (success, out) = command_output(&mut grpcurl(
        &[
            "-cert",
            cert,
            "-key",
            key,
            "-H",
            &auth,
            "-d",
            r#"{"agent":"a"}"#,
        ],
        &[&target, "hookwire.v1.AgentService/CreateSession"],
    ))
    .await;
    assert!(
        success && out.contains("\"owner\": \"alice\"") && out.contains("\"id\""),
        "{out}"
    );
    // Without the token: UNAUTHENTICATED, whatever the certificate.
    let (success, out) = command_output(&mut grpcurl(
        &["-cert", cert, "-key", key, "-d", r#"{"agent":"a"}"#],
        &[&target, "hookwire.v1.AgentService/CreateSession"],
    ))
    .await;
    assert!(!success && out.contains("Unauthenticated"), "{out}");
    // Plaintext against the TLS port fails.
    let (success, _) = command_output(tokio::process::Command::new("grpcurl").args([
        "-plaintext",
        "-connect-timeout",
        "1",
        &target,
        "list",
    ]))
    .await;
    assert!(!success);

    // hookwire's own CLI: --ca-file, --cert-file/--key-file, HOOKWIRE_TOKEN.
    let bin = env!("CARGO_BIN_EXE_hookwire");
    let (success, out) = command_output(
        tokio::process::Command::new(bin)
            .args([
                "run",
                "--addr",
                &server.addr,
                "--agent",
                "a",
                "hello over tls",
            ])
            .args(["--ca-file", pki.server_ca.to_str().unwrap()])
            .args(["--cert-file", cert, "--key-file", key])
            .env("HOOKWIRE_TOKEN", ALICE),
    )
    .await;
    assert!(success, "{out}");
    assert!(out.contains("completed"), "{out}");
    let (success, out) = command_output(
        tokio::process::Command::new(bin)
            .args(["sessions", "list", "--addr", &server.addr])
            .args(["--ca-file", pki.server_ca.to_str().unwrap()])
            .env("HOOKWIRE_TOKEN", ALICE),
    )
    .await;
    assert!(success, "{out}");
    // Two sessions of alice's (grpcurl's and the run's), one of them run.
    assert_eq!(out.matches("agent=a").count(), 2, "{out}");
    assert!(out.contains("runs=1"), "{out}");
    assert_eq!(out.matches("owner=alice").count(), 2, "{out}");
    let (success, out) = command_output(
        tokio::process::Command::new(bin)
            .args(["hooks", "list", "--addr", &server.addr])
            .args(["--ca-file", pki.server_ca.to_str().unwrap()])
            .env_remove("HOOKWIRE_TOKEN"),
    )
    .await;
    assert!(!success && out.contains("Unauthenticated"), "{out}");
    server.stop().await;
}

#[tokio::test]
async fn a_rotated_server_certificate_is_served_to_new_connections() {
    let pki = Pki::new();
    let yaml = format!("{MODELS}{}", pki.tls_yaml("optional"));
    let server = TlsServer::start(&yaml).await;
    let health = |ca: PathBuf, addr: String| async move {
        let ch = Channel::from_shared(addr)
            .unwrap()
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&ca))))
            .unwrap()
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest::default())
            .await
            .map(|_| ())
            .map_err(|s| s.to_string())
    };
    let mut up = false;
    for _ in 0..200 {
        if health(pki.server_ca.clone(), server.addr.clone())
            .await
            .is_ok()
        {
            up = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert!(up);
    // cert-manager reissues from a new CA: the files change in place.
    let new_ca = Ca::new("next server CA");
    let leaf: Leaf = new_ca.leaf(Use::Server, &["localhost"], &[]);
    let new_ca_file = write_pem(pki.dir.path(), "next-ca.pem", &new_ca.pem());
    write_atomic(&pki.server.1, &leaf.key);
    write_atomic(&pki.server.0, &leaf.cert);
    assert!(
        health(new_ca_file, server.addr.clone()).await.is_ok(),
        "a new connection gets the new certificate"
    );
    assert!(
        health(pki.server_ca.clone(), server.addr.clone())
            .await
            .is_err(),
        "the old CA no longer verifies it"
    );
    let _ = &pki.client_ca_obj;
    server.stop().await;
}
