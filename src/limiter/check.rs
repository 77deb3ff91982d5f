//! CHECK, before forwarding ([`Limiter::check`]): how each applied limit is held until
//! the end of the request (its stage: peek, reservation, held reservation, slot or
//! lease), the units this gateway admitted and has not charged yet (in flight) and the
//! lock that orders them with the store's calls, and the refusal it answers with.

use super::algorithm::{Algorithm, Op, OpKind, Policy};
use super::key::{LimitKey, StateKey};
use super::lease::{self, Ask, Take};
use super::store::{Item, Store, StoreError};
use super::{next_id, sharded, Applied, Limiter, Usage, CACHE_TRUST_MS};
use smallvec::SmallVec;
use std::sync::Arc;

/// How one limit is held between the check and the end of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
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
    pub(super) holds: Vec<Hold>,
    /// Refusals of limits in shadow mode (or outside their `enforce_percent`): the
    /// request was let through; report them ("would reject").
    pub shadowed: Vec<Usage>,
    /// The units this request adds to its checked limits' in-flight counts until it is
    /// charged or released (given back when the admission is dropped).
    pub(super) in_flight: Option<InFlightGuard>,
    /// The cost the check took or counted (the route's `cost`).
    pub(super) cost: u64,
}

/// Units this gateway admitted by a read and has not charged yet, per storage key of a
/// limit checked before forwarding (`charge = "after_response"`): at most one request's
/// per key, since a request that finds units here is held by a reservation instead
/// ([`Stage::Held`]). A check counts them as if charged, so a burst of one caller on
/// one gateway admits exactly the quota, and across N gateways at most N requests more.
///
/// A unit is never in flight and in the store at once: a check reads these counts and
/// hands its call to the store, and a charge hands its call to the store and takes its
/// units out of these counts, each under [`InFlightUnits::order`]. Since a store runs
/// calls in the order they were handed over (the memory store at once; a Redis shard
/// whose reads go to its primary through one FIFO queue, see [`Store::submit`]; on a
/// shard that reads from replicas, a window this gateway wrote is read through that
/// queue until every replica has seen the write, and otherwise on a replica that has
/// seen every write of it), a check either counts a unit here and finds it missing in
/// the store, or finds it in the store and not here.
#[derive(Debug, Clone, Default)]
pub(super) struct InFlightUnits {
    counts: Arc<sharded::ShardedMap<u64>>,
    order: Arc<std::sync::Mutex<()>>,
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
        view: impl FnOnce() -> Option<super::Usage>,
    ) -> Option<super::Usage> {
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
    pub(super) fn guard(&self, keys: Keys, cost: u64) -> Option<InFlightGuard> {
        (!keys.is_empty()).then(|| InFlightGuard {
            units: self.clone(),
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
pub(super) struct InFlightGuard {
    units: InFlightUnits,
    keys: Keys,
    cost: u64,
}

impl Drop for InFlightGuard {
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

/// How one applied limit is held, decided once by [`Limiter::check`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Hold {
    pub(super) stage: Stage,
    /// The verdict's epoch, for a reservation or slot that was taken.
    pub(super) epoch: Option<u64>,
    /// A reservation ([`Stage::Reserve`], [`Stage::Held`]) or slot ([`Stage::Slot`])
    /// whose call failed in a way that it may still land ([`StoreError::may_have_run`]:
    /// a timeout): its op id, by which the store tells later what became of it
    /// ([`Store::late_reservation`]). A request let through (`on_error = "allow"`) is
    /// charged after its response only if its reservation did not land, and its
    /// reservation is refunded if it landed and the request is not charged (a slot that
    /// landed is given back when the response ends), in the background
    /// (`settle::spawn_late`): counted once either way.
    pub(super) late: Option<u64>,
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

impl Applied {
    /// How this limit is held between the check and the end of the request.
    pub(super) fn stage(&self, on_request: bool) -> Stage {
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

/// Why a CHECK did not admit a request.
#[derive(Debug)]
pub enum Refusal {
    /// Over the limit: answer 429 with this usage (from the CHECK itself).
    OverLimit(Usage),
    /// The store failed and `store.on_error = "deny"`: answer 503.
    StoreDenied(StoreError),
}

impl Limiter {
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
                    late: None,
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
        // (On the stack for up to two limits, as the other per-request lists below.)
        let mut in_flight: SmallVec<[(u64, Option<Policy>); 2]> =
            smallvec::smallvec![(0, None); applied.len()];
        let mut counted = Keys::new();
        let peeked = admission.holds.iter().any(|h| h.stage == Stage::Peek);
        let order = peeked.then(|| self.in_flight.order());
        // Per applied limit: the usage the recent-charge view admitted it with (no store
        // call then), when `store.check_from_charge` is on.
        let mut viewed: Vec<Option<Usage>> = Vec::new();
        if self.recent.enabled() {
            viewed.resize(applied.len(), None);
        }
        for (i, a) in applied.iter().enumerate() {
            if admission.holds[i].stage != Stage::Peek {
                continue;
            }
            if let Some(slot) = viewed.get_mut(i) {
                let fixed = a.policy.algorithm == Algorithm::FixedWindow;
                let quota = a.policy.limit();
                *slot = self.in_flight.enter_viewed(&a.key, cost, || {
                    self.recent.admits(&a.key, quota, cost, fixed, now_ms)
                });
                if slot.is_some() {
                    counted.push(a.key.state);
                    continue;
                }
            }
            in_flight[i] = self.in_flight.enter(&a.key, cost, &a.policy);
            if in_flight[i].1.is_some() {
                admission.holds[i].stage = Stage::Held;
            } else {
                counted.push(a.key.state);
            }
        }
        admission.in_flight = self.in_flight.guard(counted, cost);
        let in_flight_before = |i: usize| in_flight[i].0;
        // Per applied limit: the op id of its reservation or slot (0 for the others).
        let ids: SmallVec<[u64; 2]> = admission
            .holds
            .iter()
            .map(|h| match h.stage {
                Stage::Peek | Stage::Lease => 0,
                _ => next_id(),
            })
            .collect();
        let items: SmallVec<[Item<'_>; 2]> = applied
            .iter()
            .zip(admission.holds.iter().map(|h| h.stage))
            .enumerate()
            .filter(|(i, (_, st))| {
                *st != Stage::Lease && viewed.get(*i).is_none_or(|v| v.is_none())
            })
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
                        id: ids[i],
                    },
                },
            })
            .collect();
        // Reservations change the windows the recent-charge view holds: counted there as
        // pending until their answers (below).
        let tickets: Vec<u64> = if self.recent.enabled() {
            items
                .iter()
                .map(|it| match (it.op.kind, it.policy.algorithm) {
                    (OpKind::Reserve, a) if a != Algorithm::Concurrency => {
                        self.recent.sent(it.key, it.op.cost, now_ms)
                    }
                    _ => 0,
                })
                .collect()
        } else {
            Vec::new()
        };
        let submitted = (!items.is_empty()).then(|| self.store.submit(&items, now_ms));
        drop(order);
        let mut results = match submitted {
            Some(answers) => answers.await,
            None => Vec::new(),
        }
        .into_iter();
        let mut over: Option<Usage> = None;
        let mut denied: Option<StoreError> = None;
        // Store answers consumed so far (the index into `tickets`).
        let mut answered = 0;
        for (i, a) in applied.iter().enumerate() {
            if admission.holds[i].stage == Stage::Lease {
                admission.usages.push(None); // filled in below, once nothing else refused
                continue;
            }
            if let Some(u) = viewed.get_mut(i).and_then(Option::take) {
                admission.usages.push(Some(u));
                continue;
            }
            let result = results.next().unwrap_or(Err(StoreError::NotStarted));
            if let Some(&ticket) = tickets.get(answered) {
                let after = result.as_ref().ok().map(|v| a.usage(v));
                self.recent
                    .replied(&a.key, ticket, cost, after.as_ref(), now_ms);
            }
            answered += 1;
            match result {
                Ok(v) => {
                    // Units in flight count as used, so that a refusal they caused
                    // does not show a full Remaining; but a refusal never reports
                    // more than the store holds and the quota: what the store alone
                    // refuses shows the store's count.
                    let mut u = a.usage(&v);
                    let n = in_flight_before(i);
                    u.used = if v.admitted {
                        u.used.saturating_add(n)
                    } else if u.used.saturating_add(cost) > u.quota {
                        u.used
                    } else {
                        u.used.saturating_add(n).min(u.quota).max(u.used)
                    };
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
                        // A refusal that this gateway's requests in flight caused (or
                        // that a held reservation judged by a quota tightened by them)
                        // may not last: they can be released. Keep only what the store
                        // alone refuses.
                        if in_flight_before(i) == 0 && admission.holds[i].stage != Stage::Held {
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
                    let may_land = e.may_have_run();
                    if let Err(Refusal::StoreDenied(e)) = self.store_failed(e) {
                        denied = Some(e);
                    }
                    match admission.holds[i].stage {
                        // The reservation may still land: settled once its late answer
                        // is known (see `Hold::late`).
                        Stage::Reserve | Stage::Held | Stage::Slot if may_land => {
                            admission.holds[i].late = Some(ids[i]);
                        }
                        // Nothing was reserved: if let through (on_error = "allow"),
                        // charge it after the response like a checked limit.
                        Stage::Held => admission.holds[i].stage = Stage::Peek,
                        _ => {}
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
            // Boxed: kept out of the size of every request's future.
            let taken = Box::pin(self.leases.take(
                &*self.store,
                Ask {
                    key: &a.key,
                    cost,
                    lease: a.limit.lease,
                    lease_ttl_ms: a.limit.lease_ttl_ms,
                    quota: a.policy.quota,
                    window_ms: a.limit.window_ms,
                },
                now_ms,
            ))
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

    /// Keep a refusal that the store's count alone made (see [`Limiter::check`]) in the
    /// over-limit cache while it holds, for at most [`CACHE_TRUST_MS`]: a fixed window's
    /// refusal for any request whose cost does not fit; the other algorithms' for this
    /// cost until `retry_at`. Concurrency refusals are not kept (a slot may free at any
    /// moment). The bound is there because the store's count may include reservations
    /// of other gateways that they refund later (a refund on this gateway forgets the
    /// entry at once, see [`Limiter::release`]).
    fn remember_refusal(&self, a: &Applied, u: &Usage, cost: u64, now_ms: u64) {
        let trusted_until = now_ms.saturating_add(CACHE_TRUST_MS);
        match a.policy.algorithm {
            Algorithm::Concurrency => {}
            Algorithm::FixedWindow => self.cache.insert_until(&a.key, u, 1, now_ms, trusted_until),
            _ => self.cache.insert_until(
                &a.key,
                u,
                cost,
                now_ms,
                u.retry_at_ms.max(now_ms).min(trusted_until),
            ),
        }
    }
}
