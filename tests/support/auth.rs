//! Authenticated callers for tests: a tokens file with four principals and
//! clients that send `authorization: Bearer …`.

use std::path::PathBuf;

use hookwire::auth::tokens::token_sha256;
use hookwire::pb;
use hookwire::pb::agent_service_client::AgentServiceClient;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

pub const ALICE: &str = "alice-token-6f1c";
pub const BOB: &str = "bob-token-91ad";
pub const ROOT: &str = "root-token-03be";
pub const CAROL: &str = "carol-token-5e77";

/// A tokens file: alice (tenant acme), bob, root (admin), carol (approver).
pub struct Tokens {
    pub dir: tempfile::TempDir,
    pub file: PathBuf,
}

impl Tokens {
    pub fn write() -> Tokens {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens.yaml");
        std::fs::write(
            &file,
            format!(
                "tokens:\n\
                 \x20 - {{principal: alice, sha256: {}, roles: [user], claims: {{tenant: acme, team: blue}}}}\n\
                 \x20 - {{principal: bob, sha256: {}}}\n\
                 \x20 - {{principal: root, sha256: {}, roles: [admin]}}\n\
                 \x20 - {{principal: carol, sha256: {}, roles: [approver]}}\n",
                token_sha256(ALICE),
                token_sha256(BOB),
                token_sha256(ROOT),
                token_sha256(CAROL)
            ),
        )
        .unwrap();
        Tokens { dir, file }
    }

    /// YAML for `auth:` in tokens mode with this file.
    pub fn auth_yaml(&self) -> String {
        format!(
            "auth:\n  mode: tokens\n  tokens_file: {}\n  forward_claims: [roles, tenant]\n",
            self.file.display()
        )
    }
}

/// Adds `authorization: Bearer <token>` to every call (none when `None`).
#[derive(Clone)]
pub struct Bearer(pub Option<String>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        Ok(req)
    }
}

pub type Client = AgentServiceClient<InterceptedService<Channel, Bearer>>;

/// A client of `addr` presenting `token`, once the server answers health
/// (which needs no credentials).
pub async fn client(addr: &str, token: Option<&str>) -> Client {
    let ch = Channel::from_shared(addr.to_string())
        .unwrap()
        .connect_lazy();
    wait_serving(ch.clone()).await;
    AgentServiceClient::with_interceptor(ch, Bearer(token.map(str::to_string)))
}

/// Waits until grpc.health.v1 says SERVING (health is exempt from auth).
pub async fn wait_serving(ch: Channel) {
    let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
    for _ in 0..400 {
        if let Ok(r) = h
            .check(tonic_health::pb::HealthCheckRequest {
                service: "hookwire.v1.AgentService".into(),
            })
            .await
        {
            if r.into_inner().status
                == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
            {
                return;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("hookwire never reported SERVING");
}

pub async fn new_session(c: &mut Client, agent: &str) -> Result<String, tonic::Status> {
    c.create_session(pb::CreateSessionRequest {
        agent: agent.into(),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner().id)
}
