//! Work handed to the store in the background: the concurrency slots a response body
//! gives back when it ends ([`SlotGuard`]), and refunds (or charges) sent without
//! waiting ([`spawn_refunds`]).

use super::algorithm::{Op, OpKind, Policy};
use super::hold::{Stage, Taken};
use super::key::LimitKey;
use super::late::{self, Then};
use super::store::{AnyStore, Item, Store};
use super::{Applied, Limiter};
use std::sync::Arc;

/// Gives back concurrency slots when dropped: when the response body ends, fails, or
/// the client goes away (see [`super::Ticket::slots`]).
#[derive(Debug)]
pub struct SlotGuard {
    store: Arc<AnyStore>,
    clock: crate::clock::SharedClock,
    /// The refund of each slot.
    slots: Vec<Refund>,
    /// Slots whose calls timed out (`check::Hold::late`): given back if they landed.
    late: Vec<late::LateHold>,
}

impl SlotGuard {
    /// The guard of the slots `taken` holds for `applied` (given back through
    /// `limiter`'s store, at the time `clock` tells then); `None` when it holds none.
    pub(super) fn of(
        limiter: &Limiter,
        applied: &[Applied],
        taken: &Taken,
        clock: crate::clock::SharedClock,
    ) -> Option<Self> {
        let slots = refunds(applied, taken, 1, |st| st == Stage::Slot);
        let late = late::holds(applied, taken, 1, |_| Then::Release, |st| st == Stage::Slot);
        (!slots.is_empty() || !late.is_empty()).then(|| SlotGuard {
            store: limiter.store.clone(),
            clock,
            slots,
            late,
        })
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        let now_ms = self.clock.now_ms();
        spawn_refunds(&self.store, slots, now_ms);
        late::spawn(&self.store, std::mem::take(&mut self.late), now_ms);
    }
}

/// One operation to send in the background: a refund ([`OpKind::Refund`]), or the
/// charge of a request whose client went away.
pub(super) type Refund = (LimitKey, Policy, Op);

/// The refunds of the reservations and slots `taken` holds for the limits whose stage
/// `which` picks: `cost` units back from each (slots ignore the cost).
pub(super) fn refunds(
    applied: &[Applied],
    taken: &Taken,
    cost: u64,
    which: impl Fn(Stage) -> bool,
) -> Vec<Refund> {
    applied
        .iter()
        .zip(&taken.holds)
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
pub(super) fn spawn_refunds(store: &AnyStore, refunds: Vec<Refund>, now_ms: u64) {
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
