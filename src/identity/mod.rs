//! Step 1 of the request path: who is calling.
//!
//! An API key (in `identity.api_key_header`) maps to a client id and tier; no key means
//! an anonymous caller known by client IP; a key that matches no client is a 401. With
//! `identity.client_cert_subject_as_caller`, a request without a key on a TLS connection
//! whose verified client certificate's CN is a client id is that client.
//! `[identity.jwt]`, a bearer token shaped like a JWT is verified instead ([`jwt`]) and
//! names the caller by a claim; a JWT caller and an API-key client with the same id are
//! the same caller for every limit.
//!
//! Before forwarding, [`Identities::to_upstream`] tells the upstream who called
//! (`forward_caller_header`, `forward_tier_header`) and may strip the credential.

mod auth_cache;
pub mod auth_request;
mod client_ip;
pub mod jwt;
pub mod keys;
mod records;

pub use client_ip::{client_ip, network};
pub use jwt::{JwtCaller, JwtVerifier};

use crate::config::{Config, IdentityConfig, Problems};
use arc_swap::ArcSwap;
use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;
use keys::{KeyErrors, KeyProblem, KeySet, KeySource};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

/// A known API client (all its keys share it, and so share its windows).
#[derive(Debug, Clone)]
pub struct Client {
    /// Caller id (from config, the keys file, or a JWT claim).
    pub id: Arc<str>,
    /// Tier, which selects the quota of each limit.
    pub tier: Arc<str>,
    /// Per-client quotas by limit name (cost units per window), which win over the
    /// tier's quota (`"quotas"` in the keys file).
    quotas: Option<Box<keys::Quotas>>,
    /// Every key of a disabled client is refused (401).
    disabled: bool,
}

impl Client {
    /// A client with no quota overrides (JWT callers).
    pub fn new(id: Arc<str>, tier: Arc<str>) -> Self {
        Self {
            id,
            tier,
            quotas: None,
            disabled: false,
        }
    }

    /// This client's own quota for the limit `name` (cost units per window), if it has
    /// one; otherwise its tier's applies.
    pub fn quota_for(&self, name: &str) -> Option<u64> {
        self.quotas
            .as_deref()?
            .iter()
            .find(|(n, _)| &**n == name)
            .map(|(_, q)| *q)
    }

    /// Whether limits count this client and `other` alike: the same id and tier, and
    /// neither with quotas of its own (which a disabled client never reaches).
    pub fn limits_alike(&self, other: &Client) -> bool {
        self.quotas.is_none()
            && other.quotas.is_none()
            && self.id == other.id
            && self.tier == other.tier
    }
}

/// The caller of one request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The client, when a valid API key was presented; `None` for anonymous callers.
    pub client: Option<Arc<Client>>,
    /// Tier for quota lookups: the client's, or `identity.anonymous_tier`.
    pub tier: Arc<str>,
    /// Client IP: the socket peer, or the right-most untrusted `X-Forwarded-For` hop when
    /// the peer is a trusted proxy. Logged and forwarded as it is.
    pub ip: IpAddr,
    /// What per-IP limits count for this caller: `ip`'s network of
    /// `identity.ipv6_prefix_len` bits for IPv6, `ip` itself for IPv4 (see
    /// [`Identities::ip_key`]).
    pub ip_key: IpAddr,
    /// Whether the socket peer is one of `identity.trusted_proxies` (limits with
    /// `trusted_only = true` believe its headers).
    pub peer_trusted: bool,
    /// The label of the key presented (`"label"` in the keys file), for logs and
    /// `/top`; never the key.
    pub key_label: Option<Arc<str>>,
}

impl Caller {
    /// The id to show in logs and messages: the client id, else the client IP.
    pub fn label(&self) -> String {
        match &self.client {
            Some(c) => c.id.to_string(),
            None => self.ip.to_string(),
        }
    }
}

