//! After the response: CHARGE the limits that were only checked ([`Ticket::charge`]),
//! or RELEASE what the check took ([`Ticket::release`]: refund reservations, give lease
//! units back); give concurrency slots back when the response body ends
//! ([`SlotGuard`]); give back everything a refused check took.

use super::algorithm::{Op, OpKind};
use super::hold::{Stage, Taken};
use super::late::{self, Then};
use super::slots::{refunds, spawn_refunds};
use super::store::{CallNote, Item, Store};
use super::ticket::Ticket;
use super::{next_id, Applied, Limiter, Usage};
use std::future::Future;

impl<'a> Ticket<'a> {
    /// CHARGE `cost` units (what the request cost: the route's `cost`, or what the
    /// upstream said) to every limit that was only checked, at `now_ms` (epoch
    /// milliseconds), one store call per shard, and return the usage of each applied
    /// limit after the charge; where a charge fails, the usage from the CHECK stands.
    /// Reserved and leased limits were counted by the CHECK (the route's cost) and are
    /// SETTLED to `cost`: when it is less, the difference is refunded (a reservation
    /// through the store's refund, which gives nothing back to a window that has ended
    /// since; leased units to this gateway's lease of the same window); when it is
    /// more, the excess is charged, past the quota if need be. Concurrency limits count
    /// requests in flight, not cost, and keep their slot.
    ///
    /// The charge is handed to the store when this is called (not when the returned
    /// future is first polled), so a request cancelled from here on is counted once;
    /// the future awaits the answers. It borrows the ticket, which its owner keeps
    /// (closed: a second `charge` or `release` does nothing, and dropping it charges
    /// nothing more), so that the ticket is not moved into the future. A plain
    /// function, not an `async fn`: an `async fn` would keep its arguments twice in
    /// its state (rust-lang/rust#62958).
    pub fn charge<'t>(
        &'t mut self,
        cost: u64,
        now_ms: u64,
    ) -> impl Future<Output = Vec<Option<Usage>>> + Send + use<'a, 't>
    where
        'a: 't,
    {
        self.charge_noted(cost, now_ms, None)
    }

    /// [`Ticket::charge`], noting its store call in `note` (a sampled request's trace:
    /// shard, node, script, batch, a breaker found open).
    pub fn charge_noted<'t>(
        &'t mut self,
        cost: u64,
        now_ms: u64,
        note: Option<&'t mut CallNote>,
    ) -> impl Future<Output = Vec<Option<Usage>>> + Send + use<'a, 't>
    where
        'a: 't,
    {
        // A ticket is handed back once: charged or released before, it charges nothing.
        let was_open = self.open;
        self.close();
        let limiter = self.limiter;
        let applied = &*self.applied;
        let taken = &self.taken;
        // Checked limits are charged `cost`; limits that took the route's cost at the
        // check (reserved, held or leased) are settled to `cost`: charged the excess
        // when the upstream said the request cost more, refunded the difference when
        // it said less.
        let top_up = cost.saturating_sub(taken.cost);
        let refund = if was_open {
            taken.cost.saturating_sub(cost)
        } else {
            0
        };
        let mut charged: Vec<(usize, u64)> = (0..applied.len())
            .filter(|_| was_open)
            .filter_map(|i| match taken.holds[i].stage {
                Stage::Peek => Some((i, cost)),
                Stage::Reserve | Stage::Held if top_up > 0 && taken.holds[i].late.is_none() => {
                    Some((i, top_up))
                }
                _ => None,
            })
            .collect();
        // Leased limits take the excess from this gateway's lease while it holds it
        // (those units are counted in the window already), and charge the rest.
        let mut leased_more: Vec<usize> = Vec::new();
        if was_open && top_up > 0 {
            for (i, a) in applied.iter().enumerate() {
                let usage = taken.usages.get(i).and_then(Option::as_ref);
                if let (Stage::Lease, Some(u)) = (taken.holds[i].stage, usage) {
                    let rest = limiter
                        .leases
                        .take_excess(&a.key, top_up, u.reset_at_ms, now_ms);
                    if rest > 0 {
                        charged.push((i, rest));
                    }
                    leased_more.push(i);
                    limiter.cache.forget(&a.key);
                }
            }
        }
        // The difference refunded: reservations that landed (the store gives nothing
        // back to a window that has ended since: the refund quotes the reservation's
        // epoch), and leased units to this gateway's lease of the same window.
        let mut given_back: Vec<usize> = Vec::new();
        if refund > 0 {
            for (i, a) in applied.iter().enumerate() {
                let hold = &taken.holds[i];
                let usage = taken.usages.get(i).and_then(Option::as_ref);
                match (hold.stage, usage) {
                    (Stage::Lease, Some(u)) => {
                        limiter.leases.give_back(&a.key, refund, u.reset_at_ms);
                        given_back.push(i);
                    }
                    (Stage::Reserve | Stage::Held, _) if hold.epoch.is_some() => {
                        given_back.push(i);
                    }
                    _ => continue,
                }
                limiter.cache.forget(&a.key);
                limiter.recent.forget(&a.key);
            }
            let back = refunds(applied, taken, refund, |st| {
                matches!(st, Stage::Reserve | Stage::Held)
            });
            spawn_refunds(&limiter.store, back, now_ms);
        }
        // Reservations that timed out: charged once their fate is known (settled to
        // `cost` if they landed).
        let late = late::holds(
            applied,
            taken,
            cost,
            |_| Then::Charge { top_up, refund },
            |st| matches!(st, Stage::Reserve | Stage::Held),
        );
        if was_open && !late.is_empty() {
            for h in &late {
                limiter.recent.forget(&h.key);
            }
            late::spawn(&limiter.store, late, now_ms);
        }
        let in_flight = self.in_flight.take();
        let submitted = if charged.is_empty() || cost == 0 {
            drop(in_flight);
            None
        } else {
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
            // The charge joins the store's queue and its units leave the in-flight
            // counts in one step (see `InFlightUnits`).
            let order = limiter.in_flight.order();
            // The recent-charge view counts the charges as pending until their answers.
            let pending: Vec<u64> = if limiter.recent.enabled() {
                items
                    .iter()
                    .map(|it| limiter.recent.sent(it.key, it.op.cost, now_ms))
                    .collect()
            } else {
                Vec::new()
            };
            let answers = limiter.store.submit(&items, now_ms);
            drop(in_flight);
            drop(order);
            Some((answers, pending))
        };
        async move {
            let mut usages = std::mem::take(&mut self.taken.usages);
            for &i in &given_back {
                if let Some(Some(u)) = usages.get_mut(i) {
                    self.applied[i].refunded(u, refund, now_ms);
                }
            }
            // A lease's usage is this gateway's view of the window (the units it still
            // holds not counted): the check's, plus the excess.
            for &i in &leased_more {
                if let Some(Some(u)) = usages.get_mut(i) {
                    u.used = u.used.saturating_add(top_up);
                }
            }
            let Some((answers, pending)) = submitted else {
                return usages;
            };
            let answered = answers.await;
            let (limiter, applied) = (self.limiter, &*self.applied);
            if let Some(n) = note {
                n.noted(answered.call, answered.calls, &limiter.store);
            }
            let results = answered.answers;
            for (n, (&(i, cost), result)) in charged.iter().zip(results).enumerate() {
                if let Some(&sent) = pending.get(n) {
                    let after = result.as_ref().ok().map(|v| applied[i].usage(v));
                    let key = &applied[i].key;
                    limiter
                        .recent
                        .replied(key, sent, cost, after.as_ref(), now_ms);
                }
                match result {
                    Ok(_) if self.taken.holds[i].stage == Stage::Lease => {}
                    Ok(v) => {
                        let mut u = applied[i].usage(&v);
                        limiter.local_share(&applied[i], &mut u);
                        usages[i] = Some(u);
                    }
                    Err(e) => limiter
                        .warn_gate
                        .warn(&e, "charge failed; the request was not counted"),
                }
            }
            usages
        }
    }

    /// RELEASE: the request is not charged after all (an uncharged status, or the
    /// upstream failed), at `now_ms` (epoch milliseconds): reservations are refunded
    /// and lease-mode limits get their units back, in the background. Limits that were
    /// only checked were never charged. Slots handed out ([`Ticket::slots`]) are given
    /// back by their guard when the response ends.
    ///
    /// Returns the usage of each applied limit after the refund (what the response's
    /// headers show): the check's, with `cost` units fewer used where units were given
    /// back.
    pub fn release(&mut self, now_ms: u64) -> Vec<Option<Usage>> {
        // A ticket is handed back once: charged or released before, it gives back nothing.
        if !self.open {
            return Vec::new();
        }
        self.close();
        // Its units leave the in-flight counts now, as when the ticket is dropped.
        drop(self.in_flight.take());
        let cost = self.taken.cost;
        self.limiter
            .give_back_where(&self.applied, &self.taken, now_ms, |st| st != Stage::Slot);
        let mut usages = std::mem::take(&mut self.taken.usages);
        for (i, a) in self.applied.iter().enumerate() {
            let hold = &self.taken.holds[i];
            let given_back = match hold.stage {
                Stage::Reserve | Stage::Held => hold.epoch.is_some(),
                Stage::Lease => true,
                Stage::Peek | Stage::Slot => false,
            };
            if let (true, Some(Some(u))) = (given_back, usages.get_mut(i)) {
                a.refunded(u, cost, now_ms);
            }
        }
        usages
    }
}

