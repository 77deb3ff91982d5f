//! A map from storage key to a value, split over 64 mutex-guarded hash maps so that
//! concurrent requests for different callers rarely contend. Keyed by the compact form
//! of a storage key ([`StateKey`]: 24 bytes, copied, never allocated). Shared by the
//! memory store and the gateway's own maps: the over-limit cache, in-flight units,
//! leases, the recent-charge view and delayed requests.

use super::key::{LimitKey, StateKey};
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// Number of independent maps.
pub const SHARDS: usize = 64;

/// See the module documentation.
#[derive(Debug)]
pub struct ShardedMap<V> {
    shards: Box<[Mutex<HashMap<StateKey, V, RandomState>>]>,
}

impl<V> Default for ShardedMap<V> {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
        }
    }
}

/// One locked shard.
pub type Shard<'a, V> = MutexGuard<'a, HashMap<StateKey, V, RandomState>>;

fn lock<V>(m: &Mutex<HashMap<StateKey, V, RandomState>>) -> Shard<'_, V> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<V> ShardedMap<V> {
    /// The (locked) map that holds `key` (its [`LimitKey::state`]).
    pub fn shard(&self, key: &LimitKey) -> Shard<'_, V> {
        self.shard_of(&key.state)
    }

    /// The (locked) map that holds `key`.
    pub fn shard_of(&self, key: &StateKey) -> Shard<'_, V> {
        // The shard hash is already a uniform hash of the subject.
        lock(&self.shards[(key.shard_hash().rotate_right(17) as usize) % SHARDS])
    }

    /// Keep only the entries for which `keep` is true; returns how many were dropped.
    pub fn retain(&self, mut keep: impl FnMut(&V) -> bool) -> usize {
        self.retain_mut(|v| keep(v))
    }

    /// Keep only the entries for which `keep` is true, letting it change them; returns
    /// how many were dropped.
    pub fn retain_mut(&self, mut keep: impl FnMut(&mut V) -> bool) -> usize {
        let mut dropped = 0;
        for shard in self.shards.iter() {
            let mut map = lock(shard);
            let before = map.len();
            map.retain(|_, v| keep(v));
            dropped += before - map.len();
        }
        dropped
    }

    /// Number of entries (locks each map in turn).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
