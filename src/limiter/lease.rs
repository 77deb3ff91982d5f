//! Lease mode (`[[limits]] lease = N`): a gateway takes up to N units of a caller's
//! window from the store in one call (`lua/lease.lua`) and admits requests from them
//! locally, so a hot caller costs about one Redis call per N requests.
//!
//! Leased units are counted in the shared window when they are granted, so the units
//! admitted by all gateways together never exceed the quota; the price is that a
//! gateway may hold units another gateway's callers could have used. Units a gateway
//! has not used are given back (`lua/refund.lua`) once its lease has been idle for
//! [`IDLE_MS`], and at shutdown; when the window ends they lapse with it.
//!
//! A gateway that dies without giving its units back (`kill -9`) must not strand them
//! until the window ends: the store keeps each gateway's unused units for it only for
//! the limit's `lease_ttl` after it last heard from it, then gives them back to the
//! window (`lua/lease.lua`). So a live gateway uses a lease only for half its
//! `lease_ttl` after its last store call, then renews it (reporting what it still
//! holds) or, idle, gives it back: its record never lapses while it admits from it.

use super::key::{LimitKey, StateKey};
use super::sharded::ShardedMap;
use super::store::{Grant, Store, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// A lease unused this long (milliseconds) gives its units back.
pub const IDLE_MS: u64 = 1_000;

/// One lease: units this gateway holds in one window.
#[derive(Debug, Clone)]
struct Lease {
    key: LimitKey,
    /// The window the units belong to (its end, ms since the epoch).
    reset_at_ms: u64,
    /// Units held and not yet used.
    remaining: u64,
    /// The window's count in the store at the last grant (every gateway's leases).
    store_used: u64,
    /// Last time units were taken or returned, ms since the epoch.
    last_ms: u64,
    /// The units may be admitted from until this time (ms since the epoch): half the
    /// limit's `lease_ttl` after the last store call that renewed the lease.
    valid_until_ms: u64,
}

impl Lease {
    /// Whether units may be admitted from this lease at `now_ms`: its window is live
    /// and the store's record of it is fresh (see `valid_until_ms`).
    fn usable(&self, now_ms: u64) -> bool {
        self.reset_at_ms > now_ms && self.valid_until_ms > now_ms
    }
}

/// What taking units from a lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Taken. `used` is the window's count as this gateway sees it (the store's count
    /// minus the units it still holds); `reset_at_ms` its end.
    Taken {
        /// Units used in the window, as reported in `X-RateLimit-Used`.
        used: u64,
        /// End of the window, ms since the epoch.
        reset_at_ms: u64,
    },
    /// The window has no units left for this request.
    Exhausted {
        /// The store's count (every gateway's leases).
        used: u64,
        /// End of the window, ms since the epoch.
        reset_at_ms: u64,
    },
}

/// What one request asks of a lease-mode limit.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The window.
    pub key: &'a LimitKey,
    /// Units the request costs.
    pub cost: u64,
    /// Units to take from the store at a time (`[[limits]] lease`).
    pub lease: u64,
    /// The caller's quota, units per window.
    pub quota: u64,
    /// Window length for a new window, milliseconds.
    pub window_ms: u64,
    /// `lease_ttl`, milliseconds.
    pub lease_ttl_ms: u64,
}

/// Every lease this gateway holds, shared across config reloads that keep the store.
#[derive(Debug)]
pub struct LeaseTable {
    leases: ShardedMap<Lease>,
    /// This gateway's id in the store's lease records: random per process.
    gateway: u64,
    /// The windows whose grant this gateway is asking the store for now, each with what
    /// wakes the takers that wait for it: at most one grant per window in flight (see
    /// [`LeaseTable::take`]).
    asking: Mutex<HashMap<StateKey, Arc<Notify>>>,
}

impl Default for LeaseTable {
    fn default() -> Self {
        Self {
            leases: ShardedMap::default(),
            // 53 bits: exact in Lua's numbers.
            gateway: (uuid::Uuid::new_v4().as_u64_pair().0 >> 11).max(1),
            asking: Mutex::default(),
        }
    }
}

impl LeaseTable {
    /// An empty table, with a new random gateway id.
    pub fn new() -> Self {
        Self::default()
    }

