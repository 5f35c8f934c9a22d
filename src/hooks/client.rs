//! One reusable channel per configured hook server: lazy connect, HTTP/2
//! keepalive, `Describe` at start-up and after reconnects, the circuit
//! breaker (with background probing while it is open), and `CallTool`.

use crate::lock::{LockExt, RwLockExt};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

use crate::agent::contain::contained;
use crate::config::{self, HookConfig, HookMode};
use crate::event::EventKind;
use crate::hooks::breaker::{Admit, Breaker};
use crate::hooks::channel::{Channel, Settings};
use crate::hooks::codec::{ScratchCodec, ToolCallCodec, ToolRequest};
use crate::hooks::connector::{self, Connector};
use crate::hooks::credentials::Credentials;
use crate::hooks::failure::{FailureClass, Fault};
use crate::hooks::failure_log::FailureLog;
use crate::hooks::peer_settings::{Report, SettingsWatch};
use crate::hooks::pool::{Lease, Pool};
use crate::hooks::stream::{classify_status, RunStream};
use crate::hooks::wire::event_kind_from_wire;
use crate::hooks::wire_event::WireEvent;
use crate::message::{ToolCall, ToolSpec};
use crate::pb;
use crate::pb::hook_service_client::HookServiceClient;
use crate::telemetry::Metrics;
use crate::tls::HookTls;

/// What a hook server said about itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Description {
    pub name: String,
    pub version: String,
    pub events: Vec<EventKind>,
    pub tools: Vec<ToolSpec>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    Connecting,
    Connected,
    Unavailable,
}

#[derive(Debug)]
struct Status {
    state: ConnState,
    last_error: Option<String>,
}

/// A hook server's channel with its call credentials applied.
pub type HookChannel = InterceptedService<Channel, Credentials>;

pub struct HookClient {
    pub config: HookConfig,
    /// Connections to the hook server: every call and stream takes a slot.
    pool: Pool,
    described: RwLock<Option<Description>>,
    status: Mutex<Status>,
    breaker: Mutex<Breaker>,
    /// Signalled when the breaker opens: `maintain` then probes the server.
    breaker_opened: Notify,
    /// Describe again: a connection-level fault, or a connection ended.
    redescribe: Arc<Notify>,
    /// Shared with the hook's run streams, which log faults seen after
    /// their run ended.
    failure_log: Arc<Mutex<FailureLog>>,
    /// Where the breaker gauge and the unsubscribed-events gauge live (set
    /// once by the engine).
    metrics: OnceLock<Arc<Metrics>>,
    /// This hook's latency series for successful calls, one per event,
    /// taken from `metrics` at the first such call.
    ok_calls: [OnceLock<Histogram>; EventKind::ALL.len()],
}

/// Leave to call the hook, from [`HookClient::admit`]. The call's outcome
/// is given to [`Permit::record`]; a permit dropped without an outcome (the
/// run was cancelled or ran out of time while the hook was being called)
/// records nothing against the hook, and if it was the breaker's probe, the
/// next call probes instead.
pub struct Permit<'a> {
    client: &'a HookClient,
    probe: bool,
    recorded: bool,
}

impl Permit<'_> {
    pub fn record(mut self, ok: bool) {
        self.recorded = true;
        self.client.record(ok);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.probe && !self.recorded {
            self.client.breaker.locked().abandon_probe();
        }
    }
}

/// A point-in-time view for `ListHooks`.
#[derive(Clone, Debug)]
pub struct HookSnapshot {
    pub config: HookConfig,
    pub state: &'static str,
    pub events: Vec<EventKind>,
    pub description: Option<Description>,
    pub last_error: Option<String>,
    /// Configured events the server's Describe does not list (a blocking
    /// hook fails at each of them under its failure policy).
    pub unsubscribed: Vec<EventKind>,
}

