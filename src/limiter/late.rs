//! Reservations and slots whose store calls timed out (`hold::Hold::late`): settled in
//! the background once the store tells what became of them.

use super::algorithm::{Op, OpKind, Policy};
use super::hold::{Stage, Taken};
use super::key::LimitKey;
use super::store::{AnyStore, Item, Late, Store};
use super::{next_id, Applied};
use std::sync::Arc;

/// What to do with a reservation whose call timed out once its late answer is known
/// ([`Store::late_reservation`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Then {
    /// The request is charged: if the reservation landed, only `top_up` more units (the
    /// upstream said it cost more than was reserved), or `refund` units back (it said
    /// less); if it did not, its `cost`.
    Charge { top_up: u64, refund: u64 },
    /// The request is not charged (or was refused): if the reservation landed, refund
    /// it.
    Release,
}

/// One reservation that timed out, to settle in the background ([`spawn`]).
#[derive(Debug)]
pub(super) struct LateHold {
    pub(super) key: LimitKey,
    policy: Policy,
    /// The reservation's op id.
    id: u64,
    /// The units the request counts (charged if the reservation did not land, refunded
    /// if it landed and `then` is [`Then::Release`]).
    cost: u64,
    then: Then,
}

/// The reservations of `taken` that timed out, of the limits whose stage `which` picks,
/// to settle with `then` (given the stage: only a held reservation is topped up, as
/// [`Ticket::charge`](super::Ticket::charge) does); `cost` units each.
pub(super) fn holds(
    applied: &[Applied],
    taken: &Taken,
    cost: u64,
    then: impl Fn(Stage) -> Then,
    which: impl Fn(Stage) -> bool,
) -> Vec<LateHold> {
    applied
        .iter()
        .zip(&taken.holds)
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
pub(super) fn spawn(store: &Arc<AnyStore>, late: Vec<LateHold>, now_ms: u64) {
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
        let mut ops: Vec<(LimitKey, Policy, Op)> = Vec::new();
        for (h, outcome) in late.iter().zip(outcomes) {
            let op = |kind, cost, id| Op { kind, cost, id };
            match (outcome, h.then) {
                (Late::Landed { .. }, Then::Charge { top_up, .. }) if top_up > 0 => ops.push((
                    h.key.clone(),
                    h.policy,
                    op(OpKind::Charge, top_up, next_id()),
                )),
                (Late::Landed { epoch }, Then::Charge { refund, .. }) if refund > 0 => ops.push((
                    h.key.clone(),
                    h.policy,
                    op(OpKind::Refund, refund, epoch),
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
