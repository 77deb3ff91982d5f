//! The units this gateway admitted by a read and has not charged yet (in flight), per
//! storage key, and the lock that orders them with the store's calls.

use super::algorithm::{Algorithm, Policy};
use super::key::{LimitKey, StateKey};
use super::{sharded, Usage};
use smallvec::SmallVec;

/// Units this gateway admitted by a read and has not charged yet, per storage key of a
/// limit checked before forwarding (`charge = "after_response"`): at most one request's
/// per key, since a request that finds units here is held by a reservation instead
/// (`Stage::Held`). A check counts them as if charged, so a burst of one caller on
/// one gateway admits exactly the quota, and across N gateways at most N requests more.
///
/// A unit is never in flight and in the store at once: a check reads these counts and
/// hands its call to the store, and a charge hands its call to the store and takes its
/// units out of these counts, each under [`InFlightUnits::order`]. Since a store runs
/// calls in the order they were handed over (the memory store at once; a Redis shard
/// whose reads go to its primary through one FIFO queue, see
/// [`Store::submit`](super::store::Store::submit); on a shard that reads from replicas,
/// a window this gateway wrote is read through that queue until every replica has seen
/// the write, and otherwise on a replica that has seen every write of it), a check
/// either counts a unit here and finds it missing in the store, or finds it in the store
/// and not here.
#[derive(Debug, Default)]
pub(super) struct InFlightUnits {
    counts: sharded::ShardedMap<u64>,
    order: std::sync::Mutex<()>,
}

impl InFlightUnits {
    /// The units in flight for `key` before this request, and the policy a reservation
    /// of it is judged by ([`tightened`] by them). When there is none (a read will do),
    /// `cost` units are counted in flight for `key` (see [`InFlightUnits::guard`]).
    pub(super) fn enter(
        &self,
        key: &LimitKey,
        cost: u64,
        policy: &Policy,
    ) -> (u64, Option<Policy>) {
        let mut shard = self.counts.shard(key);
        let n = shard.get(&key.state).copied().unwrap_or(0);
        let held = tightened(policy, n);
        if held.is_none() {
            *shard.entry(key.state).or_insert(0) += cost;
        }
        (n, held)
    }

    /// Like [`InFlightUnits::enter`] for a limit the recent-charge view may answer: when
    /// no request of `key` is in flight on this gateway and `view()` admits, `cost` units
    /// are counted in flight and the view's usage is returned. With requests in flight,
    /// `None`: the request is held by a reservation as usual (a burst gains nothing from
    /// the view, whose answers would only move the store call after the response).
    pub(super) fn enter_viewed(
        &self,
        key: &LimitKey,
        cost: u64,
        view: impl FnOnce() -> Option<Usage>,
    ) -> Option<Usage> {
        let mut shard = self.counts.shard(key);
        if shard.get(&key.state).is_some_and(|&n| n > 0) {
            return None;
        }
        let u = view()?;
        *shard.entry(key.state).or_insert(0) += cost;
        Some(u)
    }

    /// Hold while reading the counts and handing the check's call to the store, or while
    /// handing a charge to the store and taking its units out of the counts (see the
    /// type's documentation). Held for microseconds, never across an `await`.
    pub(super) fn order(&self) -> std::sync::MutexGuard<'_, ()> {
        self.order.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A guard that takes `cost` units out of the counts of `keys` (those
    /// [`InFlightUnits::enter`] counted) when dropped; `None` for no key.
    pub(super) fn guard(&self, keys: Keys, cost: u64) -> Option<InFlightGuard<'_>> {
        (!keys.is_empty()).then_some(InFlightGuard {
            units: self,
            keys,
            cost,
        })
    }
}

/// The keys a request counted in flight: held inline for the one or two limits most routes
/// apply (no allocation per request), on the heap past that.
pub(super) type Keys = SmallVec<[StateKey; 2]>;

/// Takes a request's units out of the in-flight counts when dropped.
#[derive(Debug)]
pub(super) struct InFlightGuard<'a> {
    units: &'a InFlightUnits,
    keys: Keys,
    cost: u64,
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        for key in &self.keys {
            let mut shard = self.units.counts.shard_of(key);
            if let Some(n) = shard.get_mut(key) {
                *n = n.saturating_sub(self.cost);
                if *n == 0 {
                    shard.remove(key);
                }
            }
        }
    }
}

/// The policy a `Stage::Held` reservation is judged by while `n` units of the same
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
