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

mod answer;
mod auth_cache;
mod auth_conn;
pub mod auth_request;
mod build;
mod client;
mod client_ip;
mod error;
pub mod jwt;
pub mod keys;
mod records;

pub use build::read_keys;
pub use client::{Caller, Client};
pub use client_ip::{client_ip, network};
pub use error::{IdentityError, KeysReload};
pub use jwt::{JwtCaller, JwtVerifier};

use arc_swap::ArcSwap;
use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;
use keys::{KeyErrors, KeySet, KeySource};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

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

    /// `identity.anonymous_tier`: the tier of callers who present no key.
    pub fn anonymous_tier(&self) -> &Arc<str> {
        &self.anonymous_tier
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

/// The time now, epoch seconds (for `expires_at`).
fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests;
