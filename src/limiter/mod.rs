//! Steps 3 and 5 of the request path: CHECK the limits of a route before forwarding,
//! CHARGE them after the response.
//!
//! Each limit has an algorithm ([`algorithm`]: fixed window, the default, as in GitHub's
//! API limiter; sliding window; sliding log; GCRA; concurrency). A request's limits go
//! through up to three stages, each one store call per shard:
//!
//! - **check** before forwarding: a peek (read only, may be stale) for limits charged
//!   after the response; a reservation (check and add in one step, on the primary) for
//!   routes with `charge = "on_request"`, with `store.reserve_in_flight`, and for a
//!   request that finds another of its caller in flight on this gateway; a slot for
//!   concurrency limits. A rejection
//!   (429) is built from the very call that found the caller over the limit.
//! - **charge** after the response (peeked limits), or **release** (refund
//!   reservations, give back lease units) when the status is uncharged or the upstream
//!   failed.
//! - concurrency slots are given back when the response body ends ([`SlotGuard`]).

pub mod algorithm;
pub mod cache;
pub mod key;
pub mod lease;
pub mod sharded;
pub mod store;

use crate::config::{LimitConfig, OnError, Problems};
use crate::identity::Caller;
use algorithm::{Algorithm, Align, Op, OpKind, Policy, Verdict};
use cache::OverLimitCache;
use http::{HeaderMap, HeaderName};
use key::{KeyScheme, LimitKey, SubjectDigest};
use lease::{Ask, LeaseTable, Take};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use store::{AnyStore, Item, Store, StoreError};

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
    /// The algorithm.
    pub algorithm: Algorithm,
    /// GCRA bucket size in units; `None`: the tier's quota.
    pub burst: Option<u64>,
    /// Where fixed windows start.
    pub align: Align,
    /// The name in storage keys: the limit's name, plus `:ALGORITHM` for every algorithm
    /// but the fixed window (so a changed algorithm starts from fresh state).
    pub key_name: Arc<str>,
    /// Percent of subjects (0-100) for whom a refusal is enforced; the others are
    /// shadowed: reported, never refused. `mode = "shadow"` is 0.
    pub enforce_percent: u8,
    /// `on_limit = "delay"`: hold a refused request up to this many milliseconds until
    /// the limit admits it (0: refuse at once).
    pub max_delay_ms: u64,
    /// `on_limit = "delay"`: requests of one subject held at once on this gateway.
    pub max_waiting: u32,
}

