//! The one hookwire service most figures share: every hook server started
//! in this process (the Python one as a child process), one config with an
//! agent per variant, and a client.

use hookwire::pb;
use hookwire::pb::agent_service_client::AgentServiceClient;
use prost::Message as _;
use tonic::transport::Channel;

use crate::hook::{self, Steady};
use crate::python::PythonHook;
use crate::service::{self, input, Service, Yaml};

/// The blocking events of a run.
const RUN_EVENTS: [&str; 7] = [
    "run_start",
    "model_request",
    "model_response",
    "invalid_tool_call",
    "tool_call",
    "tool_result",
    "turn_end",
];

/// Hook counts of the fan-out figure.
pub const FAN: [usize; 4] = [1, 2, 4, 8];

pub struct Rig {
    pub service: Service,
    pub client: AgentServiceClient<Channel>,
    /// Why the Python figure is missing, when it is.
    pub python_missing: Option<String>,
    /// The hook event the floor pings with.
    pub typical_event: pb::HookEvent,
    _hooks: Vec<hook::Running>,
    _python: Option<PythonHook>,
}

/// One kind of run: an agent and the input that shapes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Variant {
    pub agent: &'static str,
    pub input: &'static str,
}

pub const BARE_CHAT: Variant = Variant {
    agent: "bare",
    input: input::CHAT,
};
pub const BARE_TOOLS: Variant = Variant {
    agent: "bare",
    input: input::TOOLS,
};
pub const HOOKED_CHAT: Variant = Variant {
    agent: "hooked",
    input: input::CHAT,
};
pub const HOOKED_TOOLS: Variant = Variant {
    agent: "hooked",
    input: input::TOOLS,
};
pub const PYTHON_TOOLS: Variant = Variant {
    agent: "python",
    input: input::TOOLS,
};

pub fn merged(k: usize) -> Variant {
    Variant {
        agent: ["mr1", "mr2", "mr4", "mr8"][FAN.iter().position(|&f| f == k).unwrap()],
        input: input::TOOLS,
    }
}

/// `k` merged `model_request` hooks that each take [`SLOW`] to decide.
pub fn merged_slow(k: usize) -> Variant {
    Variant {
        agent: ["mrs1", "mrs2", "mrs4", "mrs8"][FAN.iter().position(|&f| f == k).unwrap()],
        input: input::TOOLS,
    }
}

/// `k` (1 or 8) merged `model_request` hooks that each take exactly
/// [`SLOW`] (`Steady::thinking_exactly`).
pub fn merged_exact(k: usize) -> Variant {
    Variant {
        agent: if k == 1 { "mre1" } else { "mre8" },
        input: input::TOOLS,
    }
}

/// How long a slow hook thinks: a lookup (issue 18 asks for 1 ms hooks).
pub const SLOW: std::time::Duration = std::time::Duration::from_millis(1);

pub fn chained(k: usize) -> Variant {
    Variant {
        agent: ["tr1", "tr2", "tr4", "tr8"][FAN.iter().position(|&f| f == k).unwrap()],
        input: input::TOOLS,
    }
}

fn names(prefix: &str, k: usize) -> Vec<String> {
    (1..=k).map(|i| format!("{prefix}{i}")).collect()
}

/// What to start besides hookwire and the `steady` hook.
#[derive(Clone, Copy, PartialEq)]
pub enum Extent {
    /// Every hook of every figure, the Python one included.
    Full,
    /// Only `steady`, for the bare and hooked agents.
    Lean,
}

impl Rig {
    pub async fn start(extent: Extent) -> Rig {
        // The hook of the per-event and throughput figures; it also owns the
        // `get_weather` tool of every agent.
        let steady = Steady::new("steady", true);
        let mut hooks = vec![hook::start(steady.clone()).await];
        let mut yaml = Yaml::new();
        // Every event of a run, not session_start: sessions are made
        // outside the timed part, and should stay cheap.
        yaml.hook("steady", &hooks[0].addr, &RUN_EVENTS);
        yaml.agent("bare", &[], 8)
            .agent("hooked", &["steady".into()], 8);
        if extent == Extent::Lean {
            return Rig::finish(yaml, Some(steady), hooks, None, Some("lean rig".into())).await;
        }
        for i in 1..=8 {
            let fan = hook::start(Steady::new(&format!("fan{i}"), false)).await;
            yaml.hook(&format!("mr_{i}"), &fan.addr, &["model_request"]);
            yaml.hook(&format!("tr_{i}"), &fan.addr, &["tool_result"]);
            hooks.push(fan);
            let slow = hook::start(Steady::new(&format!("slow{i}"), false).thinking(SLOW)).await;
            yaml.hook(&format!("mrs_{i}"), &slow.addr, &["model_request"]);
            hooks.push(slow);
            let exact =
                hook::start(Steady::new(&format!("exact{i}"), false).thinking_exactly(SLOW)).await;
            yaml.hook(&format!("mre_{i}"), &exact.addr, &["model_request"]);
            hooks.push(exact);
        }
        for k in [1, 8] {
            yaml.agent(merged_exact(k).agent, &names("mre_", k), 8);
        }
        for k in FAN {
            yaml.agent(merged(k).agent, &names("mr_", k), 8);
            yaml.agent(chained(k).agent, &names("tr_", k), 8);
            yaml.agent(merged_slow(k).agent, &names("mrs_", k), 8);
        }
        yaml.agent("solo", &[], 8).agent("looping", &[], 10);
        let (python, python_missing) = match PythonHook::start().await {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        };
        if let Some(p) = &python {
            // The events its Describe lists: naming others (turn_end, which
            // it does not handle) would make each a hook failure.
            yaml.hook("py", &p.addr, &[]);
            yaml.agent("python", &["py".into()], 8);
        }
        Rig::finish(yaml, Some(steady), hooks, python, python_missing).await
    }

