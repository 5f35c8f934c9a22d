//! The `hookwire` command line: the server, a run client, session, hook
//! (list and conformance check) and config tools.

/// `println!` that hands back the write's error instead of panicking:
/// `hookwire sessions list | head -1` closes the pipe, which `println!`
/// turned into a panic (exit 101); main treats a broken pipe as done.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

/// `print!`, as [`outln`].
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout().lock(), $($arg)*)
    }};
}

mod client;
pub mod connection;
mod fd_limit;
mod json;
pub mod load;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use crate::config::{Config, StoreSetting};
use crate::event::EventKind;
use crate::telemetry::LogFormat;

/// `hookwire --version`: the crate version and the git commit it was built
/// from ("unknown" without git; see build.rs).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("HOOKWIRE_COMMIT"),
    ")"
);

#[derive(Parser, Debug)]
#[command(
    name = "hookwire",
    version = VERSION,
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
        /// YAML config file; without it the embedded demo runs: agent `demo`
        /// on the scripted model with a built-in demo hook server (redacts
        /// sk-… keys at run_start, owns get_weather, denies delete_* tools).
        /// HOOKWIRE_HOOK_<NAME>_ENDPOINT and HOOKWIRE_MODEL_<NAME>_BASE_URL
        /// override endpoints in it.
        #[arg(long, env = "HOOKWIRE_CONFIG")]
        config: Option<PathBuf>,
        /// Without --config: serve the demo agent with no hooks at all.
        #[arg(long)]
        no_demo_hooks: bool,
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
        /// postgres://user@host:5432/db (password from PGPASSWORD or
        /// `store.password_env`). Without the flag, the HOOKWIRE_STORE
        /// variable (the only place a URL may carry a password), then
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
        /// Print each run event as one line of JSON, in the canonical
        /// protobuf JSON mapping (as grpcurl and buf curl print it).
        #[arg(long)]
        json: bool,
        /// The user input.
        prompt: String,
        #[command(flatten)]
        server: connection::ServerOpts,
    },
    /// List, show or delete sessions on a server.
    Sessions {
        /// Server address.
        #[arg(
            long,
            global = true,
            env = "HOOKWIRE_ADDR",
            default_value = "http://127.0.0.1:50051"
        )]
        addr: String,
        #[command(subcommand)]
        action: SessionsAction,
        #[command(flatten)]
        server: connection::ServerOpts,
    },
    /// Hook servers: list a hookwire server's configured hooks, or check a
    /// hook server against the protocol.
    Hooks {
        #[command(subcommand)]
        action: HooksAction,
    },
    /// Load a server: N concurrent clients invoke runs back to back for a
    /// while, then print runs/s, latency percentiles and outcomes.
    ///
    /// Each client creates a session, invokes `--runs-per-session` runs on
    /// it (Invoke, the input `--input`), and starts over with a fresh
    /// session, until `--duration` has passed; runs still in flight then
    /// are awaited (at most `--drain`). Exits 0 only when every run
    /// completed.
    Load {
        /// Server address.
        #[arg(long, env = "HOOKWIRE_ADDR", default_value = "http://127.0.0.1:50051")]
        addr: String,
        /// Agent of the sessions.
        #[arg(long, default_value = "demo")]
        agent: String,
        /// Runs in flight at once (one per client), 1..=100000.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// How long to keep starting runs, e.g. 3s, 1m (at most 1h).
        #[arg(long, default_value = "3s", value_parser = parse_duration)]
        duration: Duration,
        /// The user input of every run.
        #[arg(long, default_value = "hello")]
        input: String,
        /// Runs per session before a client starts a fresh one (a longer
        /// conversation makes every later run bigger).
        #[arg(long, default_value_t = 1)]
        runs_per_session: u32,
        /// How long runs in flight at the end may take to finish (at most
        /// 1h); runs still going then are counted unfinished.
        #[arg(long, default_value = "60s", value_parser = parse_duration)]
        drain: Duration,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: connection::ServerOpts,
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
        /// The session's id.
        id: String,
    },
    /// Delete a session (its run, if one is going, is cancelled).
    Delete {
        /// The session's id.
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
        #[command(flatten)]
        server: connection::ServerOpts,
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
        /// PEM CA bundle the server's certificate must chain to (https://;
        /// default: the webpki roots), as a hook's `tls.ca_file`.
        #[arg(long)]
        ca_file: Option<PathBuf>,
        /// PEM client certificate for servers that require mTLS (with --key-file).
        #[arg(long, requires = "key_file")]
        cert_file: Option<PathBuf>,
        /// PEM private key of --cert-file, as a hook's `tls.key_file`.
        #[arg(long, requires = "cert_file")]
        key_file: Option<PathBuf>,
        /// Name to verify the certificate against (and send as SNI) instead
        /// of the endpoint's host, as `tls.server_name`.
        #[arg(long)]
        server_name: Option<String>,
        /// Bearer token sent on every call, as a hook's `credentials`.
        #[arg(long, env = "HOOKWIRE_HOOK_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// The caller the events claim to come from (EventContext.principal).
        #[arg(long, default_value = crate::conformance::script::DEFAULT_PRINCIPAL)]
        principal: String,
        /// A claim of that caller (EventContext.principal_claims): KEY=VALUE.
        /// Repeatable.
        #[arg(long = "claim", value_name = "KEY=VALUE", value_parser = parse_claim)]
        claims: Vec<(String, String)>,
    },
}

