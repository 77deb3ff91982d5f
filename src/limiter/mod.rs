//! Steps 3 and 5 of the request path: CHECK the limits of a route before forwarding,
//! CHARGE them after the response.
//!
//! Each limit has an algorithm ([`algorithm`]: fixed window, the default, as in GitHub's
//! API limiter; sliding window; sliding log; GCRA; concurrency). A request's limits go
//! through up to three stages, each one store call per shard:
//!
//! - **check** before forwarding ([`Limiter::check`]): a peek (read only, may be stale)
//!   for limits charged after the response; a reservation (check and add in one step, on
//!   the primary) for routes with `charge = "on_request"`, with
//!   `store.reserve_in_flight`, and for a request that finds another of its caller in
//!   flight on this gateway; a slot for concurrency limits. A rejection (429) is built
//!   from the very call that found the caller over the limit. What a check admits is one
//!   [`Ticket`], which the request owns until it ends.
//! - **charge** after the response ([`Ticket::charge`]: peeked limits), or **release**
//!   ([`Ticket::release`]: refund reservations, give back lease units) when the status
//!   is uncharged or the upstream failed. A ticket dropped without either (the client
//!   went away) charges in the background.
//! - concurrency slots come out of the ticket as the response body's guard
//!   ([`Ticket::slots`], [`SlotGuard`]) and are given back when the body ends.
//!
//! Where each part lives (one concern per file):
//!
//! - `mod.rs` (this file): the [`Limiter`] (what a snapshot holds: store, over-limit
//!   cache, leases, key scheme, `store.on_error`), the counts for `GET /top`, and the
//!   store-failure policy.
//! - `limit.rs`: a `[[limits]]` entry ready to use ([`Limit`], built and validated from
//!   config), what it counts ([`By`], the subject of a caller), and one limit as it
//!   applies to a request ([`Applied`]).
//! - `applicable.rs`: which limits apply to a request ([`Limiter::applicable`]), a
//!   route's limits ([`LimitSet`]), remembered per thread for a caller that comes back
//!   ([`Limiter::applicable_to`]).
//! - `check.rs`: CHECK ([`Limiter::check`]), one function per stage (over-limit cache,
//!   plan, store call, answers, leases), how each limit is held until the end of the
//!   request, and why a request is refused ([`Refusal`]).
//! - `in_flight.rs`: the units this gateway admitted and has not charged yet, and the
//!   lock that orders them with the store (why a unit is never in flight and in the
//!   store at once).
//! - `ticket.rs`: what a check admitted ([`Ticket`]), and its charge in the background
//!   when dropped.
//! - `settle.rs`: CHARGE ([`Ticket::charge`]), RELEASE ([`Ticket::release`]), giving
//!   back what a refused check took, and concurrency slots given back ([`SlotGuard`]).
//! - `late.rs`: reservations whose store calls timed out, settled once their fate is
//!   known.
//! - `usage.rs`: the numbers for the `X-RateLimit-*` headers ([`Usage`], made from a
//!   verdict, a lease or a refund), which of several limits to report
//!   ([`most_constrained`]), and the read of the rate-limit endpoint ([`Limiter::peek`]).
//! - [`delayed`]: `on_limit = "delay"` ([`Limiter::check_or_delay`], `max_waiting`, and
//!   the gateway-wide `server.max_delayed`).
//! - [`block_for`]: `[[limits]].block_for` (a refusal that blocks the caller for a
//!   while, on every gateway) and the count of blocks started.
//! - `failed_auth.rs`: the built-in limit on failed authentications
//!   ([`Limiter::failed_auth`]) and [`blocked`] the addresses past it.
//! - [`algorithm`] (the reference model of every algorithm), [`store`] (memory and
//!   Redis), [`key`] (storage keys and shards), [`cache`] (the over-limit cache),
//!   [`lease`] (lease mode), [`sharded`] (a map sharded by key), [`reset`] (clearing a
//!   client's windows: `POST /callers/{id}/reset`), [`recent`] (answering checks from
//!   this gateway's last charge), [`top`] (heavy hitters).

pub mod algorithm;
mod applicable;
pub mod block_for;
pub mod blocked;
pub mod cache;
mod check;
pub mod delayed;
mod failed_auth;
mod hold;
mod in_flight;
pub mod key;
mod late;
pub mod lease;
mod limit;
pub mod read;
pub mod recent;
pub mod reset;
mod settle;
pub mod sharded;
mod slots;
pub mod store;
mod ticket;
pub mod top;
mod usage;

pub use applicable::LimitSet;
pub use check::Refusal;
pub use limit::{Applied, By, Limit, TierQuotas};
pub use slots::SlotGuard;
pub use ticket::Ticket;
pub use usage::{most_constrained, Usage};

use crate::config::OnError;
use crate::identity::Caller;
use cache::OverLimitCache;
use in_flight::InFlightUnits;
use key::KeyScheme;
use lease::LeaseTable;
use recent::RecentCharges;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use store::{AnyStore, StoreError};

