//! The service's domain: sessions, runs, approvals and hooks, independent of
//! gRPC. `server::grpc` adapts it to AgentService. State lives in the store
//! (`crate::store`); this replica's own runs are in `runs`, and `replica`
//! keeps them leased and reaps the runs of replicas that were lost; `drain`
//! waits for them (and for runs still starting) at shutdown.

mod caller;
mod drain;
mod replica;

pub use caller::{gone_reason, CallerDeadline};

use crate::lock::LockExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::agent::approvals::{Approvals, Decision};
use crate::agent::contain::{contain_tail, drive_contained};
use crate::agent::early_answer::hold_for_question;
use crate::agent::events::{QueuedEvent, RunReport};
use crate::agent::ledger::Ledger;
use crate::agent::outcome::RunOutcome;
use crate::agent::runner::{AgentRuntime, Run};
use crate::agent::store_warnings::StoreWarnings;
use crate::auth::access::{self, Action, Denied, SessionGrant};
use crate::auth::quota::{
    self, CreatingSlot, Held, QuotaExceeded, QuotaLedger, Reading, StartRefused, StartingSlot,
};
use crate::auth::Principal;
use crate::config::Config;
use crate::event::{nearest, EventKind};
use crate::hooks::client::{HookClient, HookSnapshot};
use crate::hooks::compose::{firing_order, Ranked, SessionStartChain};
use crate::hooks::dispatch::RunHooks;
use crate::hooks::failure::HookFailure;
use crate::hooks::payload::{EventContext, Payload};
use crate::hooks::registry::{HookRegistry, RegistryError};
use crate::model::ModelProvider;
use crate::session::Session;
use crate::store::{
    asked_hint, NewSession, RunEnd, RunLease, SessionFilter, SessionPage, SessionStore, StoreError,
    TranscriptCache,
};
use crate::telemetry::{propagation, spans, Instruments};
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("unknown agent `{name}`{hint}")]
    UnknownAgent { name: String, hint: String },
    #[error("unknown hook `{0}`: sessions may only enable hooks configured under `hooks:`")]
    UnknownHook(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("input must not be empty")]
    EmptyInput,
    #[error("input is {size} bytes; the limit is {max} (server.max_input_bytes)")]
    InputTooLarge { size: usize, max: usize },
    #[error("session rejected by hook `{hook}`: {reason}")]
    SessionRejected { hook: String, reason: String },
    #[error("session_start failed: {0}")]
    SessionHookFailed(HookFailure),
    #[error("server is shutting down; retry against another replica")]
    ShuttingDown,
    #[error("principal `{principal}` may not use agent `{agent}` (agents[].allow)")]
    AgentDenied { principal: String, agent: String },
    #[error(transparent)]
    Quota(#[from] QuotaExceeded),
}