/// Why a caller could not be identified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// An API key was presented but matches no client (HTTP 401).
    #[error("Bad credentials")]
    BadCredentials,
    /// A JWT was presented and failed verification (HTTP 401); the reason, e.g.
    /// `expired`.
    #[error("invalid token: {0}")]
    InvalidToken(String),
    /// The credential header is not exactly one credential: sent twice, several
    /// credentials in one value, or a key scheme without a key (HTTP 400). What the
    /// gateway cannot identify unambiguously, it must not forward either.
    #[error("malformed credentials: {0}")]
    Malformed(&'static str),
    /// `[identity.auth_request]` answered 401 or 403: passed to the client as it is.
    #[error("refused by the auth service")]
    Refused {
        /// 401 or 403.
        status: u16,
        /// The answer's `Content-Type`.
        content_type: Option<HeaderValue>,
        /// The answer's body (at most 64 KB).
        body: bytes::Bytes,
    },
    /// `[identity.auth_request]` failed (why: `error`, `timeout`, `breaker_open`) and
    /// its `on_error = "deny"` (HTTP 503).
    #[error("authentication service unavailable")]
    AuthUnavailable(&'static str),
    /// A callout to `[identity.auth_request]` was needed and none was made:
    /// `identity.auth_request.max_concurrent` are under way (HTTP 503), or
    /// `max_concurrent_per_ip` for the request's client address (`per_address`: HTTP 429).
    #[error("too many auth callouts under way")]
    AuthBusy {
        /// Whether the client address's own bound was the one reached.
        per_address: bool,
    },
    /// `[identity.auth_request]` answered another 4xx (the status): it could not judge
    /// this request, e.g. 431 for a long `X-Original-URI`. This request only gets a 4xx.
    #[error("the authentication service could not judge this request ({0})")]
    AuthRejected(u16),
    /// What a callout would send is larger than its bound, so none is made: the URI
    /// (414) or the credential and forwarded headers (431).
    #[error("{0:?}")]
    TooLargeToAsk(auth_request::Oversize),
}

/// What a reload of the keys file did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeysReload {
    /// The new set is in use.
    Applied {
        /// Clients (distinct ids) of the new set.
        clients: usize,
        /// Keys of the new set.
        keys: usize,
    },
    /// The new set would remove too many keys: the running set stays until SIGHUP.
    Held {
        /// Keys in use that the new set does not have.
        removed: usize,
        /// Keys in use.
        running: usize,
        /// Keys of the new set.
        keys: usize,
    },
}

/// The identity part of a config snapshot.
#[derive(Debug)]
pub struct Identities {
    header: HeaderName,
    scheme_prefixed: bool,
    /// `[identity.auth_request]`, when configured.
    auth_request: Option<Arc<auth_request::AuthRequest>>,
    /// Every API key: swapped as a whole when the keys file is reloaded.
    keys: Arc<ArcSwap<KeySet>>,
    /// What `keys` is built from.
    key_source: Arc<KeySource>,
    trusted_proxies: Vec<IpNet>,
    /// `identity.ipv6_prefix_len` (1 to 128).
    ipv6_prefix_len: u8,
    anonymous_tier: Arc<str>,
    jwt: Option<JwtVerifier>,
    forward_caller: Option<HeaderName>,
    forward_tier: Option<HeaderName>,
    strip_credentials: bool,
}

impl Identities {
    /// Build from `[identity]`, recording problems under `identity.*`; key files of
    /// `[identity.jwt]` are relative to the working directory.
    pub fn build(cfg: &IdentityConfig, problems: &mut Problems) -> Self {
        Self::build_in(cfg, Path::new("."), problems)
    }

    /// Build from `[identity]`, recording problems under `identity.*`; key files of
    /// `[identity.jwt]` and `identity.clients_file` are read now, relative to `base_dir`
    /// (the config file's directory). Tier and limit names in the keys file are not
    /// checked (see [`Identities::build_for`]).
    pub fn build_in(cfg: &IdentityConfig, base_dir: &Path, problems: &mut Problems) -> Self {
        let source = KeySource::of_identity(cfg, base_dir);
        Self::build_with(cfg, base_dir, source, None, problems)
    }