const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
const REDESCRIBE_PAUSE: Duration = Duration::from_millis(100);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(300);
/// While the breaker is open the server is probed with Describe, first after
/// [`PROBE_FIRST`], then backing off to [`PROBE_MAX`]: runs succeed again
/// within about [`PROBE_MAX`] of the server's return, whatever the cool-down.
pub const PROBE_FIRST: Duration = Duration::from_millis(100);
pub const PROBE_MAX: Duration = Duration::from_millis(500);
/// How long one background probe waits for Describe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How hookwire connects to a hook server (also used by `hookwire hooks
/// check`, so the checker connects exactly like the engine): lazily, with
/// `tls` for `https://` endpoints (the webpki roots when `None`).
///
/// `closed` is signalled whenever a connection ends, so the client can ask
/// a (possibly restarted) server for its Describe again.
pub fn connect(
    url: &str,
    connect_timeout: Duration,
    tls: Option<&HookTls>,
    closed: Arc<Notify>,
) -> Result<Channel, String> {
    Ok(Dialer::new(url, connect_timeout, tls)?.channel(closed, Arc::new(|_| {})))
}

/// Makes connections to one hook server, each its own lazy channel (the
/// connection pool opens as many as the server's stream limit needs).
///
/// TLS is done by our own connector (`tls::HookTls`), so certificate files
/// are re-read when they change and failures say what did not match; the
/// requests themselves carry the `http://` form of the URL as their origin
/// (as tonic's channel, which refuses an `https://` URL without its own
/// TLS, had them). The server's SETTINGS are read above the TLS layer, so
/// a TLS hook's stream limit is known as a plaintext one's is.
#[derive(Clone)]
pub struct Dialer {
    /// Where the connector connects.
    target: http::Uri,
    /// The requests' `:scheme` and `:authority`.
    origin: http::Uri,
    settings: Settings,
    tls: Option<HookTls>,
}

impl Dialer {
    pub fn new(
        url: &str,
        connect_timeout: Duration,
        tls: Option<&HookTls>,
    ) -> Result<Dialer, String> {
        let settings = settings(connect_timeout);
        let Some(rest) = url.strip_prefix("https://") else {
            let target = parse_endpoint(url, url)?;
            return Ok(Dialer {
                origin: target.clone(),
                target,
                settings,
                tls: None,
            });
        };
        let tls = match tls {
            Some(t) => t.clone(),
            None => HookTls::new(url, &config::HookTls::default(), Duration::MAX)
                .map_err(|e| e.to_string())?,
        };
        let target = parse_endpoint(&format!("http://{rest}"), url)?;
        let mut origin = target.clone();
        if let Some(name) = tls.server_name() {
            // The name the certificate is for is also the :authority a proxy
            // or a virtual host routes on.
            let port = target.port_u16().unwrap_or(443);
            origin = format!("http://{name}:{port}")
                .parse()
                .map_err(|e| format!("tls.server_name `{name}`: {e}"))?;
        }
        Ok(Dialer {
            target,
            origin,
            settings,
            tls: Some(tls),
        })
    }

    /// A new lazy channel (one HTTP/2 connection at a time): `closed` is
    /// signalled when a connection of it ends, `report` hears the server's
    /// advertised stream limit on each.
    pub fn channel(&self, closed: Arc<Notify>, report: Report) -> Channel {
        let (target, origin) = (self.target.clone(), &self.origin);
        match &self.tls {
            None => {
                let tcp = connector::plain_tcp(self.settings.connect_timeout);
                Channel::lazy(
                    Connector::new(SettingsWatch::new(tcp, report), closed),
                    target,
                    origin,
                    self.settings,
                )
            }
            Some(tls) => Channel::lazy(
                Connector::new(SettingsWatch::new(tls.connector(), report), closed),
                target,
                origin,
                self.settings,
            ),
        }
    }
}

/// Whether `url` names this machine (plaintext is fine there).
pub fn is_loopback(url: &str) -> bool {
    let Ok(uri) = url.parse::<http::Uri>() else {
        return false;
    };
    match uri
        .host()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
    {
        Some("localhost") => true,
        Some(h) => h
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback()),
        None => false,
    }
}

/// `url` as a connection target: an absolute `http` URL with a host
/// (`named` is the URL as configured, for the error).
fn parse_endpoint(url: &str, named: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("bad endpoint `{named}`: {e}"))?;
    if uri.scheme().is_none() || uri.host().is_none() {
        return Err(format!(
            "bad endpoint `{named}`: expected an absolute URL such as http://host:port"
        ));
    }
    Ok(uri)
}