    /// Take `ask.cost` units of `ask.key`'s window: from the local lease when it holds
    /// enough and is valid, else after asking the store for what tops the lease up to
    /// `max(lease, cost)` units (never past `quota`), which also renews the store's
    /// record of the units this gateway holds.
    ///
    /// One grant per window is in flight at a time: a taker that needs one while another
    /// is being asked for waits for it, then looks at the local lease again. (The store
    /// records the units this gateway holds as those it reports kept plus the grant; two
    /// grants asked at once would each report the units kept before either, and the
    /// record would miss one of them: units that shutdown or idleness could then never
    /// give back, lost to the window until it ends.)
    ///
    /// Errors: the store's, when a grant was needed and the store failed.
    ///
    /// `note`: a sampled request's trace, told of the refill when one is asked for
    /// (`None`: nothing is noted).
    pub async fn take(
        &self,
        store: &impl Store,
        ask: Ask<'_>,
        now_ms: u64,
        note: Option<&mut super::store::CallNote>,
    ) -> Result<Take, StoreError> {
        let _asking = loop {
            if let Some(t) = self.take_local(ask.key, ask.cost, now_ms) {
                return Ok(t);
            }
            let busy = {
                let mut asking = self.asking.lock().unwrap_or_else(|e| e.into_inner());
                match asking.get(&ask.key.state) {
                    Some(n) => n.clone(),
                    None => {
                        asking.insert(ask.key.state, Arc::new(Notify::new()));
                        break Asking {
                            table: self,
                            key: ask.key.state,
                        };
                    }
                }
            };
            // Registered before the lock is taken again, so that the asker's wake-up
            // (after it leaves the map, under the lock) cannot be missed.
            let done = busy.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            let still = {
                let asking = self.asking.lock().unwrap_or_else(|e| e.into_inner());
                asking
                    .get(&ask.key.state)
                    .is_some_and(|n| Arc::ptr_eq(n, &busy))
            };
            if still {
                done.await;
            }
        };
        let (kept, kept_reset_at_ms) = self.kept(ask.key, now_ms);
        let lessee = super::store::Lessee {
            gateway: self.gateway,
            ttl_ms: ask.lease_ttl_ms,
            kept,
            kept_reset_at_ms,
        };
        let want = ask.lease.max(ask.cost).saturating_sub(kept);
        let grant = store
            .lease(ask.key, want, ask.quota, ask.window_ms, now_ms, &lessee)
            .await;
        if let Some(note) = note {
            note.refilled(want, grant.as_ref().map_or(0, |g| g.granted));
        }
        let grant = grant?;
        let valid_until_ms = now_ms.saturating_add(ask.lease_ttl_ms / 2);
        Ok(self.add_and_take(ask.key, grant, ask.cost, now_ms, valid_until_ms))
    }

    /// Whether this gateway's lease of `key` holds `cost` units now (then a cached
    /// refusal of the shared window does not apply to it).
    pub fn holds(&self, key: &LimitKey, cost: u64, now_ms: u64) -> bool {
        let map = self.leases.shard(key);
        map.get(&key.state)
            .is_some_and(|l| l.usable(now_ms) && l.remaining >= cost)
    }

    /// The unused units this gateway holds of `key`'s window at `now_ms` (0 when it
    /// holds no lease of it): for `GET /callers/{id}`.
    pub fn held(&self, key: &LimitKey, now_ms: u64) -> u64 {
        self.kept(key, now_ms).0
    }

    /// The unused units this gateway holds of `key`'s window, and the window's end (ms
    /// since the epoch; 0 when it holds none).
    fn kept(&self, key: &LimitKey, now_ms: u64) -> (u64, u64) {
        let map = self.leases.shard(key);
        match map.get(&key.state) {
            Some(l) if l.reset_at_ms > now_ms && l.remaining > 0 => (l.remaining, l.reset_at_ms),
            _ => (0, 0),
        }
    }

    fn take_local(&self, key: &LimitKey, cost: u64, now_ms: u64) -> Option<Take> {
        let mut map = self.leases.shard(key);
        let l = map.get_mut(&key.state)?;
        if !l.usable(now_ms) || l.remaining < cost {
            return None;
        }
        l.remaining -= cost;
        l.last_ms = now_ms;
        Some(Take::Taken {
            used: l.store_used.saturating_sub(l.remaining),
            reset_at_ms: l.reset_at_ms,
        })
    }

