//! TLS on the proxy listener (`[server.tls]`): certificates built from the PEM files the
//! loading step read ([`crate::config::files`]) when a snapshot is built, chosen by SNI,
//! and optional client certificates.
//!
//! Each snapshot carries its own [`Tls`] (a rustls `ServerConfig` with the ring provider,
//! TLS 1.2 and 1.3 only, ALPN `h2` then `http/1.1`). A new connection's handshake uses the
//! snapshot that is current when it is accepted, so a reload (SIGHUP, or a change to the
//! config file or a certificate file) swaps certificates for new handshakes while open
//! connections keep the session they have. A certificate that cannot be loaded makes the
//! whole config invalid: a reload then keeps the running snapshot, and its certificates.

mod der;
mod sni;
#[cfg(test)]
mod tests;

pub use der::{not_after, subject_cn};

use crate::config::{ClientAuth, Files, Problems, TlsConfig};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};
use sni::{same_certificate, SniResolver};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The TLS part of a snapshot: what new handshakes on the proxy listener use.
#[derive(Debug)]
pub struct Tls {
    config: Arc<rustls::ServerConfig>,
    /// Picks the certificate by SNI (also in `config`).
    resolver: Arc<SniResolver>,
    /// `server.tls.handshake_timeout`: the budget of one handshake.
    pub handshake_timeout: Duration,
    files: Vec<PathBuf>,
    digest: String,
    expiries: Vec<CertExpiry>,
}

/// When one served certificate expires: a row of `tollgate_tls_cert_not_after_seconds`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertExpiry {
    /// The certificate file, resolved against the config file's directory.
    pub cert: String,
    /// `"default"` for `server.tls.cert`, else the `[[server.tls.sni]]` host (lower case).
    pub sni: String,
    /// The leaf certificate's notAfter, UTC epoch seconds.
    pub not_after: i64,
}

/// What the request path learns of a TLS connection; the listener puts it in the
/// extensions of every request of that connection.
#[derive(Debug, Clone, Default)]
pub struct TlsInfo {
    /// The subject common name (CN) of the client certificate, when the client presented
    /// one and it verified against `server.tls.client_ca`.
    pub client_cn: Option<Arc<str>>,
    /// On a listener with more than one certificate: the one the handshake chose (by
    /// SNI), and what chooses one for a host name.
    chosen: Option<(Arc<SniResolver>, Arc<CertifiedKey>)>,
}

impl TlsInfo {
    /// What a finished handshake tells: the verified client certificate's CN, if any.
    pub fn of(conn: &rustls::ServerConnection) -> Self {
        let client_cn = conn
            .peer_certificates()
            .and_then(|chain| chain.first())
            .and_then(|leaf| subject_cn(leaf.as_ref()))
            .map(Arc::from);
        Self {
            client_cn,
            chosen: None,
        }
    }

    /// Whether a request for `host` (a host name or IP address, without port, any case)
    /// is misdirected on this connection: the listener has more than one certificate,
    /// and the one it presents for `host` is not the one this connection's SNI chose.
    /// Such a request gets 421 (RFC 9110 §15.5.20): the client has not checked that this
    /// connection may speak for `host`, and should open one of its own.
    pub fn misdirected(&self, host: &str) -> bool {
        match &self.chosen {
            None => false,
            Some((resolver, chosen)) => !same_certificate(resolver.pick(Some(host)), chosen),
        }
    }
}

