//! The embedded memory store: limit state in this process only, same semantics as Redis.
//!
//! Each limit's state for one subject is an [`algorithm::State`], updated by the
//! reference model [`algorithm::apply`] (Redis runs the same rules in
//! `lua/apply.lua`). States live in a [`ShardedMap`] (64 mutex-guarded hash maps) so
//! concurrent callers rarely contend. [`MemoryStore::sweep`] drops states that no
//! longer count; the gateway runs it every `store.sweep_interval`, so memory stays
//! bounded by the callers active within one window, however many come and go, and by
//! `store.max_callers` whatever they do: a new caller past it gets [`StoreError::Full`],
//! which `store.on_error` handles, while the callers already held keep their windows.

use super::{Grant, Item, Store, StoreError, WindowState};
use crate::clock::SharedClock;
use crate::limiter::algorithm::{self, Op, Policy, State, Verdict};
use crate::limiter::key::{LimitKey, StateKey};
use crate::limiter::sharded::{ShardedMap, SHARDS};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// One limit's state for one subject and when it stops counting (ms since the epoch).
#[derive(Debug, Clone)]
struct Held {
    state: State,
    expires_at: u64,
}

impl Held {
    fn fixed(w: WindowState) -> Self {
        Held {
            state: State::Fixed {
                used: w.used,
                reset_at: w.reset_at_ms,
            },
            expires_at: w.reset_at_ms,
        }
    }

    /// The fixed window, if this is one and it is live at `now_ms`.
    fn window(&self, now_ms: u64) -> Option<WindowState> {
        match self.state {
            State::Fixed { used, reset_at } if reset_at > now_ms => Some(WindowState {
                used,
                reset_at_ms: reset_at,
            }),
            _ => None,
        }
    }
}

/// Limit state held in process memory.
#[derive(Debug)]
pub struct MemoryStore {
    /// Shared with the sweeper task, which holds it weakly. Keyed by the compact form of
    /// each storage key (24 bytes, no allocation per caller).
    windows: Arc<ShardedMap<Held>>,
    sweeper_started: AtomicBool,
    /// `store.max_callers`: the most states held.
    max_callers: usize,
    /// The most states one of the map's shards holds (`max_callers` spread evenly: the
    /// shard of a key is a uniform hash, and checking one locked shard costs nothing).
    max_per_shard: usize,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::with_max_callers(usize::MAX)
    }
}

impl MemoryStore {
    /// An empty store without a bound.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that holds at most about `max_callers` states (`store.max_callers`).
    pub fn with_max_callers(max_callers: usize) -> Self {
        Self {
            windows: Arc::default(),
            sweeper_started: AtomicBool::new(false),
            max_callers,
            max_per_shard: max_callers.div_ceil(SHARDS).max(1),
        }
    }