    /// Build the identity part of a whole config: the keys file's tiers and quota
    /// overrides are checked against its limits. When `previous` was built from the same
    /// keys (inline list, keys file path and the names they are checked against), its
    /// key set is kept, and so is the cell the keys file's reloads swap.
    pub fn build_for(
        cfg: &Config,
        base_dir: &Path,
        previous: Option<&Identities>,
        problems: &mut Problems,
    ) -> Self {
        let source = KeySource::of_config(cfg, base_dir);
        Self::build_with(&cfg.identity, base_dir, source, previous, problems)
    }

    fn build_with(
        cfg: &IdentityConfig,
        base_dir: &Path,
        source: KeySource,
        previous: Option<&Identities>,
        problems: &mut Problems,
    ) -> Self {
        let header =
            match HeaderName::from_bytes(cfg.api_key_header.to_ascii_lowercase().as_bytes()) {
                Ok(h) => h,
                Err(_) => {
                    problems.error(
                        "identity.api_key_header",
                        format!("{:?} is not a valid header name", cfg.api_key_header),
                    );
                    http::header::AUTHORIZATION
                }
            };
        let scheme_prefixed = header == http::header::AUTHORIZATION;
        if cfg.anonymous_tier.trim().is_empty() {
            problems.error("identity.anonymous_tier", "must not be empty");
        }

        let mut trusted_proxies = Vec::new();
        for (i, cidr) in cfg.trusted_proxies.iter().enumerate() {
            match parse_cidr(cidr) {
                Some(net) => trusted_proxies.push(net),
                None => problems.error(
                    format!("identity.trusted_proxies[{i}]"),
                    format!("{cidr:?} is not a CIDR (e.g. \"10.0.0.0/8\") or an IP address"),
                ),
            }
        }

        if !(1..=128).contains(&cfg.ipv6_prefix_len) {
            problems.error(
                "identity.ipv6_prefix_len",
                format!(
                    "{} is not a prefix length: must be between 1 and 128 (64 keys a subscriber's /64; 128 keys each address, for callers inside a cluster or a LAN)",
                    cfg.ipv6_prefix_len
                ),
            );
        }
        let ipv6_prefix_len = cfg.ipv6_prefix_len.clamp(1, 128) as u8;
        if cfg.clients_file_max_removed_percent > 100 {
            problems.error(
                "identity.clients_file_max_removed_percent",
                format!(
                    "{} is not a percentage: must be between 0 and 100",
                    cfg.clients_file_max_removed_percent
                ),
            );
        }

        let kept = previous.filter(|p| *p.key_source == source);
        let keys = match kept {
            Some(p) => p.keys.clone(),
            None => match source.build(previous.map(|p| p.keys.load_full()).as_deref()) {
                Ok(set) => Arc::new(ArcSwap::from_pointee(set)),
                Err(errors) => {
                    record_key_errors(&errors, problems);
                    Arc::new(ArcSwap::from_pointee(KeySet::failed(&source)))
                }
            },
        };
        if cfg
            .clients_file
            .as_ref()
            .is_some_and(|f| f.trim().is_empty())
        {
            problems.error(
                "identity.clients_file",
                "must not be empty (leave it out for none)",
            );
        }

        let jwt = cfg
            .jwt
            .as_ref()
            .and_then(|j| JwtVerifier::build(j, base_dir, problems));
        let forward_caller = upstream_header(
            "identity.forward_caller_header",
            cfg.forward_caller_header.as_deref(),
            &header,
            problems,
        );
        let forward_tier = upstream_header(
            "identity.forward_tier_header",
            cfg.forward_tier_header.as_deref(),
            &header,
            problems,
        );
        if forward_caller.is_some() && forward_caller == forward_tier {
            problems.error(
                "identity.forward_tier_header",
                "must differ from identity.forward_caller_header",
            );
        }

        let mut identities = Self {
            auth_request: None,
            header,
            scheme_prefixed,
            keys,
            key_source: Arc::new(source),
            trusted_proxies,
            ipv6_prefix_len,
            anonymous_tier: cfg.anonymous_tier.as_str().into(),
            jwt,
            forward_caller,
            forward_tier,
            strip_credentials: cfg.strip_credentials,
        };
        let tiers = identities.tiers();
        if let Some(jwt) = &mut identities.jwt {
            jwt.known_tiers = tiers.clone();
        }
        if let Some(a) = &cfg.auth_request {
            let mut tiers = tiers;
            let source = &identities.key_source;
            tiers.extend(source.tiers.iter().flatten().map(|t| Arc::from(t.as_str())));
            let limits: Vec<String> = source.limits.iter().flatten().cloned().collect();
            identities.auth_request = auth_request::AuthRequest::build(
                a,
                &identities.header,
                tiers,
                &limits,
                previous.and_then(|p| p.auth_request.as_ref()),
                problems,
            );
        }
        identities
    }

