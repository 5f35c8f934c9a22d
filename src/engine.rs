//! The service's domain: sessions, runs, approvals and hooks, independent of
//! gRPC. `server::grpc` adapts it to AgentService. State lives in the store
//! (`crate::store`); this replica's own runs are in `runs`, and `replica`
//! keeps them leased and reaps the runs of replicas that were lost.

mod replica;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::agent::approvals::{Approvals, Decision};
use crate::agent::events::{RunEvent, RunReport};
use crate::agent::ledger::Ledger;
use crate::agent::outcome::RunOutcome;
use crate::agent::runner::{drive, AgentRuntime, Run};
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
    NewSession, RunEnd, SessionFilter, SessionPage, SessionStore, StoreError, TranscriptCache,
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
    /// This replica's copies of recently used transcripts: a run reads only
    /// the messages committed since.
    transcripts: TranscriptCache,
    /// This process's id in the store (lease holder name).
    replica: String,
    approvals: Arc<Approvals>,
    /// Runs executing on this replica.
    runs: Mutex<HashMap<String, Arc<Run>>>,
    accepting: AtomicBool,
    idle: Notify,
    inst: Instruments,
    background: replica::Background,
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
            config,
            agents,
            registry,
            store,
            transcripts: TranscriptCache::default(),
            replica: replica::replica_id(),
            approvals: Arc::new(Approvals::default()),
            runs: Mutex::new(HashMap::new()),
            accepting: AtomicBool::new(true),
            idle: Notify::new(),
            inst,
            background: replica::Background::default(),
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
        self.runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(run_id)
            .cloned()
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

    /// Creates a session owned by `owner` (the caller's principal;
    /// [`crate::session::ANONYMOUS`] without authentication).
    pub async fn create_session(
        &self,
        agent_name: &str,
        extra_hooks: Vec<String>,
        metadata: BTreeMap<String, String>,
        owner: &str,
    ) -> Result<Session, EngineError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(EngineError::ShuttingDown);
        }
        let agent = self.agent(agent_name)?.clone();
        for h in &extra_hooks {
            if self.registry.get(h).is_none() {
                return Err(EngineError::UnknownHook(h.clone()));
            }
        }
        let session = NewSession {
            id: uuid::Uuid::new_v4().to_string(),
            agent: agent_name.to_string(),
            owner: owner.to_string(),
            extra_hooks: extra_hooks.clone(),
            metadata: metadata.clone(),
        };
        let clients = self.session_hooks(&agent, &extra_hooks);
        if !clients.is_empty() {
            let names: Vec<String> = clients.iter().map(|c| c.name().to_string()).collect();
            let hooks = RunHooks::new(
                clients,
                EventContext {
                    session_id: session.id.clone(),
                    agent: agent_name.to_string(),
                    ..Default::default()
                },
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
        Ok(self.store.create_session(&session).await?)
    }

    /// The session with its transcript.
    pub async fn get_session(&self, id: &str) -> Result<Session, EngineError> {
        let mut s = self.store.get_session(id).await?;
        s.transcript = self.transcripts.load(&*self.store, id).await?.to_vec();
        Ok(s)
    }

    /// The session without its transcript.
    pub async fn session_info(&self, id: &str) -> Result<Session, EngineError> {
        Ok(self.store.get_session(id).await?)
    }

    pub async fn list_sessions(&self, filter: &SessionFilter) -> Result<SessionPage, EngineError> {
        Ok(self.store.list_sessions(filter).await?)
    }

    pub async fn delete_session(&self, id: &str) -> Result<(), EngineError> {
        let session = self.store.delete_session(id).await?;
        self.transcripts.forget(id);
        if let Some(run) = &session.active_run {
            // Wherever it runs, its replica is told to stop it.
            match self.store.request_cancel(run, "session deleted").await {
                Ok(()) | Err(StoreError::RunNotFound(_)) => {}
                Err(e) => {
                    tracing::warn!(run = %run, error = %e, "cannot record the cancel of a deleted session's run")
                }
            }
            if let Some(r) = self.local_run(run) {
                r.cancel("session deleted");
            }
        }
        self.session_end(&session, "deleted");
        Ok(())
    }

    /// Fires session_end (observe) at the session's hooks.
    fn session_end(&self, session: &Session, reason: &str) {
        if let Ok(agent) = self.agent(&session.agent) {
            let clients = self.session_hooks(agent, &session.extra_hooks);
            if !clients.is_empty() {
                let hooks = RunHooks::new(
                    clients,
                    EventContext {
                        session_id: session.id.clone(),
                        agent: session.agent.clone(),
                        ..Default::default()
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
    pub async fn start_run(
        self: &Arc<Self>,
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
        let run_id = uuid::Uuid::new_v4().to_string();
        let lease = self
            .store
            .begin_run(session_id, &run_id, &self.replica)
            .await?;
        let ledger = Ledger {
            store: self.store.clone(),
            lease,
        };
        // Only the messages committed since this replica last read the
        // session are read; the transcript is shared with the run, not
        // copied, and nothing of it is rewritten.
        let loaded = async {
            let session = self.store.get_session(session_id).await?;
            let agent = self.agent(&session.agent)?.clone();
            let transcript = self.transcripts.load(&*self.store, session_id).await?;
            Ok::<_, EngineError>((session, agent, transcript))
        }
        .await;
        let (session, agent, transcript) = match loaded {
            Ok(l) => l,
            Err(e) => {
                let end = RunEnd {
                    outcome: RunOutcome::Failed,
                    reason: e.to_string(),
                    usage: Default::default(),
                    turns: 0,
                };
                if let Err(w) = ledger.end(&[], &end).await {
                    tracing::warn!(run = %run_id, error = %w, "cannot record a run that could not start");
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
                ledger,
            )
            .with_client_stall(self.config.server.client_stall_timeout),
        );
        self.runs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(run_id.clone(), run.clone());
        let engine = self.clone();
        let active = self.inst.metrics.active_run();
        let started = std::time::Instant::now();
        let task = tokio::spawn(async move {
            let report = drive(run.clone(), transcript, input)
                .instrument(span.clone())
                .await;
            let outcome = report.outcome.name();
            spans::record_run_outcome(
                &span,
                outcome,
                (report.outcome != crate::agent::outcome::RunOutcome::Completed).then_some(outcome),
            );
            engine
                .inst
                .metrics
                .run_finished(&agent_name, outcome, started.elapsed());
            drop(active);
            // drive recorded the run's end; only now does it leave this
            // replica (a drain waits for the record).
            let mut runs = engine.runs.lock().unwrap_or_else(|e| e.into_inner());
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

    /// Cancels a run wherever it executes: recorded in the store (which
    /// denies its pending approvals) and delivered to its replica.
    pub async fn cancel_run(&self, run_id: &str) -> Result<(), EngineError> {
        const REASON: &str = "cancelled by client";
        self.store.request_cancel(run_id, REASON).await?;
        if let Some(r) = self.local_run(run_id) {
            r.cancel(REASON);
        }
        Ok(())
    }

    /// Answers an approval wherever its run executes; the first answer
    /// recorded wins.
    pub async fn resolve_approval(
        &self,
        run_id: &str,
        call_id: &str,
        approve: bool,
        note: String,
    ) -> Result<(), EngineError> {
        let d = Decision { approve, note };
        self.store.resolve_approval(run_id, call_id, &d).await?;
        self.approvals.deliver(run_id, call_id, d);
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
        self.runs.lock().unwrap_or_else(|e| e.into_inner()).len()
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
            let runs: Vec<Arc<Run>> = self
                .runs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned()
                .collect();
            tracing::warn!(runs = runs.len(), "shutdown grace elapsed; cancelling runs");
            for r in runs {
                r.cancel("server shutting down");
            }
            // Cancelled runs still fire run_end and commit; give them a
            // bounded moment (deploy/ sizes the pod's grace period on it).
            let _ = tokio::time::timeout(CANCEL_WIND_DOWN, self.until_idle()).await;
            // Runs that did not even end then are recorded as interrupted
            // now, so their sessions are free when this replica is gone.
            let stuck: Vec<Arc<Run>> = self
                .runs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .cloned()
                .collect();
            for r in stuck {
                let end = RunEnd {
                    outcome: RunOutcome::Interrupted,
                    reason: "the replica shut down before the run ended".into(),
                    usage: Default::default(),
                    turns: 0,
                };
                if let Err(e) = r.ledger.end(&[], &end).await {
                    tracing::warn!(run = %r.run_id, error = %e, "cannot record the run's end at shutdown");
                }
            }
        }
        self.background.stop().await;
        self.registry.stop();
    }

    /// Resolves once no run is in flight.
    async fn until_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self
                .runs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                return;
            }
            notified.await;
        }
    }
}

/// How long runs cancelled at the end of the shutdown grace may take to end.
const CANCEL_WIND_DOWN: Duration = Duration::from_secs(5);
