//! The `hookwire` command line: the server, a run client, session and
//! config tools.

mod client;

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::telemetry::LogFormat;

#[derive(Parser, Debug)]
#[command(
    name = "hookwire",
    version,
    about = "Run LLM agent sessions with remote gRPC hook servers at every lifecycle event."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve AgentService, gRPC health and reflection.
    Serve {
        /// YAML config file; without it the embedded default runs (agent
        /// `demo` on the scripted model, no hooks). HOOKWIRE_HOOK_<NAME>_ENDPOINT
        /// and HOOKWIRE_MODEL_<NAME>_BASE_URL override endpoints in it.
        #[arg(long, env = "HOOKWIRE_CONFIG")]
        config: Option<PathBuf>,
        /// gRPC listen address (overrides `listen:` in the config).
        #[arg(long, env = "HOOKWIRE_LISTEN")]
        listen: Option<SocketAddr>,
        /// Admin HTTP listen address for /metrics, /healthz, /readyz
        /// (overrides `admin_listen:`).
        #[arg(long, env = "HOOKWIRE_ADMIN_LISTEN")]
        admin_listen: Option<SocketAddr>,
        /// Log line format on stderr.
        #[arg(long, env = "HOOKWIRE_LOG_FORMAT", value_enum, default_value = "text")]
        log_format: LogFormat,
    },
    /// Run one prompt against a server and render the streamed timeline.
    Run {
        /// Server address.
        #[arg(long, env = "HOOKWIRE_ADDR", default_value = "http://127.0.0.1:50051")]
        addr: String,
        /// Agent for a new session (ignored with --session).
        #[arg(long, default_value = "demo")]
        agent: String,
        /// Continue an existing session instead of creating one.
        #[arg(long)]
        session: Option<String>,
        /// Extra configured hooks to enable on a new session.
        #[arg(long = "hook")]
        hooks: Vec<String>,
        /// Print one JSON object per run event per line.
        #[arg(long)]
        json: bool,
        /// The user input.
        prompt: String,
    },
    /// List, show or delete sessions on a server.
    Sessions {
        #[arg(
            long,
            global = true,
            env = "HOOKWIRE_ADDR",
            default_value = "http://127.0.0.1:50051"
        )]
        addr: String,
        #[command(subcommand)]
        action: SessionsAction,
    },
    /// Configured hooks of a server with their state.
    Hooks {
        #[arg(long, env = "HOOKWIRE_ADDR", default_value = "http://127.0.0.1:50051")]
        addr: String,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
}

#[derive(Subcommand, Debug)]
pub enum SessionsAction {
    List,
    /// Show a session with its transcript.
    Show {
        id: String,
    },
    Delete {
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum ConfigAction {
    /// Validate a config file, with the environment's endpoint overrides
    /// applied as `serve` would; exit 0 when valid, 1 with the error otherwise.
    Check { file: PathBuf },
}

/// Entry point of the binary; errors surface as a message and exit 1.
pub async fn main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve {
            config,
            listen,
            admin_listen,
            log_format,
        } => {
            let mut cfg = match &config {
                Some(path) => Config::load(path)?,
                None => Config::embedded_default(),
            };
            let telemetry = crate::telemetry::init(&cfg.telemetry, log_format)?;
            if let Some(l) = listen {
                cfg.listen = l;
            }
            if let Some(a) = admin_listen {
                cfg.admin_listen = a;
            }
            let listener = tokio::net::TcpListener::bind(cfg.listen)
                .await
                .with_context(|| {
                    format!(
                        "cannot listen on {} (is it taken? use --listen)",
                        cfg.listen
                    )
                })?;
            let admin = tokio::net::TcpListener::bind(cfg.admin_listen)
                .await
                .with_context(|| {
                    format!(
                        "cannot listen on {} for the admin port (use --admin-listen)",
                        cfg.admin_listen
                    )
                })?;
            tracing::info!(
                grpc = %listener.local_addr()?,
                admin = %admin.local_addr()?,
                "listening"
            );
            let served =
                crate::server::serve_with_admin(listener, Some(admin), cfg, shutdown_signal())
                    .await;
            // Flush spans even when serving failed.
            telemetry.shutdown().await;
            served?;
            Ok(())
        }
        Command::Run {
            addr,
            agent,
            session,
            hooks,
            json,
            prompt,
        } => client::run(&addr, &agent, session, hooks, json, prompt).await,
        Command::Sessions { addr, action } => client::sessions(&addr, action).await,
        Command::Hooks { addr } => client::hooks(&addr).await,
        Command::Config {
            action: ConfigAction::Check { file },
        } => {
            let cfg = Config::load(&file)?;
            println!(
                "{}: ok ({} models, {} hooks, {} agents)",
                file.display(),
                cfg.models.len(),
                cfg.hooks.len(),
                cfg.agents.len()
            );
            Ok(())
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