    /// Every tier a caller can have: the anonymous tier, each client's tier, and the
    /// tiers `[identity.jwt]` declares (`default_tier`, `tiers`).
    pub fn tiers(&self) -> BTreeSet<Arc<str>> {
        let mut t: BTreeSet<Arc<str>> = self.keys.load().tiers().clone();
        t.insert(self.anonymous_tier.clone());
        if let Some(jwt) = &self.jwt {
            t.extend(jwt.declared_tiers.iter().cloned());
        }
        if let Some(a) = &self.auth_request {
            t.insert(a.default_tier());
        }
        t
    }

    /// The key set in use now (it changes when the keys file is reloaded).
    pub fn keys(&self) -> arc_swap::Guard<Arc<KeySet>> {
        self.keys.load()
    }

    /// The keys file (resolved), if any.
    pub fn clients_file(&self) -> Option<&Path> {
        self.key_source.file.as_deref()
    }

    /// Whether `other` shares this one's key set cell (a reload kept the keys).
    pub fn shares_keys(&self, other: &Identities) -> bool {
        Arc::ptr_eq(&self.keys, &other.keys)
    }

    /// Read the keys file again and swap the new set in, for this snapshot and every
    /// later one that kept its keys; requests in flight finish with the set they
    /// started with. Returns the numbers of clients and keys.
    ///
    /// Errors: every problem of the file ([`KeyErrors::lines`]); the running set
    /// stays.
    ///
    /// With `max_removed_percent` (a watcher's reload), a new set that [`keys::held`]
    /// holds is not swapped in: [`KeysReload::Held`].
    pub fn reload_keys(&self, max_removed_percent: Option<u32>) -> Result<KeysReload, KeyErrors> {
        let running = self.keys.load_full();
        let set = self.key_source.build(Some(&running))?;
        if let Some(removed) = max_removed_percent.and_then(|p| keys::held(&running, &set, p)) {
            return Ok(KeysReload::Held {
                removed,
                running: running.keys(),
                keys: set.keys(),
            });
        }
        drop(running);
        let counts = KeysReload::Applied {
            clients: set.clients(),
            keys: set.keys(),
        };
        self.keys.store(Arc::new(set));
        Ok(counts)
    }

