//! What a CHECK admitted, owned by the request until it ends ([`Ticket`]): charged,
//! released, or charged in the background when dropped.

use super::algorithm::{Op, OpKind};
use super::hold::{Stage, Taken};
use super::in_flight::InFlightGuard;
use super::late::{self, Then};
use super::slots::{self, Refund, SlotGuard};
use super::{next_id, Applied, Limiter, Usage};
use crate::clock::SharedClock;
use std::sync::Arc;

/// A request's hold on its limits, from the CHECK that admitted it ([`Limiter::check`])
/// to the end of the request. Called a ticket because, like a parking ticket, it is
/// issued on the way in and handed back exactly once on the way out: paid
/// ([`Ticket::charge`]) or voided ([`Ticket::release`]); both borrow it, so that the
/// request's state keeps it in place, and once it is handed back a second charge or
/// release does nothing. It owns every unit the check
/// took or counted (reservations, leased units, concurrency slots, the units counted in
/// flight on this gateway), so none is counted twice or lost:
///
/// - [`Ticket::slots`] hands the concurrency slots out as the response body's guard,
///   which gives them back when the body ends;
/// - [`Ticket::charge`] charges the limits that were only checked and keeps what was
///   reserved or leased;
/// - [`Ticket::release`] refunds reservations and gives leased units back (an uncharged
///   status, or the upstream failed);
/// - dropped without either, the request counts (the client went away, or its body
///   timed out, while the upstream had it, which may have served it): the limits that
///   were only checked are charged `cost` in the background, reservations and leased
///   units stand.
///
/// Slots not handed out are given back when the ticket is charged, released or dropped.
#[derive(Debug)]
pub struct Ticket<'a> {
    pub(super) limiter: &'a Limiter,
    /// Read when the ticket is dropped (the time of its background charge), and held by
    /// the slot guard.
    clock: &'a SharedClock,
    pub(super) applied: Arc<[Applied]>,
    pub(super) taken: Taken,
    /// The request's units in the in-flight counts, taken out when its charge is handed
    /// to the store, or when it is released.
    pub(super) in_flight: Option<InFlightGuard<'a>>,
    /// Whether it holds concurrency slots not yet handed out ([`Ticket::slots`]).
    slots_held: bool,
    /// Neither charged nor released yet: charged in the background when dropped.
    pub(super) open: bool,
}

impl<'a> Ticket<'a> {
    /// The ticket of a request `limiter` admitted with `taken` for `applied`.
    pub(super) fn new(
        limiter: &'a Limiter,
        clock: &'a SharedClock,
        applied: Arc<[Applied]>,
        taken: Taken,
        in_flight: Option<InFlightGuard<'a>>,
    ) -> Self {
        let slots_held = taken.holds.iter().any(|h| h.stage == Stage::Slot);
        Self {
            limiter,
            clock,
            applied,
            taken,
            in_flight,
            slots_held,
            open: true,
        }
    }

    /// The usage of each applied limit as the check found it, in order (`None` where
    /// the store failed and `store.on_error = "allow"` let the request through).
    pub fn usages(&self) -> &[Option<Usage>] {
        &self.taken.usages
    }

    /// Whether a limit was answered by `store.on_error = "local"`'s enforcement in
    /// this gateway's memory (its Redis shard failing).
    pub fn local(&self) -> bool {
        self.taken.local
    }

    /// Refusals of limits in shadow mode (or outside their `enforce_percent`): the
    /// request was let through; report them ("would reject").
    pub fn shadowed(&self) -> &[Usage] {
        &self.taken.shadowed
    }

    /// The limits the ticket holds, as the check was given them.
    pub fn applied(&self) -> &Arc<[Applied]> {
        &self.applied
    }

    /// The units the check took or counted (the route's `cost`).
    pub fn cost(&self) -> u64 {
        self.taken.cost
    }

    /// Hand out the concurrency slots this ticket holds, as a guard that gives them back
    /// when dropped (put it in the response body: they are given back when the body
    /// ends, fails, or the client goes away). `None` when it holds none, or handed them
    /// out before.
    pub fn slots(&mut self) -> Option<SlotGuard> {
        if !std::mem::take(&mut self.slots_held) {
            return None;
        }
        SlotGuard::of(self.limiter, &self.applied, &self.taken, self.clock.clone())
    }

    /// Mark the ticket handed back (charged or released): dropping it then does nothing
    /// more than take its units out of the in-flight counts. Slots not handed out are
    /// given back now.
    pub(super) fn close(&mut self) {
        self.open = false;
        drop(self.slots());
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        self.close();
        let limiter = self.limiter;
        let cost = self.taken.cost;
        let charges: Vec<Refund> = self
            .applied
            .iter()
            .zip(&self.taken.holds)
            .filter(|(_, h)| h.stage == Stage::Peek)
            .map(|(a, _)| {
                let op = Op {
                    kind: OpKind::Charge,
                    cost,
                    id: next_id(),
                };
                (a.key.clone(), a.policy, op)
            })
            .collect();
        tracing::debug!(
            limits = charges.len(),
            "client went away; charging the forwarded request"
        );
        let order = limiter.in_flight.order();
        // Charged without an answer here: the recent-charge view reads the store next.
        for (key, _, _) in &charges {
            limiter.recent.forget(key);
        }
        let now_ms = self.clock.now_ms();
        slots::spawn_refunds(&limiter.store, charges, now_ms);
        drop(self.in_flight.take());
        drop(order);
        // Reservations whose calls timed out: charged only if they did not land.
        let late = late::holds(
            &self.applied,
            &self.taken,
            cost,
            |_| Then::Charge {
                top_up: 0,
                refund: 0,
            },
            |st| matches!(st, Stage::Reserve | Stage::Held),
        );
        for h in &late {
            limiter.recent.forget(&h.key);
        }
        late::spawn(&limiter.store, late, now_ms);
    }
}
