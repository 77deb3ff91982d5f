//! The over-limit cache: callers known to be over a limit until its reset, answered with
//! a 429 in-process without calling the store.
//!
//! Within one fixed window `used` only grows, so a window seen with `used + cost > quota`
//! stays over the limit for any request of at least that cost until `reset_at`. The
//! other algorithms' refusals hold until their `retry_at`, for requests of at least the
//! refused cost (see `Limiter::remember_refusal`). (Lease mode is
//! the exception: gateways give unused units back, so its entries also expire after
//! [`crate::limiter::lease::IDLE_MS`], see [`OverLimitCache::insert_until`].) Entries are
//! keyed by storage key, expire at their `reset_at`, and are bounded by
//! `store.local_cache_size` (when full, expired entries are dropped first; if none are,
//! the new entry is not kept). A reload that changes a limit drops that limit's entries.

use super::key::LimitKey;
use super::sharded::ShardedMap;
use super::Usage;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// A cached refusal: the window as read, trusted until `min(reset_at, until_ms)`.
#[derive(Debug, Clone)]
struct Entry {
    usage: Usage,
    until_ms: u64,
    /// The entry answers only requests of at least this cost.
    min_cost: u64,
}

impl Entry {
    fn live(&self, now_ms: u64) -> bool {
        self.usage.reset_at_ms.min(self.until_ms) > now_ms
    }
}

/// See the module documentation.
#[derive(Debug)]
pub struct OverLimitCache {
    capacity: usize,
    /// Sharded like the memory store, so lookups on the request path rarely contend.
    entries: ShardedMap<Entry>,
    count: AtomicUsize,
    hits: AtomicU64,
}

impl OverLimitCache {
    /// A cache of at most `capacity` entries (0: never keeps anything).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: ShardedMap::default(),
            count: AtomicUsize::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// The cached window of `key`, reported with the caller's own `quota`, if it is over
    /// that quota for `cost` at `now_ms`. (One window may be shared by callers of several
    /// tiers, e.g. with `by = "ip"`: each is judged by its own quota.)
    pub fn get(&self, key: &LimitKey, quota: u64, cost: u64, now_ms: u64) -> Option<Usage> {
        if self.capacity == 0 || self.count.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let entries = self.entries.shard(key);
        let e = entries.get(&key.state)?;
        if e.live(now_ms) && cost >= e.min_cost && e.usage.used.saturating_add(cost) > quota {
            self.hits.fetch_add(1, Ordering::Relaxed);
            Some(Usage {
                quota,
                ..e.usage.clone()
            })
        } else {
            None
        }
    }

    /// Remember that `key` is over the limit as `usage` says until its reset, for
    /// requests of any cost that overflow it (a fixed window).
    pub fn insert(&self, key: &LimitKey, usage: &Usage, now_ms: u64) {
        self.insert_until(key, usage, 1, now_ms, u64::MAX);
    }

    /// Remember that `key` is over the limit as `usage` says, for requests of at least
    /// `min_cost`, until its reset or `until_ms` (ms since the epoch), whichever comes
    /// first (`u64::MAX`: until the reset).
    pub fn insert_until(
        &self,
        key: &LimitKey,
        usage: &Usage,
        min_cost: u64,
        now_ms: u64,
        until_ms: u64,
    ) {
        let entry = Entry {
            usage: usage.clone(),
            until_ms,
            min_cost,
        };
        if self.capacity == 0 || !entry.live(now_ms) {
            return;
        }
        if self.count.load(Ordering::Relaxed) >= self.capacity {
            // Full: drop expired entries everywhere (rare), then give up if still full.
            self.retain(|e| e.live(now_ms));
            if self.count.load(Ordering::Relaxed) >= self.capacity {
                return;
            }
        }
        if self.entries.shard(key).insert(key.state, entry).is_none() {
            self.count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drop the entry of `key`, if any: units of its window were given back (a refund),
    /// so a refusal remembered before may no longer hold.
    pub fn forget(&self, key: &LimitKey) {
        if self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        if self.entries.shard(key).remove(&key.state).is_some() {
            self.count.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn retain(&self, keep: impl FnMut(&Entry) -> bool) {
        let dropped = self.entries.retain(keep);
        self.count.fetch_sub(dropped, Ordering::Relaxed);
    }

    /// Drop every entry of the limit named `resource`.
    pub fn forget_limit(&self, resource: &str) {
        self.retain(|e| &*e.usage.resource != resource);
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Requests answered from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::key::KeyScheme;

    fn k(name: &str) -> LimitKey {
        KeyScheme::new("t:", None).key("core", name)
    }

    fn usage(resource: &str, used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: resource.into(),
            quota: 10,
            used,
            reset_at_ms,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        }
    }

    #[test]
    fn answers_until_reset_and_only_when_over() {
        let c = OverLimitCache::new(10);
        c.insert(&k("k"), &usage("core", 10, 2_000), 1_000);
        assert_eq!(c.get(&k("k"), 10, 1, 1_500).unwrap().used, 10);
        assert!(
            c.get(&k("k"), 5000, 1, 1_500).is_none(),
            "a caller with a larger quota is not over"
        );
        assert!(c.get(&k("k"), 10, 1, 2_000).is_none(), "expired at reset");
        c.insert(&k("k2"), &usage("core", 9, 2_000), 1_000);
        assert!(c.get(&k("k2"), 10, 1, 1_500).is_none(), "room for cost 1");
        assert!(
            c.get(&k("k2"), 10, 2, 1_500).is_some(),
            "no room for cost 2"
        );
        assert_eq!(c.hits(), 2);
    }

    #[test]
    fn bounded_and_cleared_per_limit() {
        let c = OverLimitCache::new(2);
        c.insert(&k("a"), &usage("core", 10, 2_000), 0);
        c.insert(&k("b"), &usage("search", 10, 5_000), 0);
        c.insert(&k("c"), &usage("core", 10, 5_000), 0);
        assert_eq!(c.len(), 2, "full: not kept");
        c.insert(&k("c"), &usage("core", 10, 5_000), 3_000);
        assert_eq!(c.len(), 2, "the expired entry made room");
        c.forget_limit("core");
        assert_eq!(c.len(), 1);
        c.forget(&k("x"));
        assert_eq!(c.len(), 1, "forgetting a key not held changes nothing");
        c.insert(&k("d"), &usage("core", 10, 5_000), 3_000);
        c.forget(&k("d"));
        assert_eq!(c.len(), 1);
        assert!(
            c.get(&k("d"), 10, 1, 3_000).is_none(),
            "a refund forgets the refusal"
        );
        assert!(c.get(&k("b"), 10, 1, 3_000).is_some());
        let off = OverLimitCache::new(0);
        off.insert(&k("a"), &usage("core", 10, 2_000), 0);
        assert!(off.get(&k("a"), 10, 1, 0).is_none());
    }

    #[test]
    fn entries_for_shrinkable_windows_expire_early() {
        let c = OverLimitCache::new(10);
        c.insert_until(&k("k"), &usage("core", 10, 60_000), 1, 1_000, 2_000);
        assert!(c.get(&k("k"), 10, 1, 1_999).is_some());
        assert!(
            c.get(&k("k"), 10, 1, 2_000).is_none(),
            "trusted only until 2_000"
        );
        // And a full cache drops such an entry to make room once it has expired.
        let full = OverLimitCache::new(1);
        full.insert_until(&k("a"), &usage("core", 10, 60_000), 1, 0, 1_000);
        full.insert(&k("b"), &usage("core", 10, 60_000), 1_500);
        assert!(full.get(&k("b"), 10, 1, 1_500).is_some());
    }
}
