//! Percentiles of samples and the median-with-spread of repeated rounds.

use std::time::Duration;

use serde::Serialize;

/// The value at quantile `q` (0..=1) of `samples`, by nearest rank. Sorts
/// in place; `samples` must not be empty.
pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
    assert!(!samples.is_empty(), "quantile of no samples");
    samples.sort_by(f64::total_cmp);
    let rank = (q * samples.len() as f64).ceil() as usize;
    samples[rank.clamp(1, samples.len()) - 1]
}

/// Microseconds, the unit every latency figure is reported in.
pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// One figure over repeated rounds: the median of the per-round values,
/// with the lowest and highest round as its spread.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub rounds: usize,
}

impl Spread {
    pub fn of(rounds: &[f64]) -> Spread {
        let mut v = rounds.to_vec();
        Spread {
            median: quantile(&mut v, 0.5),
            min: v[0],
            max: v[v.len() - 1],
            rounds: v.len(),
        }
    }
}
