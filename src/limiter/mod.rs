//! Steps 3 and 5 of the request path: CHECK the limits of a route before forwarding,
//! CHARGE them after the response.
//!
//! The algorithm is the fixed window of GitHub's API limiter ("How we scaled the GitHub
//! API with a sharded, replicated rate limiter in Redis", 2021): a window starts at the
//! caller's first charge and ends at a stored `reset_at`. A rejection (429) is built from
//! the very CHECK that found the caller over the limit, never from a second store call.

pub mod cache;
pub mod key;
pub mod lease;
pub mod sharded;
pub mod store;

use crate::config::{LimitConfig, OnError, Problems};
use crate::identity::Caller;
use cache::OverLimitCache;
use http::{HeaderMap, HeaderName};
use key::{KeyScheme, LimitKey, SubjectDigest};
use lease::{Ask, LeaseTable, Take};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use store::{AnyStore, Charge, Store, StoreError, WindowState};

/// What a limit's windows count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum By {
    /// The client id for callers with a key, else the client IP.
    Caller,
    /// The client IP, key or no key.
    Ip,
    /// One window shared by every caller.
    Global,
    /// The value of a request header; callers without it count as `Caller`.
    Header(HeaderName),
}

/// A `[[limits]]` entry, ready to use.
#[derive(Debug)]
pub struct Limit {
    /// Name, reported as `X-RateLimit-Resource`.
    pub name: Arc<str>,
    /// Window length in milliseconds.
    pub window_ms: u64,
    /// Quota (cost units per window) by tier; a tier absent here is not limited by this limit.
    pub quota: HashMap<Arc<str>, u64>,
    /// What the windows count.
    pub by: By,
    /// Lease mode: units taken from the store at a time and admitted locally (0: off,
    /// every request is checked and charged in the store).
    pub lease: u64,
}

impl Limit {
    /// Build from config, recording problems under `limits[index]`. `tiers` are the tiers
    /// a caller can have (quota keys must name one of them).
    pub fn build(
        index: usize,
        cfg: &LimitConfig,
        tiers: &BTreeSet<Arc<str>>,
        problems: &mut Problems,
    ) -> Option<Self> {
        let at = format!("limits[{index}]");
        let before = problems.errors.len();
        if cfg.name.trim().is_empty() {
            problems.error(format!("{at}.name"), "must not be empty");
        } else if cfg.name.contains(['{', '}', ':']) || cfg.name.contains(char::is_whitespace) {
            problems.error(
                format!("{at}.name"),
                "must not contain white space, `:` or braces (it is part of Redis keys)",
            );
        }
        match cfg.algorithm.as_str() {
            "fixed_window" => {}
            "sliding_window" | "sliding_log" | "gcra" => problems.error(
                format!("{at}.algorithm"),
                format!("algorithm {:?} is not supported yet (only \"fixed_window\")", cfg.algorithm),
            ),
            other => problems.error(
                format!("{at}.algorithm"),
                format!("unknown algorithm {other:?}; expected \"fixed_window\", \"sliding_window\", \"sliding_log\" or \"gcra\""),
            ),
        }
        let window_ms = cfg.window.as_millis();
        if window_ms < 1_000 {
            problems.error(format!("{at}.window"), "must be at least 1s");
        }
        if cfg.quota.is_empty() {
            problems.error(
                format!("{at}.quota"),
                "is empty: give a quota for at least one tier, e.g. { anonymous = 60 }",
            );
        }
        let mut quota = HashMap::new();
        for (tier, n) in &cfg.quota {
            if !tiers.contains(tier.as_str()) {
                let known: Vec<&str> = tiers.iter().map(|t| &**t).collect();
                problems.error(
                    format!("{at}.quota.{tier}"),
                    format!("unknown tier {tier:?}; known tiers: {}", known.join(", ")),
                );
            }
            if *n == 0 {
                problems.error(format!("{at}.quota.{tier}"), "must be at least 1");
            }
            quota.insert(Arc::from(tier.as_str()), *n);
        }
        for tier in tiers {
            if !cfg.quota.is_empty() && !cfg.quota.contains_key(&**tier) {
                problems.warn(
                    format!("{at}.quota"),
                    format!(
                        "tier {tier:?} has no quota here: its callers are not limited by {:?}",
                        cfg.name
                    ),
                );
            }
        }
        let by = match cfg.by.as_str() {
            "caller" => By::Caller,
            "ip" => By::Ip,
            "global" => By::Global,
            other => {
                match other
                    .strip_prefix("header:")
                    .map(|h| HeaderName::from_bytes(h.trim().to_ascii_lowercase().as_bytes()))
                {
                    Some(Ok(h)) => By::Header(h),
                    _ => {
                        problems.error(format!("{at}.by"), format!("{other:?}: expected \"caller\", \"ip\", \"global\" or \"header:NAME\""));
                        By::Caller
                    }
                }
            }
        };
        if cfg.lease == Some(0) {
            problems.error(
                format!("{at}.lease"),
                "must be at least 1 (leave it out to turn lease mode off)",
            );
        }
        (problems.errors.len() == before).then(|| Self {
            name: cfg.name.as_str().into(),
            window_ms,
            quota,
            by,
            lease: cfg.lease.unwrap_or(0),
        })
    }