    /// The lean rig with `steady` served elsewhere (another process).
    pub async fn start_remote(hook_addr: &str, fan_addr: &str) -> Rig {
        let mut yaml = Yaml::new();
        yaml.hook("steady", hook_addr, &RUN_EVENTS);
        yaml.agent("bare", &[], 8)
            .agent("hooked", &["steady".into()], 8);
        // Eight merged `model_request` hooks: one remote server that owns
        // no tool under eight names, so eight connections and streams as
        // with eight servers (hookwire pools per hook).
        for i in 1..=8 {
            yaml.hook(&format!("mr_{i}"), fan_addr, &["model_request"]);
        }
        for k in [1, 8] {
            yaml.agent(merged(k).agent, &names("mr_", k), 8);
        }
        Rig::finish(yaml, None, Vec::new(), None, Some("remote rig".into())).await
    }

    async fn finish(
        yaml: Yaml,
        steady: Option<Steady>,
        hooks: Vec<hook::Running>,
        python: Option<PythonHook>,
        python_missing: Option<String>,
    ) -> Rig {
        let service = Service::start(&yaml.build()).await;
        let mut client = service.client().await;
        // One hooked run fills the hook's samples of each event kind.
        let s = service::sessions(&client, HOOKED_TOOLS.agent, 1).await;
        let (_, r) = service::invoke(&mut client, &s[0], HOOKED_TOOLS.input).await;
        service::assert_completed(&r, "calibration run");
        let typical_event = steady
            .map(|s| typical(&s.sample.lock().unwrap()))
            .unwrap_or_default();
        Rig {
            service,
            client,
            python_missing,
            typical_event,
            _hooks: hooks,
            _python: python,
        }
    }

    pub fn has(&self, v: Variant) -> bool {
        v.agent != "python" || self.python_missing.is_none()
    }

    /// Blocking hook events per run of `v`, counted by hookwire's own
    /// `hookwire_hook_call_duration_seconds` for `hook`.
    pub async fn events_per_run(&mut self, v: Variant, hook: &str, runs: usize) -> f64 {
        let count = |text: &str| {
            service::metric_sum(
                text,
                "hookwire_hook_call_duration_seconds_count",
                &[&format!("hook=\"{hook}\"")],
            )
        };
        let sessions = service::sessions(&self.client, v.agent, runs).await;
        let before = count(&service::metrics(self.service.admin).await);
        for s in sessions {
            let (_, r) = service::invoke(&mut self.client, &s, v.input).await;
            service::assert_completed(&r, v.agent);
        }
        (count(&service::metrics(self.service.admin).await) - before) / runs as f64
    }
}

/// The event of median encoded size among the kinds one tools run sends.
fn typical(samples: &[pb::HookEvent]) -> pb::HookEvent {
    let mut by_size: Vec<&pb::HookEvent> = samples.iter().collect();
    assert!(!by_size.is_empty(), "the calibration run sent no events");
    by_size.sort_by_key(|e| e.encoded_len());
    by_size[by_size.len() / 2].clone()
}

impl Rig {
    /// Client-side run latencies (µs) of each variant, `runs` each. Runs go
    /// one at a time, the variants interleaved (rotating which goes first)
    /// so drift on a shared machine hits them alike. Sessions are created
    /// beforehand, untimed.
    pub async fn latencies(&mut self, variants: &[Variant], runs: usize) -> Vec<Vec<f64>> {
        let mut sessions = Vec::new();
        for v in variants {
            sessions.push(
                service::sessions(&self.client, v.agent, runs)
                    .await
                    .into_iter(),
            );
        }
        let mut out = vec![Vec::with_capacity(runs); variants.len()];
        for i in 0..runs {
            for j in 0..variants.len() {
                let k = (i + j) % variants.len();
                let session = sessions[k].next().expect("one session per run");
                let (took, r) =
                    service::invoke(&mut self.client, &session, variants[k].input).await;
                service::assert_completed(&r, variants[k].agent);
                out[k].push(crate::stats::micros(took));
            }
        }
        out
    }
}