fn parse_claim(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| "expected KEY=VALUE, e.g. tenant=acme".to_string())
}

const CHECK_HELP: &str = "\
Checks, each a row of the report:
  describe      answers; non-empty name; known events; tool names
  health        grpc.health.v1 Check(\"\") and Check(hookwire.v1.HookService) are SERVING (SKIP if not served)
  tool NAME     schema is a valid JSON Schema for an object; arguments derived from it (its `examples`
                first) are valid; CallTool with them answers a non-error result in time
  per event     a blocking event gets exactly one verdict with its seq, within the deadline it was sent,
                of the event's kind and valid (the same rules hookwire applies); an observe-only event
                (text_delta, run_end, session_end) gets none. Turn 1 calls the owned tools and three
                stand-ins the server does not own (lookup_order, delete_file, send_email), so a policy's
                skip and ask are exercised; an ask is approved, as a client would
  per stream    opens the way hookwire opens it; the turn's tool_call (then tool_result) events are sent
                all at once, as with tool_concurrency > 1, and each must be answered by its own seq; no
                verdict for a seq never sent; the server ends its side with OK once hookwire half-closes it

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
    /// Check a config file as `serve` would before listening; exit 0 when it
    /// would start, 1 with the error otherwise.
    ///
    /// The same checks (in an order of their own, so with several problems
    /// the first reported may differ): the file (with the environment's
    /// endpoint overrides), authentication and TLS (their files, unless
    /// --skip-files; no authentication off loopback is refused either
    /// way), the trace exporter, every model (URLs, headers, API key
    /// variables), every hook endpoint, the store setting (the one
    /// serve would use without --store: HOOKWIRE_STORE, `store:`, else
    /// SQLite in HOOKWIRE_DATA_DIR or the default data directory; checked
    /// without connecting: a Postgres URL the driver accepts, its
    /// password_env set, a SQLite path that can hold the file), then the
    /// hook servers that answer Describe within 3 s, whose tools must not be
    /// owned twice. An unreachable hook server is reported but, as for
    /// `serve`, not an error.
    Check {
        /// The YAML config file.
        file: PathBuf,
        /// Do not contact hook servers (so tool ownership is not checked).
        #[arg(long)]
        offline: bool,
        /// Do not read the files the security settings name (certificates,
        /// keys, tokens, JWKS, hook tokens): for checking a config away from
        /// the machine or pod it runs on. Their settings are still checked.
        #[arg(long)]
        skip_files: bool,
        /// The gRPC listen address `serve` would use (overrides `listen:`,
        /// as for serve): authentication `none` is refused off loopback.
        #[arg(long, env = "HOOKWIRE_LISTEN")]
        listen: Option<SocketAddr>,
    },
}