    /// Write the subject this limit counts for a caller into `out` (cleared first): e.g.
    /// `client:acme`, `ip:192.0.2.7`, `global`, `header:x-tenant:t1`. It is hashed
    /// before it reaches a store.
    fn subject_into(&self, caller: &Caller, headers: &HeaderMap, out: &mut Vec<u8>) {
        out.clear();
        let by_caller = |out: &mut Vec<u8>| match &caller.client {
            Some(c) => {
                out.extend_from_slice(b"client:");
                out.extend_from_slice(c.id.as_bytes());
            }
            None => ip_subject(caller.ip, out),
        };
        match &self.by {
            By::Caller => by_caller(out),
            By::Ip => ip_subject(caller.ip, out),
            By::Global => out.extend_from_slice(b"global"),
            By::Header(h) => match headers.get(h) {
                Some(v) => {
                    out.extend_from_slice(b"header:");
                    out.extend_from_slice(h.as_str().as_bytes());
                    out.push(b':');
                    // As before: invalid UTF-8 hashes as its lossy form.
                    match std::str::from_utf8(v.as_bytes()) {
                        Ok(s) => out.extend_from_slice(s.as_bytes()),
                        Err(_) => {
                            out.extend_from_slice(String::from_utf8_lossy(v.as_bytes()).as_bytes())
                        }
                    }
                }
                None => by_caller(out),
            },
        }
    }
}

/// Append the subject of a client IP, `ip:ADDRESS`, to `out`.
fn ip_subject(ip: std::net::IpAddr, out: &mut Vec<u8>) {
    use std::io::Write;
    let _ = write!(out, "ip:{ip}");
}

/// The state of one limit for one caller, as reported in `X-RateLimit-*` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// The limit's name (`X-RateLimit-Resource`).
    pub resource: Arc<str>,
    /// The quota for the caller's tier (`X-RateLimit-Limit`).
    pub quota: u64,
    /// Units charged in the current window (`X-RateLimit-Used`).
    pub used: u64,
    /// End of the current window, milliseconds since the Unix epoch.
    pub reset_at_ms: u64,
}

impl Usage {
    /// `quota − used`, never below 0 (`X-RateLimit-Remaining`).
    pub fn remaining(&self) -> u64 {
        self.quota.saturating_sub(self.used)
    }

    /// End of the window in UTC epoch seconds, rounded up (`X-RateLimit-Reset`).
    pub fn reset_epoch_s(&self) -> u64 {
        self.reset_at_ms.div_ceil(1000)
    }

    /// Whole seconds from `now_ms` until the reset, at least 1 (`Retry-After`).
    pub fn retry_after_s(&self, now_ms: u64) -> u64 {
        self.reset_at_ms
            .saturating_sub(now_ms)
            .div_ceil(1000)
            .max(1)
    }
}

/// One limit applied to one request: where its window is and what quota applies.
#[derive(Debug, Clone)]
pub struct Applied {
    limit: Arc<Limit>,
    key: LimitKey,
    quota: u64,
}

impl Applied {
    /// The storage key of this limit's window for this caller.
    pub fn key(&self) -> &LimitKey {
        &self.key
    }

    /// The limit applied (its name, window length in milliseconds, lease mode).
    pub fn limit(&self) -> &Arc<Limit> {
        &self.limit
    }

    /// The caller's quota in this limit: cost units per window.
    pub fn quota(&self) -> u64 {
        self.quota
    }

    fn usage_at(&self, used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: self.limit.name.clone(),
            quota: self.quota,
            used,
            reset_at_ms,
        }
    }

    fn usage(&self, w: WindowState, now_ms: u64) -> Usage {
        let reset_at_ms = if w.is_empty() {
            now_ms + self.limit.window_ms
        } else {
            w.reset_at_ms
        };
        Usage {
            resource: self.limit.name.clone(),
            quota: self.quota,
            used: w.used,
            reset_at_ms,
        }
    }
}

