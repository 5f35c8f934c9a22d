//! When and how long to wait before another attempt: jittered exponential
//! backoff, overridden by the server's `Retry-After`.

use std::time::Duration;

use reqwest::header::{HeaderMap, RETRY_AFTER};

/// Longest `Retry-After` that is waited for. A server asking for more (a
/// quota window, typically) fails the call at once: the run has its own
/// deadline and the operator learns sooner.
pub(super) const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Backoff {
    /// Delay before the first retry (before jitter).
    pub base: Duration,
    /// Upper bound of any computed delay.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(500),
            max: Duration::from_secs(8),
        }
    }
}

impl Backoff {
    /// Delay before retry number `retry` (0-based): `base * 2^retry`, capped,
    /// then scaled by a random factor in [0.5, 1.0) so that clients that
    /// failed together do not retry together. `jitter` is that factor's
    /// random input in [0, 1).
    pub fn delay(&self, retry: u32, jitter: f64) -> Duration {
        let exp = self
            .base
            .saturating_mul(2u32.saturating_pow(retry.min(16)))
            .min(self.max);
        // NaN survives `clamp`, and `mul_f64` panics on it.
        let jitter = if jitter.is_nan() {
            1.0
        } else {
            jitter.clamp(0.0, 1.0)
        };
        // f64 rounding can land a hair above the cap on huge durations.
        exp.mul_f64(0.5 + 0.5 * jitter).min(self.max)
    }
}

/// A random number in [0, 1), from the OS RNG behind UUID v4.
pub(super) fn jitter() -> f64 {
    let bits = (uuid::Uuid::new_v4().as_u128() >> 75) as u64; // 53 random bits
    bits as f64 / (1u64 << 53) as f64
}

/// Longest wait a header is read as. Anything longer is as good as forever
/// (it is far above [`MAX_RETRY_AFTER`], so the call ends), and capping it
/// keeps `1e30` from overflowing a `Duration`.
const LONGEST_PARSED: Duration = Duration::from_secs(1_000_000_000);

/// The server's requested wait: `retry-after-ms` (OpenAI) or `Retry-After`
/// in seconds. HTTP dates are not supported and fall back to backoff, as do
/// values that are not a finite, non-negative number (`NaN`, `inf`, `-1`).
/// Waits beyond [`LONGEST_PARSED`] are read as that.
pub(super) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let seconds = |name: &str, per_second: f64| -> Option<Duration> {
        let v = headers
            .get(name)?
            .to_str()
            .ok()?
            .trim()
            .parse::<f64>()
            .ok()?;
        if !v.is_finite() || v < 0.0 {
            return None;
        }
        // Never `from_secs_f64`: it panics on values a server may send.
        let secs = (v / per_second).min(LONGEST_PARSED.as_secs_f64());
        Duration::try_from_secs_f64(secs).ok()
    };
    seconds("retry-after-ms", 1000.0).or_else(|| seconds(RETRY_AFTER.as_str(), 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn backoff_doubles_is_capped_and_jittered_into_the_upper_half() {
        let b = Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_millis(1000),
        };
        assert_eq!(b.delay(0, 0.0), Duration::from_millis(50));
        assert_eq!(b.delay(0, 1.0), Duration::from_millis(100));
        assert_eq!(b.delay(2, 0.0), Duration::from_millis(200));
        assert_eq!(b.delay(5, 1.0), Duration::from_millis(1000));
        assert_eq!(b.delay(u32::MAX, 1.0), Duration::from_millis(1000));
        for _ in 0..100 {
            let j = jitter();
            assert!((0.0..1.0).contains(&j));
        }
    }

    #[test]
    fn retry_after_seconds_and_milliseconds() {
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h), None);
        h.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after(&h), Some(Duration::from_millis(250)));
        let mut h = HeaderMap::new();
        h.insert(
            RETRY_AFTER,
            HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(&h), None);
        h.insert(RETRY_AFTER, HeaderValue::from_static("-1"));
        assert_eq!(retry_after(&h), None);
    }

    /// Numbers a server may send that once panicked the run task
    /// (`Duration::from_secs_f64` overflow) or must not count as a wait.
    #[test]
    fn retry_after_never_panics_and_clamps_what_it_reads() {
        let read = |name: &'static str, value: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_static(value));
            retry_after(&h)
        };
        for name in ["retry-after-ms", "retry-after"] {
            for huge in [
                "1e30",
                "1e308",
                "18446744073709551616",
                "99999999999999999999",
            ] {
                assert_eq!(read(name, huge), Some(LONGEST_PARSED), "{name}: {huge}");
            }
            for bad in [
                "NaN", "nan", "inf", "-inf", "infinity", "-1", "-1e30", "", "x",
            ] {
                assert_eq!(read(name, bad), None, "{name}: {bad}");
            }
            assert_eq!(read(name, "-0"), Some(Duration::ZERO), "{name}: -0");
            assert_eq!(read(name, "0"), Some(Duration::ZERO), "{name}: 0");
        }
        assert_eq!(
            read("retry-after-ms", "1.5"),
            Some(Duration::from_micros(1500))
        );
        assert_eq!(read("retry-after", "1e9"), Some(LONGEST_PARSED));
        assert!(
            LONGEST_PARSED > MAX_RETRY_AFTER,
            "a clamped wait still ends the call"
        );
        // An unusable retry-after-ms falls back to Retry-After.
        let mut h = HeaderMap::new();
        h.insert("retry-after-ms", HeaderValue::from_static("NaN"));
        h.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(3)));
    }
}
