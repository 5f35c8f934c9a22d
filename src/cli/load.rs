//! `hookwire load`: a bounded load generator, so an operator can size a
//! deployment against their own hooks. N workers each invoke runs back to
//! back (a fresh session every `runs_per_session` runs) for a fixed time;
//! runs still in flight then are awaited, up to a drain limit.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::cli::client::outcome_name;
use crate::cli::connection::{self, Client, ServerOpts};
use crate::pb;

/// Workers per HTTP/2 connection to the server: one connection would make
/// its single connection task the client's bottleneck at high concurrency.
const WORKERS_PER_CONNECTION: usize = 500;
const MAX_CONNECTIONS: usize = 32;
pub const MAX_CONCURRENCY: usize = 100_000;
pub const MAX_DURATION: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug)]
pub struct Options {
    pub addr: String,
    pub agent: String,
    pub concurrency: usize,
    pub duration: Duration,
    pub input: String,
    pub runs_per_session: u32,
    /// How long runs still in flight at the end may take to finish.
    pub drain: Duration,
    /// TLS and token, as for the other client commands.
    pub server: ServerOpts,
}

/// What one run came to.
enum Ended {
    /// The run's outcome, e.g. `completed`, `hook_failed`.
    Outcome(String),
    /// The call failed: the gRPC status code.
    Error(tonic::Code),
}

struct Sample {
    /// Since the load started, when the run ended.
    at: Duration,
    latency: Duration,
    ended: Ended,
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Default, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub addr: String,
    pub agent: String,
    pub concurrency: usize,
    pub duration_s: f64,
    /// Runs that ended with an outcome, those drained after the duration
    /// included (failed calls are in `errors`).
    pub runs: u64,
    /// Runs that ended within the duration, per second of it.
    pub runs_per_second: f64,
    /// From the start to the last run's end, drain included (the
    /// duration when nothing ended after it).
    pub elapsed_s: f64,
    /// Every run that ended with an outcome, per second of `elapsed_s`:
    /// what to read when runs take about as long as the duration or
    /// longer, and few or none end within it.
    pub runs_per_second_with_drain: f64,
    pub latency_ms: Latency,
    /// Runs by outcome (`completed`, `hook_failed`, ...).
    pub outcomes: BTreeMap<String, u64>,
    /// Calls that failed, by gRPC status code (session creation included).
    pub errors: BTreeMap<String, u64>,
    /// Runs still in flight when the drain limit passed.
    pub unfinished: u64,
    /// The first error's text, to start looking.
    pub first_error: Option<String>,
}

impl Report {
    /// Every run completed (outcome `completed` or `max_turns`), and there
    /// was at least one.
    pub fn all_completed(&self) -> bool {
        let done = |k: &str| self.outcomes.get(k).copied().unwrap_or(0);
        self.runs > 0
            && self.unfinished == 0
            && self.errors.is_empty()
            && done("completed") + done("max_turns") == self.runs
    }

    pub fn text(&self) -> String {
        let mut out = format!(
            "hookwire load: agent {} at {}, {} concurrent, {:.1}s\n",
            self.agent, self.addr, self.concurrency, self.duration_s
        );
        out.push_str(&format!(
            "runs: {} ({:.1} runs/s within the duration",
            self.runs, self.runs_per_second
        ));
        // Runs in flight at the end always end a little after it: worth a
        // second rate only when the drain took a good part of the time.
        if self.elapsed_s > self.duration_s * 1.1 {
            out.push_str(&format!(
                "; {:.1} runs/s over {:.1}s with the drain",
                self.runs_per_second_with_drain, self.elapsed_s
            ));
        }
        out.push_str(")\n");
        if self.runs > 0 && self.latency_ms.p50 >= self.duration_s * 1e3 / 2.0 {
            out.push_str(
                "note: runs take half the duration or more; for a steady rate, \
                 run for many times their latency (--duration)\n",
            );
        }
        let l = &self.latency_ms;
        out.push_str(&format!(
            "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}  mean {:.2}\n",
            l.p50, l.p90, l.p99, l.max, l.mean
        ));
        let list = |m: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!("outcomes: {}\n", list(&self.outcomes)));
        if !self.errors.is_empty() {
            out.push_str(&format!("errors: {}\n", list(&self.errors)));
        }
        if self.unfinished > 0 {
            out.push_str(&format!(
                "unfinished: {} runs still in flight after the drain limit\n",
                self.unfinished
            ));
        }
        if let Some(e) = &self.first_error {
            out.push_str(&format!("first error: {e}\n"));
        }
        out
    }
}

