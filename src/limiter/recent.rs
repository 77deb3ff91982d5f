//! The recent-charge view (`store.check_from_charge`): a hot caller's CHECK answered from
//! this gateway's own last CHARGE reply for the same window, without a store call.
//!
//! A CHARGE returns the window as the store holds it right after the charge (its `used`,
//! `reset_at`). For a caller that sends many requests, the next CHECK would read almost
//! the same thing back. With `store.check_from_charge = "100ms"`, a CHECK of a limit
//! charged after the response reads this view instead of the store while the last reply
//! is younger than that, and admits when the view leaves room for the request's cost.
//! Refusals never come from the view: a request the view would refuse goes to the store,
//! so a 429's headers always come from a store read (and the over-limit cache).
//!
//! What the view counts: the store's `used` from the last reply, plus the units of this
//! gateway's charges handed to the store since and not answered yet (`pending`; a shard's
//! replies come back in the order its calls went out, so a reply includes every charge
//! sent before it). The view answers only a request that finds no other of its caller
//! and limit in flight on this gateway (one that does is held by a reservation in the
//! store as usual, see [`super::check`]), and counts it in flight like a store read does.
//! So this gateway's own requests are counted exactly.
//!
//! Staleness: charges by *other* gateways during the last `check_from_charge` are not
//! seen. A fleet of N gateways may overshoot a quota by at most what the other N − 1
//! charge in that time (one gateway: never). A fixed window's entry is used only before
//! its `reset_at`; the other algorithms only free units as time passes, so an older view
//! of them is conservative. Concurrency limits, lease mode and reserved limits never use
//! the view. A reset (`POST /callers/{id}/reset`) or a refund drops the entry here; other
//! gateways' entries expire within `check_from_charge`.
//!
//! Entries are keyed by storage key and bounded by `store.local_cache_size`; when full,
//! stale entries are dropped first, and if none are, a new entry is not kept.

use super::key::LimitKey;
use super::sharded::ShardedMap;
use super::Usage;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// One window as this gateway last saw it charged.
#[derive(Debug, Clone)]
struct Entry {
    /// The usage from the last CHARGE reply (its `used` is the store's count then);
    /// `None` until a reply arrives, and after a failed charge.
    usage: Option<Usage>,
    /// When that reply arrived (ms since the epoch).
    at_ms: u64,
    /// Units of this gateway's charges handed to the store and not answered yet.
    pending: u64,
    /// Which entry a charge's reply belongs to (see [`RecentCharges::sent`]): a reply
    /// to a charge sent before the entry was dropped and made again is ignored.
    ticket: u64,
}

/// See the module documentation.
#[derive(Debug)]
pub struct RecentCharges {
    /// How long a reply answers CHECKs, in ms; 0: off.
    max_age_ms: u64,
    capacity: usize,
    entries: ShardedMap<Entry>,
    count: AtomicUsize,
    tickets: AtomicU64,
    hits: AtomicU64,
}

impl RecentCharges {
    /// A view trusting replies for `max_age_ms` (0: off, nothing is kept), of at most
    /// `capacity` entries.
    pub fn new(max_age_ms: u64, capacity: usize) -> Self {
        Self {
            max_age_ms,
            capacity: if max_age_ms == 0 { 0 } else { capacity },
            entries: ShardedMap::default(),
            count: AtomicUsize::new(0),
            tickets: AtomicU64::new(1),
            hits: AtomicU64::new(0),
        }
    }

