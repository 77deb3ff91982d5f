//! `POST /callers/{id}/reset`: clear a caller's windows, so that support can unblock a
//! customer at once without a config change.
//!
//! The windows of a caller are found by the key scheme, as a request would find them:
//! its subject, the subject's keyed digest, and one key per limit name
//! ([`crate::limiter::key`]). An id names up to two subjects, and both are cleared:
//!
//! - always the client `ID` (subject `client:ID`): the limits that count a client by its
//!   id, `by = "caller"`, and `by = "header:NAME"` for its requests without that header;
//! - an anonymous caller, when the id is what `GET /top` and the access log show for one:
//!   the 32 hex digits of its address's keyed hash, or the address itself (with
//!   `identity.ipv6_prefix_len` applied, as requests are counted). Its windows are
//!   those of its address: `by = "caller"`, `by = "ip"` and `by = "header:NAME"` without
//!   the header.
//!
//! A client id that looks like an address or a hash clears both; the other subject
//! usually has no windows (a keyed hash names no client), and `windows_deleted` counts
//! only windows that existed. Global limits are shared by every caller and are left
//! alone, and so are concurrency limits: their slots are requests in flight, given back
//! when those requests end, not a budget to forgive.
//!
//! What is cleared, in order: the windows in the store (one `lua/reset.lua` call per
//! shard with Redis), then this gateway's over-limit cache entries and lease-mode
//! leases for them. Other gateways trust their over-limit cache entries for at most
//! [`CACHE_TRUST_MS`](super::CACHE_TRUST_MS) before asking the store again, so every
//! gateway of a fleet admits the caller within that time (well within 2 s).

use super::algorithm::Algorithm;
use super::key::SubjectDigest;
use super::limit::{client_subject, ip_subject};
use super::store::{Store, StoreError};
use super::{By, Limit, Limiter};
use std::sync::Arc;

/// What a reset did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetReport {
    /// The limits whose windows for the client were cleared (in config order).
    pub cleared: Vec<Arc<str>>,
    /// The limits left alone, each with why (`"by = \"ip\""`, ...).
    pub skipped: Vec<(Arc<str>, &'static str)>,
    /// How many windows the store held (0: the caller had none live).
    pub deleted: u64,
    /// Whether the id also named an anonymous caller (an address, or its keyed hash),
    /// whose windows were cleared too.
    pub anonymous: bool,
}

/// Why a reset did not happen.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// `?limit=NAME` names no limit of the running config.
    #[error("no limit named {0:?}")]
    UnknownLimit(String),
    /// `?limit=NAME` names a limit that does not count clients by id.
    #[error("limit {0:?} is not reset per caller: {1}")]
    NotPerCaller(String, &'static str),
    /// The store failed; some windows may have been cleared.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// Why `limit`'s windows are not a client's own (`anonymous`: an anonymous caller's,
/// i.e. its address's), or `None` when they are.
fn not_per_caller(limit: &Limit, anonymous: bool) -> Option<&'static str> {
    if limit.algorithm == Algorithm::Concurrency {
        return Some("a concurrency limit: its slots are requests in flight, freed when they end");
    }
    match limit.by {
        By::Ip if !anonymous => Some("by = \"ip\": counted per client IP, not per caller"),
        By::Global => Some("by = \"global\": one window shared by every caller"),
        By::Caller | By::Ip | By::Header(_) | By::TrustedHeader(_) => None,
    }
}

/// The digest of the anonymous caller `id` names, if any: an address (passed through
/// `ip_key`, as requests are counted) or the 32 hex digits of an address's keyed hash.
pub(super) fn anonymous_digest(
    limiter: &Limiter,
    id: &str,
    ip_key: impl Fn(std::net::IpAddr) -> std::net::IpAddr,
) -> Option<SubjectDigest> {
    if let Ok(ip) = id.parse::<std::net::IpAddr>() {
        let mut subject = Vec::with_capacity(48);
        ip_subject(ip_key(ip), &mut subject);
        return Some(limiter.keys.digest(&subject));
    }
    SubjectDigest::from_hex(id)
}

impl Limiter {
    /// Clear the windows of the caller `id` in `limits` (only the one named `only`, when
    /// given): those of the client `id`, and those of the anonymous caller `id` names
    /// when it is an address or an address's keyed hash (`ip_key` maps an address to
    /// the one requests are counted by); in the store, then in this gateway's over-limit
    /// cache and leases.
    ///
    /// Errors: [`ResetError::UnknownLimit`] and [`ResetError::NotPerCaller`] for a bad
    /// `only` (nothing is touched), [`ResetError::Store`] when the store call fails
    /// (the local cache entries are dropped anyway).
    pub async fn reset_caller(
        &self,
        limits: &[Arc<Limit>],
        id: &str,
        only: Option<&str>,
        ip_key: impl Fn(std::net::IpAddr) -> std::net::IpAddr,
    ) -> Result<ResetReport, ResetError> {
        let mut subject = Vec::with_capacity(7 + id.len());
        client_subject(id, &mut subject);
        let client = self.keys.digest(&subject);
        let anonymous = anonymous_digest(self, id, ip_key);
        // Each subject with the limits that count it.
        let subjects = [(Some(client), false), (anonymous, true)];
        let subjects = subjects
            .iter()
            .filter_map(|(d, anonymous)| d.map(|d| (d, *anonymous)));
        let why_not = |limit: &Limit| -> Option<&'static str> {
            let mut why = None;
            for (_, anonymous) in subjects.clone() {
                match not_per_caller(limit, anonymous) {
                    None => return None,
                    Some(w) => why = Some(w),
                }
            }
            why
        };
        if let Some(name) = only {
            let limit = limits
                .iter()
                .find(|l| &*l.name == name)
                .ok_or_else(|| ResetError::UnknownLimit(name.to_string()))?;
            if let Some(why) = why_not(limit) {
                return Err(ResetError::NotPerCaller(name.to_string(), why));
            }
        }
        let mut report = ResetReport {
            cleared: Vec::new(),
            skipped: Vec::new(),
            deleted: 0,
            anonymous: anonymous.is_some(),
        };
        let mut keys = Vec::new();
        for limit in limits.iter().filter(|l| only.is_none_or(|n| *l.name == *n)) {
            match why_not(limit) {
                Some(why) => report.skipped.push((limit.name.clone(), why)),
                None => {
                    for (digest, anonymous) in subjects.clone() {
                        if not_per_caller(limit, anonymous).is_none() {
                            keys.push(self.keys.key_for(&limit.key_name, &digest));
                        }
                    }
                    report.cleared.push(limit.name.clone());
                }
            }
        }
        if keys.is_empty() {
            return Ok(report);
        }
        let deleted = self.store.reset(&keys).await;
        for key in &keys {
            self.cache.forget(key);
            self.recent.forget(key);
            self.leases.forget(key);
        }
        report.deleted = deleted?;
        Ok(report)
    }
}
