//! Durations in the config file: humantime text (`30s`, `5m`, `2h`), at
//! most [`MAX`]. Every one of them ends up added to an `Instant` or armed
//! as a timer somewhere (a run's deadline, a lease, a JWT's leeway
//! subtracted from now); a value like `10000000000000000000s` parsed fine
//! and then panicked on the first request that used it.

use std::time::Duration;

use serde::{de::Error, Deserializer};

/// The longest duration any setting takes: longer than any run, approval,
/// lease or idle session needs, and far from every overflow.
pub const MAX: Duration = Duration::from_secs(366 * 24 * 60 * 60);

fn bounded<E: Error>(d: Duration) -> Result<Duration, E> {
    if d > MAX {
        return Err(E::custom(format!(
            "`{}` is longer than a duration may be here (at most 366d)",
            humantime_serde::re::humantime::format_duration(d)
        )));
    }
    Ok(d)
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    bounded(humantime_serde::deserialize(d)?)
}

/// For `Option<Duration>` settings.
pub mod option {
    use super::*;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let d: Option<Duration> = humantime_serde::deserialize(d)?;
        d.map(bounded).transpose()
    }
}
