//! The service's domain: sessions, runs, approvals and hooks, independent of
//! gRPC. `server::grpc` adapts it to AgentService.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::agent::approvals::{ApprovalError, Approvals, Decision};
use crate::agent::contain::drive_contained;
use crate::agent::events::{RunEvent, RunReport};
use crate::agent::runner::{AgentRuntime, Run};
use crate::auth::access::{self, Action, Denied, SessionGrant};
use crate::auth::quota::{QuotaExceeded, QuotaLedger};
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
use crate::session::{MemoryStore, Session, SessionError, SessionStore};
use crate::telemetry::{propagation, spans, Instruments};
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("unknown agent `{name}`{hint}")]
    UnknownAgent { name: String, hint: String },
    #[error("unknown hook `{0}`: sessions may only enable hooks configured under `hooks:`")]
    UnknownHook(String),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("input must not be empty")]
    EmptyInput,
    #[error("input is {size} bytes; the limit is {max} (server.max_input_bytes)")]
    InputTooLarge { size: usize, max: usize },
    #[error("session rejected by hook `{hook}`: {reason}")]
    SessionRejected { hook: String, reason: String },
    #[error("session_start failed: {0}")]
    SessionHookFailed(HookFailure),
    #[error("run `{0}` not found (it may have finished)")]
    UnknownRun(String),
    #[error(transparent)]
    Approval(#[from] ApprovalError),
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
    /// Bounded by `server.run_event_buffer`. When it was full as the run
    /// ended, the last event (`Finished`) is missing: the report is then
    /// `task`'s result.
    pub events: mpsc::Receiver<RunEvent>,
    pub task: tokio::task::JoinHandle<RunReport>,
}

pub struct Engine {
    config: Config,
    agents: HashMap<String, Arc<AgentRuntime>>,
    registry: Arc<HookRegistry>,
    store: Arc<dyn SessionStore>,
    approvals: Arc<Approvals>,
    runs: Mutex<HashMap<String, Arc<Run>>>,
    accepting: AtomicBool,
    idle: Notify,
    inst: Instruments,
    quotas: Arc<QuotaLedger>,
}

