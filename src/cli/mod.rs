//! The `hookwire` command line: the server, a run client, session, hook
//! (list and conformance check) and config tools.

mod client;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::config::{Config, StoreSetting};
use crate::event::EventKind;
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
        /// Log line format (logs go to stdout).
        #[arg(long, env = "HOOKWIRE_LOG_FORMAT", value_enum, default_value = "text")]
        log_format: LogFormat,
        /// Where sessions live: memory, sqlite:///path/to/file.db or
        /// postgres://user@host:5432/db (password from PGPASSWORD; only this
        /// variable, not the flag, may carry one in the URL). Overrides
        /// `store:` in the config.
        #[arg(long, value_name = "URL")]
        store: Option<String>,
        /// Directory of the default store (SQLite file `hookwire.db`), used
        /// when neither --store nor `store:` is given. Default:
        /// $XDG_DATA_HOME/hookwire, else ~/.local/share/hookwire, else
        /// ./.hookwire.
        #[arg(long, env = "HOOKWIRE_DATA_DIR", value_name = "DIR")]
        data_dir: Option<PathBuf>,
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
    /// Hook servers: list a hookwire server's configured hooks, or check a
    /// hook server against the protocol.
    Hooks {
        #[command(subcommand)]
        action: HooksAction,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
}

#[derive(Subcommand, Debug)]
pub enum SessionsAction {
    /// List sessions (all pages), oldest first.
    List {
        /// Only sessions of this agent.
        #[arg(long)]
        agent: Option<String>,
    },
    /// Show a session with its transcript.
    Show {
        id: String,
    },
    Delete {
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum HooksAction {
    /// List a hookwire server's configured hooks with their state.
    ///
    /// Connection state, subscriptions and tools of each configured hook
    /// (AgentService.ListHooks).
    List {
        /// hookwire server address.
        #[arg(long, env = "HOOKWIRE_ADDR", default_value = "http://127.0.0.1:50051")]
        addr: String,
    },
    /// Check a hook server against the protocol: one PASS/FAIL row per check.
    ///
    /// Calls Describe and grpc.health.v1, plays a scripted session and run
    /// covering every event the server subscribes to (as hookwire plays
    /// them), and calls every tool it owns. Exits 0 only when no check
    /// fails.
    #[command(after_help = CHECK_HELP)]
    Check {
        /// The hook server: http://host:port, https://host:port, or
        /// host:port (plaintext).
        endpoint: String,
        /// Only exercise these events (comma-separated snake_case names);
        /// like a hook's `events:` in config, this can only narrow what
        /// Describe lists.
        #[arg(long, value_delimiter = ',')]
        events: Option<Vec<EventKind>>,
        /// Deadline sent with every event (deadline_remaining_ms) and limit
        /// for Describe, health and CallTool, e.g. 500ms, 5s.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        timeout: Duration,
        /// Arguments for an owned tool instead of ones derived from its
        /// schema: NAME='{"json":"object"}'. Repeatable.
        #[arg(long = "tool-args", value_name = "NAME=JSON", value_parser = parse_tool_args)]
        tool_args: Vec<(String, String)>,
        /// Print the report as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

const CHECK_HELP: &str = "\
Checks, each a row of the report:
  describe      answers; non-empty name; known events; tool names
  health        grpc.health.v1 Check(\"\") and Check(hookwire.v1.HookService) are SERVING (SKIP if not served)
  tool NAME     schema is a valid JSON Schema for an object; arguments derived from it (its `examples`
                first) are valid; CallTool with them answers a non-error result in time
  per event     a blocking event gets exactly one verdict with its seq, within the deadline it was sent,
                of the event's kind and valid (the same rules hookwire applies); an observe-only event
                (text_delta, run_end, session_end) gets none
  per stream    opens the way hookwire opens it; no verdict for a seq never sent; the server ends its
                side with OK once hookwire half-closes it

Exit status: 0 when no check failed, 1 otherwise (2 for a usage error).";

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime_serde::re::humantime::parse_duration(s).map_err(|e| format!("{e} (e.g. 500ms, 5s)"))
}

fn parse_tool_args(s: &str) -> Result<(String, String), String> {
    let (name, json) = s
        .split_once('=')
        .ok_or_else(|| "expected NAME=JSON, e.g. get_weather='{\"city\":\"Paris\"}'".to_string())?;
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(_)) => Ok((name.trim().to_string(), json.to_string())),
        Ok(_) => Err(format!("the arguments for `{name}` must be a JSON object")),
        Err(e) => Err(format!(
            "the arguments for `{name}` are not valid JSON: {e}"
        )),
    }
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
            store,
            data_dir,
        } => {
            let mut cfg = match &config {
                Some(path) => Config::load(path)?,
                None => Config::embedded_default(),
            };
            cfg.store = Some(resolve_store(store, cfg.store.take(), data_dir)?);
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
        Command::Hooks {
            action: HooksAction::List { addr },
        } => client::hooks(&addr).await,
        Command::Hooks {
            action:
                HooksAction::Check {
                    endpoint,
                    events,
                    timeout,
                    tool_args,
                    json,
                },
        } => {
            let opts = crate::conformance::Options {
                endpoint,
                events,
                timeout,
                tool_args: tool_args.into_iter().collect(),
            };
            let report = crate::conformance::check(&opts).await?;
            if json {
                println!("{}", report.to_json());
            } else {
                print!("{}", report.table());
            }
            if !report.passed() {
                anyhow::bail!(
                    "{} of {} checks failed",
                    report.count(crate::conformance::Status::Fail),
                    report.rows.len()
                );
            }
            Ok(())
        }
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

/// The store `serve` uses: --store, else HOOKWIRE_STORE (which alone may
/// carry a password), else the config's `store:`, else SQLite in the data
/// directory.
fn resolve_store(
    flag: Option<String>,
    configured: Option<StoreSetting>,
    data_dir: Option<PathBuf>,
) -> anyhow::Result<StoreSetting> {
    if let Some(url) = flag {
        return StoreSetting::parse(&url, false).map_err(|e| anyhow::anyhow!("--store: {e}"));
    }
    if let Some(url) = std::env::var("HOOKWIRE_STORE")
        .ok()
        .filter(|v| !v.is_empty())
    {
        return StoreSetting::parse(&url, true).map_err(|e| anyhow::anyhow!("HOOKWIRE_STORE: {e}"));
    }
    if let Some(s) = configured {
        return Ok(s);
    }
    let dir = data_dir.unwrap_or_else(default_data_dir);
    Ok(StoreSetting::Sqlite {
        path: dir.join("hookwire.db"),
    })
}

/// Per-user data (XDG): sessions outlive the checkout or the build that
/// made them, and never land in a source tree by accident.
fn default_data_dir() -> PathBuf {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(x) = env("XDG_DATA_HOME") {
        return x.join("hookwire");
    }
    if let Some(h) = env("HOME") {
        return h.join(".local/share/hookwire");
    }
    PathBuf::from(".hookwire")
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
