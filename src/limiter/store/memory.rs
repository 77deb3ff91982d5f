//! The embedded memory store: windows in this process only, same semantics as Redis.
//!
//! Windows live in a [`ShardedMap`] (64 mutex-guarded hash maps) so concurrent callers
//! rarely contend. [`MemoryStore::sweep`] drops windows past their reset; the
//! gateway runs it every `store.sweep_interval`, so memory stays bounded by the callers
//! active within one window, however many distinct callers come and go.

use super::{Charge, Grant, Store, StoreError, WindowState};
use crate::clock::SharedClock;
use crate::limiter::key::LimitKey;
use crate::limiter::sharded::ShardedMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Fixed windows held in process memory.
#[derive(Debug, Default)]
pub struct MemoryStore {
    /// Shared with the sweeper task, which holds it weakly.
    windows: Arc<ShardedMap<WindowState>>,
    sweeper_started: AtomicBool,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
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

    /// Read a window (same rules as `lua/check.lua`).
    pub fn check_now(&self, key: &LimitKey, now_ms: u64) -> WindowState {
        let map = self.windows.shard(key);
        match map.get(&key.key) {
            Some(w) if w.reset_at_ms > now_ms => *w,
            _ => WindowState::default(),
        }
    }

    /// Charge a window (same rules as `lua/charge.lua`).
    pub fn charge_now(
        &self,
        key: &LimitKey,
        cost: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> WindowState {
        let mut map = self.windows.shard(key);
        let w = map.entry(key.key.clone()).or_default();
        if w.reset_at_ms <= now_ms {
            *w = WindowState {
                used: cost,
                reset_at_ms: now_ms + window_ms,
            };
        } else {
            w.used = w.used.saturating_add(cost);
        }
        *w
    }

    /// Take up to `want` units, never past `quota` (same rules as `lua/lease.lua`).
    pub fn lease_now(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> Grant {
        let mut map = self.windows.shard(key);
        let live = map
            .get(&key.key)
            .filter(|w| w.reset_at_ms > now_ms)
            .copied();
        let w = live.unwrap_or(WindowState {
            used: 0,
            reset_at_ms: now_ms + window_ms,
        });
        let granted = want.min(quota.saturating_sub(w.used));
        if granted == 0 {
            return Grant { granted, window: w };
        }
        let window = WindowState {
            used: w.used + granted,
            ..w
        };
        map.insert(key.key.clone(), window);
        Grant { granted, window }
    }

    /// Give back units of the window ending at `reset_at_ms` (same rules as
    /// `lua/refund.lua`).
    pub fn refund_now(&self, key: &LimitKey, units: u64, reset_at_ms: u64) -> WindowState {
        let mut map = self.windows.shard(key);
        match map.get_mut(&key.key) {
            Some(w) if w.reset_at_ms == reset_at_ms => {
                w.used = w.used.saturating_sub(units);
                *w
            }
            _ => WindowState::default(),
        }
    }

    /// Drop every window whose reset is at or before `now_ms`; returns how many were dropped.
    pub fn sweep(&self, now_ms: u64) -> usize {
        drop_expired(&self.windows, now_ms)
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

/// Drop the windows of `windows` whose reset is at or before `now_ms`; how many.
fn drop_expired(windows: &ShardedMap<WindowState>, now_ms: u64) -> usize {
    windows.retain(|w| w.reset_at_ms > now_ms)
}

impl Store for MemoryStore {
    async fn check(&self, keys: &[&LimitKey], now_ms: u64) -> Vec<Result<WindowState, StoreError>> {
        keys.iter().map(|k| Ok(self.check_now(k, now_ms))).collect()
    }

    async fn charge(
        &self,
        items: &[Charge<'_>],
        now_ms: u64,
    ) -> Vec<Result<WindowState, StoreError>> {
        items
            .iter()
            .map(|c| Ok(self.charge_now(c.key, c.cost, c.window_ms, now_ms)))
            .collect()
    }

    async fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> Result<Grant, StoreError> {
        Ok(self.lease_now(key, want, quota, window_ms, now_ms))
    }

    async fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
    ) -> Result<WindowState, StoreError> {
        Ok(self.refund_now(key, units, reset_at_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::key::KeyScheme;

    #[test]
    fn window_starts_at_first_charge_and_resets() {
        let s = MemoryStore::new();
        let k = KeyScheme::new("t:", None).key("core", "ip:1.2.3.4");
        assert!(s.check_now(&k, 1_000).is_empty());
        assert_eq!(
            s.charge_now(&k, 1, 60_000, 1_000),
            WindowState {
                used: 1,
                reset_at_ms: 61_000
            }
        );
        assert_eq!(
            s.charge_now(&k, 2, 60_000, 30_000),
            WindowState {
                used: 3,
                reset_at_ms: 61_000
            }
        );
        assert_eq!(
            s.check_now(&k, 60_999),
            WindowState {
                used: 3,
                reset_at_ms: 61_000
            }
        );
        // At reset_at the old window is over: reads empty, the next charge starts anew.
        assert!(s.check_now(&k, 61_000).is_empty());
        assert_eq!(
            s.charge_now(&k, 1, 60_000, 61_000),
            WindowState {
                used: 1,
                reset_at_ms: 121_000
            }
        );
    }

    #[test]
    fn sweep_keeps_memory_bounded() {
        let s = MemoryStore::new();
        let scheme = KeyScheme::new("t:", None);
        for i in 0..10_000 {
            s.charge_now(&scheme.key("core", &format!("ip:{i}")), 1, 1_000, 0);
        }
        s.charge_now(&scheme.key("core", "late"), 1, 1_000, 500);
        assert_eq!(s.len(), 10_001);
        assert_eq!(s.sweep(1_000), 10_000);
        assert_eq!(s.len(), 1);
        assert_eq!(s.sweep(1_500), 1);
        assert!(s.is_empty());
    }
}