/// `window = "1mo"` in milliseconds (humantime's month: 30.44 days).
const MONTH_MS: u64 = 2_630_016_000;

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
        let algorithm = cfg.algorithm;
        // At most a year: longer durations would also overflow epoch milliseconds.
        let year = std::time::Duration::from_secs(366 * 86_400);
        let window_ms = cfg.window.0.min(year).as_millis() as u64;
        if window_ms < 1_000 {
            problems.error(format!("{at}.window"), "must be at least 1s");
        }
        if cfg.window.0 > year {
            problems.error(format!("{at}.window"), "must be at most 1 year (\"366d\")");
        }
        let align = match cfg.align.as_str() {
            "first_request" => Align::FirstRequest,
            "calendar" if algorithm != Algorithm::FixedWindow => {
                problems.error(
                    format!("{at}.align"),
                    "align = \"calendar\" is for fixed windows only (algorithm = \"fixed_window\")",
                );
                Align::FirstRequest
            }
            "calendar" if window_ms == MONTH_MS => Align::Month,
            "calendar" if window_ms > 0 && 86_400_000 % window_ms == 0 => Align::Epoch,
            "calendar" => {
                problems.error(
                    format!("{at}.align"),
                    "a calendar window must divide a day (e.g. \"1h\", \"1d\") or be \"1mo\"",
                );
                Align::FirstRequest
            }
            other => {
                problems.error(
                    format!("{at}.align"),
                    format!("{other:?}: expected \"first_request\" or \"calendar\""),
                );
                Align::FirstRequest
            }
        };
        match cfg.burst {
            Some(_) if algorithm != Algorithm::Gcra => problems.error(
                format!("{at}.burst"),
                "burst is for algorithm = \"gcra\" only",
            ),
            Some(0) => problems.error(format!("{at}.burst"), "must be at least 1"),
            _ => {}
        }
        let enforce_percent = match cfg.mode.as_str() {
            "enforce" => cfg.enforce_percent,
            "shadow" => 0,
            other => {
                problems.error(
                    format!("{at}.mode"),
                    format!("{other:?}: expected \"enforce\" or \"shadow\""),
                );
                100
            }
        };
        if cfg.enforce_percent > 100 {
            problems.error(format!("{at}.enforce_percent"), "must be between 0 and 100");
        } else if cfg.mode == "shadow" && cfg.enforce_percent != 100 {
            problems.error(
                format!("{at}.enforce_percent"),
                "a limit in mode = \"shadow\" enforces for nobody: leave enforce_percent out",
            );
        }
        let max_delay_ms = match cfg.on_limit.as_str() {
            "reject" => 0,
            "delay" if cfg.max_delay.as_millis() == 0 || cfg.max_delay.as_millis() > 60_000 => {
                problems.error(
                    format!("{at}.max_delay"),
                    "must be more than 0 and at most 1m",
                );
                0
            }
            "delay" if algorithm == Algorithm::Concurrency => {
                problems.error(
                    format!("{at}.on_limit"),
                    "a concurrency limit cannot delay (when a slot frees is unknown)",
                );
                0
            }
            "delay" => cfg.max_delay.as_millis(),
            other => {
                problems.error(
                    format!("{at}.on_limit"),
                    format!("{other:?}: expected \"reject\" or \"delay\""),
                );
                0
            }
        };
        if cfg.max_waiting == 0 {
            problems.error(format!("{at}.max_waiting"), "must be at least 1");
        }
        if cfg.lease.is_some() && algorithm != Algorithm::FixedWindow {
            problems.error(
                format!("{at}.lease"),
                "lease mode is for fixed windows only (algorithm = \"fixed_window\")",
            );
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
            if algorithm == Algorithm::Gcra && *n > window_ms {
                problems.error(
                    format!("{at}.quota.{tier}"),
                    format!("GCRA spaces units at least 1 ms apart: at most {window_ms} per window of {window_ms} ms"),
                );
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
            algorithm,
            burst: cfg.burst,
            align,
            enforce_percent,
            max_delay_ms,
            max_waiting: cfg.max_waiting,
            key_name: match algorithm {
                Algorithm::FixedWindow => cfg.name.as_str().into(),
                other => format!("{}:{}", cfg.name, other.name()).into(),
            },
        })
    }

    /// The policy this limit applies to a caller whose tier has `quota`.
    pub fn policy(&self, quota: u64) -> Policy {
        Policy {
            algorithm: self.algorithm,
            quota,
            window_ms: self.window_ms,
            burst: self.burst.unwrap_or(quota),
            align: self.align,
        }
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
    /// The limit for the caller's tier (`X-RateLimit-Limit`): the quota, or the burst
    /// for GCRA.
    pub quota: u64,
    /// Units counted against the limit (`X-RateLimit-Used`); may exceed `quota`.
    pub used: u64,
    /// When the caller has its whole limit again, milliseconds since the Unix epoch
    /// (the end of a fixed window).
    pub reset_at_ms: u64,
    /// When the refused cost would be admitted, milliseconds since the Unix epoch; 0
    /// when admitted (then `Retry-After` falls back to the reset).
    pub retry_at_ms: u64,
}

impl Usage {
    /// `quota − used`, never below 0 (`X-RateLimit-Remaining`).
    pub fn remaining(&self) -> u64 {
        self.quota.saturating_sub(self.used)
    }

    /// `reset_at` in UTC epoch seconds, rounded up (`X-RateLimit-Reset`).
    pub fn reset_epoch_s(&self) -> u64 {
        self.reset_at_ms.div_ceil(1000)
    }

    /// Whole seconds from `now_ms` until the refused cost would be admitted (or, when
    /// unknown, until the reset), at least 1 (`Retry-After`).
    pub fn retry_after_s(&self, now_ms: u64) -> u64 {
        let at = if self.retry_at_ms > 0 {
            self.retry_at_ms
        } else {
            self.reset_at_ms
        };
        at.saturating_sub(now_ms).div_ceil(1000).max(1)
    }
}

/// One limit applied to one request: where its state is and what policy applies.
#[derive(Debug, Clone)]
pub struct Applied {
    limit: Arc<Limit>,
    key: LimitKey,
    policy: Policy,
}

impl Applied {
    /// The storage key of this limit's state for this caller.
    pub fn key(&self) -> &LimitKey {
        &self.key
    }

    /// The limit applied (its name, window length in milliseconds, lease mode).
    pub fn limit(&self) -> &Arc<Limit> {
        &self.limit
    }

    /// The policy (algorithm, quota for the caller's tier, window, burst).
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    fn usage(&self, v: &Verdict) -> Usage {
        Usage {
            resource: self.limit.name.clone(),
            quota: self.policy.limit(),
            used: v.used,
            reset_at_ms: v.reset_at_ms,
            retry_at_ms: v.retry_at_ms,
        }
    }