    /// For a request whose credential no local key matches (it got
    /// [`IdentityError::BadCredentials`]), ask `[identity.auth_request]`: `None` when
    /// there is none, the request has no key, or the key is a local one (disabled or
    /// expired keys stay refused). The answer: the caller it names; its 401/403
    /// ([`IdentityError::Refused`]); its other 4xx ([`IdentityError::AuthRejected`]);
    /// or, when the service fails, what `on_error` says
    /// ([`IdentityError::AuthUnavailable`] or an anonymous caller). A request whose URI
    /// or headers would make too large a callout gets [`IdentityError::TooLargeToAsk`]
    /// without one; past `max_concurrent` or `max_concurrent_per_ip` (keyed by the client
    /// IP, as `failed_auth_limit`), [`IdentityError::AuthBusy`] without a callout.
    /// Sockets to the service are counted in `budget`.
    pub async fn ask_auth_service(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        method: &http::Method,
        uri: &http::Uri,
        budget: &crate::budget::Budget,
        metrics: &crate::metrics::Metrics,
    ) -> Option<Result<Caller, IdentityError>> {
        let auth = self.auth_request.as_ref()?;
        let key = self.presented_key(headers).ok()??;
        let digest: [u8; 32] = Sha256::digest(key).into();
        if self.keys.load().find(&digest, || 0).is_some() {
            return None;
        }
        if let Err(oversize) = auth.fits(headers, uri) {
            return Some(Err(IdentityError::TooLargeToAsk(oversize)));
        }
        let ip = client_ip(headers, peer, &self.trusted_proxies);
        let answer = auth
            .ask(
                auth.cache_key(headers),
                headers,
                method,
                uri,
                (self.ip_key(ip), budget),
                metrics,
            )
            .await;
        let caller = |client: Option<Arc<Client>>| Caller {
            tier: client
                .as_ref()
                .map_or_else(|| self.anonymous_tier.clone(), |c| c.tier.clone()),
            client,
            ip,
            ip_key: self.ip_key(ip),
            peer_trusted: self.trusts(peer),
            key_label: None,
        };
        Some(match answer {
            auth_request::Answer::Caller(client) => Ok(caller(Some(client))),
            auth_request::Answer::Refused {
                status,
                content_type,
                body,
            } => Err(IdentityError::Refused {
                status,
                content_type,
                body,
            }),
            auth_request::Answer::Busy { per_address } => {
                Err(IdentityError::AuthBusy { per_address })
            }
            auth_request::Answer::Rejected(status) => Err(IdentityError::AuthRejected(status)),
            auth_request::Answer::Failed(why) => match auth.on_error() {
                crate::config::AuthOnError::Deny => Err(IdentityError::AuthUnavailable(why)),
                crate::config::AuthOnError::Anonymous => Ok(caller(None)),
            },
        })
    }

    /// Tell the upstream who called, just before forwarding: remove any
    /// `forward_caller_header` / `forward_tier_header` the client sent, then set them to
    /// the caller's id and tier (identified callers only); with `strip_credentials`,
    /// remove the credential header the caller was identified by.
    pub fn to_upstream(&self, caller: &Caller, headers: &mut HeaderMap) {
        for name in [&self.forward_caller, &self.forward_tier]
            .into_iter()
            .flatten()
        {
            headers.remove(name);
            unlist_from_connection(headers, name);
        }
        let Some(client) = &caller.client else {
            return;
        };
        if let Some(name) = &self.forward_caller {
            if let Ok(v) = HeaderValue::from_str(&client.id) {
                headers.insert(name.clone(), v);
            }
        }
        if let Some(name) = &self.forward_tier {
            if let Ok(v) = HeaderValue::from_str(&client.tier) {
                headers.insert(name.clone(), v);
            }
        }
        if self.strip_credentials {
            headers.remove(&self.header);
        }
    }

    /// Whether `ip` is a trusted proxy (its `X-Forwarded-*` headers are believed).
    pub fn trusts(&self, ip: IpAddr) -> bool {
        client_ip::is_trusted(client_ip::canonical(ip), &self.trusted_proxies)
    }

    /// The client IP of a request: the socket peer, or the right-most untrusted
    /// `X-Forwarded-For` hop when the peer is a trusted proxy.
    pub fn client_ip(&self, headers: &HeaderMap, peer: IpAddr) -> IpAddr {
        client_ip(headers, peer, &self.trusted_proxies)
    }

    /// The address that keys `ip` in every per-IP count (anonymous callers, `by = "ip"`
    /// limits, `identity.failed_auth_limit`, the access log's client hash,
    /// `server.max_connections_per_ip`): for IPv6, its network of
    /// `identity.ipv6_prefix_len` bits (one subscriber usually holds a whole /64, so
    /// rotating addresses inside it is one caller); an IPv4 address (or an IPv4-mapped
    /// IPv6 one) is itself.
    pub fn ip_key(&self, ip: IpAddr) -> IpAddr {
        client_ip::network(ip, self.ipv6_prefix_len)
    }

