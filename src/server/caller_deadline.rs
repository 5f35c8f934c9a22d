//! The caller's own deadline, read from the `grpc-timeout` request header
//! (gRPC over HTTP/2: at most 8 digits and a unit, `H M S m u n`), so a
//! run its caller abandoned at that deadline says so instead of "client
//! disconnected" alone.

use std::time::Duration;

use crate::engine::CallerDeadline;

/// When the caller of a request with these headers stops waiting, if it
/// said (`None` for no header, or one that is not a valid `grpc-timeout`).
pub fn of(headers: &tonic::metadata::MetadataMap) -> Option<CallerDeadline> {
    CallerDeadline::after(parse(headers.get("grpc-timeout")?.to_str().ok()?)?)
}

fn parse(v: &str) -> Option<Duration> {
    let digits = v.get(..v.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match v.as_bytes()[v.len() - 1] {
        b'H' => Duration::from_secs(n.checked_mul(3600)?),
        b'M' => Duration::from_secs(n.checked_mul(60)?),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_values_are_read_by_the_spec() {
        assert_eq!(parse("1S"), Some(Duration::from_secs(1)));
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("99999999u"), Some(Duration::from_micros(99_999_999)));
        assert_eq!(parse("5n"), Some(Duration::from_nanos(5)));
        for bad in ["", "S", "1", "1s", "123456789S", "-1S", "1.5S", "1 S", "ü"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