/// Why a CHECK did not admit a request.
#[derive(Debug)]
pub enum Refusal {
    /// Over the limit: answer 429 with this usage (from the CHECK itself).
    OverLimit(Usage),
    /// The store failed and `store.on_error = "deny"`: answer 503.
    StoreDenied(StoreError),
}

/// The limits part of a snapshot: the store, the over-limit cache, the leases, the key
/// scheme and the failure policy.
#[derive(Debug)]
pub struct Limiter {
    store: Arc<AnyStore>,
    cache: Arc<OverLimitCache>,
    leases: Arc<LeaseTable>,
    keys: KeyScheme,
    on_error: OnError,
    warn_gate: Arc<WarnGate>,
    /// `identity.failed_auth_limit`, as a limit on the client IP; `None` when off.
    failed_auth: Option<Arc<Limit>>,
}

/// The name of the built-in limit on failed authentications (reserved: part of its keys).
pub const FAILED_AUTH: &str = "failed_auth";

impl Limiter {
    /// A limiter over `store`, answering callers known to be over a limit from `cache`
    /// and admitting lease-mode limits from `leases`.
    pub fn new(
        store: Arc<AnyStore>,
        cache: Arc<OverLimitCache>,
        leases: Arc<LeaseTable>,
        keys: KeyScheme,
        on_error: OnError,
    ) -> Self {
        Self {
            store,
            cache,
            leases,
            keys,
            on_error,
            warn_gate: Arc::new(WarnGate::default()),
            failed_auth: None,
        }
    }

    /// Limit failed authentications to `quota` per client IP and `window_ms` (0: off).
    pub fn with_failed_auth_limit(mut self, quota: u64, window_ms: u64) -> Self {
        self.failed_auth = (quota > 0).then(|| {
            Arc::new(Limit {
                name: FAILED_AUTH.into(),
                window_ms,
                // Every caller of a failed authentication is judged under this one tier.
                quota: [(Arc::from(FAILED_AUTH), quota)].into(),
                by: By::Ip,
                lease: 0,
            })
        });
        self
    }

    /// Count one failed authentication from `ip` (an API key that matched no client).
    /// Returns the usage to refuse with (429) when `ip` is past
    /// `identity.failed_auth_limit`, else `None` (answer 401). A failing store follows
    /// `store.on_error` like any limit (`deny`: refused as over the limit would be).
    pub async fn failed_auth(&self, ip: std::net::IpAddr, now_ms: u64) -> Option<Usage> {
        let limit = self.failed_auth.as_ref()?;
        let quota = *limit.quota.values().next()?;
        let mut subject = Vec::with_capacity(48);
        ip_subject(ip, &mut subject);
        let applied = [Applied {
            limit: limit.clone(),
            key: self.keys.key_for(&limit.name, &self.keys.digest(&subject)),
            quota,
        }];
        match self.check(&applied, 1, now_ms).await {
            Ok(checked) => {
                self.charge(&applied, 1, now_ms, checked).await;
                None
            }
            Err(Refusal::OverLimit(usage)) => Some(usage),
            Err(Refusal::StoreDenied(_)) => {
                Some(applied[0].usage_at(quota, now_ms + limit.window_ms))
            }
        }
    }

    /// The built-in limit on failed authentications (`identity.failed_auth_limit`), when on.
    pub fn failed_auth_limit(&self) -> Option<&Arc<Limit>> {
        self.failed_auth.as_ref()
    }

    /// The 32 hex digits that stand for a client IP in storage keys (its by-IP windows).
    pub fn ip_hash(&self, ip: std::net::IpAddr) -> String {
        let mut subject = Vec::with_capacity(48);
        ip_subject(ip, &mut subject);
        self.keys.digest(&subject).hex().to_string()
    }

    /// The store this limiter uses.
    pub fn store(&self) -> &Arc<AnyStore> {
        &self.store
    }

    /// The over-limit cache this limiter uses.
    pub fn cache(&self) -> &Arc<OverLimitCache> {
        &self.cache
    }

    /// The leases this limiter admits lease-mode limits from.
    pub fn leases(&self) -> &Arc<LeaseTable> {
        &self.leases
    }