impl Limiter {
    /// Give back everything `taken` holds for `applied`, slots included (a refused
    /// request).
    pub(super) fn give_back(&self, applied: &[Applied], taken: &Taken, now_ms: u64) {
        self.give_back_where(applied, taken, now_ms, |_| true);
    }

    /// Give back what `taken` holds for the limits of `applied` whose stage `which`
    /// picks: lease units to this gateway's lease, refunds of reservations and slots to
    /// the store (in the background), and reservations that timed out once their fate
    /// is known. The over-limit cache and the recent-charge view forget those windows.
    pub(super) fn give_back_where(
        &self,
        applied: &[Applied],
        taken: &Taken,
        now_ms: u64,
        which: impl Fn(Stage) -> bool,
    ) {
        let cost = taken.cost;
        for (i, a) in applied.iter().enumerate() {
            if taken.holds[i].stage == Stage::Lease && which(Stage::Lease) {
                if let Some(Some(u)) = taken.usages.get(i) {
                    self.leases.give_back(&a.key, cost, u.reset_at_ms);
                    self.cache.forget(&a.key);
                    self.recent.forget(&a.key);
                }
            }
        }
        let refunds = refunds(applied, taken, cost, |st| {
            matches!(st, Stage::Reserve | Stage::Held | Stage::Slot) && which(st)
        });
        // Units go back to these windows: a refusal remembered for them may not hold.
        for (key, _, _) in &refunds {
            self.cache.forget(key);
            self.recent.forget(key);
        }
        spawn_refunds(&self.store, refunds, now_ms);
        let late = late::holds(
            applied,
            taken,
            cost,
            |_| Then::Release,
            |st| matches!(st, Stage::Reserve | Stage::Held | Stage::Slot) && which(st),
        );
        for h in &late {
            self.cache.forget(&h.key);
            self.recent.forget(&h.key);
        }
        late::spawn(&self.store, late, now_ms);
    }
}