/// Entry point of the binary; errors surface as a message and exit 1.
pub async fn main(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve {
            config,
            no_demo_hooks,
            listen,
            admin_listen,
            log_format,
            store,
            data_dir,
        } => {
            // Without a config, the demo hook server runs beside hookwire
            // (its own loopback port) and is called over gRPC like any hook.
            let demo = match &config {
                None if !no_demo_hooks => Some(
                    crate::demo::DemoHooks::start()
                        .await
                        .context("cannot start the demo hook server (use --no-demo-hooks)")?,
                ),
                _ => None,
            };
            let mut cfg = match (&config, &demo) {
                (Some(path), _) => Config::load(path)?,
                (None, Some(demo)) => demo.config()?,
                (None, None) => Config::embedded_default(),
            };
            cfg.store = Some(resolve_store(store, cfg.store.take(), data_dir)?);
            let telemetry = crate::telemetry::init(&cfg.telemetry, log_format)?;
            match fd_limit::raise() {
                Ok(Some((from, to))) => {
                    tracing::info!(from, to, "raised the open-file limit (RLIMIT_NOFILE)")
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("{e}"),
            }
            if let Some(demo) = &demo {
                tracing::info!(
                    hook = crate::demo::guard::NAME,
                    endpoint = demo.endpoint(),
                    "demo hook server started (--no-demo-hooks or a --config leaves it out)"
                );
            }
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
            if let Some(demo) = demo {
                demo.stop().await;
            }
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
            server,
        } => client::run(&addr, &server, &agent, session, hooks, json, prompt).await,
        Command::Sessions {
            addr,
            action,
            server,
        } => client::sessions(&addr, &server, action).await,
        Command::Hooks {
            action: HooksAction::List { addr, server },
        } => client::hooks(&addr, &server).await,
        Command::Hooks {
            action:
                HooksAction::Check {
                    endpoint,
                    events,
                    timeout,
                    tool_args,
                    json,
                    ca_file,
                    cert_file,
                    key_file,
                    server_name,
                    token,
                    principal,
                    claims,
                },
        } => {
            let mut opts = crate::conformance::Options::new(endpoint);
            opts.events = events;
            opts.timeout = timeout;
            opts.tool_args = tool_args.into_iter().collect();
            opts.tls = crate::config::HookTls {
                ca_file,
                cert_file,
                key_file,
                server_name,
            };
            opts.token = token;
            opts.principal = principal;
            if !claims.is_empty() {
                opts.principal_claims = claims.into_iter().collect();
            }
            let report = crate::conformance::check(&opts).await?;
            if json {
                outln!("{}", report.to_json())?;
            } else {
                out!("{}", report.table())?;
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
        Command::Load {
            addr,
            agent,
            concurrency,
            duration,
            input,
            runs_per_session,
            drain,
            json,
            server,
        } => {
            let report = load::run(load::Options {
                addr,
                agent,
                concurrency,
                duration,
                input,
                runs_per_session,
                drain,
                server,
            })
            .await?;
            if json {
                outln!("{}", serde_json::to_string(&report)?)?;
            } else {
                out!("{}", report.text())?;
            }
            if !report.all_completed() {
                anyhow::bail!("not every run completed (see outcomes and errors above)");
            }
            Ok(())
        }
        Command::Config {
            action:
                ConfigAction::Check {
                    file,
                    offline,
                    skip_files,
                    listen,
                },
        } => check_config(&file, offline, skip_files, listen).await,
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

/// `hookwire config check`: `serve`'s start-up checks, without listening.
async fn check_config(
    file: &std::path::Path,
    offline: bool,
    skip_files: bool,
    listen: Option<SocketAddr>,
) -> anyhow::Result<()> {
    let cfg = Config::load(file)?;
    // Where serve would listen: HOOKWIRE_LISTEN (the image sets it) wins.
    let listen = listen.unwrap_or(cfg.listen);
    let mut cfg = if skip_files {
        // Without the files, still the check that needs none of them.
        crate::auth::refuse_open(&cfg.auth, listen)?;
        crate::server::preflight::without_files(&cfg)
    } else {
        // Authentication and TLS as `serve` sets them up there.
        crate::server::preflight::security(&cfg, listen)?;
        cfg
    };
    // The exporter `serve` would install, built and dropped.
    let (_, telemetry) = crate::telemetry::build(
        &crate::telemetry::TelemetryOptions::from_env(&cfg.telemetry, LogFormat::Text),
        tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::io::sink),
    )?;
    telemetry.shutdown().await;
    // The store serve would use without --store: HOOKWIRE_STORE, the
    // file's `store:`, else SQLite in HOOKWIRE_DATA_DIR or the default.
    let data_dir = std::env::var_os("HOOKWIRE_DATA_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    cfg.store = Some(resolve_store(None, cfg.store.take(), data_dir)?);
    let describe = (!offline).then_some(crate::server::preflight::STARTUP_DESCRIBE);
    let inst = crate::telemetry::Instruments::new(&cfg.telemetry);
    let engine = crate::server::preflight::engine(
        &cfg,
        inst,
        describe,
        crate::server::preflight::StoreUse::CheckOnly,
    )
    .await?;
    outln!(
        "{}: ok ({} models, {} hooks, {} agents)",
        file.display(),
        cfg.models.len(),
        cfg.hooks.len(),
        cfg.agents.len()
    )?;
    outln!(
        "  store {}: setting checked, not opened (config check never connects to a database)",
        crate::server::preflight::store_setting(&cfg)
    )?;
    for h in engine.hooks() {
        let line = match (&h.description, offline) {
            (_, true) => "not contacted (--offline): its tools are not checked".to_string(),
            (Some(d), false) => format!(
                "answered Describe: {} {}, tools: {}",
                d.name,
                d.version,
                if d.tools.is_empty() {
                    "none".to_string()
                } else {
                    d.tools
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
            (None, false) => format!(
                "not reachable now ({}); serve would start and keep retrying, its tools are not checked",
                h.last_error.as_deref().unwrap_or("no answer within 3s")
            ),
        };
        outln!("  hook {} at {}: {line}", h.config.name, h.config.endpoint)?;
    }
    engine.registry().stop();
    Ok(())
}

async fn shutdown_signal() {
    any_signal().await;
    // The drain may take the whole grace; an operator who asks again
    // means now (tokio keeps its handler installed, so a second Ctrl-C
    // was otherwise swallowed). Runs not recorded are ended by the reaper
    // after their lease.
    tokio::spawn(async {
        any_signal().await;
        tracing::warn!("second shutdown signal: exiting without waiting for the drain");
        std::process::exit(130);
    });
}

/// The next SIGINT (Ctrl-C) or SIGTERM.
async fn any_signal() {
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