impl Tls {
    /// Build the rustls config from every certificate and key of `cfg`, taken from
    /// `files` (the loading step read them: see [`crate::config::files::server_tls`];
    /// `base`, the config file's directory, resolves the paths [`Tls::files`] lists),
    /// recording problems under `server.tls.*`. `None` when anything is wrong.
    pub fn build(
        cfg: &TlsConfig,
        base: &Path,
        files: &Files,
        problems: &mut Problems,
    ) -> Option<Tls> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let before = problems.errors.len();
        if cfg.handshake_timeout.0.is_zero() {
            problems.error("server.tls.handshake_timeout", "must be more than 0");
        }
        let mut default = load_pair("server.tls", &provider, files, problems);
        let mut expiries = Vec::new();
        let mut expiry = |path: &Path, sni: &str, pair: &CertifiedKey| {
            let Some(leaf) = pair.cert.first() else {
                return;
            };
            match not_after(leaf.as_ref()) {
                Some(not_after) => expiries.push(CertExpiry {
                    cert: path.display().to_string(),
                    sni: sni.to_string(),
                    not_after,
                }),
                None => tracing::warn!(
                    cert = %path.display(),
                    "cannot read the certificate's notAfter; tollgate_tls_cert_not_after_seconds leaves it out"
                ),
            }
        };
        if let Some(pair) = &default {
            expiry(&base.join(&cfg.cert), "default", pair);
        }
        if cfg.ocsp.is_some() {
            // Stapled with the default certificate.
            let response = files.bytes("server.tls.ocsp", problems).map(|(_, b)| b);
            if response.is_some_and(<[u8]>::is_empty) {
                problems.error("server.tls.ocsp", "the OCSP response file is empty");
            }
            if let (Some(pair), Some(bytes)) = (default.as_mut(), response) {
                let mut with_ocsp = CertifiedKey::clone(pair);
                with_ocsp.ocsp = Some(bytes.to_vec());
                *pair = Arc::new(with_ocsp);
            }
        }
        let mut by_host = HashMap::new();
        for (i, sni) in cfg.sni.iter().enumerate() {
            let at = format!("server.tls.sni[{i}]");
            let host = sni.host.trim().trim_end_matches('.').to_ascii_lowercase();
            if host.is_empty() {
                problems.error(format!("{at}.host"), "must not be empty");
            }
            let pair = load_pair(&at, &provider, files, problems);
            if let Some(pair) = pair {
                expiry(&base.join(&sni.cert), &host, &pair);
                if by_host.insert(host, pair).is_some() {
                    problems.error(
                        format!("{at}.host"),
                        format!("{:?} already has a certificate", sni.host),
                    );
                }
            }
        }
        // Shared ticket keys.
        let shared_tickets = cfg.ticket_keys.as_ref().and_then(|_| {
            let (path, bytes) = files.bytes("server.tls.ticket_keys", problems)?;
            let text = String::from_utf8_lossy(bytes);
            match crate::tickets::SharedTicketer::parse(&text) {
                Ok(t) => Some(Arc::new(t) as Arc<dyn rustls::server::ProducesTickets>),
                Err(e) => {
                    problems.error("server.tls.ticket_keys", format!("{}: {e}", path.display()));
                    None
                }
            }
        });
        let verifier = match &cfg.client_ca {
            None => {
                if cfg.client_auth.is_some() {
                    problems.error(
                        "server.tls.client_auth",
                        "needs server.tls.client_ca (the CA that client certificates chain to)",
                    );
                }
                None
            }
            Some(_) => client_verifier(
                cfg.client_auth.unwrap_or_default(),
                &provider,
                files,
                problems,
            ),
        };
        if problems.errors.len() > before {
            return None;
        }
        let default = default?;
        let builder = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12]);
        let builder = match builder {
            Ok(b) => b,
            Err(e) => {
                problems.error("server.tls", format!("cannot build the TLS config: {e}"));
                return None;
            }
        };
        let builder = match cfg.client_ca {
            Some(_) => builder.with_client_cert_verifier(verifier?),
            None => builder.with_no_client_auth(),
        };
        let resolver = Arc::new(SniResolver { default, by_host });
        let mut config = builder.with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        // Stateless session tickets (TLS 1.2 and 1.3): no session cache to share.
        let ticketer = match shared_tickets {
            Some(shared) => Some(shared),
            None => ticketer(&resolver.certificates_digest()),
        };
        if let Some(ticketer) = ticketer {
            config.ticketer = ticketer;
        }
        Some(Tls {
            config: Arc::new(config),
            resolver,
            handshake_timeout: cfg.handshake_timeout.0,
            files: self::files(cfg, base),
            // Every file was read (or the build failed): the digest of their contents.
            digest: loaded_digest(files),
            expiries,
        })
    }

    /// An acceptor for one new connection.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.config.clone())
    }

    /// What a handshake made with [`Tls::acceptor`] tells the request path: the client
    /// certificate's CN ([`TlsInfo::of`]) and, when there is more than one certificate,
    /// the one chosen, to tell misdirected requests ([`TlsInfo::misdirected`]).
    pub fn info(&self, conn: &rustls::ServerConnection) -> TlsInfo {
        let mut info = TlsInfo::of(conn);
        if !self.resolver.by_host.is_empty() {
            let chosen = self.resolver.pick(conn.server_name()).clone();
            info.chosen = Some((self.resolver.clone(), chosen));
        }
        info
    }

    /// Every file this config was loaded from (certificates, keys, client CA).
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// SHA-256 over the contents of [`Tls::files`] when they were loaded, hex.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// When each served certificate expires (the default first, then the SNI ones in
    /// config order); a certificate whose notAfter cannot be read is left out.
    pub fn expiries(&self) -> &[CertExpiry] {
        &self.expiries
    }
}

