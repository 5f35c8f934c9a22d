//! Certificates made per test with rcgen: CAs, server and client leaves
//! (valid, expired, for another name), written as PEM files.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key as PEM.
#[derive(Clone)]
pub struct Leaf {
    pub cert: String,
    pub key: String,
}

/// What a leaf is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Server,
    Client,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut p = CertificateParams::default();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        Ca {
            issuer: CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf for `dns` names (and 127.0.0.1 when `dns` has "localhost"),
    /// plus `uris` (e.g. a SPIFFE ID).
    pub fn leaf(&self, usage: Use, dns: &[&str], uris: &[&str]) -> Leaf {
        self.leaf_with(usage, dns, uris, false)
    }

    /// Like `leaf`, but expired since 2020.
    pub fn expired_leaf(&self, usage: Use, dns: &[&str]) -> Leaf {
        self.leaf_with(usage, dns, &[], true)
    }

    fn leaf_with(&self, usage: Use, dns: &[&str], uris: &[&str], expired: bool) -> Leaf {
        let mut p =
            CertificateParams::new(dns.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        if dns.contains(&"localhost") {
            p.subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        }
        for u in uris {
            p.subject_alt_names
                .push(SanType::URI((*u).try_into().unwrap()));
        }
        p.distinguished_name.push(
            DnType::CommonName,
            dns.first().or(uris.first()).copied().unwrap_or("leaf"),
        );
        p.extended_key_usages = vec![match usage {
            Use::Server => ExtendedKeyUsagePurpose::ServerAuth,
            Use::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        if expired {
            p.not_before = rcgen::date_time_ymd(2019, 1, 1);
            p.not_after = rcgen::date_time_ymd(2020, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

impl Leaf {
    /// Writes `NAME.crt` and `NAME.key` into `dir`; returns their paths.
    pub fn write(&self, dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let c = dir.join(format!("{name}.crt"));
        let k = dir.join(format!("{name}.key"));
        write_atomic(&c, &self.cert);
        write_atomic(&k, &self.key);
        (c, k)
    }
}

/// Writes a PEM file `NAME` into `dir`.
pub fn write_pem(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let p = dir.join(name);
    write_atomic(&p, pem);
    p
}

/// Replaces a file by renaming a new one over it, as Kubernetes' symlink
/// swap does: readers see the old or the new content, never half of it.
pub fn write_atomic(path: &Path, content: &str) {
    let tmp = path.with_extension("tmp-new");
    std::fs::write(&tmp, content).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
