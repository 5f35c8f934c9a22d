//! The open-file limit of `hookwire serve`. Every client connection, hook
//! connection and model connection is a file descriptor; distributions
//! start processes with a soft limit of 1024 even where the hard limit is
//! far higher, which a replica with thousands of runs in flight can reach.
//! Raising the soft limit to the hard one needs no privilege.

use rustix::process::{getrlimit, setrlimit, Resource};

/// Raises the soft RLIMIT_NOFILE to the hard limit; returns (before, after)
/// when it changed anything.
pub fn raise() -> Result<Option<(u64, u64)>, String> {
    let limit = getrlimit(Resource::Nofile);
    let (Some(soft), hard) = (limit.current, limit.maximum) else {
        // Already unlimited.
        return Ok(None);
    };
    let target = hard.unwrap_or(u64::MAX);
    if soft >= target {
        return Ok(None);
    }
    let mut raised = limit;
    raised.current = hard;
    setrlimit(Resource::Nofile, raised)
        .map_err(|e| format!("cannot raise the open-file limit from {soft} to {target}: {e}"))?;
    Ok(Some((soft, target)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_ends_at_the_hard_one() {
        let hard = getrlimit(Resource::Nofile).maximum;
        // Lower the soft limit first, so there is something to raise (this
        // test binary's own limit; it never goes above the hard one).
        let mut low = getrlimit(Resource::Nofile);
        low.current = Some(512.min(hard.unwrap_or(u64::MAX)));
        setrlimit(Resource::Nofile, low).unwrap();
        let changed = raise().unwrap();
        let now = getrlimit(Resource::Nofile);
        assert_eq!(now.current, hard);
        if hard != Some(512) {
            assert_eq!(changed.map(|c| c.0), Some(512));
        }
        assert_eq!(raise().unwrap(), None, "nothing left to raise");
    }
}