/// The caller's identity as hooks see it in EventContext.
fn with_principal(mut ctx: EventContext, p: &Principal) -> EventContext {
    ctx.principal = p.name.clone();
    ctx.principal_claims = p.claims.clone();
    ctx
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Engine {
    pub fn new(
        config: Config,
        models: HashMap<String, Arc<dyn ModelProvider>>,
        inst: Instruments,
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
        Ok(Engine {
            agents,
            registry,
            store: Arc::new(MemoryStore::default()),
            approvals: Arc::new(Approvals::default()),
            runs: Mutex::new(HashMap::new()),
            accepting: AtomicBool::new(true),
            idle: Notify::new(),
            inst,
            quotas: Arc::new(QuotaLedger::new(config.quotas.clone())),
            config,
        })
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
        let rank = |names: &[String]| -> Vec<Ranked> {
            names
                .iter()
                .filter_map(|n| self.registry.get(n))
                .map(|c| Ranked {
                    name: c.name().to_string(),
                    priority: c.config.priority,
                })
                .collect()
        };
        firing_order(&rank(&agent.config.hooks), &rank(extra))
            .iter()
            .filter_map(|n| self.registry.get(n).cloned())
            .collect()
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
            Denied::Hidden => SessionError::NotFound(session_id.to_string()).into(),
            Denied::Agent { principal, agent } => EngineError::AgentDenied { principal, agent },
        }
    }

    fn quota(&self, p: &Principal, e: QuotaExceeded) -> EngineError {
        self.inst.metrics.quota_rejected(e.limit, p.class());
        e.into()
    }

    /// The session, if `p` may do `action` with it.
    fn grant(
        &self,
        p: &Principal,
        action: Action,
        id: &str,
    ) -> Result<(Session, SessionGrant), EngineError> {
        let s = self
            .store
            .get(id)
            .ok_or_else(|| SessionError::NotFound(id.to_string()))?;
        let agent = self.config.agent(&s.agent);
        let g =
            access::authorize(p, action, &s.id, &s.owner, agent).map_err(|d| self.denied(d, id))?;
        Ok((s, g))
    }

    /// The run's session, if `p` may do `action` with it; a run the caller
    /// may not see answers exactly like a finished one.
    fn grant_run(
        &self,
        p: &Principal,
        action: Action,
        run_id: &str,
    ) -> Result<(Arc<Run>, SessionGrant), EngineError> {
        let unknown = || EngineError::UnknownRun(run_id.to_string());
        let run = self
            .runs
            .lock()
            .unwrap()
            .get(run_id)
            .cloned()
            .ok_or_else(unknown)?;
        let s = self.store.get(&run.session_id).ok_or_else(unknown)?;
        let g = access::authorize(p, action, &s.id, &s.owner, Some(&run.agent.config))
            .map_err(|_| unknown())?;
        Ok((run, g))
    }

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
        // creations cannot both take the last slot.
        let _slot = self
            .quotas
            .begin_session(principal, self.store.count_owned(&principal.name))
            .map_err(|e| self.quota(principal, e))?;
        let session = Session {
            id: uuid::Uuid::new_v4().to_string(),
            agent: agent_name.to_string(),
            owner: principal.name.clone(),
            extra_hooks: extra_hooks.clone(),
            metadata: metadata.clone(),
            created_at_unix_ms: now_ms(),
            transcript: Vec::new(),
            run_count: 0,
            active_run: None,
        };
        let clients = self.session_hooks(&agent, &extra_hooks);
        if !clients.is_empty() {
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
        self.store.insert(session.clone());
        Ok(session)
    }

    pub fn get_session(&self, principal: &Principal, id: &str) -> Result<Session, EngineError> {
        Ok(self.grant(principal, Action::Read, id)?.0)
    }

    /// The sessions `principal` may see: its own, or all for an admin.
    pub fn list_sessions(&self, principal: &Principal) -> Vec<Session> {
        match access::list_scope(principal) {
            access::ListScope::All => self.store.list(None),
            access::ListScope::OwnedBy(o) => self.store.list(Some(&o)),
        }
    }

    pub async fn delete_session(&self, principal: &Principal, id: &str) -> Result<(), EngineError> {
        let (_, grant) = self.grant(principal, Action::Delete, id)?;
        let session = self
            .store
            .remove(grant.session_id())
            .ok_or_else(|| SessionError::NotFound(id.to_string()))?;
        if let Some(run) = &session.active_run {
            if let Some(r) = self.runs.lock().unwrap().get(run) {
                r.cancel("session deleted");
            }
        }
        if let Ok(agent) = self.agent(&session.agent) {
            let clients = self.session_hooks(agent, &session.extra_hooks);
            if !clients.is_empty() {
                let hooks = RunHooks::new(
                    clients,
                    with_principal(
                        EventContext {
                            session_id: session.id.clone(),
                            agent: session.agent.clone(),
                            ..Default::default()
                        },
                        principal,
                    ),
                    Instant::now() + agent.config.event_budget,
                    agent.config.event_budget,
                    self.inst.clone(),
                );
                hooks.observe(0, EventKind::SessionEnd, || Payload::SessionEnd {
                    reason: "deleted".into(),
                });
                hooks.close();
            }
        }
        Ok(())
    }

    /// Starts a run; its events arrive on the handle until `Finished`.
    pub fn start_run(
        self: &Arc<Self>,
        principal: &Principal,
        session_id: &str,
        input: String,
        streaming: bool,
        traceparent: (String, String),
    ) -> Result<RunHandle, EngineError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(EngineError::ShuttingDown);
        }
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
        let (_, grant) = self.grant(principal, Action::Run, session_id)?;
        let slot = self
            .quotas
            .begin_run(principal)
            .map_err(|e| self.quota(principal, e))?;
        let run_id = uuid::Uuid::new_v4().to_string();
        let session = self.store.begin_run(grant.session_id(), &run_id)?;
        let agent = match self.agent(&session.agent) {
            Ok(a) => a.clone(),
            Err(e) => {
                self.store.end_run(session_id, &run_id, vec![]);
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
        );
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
            )
            .with_client_stall(self.config.server.client_stall_timeout),
        );
        self.runs
            .lock()
            .unwrap()
            .insert(run_id.clone(), run.clone());
        let engine = self.clone();
        let transcript = session.transcript;
        let active = self.inst.metrics.active_run();
        let started = std::time::Instant::now();
        let task = tokio::spawn(async move {
            let report = drive_contained(run.clone(), transcript, input)
                .instrument(span.clone())
                .await;
            let outcome = report.outcome.name();
            spans::record_run_outcome(
                &span,
                outcome,
                (report.outcome != crate::agent::outcome::RunOutcome::Completed).then_some(outcome),
            );
            // The run's span ends here, before the run counts as finished:
            // whoever waits for that (a drain, a test about to flush the
            // exporter) then finds the span closed and handed to export.
            drop(span);
            engine
                .inst
                .metrics
                .run_finished(&agent_name, outcome, started.elapsed());
            drop(active);
            drop(slot);
            engine
                .store
                .end_run(&report.session_id, &report.run_id, report.messages.clone());
            let mut runs = engine.runs.lock().unwrap();
            runs.remove(&report.run_id);
            if runs.is_empty() {
                engine.idle.notify_waiters();
            }
            report
        });
        Ok(RunHandle {
            run_id,
            events: rx,
            task,
        })
    }

    pub fn cancel_run(&self, principal: &Principal, run_id: &str) -> Result<(), EngineError> {
        let (run, _grant) = self.grant_run(principal, Action::Cancel, run_id)?;
        run.cancel("cancelled by client");
        Ok(())
    }

    pub fn resolve_approval(
        &self,
        principal: &Principal,
        run_id: &str,
        call_id: &str,
        approve: bool,
        note: String,
    ) -> Result<(), EngineError> {
        let (run, _grant) = self.grant_run(principal, Action::ResolveApproval, run_id)?;
        Ok(self
            .approvals
            .resolve(&run.run_id, call_id, Decision { approve, note })?)
    }

    pub fn hooks(&self) -> Vec<HookSnapshot> {
        self.registry.all().iter().map(|c| c.snapshot()).collect()
    }

    /// Approval requests still waiting for `ResolveApproval`.
    pub fn pending_approvals(&self) -> usize {
        self.approvals.pending()
    }

    pub fn active_runs(&self) -> usize {
        self.runs.lock().unwrap().len()
    }

    /// Refuses new sessions and runs from now on.
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::SeqCst);
    }

    /// Waits for in-flight runs up to `grace`, then cancels the rest and
    /// waits for them to finish (they end promptly with outcome cancelled).
    pub async fn drain(&self, grace: Duration) {
        if tokio::time::timeout(grace, self.until_idle())
            .await
            .is_err()
        {
            let runs: Vec<Arc<Run>> = self.runs.lock().unwrap().values().cloned().collect();
            tracing::warn!(runs = runs.len(), "shutdown grace elapsed; cancelling runs");
            for r in runs {
                r.cancel("server shutting down");
            }
            // Cancelled runs still fire run_end and commit; give them a
            // bounded moment (deploy/ sizes the pod's grace period on it).
            let _ = tokio::time::timeout(CANCEL_WIND_DOWN, self.until_idle()).await;
        }
        self.registry.stop();
    }

    /// Resolves once no run is in flight.
    async fn until_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.runs.lock().unwrap().is_empty() {
                return;
            }
            notified.await;
        }
    }
}

/// How long runs cancelled at the end of the shutdown grace may take to end.
const CANCEL_WIND_DOWN: Duration = Duration::from_secs(5);
