//! The certificate a handshake (or a request's host) gets: by SNI, else the default.

use super::digest_file;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Arc;

/// Whether two loaded certificates are the same (the same leaf, perhaps loaded twice).
pub(super) fn same_certificate(a: &Arc<CertifiedKey>, b: &Arc<CertifiedKey>) -> bool {
    Arc::ptr_eq(a, b) || a.cert.first() == b.cert.first()
}

/// Picks the certificate by SNI: an exact, case-insensitive match of a
/// `[[server.tls.sni]]` host, else the default.
#[derive(Debug)]
pub(super) struct SniResolver {
    pub(super) default: Arc<CertifiedKey>,
    pub(super) by_host: HashMap<String, Arc<CertifiedKey>>,
}

impl SniResolver {
    /// SHA-256 over every certificate chain (the default, then each host's in host
    /// order), hex: what tells one set of certificates from another.
    pub(super) fn certificates_digest(&self) -> String {
        let mut h = Sha256::new();
        let mut hosts: Vec<_> = self.by_host.iter().collect();
        hosts.sort_by(|a, b| a.0.cmp(b.0));
        for key in std::iter::once(&self.default).chain(hosts.into_iter().map(|(_, k)| k)) {
            for cert in &key.cert {
                digest_file(&mut h, cert.as_ref());
            }
        }
        hex::encode(h.finalize())
    }

    /// The certificate for the host `name` (SNI, or a request's host): its
    /// `[[server.tls.sni]]` entry's (case-insensitive, a trailing dot ignored), else the
    /// default.
    pub(super) fn pick(&self, name: Option<&str>) -> &Arc<CertifiedKey> {
        let named = name.and_then(|name| {
            let name = name.trim_end_matches('.');
            if name.bytes().any(|b| b.is_ascii_uppercase()) {
                self.by_host.get(&name.to_ascii_lowercase())
            } else {
                self.by_host.get(name)
            }
        });
        named.unwrap_or(&self.default)
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.pick(hello.server_name()).clone())
    }
}