#[derive(Debug, thiserror::Error)]
pub enum EngineSetupError {
    #[error("agent `{agent}`: model `{model}` was not built")]
    MissingModel { agent: String, model: String },
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// A started run: its events, and the task that drives it.
pub struct RunHandle {
    pub run_id: String,
    /// Bounded by `server.run_event_buffer`. When it stayed full as the run
    /// ended (the client stalled), the last event (`Finished`) is missing:
    /// the report is then
    /// `task`'s result. A run started without `streaming` (`Invoke`) queues
    /// only `Finished`.
    pub events: mpsc::Receiver<QueuedEvent>,
    pub task: tokio::task::JoinHandle<RunReport>,
}

pub struct Engine {
    config: Config,
    agents: HashMap<String, Arc<AgentRuntime>>,
    /// Each agent's own hooks in firing order. The config fixes it, so it
    /// is computed once rather than for every session and run (a run of a
    /// session without extra hooks takes a copy of this list).
    agent_hooks: HashMap<String, Vec<Arc<HookClient>>>,
    registry: Arc<HookRegistry>,
    store: Arc<dyn SessionStore>,
    /// This replica's copies of recently used transcripts: a run reads only
    /// the messages committed since.
    transcripts: TranscriptCache,
    /// This process's id in the store (lease holder name).
    replica: String,
    approvals: Arc<Approvals>,
    /// Runs executing on this replica.
    runs: Mutex<HashMap<String, Arc<Run>>>,
    /// Run starts past the `accepting` check whose run is not in `runs`
    /// yet (see `drain`).
    starting: AtomicUsize,
    /// Cancels and deletes that found no run on this replica to stop: a
    /// run starting meanwhile (in the store, not in `runs` yet) may be the
    /// one they meant, and asks the store once registered.
    unmatched_cancels: AtomicU64,
    accepting: AtomicBool,
    /// Set when the shutdown grace ran out and the runs were cancelled.
    cancelling: AtomicBool,
    /// Notified when the last run in flight or starting is gone.
    idle: Notify,
    inst: Instruments,
    background: replica::Background,
    quotas: Arc<QuotaLedger>,
    /// Failed store writes of all runs, warned of once per kind and
    /// interval.
    store_warnings: StoreWarnings,
}

/// The clients of `agent` hooks then `extra` ones, in firing order.
fn ordered_hooks(
    registry: &HookRegistry,
    agent: &[String],
    extra: &[String],
) -> Vec<Arc<HookClient>> {
    let rank = |names: &[String]| -> Vec<Ranked> {
        names
            .iter()
            .filter_map(|n| registry.get(n))
            .map(|c| Ranked {
                name: c.name().to_string(),
                priority: c.config.priority,
            })
            .collect()
    };
    firing_order(&rank(agent), &rank(extra))
        .iter()
        .filter_map(|n| registry.get(n).cloned())
        .collect()
}

/// The caller's identity as hooks see it in EventContext.
fn with_principal(mut ctx: EventContext, p: &Principal) -> EventContext {
    ctx.principal = p.name.clone();
    ctx.principal_claims = p.claims.clone();
    ctx
}

/// Runs `work` to its end in a task of its own, so a caller that leaves
/// (tonic drops the handler when the client's deadline passes) cannot stop
/// it halfway; its answer still goes to the caller that waited.
async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, EngineError>> + Send + 'static,
) -> Result<T, EngineError> {
    match tokio::spawn(work).await {
        Ok(done) => done,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Only when the runtime shuts down.
        Err(_) => Err(EngineError::ShuttingDown),
    }
}

impl Engine {
    pub fn new(
        config: Config,
        models: HashMap<String, Arc<dyn ModelProvider>>,
        inst: Instruments,
        store: Arc<dyn SessionStore>,
    ) -> Result<Engine, EngineSetupError> {
        let registry = Arc::new(HookRegistry::new(&config)?);
        // Breaker gauges exist (closed) from the start; clients only touch
        // them when a breaker opens or closes.
        for c in registry.all() {
            c.attach_metrics(inst.metrics.clone());
            c.pool().attach_metrics(inst.metrics.hook_pool(c.name()));
        }
        let mut agents = HashMap::new();
        for a in &config.agents {
            let model =
                models
                    .get(&a.model)
                    .cloned()
                    .ok_or_else(|| EngineSetupError::MissingModel {
                        agent: a.name.clone(),
                        model: a.model.clone(),
                    })?;
            agents.insert(
                a.name.clone(),
                Arc::new(AgentRuntime {
                    config: a.clone(),
                    model,
                }),
            );
        }
        let agent_hooks = agents
            .iter()
            .map(|(name, a)| (name.clone(), ordered_hooks(&registry, &a.config.hooks, &[])))
            .collect();
        Ok(Engine {
            quotas: Arc::new(QuotaLedger::new(config.quotas.clone())),
            config,
            agents,
            agent_hooks,
            registry,
            store,
            transcripts: TranscriptCache::default(),
            replica: replica::replica_id(),
            approvals: Arc::new(Approvals::default()),
            runs: Mutex::new(HashMap::new()),
            starting: AtomicUsize::new(0),
            unmatched_cancels: AtomicU64::new(0),
            accepting: AtomicBool::new(true),
            cancelling: AtomicBool::new(false),
            idle: Notify::new(),
            inst,
            background: replica::Background::default(),
            store_warnings: StoreWarnings::default(),
        })
    }

    pub fn store(&self) -> &Arc<dyn SessionStore> {
        &self.store
    }