    /// Identify the caller of a request from its headers and socket peer.
    ///
    /// Errors: [`IdentityError::BadCredentials`] when a key is presented and unknown;
    /// [`IdentityError::InvalidToken`] when a JWT is presented and fails verification.
    pub fn identify(&self, headers: &HeaderMap, peer: IpAddr) -> Result<Caller, IdentityError> {
        self.identify_with_cert(headers, peer, None)
    }

    /// [`Identities::identify`], for a request on a connection whose verified client
    /// certificate has the subject common name `cert_cn`: without an API key, a CN that
    /// is a client's id (with `identity.client_cert_subject_as_caller`) is that client;
    /// any other CN leaves the caller anonymous. An API key, when presented, wins.
    ///
    /// Errors: [`IdentityError::BadCredentials`] when a key is presented and unknown.
    pub fn identify_with_cert(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        cert_cn: Option<&str>,
    ) -> Result<Caller, IdentityError> {
        let ip = client_ip(headers, peer, &self.trusted_proxies);
        let ip_key = self.ip_key(ip);
        let peer_trusted = self.trusts(peer);
        match self.presented_key(headers)? {
            None => match cert_cn.and_then(|cn| self.keys.load().by_id(cn).cloned()) {
                Some(client) if !client.disabled => Ok(Caller {
                    tier: client.tier.clone(),
                    client: Some(client),
                    ip,
                    ip_key,
                    peer_trusted,
                    key_label: None,
                }),
                _ => Ok(Caller {
                    client: None,
                    tier: self.anonymous_tier.clone(),
                    ip,
                    ip_key,
                    peer_trusted,
                    key_label: None,
                }),
            },
            Some(token) if self.jwt.is_some() && jwt::looks_like_jwt(token) => {
                let verifier = self.jwt.as_ref().ok_or(IdentityError::BadCredentials)?;
                let found = verifier
                    .verify(token)
                    .map_err(IdentityError::InvalidToken)?;
                Ok(Caller {
                    tier: found.tier.clone(),
                    client: Some(Arc::new(Client::new(found.id.into(), found.tier))),
                    ip,
                    ip_key,
                    peer_trusted,
                    key_label: None,
                })
            }
            Some(key) => {
                let (client, key_label) = self.lookup(key).ok_or(IdentityError::BadCredentials)?;
                Ok(Caller {
                    tier: client.tier.clone(),
                    client: Some(client),
                    ip,
                    ip_key,
                    peer_trusted,
                    key_label,
                })
            }
        }
    }

    /// Whether the request presents a credential in `identity.api_key_header`: an API
    /// key or token, or a malformed attempt at one (not another scheme, such as
    /// `Basic ...`).
    pub fn presents_credential(&self, headers: &HeaderMap) -> bool {
        !matches!(self.presented_key(headers), Ok(None))
    }

