//! CHECK, before forwarding ([`Limiter::check`]), one function per stage: the
//! over-limit cache, the plan (how each applied limit is held until the end of the
//! request, and the units it counts in flight on this gateway), one store call per
//! shard, the reading of its answers, and lease-mode limits. What the check admits is a
//! [`Ticket`]; what it refuses, a [`Refusal`].

use super::algorithm::{Algorithm, Op, OpKind, Policy, Verdict};
use super::hold::{Hold, Stage, Taken};
use super::in_flight::{InFlightGuard, Keys};
use super::lease::{self, Ask, Take};
use super::store::{CallNote, Item, Store, StoreError, Submitted};
use super::ticket::Ticket;
use super::{next_id, Applied, Limiter, Usage, CACHE_TRUST_MS};
use crate::clock::SharedClock;
use smallvec::SmallVec;
use std::sync::Arc;

/// Why a CHECK did not admit a request.
#[derive(Debug)]
pub enum Refusal {
    /// Over the limit: answer 429 with this usage (from the CHECK itself).
    OverLimit(Usage),
    /// The store failed and `store.on_error = "deny"`: answer 503.
    StoreDenied(StoreError),
}

/// What the check works out before it asks the store ([`Limiter::plan`]).
struct Plan<'a> {
    /// Per applied limit: the units of the same caller and limit in flight on this
    /// gateway before this request, and the tightened policy of a held reservation.
    /// (On the stack for up to two limits, as the other per-request lists.)
    in_flight: SmallVec<[(u64, Option<Policy>); 2]>,
    /// Per applied limit: the usage the recent-charge view admitted it with (no store
    /// call then); empty when `store.check_from_charge` is off.
    viewed: Vec<Option<Usage>>,
    /// Per applied limit: the op id of its reservation or slot (0 for the others).
    ids: SmallVec<[u64; 2]>,
    /// The units this request counted in flight, taken out when the guard is dropped
    /// (by the ticket, when the request is charged or released).
    counted: Option<InFlightGuard<'a>>,
    /// Whether a limit is in lease mode (the last stage has work).
    leased: bool,
    /// The enforced limits with `block_for` that refused without a block on: a BLOCK
    /// follows the refusal ([`Limiter::start_blocks`]).
    to_block: SmallVec<[usize; 1]>,
}

