//! After the response: CHARGE the limits that were only checked ([`Limiter::charge`]),
//! or RELEASE what the check took ([`Limiter::release`]: refund reservations, give
//! lease units back); charge a request whose client went away ([`PendingCharge`]); give
//! concurrency slots back when the response body ends ([`SlotGuard`]).

use super::algorithm::{Op, OpKind, Policy};
use super::check::{InFlightGuard, InFlightUnits, Stage};
use super::key::LimitKey;
use super::store::{AnyStore, Item, Late, Store};
use super::{next_id, Admission, Applied, Limiter, Usage};
use std::sync::Arc;

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
    /// The request's units in the in-flight counts, taken out when its charge is handed
    /// to the store (or, once settled, when this is dropped).
    in_flight: Option<InFlightGuard>,
    units: InFlightUnits,
    recent: Arc<super::recent::RecentCharges>,
    /// Reservations whose calls timed out (see `check::Hold::late`): charged when
    /// dropped armed only if they did not land.
    late: Vec<LateHold>,
}

impl PendingCharge {
    /// The request was released (not charged): nothing to do when dropped.
    pub fn settled(&mut self) {
        self.armed = false;
    }

    /// The request is about to be charged by [`Limiter::charge`] with `admission`:
    /// disarm, and hand the in-flight units back to the admission, which takes them out
    /// when the charge is handed to the store.
    pub fn settle(&mut self, admission: &mut Admission) {
        self.armed = false;
        admission.in_flight = self.in_flight.take();
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
        let order = self.units.order();
        // Charged without an answer here: the recent-charge view reads the store next.
        for (key, _, _) in &charges {
            self.recent.forget(key);
        }
        let now_ms = self.clock.now_ms();
        spawn_refunds(&self.store, charges, now_ms);
        drop(self.in_flight.take());
        drop(order);
        let late = std::mem::take(&mut self.late);
        for h in &late {
            self.recent.forget(&h.key);
        }
        spawn_late(&self.store, late, now_ms);
    }
}

/// What to do with a reservation whose call timed out (`check::Hold::late`) once its
/// late answer is known ([`Store::late_reservation`]).
#[derive(Debug, Clone, Copy)]
enum Then {
    /// The request is charged: if the reservation landed, only `top_up` more units (the
    /// upstream said it cost more than was reserved); if it did not, its `cost`.
    Charge { top_up: u64 },
    /// The request is not charged (or was refused): if the reservation landed, refund
    /// it.
    Release,
}

/// One reservation that timed out, to settle in the background ([`spawn_late`]).
#[derive(Debug)]
struct LateHold {
    key: LimitKey,
    policy: Policy,
    /// The reservation's op id.
    id: u64,
    /// The units the request counts (charged if the reservation did not land, refunded
    /// if it landed and `then` is [`Then::Release`]).
    cost: u64,
    then: Then,
}

/// The reservations of `admission` that timed out (`check::Hold::late`), of the limits
/// whose stage `which` picks, to settle with `then` (given the stage: only a held
/// reservation is topped up, as [`Limiter::charge`] does).
fn late_holds(
    applied: &[Applied],
    admission: &Admission,
    cost: u64,
    then: impl Fn(Stage) -> Then,
    which: impl Fn(Stage) -> bool,
) -> Vec<LateHold> {
    applied
        .iter()
        .zip(&admission.holds)
        .filter(|(_, h)| which(h.stage))
        .filter_map(|(a, h)| {
            Some(LateHold {
                key: a.key.clone(),
                policy: a.policy,
                id: h.late?,
                cost,
                then: then(h.stage),
            })
        })
        .collect()
}

