//! How the CLI client reaches a hookwire server: plaintext or TLS (with a
//! private CA and a client certificate for mTLS), and a bearer token.

use std::path::PathBuf;

use anyhow::Context;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::pb::agent_service_client::AgentServiceClient;

/// Connection options shared by `run`, `sessions` and `hooks list`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServerOpts {
    /// PEM CA bundle to verify an https:// server with (default: the webpki roots).
    #[arg(long, global = true, env = "HOOKWIRE_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate for servers that require mTLS (with --key-file).
    #[arg(long, global = true, env = "HOOKWIRE_CERT_FILE", requires = "key_file")]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of --cert-file.
    #[arg(long, global = true, env = "HOOKWIRE_KEY_FILE", requires = "cert_file")]
    pub key_file: Option<PathBuf>,
    /// Bearer token sent as `authorization: Bearer …` (prefer the
    /// environment variable: command lines are visible to other users).
    #[arg(long, global = true, env = "HOOKWIRE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Adds the bearer token to every call.
#[derive(Clone, Default)]
pub struct Token(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Token {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type Client = AgentServiceClient<InterceptedService<Channel, Token>>;

fn read(what: &str, p: &PathBuf) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("cannot read {what} {}", p.display()))
}

pub async fn connect(addr: &str, opts: &ServerOpts) -> anyhow::Result<Client> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(addr.to_string())
        .with_context(|| {
            format!("bad server address `{addr}` (expected e.g. http://127.0.0.1:50051)")
        })?
        .tcp_nodelay(true)
        // An address that drops packets would otherwise hang for the OS's
        // SYN retries (about 2 minutes) before saying anything.
        .connect_timeout(std::time::Duration::from_secs(10));
    let tls_flags = opts.ca_file.is_some() || opts.cert_file.is_some();
    if addr.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        tls = match &opts.ca_file {
            Some(f) => tls.ca_certificate(Certificate::from_pem(read("--ca-file", f)?)),
            None => tls.with_webpki_roots(),
        };
        if let (Some(c), Some(k)) = (&opts.cert_file, &opts.key_file) {
            tls = tls.identity(Identity::from_pem(
                read("--cert-file", c)?,
                read("--key-file", k)?,
            ));
        }
        endpoint = endpoint.tls_config(tls).context("TLS setup")?;
    } else if tls_flags {
        anyhow::bail!("--ca-file/--cert-file need an https:// server address (got {addr})");
    }
    let ch = endpoint.connect().await.with_context(|| {
        format!("cannot connect to hookwire at {addr} (is `hookwire serve` running?)")
    })?;
    let token = match &opts.token {
        Some(t) => {
            let mut v: tonic::metadata::MetadataValue<_> =
                format!("Bearer {}", t.trim())
                    .parse()
                    .context("the token has characters not allowed in a header")?;
            v.set_sensitive(true);
            Token(Some(v))
        }
        None => Token(None),
    };
    Ok(AgentServiceClient::with_interceptor(ch, token))
}