impl Limiter {
    /// CHECK every applied limit before forwarding: one store call per shard that peeks
    /// (limits charged after the response), reserves `cost` (`on_request`: check and
    /// add in one step) or takes a slot (concurrency); lease-mode limits take `cost`
    /// units from this gateway's lease. `now_ms` is the time of the check (epoch
    /// milliseconds); `clock` is read when the returned [`Ticket`] is dropped without
    /// being charged or released. Admits when every limit admits; otherwise nothing
    /// taken is kept.
    ///
    /// Errors: [`Refusal::OverLimit`] with the usage of the limit that refused (the one
    /// that frees latest when several do); [`Refusal::StoreDenied`] when the store
    /// failed and `on_error = "deny"`.
    ///
    /// `note`: where a sampled request's trace keeps its store calls (shard, node,
    /// script, batch, breaker and lease-refill events); `None` when it is not traced.
    pub async fn check<'a>(
        &'a self,
        applied: &Arc<[Applied]>,
        cost: u64,
        on_request: bool,
        clock: &'a SharedClock,
        now_ms: u64,
        mut note: Option<&mut CallNote>,
    ) -> Result<Ticket<'a>, Refusal> {
        if let Some(usage) = self.cached_refusal(applied, cost, now_ms) {
            return Err(Refusal::OverLimit(usage));
        }
        let mut taken = Taken {
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
            cost,
            local: false,
        };
        // Peeked limits count their units in flight and hand their call to the store
        // under one lock (see `InFlightUnits`).
        let peeked = taken.holds.iter().any(|h| h.stage == Stage::Peek);
        let order = peeked.then(|| self.in_flight.order());
        let mut plan = self.plan(applied, &mut taken.holds, cost, now_ms);
        let (submitted, pending) = self.submit(applied, &taken.holds, &plan, cost, now_ms);
        drop(order);
        let answers = match submitted {
            Some(submitted) => {
                let answered = submitted.await;
                if let Some(n) = note.as_deref_mut() {
                    n.noted(answered.call, answered.calls, &self.store);
                }
                answered.answers
            }
            None => Vec::new(),
        };
        if let Err(refusal) = self.judge(applied, &mut plan, answers, &pending, &mut taken, now_ms)
        {
            let refusal = if plan.to_block.is_empty() {
                refusal
            } else {
                // Boxed: kept out of the size of every request's future.
                Box::pin(self.start_blocks(applied, &plan.to_block, refusal, cost, now_ms)).await
            };
            self.give_back(applied, &taken, now_ms);
            return Err(refusal);
        }
        if plan.leased {
            self.take_leases(applied, &mut taken, now_ms, note).await?;
        }
        Ok(Ticket::new(
            self,
            clock,
            applied.clone(),
            taken,
            plan.counted,
        ))
    }

    /// Stage 1: a caller known to be over a limit is answered from the over-limit cache,
    /// without the store (unless this gateway still holds lease units of the limit:
    /// those were granted within the quota). The refusal's usage, or `None`.
    #[inline]
    fn cached_refusal(&self, applied: &[Applied], cost: u64, now_ms: u64) -> Option<Usage> {
        applied.iter().find_map(|a| {
            let leased = a.limit.lease > 0 && self.leases.holds(&a.key, cost, now_ms);
            (!leased)
                .then(|| self.cache.get(&a.key, a.policy.limit(), cost, now_ms))
                .flatten()
        })
    }

    /// Stage 2, under [`InFlightUnits::order`](super::in_flight::InFlightUnits::order):
    /// how each peeked limit is held. Requests this gateway admitted and has not charged
    /// yet count as charged, so a burst of concurrent requests cannot all pass one stale
    /// check. The first request of a caller and limit in flight on this gateway is
    /// checked by a read (or answered by the recent-charge view) and counted in flight
    /// until it is charged or released. A request that finds one already in flight is
    /// held by a reservation in the store instead ([`Stage::Held`]), with the quota
    /// tightened by the units in flight here, which the store has not seen yet: so every
    /// gateway of a fleet has at most one request per caller and limit that the others
    /// cannot see, and a burst overshoots by at most one request per gateway.
    fn plan(&self, applied: &[Applied], holds: &mut [Hold], cost: u64, now_ms: u64) -> Plan<'_> {
        let mut in_flight: SmallVec<[(u64, Option<Policy>); 2]> =
            smallvec::smallvec![(0, None); applied.len()];
        let mut counted = Keys::new();
        let mut viewed: Vec<Option<Usage>> = Vec::new();
        if self.recent.enabled() {
            viewed.resize(applied.len(), None);
        }
        for (i, a) in applied.iter().enumerate() {
            if holds[i].stage != Stage::Peek {
                continue;
            }
            // A block kept in the store is not in the view: limits with `block_for`
            // are read.
            if let Some(slot) = viewed.get_mut(i).filter(|_| a.policy.block_ms == 0) {
                let fixed = a.policy.algorithm == Algorithm::FixedWindow;
                let quota = self.local_limit(a);
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
                holds[i].stage = Stage::Held;
            } else {
                counted.push(a.key.state);
            }
        }
        let ids = holds
            .iter()
            .map(|h| match h.stage {
                Stage::Peek | Stage::Lease => 0,
                _ => next_id(),
            })
            .collect();
        Plan {
            in_flight,
            viewed,
            ids,
            counted: self.in_flight.guard(counted, cost),
            leased: holds.iter().any(|h| h.stage == Stage::Lease),
            to_block: SmallVec::new(),
        }
    }

    /// Stage 3: hand the store one call per shard for the limits that need one (not
    /// leased, not answered by the recent-charge view): a peek of `cost` plus the units
    /// in flight, or a reservation of `cost` (slots: one). Reservations change the
    /// windows the recent-charge view holds: they are counted there as pending until
    /// their answers. Returns the answers to await (`None`: no limit needs the store)
    /// and the view's pending entries, one per reservation in call order when the view
    /// is on.
    fn submit(
        &self,
        applied: &[Applied],
        holds: &[Hold],
        plan: &Plan<'_>,
        cost: u64,
        now_ms: u64,
    ) -> (Option<Submitted>, Vec<u64>) {
        let items: SmallVec<[Item<'_>; 2]> = applied
            .iter()
            .zip(holds.iter().map(|h| h.stage))
            .enumerate()
            .filter(|(i, (_, st))| {
                *st != Stage::Lease && plan.viewed.get(*i).is_none_or(|v| v.is_none())
            })
            .map(|(i, (a, st))| match st {
                Stage::Peek => Item {
                    key: &a.key,
                    policy: &a.policy,
                    op: Op {
                        kind: OpKind::Peek,
                        cost: cost.saturating_add(plan.in_flight[i].0),
                        id: 0,
                    },
                },
                _ => Item {
                    key: &a.key,
                    policy: plan.in_flight[i].1.as_ref().unwrap_or(&a.policy),
                    op: Op {
                        kind: OpKind::Reserve,
                        cost,
                        id: plan.ids[i],
                    },
                },
            })
            .collect();
        let pending: Vec<u64> = if self.recent.enabled() {
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
        (submitted, pending)
    }

    /// Stage 4: read the store's `answers` (in the order of [`Limiter::submit`]) into
    /// `taken`: each limit's usage, the epoch of each reservation or slot taken, the
    /// refusals of limits in shadow mode, the calls that may still land. Refusals the
    /// store's count alone made are kept in the over-limit cache.
    ///
    /// Errors: [`Refusal::OverLimit`] with the usage of the refusing limit that frees
    /// latest; [`Refusal::StoreDenied`] when a call failed and `on_error = "deny"`.
    /// Nothing taken is given back here.
    fn judge(
        &self,
        applied: &[Applied],
        plan: &mut Plan<'_>,
        answers: Vec<Result<Verdict, StoreError>>,
        pending: &[u64],
        taken: &mut Taken,
        now_ms: u64,
    ) -> Result<(), Refusal> {
        let cost = taken.cost;
        let mut results = answers.into_iter();
        let mut over: Option<Usage> = None;
        let mut denied: Option<StoreError> = None;
        // Store answers consumed so far (the index into `pending`).
        let mut answered = 0;
        for (i, a) in applied.iter().enumerate() {
            let hold = &mut taken.holds[i];
            if hold.stage == Stage::Lease {
                taken.usages.push(None); // filled in by the last stage
                continue;
            }
            if let Some(u) = plan.viewed.get_mut(i).and_then(Option::take) {
                taken.usages.push(Some(u));
                continue;
            }
            let result = results.next().unwrap_or(Err(StoreError::NotStarted));
            if let Some(&sent) = pending.get(answered) {
                let after = result.as_ref().ok().map(|v| a.usage(v));
                self.recent
                    .replied(&a.key, sent, cost, after.as_ref(), now_ms);
            }
            answered += 1;
            let in_flight_before = plan.in_flight[i].0;
            match result {
                Ok(v) => {
                    // Units in flight count as used, so that a refusal they caused
                    // does not show a full Remaining; but a refusal never reports
                    // more than the store holds and the quota: what the store alone
                    // refuses shows the store's count.
                    let mut u = a.usage(&v);
                    let local = self.local_share(a, &mut u);
                    taken.local |= local;
                    u.used = if v.admitted {
                        u.used.saturating_add(in_flight_before)
                    } else if u.used.saturating_add(cost) > u.quota {
                        u.used
                    } else {
                        u.used
                            .saturating_add(in_flight_before)
                            .min(u.quota)
                            .max(u.used)
                    };
                    if v.admitted {
                        if hold.stage != Stage::Peek {
                            hold.epoch = Some(v.epoch);
                        }
                    } else if !a.enforced() {
                        taken.shadowed.push(u.clone());
                        if hold.stage == Stage::Held {
                            // Let through without a reservation: charged after the
                            // response, like a checked limit.
                            hold.stage = Stage::Peek;
                        }
                    } else {
                        // A refusal that this gateway's requests in flight caused (or
                        // that a held reservation judged by a quota tightened by them)
                        // may not last: they can be released. Keep only what the store
                        // alone refuses.
                        if v.blocked && !local {
                            self.remember_block(a, &u, now_ms);
                        } else if in_flight_before == 0 && hold.stage != Stage::Held && !local {
                            self.remember_refusal(a, &u, cost, now_ms);
                        }
                        // Blocks are kept in the store: none is started while the
                        // shard is enforced locally (`on_error = "local"`).
                        if a.policy.block_ms > 0 && !v.blocked && !local {
                            plan.to_block.push(i);
                        }
                        let frees = |u: &Usage| u.retry_at_ms.max(u.reset_at_ms);
                        if over.as_ref().is_none_or(|o| frees(&u) > frees(o)) {
                            over = Some(u.clone());
                        }
                    }
                    taken.usages.push(Some(u));
                }
                Err(e) => {
                    let may_land = e.may_have_run();
                    if let Err(Refusal::StoreDenied(e)) = self.store_failed(e) {
                        denied = Some(e);
                    }
                    match hold.stage {
                        // The reservation may still land: settled once its late answer
                        // is known (see `Hold::late`).
                        Stage::Reserve | Stage::Held | Stage::Slot if may_land => {
                            hold.late = Some(plan.ids[i]);
                        }
                        // Nothing was reserved: if let through (on_error = "allow"),
                        // charge it after the response like a checked limit.
                        Stage::Held => hold.stage = Stage::Peek,
                        _ => {}
                    }
                    taken.usages.push(None);
                }
            }
        }
        match (over, denied) {
            (Some(u), _) => Err(Refusal::OverLimit(u)),
            (None, Some(e)) => Err(Refusal::StoreDenied(e)),
            (None, None) => Ok(()),
        }
    }

    /// Stage 5: lease-mode limits take `cost` units from this gateway's lease. If one
    /// refuses (or its store call fails and `on_error = "deny"`), what the limits before
    /// it took is given back and the refusal returned.
    async fn take_leases(
        &self,
        applied: &[Applied],
        taken: &mut Taken,
        now_ms: u64,
        mut note: Option<&mut CallNote>,
    ) -> Result<(), Refusal> {
        let cost = taken.cost;
        for (i, a) in applied.iter().enumerate() {
            if taken.holds[i].stage != Stage::Lease {
                continue;
            }
            let refills = note.as_ref().map(|n| n.lease);
            // Boxed: kept out of the size of every request's future.
            let took = Box::pin(self.leases.take(
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
                note.as_deref_mut(),
            ))
            .await;
            // A refill was asked for: note its call (shard, node, breaker).
            if let Some(n) = note.as_deref_mut().filter(|n| Some(n.lease) != refills) {
                n.noted(self.store.lease_call(&a.key, &took), 1, &self.store);
            }
            let refusal = match took {
                Ok(Take::Taken { used, reset_at_ms }) => {
                    taken.usages[i] = Some(a.usage_at(used, reset_at_ms));
                    continue;
                }
                Ok(Take::Exhausted { used, reset_at_ms }) => {
                    let mut u = a.usage_at(used.max(a.policy.quota), reset_at_ms);
                    u.retry_at_ms = reset_at_ms;
                    if !a.enforced() {
                        // Let through without lease units: it is charged to the window
                        // in the store after the response, like a checked limit.
                        taken.shadowed.push(u.clone());
                        taken.usages[i] = Some(u);
                        taken.holds[i].stage = Stage::Peek;
                        continue;
                    }
                    // Other gateways may give leased units back: trust the refusal only
                    // until their leases could have gone idle.
                    self.cache
                        .insert_until(&a.key, &u, cost, now_ms, now_ms + lease::IDLE_MS);
                    Refusal::OverLimit(u)
                }
                Err(e) => match self.store_failed(e) {
                    Ok(()) => continue,
                    Err(refusal) => refusal,
                },
            };
            taken.usages.truncate(i);
            self.give_back(&applied[..i], taken, now_ms);
            return Err(refusal);
        }
        Ok(())
    }

    /// With `store.on_error = "local"`, while `a`'s shard is enforced in this gateway's
    /// memory: `u` reports the local share of the quota (divided by the fleet size) and
    /// the answer is local (true). False, `u` untouched, otherwise (a branch without
    /// `"local"`).
    #[inline]
    pub(super) fn local_share(&self, a: &Applied, u: &mut Usage) -> bool {
        if self.on_error != crate::config::OnError::Local {
            return false;
        }
        match self.store.local_divisor(&a.key) {
            Some(d) => {
                u.quota = (u.quota / d).max(1);
                true
            }
            None => false,
        }
    }

    /// `a`'s limit (`X-RateLimit-Limit`), or its local share while its shard is enforced
    /// by `store.on_error = "local"`.
    #[inline]
    fn local_limit(&self, a: &Applied) -> u64 {
        let limit = a.policy.limit();
        if self.on_error != crate::config::OnError::Local {
            return limit;
        }
        self.store
            .local_divisor(&a.key)
            .map_or(limit, |d| (limit / d).max(1))
    }

    /// Whether any of `applied` is enforced by `store.on_error = "local"` now (its
    /// shard's calls fail): a refusal of them was decided locally.
    pub fn decided_locally(&self, applied: &[Applied]) -> bool {
        self.on_error == crate::config::OnError::Local
            && applied
                .iter()
                .any(|a| self.store.local_divisor(&a.key).is_some())
    }

    /// Keep a refusal that the store's count alone made (see [`Limiter::check`]) in the
    /// over-limit cache while it holds, for at most [`CACHE_TRUST_MS`]: a fixed window's
    /// refusal for any request whose cost does not fit; the other algorithms' for this
    /// cost until `retry_at`. Concurrency refusals are not kept (a slot may free at any
    /// moment). The bound is there because the store's count may include reservations
    /// of other gateways that they refund later (a refund on this gateway forgets the
    /// entry at once, see [`Ticket::release`]).
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