    /// The caller's quota in this limit: cost units per window.
    pub fn quota(&self) -> u64 {
        self.policy.quota
    }

    fn usage_at(&self, used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: self.limit.name.clone(),
            quota: self.policy.limit(),
            used,
            reset_at_ms,
            retry_at_ms: 0,
        }
    }

    /// Whether a refusal of this limit is enforced for this subject (`enforce_percent`,
    /// by a stable hash of the subject, the same on every gateway); otherwise it is
    /// shadowed: reported, not refused.
    pub fn enforced(&self) -> bool {
        match self.limit.enforce_percent {
            100 => true,
            0 => false,
            p => self.key.shard_hash.rotate_right(32) % 100 < u64::from(p),
        }
    }

    /// How this limit is held between the check and the end of the request.
    fn stage(&self, on_request: bool) -> Stage {
        if self.limit.lease > 0 {
            Stage::Lease
        } else if self.policy.algorithm == Algorithm::Concurrency {
            Stage::Slot
        } else if on_request {
            Stage::Reserve
        } else {
            Stage::Peek
        }
    }
}

/// How one limit is held between the check and the end of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Peeked before forwarding, charged after the response.
    Peek,
    /// Reserved before forwarding, refunded if the request is not charged.
    Reserve,
    /// Charged after the response, but reserved at the check because this gateway
    /// already had a request of the same caller and limit in flight (see
    /// [`Limiter::check`]); refunded if the request is not charged, topped up when the
    /// upstream says it cost more.
    Held,
    /// A concurrency slot, given back when the response body ends.
    Slot,
    /// Taken from this gateway's lease.
    Lease,
}

/// What [`Limiter::check`] admitted: per applied limit, its usage (`None` where the
/// store failed and `on_error = "allow"`) and what was taken that may have to be
/// given back.
#[derive(Debug, Default)]
pub struct Admission {
    /// The usage of each applied limit, in order.
    pub usages: Vec<Option<Usage>>,
    /// Per applied limit: how it is held, and the epoch a refund quotes for a
    /// reservation or slot that was taken.
    holds: Vec<Hold>,
    /// Refusals of limits in shadow mode (or outside their `enforce_percent`): the
    /// request was let through; report them ("would reject").
    pub shadowed: Vec<Usage>,
    /// The units this request adds to its checked limits' in-flight counts until it is
    /// charged or released (given back when the admission is dropped).
    in_flight: Option<InFlightGuard>,
    /// The cost the check took or counted (the route's `cost`).
    cost: u64,
}

/// Units this gateway admitted by a read and has not charged yet, per storage key of a
/// limit checked before forwarding (`charge = "after_response"`): at most one request's
/// per key, since a request that finds units here is held by a reservation instead
/// ([`Stage::Held`]). A check counts them as if charged, so a burst of one caller on
/// one gateway admits exactly the quota, and across N gateways at most N requests more.
#[derive(Debug, Clone, Default)]
struct InFlightUnits(Arc<sharded::ShardedMap<u64>>);

impl InFlightUnits {
    /// The units in flight for `key` before this request, and the policy a reservation
    /// of it is judged by ([`tightened`] by them). When there is none (a read will do),
    /// `cost` units are counted in flight for `key` (see [`InFlightUnits::guard`]).
    fn enter(&self, key: &LimitKey, cost: u64, policy: &Policy) -> (u64, Option<Policy>) {
        let mut shard = self.0.shard(key);
        let n = shard.get(&key.key).copied().unwrap_or(0);
        let held = tightened(policy, n);
        if held.is_none() {
            *shard.entry(key.key.clone()).or_insert(0) += cost;
        }
        (n, held)
    }

    /// A guard that takes `cost` units out of the counts of `keys` (those
    /// [`InFlightUnits::enter`] counted) when dropped; `None` for no key.
    fn guard(&self, keys: Vec<LimitKey>, cost: u64) -> Option<InFlightGuard> {
        (!keys.is_empty()).then(|| InFlightGuard {
            units: self.clone(),
            keys,
            cost,
        })
    }
}

/// Takes a request's units out of the in-flight counts when dropped.
#[derive(Debug)]
struct InFlightGuard {
    units: InFlightUnits,
    keys: Vec<LimitKey>,
    cost: u64,
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        for key in &self.keys {
            let mut shard = self.units.0.shard(key);
            if let Some(n) = shard.get_mut(&key.key) {
                *n = n.saturating_sub(self.cost);
                if *n == 0 {
                    shard.remove(&key.key);
                }
            }
        }
    }
}

/// How one applied limit is held, decided once by [`Limiter::check`].
#[derive(Debug, Clone, Copy)]
struct Hold {
    stage: Stage,
    /// The verdict's epoch, for a reservation or slot that was taken.
    epoch: Option<u64>,
}

