//! TLS to `https://` upstream targets: the rustls client configuration of one upstream
//! (trusted roots, optional client certificate, ALPN), built when the config is loaded.

use crate::config::{Problems, TlsRoots, UpstreamConfig, UpstreamProtocol};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};
use std::path::Path;
use std::sync::Arc;

/// The client configuration for the `https://` targets of `cfg` (reading its PEM files,
/// relative to `base_dir`), recording problems under `at` (`upstreams[INDEX]`).
pub(crate) fn client_config(
    at: &str,
    cfg: &UpstreamConfig,
    base_dir: &Path,
    problems: &mut Problems,
) -> Option<Arc<ClientConfig>> {
    let before = problems.errors.len();
    let roots = match &cfg.ca {
        Some(ca) => ca_roots(&format!("{at}.ca"), &base_dir.join(ca), problems),
        None => match cfg.tls_roots {
            TlsRoots::Webpki => Some(RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            }),
            TlsRoots::System => system_roots(&format!("{at}.tls_roots"), problems),
        },
    };
    let client_auth = match (&cfg.client_cert, &cfg.client_key) {
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
        (Some(cert), Some(key)) => {
            let chain = read_certs(&format!("{at}.client_cert"), &base_dir.join(cert), problems);
            let key = read_key(&format!("{at}.client_key"), &base_dir.join(key), problems);
            chain.zip(key)
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
    let mut config = match client_auth {
        None => builder.with_no_client_auth(),
        Some((chain, key)) => match builder.with_client_auth_cert(chain, key) {
            Ok(c) => c,
            Err(e) => {
                problems.error(
                    format!("{at}.client_key"),
                    format!("does not fit client_cert: {e}"),
                );
                return None;
            }
        },
    };
    config.alpn_protocols = match cfg.protocol {
        UpstreamProtocol::Http1 => vec![b"http/1.1".to_vec()],
        UpstreamProtocol::Http2 => vec![b"h2".to_vec()],
    };
    Some(Arc::new(config))
}

fn read_certs(
    key: &str,
    path: &Path,
    problems: &mut Problems,
) -> Option<Vec<CertificateDer<'static>>> {
    let certs: Result<Vec<_>, _> = match CertificateDer::pem_file_iter(path) {
        Ok(iter) => iter.collect(),
        Err(e) => Err(e),
    };
    match certs {
        Ok(certs) if certs.is_empty() => {
            problems.error(
                key,
                format!("{}: no PEM certificate in the file", path.display()),
            );
            None
        }
        Ok(certs) => Some(certs),
        Err(e) => {
            problems.error(key, format!("{}: {e}", path.display()));
            None
        }
    }
}

fn read_key(key: &str, path: &Path, problems: &mut Problems) -> Option<PrivateKeyDer<'static>> {
    match PrivateKeyDer::from_pem_file(path) {
        Ok(k) => Some(k),
        Err(e) => {
            problems.error(key, format!("{}: {e}", path.display()));
            None
        }
    }
}

fn ca_roots(key: &str, path: &Path, problems: &mut Problems) -> Option<RootCertStore> {
    let certs = read_certs(key, path, problems)?;
    crate::tls::ca_roots(certs, path, key, problems)
}

fn system_roots(key: &str, problems: &mut Problems) -> Option<RootCertStore> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
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