/// hookwire's HTTP/2 settings for hook connections.
fn settings(connect_timeout: Duration) -> Settings {
    Settings {
        connect_timeout,
        // grpc-go and grpcio servers by default answer pings more frequent
        // than every 5 minutes with GOAWAY ("too many pings"), which would
        // reset runs mid-stream; ping no faster than that, and only while
        // streams are open.
        keep_alive_interval: KEEPALIVE_INTERVAL,
        keep_alive_timeout: Duration::from_secs(20),
        keep_alive_while_idle: false,
    }
}

/// A HookService client on `channel`, as hookwire makes every one.
/// Largest verdict or Describe answer accepted from a hook server.
const MAX_DECODE: usize = 16 * 1024 * 1024;

pub fn client_on(channel: HookChannel) -> HookServiceClient<HookChannel> {
    HookServiceClient::new(channel).max_decoding_message_size(MAX_DECODE)
}

/// Opens a run's `Process` stream on `channel`: the generated client's
/// call, with [`ScratchCodec`] in place of tonic's prost codec (same
/// bytes, fewer instructions per event; see `hooks::codec`).
pub async fn open_process<S>(
    channel: HookChannel,
    events: S,
    metadata: impl FnOnce(&mut tonic::metadata::MetadataMap),
) -> Result<tonic::Streaming<pb::HookVerdict>, tonic::Status>
where
    S: futures::Stream<Item = Arc<WireEvent>> + Send + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_DECODE);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(format!("Service was not ready: {e}")))?;
    let mut req = tonic::Request::new(events);
    metadata(req.metadata_mut());
    req.extensions_mut()
        .insert(tonic::GrpcMethod::new("hookwire.v1.HookService", "Process"));
    let path = http::uri::PathAndQuery::from_static("/hookwire.v1.HookService/Process");
    let resp = grpc
        .streaming(req, path, ScratchCodec::<pb::HookVerdict>::default())
        .await?;
    Ok(resp.into_inner())
}

/// `CallTool` on `channel`: the generated client's call, with
/// [`ToolCallCodec`] in place of the prost codec, so the request's
/// `deadline_remaining_ms` is measured as it is encoded.
async fn call_tool(
    channel: HookChannel,
    mut req: tonic::Request<ToolRequest>,
) -> Result<tonic::Response<pb::CallToolResponse>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_DECODE);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unknown(format!("Service was not ready: {e}")))?;
    req.extensions_mut().insert(tonic::GrpcMethod::new(
        "hookwire.v1.HookService",
        "CallTool",
    ));
    let path = http::uri::PathAndQuery::from_static("/hookwire.v1.HookService/CallTool");
    grpc.unary(req, path, ToolCallCodec).await
}

impl HookClient {
    /// `index`: the hook's place in the configuration's `hooks`, so that
    /// start-up errors about its files name it as the configuration does
    /// (`hooks[0] (py-guard) tls: cannot read ...`); `reload_interval`: how
    /// often TLS and token files are checked for changes
    /// (`server.reload_interval`).
    pub fn new(
        index: usize,
        config: HookConfig,
        reload_interval: Duration,
    ) -> Result<Arc<HookClient>, String> {
        let owner = format!("hooks[{index}] ({})", config.name);
        let tls = if config.endpoint.starts_with("https://") {
            Some(HookTls::new(&owner, &config.tls, reload_interval).map_err(|e| e.to_string())?)
        } else {
            if !is_loopback(&config.endpoint) {
                tracing::warn!(
                    hook = %config.name,
                    endpoint = %config.endpoint,
                    "hook reached over plaintext on the network: events (prompts, tool arguments) travel unencrypted; use https:// with tls"
                );
            }
            None
        };
        // A new connection may reach a restarted server with another
        // Describe: every connection that ends asks for a fresh one.
        // (Every connection of the pool: the one that ended is replaced,
        // but the server behind it may have changed.)
        let redescribe = Arc::new(Notify::new());
        let connect_timeout = config.timeout.min(Duration::from_secs(10));
        let dialer = Dialer::new(&config.endpoint, connect_timeout, tls.as_ref())
            .map_err(|e| format!("{owner}: {e}"))?;
        let credentials = Credentials::new(&owner, &config.credentials, reload_interval)?;
        let breaker = Breaker::new(config.breaker.failures, config.breaker.cooldown);
        // Each connection of the pool reads the server's advertised stream
        // limit off the wire (see peer_settings), and carries the hook's
        // credentials on every call.
        let closed = redescribe.clone();
        let connect = Box::new(move |report| {
            InterceptedService::new(dialer.channel(closed.clone(), report), credentials.clone())
        });
        Ok(Arc::new(HookClient {
            pool: Pool::new(&config.name, &config.connections, connect_timeout, connect),
            config,
            described: RwLock::new(None),
            status: Mutex::new(Status {
                state: ConnState::Connecting,
                last_error: None,
            }),
            breaker: Mutex::new(breaker),
            breaker_opened: Notify::new(),
            redescribe,
            failure_log: Arc::default(),
            metrics: OnceLock::new(),
            ok_calls: Default::default(),
        }))
    }