/// What a worker saw, and the first error's text.
#[derive(Default)]
struct Seen {
    samples: Vec<Sample>,
    first_error: Option<String>,
    /// Calls still in flight when the drain limit passed (0 or 1).
    unfinished: u64,
}

impl Seen {
    fn error(&mut self, at: Duration, latency: Duration, what: &str, s: &tonic::Status) {
        self.first_error
            .get_or_insert_with(|| format!("{what}: {:?}: {}", s.code(), s.message()));
        self.samples.push(Sample {
            at,
            latency,
            ended: Ended::Error(s.code()),
        });
    }
}

/// Starts sessions and runs until `stop_at`; a call still in flight at
/// `drain_until` is given up and counted unfinished. The worker returns
/// what it saw either way: cut off from outside, it took every run it had
/// finished with it.
async fn worker(
    mut client: Client,
    opts: std::sync::Arc<Options>,
    start: Instant,
    stop_at: Instant,
    drain_until: Instant,
) -> Seen {
    let mut seen = Seen::default();
    'sessions: while Instant::now() < stop_at {
        let t = Instant::now();
        let created = tokio::time::timeout_at(
            drain_until,
            client.create_session(pb::CreateSessionRequest {
                agent: opts.agent.clone(),
                ..Default::default()
            }),
        )
        .await;
        let Ok(created) = created else {
            seen.unfinished = 1;
            break;
        };
        let session = match created {
            Ok(s) => s.into_inner().id,
            Err(s) => {
                seen.error(start.elapsed(), t.elapsed(), "CreateSession", &s);
                // A server that refuses sessions would otherwise spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        for _ in 0..opts.runs_per_session.max(1) {
            if Instant::now() >= stop_at {
                break 'sessions;
            }
            let t = Instant::now();
            let r = tokio::time::timeout_at(
                drain_until,
                client.invoke(pb::RunRequest {
                    session_id: session.clone(),
                    input: opts.input.clone(),
                }),
            )
            .await;
            let latency = t.elapsed();
            let Ok(r) = r else {
                seen.unfinished = 1;
                break 'sessions;
            };
            match r {
                Ok(r) => seen.samples.push(Sample {
                    at: start.elapsed(),
                    latency,
                    ended: Ended::Outcome(outcome_name(r.into_inner().outcome)),
                }),
                Err(s) => {
                    seen.error(start.elapsed(), latency, "Invoke", &s);
                    continue 'sessions;
                }
            }
        }
    }
    seen
}

/// Runs the load and reports; `anyhow` errors only for bad options or a
/// server that cannot be reached at all.
pub async fn run(opts: Options) -> anyhow::Result<Report> {
    if opts.concurrency == 0 || opts.concurrency > MAX_CONCURRENCY {
        anyhow::bail!("--concurrency must be 1..={MAX_CONCURRENCY}");
    }
    if opts.duration.is_zero() || opts.duration > MAX_DURATION {
        anyhow::bail!("--duration must be more than 0 and at most 1h");
    }
    if opts.drain > MAX_DURATION {
        anyhow::bail!("--drain must be at most 1h");
    }
    let connections = opts
        .concurrency
        .div_ceil(WORKERS_PER_CONNECTION)
        .min(MAX_CONNECTIONS);
    let mut clients = Vec::with_capacity(connections);
    for _ in 0..connections {
        clients.push(connection::connect(&opts.addr, &opts.server).await?);
    }
    let opts = std::sync::Arc::new(opts);
    let start = Instant::now();
    let stop_at = start + opts.duration;
    let drain_until = stop_at + opts.drain;
    let mut workers = tokio::task::JoinSet::new();
    for i in 0..opts.concurrency {
        let client = clients[i % connections].clone();
        workers.spawn(worker(client, opts.clone(), start, stop_at, drain_until));
    }
    let mut seen = Seen::default();
    // Every worker returns by `drain_until`, with what it saw.
    while let Some(s) = workers.join_next().await {
        let s = s.map_err(|e| anyhow::anyhow!("a load worker failed: {e}"))?;
        if seen.first_error.is_none() {
            seen.first_error = s.first_error;
        }
        seen.samples.extend(s.samples);
        seen.unfinished += s.unfinished;
    }
    Ok(report(&opts, seen))
}

