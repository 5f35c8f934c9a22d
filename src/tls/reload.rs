//! A value built from files and rebuilt when their content changes.
//!
//! Checked on use rather than by a watcher task: the first use after
//! `interval` re-reads the files and compares a SHA-256 of their bytes, so
//! Kubernetes' atomic `..data` symlink swaps (Secrets, ConfigMaps, projected
//! tokens, cert-manager) are seen like any rewrite, and nothing runs between
//! uses. A reload that fails (missing file, bad PEM, a key that does not
//! match its certificate) keeps the previous value, logs a warning and
//! counts `hookwire_reload_failures_total{what}`; it is retried at the next
//! check. Open connections keep the configuration they were made with.

use crate::lock::LockExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// A fixed kind (`server_tls`, `hook_tls`, `hook_token`, `auth_tokens`,
    /// `jwks`), never a path.
    pub what: &'static str,
}

static FAILURES: LazyLock<Family<ReloadLabels, Counter>> = LazyLock::new(Family::default);
static TOTAL_FAILURES: AtomicU64 = AtomicU64::new(0);

/// The process-wide reload failure counters (registered by telemetry).
pub fn reload_failures() -> Family<ReloadLabels, Counter> {
    FAILURES.clone()
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ReloadError(pub String);

type Build<T> = dyn Fn(&[Vec<u8>]) -> Result<T, String> + Send + Sync;

struct State<T> {
    checked: Instant,
    digest: Vec<u8>,
    value: Arc<T>,
}

pub struct Reloading<T> {
    kind: &'static str,
    /// Who uses it, for logs (`hooks[0] (py-guard) tls`).
    owner: String,
    files: Vec<PathBuf>,
    interval: Duration,
    build: Box<Build<T>>,
    state: Mutex<State<T>>,
}

fn read_all(files: &[PathBuf]) -> Result<(Vec<Vec<u8>>, Vec<u8>), String> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let bytes = std::fs::read(f).map_err(|e| format!("cannot read {}: {e}", f.display()))?;
        // Length-prefixed so moving bytes between files changes the digest.
        ctx.update(&(bytes.len() as u64).to_le_bytes());
        ctx.update(&bytes);
        out.push(bytes);
    }
    Ok((out, ctx.finish().as_ref().to_vec()))
}

impl<T: Send + Sync + 'static> Reloading<T> {
    /// Builds the first value; an error here is a start-up error.
    pub fn new(
        kind: &'static str,
        owner: impl Into<String>,
        files: Vec<PathBuf>,
        interval: Duration,
        build: impl Fn(&[Vec<u8>]) -> Result<T, String> + Send + Sync + 'static,
    ) -> Result<Reloading<T>, ReloadError> {
        let owner = owner.into();
        let (bytes, digest) = read_all(&files).map_err(|e| ReloadError(format!("{owner}: {e}")))?;
        let value = build(&bytes).map_err(|e| ReloadError(format!("{owner}: {e}")))?;
        Ok(Reloading {
            kind,
            owner,
            files,
            interval,
            build: Box::new(build),
            state: Mutex::new(State {
                checked: Instant::now(),
                digest,
                value: Arc::new(value),
            }),
        })
    }

    /// The current value, re-reading the files first when `interval` has
    /// passed since the last check.
    pub fn current(&self) -> Arc<T> {
        let mut s = self.state.locked();
        if s.checked.elapsed() < self.interval {
            return s.value.clone();
        }
        s.checked = Instant::now();
        match read_all(&self.files) {
            Ok((_, digest)) if digest == s.digest => {}
            Ok((bytes, digest)) => match (self.build)(&bytes) {
                Ok(v) => {
                    s.value = Arc::new(v);
                    s.digest = digest;
                    tracing::info!(what = self.kind, owner = %self.owner, "reloaded changed files");
                }
                Err(e) => self.failed(&e),
            },
            Err(e) => self.failed(&e),
        }
        s.value.clone()
    }

    fn failed(&self, error: &str) {
        FAILURES
            .get_or_create(&ReloadLabels { what: self.kind })
            .inc();
        TOTAL_FAILURES.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            what = self.kind,
            owner = %self.owner,
            error,
            "reload failed; keeping the previous version"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reloads_on_change_and_keeps_the_old_value_on_failure() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("v");
        std::fs::write(&f, "1").unwrap();
        let r = Reloading::new("test", "t", vec![f.clone()], Duration::ZERO, |b| {
            let s = String::from_utf8(b[0].clone()).map_err(|e| e.to_string())?;
            s.trim().parse::<u32>().map_err(|e| e.to_string())
        })
        .unwrap();
        assert_eq!(*r.current(), 1);
        std::fs::write(&f, "2").unwrap();
        assert_eq!(*r.current(), 2);
        let before = TOTAL_FAILURES.load(Ordering::Relaxed);
        std::fs::write(&f, "not a number").unwrap();
        assert_eq!(*r.current(), 2, "a bad file keeps the last good value");
        assert!(TOTAL_FAILURES.load(Ordering::Relaxed) > before);
        std::fs::remove_file(&f).unwrap();
        assert_eq!(*r.current(), 2, "a missing file keeps the last good value");
        std::fs::write(&f, "3").unwrap();
        assert_eq!(*r.current(), 3);
    }

    #[test]
    fn not_rechecked_within_the_interval() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("v");
        std::fs::write(&f, "a").unwrap();
        let r = Reloading::new(
            "test",
            "t",
            vec![f.clone()],
            Duration::from_secs(3600),
            |b| Ok(b[0].clone()),
        )
        .unwrap();
        std::fs::write(&f, "b").unwrap();
        assert_eq!(&*r.current(), b"a");
    }
}
