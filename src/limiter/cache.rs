//! The over-limit cache: callers known to be over a limit until its reset, answered with
//! a 429 in-process without calling the store.
//!
//! Within one window `used` only grows, so a window seen with `used + cost > quota` stays
//! over the limit for any request of at least that cost until `reset_at`. Entries are
//! keyed by storage key, expire at their `reset_at`, and are bounded by
//! `store.local_cache_size` (when full, expired entries are dropped first; if none are,
//! the new entry is not kept). A reload that changes a limit drops that limit's entries.

use super::Usage;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// See the module documentation.
#[derive(Debug)]
pub struct OverLimitCache {
    capacity: usize,
    entries: Mutex<HashMap<String, Usage>>,
    hits: AtomicU64,
}

impl OverLimitCache {
    /// A cache of at most `capacity` entries (0: never keeps anything).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Usage>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached window of `key`, reported with the caller's own `quota`, if it is over
    /// that quota for `cost` at `now_ms`. (One window may be shared by callers of several
    /// tiers, e.g. with `by = "ip"`: each is judged by its own quota.)
    pub fn get(&self, key: &str, quota: u64, cost: u64, now_ms: u64) -> Option<Usage> {
        if self.capacity == 0 {
            return None;
        }
        let entries = self.lock();
        let u = entries.get(key)?;
        if u.reset_at_ms > now_ms && u.used.saturating_add(cost) > quota {
            self.hits.fetch_add(1, Ordering::Relaxed);
            Some(Usage { quota, ..u.clone() })
        } else {
            None
        }
    }

    /// Remember that `key` is over the limit as `usage` says, until its reset.
    pub fn insert(&self, key: &str, usage: &Usage, now_ms: u64) {
        if self.capacity == 0 || usage.reset_at_ms <= now_ms {
            return;
        }
        let mut entries = self.lock();
        if entries.len() >= self.capacity && !entries.contains_key(key) {
            entries.retain(|_, u| u.reset_at_ms > now_ms);
            if entries.len() >= self.capacity {
                return;
            }
        }
        entries.insert(key.to_string(), usage.clone());
    }

    /// Drop every entry of the limit named `resource`.
    pub fn forget_limit(&self, resource: &str) {
        self.lock().retain(|_, u| &*u.resource != resource);
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.lock().len()
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

    fn usage(resource: &str, used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: resource.into(),
            quota: 10,
            used,
            reset_at_ms,
        }
    }

    #[test]
    fn answers_until_reset_and_only_when_over() {
        let c = OverLimitCache::new(10);
        c.insert("k", &usage("core", 10, 2_000), 1_000);
        assert_eq!(c.get("k", 10, 1, 1_500).unwrap().used, 10);
        assert!(
            c.get("k", 5000, 1, 1_500).is_none(),
            "a caller with a larger quota is not over"
        );
        assert!(c.get("k", 10, 1, 2_000).is_none(), "expired at reset");
        c.insert("k2", &usage("core", 9, 2_000), 1_000);
        assert!(c.get("k2", 10, 1, 1_500).is_none(), "room for cost 1");
        assert!(c.get("k2", 10, 2, 1_500).is_some(), "no room for cost 2");
        assert_eq!(c.hits(), 2);
    }

    #[test]
    fn bounded_and_cleared_per_limit() {
        let c = OverLimitCache::new(2);
        c.insert("a", &usage("core", 10, 2_000), 0);
        c.insert("b", &usage("search", 10, 5_000), 0);
        c.insert("c", &usage("core", 10, 5_000), 0);
        assert_eq!(c.len(), 2, "full: not kept");
        c.insert("c", &usage("core", 10, 5_000), 3_000);
        assert_eq!(c.len(), 2, "the expired entry made room");
        c.forget_limit("core");
        assert_eq!(c.len(), 1);
        assert!(c.get("b", 10, 1, 3_000).is_some());
        let off = OverLimitCache::new(0);
        off.insert("a", &usage("core", 10, 2_000), 0);
        assert!(off.get("a", 10, 1, 0).is_none());
    }
}
