//! A map from storage key to a value, split over 64 mutex-guarded hash maps so that
//! concurrent requests for different callers rarely contend. Shared by the memory store
//! (keyed by the compact [`StateKey`](super::key::StateKey)) and the gateway's own
//! bounded maps (keyed by the full key: the over-limit cache, in-flight units, leases,
//! the recent-charge view, delayed requests).

use super::key::LimitKey;
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// Number of independent maps.
pub const SHARDS: usize = 64;

/// See the module documentation. `K` is the key type: the full storage key by default.
#[derive(Debug)]
pub struct ShardedMap<V, K = String> {
    shards: Box<[Mutex<HashMap<K, V, RandomState>>]>,
}

impl<V, K> Default for ShardedMap<V, K> {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
        }
    }
}

fn lock<V, K>(m: &Mutex<HashMap<K, V, RandomState>>) -> MutexGuard<'_, HashMap<K, V, RandomState>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<V, K> ShardedMap<V, K> {
    /// The (locked) map that holds `key`.
    pub fn shard(&self, key: &LimitKey) -> MutexGuard<'_, HashMap<K, V, RandomState>> {
        // shard_hash is already a uniform hash of the subject.
        lock(&self.shards[(key.shard_hash.rotate_right(17) as usize) % SHARDS])
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