    /// This replica's id in the store.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    fn local_run(&self, run_id: &str) -> Option<Arc<Run>> {
        self.runs.locked().get(run_id).cloned()
    }

    /// The client of a run on this replica went away: the run is cancelled
    /// (`reason`: "client disconnected", and whether at its deadline),
    /// whatever it waits for. Nothing if it ended.
    pub fn client_gone(&self, run_id: &str, reason: &str) {
        let Some(r) = self.local_run(run_id) else {
            return;
        };
        // A request it waits for is withdrawn in the store now, as a
        // CancelRun's are: until its end is recorded, an approver on another
        // replica would otherwise be told OK for a call that never runs.
        if self.approvals.has_run(run_id) {
            let (store, run_id, reason) =
                (self.store.clone(), run_id.to_string(), reason.to_string());
            tokio::spawn(async move {
                if let Err(e) = store.request_cancel(&run_id, &reason).await {
                    tracing::debug!(run_id, error = %e, "withdrawing a gone client's approvals");
                }
            });
        }
        r.client_gone(reason);
    }

    pub fn registry(&self) -> &Arc<HookRegistry> {
        &self.registry
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn agent(&self, name: &str) -> Result<&Arc<AgentRuntime>, EngineError> {
        self.agents
            .get(name)
            .ok_or_else(|| EngineError::UnknownAgent {
                name: name.to_string(),
                hint: match nearest(name, self.agents.keys().map(String::as_str)) {
                    Some(n) => format!("; did you mean `{n}`?"),
                    None => {
                        let mut names: Vec<&str> = self.agents.keys().map(String::as_str).collect();
                        names.sort();
                        format!("; configured agents: {}", names.join(", "))
                    }
                },
            })
    }

    /// The session's hooks in firing order: agent hooks, then extras.
    fn session_hooks(&self, agent: &AgentRuntime, extra: &[String]) -> Vec<Arc<HookClient>> {
        match self.agent_hooks.get(&agent.config.name) {
            Some(own) if extra.is_empty() => own.clone(),
            _ => ordered_hooks(&self.registry, &agent.config.hooks, extra),
        }
    }

    /// Names of the hooks enabled on a session, in firing order.
    pub fn session_hook_names(&self, session: &Session) -> Vec<String> {
        match self.agent(&session.agent) {
            Ok(agent) => self
                .session_hooks(agent, &session.extra_hooks)
                .iter()
                .map(|c| c.name().to_string())
                .collect(),
            Err(_) => session.extra_hooks.clone(),
        }
    }

    /// Refusals of `access` as the caller sees them: a session the caller
    /// may not see answers exactly like a missing one.
    fn denied(&self, d: Denied, session_id: &str) -> EngineError {
        match d {
            Denied::Hidden => StoreError::SessionNotFound(session_id.to_string()).into(),
            Denied::Agent { principal, agent } => EngineError::AgentDenied { principal, agent },
        }
    }

    fn quota(&self, p: &Principal, e: QuotaExceeded) -> EngineError {
        self.inst.metrics.quota_rejected(e.limit, p.class());
        e.into()
    }

    /// What `owner` holds in the store, when a quota needs it.
    async fn held(&self, owner: &str, needed: bool) -> Result<(Reading, Held), EngineError> {
        if !needed {
            return Ok(Default::default());
        }
        let read = self.quotas.reading(owner);
        let u = self
            .store
            .owner_usage(owner, quota::WINDOW, self.quotas.count_cap())
            .await?;
        let held = Held {
            sessions: u.sessions,
            active_runs: u.active_runs,
            recent_runs: u.recent_runs,
        };
        Ok((read, held))
    }

    /// A session slot under `p`'s quota. A refusal counts what this
    /// replica recorded since the store's count was read (which may have
    /// missed it): conservative under a race, so it is read again once.
    async fn reserve_session(&self, p: &Principal) -> Result<CreatingSlot, EngineError> {
        let mut again = false;
        loop {
            let (read, held) = self.held(&p.name, self.quotas.limits_sessions()).await?;
            match self.quotas.begin_session(p, read, held) {
                Ok(slot) => return Ok(slot),
                Err(e) if again => return Err(self.quota(p, e)),
                Err(_) => again = true,
            }
        }
    }

    /// A run start in `session` under its owner's quota (the store counts
    /// the run for the owner, whoever starts it: checking the caller's
    /// would let an admin's and the owner's starts overshoot).
    async fn reserve_start(
        &self,
        p: &Principal,
        session: &Session,
    ) -> Result<StartingSlot, EngineError> {
        let busy = |run: String| -> EngineError {
            StoreError::Busy {
                session: session.id.clone(),
                run,
            }
            .into()
        };
        let mut again = false;
        loop {
            let (read, held) = self.held(&session.owner, self.quotas.limits_runs()).await?;
            match self
                .quotas
                .begin_run(&session.owner, &session.id, read, held)
            {
                Ok(slot) => return Ok(slot),
                Err(StartRefused::Busy) => return Err(busy(String::new())),
                Err(StartRefused::Quota(e)) => {
                    // Another start may have taken this session since the
                    // caller's read of it: that answer is busy, not a
                    // limit its run reached. Otherwise the count may hold
                    // runs recorded here that ended since: read it again
                    // once.
                    if let Ok(Session {
                        active_run: Some(run),
                        ..
                    }) = self.store.get_session(&session.id).await
                    {
                        return Err(busy(run));
                    }
                    if again {
                        return Err(self.quota(p, e));
                    }
                    again = true;
                }
            }
        }
    }

    /// The session (without its transcript), if `p` may do `action` with it.
    async fn grant(
        &self,
        p: &Principal,
        action: Action,
        id: &str,
    ) -> Result<(Session, SessionGrant), EngineError> {
        let s = self.store.get_session(id).await?;
        let agent = self.config.agent(&s.agent);
        let g =
            access::authorize(p, action, &s.id, &s.owner, agent).map_err(|d| self.denied(d, id))?;
        Ok((s, g))
    }

    /// The session of an active run, wherever it executes, if `p` may do
    /// `action` with it; a run the caller may not see answers exactly like
    /// a finished one.
    async fn grant_run(
        &self,
        p: &Principal,
        action: Action,
        run_id: &str,
    ) -> Result<SessionGrant, EngineError> {
        let s = self.store.run_session(run_id).await?;
        access::authorize(p, action, &s.id, &s.owner, self.config.agent(&s.agent))
            .map_err(|_| StoreError::RunNotFound(run_id.to_string()).into())
    }

    /// Creates a session owned by the caller (`principal`;
    /// [`crate::session::ANONYMOUS`] without authentication).
    pub async fn create_session(
        &self,
        principal: &Principal,
        agent_name: &str,
        extra_hooks: Vec<String>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Session, EngineError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(EngineError::ShuttingDown);
        }
        let agent = self.agent(agent_name)?.clone();
        access::may_use_agent(principal, &agent.config).map_err(|d| self.denied(d, ""))?;
        for h in &extra_hooks {
            if self.registry.get(h).is_none() {
                return Err(EngineError::UnknownHook(h.clone()));
            }
        }
        // Held until the session is stored (or refused), so concurrent
        // creations here cannot both take the last slot.
        let slot = self.reserve_session(principal).await?;
        let session = NewSession {
            id: uuid::Uuid::new_v4().to_string(),
            agent: agent_name.to_string(),
            owner: principal.name.clone(),
            extra_hooks: extra_hooks.clone(),
            metadata: metadata.clone(),
        };
        let clients = self.session_hooks(&agent, &extra_hooks);
        // Most hooks do not subscribe to session_start: when none of them
        // can take part, there is no chain to set up.
        if !clients.iter().all(|c| c.sits_out(EventKind::SessionStart)) {
            let names: Vec<String> = clients.iter().map(|c| c.name().to_string()).collect();
            let hooks = RunHooks::new(
                clients,
                with_principal(
                    EventContext {
                        session_id: session.id.clone(),
                        agent: agent_name.to_string(),
                        ..Default::default()
                    },
                    principal,
                ),
                Instant::now() + agent.config.event_budget,
                agent.config.event_budget,
                self.inst.clone(),
            );
            let out = hooks
                .chain::<SessionStartChain>(0, (), |_| Payload::SessionStart {
                    hooks: names.clone(),
                    metadata: metadata.clone(),
                })
                .await;
            hooks.close();
            match out {
                Err(f) => return Err(EngineError::SessionHookFailed(f)),
                Ok(o) => {
                    if let Some((hook, t)) = o.stop {
                        return Err(EngineError::SessionRejected {
                            hook,
                            reason: t.reason,
                        });
                    }
                }
            }
        }
        let created = self.store.create_session(&session).await?;
        slot.recorded();
        Ok(created)
    }

    /// The session with its transcript.
    pub async fn get_session(
        &self,
        principal: &Principal,
        id: &str,
    ) -> Result<Session, EngineError> {
        let (mut s, grant) = self.grant(principal, Action::Read, id).await?;
        s.transcript = self
            .transcripts
            .load(&*self.store, grant.session_id())
            .await?
            .to_vec();
        Ok(s)
    }

    /// The session without its transcript.
    pub async fn session_info(
        &self,
        principal: &Principal,
        id: &str,
    ) -> Result<Session, EngineError> {
        Ok(self.grant(principal, Action::Read, id).await?.0)
    }

    /// A page of the sessions `principal` may see: its own, or all for an
    /// admin (filtered in the store, so pages are full).
    pub async fn list_sessions(
        &self,
        principal: &Principal,
        mut filter: SessionFilter,
    ) -> Result<SessionPage, EngineError> {
        filter.owner = match access::list_scope(principal) {
            access::ListScope::All => None,
            access::ListScope::OwnedBy(o) => Some(o),
        };
        let mut page = self.store.list_sessions(&filter).await?;
        // A page of many sessions with large metadata can pass what gRPC
        // clients receive by default (4 MiB): it ends early instead, and the
        // rest follows on the next page. At least one session per page, so
        // paging always advances.
        let mut bytes = 0;
        let over = page.sessions.iter().position(|s| {
            bytes += self.listed_bytes(s);
            bytes > MAX_PAGE_BYTES
        });
        if let Some(n) = over.map(|n| n.max(1)) {
            if n < page.sessions.len() {
                page.sessions.truncate(n);
                page.next_page_token = crate::store::page_token(&page.sessions[n - 1]);
            }
        }
        Ok(page)
    }

    /// About what `s` takes in a ListSessions page: its strings, plus room
    /// for the numbers and the framing.
    fn listed_bytes(&self, s: &Session) -> usize {
        const FRAMING: usize = 128;
        let hooks: usize = self.session_hook_names(s).iter().map(|h| h.len() + 4).sum();
        let metadata: usize = s.metadata.iter().map(|(k, v)| k.len() + v.len() + 12).sum();
        FRAMING
            + s.id.len()
            + s.agent.len()
            + s.owner.len()
            + s.active_run.as_ref().map_or(0, String::len)
            + hooks
            + metadata
    }

    pub async fn delete_session(
        self: &Arc<Self>,
        principal: &Principal,
        id: &str,
    ) -> Result<(), EngineError> {
        let (_, grant) = self.grant(principal, Action::Delete, id).await?;
        // From the delete on, detached: a caller that left mid-call left a
        // deleted session whose run went on, whose cancel was never
        // recorded, and whose session_end never fired (the row is gone, so
        // no TTL sweep finds it later).
        let engine = self.clone();
        let (principal, id) = (principal.clone(), grant.session_id().to_string());
        detached(async move { engine.delete_now(&principal, &id).await }).await
    }

    /// The store's part of [`Engine::delete_session`], and what follows.
    async fn delete_now(
        self: &Arc<Self>,
        principal: &Principal,
        id: &str,
    ) -> Result<(), EngineError> {
        let session = self.store.delete_session(id).await?;
        self.transcripts.forget(id);
        let mut local = None;
        if let Some(run) = &session.active_run {
            local = self.local_run(run);
            // A run of this replica stops now, not after the store answered.
            self.cancel_local(run, "session deleted");
            // Wherever it runs, its replica is told to stop it.
            match self.store.request_cancel(run, "session deleted").await {
                Ok(()) | Err(StoreError::RunNotFound(_)) => {}
                Err(e) => self.store_warnings.warn(
                    "cannot record the cancel of a deleted session's run",
                    run,
                    &e,
                ),
            }
        }
        match local {
            // Its hooks hear of the session's end after the run's: they
            // may drop what they keep per session at session_end. Not
            // awaited here, so the delete's answer never waits for the
            // run's tools to drain.
            Some(run) => {
                let (engine, principal) = (self.clone(), principal.clone());
                tokio::spawn(async move {
                    run.left.cancelled().await;
                    engine.session_end(&session, "deleted", Some(&principal));
                });
            }
            None => self.session_end(&session, "deleted", Some(principal)),
        }
        Ok(())
    }

    /// Fires session_end (observe) at the session's hooks; `by`: the caller
    /// that ended it (none when it expired).
    fn session_end(&self, session: &Session, reason: &str, by: Option<&Principal>) {
        if let Ok(agent) = self.agent(&session.agent) {
            let clients = self.session_hooks(agent, &session.extra_hooks);
            if !clients.is_empty() {
                let ctx = EventContext {
                    session_id: session.id.clone(),
                    agent: session.agent.clone(),
                    ..Default::default()
                };
                let hooks = RunHooks::new(
                    clients,
                    match by {
                        Some(p) => with_principal(ctx, p),
                        None => ctx,
                    },
                    Instant::now() + agent.config.event_budget,
                    agent.config.event_budget,
                    self.inst.clone(),
                );
                hooks.observe(0, EventKind::SessionEnd, || Payload::SessionEnd {
                    reason: reason.into(),
                });
                hooks.close();
            }
        }
    }

    /// Starts a run; its events arrive on the handle until `Finished`.
    /// `caller` is when the caller stops waiting, if it said: a start it
    /// abandons then says so.
    pub async fn start_run(
        self: &Arc<Self>,
        principal: &Principal,
        session_id: &str,
        input: String,
        streaming: bool,
        traceparent: (String, String),
        caller: Option<CallerDeadline>,
    ) -> Result<RunHandle, EngineError> {
        // A drain waits for this start until the run is registered (or
        // failed to start): its run is in the store before it is in `runs`.
        let start = self.begin_start()?;
        if input.trim().is_empty() {
            return Err(EngineError::EmptyInput);
        }
        let max = self.config.server.max_input_bytes;
        if input.len() > max {
            return Err(EngineError::InputTooLarge {
                size: input.len(),
                max,
            });
        }
        let caller = Caller {
            streaming,
            traceparent,
            deadline: caller,
        };
        self.start_now(start, principal, session_id, input, caller)
            .await
    }

    /// The store's part of [`Engine::start_run`] and the run's task.
    async fn start_now(
        self: &Arc<Self>,
        start: drain::Starting<'_>,
        principal: &Principal,
        session_id: &str,
        input: String,
        caller: Caller,
    ) -> Result<RunHandle, EngineError> {
        let Caller {
            streaming,
            traceparent,
            deadline: caller,
        } = caller;
        let (session, grant) = self.grant(principal, Action::Run, session_id).await?;
        // A busy session answers Busy before any quota: its active run
        // counts toward `max_concurrent_runs`, so the quota check answered
        // RESOURCE_EXHAUSTED for what only needs the run to end. The store
        // still enforces one run per session (this read may be stale).
        if let Some(run) = &session.active_run {
            return Err(StoreError::Busy {
                session: session.id.clone(),
                run: run.clone(),
            }
            .into());
        }
        let starting = self.reserve_start(principal, &session).await?;
        let run_id = uuid::Uuid::new_v4().to_string();
        // A caller that leaves from here on (tonic drops the handler when
        // the client's deadline passes or it disconnects) drops this start
        // before the run's task exists: the run would stay active in the
        // store with nothing behind it, its session busy until the lease
        // expired. Its end is recorded instead, from before the store is
        // asked: a begin that committed while its answer was dropped (or
        // lost with a connection) is one too.
        let first = RunLease::first(grant.session_id(), &run_id);
        let abandoned = AbandonedStart::new(self.store.clone(), first, caller);
        // The lease runs from when the store took the call, later than this.
        let asked = Instant::now();
        let lease = self
            .store
            .begin_run(grant.session_id(), &run_id, &self.replica)
            .await;
        // From here the store counts the run (or it did not start).
        match &lease {
            Ok(_) => starting.recorded(),
            Err(_) => drop(starting),
        }
        let lease = match lease {
            Ok(lease) => lease,
            // Only an unavailable store may have begun the run anyway.
            Err(e @ StoreError::Unavailable(_)) => {
                abandoned.abandon("the store's answer to the run's start was lost");
                return Err(e.into());
            }
            Err(e) => {
                abandoned.disarm();
                return Err(e.into());
            }
        };
        let ledger = Ledger::new(self.store.clone(), lease)
            .leased_at(asked)
            .retrying_end_for(self.config.server.run_lease)
            .warning_through(self.store_warnings.clone());
        // Only the messages committed since this replica last read the
        // session are read; the transcript is shared with the run, not
        // copied, and nothing of it is rewritten.
        let loaded = async {
            let agent = self.agent(&session.agent)?.clone();
            let transcript = self.transcripts.load(&*self.store, &session.id).await?;
            Ok::<_, EngineError>((agent, transcript))
        }
        .await;
        // No await from here to the run's task (or the failed start's own
        // end below).
        abandoned.disarm();
        let (agent, transcript) = match loaded {
            Ok(l) => l,
            Err(e) => {
                let end = RunEnd {
                    outcome: RunOutcome::Failed,
                    reason: e.to_string(),
                    usage: Default::default(),
                    turns: 0,
                };
                if let Err(w) = ledger.end_once(&[], &end).await {
                    ledger.warn("cannot record a run that could not start", &w);
                }
                return Err(e);
            }
        };
        let deadline = Instant::now() + agent.config.run_timeout;
        // The run's span; a client's traceparent makes it part of the
        // caller's trace.
        let span = spans::invoke_agent(
            &agent.config.name,
            agent.model.provider_name(),
            &session.id,
            &run_id,
        );
        propagation::set_parent_from_headers(&span, &traceparent.0, &traceparent.1);
        let hooks = RunHooks::new(
            self.session_hooks(&agent, &session.extra_hooks),
            EventContext {
                session_id: session.id.clone(),
                run_id: run_id.clone(),
                turn: 0,
                agent: agent.config.name.clone(),
                streaming,
                traceparent: String::new(),
                tracestate: String::new(),
                principal: principal.name.clone(),
                principal_claims: principal.claims.clone(),
            },
            deadline,
            agent.config.event_budget,
            self.inst.clone(),
        )
        .with_schemas(self.registry.clone());
        let (tx, rx) = mpsc::channel(self.config.server.run_event_buffer);
        let agent_name = agent.config.name.clone();
        let run = Arc::new(
            Run::new(
                run_id.clone(),
                session.id.clone(),
                agent,
                hooks,
                self.registry.clone(),
                streaming,
                self.approvals.clone(),
                deadline,
                tx,
                self.inst.clone(),
                ledger,
            )
            .with_client_stall(self.config.server.client_stall_timeout),
        );
        let missed_cancel = self.register(&run, start);
        let engine = self.clone();
        let active = self.inst.metrics.active_run();
        let started = std::time::Instant::now();
        let task = tokio::spawn(async move {
            // Taken off this replica at the end, or if what follows the
            // contained run panics: left behind, the run would hold up a
            // drain for its whole grace.
            let leaving = drain::Leaving {
                engine,
                run: run.clone(),
            };
            // A cancel (or a delete) answered on this replica while the run
            // was starting found no run to stop: the store has it, so the
            // run stops before its first hook. (Any later cancel finds the
            // run; one recorded by another replica meanwhile reaches it with
            // the next poll, and the store refuses the run's tools and
            // approvals from then on.)
            if missed_cancel {
                if let Some(stop) = run.ledger.recorded_stop().await {
                    run.stop_from_outside(stop);
                }
            }
            let driven = drive_contained(run.clone(), transcript, input)
                .instrument(span.clone())
                .await;
            let report = driven.report;
            let outcome = report.outcome.name();
            spans::record_run_outcome(
                &span,
                outcome,
                (report.outcome != crate::agent::outcome::RunOutcome::Completed).then_some(outcome),
            );
            // The run's span ends here, before its last events wait for a
            // slow client: exported even if the process exits first (a
            // drain past its grace does not wait for that client). Whoever
            // waits for the run to finish (a drain, a test about to flush
            // the exporter) finds it closed and handed to export.
            drop(span);
            leaving
                .engine
                .inst
                .metrics
                .run_finished(&agent_name, outcome, started.elapsed());
            drop(active);
            contain_tail(&run, run.deliver_tail(driven.tail)).await;
            // drive recorded the run's end; only now does it leave this
            // replica (a drain waits for the record).
            drop(leaving);
            report
        });
        Ok(RunHandle {
            run_id,
            events: rx,
            task,
        })
    }

    /// Cancels a run wherever it executes: recorded in the store (which
    /// denies its pending approvals) and delivered to its replica.
    pub async fn cancel_run(
        self: &Arc<Self>,
        principal: &Principal,
        run_id: &str,
    ) -> Result<(), EngineError> {
        const REASON: &str = "cancelled by client";
        self.grant_run(principal, Action::Cancel, run_id).await?;
        // Once granted, the cancel is recorded even if its caller leaves
        // mid-statement: dropped there, it was rolled back, and no poll
        // could deliver a cancel the store never saw.
        let engine = self.clone();
        let run_id = run_id.to_string();
        detached(async move {
            engine.store.request_cancel(&run_id, REASON).await?;
            engine.cancel_local(&run_id, REASON);
            Ok(())
        })
        .await
    }

    /// Answers an approval wherever its run executes; the first answer
    /// recorded wins.
    pub async fn resolve_approval(
        &self,
        principal: &Principal,
        run_id: &str,
        call_id: &str,
        approve: bool,
        note: String,
    ) -> Result<(), EngineError> {
        self.grant_run(principal, Action::ResolveApproval, run_id)
            .await?;
        let d = Decision { approve, note };
        // An answer may come before its question: the hook that asks tells
        // its approver (a bot, say) before hookwire has its `ask`. Such an
        // answer waits for the request (see `early_answer`).
        let mut hints = self.store.subscribe();
        let mut waiting = None;
        hold_for_question(
            &mut hints,
            &asked_hint(run_id),
            || self.answer(run_id, call_id, &d),
            |e| matches!(e, StoreError::ApprovalNotAsked { .. }),
            || {
                waiting.get_or_insert_with(|| self.inst.metrics.early_answer());
            },
        )
        .await
        .map_err(Into::into)
    }

    /// One attempt of [`Engine::resolve_approval`].
    async fn answer(&self, run_id: &str, call_id: &str, d: &Decision) -> Result<(), StoreError> {
        // A run of this replica knows at once that a request was withdrawn
        // (its batch stopped): refused here, never recorded as answered.
        // A request is registered here before the store records it, so a
        // pending record of a local run always has its waiter. A call not
        // asked yet has no record in the store either: the store
        // says whether the run may still ask (not ended, no cancel), as it
        // does for a run of another replica. Read in this order (asked,
        // then pending) against the run's (registered, then asked).
        if let Some(run) = self.local_run(run_id) {
            let asked = run.has_asked(call_id);
            if !self.approvals.is_pending(run_id, call_id) && (asked || run.cancel.is_cancelled()) {
                return Err(StoreError::ApprovalNotPending {
                    run_id: run_id.to_string(),
                    call_id: call_id.to_string(),
                });
            }
        }
        self.store.resolve_approval(run_id, call_id, d).await?;
        self.approvals.deliver(run_id, call_id, d.clone());
        Ok(())
    }

    pub fn hooks(&self) -> Vec<HookSnapshot> {
        self.registry.all().iter().map(|c| c.snapshot()).collect()
    }

    /// Approval requests of this replica's runs still waiting for an
    /// answer.
    pub fn pending_approvals(&self) -> usize {
        self.approvals.pending()
    }

    pub fn active_runs(&self) -> usize {
        self.runs.locked().len()
    }

    /// The runs this replica executes now (a copy: the lock is not held
    /// while they are acted on).
    fn runs_in_flight(&self) -> Vec<Arc<Run>> {
        self.runs.locked().values().cloned().collect()
    }
}