fn report(opts: &Options, seen: Seen) -> Report {
    let mut outcomes = BTreeMap::new();
    let mut errors = BTreeMap::new();
    let mut latencies: Vec<Duration> = Vec::with_capacity(seen.samples.len());
    let mut within = 0u64;
    let mut last = opts.duration;
    for s in &seen.samples {
        last = last.max(s.at);
        match &s.ended {
            Ended::Outcome(o) => {
                *outcomes.entry(o.clone()).or_insert(0) += 1;
                latencies.push(s.latency);
                if s.at <= opts.duration {
                    within += 1;
                }
            }
            Ended::Error(code) => {
                *errors.entry(format!("{code:?}")).or_insert(0) += 1;
            }
        }
    }
    latencies.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let pct = |q: f64| -> f64 {
        if latencies.is_empty() {
            return 0.0;
        }
        // Nearest rank.
        let rank = (q * latencies.len() as f64).ceil().max(1.0) as usize;
        ms(latencies[rank.min(latencies.len()) - 1])
    };
    let latency_ms = Latency {
        p50: pct(0.50),
        p90: pct(0.90),
        p99: pct(0.99),
        max: latencies.last().map(|d| ms(*d)).unwrap_or(0.0),
        mean: if latencies.is_empty() {
            0.0
        } else {
            latencies.iter().map(|d| ms(*d)).sum::<f64>() / latencies.len() as f64
        },
    };
    Report {
        addr: opts.addr.clone(),
        agent: opts.agent.clone(),
        concurrency: opts.concurrency,
        duration_s: opts.duration.as_secs_f64(),
        runs: latencies.len() as u64,
        runs_per_second: within as f64 / opts.duration.as_secs_f64(),
        elapsed_s: last.as_secs_f64(),
        runs_per_second_with_drain: latencies.len() as f64 / last.as_secs_f64(),
        latency_ms,
        outcomes,
        errors,
        unfinished: seen.unfinished,
        first_error: seen.first_error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(duration: Duration) -> Options {
        Options {
            addr: "http://127.0.0.1:1".into(),
            agent: "demo".into(),
            concurrency: 2,
            duration,
            input: "hello".into(),
            runs_per_session: 1,
            drain: Duration::from_secs(60),
            server: ServerOpts::default(),
        }
    }

    fn run(at_ms: u64, latency_ms: u64) -> Sample {
        Sample {
            at: Duration::from_millis(at_ms),
            latency: Duration::from_millis(latency_ms),
            ended: Ended::Outcome("completed".into()),
        }
    }

    /// Runs that outlast the duration still give a rate: over the time
    /// until the last one ended, with a note to run longer.
    #[test]
    fn runs_ended_in_the_drain_give_a_rate_with_it() {
        let seen = Seen {
            samples: vec![run(2_500, 2_500), run(3_500, 3_500), run(4_000, 4_000)],
            ..Default::default()
        };
        let r = report(&options(Duration::from_secs(3)), seen);
        assert_eq!(r.runs, 3);
        assert!((r.runs_per_second - 1.0 / 3.0).abs() < 1e-9, "{r:?}");
        assert!((r.elapsed_s - 4.0).abs() < 1e-9, "{r:?}");
        assert!((r.runs_per_second_with_drain - 0.75).abs() < 1e-9, "{r:?}");
        let text = r.text();
        assert!(
            text.contains(
                "runs: 3 (0.3 runs/s within the duration; 0.8 runs/s over 4.0s with the drain)"
            ),
            "{text}"
        );
        assert!(text.contains("note: runs take half the duration"), "{text}");
    }

    /// Short runs, the last ones ending just after the duration: one rate,
    /// no note.
    #[test]
    fn runs_within_the_duration_give_one_rate() {
        let seen = Seen {
            samples: vec![run(100, 10), run(900, 10), run(1_000, 10), run(1_050, 10)],
            ..Default::default()
        };
        let r = report(&options(Duration::from_secs(1)), seen);
        assert!((r.elapsed_s - 1.05).abs() < 1e-9, "{r:?}");
        assert!((r.runs_per_second - 3.0).abs() < 1e-9, "{r:?}");
        assert!(
            (r.runs_per_second_with_drain - 4.0 / 1.05).abs() < 1e-9,
            "{r:?}"
        );
        let text = r.text();
        assert!(
            text.contains("runs: 4 (3.0 runs/s within the duration)\n"),
            "{text}"
        );
        assert!(!text.contains("note:"), "{text}");
    }
}
