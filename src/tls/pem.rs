//! Certificates and keys from PEM bytes, with errors that name the file.

use std::path::Path;

use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum PemError {
    #[error("cannot read {file}: {error}")]
    Read { file: String, error: String },
    #[error("{file}: {error}")]
    Invalid { file: String, error: String },
}

fn name(file: &Path) -> String {
    file.display().to_string()
}

/// Every certificate in a PEM file (a chain, leaf first, or a CA bundle).
pub fn load_certs(file: &Path, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PemError::Invalid {
            file: name(file),
            error: format!("not a PEM certificate file: {e}"),
        })?;
    if certs.is_empty() {
        return Err(PemError::Invalid {
            file: name(file),
            error: "no CERTIFICATE block found".into(),
        });
    }
    Ok(certs)
}

/// The first private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(file: &Path, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(bytes).map_err(|e| PemError::Invalid {
        file: name(file),
        error: format!("no usable PRIVATE KEY block: {e}"),
    })
}

/// A CA bundle as a root store; every certificate must parse as a CA.
pub fn load_roots(file: &Path, bytes: &[u8]) -> Result<RootCertStore, PemError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(file, bytes)? {
        roots.add(cert).map_err(|e| PemError::Invalid {
            file: name(file),
            error: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(roots)
}