    /// Whether the view is on (`store.check_from_charge` above 0).
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// The window of `key` from the view, with `used` counting this gateway's charges
    /// not answered yet, if a reply younger than the bound says `cost` more units fit
    /// under `quota` at `now_ms`; `None` sends the CHECK to the store. `fixed`: a fixed
    /// window, whose entry ends at its `reset_at`.
    pub fn admits(
        &self,
        key: &LimitKey,
        quota: u64,
        cost: u64,
        fixed: bool,
        now_ms: u64,
    ) -> Option<Usage> {
        if self.capacity == 0 || self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let shard = self.entries.shard(key);
        let e = shard.get(&key.state)?;
        let u = e.usage.as_ref()?;
        let fresh = now_ms < e.at_ms.saturating_add(self.max_age_ms);
        let in_window = !fixed || now_ms < u.reset_at_ms;
        let used = u.used.saturating_add(e.pending);
        if !(fresh && in_window && used.saturating_add(cost) <= quota) {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(Usage {
            quota,
            used,
            ..u.clone()
        })
    }

    /// A charge of `cost` units to `key` is being handed to the store: count it as
    /// pending until its reply. Call it in the same step that takes the units out of the
    /// in-flight counts. Returns the ticket to give [`RecentCharges::replied`] (0 when
    /// nothing is kept).
    pub fn sent(&self, key: &LimitKey, cost: u64, now_ms: u64) -> u64 {
        if self.capacity == 0 {
            return 0;
        }
        if let Some(e) = self.entries.shard(key).get_mut(&key.state) {
            e.pending = e.pending.saturating_add(cost);
            return e.ticket;
        }
        if self.count.load(Ordering::Relaxed) >= self.capacity {
            // Full: drop the entries no reply can be trusted from any more (rare).
            let dropped = self
                .entries
                .retain(|e| e.pending > 0 || now_ms < e.at_ms.saturating_add(self.max_age_ms));
            self.count.fetch_sub(dropped, Ordering::Relaxed);
            if self.count.load(Ordering::Relaxed) >= self.capacity {
                return 0;
            }
        }
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let mut shard = self.entries.shard(key);
        let e = shard.entry(key.state).or_insert_with(|| {
            self.count.fetch_add(1, Ordering::Relaxed);
            Entry {
                usage: None,
                at_ms: 0,
                pending: 0,
                ticket,
            }
        });
        e.pending = e.pending.saturating_add(cost);
        e.ticket
    }

    /// The reply to a charge of `cost` units to `key` (sent with
    /// [`RecentCharges::sent`], which gave `ticket`) arrived at `now_ms`: `Some(usage)`
    /// after the charge, or `None` when the charge failed.
    pub fn replied(
        &self,
        key: &LimitKey,
        ticket: u64,
        cost: u64,
        usage: Option<&Usage>,
        now_ms: u64,
    ) {
        if ticket == 0 {
            return;
        }
        let mut shard = self.entries.shard(key);
        let Some(e) = shard.get_mut(&key.state).filter(|e| e.ticket == ticket) else {
            return;
        };
        e.pending = e.pending.saturating_sub(cost);
        // A failed charge: what the store holds is unknown; read it next time.
        e.usage = usage.cloned();
        e.at_ms = now_ms;
    }

    /// Drop the entry of `key`: units went back to its window (a refund) or it was reset.
    /// The reply of a charge still pending then finds no entry and is ignored.
    pub fn forget(&self, key: &LimitKey) {
        if self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        if self.entries.shard(key).remove(&key.state).is_some() {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Drop every entry (a reload changed a limit: windows may mean something else).
    pub fn clear(&self) {
        let dropped = self.entries.retain(|_| false);
        self.count.fetch_sub(dropped, Ordering::Relaxed);
    }

    /// CHECKs answered from the view so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::key::KeyScheme;

    fn usage(used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: "core".into(),
            quota: 10,
            used,
            reset_at_ms,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        }
    }

    #[test]
    fn admits_only_within_the_bound_the_window_and_the_quota() {
        let key = KeyScheme::new("t:", None).key("core", "acme");
        let view = RecentCharges::new(100, 10);
        assert_eq!(
            view.admits(&key, 10, 1, true, 1_000),
            None,
            "nothing seen yet"
        );
        let t = view.sent(&key, 1, 1_000);
        assert_eq!(view.admits(&key, 10, 1, true, 1_000), None, "no answer yet");
        view.replied(&key, t, 1, Some(&usage(4, 5_000)), 1_000);
        assert_eq!(
            view.admits(&key, 10, 1, true, 1_050).map(|u| u.used),
            Some(4)
        );
        // A charge sent and not answered counts.
        let t2 = view.sent(&key, 3, 1_050);
        assert_eq!(
            view.admits(&key, 10, 1, true, 1_050).map(|u| u.used),
            Some(7)
        );
        assert_eq!(view.admits(&key, 10, 4, true, 1_050), None, "7 + 4 > 10");
        view.replied(&key, t2, 3, Some(&usage(7, 5_000)), 1_060);
        assert_eq!(
            view.admits(&key, 10, 3, true, 1_100).map(|u| u.used),
            Some(7)
        );
        assert_eq!(
            view.admits(&key, 10, 1, true, 1_160),
            None,
            "older than the bound"
        );
        // A fixed window's answer ends at its reset; other algorithms' do not.
        let t3 = view.sent(&key, 1, 4_990);
        view.replied(&key, t3, 1, Some(&usage(8, 5_000)), 4_990);
        assert_eq!(view.admits(&key, 10, 1, true, 5_000), None);
        assert!(view.admits(&key, 10, 1, false, 5_000).is_some());
        // A failed charge: read the store next time.
        let t4 = view.sent(&key, 1, 5_000);
        view.replied(&key, t4, 1, None, 5_000);
        assert_eq!(view.admits(&key, 10, 1, false, 5_001), None);
    }

    #[test]
    fn an_answer_to_a_charge_sent_before_a_forget_is_ignored() {
        let key = KeyScheme::new("t:", None).key("core", "acme");
        let view = RecentCharges::new(100, 10);
        let old = view.sent(&key, 1, 0);
        view.forget(&key);
        let new = view.sent(&key, 1, 0);
        assert_ne!(old, new);
        view.replied(&key, old, 1, Some(&usage(1, 5_000)), 0);
        assert_eq!(
            view.admits(&key, 10, 1, true, 1),
            None,
            "still waiting for its own"
        );
        view.replied(&key, new, 1, Some(&usage(2, 5_000)), 0);
        assert_eq!(view.admits(&key, 10, 1, true, 1).map(|u| u.used), Some(2));
    }

    #[test]
    fn off_keeps_nothing_and_a_full_view_drops_stale_entries() {
        let scheme = KeyScheme::new("t:", None);
        let off = RecentCharges::new(0, 10);
        assert_eq!(off.sent(&scheme.key("core", "a"), 1, 0), 0);
        assert!(off.is_empty());
        let view = RecentCharges::new(100, 1);
        let (a, b) = (scheme.key("core", "a"), scheme.key("core", "b"));
        let t = view.sent(&a, 1, 0);
        view.replied(&a, t, 1, Some(&usage(1, 5_000)), 0);
        assert_eq!(
            view.sent(&b, 1, 50),
            0,
            "full, and a's answer is still fresh"
        );
        assert_ne!(view.sent(&b, 1, 200), 0, "a's answer went stale: dropped");
        assert_eq!(view.len(), 1);
    }
}