/// Ids for sliding-log entries and concurrency slots: unique within the process,
/// random across processes (53 bits, exact in Lua's numbers).
fn next_id() -> u64 {
    use std::sync::OnceLock;
    static NEXT: OnceLock<AtomicU64> = OnceLock::new();
    let next = NEXT.get_or_init(|| AtomicU64::new(uuid::Uuid::new_v4().as_u64_pair().0 >> 12));
    (next.fetch_add(1, Ordering::Relaxed) & ((1 << 53) - 1)).max(1)
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
    /// Its own gate for the decision on a failed check (deny, or fail open), so that a
    /// failed charge logged just before cannot hold back the line saying callers now go
    /// unlimited (or are refused).
    decision_gate: Arc<WarnGate>,
    /// `identity.failed_auth_limit`, as a limit on the client IP; `None` when off.
    failed_auth: Option<Arc<Limit>>,
    /// Addresses past `failed_auth` until its reset; kept across reloads.
    blocked: Arc<blocked::BlockedAddresses>,
    /// Requests held by `on_limit = "delay"`, per storage key of the refusing limit.
    waiting: Arc<sharded::ShardedMap<u32>>,
    /// Units admitted by this gateway and not charged yet, per storage key.
    in_flight: InFlightUnits,
    /// `store.reserve_in_flight`: limits charged after the response are reserved at the
    /// check instead (see [`Limiter::reserves`]).
    reserve_in_flight: bool,
    /// Who is being limited now (`GET /top`); kept across reloads.
    top: Arc<top::Top>,
    /// `store.check_from_charge`: CHECKs answered from this gateway's last CHARGE reply.
    recent: Arc<RecentCharges>,
    /// Blocks this gateway's refusals started (`tollgate_blocked_total`); kept across
    /// reloads.
    blocks_started: Arc<block_for::BlocksStarted>,
}

/// The longest a refusal is answered from the over-limit cache without asking the store
/// again, in milliseconds: how stale a cached refusal's numbers can be.
pub const CACHE_TRUST_MS: u64 = 1_000;

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
            decision_gate: Arc::new(WarnGate::default()),
            failed_auth: None,
            blocked: Arc::default(),
            waiting: Arc::default(),
            in_flight: InFlightUnits::default(),
            reserve_in_flight: false,
            top: Arc::default(),
            recent: Arc::new(RecentCharges::new(0, 0)),
            blocks_started: Arc::default(),
        }
    }

    /// Count heavy hitters in `top` (the previous snapshot's, across a reload).
    pub fn with_top(mut self, top: Arc<top::Top>) -> Self {
        self.top = top;
        self
    }

    /// The heavy hitters (`GET /top`).
    pub fn top(&self) -> &Arc<top::Top> {
        &self.top
    }

    /// Count `units` admitted for `caller` in each limit of `applied`, at `now_ms`
    /// (epoch milliseconds), for `GET /top`.
    pub fn count_used(&self, applied: &[Applied], caller: &Caller, units: u64, now_ms: u64) {
        let who = top::WhoRef::of(caller);
        for a in applied {
            self.top
                .used(&a.limit().name, who, &caller.tier, units, now_ms / 1000);
        }
    }

    /// Count a refusal of `caller` by the limit named `limit`, at `now_ms` (epoch
    /// milliseconds), for `GET /top`.
    pub fn count_refused(&self, limit: &Arc<str>, caller: &Caller, now_ms: u64) {
        self.top
            .refused(limit, top::WhoRef::of(caller), &caller.tier, now_ms / 1000);
    }

    /// `store.check_from_charge`: answer CHECKs of limits charged after the response from
    /// this gateway's last CHARGE reply of the window while it is younger than
    /// `max_age_ms` (0: off), keeping at most `capacity` windows.
    pub fn with_check_from_charge(mut self, max_age_ms: u64, capacity: usize) -> Self {
        self.recent = Arc::new(RecentCharges::new(max_age_ms, capacity));
        self
    }

    /// The recent-charge view (`store.check_from_charge`).
    pub fn recent(&self) -> &Arc<RecentCharges> {
        &self.recent
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

    /// Apply `store.on_error` to a failed store call: `Ok` to go on unlimited (allow),
    /// or the refusal (deny). Logs at most once per 10 s. With `"local"` a failed
    /// Redis call is answered locally and never gets here: what does (the memory store
    /// full, or the local store's own bound reached) goes on unlimited, as `"allow"`.
    fn store_failed(&self, e: StoreError) -> Result<(), Refusal> {
        match self.on_error {
            OnError::Deny => {
                self.decision_gate
                    .warn(&e, "denying request (store.on_error = \"deny\")");
                Err(Refusal::StoreDenied(e))
            }
            OnError::Allow => {
                self.decision_gate.warn(
                    &e,
                    "forwarding without limiting (store.on_error = \"allow\")",
                );
                Ok(())
            }
            OnError::Local => {
                self.decision_gate.warn(
                    &e,
                    "forwarding without limiting (store.on_error = \"local\" could not answer it locally)",
                );
                Ok(())
            }
        }
    }

    /// Give back every unit this gateway holds in leases (at shutdown). Returns the
    /// number of units given back.
    pub async fn return_leases(&self, now_ms: u64) -> u64 {
        self.leases.sweep(&*self.store, now_ms, true).await
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