    /// Drop windows past their reset every `every`, in a background task that ends with
    /// the store (inside a Tokio runtime). Calling it again does nothing.
    pub fn start_sweeper(&self, every: std::time::Duration, clock: SharedClock) {
        if self.sweeper_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let weak = Arc::downgrade(&self.windows);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(windows) = weak.upgrade() else {
                    return;
                };
                let dropped = drop_expired(&windows, clock.now_ms());
                tracing::trace!(dropped, "memory store swept");
            }
        });
    }

    /// Apply one operation (the reference model; `lua/apply.lua` in Redis).
    ///
    /// Errors: [`StoreError::Full`] when the caller holds no state yet and the store
    /// holds `store.max_callers` (also for a peek, so that `on_error` decides at the
    /// check).
    pub fn apply_now(&self, item: &Item<'_>, now_ms: u64) -> Result<Verdict, StoreError> {
        self.apply_state(&item.key.state, item.policy, item.op, now_ms)
    }

    /// [`MemoryStore::apply_now`] for the state kept under `state` (the compact form of
    /// a storage key: all this store keys its states by).
    pub fn apply_state(
        &self,
        state: &StateKey,
        policy: &Policy,
        op: Op,
        now_ms: u64,
    ) -> Result<Verdict, StoreError> {
        let mut map = self.windows.shard_of(state);
        match map.get_mut(state) {
            Some(held) => {
                // In place: a peek never changes the state.
                let verdict = algorithm::apply(policy, &mut held.state, op, now_ms);
                if held.state == State::Empty {
                    map.remove(state);
                } else if op.kind != algorithm::OpKind::Peek {
                    held.expires_at = held.state.expires_at(policy.window_ms);
                }
                Ok(verdict)
            }
            None => {
                if map.len() >= self.max_per_shard {
                    return Err(StoreError::Full(self.max_callers));
                }
                let mut state_now = State::Empty;
                let verdict = algorithm::apply(policy, &mut state_now, op, now_ms);
                if state_now != State::Empty {
                    let expires_at = state_now.expires_at(policy.window_ms);
                    map.insert(
                        *state,
                        Held {
                            state: state_now,
                            expires_at,
                        },
                    );
                }
                Ok(verdict)
            }
        }
    }

    /// Take up to `want` units, never past `quota` (same rules as `lua/lease.lua`).
    ///
    /// Errors: [`StoreError::Full`], as for [`MemoryStore::apply_now`].
    pub fn lease_now(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> Result<Grant, StoreError> {
        let mut map = self.windows.shard(key);
        if map.len() >= self.max_per_shard && !map.contains_key(&key.state) {
            return Err(StoreError::Full(self.max_callers));
        }
        let live = map.get(&key.state).and_then(|h| h.window(now_ms));
        let w = live.unwrap_or(WindowState {
            used: 0,
            reset_at_ms: now_ms + window_ms,
        });
        let granted = want.min(quota.saturating_sub(w.used));
        if granted == 0 {
            return Ok(Grant { granted, window: w });
        }
        let window = WindowState {
            used: w.used + granted,
            ..w
        };
        map.insert(key.state, Held::fixed(window));
        Ok(Grant { granted, window })
    }

    /// Give back units of the window ending at `reset_at_ms` (same rules as
    /// `lua/refund.lua`).
    pub fn refund_now(&self, key: &LimitKey, units: u64, reset_at_ms: u64) -> WindowState {
        let mut map = self.windows.shard(key);
        match map.get_mut(&key.state) {
            Some(held) => match held.state {
                State::Fixed {
                    ref mut used,
                    reset_at,
                } if reset_at == reset_at_ms => {
                    *used = used.saturating_sub(units);
                    WindowState {
                        used: *used,
                        reset_at_ms,
                    }
                }
                _ => WindowState::default(),
            },
            None => WindowState::default(),
        }
    }

    /// Remove the states of `keys` (same rules as `lua/reset.lua`); returns how many
    /// were held.
    pub fn reset_now(&self, keys: &[LimitKey]) -> u64 {
        keys.iter()
            .filter(|k| self.windows.shard(k).remove(&k.state).is_some())
            .count() as u64
    }

    /// Drop every window whose reset is at or before `now_ms`; returns how many were dropped.
    pub fn sweep(&self, now_ms: u64) -> usize {
        drop_expired(&self.windows, now_ms)
    }

    /// Drop every state held; returns how many were dropped.
    pub fn clear(&self) -> usize {
        self.windows.retain(|_| false)
    }

    /// Number of windows held (live or not yet swept).
    pub fn len(&self) -> usize {
        self.windows.len()
    }

    /// True when no window is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Drop the states of `windows` that stop counting at or before `now_ms`; how many.
fn drop_expired(windows: &ShardedMap<Held>, now_ms: u64) -> usize {
    windows.retain(|h| h.expires_at > now_ms)
}

impl Store for MemoryStore {
    /// Applied at once: the answers are ready.
    fn submit(&self, items: &[Item<'_>], now_ms: u64) -> super::Submitted {
        super::Submitted::Ready(Some(super::Answered {
            answers: items.iter().map(|i| self.apply_now(i, now_ms)).collect(),
            call: super::StoreCall::memory(items.len()),
            calls: 1,
        }))
    }

    async fn apply(&self, items: &[Item<'_>], now_ms: u64) -> Vec<Result<Verdict, StoreError>> {
        items.iter().map(|i| self.apply_now(i, now_ms)).collect()
    }

    async fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
        _lessee: &super::Lessee,
    ) -> Result<Grant, StoreError> {
        // One process: the leases die with the store, nothing to keep a record of.
        self.lease_now(key, want, quota, window_ms, now_ms)
    }

    async fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
        _gateway: u64,
    ) -> Result<WindowState, StoreError> {
        Ok(self.refund_now(key, units, reset_at_ms))
    }

    async fn reset(&self, keys: &[LimitKey]) -> Result<u64, StoreError> {
        Ok(self.reset_now(keys))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::algorithm::OpKind;
    use crate::limiter::key::KeyScheme;

    fn charge(s: &MemoryStore, k: &LimitKey, cost: u64, window_ms: u64, now: u64) -> Verdict {
        let policy = Policy::fixed(100, window_ms);
        let item = Item {
            key: k,
            policy: &policy,
            op: Op {
                kind: OpKind::Charge,
                cost,
                id: 0,
            },
        };
        s.apply_now(&item, now).unwrap()
    }

    #[test]
    fn window_starts_at_first_charge_and_resets() {
        let s = MemoryStore::new();
        let k = KeyScheme::new("t:", None).key("core", "ip:1.2.3.4");
        let v = charge(&s, &k, 1, 60_000, 1_000);
        assert_eq!((v.used, v.reset_at_ms), (1, 61_000));
        let v = charge(&s, &k, 2, 60_000, 30_000);
        assert_eq!((v.used, v.reset_at_ms), (3, 61_000));
        // At reset_at the old window is over: the next charge starts anew.
        let v = charge(&s, &k, 1, 60_000, 61_000);
        assert_eq!((v.used, v.reset_at_ms), (1, 121_000));
    }

    #[test]
    fn callers_limits_and_prefixes_keep_their_own_windows() {
        let s = MemoryStore::new();
        let t = KeyScheme::new("t:", None);
        let a = t.key("core", "ip:1.2.3.4");
        let b = t.key("core", "ip:1.2.3.5");
        let other_limit = t.key("search", "ip:1.2.3.4");
        let other_prefix = KeyScheme::new("u:", None).key("core", "ip:1.2.3.4");
        for (i, k) in [&a, &b, &other_limit, &other_prefix]
            .into_iter()
            .enumerate()
        {
            let cost = i as u64 + 1;
            assert_eq!(charge(&s, k, cost, 60_000, 0).used, cost, "{}", k.key);
        }
        assert_eq!(s.len(), 4);
        // A reload's new scheme with the same prefix finds the same windows.
        let reloaded = KeyScheme::new("t:", None).key("core", "ip:1.2.3.4");
        assert_eq!(charge(&s, &reloaded, 10, 60_000, 1).used, 11);
        assert_eq!(charge(&s, &b, 1, 60_000, 1).used, 3);
        assert_eq!(s.reset_now(std::slice::from_ref(&a)), 1);
        assert_eq!(charge(&s, &reloaded, 1, 60_000, 2).used, 1);
        assert_eq!(s.len(), 4);
    }

    #[test]
    fn sweep_keeps_memory_bounded() {
        let s = MemoryStore::new();
        let scheme = KeyScheme::new("t:", None);
        for i in 0..10_000 {
            charge(&s, &scheme.key("core", &format!("ip:{i}")), 1, 1_000, 0);
        }
        charge(&s, &scheme.key("core", "late"), 1, 1_000, 500);
        assert_eq!(s.len(), 10_001);
        assert_eq!(s.sweep(1_000), 10_000);
        assert_eq!(s.len(), 1);
        assert_eq!(s.sweep(1_500), 1);
        assert!(s.is_empty());
    }
}
