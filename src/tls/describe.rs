//! What did not match, in words, when a TLS handshake fails: the message
//! of a `tls` hook failure and of a refused client.

use rustls::{AlertDescription, CertificateError, Error};

/// A sentence naming the mismatch (expired, unknown CA, wrong name, missing
/// client certificate...), for failure details and logs.
pub fn describe_tls_error(e: &Error) -> String {
    match e {
        Error::InvalidCertificate(c) => describe_certificate(c),
        Error::NoCertificatesPresented => "the peer presented no certificate".into(),
        Error::AlertReceived(a) => match a {
            AlertDescription::CertificateRequired => {
                "the server requires a client certificate and none was sent (set tls.cert_file and tls.key_file)".into()
            }
            AlertDescription::UnknownCA => {
                "the server does not trust our client certificate (unknown CA)".into()
            }
            AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate => {
                format!("the server rejected our client certificate ({a:?})")
            }
            AlertDescription::CertificateExpired => {
                "the server rejected our client certificate: expired".into()
            }
            AlertDescription::HandshakeFailure => {
                "the server refused the handshake (no common protocol, or a client certificate it requires)".into()
            }
            other => format!("the peer sent TLS alert {other:?}"),
        },
        Error::PeerIncompatible(p) => format!("no common TLS parameters: {p:?}"),
        other => other.to_string(),
    }
}

/// `DnsName("a.example")` (rustls' debug form) as `a.example`.
fn bare(presented: &str) -> &str {
    match (presented.find("(\""), presented.rfind("\")")) {
        (Some(a), Some(b)) if a + 2 <= b => &presented[a + 2..b],
        _ => presented,
    }
}

fn describe_certificate(c: &CertificateError) -> String {
    match c {
        CertificateError::Expired => "certificate expired".into(),
        CertificateError::ExpiredContext { time, not_after } => format!(
            "certificate expired ({}s ago)",
            time.as_secs().saturating_sub(not_after.as_secs())
        ),
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            "certificate not valid yet (check the clocks)".into()
        }
        CertificateError::UnknownIssuer => {
            "certificate signed by an unknown CA (not in the configured CA bundle)".into()
        }
        CertificateError::NotValidForName => "certificate not valid for the expected name".into(),
        CertificateError::NotValidForNameContext { expected, presented } => format!(
            "certificate not valid for name {} (it is for: {}); set tls.server_name if the name differs",
            expected.to_str(),
            if presented.is_empty() {
                "no names".to_string()
            } else {
                presented.iter().map(|p| bare(p)).collect::<Vec<_>>().join(", ")
            }
        ),
        CertificateError::Revoked => "certificate revoked".into(),
        CertificateError::BadSignature => "certificate signature does not verify".into(),
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
            "certificate not valid for this purpose (extended key usage)".into()
        }
        CertificateError::BadEncoding => "certificate is not valid DER".into(),
        other => format!("invalid certificate: {other}"),
    }
}