/// The policy a [`Stage::Held`] reservation is judged by while `n` units of the same
/// caller and limit are in flight on this gateway, unseen by the store: the quota (GCRA:
/// the burst) less `n`, so that the reservation admits only what `n` more units leave
/// room for. `None` when nothing is in flight (a read will do), for concurrency limits
/// (slots), and when `n` leaves no room (the read, with `n` added, refuses and reports
/// the usage).
fn tightened(policy: &Policy, n: u64) -> Option<Policy> {
    if n == 0 {
        return None;
    }
    let mut p = *policy;
    match p.algorithm {
        Algorithm::Concurrency => return None,
        Algorithm::Gcra if n < p.burst => p.burst -= n,
        Algorithm::Gcra => return None,
        _ if n < p.quota => p.quota -= n,
        _ => return None,
    }
    Some(p)
}

/// Ids for sliding-log entries and concurrency slots: unique within the process,
/// random across processes (53 bits, exact in Lua's numbers).
fn next_id() -> u64 {
    use std::sync::OnceLock;
    static NEXT: OnceLock<AtomicU64> = OnceLock::new();
    let next = NEXT.get_or_init(|| AtomicU64::new(uuid::Uuid::new_v4().as_u64_pair().0 >> 12));
    (next.fetch_add(1, Ordering::Relaxed) & ((1 << 53) - 1)).max(1)
}

/// Charges a forwarded request that is dropped before its charge: the client went away
/// (closed the connection, or reset its HTTP/2 stream) while the upstream worked on it.
/// The upstream may have served it, so it counts: limits that were only checked get
/// `cost` added (in the background), reservations and leased units stand. Made by
/// [`Limiter::pending_charge`]; [`PendingCharge::settled`] disarms it once the request
/// was charged or released the usual way.
#[derive(Debug)]
pub struct PendingCharge {
    store: Arc<AnyStore>,
    clock: crate::clock::SharedClock,
    applied: Arc<[Applied]>,
    cost: u64,
    /// Per applied limit: whether it was only checked (charged when dropped armed).
    checked: Vec<bool>,
    armed: bool,
}

impl PendingCharge {
    /// The request was charged or released: nothing to do when dropped.
    pub fn settled(&mut self) {
        self.armed = false;
    }
}

impl Drop for PendingCharge {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let charges: Vec<Refund> = self
            .applied
            .iter()
            .zip(&self.checked)
            .filter(|(_, checked)| **checked)
            .map(|(a, _)| {
                let op = Op {
                    kind: OpKind::Charge,
                    cost: self.cost,
                    id: next_id(),
                };
                (a.key.clone(), a.policy, op)
            })
            .collect();
        tracing::debug!(
            limits = charges.len(),
            "client went away; charging the forwarded request"
        );
        spawn_refunds(self.store.clone(), charges, self.clock.now_ms());
    }
}

/// Gives back concurrency slots when dropped: when the response body ends, fails, or
/// the client goes away (see [`Limiter::slots`]).
#[derive(Debug)]
pub struct SlotGuard {
    store: Arc<AnyStore>,
    clock: crate::clock::SharedClock,
    /// The refund of each slot.
    slots: Vec<Refund>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        spawn_refunds(self.store.clone(), slots, self.clock.now_ms());
    }
}

/// One operation to send in the background: a refund ([`OpKind::Refund`]), or the
/// charge of a request whose client went away.
type Refund = (LimitKey, Policy, Op);

/// The refunds of the reservations and slots `admission` took for the limits whose
/// stage `which` picks: `cost` units back from each (slots ignore the cost).
fn refunds(
    applied: &[Applied],
    admission: &Admission,
    cost: u64,
    which: impl Fn(Stage) -> bool,
) -> Vec<Refund> {
    applied
        .iter()
        .zip(&admission.holds)
        .filter(|(_, h)| which(h.stage))
        .filter_map(|(a, h)| {
            let op = Op {
                kind: OpKind::Refund,
                cost,
                id: h.epoch?,
            };
            Some((a.key.clone(), a.policy, op))
        })
        .collect()
}