    /// The key (or token) in the credential header: `None` when there is none, or the
    /// `Authorization` scheme is not one of ours (`Basic ...` is passed on untouched).
    ///
    /// Errors: [`IdentityError::Malformed`] when the header is sent more than once, holds
    /// more than one credential (a comma), or names `Bearer`/`token` with more than one
    /// word after it; [`IdentityError::BadCredentials`] for `Bearer` with no key.
    fn presented_key<'a>(&self, headers: &'a HeaderMap) -> Result<Option<&'a [u8]>, IdentityError> {
        let mut values = headers.get_all(&self.header).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(IdentityError::Malformed(
                "the credential header is sent more than once",
            ));
        }
        let value = first.as_bytes().trim_ascii();
        if value.contains(&b',') {
            return Err(IdentityError::Malformed("one credential per header"));
        }
        let one_token = |t: &[u8]| !t.is_empty() && !t.iter().any(u8::is_ascii_whitespace);
        if !self.scheme_prefixed {
            return if one_token(value) {
                Ok(Some(value))
            } else {
                Err(IdentityError::Malformed("the key header must hold one key"))
            };
        }
        let split = value
            .iter()
            .position(|b| *b == b' ' || *b == b'\t')
            .unwrap_or(value.len());
        let (scheme, rest) = value.split_at(split);
        if !(scheme.eq_ignore_ascii_case(b"bearer") || scheme.eq_ignore_ascii_case(b"token")) {
            return Ok(None);
        }
        let key = rest.trim_ascii();
        if key.is_empty() {
            // No key at all is a wrong key (401), as before.
            return Err(IdentityError::BadCredentials);
        }
        if one_token(key) {
            Ok(Some(key))
        } else {
            Err(IdentityError::Malformed(
                "Bearer needs exactly one key after it",
            ))
        }
    }

    /// Find the client (and the key's label) whose `key_sha256` is the SHA-256 of
    /// `key`, when the key is usable now: its client is not disabled and it has not
    /// expired.
    ///
    /// The digest selects a candidate through a hash table; the final comparison of the
    /// full 32 bytes is constant-time (`subtle`). Timing can reveal nothing about the raw
    /// key: an attacker controls only the key, not its digest.
    fn lookup(&self, key: &[u8]) -> Option<(Arc<Client>, Option<Arc<str>>)> {
        if key.is_empty() {
            return None;
        }
        let digest: [u8; 32] = Sha256::digest(key).into();
        let keys = self.keys.load();
        let found = keys.find(&digest, now_s)?;
        found
            .active
            .then(|| (found.client.clone(), found.label.cloned()))
    }
}