/// The session-ticket keys for a set of certificates (`certificates`: their
/// [`SniResolver::certificates_digest`]): rustls' ring `Ticketer`, which makes a new
/// ChaCha20-Poly1305 key every 6 hours and still takes tickets of the one before, so a
/// ticket is good for up to 12 hours. Kept for the process, not the snapshot: a reload
/// that keeps the certificates keeps the keys, so tickets issued before it still
/// resume; one that changes a certificate gets new keys, so no client resumes a session
/// of the old certificate. `None` if no key could be made (the system's random source
/// failed): then sessions resume by id only.
fn ticketer(certificates: &str) -> Option<Arc<dyn rustls::server::ProducesTickets>> {
    type Keys = Vec<(String, Arc<dyn rustls::server::ProducesTickets>)>;
    /// Certificate sets remembered (the newest last): one listener needs one or two.
    const KEPT: usize = 8;
    static TICKETERS: std::sync::Mutex<Keys> = std::sync::Mutex::new(Vec::new());
    let mut kept = TICKETERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, t)) = kept.iter().find(|(d, _)| d == certificates) {
        return Some(t.clone());
    }
    match rustls::crypto::ring::Ticketer::new() {
        Ok(t) => {
            if kept.len() >= KEPT {
                kept.remove(0);
            }
            kept.push((certificates.to_string(), t.clone()));
            Some(t)
        }
        Err(e) => {
            tracing::warn!(error = %e, "no TLS session-ticket key; sessions resume by id only");
            None
        }
    }
}

/// Every file `cfg` names, resolved against `base` (in the order of
/// [`crate::config::files::server_tls`]).
pub fn files(cfg: &TlsConfig, base: &Path) -> Vec<PathBuf> {
    crate::config::files::server_tls(cfg, base)
        .into_iter()
        .map(|n| n.path)
        .collect()
}

/// SHA-256 over the contents of `files` (an unreadable file counts as its error), hex:
/// tells whether a certificate file changed. Reads the files; a reload compares
/// [`loaded_digest`] of what the loading step read instead.
pub fn files_digest(files: &[PathBuf]) -> String {
    let read: Vec<_> = files.iter().map(std::fs::read).collect();
    contents_digest(read.iter().map(|r| r.as_deref()))
}

/// SHA-256 over files' contents (each file's length, then its bytes; an unreadable
/// file counts as its error), hex.
/// SHA-256 over the contents of the `[server.tls]` files the loading step read, in
/// their order (an unreadable file counts as its error), hex; empty without
/// `[server.tls]`. It is what [`Tls::digest`] is when they build, and what
/// [`files_digest`] reads: a reload whose config text and TLS files are both unchanged
/// has nothing to do.
pub fn loaded_digest(files: &Files) -> String {
    let mut tls = files.contents_under("server.tls.").peekable();
    if tls.peek().is_none() {
        return String::new();
    }
    contents_digest(tls)
}