/// Send `refunds` (or charges) in the background (one store call per shard). Without a runtime
/// nothing is sent: reservations then stand and slots expire after their window.
fn spawn_refunds(store: Arc<AnyStore>, refunds: Vec<Refund>, now_ms: u64) {
    if refunds.is_empty() {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    rt.spawn(async move {
        let items: Vec<Item<'_>> = refunds
            .iter()
            .map(|(key, policy, op)| Item {
                key,
                policy,
                op: *op,
            })
            .collect();
        store.apply(&items, now_ms).await;
    });
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
    /// Requests held by `on_limit = "delay"`, per storage key of the refusing limit.
    waiting: Arc<sharded::ShardedMap<u32>>,
    /// Units admitted by this gateway and not charged yet, per storage key.
    in_flight: InFlightUnits,
    /// `store.reserve_in_flight`: limits charged after the response are reserved at the
    /// check instead (see [`Limiter::reserves_in_flight`]).
    reserve_in_flight: bool,
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
            waiting: Arc::default(),
            in_flight: InFlightUnits::default(),
            reserve_in_flight: false,
        }
    }

    /// `store.reserve_in_flight`: reserve the units of limits charged after the response
    /// at the check, in the store (on a Redis shard's primary), and refund them when the
    /// response is not charged, so that every gateway of a fleet sees every other's
    /// requests in flight.
    pub fn with_reserve_in_flight(mut self, reserve: bool) -> Self {
        self.reserve_in_flight = reserve;
        self
    }

    /// Whether a request is held by reservation (`charge = "on_request"` on its route,
    /// given as `on_request`, or `store.reserve_in_flight`) rather than checked by a
    /// read and charged after the response.
    pub fn reserves(&self, on_request: bool) -> bool {
        on_request || self.reserve_in_flight
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
                algorithm: Algorithm::FixedWindow,
                burst: None,
                align: Align::FirstRequest,
                key_name: FAILED_AUTH.into(),
                enforce_percent: 100,
                max_delay_ms: 0,
                max_waiting: 1,
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
            key: self
                .keys
                .key_for(&limit.key_name, &self.keys.digest(&subject)),
            policy: limit.policy(quota),
        }];
        match self.check(&applied, 1, false, now_ms).await {
            Ok(admission) => {
                self.charge(&applied, 1, now_ms, admission).await;
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
                    key: self.keys.key_for(&limit.key_name, &digest),
                    policy: limit.policy(quota),
                })
            })
            .collect()
    }

    /// CHECK every applied limit before forwarding: one store call per shard that peeks
    /// (limits charged after the response), reserves `cost` (`on_request`: check and
    /// add in one step) or takes a slot (concurrency); lease-mode limits take `cost`
    /// units from this gateway's lease. Admits when every limit admits; then nothing
    /// taken is kept.
    ///
    /// Errors: [`Refusal::OverLimit`] with the usage of the limit that refused (the one
    /// that frees latest when several do); [`Refusal::StoreDenied`] when the store
    /// failed and `on_error = "deny"`.
    pub async fn check(
        &self,
        applied: &[Applied],
        cost: u64,
        on_request: bool,
        now_ms: u64,
    ) -> Result<Admission, Refusal> {
        // A caller known to be over a limit is answered without the store (unless this
        // gateway still holds lease units of it: those were granted within the quota).
        if let Some(usage) = applied.iter().find_map(|a| {
            let leased = a.limit.lease > 0 && self.leases.holds(&a.key, cost, now_ms);
            (!leased)
                .then(|| self.cache.get(&a.key, a.policy.limit(), cost, now_ms))
                .flatten()
        }) {
            return Err(Refusal::OverLimit(usage));
        }
        let mut admission = Admission {
            usages: Vec::with_capacity(applied.len()),
            holds: applied
                .iter()
                .map(|a| Hold {
                    stage: a.stage(on_request),
                    epoch: None,
                })
                .collect(),
            shadowed: Vec::new(),
            in_flight: None,
            cost,
        };
        // Requests this gateway admitted and has not charged yet count as charged, so a
        // burst of concurrent requests cannot all pass one stale check. The first
        // request of a caller and limit in flight on this gateway is checked by a read
        // and counted here until it is charged or released. A request that finds one
        // already in flight is held by a reservation in the store instead (`Held`),
        // with the quota tightened by the units in flight here, which the store has not
        // seen yet: so every gateway of a fleet has at most one request per caller and
        // limit that the others cannot see, and a burst overshoots by at most one
        // request per gateway.
        // Per applied limit: the units in flight here before this request, and the
        // tightened policy of a held one.
        let mut in_flight: Vec<(u64, Option<Policy>)> = vec![(0, None); applied.len()];
        let mut counted = Vec::new();
        for (i, a) in applied.iter().enumerate() {
            if admission.holds[i].stage != Stage::Peek {
                continue;
            }
            in_flight[i] = self.in_flight.enter(&a.key, cost, &a.policy);
            if in_flight[i].1.is_some() {
                admission.holds[i].stage = Stage::Held;
            } else {
                counted.push(a.key.clone());
            }
        }
        admission.in_flight = self.in_flight.guard(counted, cost);
        let in_flight_before = |i: usize| in_flight[i].0;
        let items: Vec<Item<'_>> = applied
            .iter()
            .zip(admission.holds.iter().map(|h| h.stage))
            .enumerate()
            .filter(|(_, (_, st))| *st != Stage::Lease)
            .map(|(i, (a, st))| match st {
                Stage::Peek => Item {
                    key: &a.key,
                    policy: &a.policy,
                    op: Op {
                        kind: OpKind::Peek,
                        cost: cost.saturating_add(in_flight_before(i)),
                        id: 0,
                    },
                },
                _ => Item {
                    key: &a.key,
                    policy: in_flight[i].1.as_ref().unwrap_or(&a.policy),
                    op: Op {
                        kind: OpKind::Reserve,
                        cost,
                        id: next_id(),
                    },
                },
            })
            .collect();
        let mut results = if items.is_empty() {
            Vec::new()
        } else {
            self.store.apply(&items, now_ms).await
        }
        .into_iter();
        let mut over: Option<Usage> = None;
        let mut denied: Option<StoreError> = None;
        for (i, a) in applied.iter().enumerate() {
            if admission.holds[i].stage == Stage::Lease {
                admission.usages.push(None); // filled in below, once nothing else refused
                continue;
            }
            match results.next().unwrap_or(Err(StoreError::NotStarted)) {
                Ok(v) => {
                    // Units in flight count as used, so that a refusal they caused
                    // does not show a full Remaining.
                    let mut u = a.usage(&v);
                    u.used = u.used.saturating_add(in_flight_before(i));
                    if v.admitted {
                        if admission.holds[i].stage != Stage::Peek {
                            admission.holds[i].epoch = Some(v.epoch);
                        }
                    } else if !a.enforced() {
                        admission.shadowed.push(u.clone());
                        if admission.holds[i].stage == Stage::Held {
                            // Let through without a reservation: charged after the
                            // response, like a checked limit.
                            admission.holds[i].stage = Stage::Peek;
                        }
                    } else {
                        // A refusal that in-flight requests caused may not last (they
                        // can be released): keep only what the store alone refuses.
                        if u.used.saturating_add(cost) > u.quota {
                            self.remember_refusal(a, &u, cost, now_ms);
                        }
                        let frees = |u: &Usage| u.retry_at_ms.max(u.reset_at_ms);
                        if over.as_ref().is_none_or(|o| frees(&u) > frees(o)) {
                            over = Some(u.clone());
                        }
                    }
                    admission.usages.push(Some(u));
                }
                Err(e) => {
                    if let Err(Refusal::StoreDenied(e)) = self.store_failed(e) {
                        denied = Some(e);
                    }
                    if admission.holds[i].stage == Stage::Held {
                        // Nothing was reserved: if let through (on_error = "allow"),
                        // charge it after the response like a checked limit.
                        admission.holds[i].stage = Stage::Peek;
                    }
                    admission.usages.push(None);
                }
            }
        }
        if over.is_some() || denied.is_some() {
            self.give_back(applied, cost, &admission, now_ms);
            return Err(match over {
                Some(u) => Refusal::OverLimit(u),
                None => Refusal::StoreDenied(denied.unwrap_or(StoreError::NotStarted)),
            });
        }
        // Lease-mode limits: take units; if one refuses, give back what the others took.
        for (i, a) in applied.iter().enumerate() {
            if admission.holds[i].stage != Stage::Lease {
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
                        quota: a.policy.quota,
                        window_ms: a.limit.window_ms,
                    },
                    now_ms,
                )
                .await;
            match taken {
                Ok(Take::Taken { used, reset_at_ms }) => {
                    admission.usages[i] = Some(a.usage_at(used, reset_at_ms));
                }
                Ok(Take::Exhausted { used, reset_at_ms }) => {
                    let mut u = a.usage_at(used.max(a.policy.quota), reset_at_ms);
                    u.retry_at_ms = reset_at_ms;
                    if !a.enforced() {
                        // Let through without lease units: it is charged to the window
                        // in the store after the response, like a checked limit.
                        admission.shadowed.push(u.clone());
                        admission.usages[i] = Some(u);
                        admission.holds[i].stage = Stage::Peek;
                        continue;
                    }
                    // Other gateways may give leased units back: trust the refusal only
                    // until their leases could have gone idle.
                    self.cache
                        .insert_until(&a.key, &u, cost, now_ms, now_ms + lease::IDLE_MS);
                    admission.usages.truncate(i);
                    self.give_back(&applied[..i], cost, &admission, now_ms);
                    return Err(Refusal::OverLimit(u));
                }
                Err(e) => {
                    if let Err(refusal) = self.store_failed(e) {
                        admission.usages.truncate(i);
                        self.give_back(&applied[..i], cost, &admission, now_ms);
                        return Err(refusal);
                    }
                }
            }
        }
        Ok(admission)
    }

    /// [`Limiter::check`], and when the refusing limit has `on_limit = "delay"` and would
    /// admit within its `max_delay` (with fewer than `max_waiting` requests of the same
    /// subject already held), wait until it would and check again, until admitted or
    /// past `max_delay` from the first check. Waits by `clock` (milliseconds since the
    /// epoch) and real time.
    ///
    /// Errors: as [`Limiter::check`]; a request that cannot wait gets the refusal of
    /// its latest check.
    pub async fn check_or_delay(
        &self,
        applied: &[Applied],
        cost: u64,
        on_request: bool,
        clock: &dyn crate::clock::Clock,
    ) -> Result<Admission, Refusal> {
        let started = clock.now_ms();
        let mut held: Option<Waiting<'_>> = None;
        loop {
            let now_ms = clock.now_ms();
            let refusal = match self.check(applied, cost, on_request, now_ms).await {
                Err(Refusal::OverLimit(u)) => u,
                other => return other,
            };
            let Some(a) = applied.iter().find(|a| a.limit.name == refusal.resource) else {
                return Err(Refusal::OverLimit(refusal));
            };
            let deadline = started + a.limit.max_delay_ms;
            let at = refusal.retry_at_ms.max(now_ms + 1);
            if a.limit.max_delay_ms == 0 || at > deadline {
                return Err(Refusal::OverLimit(refusal));
            }
            if held.is_none() {
                match Waiting::enter(&self.waiting, &a.key, a.limit.max_waiting) {
                    Some(w) => held = Some(w),
                    None => return Err(Refusal::OverLimit(refusal)),
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(at - now_ms)).await;
        }
    }

    /// Read the state of every applied limit (one peek per shard; changes nothing): the
    /// usage a request of one unit would see, `None` where the store failed. For the
    /// rate-limit endpoint.
    pub async fn peek(&self, applied: &[Applied], now_ms: u64) -> Vec<Option<Usage>> {
        let items: Vec<Item<'_>> = applied
            .iter()
            .map(|a| Item {
                key: &a.key,
                policy: &a.policy,
                op: Op {
                    kind: OpKind::Peek,
                    cost: 1,
                    id: 0,
                },
            })
            .collect();
        if items.is_empty() {
            return Vec::new();
        }
        let results = self.store.apply(&items, now_ms).await;
        applied
            .iter()
            .zip(results)
            .map(|(a, r)| match r {
                Ok(v) => Some(a.usage(&v)),
                Err(e) => {
                    self.warn_gate.warn(&e, "rate-limit endpoint: read failed");
                    None
                }
            })
            .collect()
    }

    /// Keep a refusal in the over-limit cache while it surely holds: a fixed window's
    /// `used` only grows until its reset; the other algorithms' refusal holds for this
    /// cost until `retry_at`. Concurrency refusals are not kept (a slot may free at any
    /// moment).
    fn remember_refusal(&self, a: &Applied, u: &Usage, cost: u64, now_ms: u64) {
        match a.policy.algorithm {
            Algorithm::Concurrency => {}
            Algorithm::FixedWindow => self.cache.insert(&a.key, u, now_ms),
            _ => self
                .cache
                .insert_until(&a.key, u, cost, now_ms, u.retry_at_ms.max(now_ms)),
        }
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

    /// CHARGE `cost` to every limit that was peeked (one store call per shard) and
    /// return the usage after the charge; where a charge fails, the usage from the
    /// CHECK stands. Reserved, leased and concurrency limits were counted by the CHECK;
    /// their usage from it stands.
    pub async fn charge(
        &self,
        applied: &[Applied],
        cost: u64,
        now_ms: u64,
        admission: Admission,
    ) -> Vec<Option<Usage>> {
        // Checked limits are charged `cost`; held ones (reserved at the check) the
        // difference when the upstream said the request cost more than was reserved.
        let top_up = cost.saturating_sub(admission.cost);
        let charged: Vec<(usize, u64)> = (0..applied.len())
            .filter_map(|i| match admission.holds[i].stage {
                Stage::Peek => Some((i, cost)),
                Stage::Held if top_up > 0 => Some((i, top_up)),
                _ => None,
            })
            .collect();
        let mut usages = admission.usages;
        if charged.is_empty() || cost == 0 {
            return usages;
        }
        let items: Vec<Item<'_>> = charged
            .iter()
            .map(|&(i, cost)| Item {
                key: &applied[i].key,
                policy: &applied[i].policy,
                op: Op {
                    kind: OpKind::Charge,
                    cost,
                    id: next_id(),
                },
            })
            .collect();
        let results = self.store.apply(&items, now_ms).await;
        for (&(i, _), result) in charged.iter().zip(results) {
            match result {
                Ok(v) => usages[i] = Some(applied[i].usage(&v)),
                Err(e) => self
                    .warn_gate
                    .warn(&e, "charge failed; the request was not counted"),
            }
        }
        usages
    }

    /// The request that `check` admitted is not charged after all (an uncharged status,
    /// or the upstream failed): reservations are refunded and lease-mode limits get
    /// their units back. Peeked limits were never charged. Concurrency slots are given
    /// back by the [`SlotGuard`] when the response ends.
    pub fn release(&self, applied: &[Applied], cost: u64, admission: &Admission, now_ms: u64) {
        self.give_back_where(applied, cost, admission, now_ms, |st| st != Stage::Slot);
    }

    /// Give back everything `admission` holds, slots included (a refused request).
    fn give_back(&self, applied: &[Applied], cost: u64, admission: &Admission, now_ms: u64) {
        self.give_back_where(applied, cost, admission, now_ms, |_| true);
    }

    fn give_back_where(
        &self,
        applied: &[Applied],
        cost: u64,
        admission: &Admission,
        now_ms: u64,
        which: impl Fn(Stage) -> bool,
    ) {
        for (i, a) in applied.iter().enumerate() {
            if admission.holds[i].stage == Stage::Lease && which(Stage::Lease) {
                if let Some(Some(u)) = admission.usages.get(i) {
                    self.leases.give_back(&a.key, cost, u.reset_at_ms);
                }
            }
        }
        let refunds = refunds(applied, admission, cost, |st| {
            matches!(st, Stage::Reserve | Stage::Held | Stage::Slot) && which(st)
        });
        spawn_refunds(self.store.clone(), refunds, now_ms);
    }

    /// A guard that charges `applied` (`cost` units) if it is dropped before
    /// [`PendingCharge::settled`]: arm it before forwarding, so that a client that goes
    /// away while the upstream works is charged all the same.
    pub fn pending_charge(
        &self,
        applied: Arc<[Applied]>,
        admission: &Admission,
        clock: crate::clock::SharedClock,
    ) -> PendingCharge {
        PendingCharge {
            store: self.store.clone(),
            clock,
            checked: admission
                .holds
                .iter()
                .map(|h| h.stage == Stage::Peek)
                .collect(),
            applied,
            cost: admission.cost,
            armed: true,
        }
    }

    /// A guard that gives back the concurrency slots `admission` holds when dropped
    /// (put it in the response body); `None` when it holds none.
    pub fn slots(
        &self,
        applied: &[Applied],
        admission: &Admission,
        clock: crate::clock::SharedClock,
    ) -> Option<SlotGuard> {
        let slots = refunds(applied, admission, 1, |st| st == Stage::Slot);
        (!slots.is_empty()).then(|| SlotGuard {
            store: self.store.clone(),
            clock,
            slots,
        })
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

/// One request held by `on_limit = "delay"`, counted against `max_waiting` until dropped.
struct Waiting<'a> {
    map: &'a sharded::ShardedMap<u32>,
    key: &'a LimitKey,
}

impl<'a> Waiting<'a> {
    /// Count one more request waiting on `key`, unless `max` already are.
    fn enter(map: &'a sharded::ShardedMap<u32>, key: &'a LimitKey, max: u32) -> Option<Self> {
        let mut shard = map.shard(key);
        let n = shard.entry(key.key.clone()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Self { map, key })
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut shard = self.map.shard(self.key);
        if let Some(n) = shard.get_mut(&self.key.key) {
            *n -= 1;
            if *n == 0 {
                shard.remove(&self.key.key);
            }
        }
    }
}

/// Logs store failures at most once per 10 s, with the number suppressed since.
#[derive(Debug, Default)]
struct WarnGate(crate::logging::Throttle);

impl WarnGate {
    fn warn(&self, error: &StoreError, what: &str) {
        if let Some(suppressed) = self.0.due(10_000) {
            tracing::warn!(error = %error, suppressed, "store failure: {what}");
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
            retry_at_ms: 0,
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
            retry_at_ms: 0,
        };
        let b = Usage {
            resource: "b".into(),
            quota: 5,
            used: 2,
            reset_at_ms: 1,
            retry_at_ms: 0,
        };
        let all = vec![Some(a), None, Some(b.clone())];
        assert_eq!(most_constrained(&all), Some(&b));
        assert_eq!(most_constrained(&[None]), None);
    }
}