/// Most bytes of sessions one ListSessions page carries (estimated by
/// `Engine::listed_bytes`): half of the 4 MiB gRPC clients receive by
/// default, so that a page never needs a client to raise its limit.
pub const MAX_PAGE_BYTES: usize = 2 * 1024 * 1024;

/// What a run's caller brought besides its input: whether it reads the
/// run's events, its trace context, and when it stops waiting.
struct Caller {
    streaming: bool,
    traceparent: (String, String),
    deadline: Option<CallerDeadline>,
}

/// A run begun in the store whose start may still be dropped (its caller
/// left); dropped armed, it records the run's end (cancelled, for the
/// reason given, or because the caller left: at its deadline or not).
struct AbandonedStart {
    armed: Option<(Arc<dyn SessionStore>, RunLease)>,
    caller: Option<CallerDeadline>,
    reason: Option<&'static str>,
}

impl AbandonedStart {
    fn new(
        store: Arc<dyn SessionStore>,
        lease: RunLease,
        caller: Option<CallerDeadline>,
    ) -> AbandonedStart {
        AbandonedStart {
            armed: Some((store, lease)),
            caller,
            reason: None,
        }
    }

    fn disarm(mut self) {
        self.armed = None;
    }

    /// Dropped armed now, for `reason` rather than a caller gone.
    fn abandon(mut self, reason: &'static str) {
        self.reason = Some(reason);
    }
}

impl Drop for AbandonedStart {
    fn drop(&mut self) {
        let Some((store, lease)) = self.armed.take() else {
            return;
        };
        let reason = match self.reason {
            Some(r) => r.to_string(),
            None => gone_reason(self.caller),
        };
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return; // shutting down: the reaper ends it after the lease
        };
        rt.spawn(async move {
            let end = RunEnd {
                outcome: RunOutcome::Cancelled,
                reason,
                usage: Default::default(),
                turns: 0,
            };
            match store.end_run(&lease, &[], &end).await {
                // The store never began it (its answer was an error).
                Ok(()) | Err(StoreError::LeaseLost(_) | StoreError::RunNotFound(_)) => {}
                Err(e) => {
                    tracing::warn!(run = %lease.run_id, error = %e, "cannot record the end of a run whose caller left as it started");
                }
            }
        });
    }
}
