//! `POST /callers/{id}/reset`: clear a client's windows, so that support can unblock a
//! customer at once without a config change.
//!
//! The windows of a client are found by the key scheme, as a request would find them:
//! the subject `client:ID`, its keyed digest, and one key per limit name
//! ([`crate::limiter::key`]). Only limits that count a client by its id are reset:
//! `by = "caller"`, and `by = "header:NAME"` for its requests without that header (both
//! count `client:ID`). Limits by IP or global ones are shared with other callers and are
//! left alone, and so are concurrency limits: their slots are requests in flight, given
//! back when those requests end, not a budget to forgive.
//!
//! What is cleared, in order: the windows in the store (one `lua/reset.lua` call per
//! shard with Redis), then this gateway's over-limit cache entries and lease-mode
//! leases for them. Other gateways trust their over-limit cache entries for at most
//! [`CACHE_TRUST_MS`](super::CACHE_TRUST_MS) before asking the store again, so every
//! gateway of a fleet admits the caller within that time (well within 2 s).

use super::algorithm::Algorithm;
use super::limit::client_subject;
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
    /// How many windows the store held (0: the client had none live).
    pub deleted: u64,
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

/// Why `limit`'s windows are not a client's own, or `None` when they are.
fn not_per_caller(limit: &Limit) -> Option<&'static str> {
    if limit.algorithm == Algorithm::Concurrency {
        return Some("a concurrency limit: its slots are requests in flight, freed when they end");
    }
    match limit.by {
        By::Ip => Some("by = \"ip\": counted per client IP, not per caller"),
        By::Global => Some("by = \"global\": one window shared by every caller"),
        By::Caller | By::Header(_) | By::TrustedHeader(_) => None,
    }
}

impl Limiter {
    /// Clear the windows of the client `id` in `limits` (only the one named `only`, when
    /// given): in the store, then in this gateway's over-limit cache and leases.
    ///
    /// Errors: [`ResetError::UnknownLimit`] and [`ResetError::NotPerCaller`] for a bad
    /// `only` (nothing is touched), [`ResetError::Store`] when the store call fails
    /// (the local cache entries are dropped anyway).
    pub async fn reset_client(
        &self,
        limits: &[Arc<Limit>],
        id: &str,
        only: Option<&str>,
    ) -> Result<ResetReport, ResetError> {
        if let Some(name) = only {
            let limit = limits
                .iter()
                .find(|l| &*l.name == name)
                .ok_or_else(|| ResetError::UnknownLimit(name.to_string()))?;
            if let Some(why) = not_per_caller(limit) {
                return Err(ResetError::NotPerCaller(name.to_string(), why));
            }
        }
        let mut subject = Vec::with_capacity(7 + id.len());
        client_subject(id, &mut subject);
        let digest = self.keys.digest(&subject);
        let mut report = ResetReport {
            cleared: Vec::new(),
            skipped: Vec::new(),
            deleted: 0,
        };
        let mut keys = Vec::new();
        for limit in limits.iter().filter(|l| only.is_none_or(|n| *l.name == *n)) {
            match not_per_caller(limit) {
                Some(why) => report.skipped.push((limit.name.clone(), why)),
                None => {
                    keys.push(self.keys.key_for(&limit.key_name, &digest));
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