#[cfg(test)]
mod tests {
    use crate::clock::{SharedClock, SystemClock};
    use crate::limiter::Applied;
    use crate::snapshot::Snapshot;
    use std::sync::Arc;

    /// A memory-store snapshot with one route and the limit `core` (quota 100 per
    /// `window`).
    fn snapshot(window: &str) -> Snapshot {
        let toml = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\
             [store]\nbackend = \"memory\"\n\
             [[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9\"]\n\
             [[limits]]\nname = \"core\"\nwindow = \"{window}\"\nquota = {{ anonymous = 100 }}\n\
             [[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\nlimits = [\"core\"]\n"
        );
        let file = crate::config::parse(std::path::Path::new("t.toml"), toml).expect("parses");
        let files = crate::load::Loaded::load(&file, None);
        Snapshot::build(&file, &files, None).expect("valid")
    }

    /// The limits of `snap`'s route that apply to an anonymous caller.
    fn applied(snap: &Snapshot) -> Arc<[Applied]> {
        let route = snap
            .router
            .find(None, "/x", &http::Method::GET)
            .expect("route");
        let headers = http::HeaderMap::new();
        let caller = snap
            .identities
            .identify(&headers, "203.0.113.7".parse().unwrap())
            .expect("caller");
        snap.limiter
            .applicable(&route.limits, &caller, &headers)
            .into()
    }

    /// A ticket is handed back once: a second `charge` (or a `release` after it)
    /// counts nothing more, and dropping it afterwards charges nothing.
    #[tokio::test]
    async fn a_ticket_counts_once_however_often_it_is_handed_back() {
        let snap = snapshot("1h");
        let clock: SharedClock = Arc::new(SystemClock);
        let now_ms = clock.now_ms();
        let applied = applied(&snap);
        let used = |ticket: &super::Ticket<'_>| ticket.usages()[0].as_ref().map(|u| u.used);

        let mut ticket = snap
            .limiter
            .check(&applied, 3, false, &clock, now_ms, None)
            .await
            .expect("admitted");
        assert_eq!(used(&ticket), Some(0));
        let charged = ticket.charge(3, now_ms).await;
        assert_eq!(charged[0].as_ref().map(|u| u.used), Some(3));
        assert!(ticket.charge(3, now_ms).await.is_empty());
        assert!(ticket.release(now_ms).is_empty());
        drop(ticket);

        let next = snap
            .limiter
            .check(&applied, 1, false, &clock, now_ms, None)
            .await
            .expect("admitted");
        assert_eq!(used(&next), Some(3), "charged once, 3 units");
    }

    /// A reservation settled to a smaller cost gives the difference back to its
    /// window only: once that window has ended, the new one gets nothing.
    #[tokio::test]
    async fn a_settled_reservation_refunds_only_its_own_window() {
        let snap = snapshot("1m");
        let clock: SharedClock = Arc::new(SystemClock);
        let t0 = clock.now_ms();
        let applied = applied(&snap);
        let used = |ticket: &super::Ticket<'_>| ticket.usages()[0].as_ref().map(|u| u.used);

        // Within its window: 10 reserved, settled to 3, 7 back.
        let mut ticket = snap
            .limiter
            .check(&applied, 10, true, &clock, t0, None)
            .await
            .expect("admitted");
        assert_eq!(used(&ticket), Some(10));
        let settled = ticket.charge(3, t0).await;
        assert_eq!(settled[0].as_ref().map(|u| u.used), Some(3));
        drop(ticket);
        let mut next = snap
            .limiter
            .check(&applied, 10, true, &clock, t0, None)
            .await
            .expect("admitted");
        assert_eq!(used(&next), Some(13), "3 + the next 10");

        // Settled after its window ended: nothing goes to the new window.
        let later = t0 + 61_000;
        next.charge(1, later).await;
        drop(next);
        let fresh = snap
            .limiter
            .check(&applied, 5, true, &clock, later, None)
            .await
            .expect("admitted");
        assert_eq!(used(&fresh), Some(5), "the new window holds only its own 5");
    }
}