    fn add_and_take(
        &self,
        key: &LimitKey,
        grant: Grant,
        cost: u64,
        now_ms: u64,
        valid_until_ms: u64,
    ) -> Take {
        let w = grant.window;
        let mut map = self.leases.shard(key);
        let l = map.entry(key.state).or_insert_with(|| Lease {
            key: key.clone(),
            reset_at_ms: w.reset_at_ms,
            remaining: 0,
            store_used: 0,
            last_ms: now_ms,
            valid_until_ms,
        });
        l.valid_until_ms = l.valid_until_ms.max(valid_until_ms);
        if l.reset_at_ms != w.reset_at_ms {
            // A new window: what was held belonged to the old one and lapsed with it.
            l.reset_at_ms = w.reset_at_ms;
            l.remaining = 0;
        }
        l.remaining += grant.granted;
        l.store_used = l.store_used.max(w.used);
        l.last_ms = now_ms;
        if l.remaining >= cost {
            l.remaining -= cost;
            Take::Taken {
                used: l.store_used.saturating_sub(l.remaining),
                reset_at_ms: l.reset_at_ms,
            }
        } else {
            Take::Exhausted {
                used: w.used,
                reset_at_ms: w.reset_at_ms,
            }
        }
    }

    /// Put `cost` units back into the local lease (the request was not charged after
    /// all: an uncharged status, an upstream failure, or another limit refused it).
    pub fn give_back(&self, key: &LimitKey, cost: u64, reset_at_ms: u64) {
        let mut map = self.leases.shard(key);
        if let Some(l) = map.get_mut(&key.state) {
            if l.reset_at_ms == reset_at_ms {
                l.remaining += cost;
            }
        }
    }

    /// Count `units` more against the window of `key` ending at `reset_at_ms`, for a
    /// request settled to a higher cost than it took (`upstreams.cost_header`): taken
    /// from this gateway's lease while it is usable and holds them, and what it does not
    /// hold counted in its view of the window now. Returns the units the lease did not
    /// cover, to be charged in the store (past the quota if need be).
    pub fn take_excess(&self, key: &LimitKey, units: u64, reset_at_ms: u64, now_ms: u64) -> u64 {
        let mut map = self.leases.shard(key);
        match map.get_mut(&key.state) {
            Some(l) if l.reset_at_ms == reset_at_ms => {
                let from_lease = if l.usable(now_ms) {
                    l.remaining.min(units)
                } else {
                    0
                };
                l.remaining -= from_lease;
                let rest = units - from_lease;
                l.store_used = l.store_used.saturating_add(rest);
                l.last_ms = now_ms;
                rest
            }
            _ => units,
        }
    }

    /// Drop the local lease of `key` without giving its units back: its window was
    /// deleted in the store (`POST /callers/{id}/reset`), and the units with it.
    pub fn forget(&self, key: &LimitKey) {
        self.leases.shard(key).remove(&key.state);
    }

    /// Drop leases of past windows and give back the units of leases idle for
    /// [`IDLE_MS`] or past their validity (all of them with `all`, at shutdown), so
    /// that the store's record of them never lapses while this gateway lives. Returns
    /// the units given back.
    pub async fn sweep(&self, store: &impl Store, now_ms: u64, all: bool) -> u64 {
        let mut idle = Vec::new();
        self.leases.retain_mut(|l| {
            if l.reset_at_ms <= now_ms {
                return false;
            }
            if all || now_ms.saturating_sub(l.last_ms) >= IDLE_MS || !l.usable(now_ms) {
                if l.remaining > 0 {
                    idle.push((l.key.clone(), l.remaining, l.reset_at_ms));
                }
                return false;
            }
            true
        });
        let mut returned = 0;
        for (key, units, reset_at_ms) in idle {
            match store.refund(&key, units, reset_at_ms, self.gateway).await {
                Ok(_) => returned += units,
                Err(e) => tracing::debug!(error = %e, "returning leased units failed"),
            }
        }
        returned
    }

    /// Number of leases held.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// True when no lease is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A grant being asked for ([`LeaseTable::take`]): when it is done (or its taker went
/// away), the window leaves the map and its waiting takers are woken.
struct Asking<'a> {
    table: &'a LeaseTable,
    key: StateKey,
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        let removed = self
            .table
            .asking
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
        if let Some(n) = removed {
            n.notify_waiters();
        }
    }
}

/// Sweep `table` every [`IDLE_MS`] / 2 until the table or the store is dropped.
pub fn spawn_sweeper<S: Store + 'static>(
    table: &Arc<LeaseTable>,
    store: &Arc<S>,
    clock: crate::clock::SharedClock,
) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (table, store) = (Arc::downgrade(table), Arc::downgrade(store));
    rt.spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(IDLE_MS / 2));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (Some(table), Some(store)) = (table.upgrade(), store.upgrade()) else {
                return;
            };
            if !table.is_empty() {
                table.sweep(&*store, clock.now_ms(), false).await;
            }
        }
    });
}