fn contents_digest<'a>(
    contents: impl Iterator<Item = Result<&'a [u8], &'a std::io::Error>>,
) -> String {
    let mut h = Sha256::new();
    for c in contents {
        match c {
            Ok(bytes) => digest_file(&mut h, bytes),
            Err(e) => h.update(format!("error: {e}").as_bytes()),
        }
    }
    hex::encode(h.finalize())
}

/// One file's part of [`files_digest`]: its length, then its bytes.
fn digest_file(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

pub use crate::config::files::base_dir;

/// The PEM certificates of the file named at `at`, with its path.
fn load_certs<'f>(
    at: &str,
    files: &'f Files,
    problems: &mut Problems,
) -> Option<(&'f Path, Vec<CertificateDer<'static>>)> {
    let (path, bytes) = files.bytes(at, problems)?;
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(bytes).collect();
    match certs {
        Ok(certs) if !certs.is_empty() => Some((path, certs)),
        Ok(_) => {
            problems.error(
                at,
                format!(
                    "{}: no PEM certificate (BEGIN CERTIFICATE) found",
                    path.display()
                ),
            );
            None
        }
        Err(e) => {
            problems.error(at, format!("{}: invalid PEM: {e}", path.display()));
            None
        }
    }
}

/// A certificate chain and its key, from the files named at `{at}.cert` and `{at}.key`;
/// problems go to those keys.
fn load_pair(
    at: &str,
    provider: &CryptoProvider,
    files: &Files,
    problems: &mut Problems,
) -> Option<Arc<CertifiedKey>> {
    let (at_cert, at_key) = (format!("{at}.cert"), format!("{at}.key"));
    let chain = load_certs(&at_cert, files, problems);
    let (key, key_der) =
        files.bytes(&at_key, problems).and_then(
            |(key, bytes)| match PrivateKeyDer::from_pem_slice(bytes) {
                Ok(k) => Some((key, k)),
                Err(e) => {
                    problems.error(
                        &at_key,
                        format!("{}: no usable PEM private key: {e}", key.display()),
                    );
                    None
                }
            },
        )?;
    let (cert, chain) = chain?;
    if let Err(e) = webpki_end_entity(&chain[0]) {
        problems.error(&at_cert, format!("{}: {e}", cert.display()));
        return None;
    }
    match CertifiedKey::from_der(chain, key_der, provider) {
        Ok(k) => Some(Arc::new(k)),
        Err(e) => {
            problems.error(
                &at_key,
                format!("{}: does not fit {}: {e}", key.display(), cert.display()),
            );
            None
        }
    }
}

/// Whether the leaf parses as an X.509 certificate.
fn webpki_end_entity(leaf: &CertificateDer<'_>) -> Result<(), String> {
    rustls::server::ParsedCertificate::try_from(leaf)
        .map(|_| ())
        .map_err(|e| format!("not a valid X.509 certificate: {e}"))
}

fn client_verifier(
    auth: ClientAuth,
    provider: &Arc<CryptoProvider>,
    files: &Files,
    problems: &mut Problems,
) -> Option<Arc<dyn rustls::server::danger::ClientCertVerifier>> {
    let at = "server.tls.client_ca";
    let (ca, certs) = load_certs(at, files, problems)?;
    let roots = ca_roots(certs, ca, at, problems)?;
    let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
    let builder = match auth {
        ClientAuth::Optional => builder.allow_unauthenticated(),
        ClientAuth::Required => builder,
    };
    match builder.build() {
        Ok(v) => Some(v),
        Err(e) => {
            problems.error(at, format!("{}: {e}", ca.display()));
            None
        }
    }
}

/// A root store of the CA certificates `certs` (read from `path`); a problem at `at`
/// when one is not usable as a trust anchor.
pub(crate) fn ca_roots(
    certs: Vec<CertificateDer<'static>>,
    path: &Path,
    at: &str,
    problems: &mut Problems,
) -> Option<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs {
        if let Err(e) = roots.add(c) {
            problems.error(
                at,
                format!("{}: not a usable CA certificate: {e}", path.display()),
            );
            return None;
        }
    }
    Some(roots)
}