    /// The limits among `limits` that apply to `caller` (those with a quota for its tier).
    pub fn applicable(
        &self,
        limits: &[Arc<Limit>],
        caller: &Caller,
        headers: &HeaderMap,
    ) -> Vec<Applied> {
        // Limits of one route usually count the same subject: hash it once. The buffers
        // swap roles, so the common case allocates one.
        let mut subject = Vec::with_capacity(64);
        let mut last = Vec::new();
        let mut last_digest: Option<SubjectDigest> = None;
        limits
            .iter()
            .filter_map(|limit| {
                let quota = *limit.quota.get(&caller.tier)?;
                limit.subject_into(caller, headers, &mut subject);
                let digest = match last_digest {
                    Some(d) if last == subject => d,
                    _ => {
                        let d = self.keys.digest(&subject);
                        std::mem::swap(&mut last, &mut subject);
                        last_digest = Some(d);
                        d
                    }
                };
                Some(Applied {
                    limit: limit.clone(),
                    key: self.keys.key_for(&limit.name, &digest),
                    quota,
                })
            })
            .collect()
    }

    /// CHECK every applied limit: one store call per shard for the checked limits; lease
    /// -mode limits take `cost` units from this gateway's lease (refilled from the store
    /// when short). Admits when each limit has room for `cost`; returns the usage of
    /// each limit that answered (`None` where the store failed and `on_error = "allow"`).
    ///
    /// Errors: [`Refusal::OverLimit`] with the usage of the limit that rejected (the one
    /// with the latest reset when several do); [`Refusal::StoreDenied`] when the store
    /// failed and `on_error = "deny"`.
    pub async fn check(
        &self,
        applied: &[Applied],
        cost: u64,
        now_ms: u64,
    ) -> Result<Vec<Option<Usage>>, Refusal> {
        // A caller known to be over a limit until its reset is answered without the store.
        if let Some(usage) = applied
            .iter()
            .find_map(|a| self.cache.get(&a.key, a.quota, cost, now_ms))
        {
            return Err(Refusal::OverLimit(usage));
        }
        let checked: Vec<&LimitKey> = applied
            .iter()
            .filter(|a| a.limit.lease == 0)
            .map(|a| &a.key)
            .collect();
        let mut results = if checked.is_empty() {
            Vec::new()
        } else {
            self.store.check(&checked, now_ms).await
        }
        .into_iter();
        let mut usages = Vec::with_capacity(applied.len());
        let mut over: Option<Usage> = None;
        for a in applied.iter() {
            if a.limit.lease > 0 {
                usages.push(None); // filled in below, once nothing else refused
                continue;
            }
            let result = results.next().unwrap_or(Err(StoreError::NotStarted));
            match result {
                Ok(w) => {
                    let u = a.usage(w, now_ms);
                    if u.used.saturating_add(cost) > u.quota {
                        if !w.is_empty() {
                            self.cache.insert(&a.key, &u, now_ms);
                        }
                        if over.as_ref().is_none_or(|o| u.reset_at_ms > o.reset_at_ms) {
                            over = Some(u.clone());
                        }
                    }
                    usages.push(Some(u));
                }
                Err(e) => {
                    self.store_failed(e)?;
                    usages.push(None);
                }
            }
        }
        if let Some(u) = over {
            return Err(Refusal::OverLimit(u));
        }
        // Lease-mode limits: take units; if one refuses, give back what the others took.
        for (i, a) in applied.iter().enumerate() {
            if a.limit.lease == 0 {
                continue;
            }
            let taken = self
                .leases
                .take(
                    &*self.store,
                    Ask {
                        key: &a.key,
                        cost,
                        lease: a.limit.lease,
                        quota: a.quota,
                        window_ms: a.limit.window_ms,
                    },
                    now_ms,
                )
                .await;
            match taken {
                Ok(Take::Taken { used, reset_at_ms }) => {
                    usages[i] = Some(a.usage_at(used, reset_at_ms));
                }
                Ok(Take::Exhausted { used, reset_at_ms }) => {
                    let u = a.usage_at(used.max(a.quota), reset_at_ms);
                    // Other gateways may give leased units back: trust the refusal only
                    // until their leases could have gone idle.
                    self.cache
                        .insert_until(&a.key, &u, now_ms, now_ms + lease::IDLE_MS);
                    self.release(&applied[..i], cost, &usages[..i]);
                    return Err(Refusal::OverLimit(u));
                }
                Err(e) => {
                    if let Err(refusal) = self.store_failed(e) {
                        self.release(&applied[..i], cost, &usages[..i]);
                        return Err(refusal);
                    }
                }
            }
        }
        Ok(usages)
    }

