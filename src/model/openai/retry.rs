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

/// The server's requested wait: `retry-after-ms` (OpenAI) or `Retry-After`
/// in seconds. HTTP dates are not supported and fall back to backoff.
pub(super) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let number = |name: &str| -> Option<f64> {
        let v = headers
            .get(name)?
            .to_str()
            .ok()?
            .trim()
            .parse::<f64>()
            .ok()?;
        (v.is_finite() && v >= 0.0).then_some(v)
    };
    if let Some(ms) = number("retry-after-ms") {
        // Clamped like the seconds below: `from_secs_f64` panics on values
        // past `Duration::MAX` (a `retry-after-ms: 1e30` did, in a run).
        return Some(Duration::from_secs_f64((ms / 1000.0).min(1e9)));
    }
    number(RETRY_AFTER.as_str()).map(|s| Duration::from_secs_f64(s.min(1e9)))
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
}