    /// Counts one call of this hook in `metrics` ([`Metrics::hook_call`]).
    /// A successful call in the registry the engine attached goes straight
    /// to its kept series: the same series, without the family's lookup.
    pub fn record_call(
        &self,
        metrics: &Arc<Metrics>,
        kind: EventKind,
        outcome: &'static str,
        latency: Duration,
    ) {
        let attached = self.metrics.get().is_some_and(|m| Arc::ptr_eq(m, metrics));
        if outcome == "ok" && attached {
            self.ok_calls[kind as usize]
                .get_or_init(|| metrics.hook_call_series(self.name(), kind.name(), outcome))
                .observe(latency.as_secs_f64());
        } else {
            metrics.hook_call(self.name(), kind.name(), outcome, latency);
        }
    }

    /// Publishes this hook's breaker state in `metrics`, and counts what
    /// Describe says (`hookwire_hook_unsubscribed`), from now on.
    pub fn attach_metrics(&self, metrics: Arc<Metrics>) {
        metrics.breaker_state(self.name(), self.breaker_open());
        if self.metrics.set(metrics).is_ok() {
            self.count_unsubscribed();
        }
    }

    fn publish_breaker(&self, open: bool) {
        if let Some(m) = self.metrics.get() {
            m.breaker_state(self.name(), open);
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// A client on the leased connection.
    fn client(lease: &Lease) -> HookServiceClient<HookChannel> {
        client_on(lease.channel())
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn description(&self) -> Option<Description> {
        self.described.read_locked().clone()
    }

    /// Calls Describe once and caches the answer.
    pub async fn describe(&self, timeout: Duration) -> Result<Description, Fault> {
        let mut req = tonic::Request::new(pb::DescribeRequest {
            hookwire_version: env!("CARGO_PKG_VERSION").into(),
        });
        let deadline = Instant::now() + timeout;
        req.extensions_mut()
            .insert(crate::hooks::channel::SendBy(deadline));
        let call = async {
            let lease = self.pool.acquire(deadline).await?;
            let answer = Self::client(&lease).describe(req).await;
            answer.map_err(|status| classify_status(&status, false))
        };
        let result = match tokio::time::timeout(timeout, call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(fault)) => Err(fault),
            Err(_) => Err(Fault::new(FailureClass::Deadline, "Describe timed out")),
        };
        match result {
            Ok(d) => {
                let desc = Description {
                    name: d.name,
                    version: d.version,
                    events: d
                        .events
                        .into_iter()
                        .filter_map(event_kind_from_wire)
                        .collect(),
                    tools: d.tools.into_iter().map(Into::into).collect(),
                };
                *self.described.write_locked() = Some(desc.clone());
                {
                    let mut s = self.status.locked();
                    s.state = ConnState::Connected;
                    s.last_error = None;
                }
                let missing = self.unsubscribed_events();
                if !missing.is_empty() {
                    let events: Vec<&str> = missing.iter().map(|e| e.name()).collect();
                    tracing::warn!(
                        hook = %self.config.name,
                        events = %events.join(","),
                        failure = ?self.config.failure,
                        mode = ?self.config.mode,
                        "hook server's Describe does not list events its config names; a blocking hook fails at each of them (class unsubscribed) under its failure policy"
                    );
                }
                self.count_unsubscribed();
                Ok(desc)
            }
            Err(f) => {
                let mut s = self.status.locked();
                s.state = ConnState::Unavailable;
                s.last_error = Some(format!("{}: {}", f.class, f.detail));
                Err(f)
            }
        }
    }

    /// Keeps the description fresh: retries with backoff until Describe
    /// succeeds, then waits for a connection failure to describe again.
    /// While the circuit breaker is open it probes the server instead (see
    /// [`probe_until_closed`](Self::probe_until_closed)).
    pub async fn maintain(self: Arc<Self>, cancel: CancellationToken) {
        let mut backoff = Duration::from_millis(200);
        loop {
            let ok = contained("a hook's Describe", self.describe(DESCRIBE_TIMEOUT))
                .await
                .is_some_and(|r| r.is_ok());
            let wait = if ok {
                backoff = Duration::from_millis(200);
                None
            } else {
                let b = backoff;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                Some(b)
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.redescribe.notified() => {
                    // A server that ends every connection must not turn
                    // this into a busy loop.
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(REDESCRIBE_PAUSE) => {}
                    }
                }
                _ = self.breaker_opened.notified() => {
                    self.probe_until_closed(&cancel).await;
                }
                _ = async {
                    match wait {
                        Some(d) => tokio::time::sleep(d).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }

    /// While the breaker is open, calls Describe with backoff
    /// ([`PROBE_FIRST`] doubling to [`PROBE_MAX`]); the first answer closes
    /// the breaker on probation ([`Breaker::recover`]: one call at a time
    /// until one succeeds), so runs do not wait out the whole cool-down
    /// after the server came back. Not if the last call on probation
    /// failed: a server that answers Describe but not its events waits out
    /// the cool-down.
    pub async fn probe_until_closed(&self, cancel: &CancellationToken) {
        let mut delay = PROBE_FIRST;
        while self.breaker_open() {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            if !self.breaker_open() {
                return;
            }
            if contained("a hook's probe", self.describe(PROBE_TIMEOUT))
                .await
                .is_some_and(|r| r.is_ok())
            {
                if self.breaker.locked().recover() {
                    self.publish_breaker(false);
                    tracing::info!(hook = %self.name(), "hook server answers again; circuit breaker closed on probation (one call at a time until one succeeds)");
                } else {
                    tracing::info!(hook = %self.name(), "hook server answers Describe, but its last call on probation failed; circuit breaker stays open for its cool-down");
                }
                return;
            }
            delay = (delay * 2).min(PROBE_MAX);
        }
    }

    /// Records a connection-level fault so the next Describe refreshes the
    /// cached subscriptions and tools.
    pub fn note_fault(&self, fault: &Fault) {
        if matches!(
            fault.class,
            FailureClass::Connect | FailureClass::Tls | FailureClass::StreamReset
        ) {
            let mut s = self.status.locked();
            s.state = ConnState::Unavailable;
            s.last_error = Some(format!("{}: {}", fault.class, fault.detail));
            drop(s);
            self.redescribe.notify_one();
        }
    }

    /// Configured events the server's Describe does not list (empty before
    /// the first Describe, or when the config names no events).
    pub fn unsubscribed_events(&self) -> Vec<EventKind> {
        match &*self.described.read_locked() {
            Some(d) => self
                .config
                .events
                .iter()
                .copied()
                .filter(|e| !d.events.contains(e))
                .collect(),
            None => Vec::new(),
        }
    }

    /// Whether `kind` is configured for this hook but its server's Describe
    /// no longer lists it: a contract broken by configuration drift, never
    /// a silent skip.
    pub fn unsubscribed(&self, kind: EventKind) -> bool {
        self.config.events.contains(&kind)
            && self
                .described
                .read_locked()
                .as_ref()
                .is_some_and(|d| !d.events.contains(&kind))
    }

    /// One gauge per configured event: 1 while Describe does not list it.
    fn count_unsubscribed(&self) {
        let Some(m) = self.metrics.get() else {
            return;
        };
        if self.description().is_none() {
            return;
        }
        let missing = self.unsubscribed_events();
        for e in &self.config.events {
            m.hook_unsubscribed(&self.config.name, e.name(), missing.contains(e));
        }
    }

    /// Events this hook receives: Describe's list narrowed by config. Before
    /// the first successful Describe, the configured list (if any).
    pub fn subscriptions(&self) -> Option<Vec<EventKind>> {
        let configured = &self.config.events;
        match self.description() {
            Some(d) if configured.is_empty() => Some(d.events),
            Some(d) => Some(
                configured
                    .iter()
                    .copied()
                    .filter(|e| d.events.contains(e))
                    .collect(),
            ),
            None if configured.is_empty() => None,
            None => Some(configured.clone()),
        }
    }

    /// Whether this hook receives `kind`, as `subscriptions` would say,
    /// without copying the description (this is asked for every hook at
    /// every event).
    pub fn subscribes(&self, kind: EventKind) -> Option<bool> {
        let configured = &self.config.events;
        match &*self.described.read_locked() {
            Some(d) => Some(
                d.events.contains(&kind) && (configured.is_empty() || configured.contains(&kind)),
            ),
            None if configured.is_empty() => None,
            None => Some(configured.contains(&kind)),
        }
    }

    /// Known, without asking the server, to take no part in `kind`: its
    /// Describe (or, before one, its config) leaves `kind` out, and `kind`
    /// is not a configured event that Describe dropped (that is a failure,
    /// not a skip). What a run's dispatch skips without a call.
    pub fn sits_out(&self, kind: EventKind) -> bool {
        self.subscribes(kind) == Some(false) && !self.unsubscribed(kind)
    }

    pub fn is_observe(&self) -> bool {
        self.config.mode == HookMode::Observe
    }

    /// Asks the breaker for leave to call the hook; `None` when it is open.
    /// Time is tokio's clock, so tests can pause it.
    pub fn admit(&self) -> Option<Permit<'_>> {
        let probe = match self.breaker.locked().admit(Instant::now().into_std()) {
            Admit::Reject => return None,
            Admit::Call => false,
            Admit::Probe => true,
        };
        Some(Permit {
            client: self,
            probe,
            recorded: false,
        })
    }

    /// Records a call's result; the gauge is touched only when the breaker
    /// opens or closes, and an opening starts the background probe.
    fn record(&self, ok: bool) {
        let mut b = self.breaker.locked();
        let was = b.is_open();
        b.record(Instant::now().into_std(), ok);
        let open = b.is_open();
        drop(b);
        if open != was {
            self.publish_breaker(open);
            if open {
                self.breaker_opened.notify_one();
            }
        }
    }

    /// Whether a failure of `class` should be logged now (`Some(n)`: with
    /// `n` failures of that class left unlogged since the last line).
    pub fn log_failure(&self, class: FailureClass) -> Option<u64> {
        self.failure_log
            .locked()
            .admit(class, Instant::now().into_std())
    }

    pub fn breaker_open(&self) -> bool {
        self.breaker.locked().is_open()
    }

    pub fn open_stream(
        &self,
        metadata: Vec<(&'static str, String)>,
        metrics: Arc<crate::telemetry::Metrics>,
    ) -> RunStream {
        // A stream waits for a free slot no longer than any of its events
        // could wait for a verdict.
        RunStream::open(
            self.pool.clone(),
            self.config.observe_queue,
            metadata,
            self.config.longest_timeout(),
            self.config.name.clone(),
            metrics,
            self.failure_log.clone(),
        )
    }

    /// A stream slot for one `CallTool` if one is free now, without
    /// waiting.
    pub fn try_tool_slot(&self) -> Option<ToolSlot> {
        let lease = self.pool.try_acquire()?;
        Some(ToolSlot { lease })
    }

    /// A stream slot for one `CallTool` on this server's connections,
    /// waiting (until `deadline`) while every connection is at its stream
    /// limit. Taken apart from the call: that wait can last up to the
    /// tool's timeout, and the caller must check that the call may still
    /// start (the batch or the run may have stopped meanwhile) once the slot
    /// is there and right before the request goes out.
    pub async fn tool_slot(&self, deadline: Instant) -> Result<ToolSlot, Fault> {
        let lease = self.pool.acquire(deadline).await?;
        Ok(ToolSlot { lease })
    }

    pub fn snapshot(&self) -> HookSnapshot {
        let s = self.status.locked();
        let state = if self.breaker_open() {
            "circuit_open"
        } else {
            match s.state {
                ConnState::Connecting => "connecting",
                ConnState::Connected => "connected",
                ConnState::Unavailable => "unavailable",
            }
        };
        HookSnapshot {
            config: self.config.clone(),
            state,
            events: self.subscriptions().unwrap_or_default(),
            description: self.description(),
            last_error: s.last_error.clone(),
            unsubscribed: self.unsubscribed_events(),
        }
    }
}

/// A slot taken for one `CallTool` ([`HookClient::tool_slot`]), freed when
/// the call ends or the slot is dropped unused.
pub struct ToolSlot {
    lease: Lease,
}

impl ToolSlot {
    /// Sends the `CallTool` request on the slot and waits for its answer,
    /// until `deadline`. The tool is told the time left until `deadline` as
    /// the request goes out, after any wait for its connection, whatever
    /// `context` says (see [`ToolCallCodec`]).
    pub async fn call(
        self,
        context: pb::EventContext,
        call: &ToolCall,
        deadline: Instant,
    ) -> Result<(String, bool), Fault> {
        let timeout = tool_timed_out();
        // Sent with no time left, the request would still reach the server
        // (the call is polled before its timer) and the tool would run for
        // a caller that already gave up on it.
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timeout);
        }
        let mut req = tonic::Request::new(ToolRequest {
            request: pb::CallToolRequest {
                context: Some(context),
                call: Some(call.into()),
            },
            deadline,
        });
        // `grpc-timeout` too is what is left once the request goes out.
        req.extensions_mut()
            .insert(crate::hooks::channel::SendBy(deadline));
        let answer = call_tool(self.lease.channel(), req);
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                Ok((r.content, r.is_error))
            }
            Ok(Err(status)) => Err(tool_failure(&status, Instant::now(), deadline)),
            Err(_) => Err(timeout),
        }
    }
}

fn tool_timed_out() -> Fault {
    Fault::new(FailureClass::Deadline, "CallTool timed out")
}

/// What a `CallTool` that failed with `status` at `at` is. Failed once the
/// deadline passed (the hook server's own timer for the grpc-timeout it
/// was sent, which may be polled before ours), the call failed at its
/// deadline, whatever the status: a `CANCELLED` or an `UNAVAILABLE` then is
/// the deadline's doing, and a breaker or a dashboard counting them as the
/// server's faults would blame it for a tool that was merely slow.
fn tool_failure(status: &tonic::Status, at: Instant, deadline: Instant) -> Fault {
    if at >= deadline {
        tool_timed_out()
    } else {
        classify_status(status, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client of hook `h` whose config adds `setting` (one `key: value`).
    fn hook_with(setting: &str) -> Arc<HookClient> {
        let yaml = format!(
            "hooks:\n  - name: h\n    endpoint: http://127.0.0.1:1\n    {setting}\nagents: [{{name: a, model: m}}]\nmodels: [{{name: m, provider: scripted}}]\n"
        );
        let cfg = crate::config::Config::parse(&yaml, "test").unwrap();
        HookClient::new(0, cfg.hooks[0].clone(), std::time::Duration::from_secs(5)).unwrap()
    }

    fn client(breaker: &str) -> Arc<HookClient> {
        hook_with(&format!("breaker: {breaker}"))
    }

    fn with_events(events: &str) -> Arc<HookClient> {
        hook_with(&format!("events: {events}"))
    }

    fn described(c: &HookClient, events: &[EventKind]) {
        *c.described.write().unwrap() = Some(Description {
            events: events.to_vec(),
            ..Default::default()
        });
    }

    #[test]
    fn a_hook_sits_out_only_events_it_is_known_not_to_take() {
        use EventKind::{RunStart, SessionStart, ToolCall};
        // Nothing configured and no Describe yet: only the server can say.
        let open = with_events("[]");
        assert!(!open.sits_out(SessionStart));
        described(&open, &[RunStart]);
        assert!(open.sits_out(SessionStart));
        assert!(!open.sits_out(RunStart));

        // Configured events decide before a Describe.
        let configured = with_events("[run_start, tool_call]");
        assert!(configured.sits_out(SessionStart));
        assert!(!configured.sits_out(RunStart));
        // A configured event its Describe dropped is a failure to report,
        // never a skip.
        described(&configured, &[RunStart]);
        assert!(!configured.sits_out(ToolCall));
        assert!(configured.sits_out(SessionStart));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_probe_does_not_leave_the_breaker_rejecting() {
        let c = client("{failures: 1, cooldown: 10s}");
        c.admit().expect("closed").record(false);
        assert!(c.admit().is_none(), "open");
        tokio::time::advance(Duration::from_secs(10)).await;
        let probe = c.admit().expect("the cool-down ended: a probe");
        assert!(c.admit().is_none(), "one probe at a time");
        // The run calling the hook was cancelled mid-call.
        drop(probe);
        let probe = c.admit().expect("the next call probes");
        probe.record(true);
        assert!(!c.breaker_open());
    }

    #[tokio::test(start_paused = true)]
    async fn the_background_probe_keeps_an_unreachable_servers_breaker_open() {
        // Nothing listens on the endpoint: probes fail and back off, and the
        // breaker stays open.
        let c = client("{failures: 1, cooldown: 1h}");
        c.admit().unwrap().record(false);
        assert!(c.breaker_open());
        let cancel = CancellationToken::new();
        let probing = tokio::spawn({
            let (c, cancel) = (c.clone(), cancel.clone());
            async move { c.probe_until_closed(&cancel).await }
        });
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(c.breaker_open(), "an unreachable server does not close it");
        assert!(!probing.is_finished());
        cancel.cancel();
        probing.await.unwrap();
    }

    #[tokio::test]
    async fn calls_counted_through_the_kept_series_land_in_the_hooks_family() {
        let c = hook_with("failure: closed");
        let attached = Arc::new(Metrics::new());
        c.attach_metrics(attached.clone());
        let ms = std::time::Duration::from_millis;
        c.record_call(&attached, EventKind::ToolCall, "ok", ms(3));
        c.record_call(&attached, EventKind::ToolCall, "ok", ms(20));
        c.record_call(&attached, EventKind::RunStart, "ok", ms(1));
        c.record_call(&attached, EventKind::ToolCall, "deadline", ms(9));
        // Another registry (not the one attached) still counts its calls.
        let other = Arc::new(Metrics::new());
        c.record_call(&other, EventKind::ToolCall, "ok", ms(2));
        let text = attached.encode();
        for expected in [
            r#"hookwire_hook_call_duration_seconds_count{hook="h",event="tool_call",outcome="ok"} 2"#,
            r#"hookwire_hook_call_duration_seconds_bucket{le="0.005",hook="h",event="tool_call",outcome="ok"} 1"#,
            r#"hookwire_hook_call_duration_seconds_count{hook="h",event="run_start",outcome="ok"} 1"#,
            r#"hookwire_hook_call_duration_seconds_count{hook="h",event="tool_call",outcome="deadline"} 1"#,
        ] {
            assert!(text.contains(expected), "missing {expected} in\n{text}");
        }
        assert!(other.encode().contains(
            r#"hookwire_hook_call_duration_seconds_count{hook="h",event="tool_call",outcome="ok"} 1"#
        ));
    }

    /// A `CallTool` failing at or after its deadline failed at the
    /// deadline, whatever its status; one failing before it is what its
    /// status says.
    #[test]
    fn a_tool_call_failing_past_its_deadline_is_a_deadline() {
        let deadline = Instant::now() + Duration::from_secs(1);
        let cancelled = tonic::Status::cancelled("Timeout expired");
        let unavailable = tonic::Status::unavailable("connection reset");
        for status in [&cancelled, &unavailable] {
            for at in [deadline, deadline + Duration::from_millis(1)] {
                let f = tool_failure(status, at, deadline);
                assert_eq!(f.class, FailureClass::Deadline, "{status:?}");
                assert_eq!(f.detail, "CallTool timed out");
            }
        }
        let early = deadline - Duration::from_millis(1);
        assert_eq!(
            tool_failure(&unavailable, early, deadline).class,
            classify_status(&unavailable, false).class
        );
        assert_ne!(
            tool_failure(&unavailable, early, deadline).class,
            FailureClass::Deadline
        );
    }
}