    /// Apply `store.on_error` to a failed store call: `Ok` to go on unlimited (allow),
    /// or the refusal (deny). Logs at most once per 10 s.
    fn store_failed(&self, e: StoreError) -> Result<(), Refusal> {
        if self.on_error == OnError::Deny {
            self.warn_gate
                .warn(&e, "denying request (store.on_error = \"deny\")");
            return Err(Refusal::StoreDenied(e));
        }
        self.warn_gate.warn(
            &e,
            "forwarding without limiting (store.on_error = \"allow\")",
        );
        Ok(())
    }

    /// CHARGE `cost` to every applied limit (one store call per shard) and return the
    /// usage after the charge; where a charge fails, the usage from the CHECK
    /// (`checked`) stands. Lease-mode limits were charged when the CHECK took their
    /// units; their usage from the CHECK stands.
    pub async fn charge(
        &self,
        applied: &[Applied],
        cost: u64,
        now_ms: u64,
        checked: Vec<Option<Usage>>,
    ) -> Vec<Option<Usage>> {
        let items: Vec<Charge<'_>> = applied
            .iter()
            .filter(|a| a.limit.lease == 0)
            .map(|a| Charge {
                key: &a.key,
                cost,
                window_ms: a.limit.window_ms,
            })
            .collect();
        if items.is_empty() {
            return checked;
        }
        let mut results = self.store.charge(&items, now_ms).await.into_iter();
        applied
            .iter()
            .zip(checked)
            .map(|(a, checked)| {
                if a.limit.lease > 0 {
                    return checked;
                }
                match results.next().unwrap_or(Err(StoreError::NotStarted)) {
                    Ok(w) => Some(a.usage(w, now_ms)),
                    Err(e) => {
                        self.warn_gate
                            .warn(&e, "charge failed; the request was not counted");
                        checked
                    }
                }
            })
            .collect()
    }

    /// The request that `check` admitted is not charged after all (an uncharged status,
    /// or the upstream failed): lease-mode limits get their units back. Limits checked
    /// in the store were never charged, so nothing else changes.
    pub fn release(&self, applied: &[Applied], cost: u64, checked: &[Option<Usage>]) {
        for (a, u) in applied.iter().zip(checked) {
            if let (true, Some(u)) = (a.limit.lease > 0, u) {
                self.leases.give_back(&a.key, cost, u.reset_at_ms);
            }
        }
    }

    /// Give back every unit this gateway holds in leases (at shutdown). Returns the
    /// number of units given back.
    pub async fn return_leases(&self, now_ms: u64) -> u64 {
        self.leases.sweep(&*self.store, now_ms, true).await
    }
}

/// The usage to report when several limits apply: the fewest remaining units
/// (ties: the later reset).
pub fn most_constrained(usages: &[Option<Usage>]) -> Option<&Usage> {
    usages.iter().flatten().min_by(|a, b| {
        a.remaining()
            .cmp(&b.remaining())
            .then(b.reset_at_ms.cmp(&a.reset_at_ms))
    })
}

/// Logs store failures at most once per 10 s, with the number suppressed since.
#[derive(Debug, Default)]
struct WarnGate {
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl WarnGate {
    fn warn(&self, error: &StoreError, what: &str) {
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let last = self.last_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 10_000
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let suppressed = self.suppressed.swap(0, Ordering::Relaxed);
            tracing::warn!(error = %error, suppressed, "store failure: {what}");
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_headers_arithmetic() {
        let u = Usage {
            resource: "core".into(),
            quota: 10,
            used: 12,
            reset_at_ms: 5_001,
        };
        assert_eq!(u.remaining(), 0);
        assert_eq!(u.reset_epoch_s(), 6);
        assert_eq!(u.retry_after_s(5_000), 1);
        assert_eq!(u.retry_after_s(9_000), 1);
        assert_eq!(u.retry_after_s(1_000), 5);
    }

    #[test]
    fn most_constrained_picks_fewest_remaining() {
        let a = Usage {
            resource: "a".into(),
            quota: 10,
            used: 2,
            reset_at_ms: 1,
        };
        let b = Usage {
            resource: "b".into(),
            quota: 5,
            used: 2,
            reset_at_ms: 1,
        };
        let all = vec![Some(a), None, Some(b.clone())];
        assert_eq!(most_constrained(&all), Some(&b));
        assert_eq!(most_constrained(&[None]), None);
    }
}
