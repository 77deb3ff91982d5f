//! TLS to `https://` upstream targets: the rustls client configuration of one upstream
//! (trusted roots, optional client certificate, ALPN), built when the config is loaded,
//! from the PEM files the loading step read ([`crate::config::files`]).

use crate::config::{Files, Problems, TlsRoots, UpstreamConfig, UpstreamProtocol};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};
use std::path::Path;
use std::sync::Arc;

/// The client configuration for the `https://` targets of `cfg` (its PEM files taken
/// from `files`), recording problems under `at` (`upstreams[INDEX]`).
pub(crate) fn client_config(
    at: &str,
    cfg: &UpstreamConfig,
    files: &Files,
    problems: &mut Problems,
) -> Option<Arc<ClientConfig>> {
    let named = ClientTlsFiles {
        ca: cfg.ca.as_deref(),
        roots: cfg.tls_roots,
        roots_key: "tls_roots",
        client_cert: cfg.client_cert.as_deref(),
        client_key: cfg.client_key.as_deref(),
    };
    let mut config = named.client_config(at, files, problems)?;
    config.alpn_protocols = match cfg.protocol {
        UpstreamProtocol::Http1 => vec![b"http/1.1".to_vec()],
        UpstreamProtocol::Http2 => vec![b"h2".to_vec()],
    };
    Some(Arc::new(config))
}

/// The files and roots a TLS client is configured from (`[[upstreams]]` or
/// `[store.tls]`), as written in the config.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientTlsFiles<'a> {
    /// PEM file of private CA certificates; replaces `roots`.
    pub ca: Option<&'a str>,
    /// The built-in or system roots, when `ca` is not set.
    pub roots: TlsRoots,
    /// The key `roots` is written under (problems with the system store are reported
    /// there).
    pub roots_key: &'a str,
    /// PEM file of the client certificate chain (needs `client_key`).
    pub client_cert: Option<&'a str>,
    /// PEM file of its private key (needs `client_cert`).
    pub client_key: Option<&'a str>,
}

impl ClientTlsFiles<'_> {
    /// A rustls client configuration (ring provider, TLS 1.2 and 1.3, no ALPN) from
    /// these files, taken from `files` where the loading step read them (at `at.ca`,
    /// `at.client_cert` and `at.client_key`). Problems are recorded under those keys and
    /// `at.ROOTS_KEY`.
    pub(crate) fn client_config(
        &self,
        at: &str,
        files: &Files,
        problems: &mut Problems,
    ) -> Option<ClientConfig> {
        let before = problems.errors.len();
        let roots = match self.ca {
            Some(_) => ca_roots(&format!("{at}.ca"), files, problems),
            None => match self.roots {
                TlsRoots::Webpki => Some(RootCertStore {
                    roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
                }),
                TlsRoots::System => {
                    system_roots(&format!("{at}.{}", self.roots_key), files, problems)
                }
            },
        };
        let client_auth = match (self.client_cert, self.client_key) {
            (None, None) => None,
            (Some(_), None) => {
                problems.error(
                    format!("{at}.client_key"),
                    "is required with client_cert (the PEM file of its private key)",
                );
                None
            }
            (None, Some(_)) => {
                problems.error(
                    format!("{at}.client_cert"),
                    "is required with client_key (the PEM file of the certificate chain)",
                );
                None
            }
            (Some(_), Some(_)) => {
                let chain = read_certs(&format!("{at}.client_cert"), files, problems);
                let key = read_key(&format!("{at}.client_key"), files, problems);
                chain.map(|(_, chain)| chain).zip(key)
            }
        };
        if problems.errors.len() != before {
            return None;
        }
        let roots = roots?;
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .ok()?
                .with_root_certificates(roots);
        match client_auth {
            None => Some(builder.with_no_client_auth()),
            Some((chain, key)) => match builder.with_client_auth_cert(chain, key) {
                Ok(c) => Some(c),
                Err(e) => {
                    problems.error(
                        format!("{at}.client_key"),
                        format!("does not fit client_cert: {e}"),
                    );
                    None
                }
            },
        }
    }
}

/// The bytes of the PEM file named at `key`, with its path; when it could not be read,
/// `PATH: I/O error: ERROR` at `key` (the words of rustls' PEM file reader, which read
/// these files before the loading step did).
fn pem_file<'f>(
    key: &str,
    files: &'f Files,
    problems: &mut Problems,
) -> Option<(&'f Path, &'f [u8])> {
    files.bytes_or(key, problems, |path, e| {
        format!("{}: I/O error: {e}", path.display())
    })
}

/// The certificates of the PEM file named at `key`, with its path.
fn read_certs<'f>(
    key: &str,
    files: &'f Files,
    problems: &mut Problems,
) -> Option<(&'f Path, Vec<CertificateDer<'static>>)> {
    let (path, bytes) = pem_file(key, files, problems)?;
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(bytes).collect();
    match certs {
        Ok(certs) if certs.is_empty() => {
            problems.error(
                key,
                format!("{}: no PEM certificate in the file", path.display()),
            );
            None
        }
        Ok(certs) => Some((path, certs)),
        Err(e) => {
            problems.error(key, format!("{}: {e}", path.display()));
            None
        }
    }
}

/// The private key of the PEM file named at `key`.
fn read_key(key: &str, files: &Files, problems: &mut Problems) -> Option<PrivateKeyDer<'static>> {
    let (path, bytes) = pem_file(key, files, problems)?;
    match PrivateKeyDer::from_pem_slice(bytes) {
        Ok(k) => Some(k),
        Err(e) => {
            problems.error(key, format!("{}: {e}", path.display()));
            None
        }
    }
}

/// A root store of the CA certificates in the PEM file named at `key`.
fn ca_roots(key: &str, files: &Files, problems: &mut Problems) -> Option<RootCertStore> {
    let (path, certs) = read_certs(key, files, problems)?;
    crate::tls::ca_roots(certs, path, key, problems)
}

/// A root store of the operating system's trusted roots (read by the loading step).
fn system_roots(key: &str, files: &Files, problems: &mut Problems) -> Option<RootCertStore> {
    let found = files.system_roots(key, problems)?;
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs.iter().cloned());
    if added == 0 {
        let why = found
            .errors
            .first()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "the store is empty".into());
        problems.error(
            key,
            format!(
                "no usable certificate in the system's store ({why}); use \"webpki\" or set ca"
            ),
        );
        return None;
    }
    Some(roots)
}