/// Remove `name` from the `Connection` header's list, so that a client cannot make the
/// forwarder drop a header the gateway sets (headers listed in `Connection` are
/// hop-by-hop and never forwarded).
fn unlist_from_connection(headers: &mut HeaderMap, name: &HeaderName) {
    let is_name = |t: &[u8]| t.eq_ignore_ascii_case(name.as_str().as_bytes());
    let tokens = |headers: &HeaderMap| -> Vec<Vec<u8>> {
        headers
            .get_all(http::header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            .filter(|t| !t.is_empty())
            .map(<[u8]>::to_vec)
            .collect()
    };
    let all = tokens(headers);
    if !all.iter().any(|t| is_name(t)) {
        return;
    }
    let kept: Vec<Vec<u8>> = all.into_iter().filter(|t| !is_name(t)).collect();
    headers.remove(http::header::CONNECTION);
    if kept.is_empty() {
        return;
    }
    if let Ok(v) = HeaderValue::from_bytes(&kept.join(&b", "[..])) {
        headers.insert(http::header::CONNECTION, v);
    }
}

/// Validate a `forward_*_header` name: a valid header name that is not hop-by-hop,
/// `host`, framing, or the credential header itself.
fn upstream_header(
    key: &str,
    name: Option<&str>,
    credential: &HeaderName,
    problems: &mut Problems,
) -> Option<HeaderName> {
    let name = name?;
    let Ok(h) = HeaderName::from_bytes(name.trim().to_ascii_lowercase().as_bytes()) else {
        problems.error(
            key,
            format!("{name:?} is not a valid header name (e.g. \"x-consumer-id\")"),
        );
        return None;
    };
    let reserved = [
        "host",
        "content-length",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
    ];
    if crate::http::always_hop_by_hop(&h) || reserved.contains(&h.as_str()) || h == *credential {
        problems.error(
            key,
            format!("{name:?} is a header the gateway manages otherwise; pick another name, e.g. \"x-consumer-id\""),
        );
        return None;
    }
    Some(h)
}

/// Record the problems of the keys in a config report: inline entries at their key
/// path, lines of the keys file as `PATH:LINE: what is wrong` at
/// `identity.clients_file`.
fn record_key_errors(errors: &KeyErrors, problems: &mut Problems) {
    for p in &errors.problems {
        match p {
            KeyProblem::Config { path, message } => problems.error(path.clone(), message.clone()),
            KeyProblem::File { line, message } => {
                problems.error("identity.clients_file", errors.file_line(*line, message))
            }
        }
    }
    if let Some(more) = errors.more_line() {
        problems.error("identity.clients_file", more);
    }
}

/// The time now, epoch seconds (for `expires_at`).
fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn parse_cidr(s: &str) -> Option<IpNet> {
    let s = s.trim();
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::from))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClientConfig;

    fn ids() -> Identities {
        let cfg = IdentityConfig {
            clients: vec![ClientConfig {
                id: "acme".into(),
                key_sha256: hex::encode(Sha256::digest(b"sekrit")).into(),
                tier: "gold".into(),
            }],
            ..Default::default()
        };
        let mut p = Problems::default();
        let ids = Identities::build(&cfg, &mut p);
        assert!(p.is_ok());
        ids
    }

    fn headers(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("authorization", auth.parse().unwrap());
        h
    }

    #[test]
    fn bearer_and_token_schemes_find_the_client() {
        let ids = ids();
        let peer: IpAddr = "10.1.2.3".parse().unwrap();
        for v in ["Bearer sekrit", "token sekrit", "bearer  sekrit "] {
            let c = ids.identify(&headers(v), peer).unwrap();
            assert_eq!(c.label(), "acme");
            assert_eq!(&*c.tier, "gold");
        }
    }

    #[test]
    fn unknown_key_is_bad_credentials_and_no_key_is_anonymous() {
        let ids = ids();
        let peer: IpAddr = "10.1.2.3".parse().unwrap();
        assert_eq!(
            ids.identify(&headers("Bearer nope"), peer).unwrap_err(),
            IdentityError::BadCredentials
        );
        assert_eq!(
            ids.identify(&headers("Bearer "), peer).unwrap_err(),
            IdentityError::BadCredentials
        );
        let anon = ids.identify(&HeaderMap::new(), peer).unwrap();
        assert_eq!(anon.label(), "10.1.2.3");
        assert_eq!(&*anon.tier, "anonymous");
        let basic = ids.identify(&headers("Basic dXNlcjpwYXNz"), peer).unwrap();
        assert!(basic.client.is_none());
    }

    #[test]
    fn a_client_certificate_cn_names_the_client_only_when_enabled() {
        let peer: IpAddr = "10.1.2.3".parse().unwrap();
        // Off (the default): the CN is ignored.
        let c = ids()
            .identify_with_cert(&HeaderMap::new(), peer, Some("acme"))
            .unwrap();
        assert!(c.client.is_none());

        let cfg = IdentityConfig {
            client_cert_subject_as_caller: true,
            clients: vec![ClientConfig {
                id: "acme".into(),
                key_sha256: hex::encode(Sha256::digest(b"sekrit")).into(),
                tier: "gold".into(),
            }],
            ..Default::default()
        };
        let ids = Identities::build(&cfg, &mut Problems::default());
        let c = ids
            .identify_with_cert(&HeaderMap::new(), peer, Some("acme"))
            .unwrap();
        assert_eq!((c.label().as_str(), &*c.tier), ("acme", "gold"));
        let c = ids
            .identify_with_cert(&HeaderMap::new(), peer, Some("ACME"))
            .unwrap();
        assert!(c.client.is_none(), "ids are matched exactly");
        // A key decides, even an unknown one.
        assert_eq!(
            ids.identify_with_cert(&headers("Bearer nope"), peer, Some("acme"))
                .unwrap_err(),
            IdentityError::BadCredentials
        );
    }

    #[test]
    fn bad_entries_are_reported() {
        let cfg = IdentityConfig {
            trusted_proxies: vec!["10.0.0.0/33".into()],
            clients: vec![ClientConfig {
                id: "a".into(),
                key_sha256: String::from("xyz").into(),
                tier: "t".into(),
            }],
            ..Default::default()
        };
        let mut p = Problems::default();
        Identities::build(&cfg, &mut p);
        let paths: Vec<_> = p.errors.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "identity.trusted_proxies[0]",
                "identity.clients[0].key_sha256"
            ]
        );
    }
}