/// Settle `late` in the background: wait for what became of each reservation (bounded
/// by the store: Redis answers within 6 × `store.timeout`), then charge the request
/// only if its reservation did not land (and top it up if it landed and cost more), or
/// refund a reservation that landed for a request that is not charged. When nothing is
/// known (the late call failed too), nothing is sent: the reservation may have landed,
/// and a request is never counted twice. Without a runtime nothing is sent.
fn spawn_late(store: &Arc<AnyStore>, late: Vec<LateHold>, now_ms: u64) {
    if late.is_empty() {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let store = store.clone();
    rt.spawn(async move {
        let outcomes =
            futures_util::future::join_all(late.iter().map(|h| store.late_reservation(h.id)))
                .await;
        let mut ops: Vec<Refund> = Vec::new();
        for (h, outcome) in late.iter().zip(outcomes) {
            let op = |kind, cost, id| Op { kind, cost, id };
            match (outcome, h.then) {
                (Late::Landed { .. }, Then::Charge { top_up }) if top_up > 0 => ops.push((
                    h.key.clone(),
                    h.policy,
                    op(OpKind::Charge, top_up, next_id()),
                )),
                (Late::NotLanded, Then::Charge { .. }) => ops.push((
                    h.key.clone(),
                    h.policy,
                    op(OpKind::Charge, h.cost, next_id()),
                )),
                (Late::Landed { epoch }, Then::Release) => ops.push((
                    h.key.clone(),
                    h.policy,
                    op(OpKind::Refund, h.cost, epoch),
                )),
                _ => {}
            }
            tracing::debug!(id = h.id, ?outcome, then = ?h.then, "reservation that timed out settled");
        }
        if ops.is_empty() {
            return;
        }
        let items: Vec<Item<'_>> = ops
            .iter()
            .map(|(key, policy, op)| Item {
                key,
                policy,
                op: *op,
            })
            .collect();
        let _ = store.submit(&items, now_ms).await;
    });
}

/// Gives back concurrency slots when dropped: when the response body ends, fails, or
/// the client goes away (see [`Limiter::slots`]).
#[derive(Debug)]
pub struct SlotGuard {
    store: Arc<AnyStore>,
    clock: crate::clock::SharedClock,
    /// The refund of each slot.
    slots: Vec<Refund>,
    /// Slots whose calls timed out (`check::Hold::late`): given back if they landed.
    late: Vec<LateHold>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        let now_ms = self.clock.now_ms();
        spawn_refunds(&self.store, slots, now_ms);
        spawn_late(&self.store, std::mem::take(&mut self.late), now_ms);
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

/// Hand `refunds` (or charges) to the store now (one store call per shard) and await
/// the answers in the background. Without a runtime nothing is sent: reservations then
/// stand and slots expire after their window.
fn spawn_refunds(store: &AnyStore, refunds: Vec<Refund>, now_ms: u64) {
    if refunds.is_empty() {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let items: Vec<Item<'_>> = refunds
        .iter()
        .map(|(key, policy, op)| Item {
            key,
            policy,
            op: *op,
        })
        .collect();
    let answers = store.submit(&items, now_ms);
    rt.spawn(answers);
}

impl Limiter {
    /// CHARGE `cost` to every limit that was peeked (one store call per shard) and
    /// return the usage after the charge; where a charge fails, the usage from the
    /// CHECK stands. Reserved, leased and concurrency limits were counted by the CHECK;
    /// their usage from it stands.
    pub async fn charge(
        &self,
        applied: &[Applied],
        cost: u64,
        now_ms: u64,
        mut admission: Admission,
    ) -> Vec<Option<Usage>> {
        // Checked limits are charged `cost`; held ones (reserved at the check) the
        // difference when the upstream said the request cost more than was reserved.
        let top_up = cost.saturating_sub(admission.cost);
        let charged: Vec<(usize, u64)> = (0..applied.len())
            .filter_map(|i| match admission.holds[i].stage {
                Stage::Peek => Some((i, cost)),
                Stage::Held if top_up > 0 && admission.holds[i].late.is_none() => Some((i, top_up)),
                _ => None,
            })
            .collect();
        // Reservations that timed out: charged once their fate is known.
        let late = late_holds(
            applied,
            &admission,
            cost,
            |st| Then::Charge {
                top_up: if st == Stage::Held { top_up } else { 0 },
            },
            |st| matches!(st, Stage::Reserve | Stage::Held),
        );
        if !late.is_empty() {
            for h in &late {
                self.recent.forget(&h.key);
            }
            spawn_late(&self.store, late, now_ms);
        }
        let in_flight = admission.in_flight.take();
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
        // The charge joins the store's queue and its units leave the in-flight counts
        // in one step (see `InFlightUnits`).
        let order = self.in_flight.order();
        // The recent-charge view counts the charges as pending until their answers.
        let tickets: Vec<u64> = if self.recent.enabled() {
            items
                .iter()
                .map(|it| self.recent.sent(it.key, it.op.cost, now_ms))
                .collect()
        } else {
            Vec::new()
        };
        let answers = self.store.submit(&items, now_ms);
        drop(in_flight);
        drop(order);
        let results = answers.await;
        for (n, (&(i, cost), result)) in charged.iter().zip(results).enumerate() {
            if let Some(&ticket) = tickets.get(n) {
                let after = result.as_ref().ok().map(|v| applied[i].usage(v));
                let key = &applied[i].key;
                self.recent
                    .replied(key, ticket, cost, after.as_ref(), now_ms);
            }
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
    ///
    /// The admission's usages then describe the state after the refund (what the
    /// response's headers show): `cost` units fewer used where units were given back.
    pub fn release(&self, applied: &[Applied], cost: u64, admission: &mut Admission, now_ms: u64) {
        self.give_back_where(applied, cost, admission, now_ms, |st| st != Stage::Slot);
        for (i, a) in applied.iter().enumerate() {
            let given_back = match admission.holds[i].stage {
                Stage::Reserve | Stage::Held => admission.holds[i].epoch.is_some(),
                Stage::Lease => true,
                Stage::Peek | Stage::Slot => false,
            };
            if let (true, Some(Some(u))) = (given_back, admission.usages.get_mut(i)) {
                a.refunded(u, cost, now_ms);
            }
        }
    }

    /// Give back everything `admission` holds, slots included (a refused request).
    pub(super) fn give_back(
        &self,
        applied: &[Applied],
        cost: u64,
        admission: &Admission,
        now_ms: u64,
    ) {
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
                    self.cache.forget(&a.key);
                    self.recent.forget(&a.key);
                }
            }
        }
        let refunds = refunds(applied, admission, cost, |st| {
            matches!(st, Stage::Reserve | Stage::Held | Stage::Slot) && which(st)
        });
        // Units go back to these windows: a refusal remembered for them may not hold.
        for (key, _, _) in &refunds {
            self.cache.forget(key);
            self.recent.forget(key);
        }
        spawn_refunds(&self.store, refunds, now_ms);
        let late = late_holds(
            applied,
            admission,
            cost,
            |_| Then::Release,
            |st| matches!(st, Stage::Reserve | Stage::Held | Stage::Slot) && which(st),
        );
        for h in &late {
            self.cache.forget(&h.key);
            self.recent.forget(&h.key);
        }
        spawn_late(&self.store, late, now_ms);
    }

    /// A guard that charges `applied` (`cost` units) if it is dropped before
    /// [`PendingCharge::settled`]: arm it before forwarding, so that a client that goes
    /// away while the upstream works is charged all the same.
    pub fn pending_charge(
        &self,
        applied: Arc<[Applied]>,
        admission: &mut Admission,
        clock: crate::clock::SharedClock,
    ) -> PendingCharge {
        PendingCharge {
            in_flight: admission.in_flight.take(),
            units: self.in_flight.clone(),
            recent: self.recent.clone(),
            store: self.store.clone(),
            clock,
            checked: admission
                .holds
                .iter()
                .map(|h| h.stage == Stage::Peek)
                .collect(),
            late: late_holds(
                &applied,
                admission,
                admission.cost,
                |_| Then::Charge { top_up: 0 },
                |st| matches!(st, Stage::Reserve | Stage::Held),
            ),
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
        let late = late_holds(
            applied,
            admission,
            1,
            |_| Then::Release,
            |st| st == Stage::Slot,
        );
        (!slots.is_empty() || !late.is_empty()).then(|| SlotGuard {
            store: self.store.clone(),
            clock,
            slots,
            late,
        })
    }
}
