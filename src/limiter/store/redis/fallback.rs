//! `store.on_error = "local"`: while a shard's calls fail (its primary down, its
//! breaker open, its calls timing out), the shard's limits are enforced in this
//! gateway's memory, by the memory store's rules (the reference model: every algorithm),
//! each quota divided by the number of gateways sharing the store.
//!
//! - **Entering.** The first failed answer of a shard's call puts the shard in local
//!   mode (logged once, `tollgate_store_fallback_active{shard}` = 1) and freezes the
//!   divisor: `store.fleet_size`, or with `"auto"` the gateways seen alive in that
//!   shard's last heartbeat read while it answered (1 before any).
//! - **While local.** Every call is still sent to Redis first (an open breaker fails it
//!   at once); each failed answer is replaced by the local store's answer under the
//!   divided policy, so the request path sees a verdict, never an error.
//! - **Leaving.** The first successful answer of the shard ends local mode (logged once,
//!   gauge 0) and drops the shard's local states: local counts are not replayed into
//!   Redis, and a later fault starts afresh.
//! - **Heartbeat** (`fleet_size = "auto"`): every `store.fleet_heartbeat`, each shard's
//!   primary runs `lua/heartbeat.lua`, which records this gateway and answers how many
//!   were heard from within three heartbeats.
//!
//! Nothing here exists unless `on_error = "local"`: the store holds no [`Fallback`] and
//! its calls take no other path.

use super::scripts::Scripts;
use super::shard::Shard;
use super::Topology;
use crate::config::{FleetSize, StoreConfig};
use crate::limiter::algorithm::{Op, Policy};
use crate::limiter::key::StateKey;
use crate::limiter::store::memory::MemoryStore;
use crate::limiter::store::{Answers, Grant, StoreError, WindowState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// A heartbeat older than this many `store.fleet_heartbeat`s no longer counts its
/// gateway as alive.
pub(super) const HEARTBEAT_TTL_FACTOR: u32 = 3;

/// One item of a call, kept to answer it locally: its shard, the compact form of its
/// key, its policy and its operation.
pub(super) type Copied = (usize, StateKey, Policy, Op);

/// How many gateways share the store (`store.fleet_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fleet {
    /// A count given in the config.
    Fixed(u64),
    /// Counted from the heartbeats.
    Auto,
}

/// One shard's local mode.
#[derive(Debug)]
struct Local {
    /// In local mode now.
    active: AtomicBool,
    /// The divisor frozen when local mode began.
    divisor: AtomicU64,
    /// Gateways alive at the last heartbeat read (`"auto"`; 0 before any).
    seen: AtomicU64,
    /// The limit states while local.
    memory: MemoryStore,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Fallback {
    shards: Box<[Local]>,
    fleet: Fleet,
    /// This gateway's id in the heartbeats: random per store.
    gateway: u64,
    /// `store.fleet_heartbeat`.
    heartbeat: Duration,
    /// The heartbeats' sorted set: `{key_prefix}gateways`.
    key: String,
    /// The background task was started.
    started: AtomicBool,
    /// Failed heartbeats are logged at most once a minute.
    beat_warnings: crate::logging::Throttle,
}

impl Fallback {
    /// The fallback of a store of `shards` shards configured by `cfg`, or `None` unless
    /// `on_error = "local"`.
    pub(super) fn new(cfg: &StoreConfig, shards: usize) -> Option<Self> {
        if cfg.on_error != crate::config::OnError::Local {
            return None;
        }
        let fleet = match cfg.fleet_size {
            Some(FleetSize::Count(n)) => Fleet::Fixed(n.max(1) as u64),
            _ => Fleet::Auto,
        };
        Some(Self {
            shards: (0..shards.max(1))
                .map(|_| Local {
                    active: AtomicBool::new(false),
                    divisor: AtomicU64::new(1),
                    seen: AtomicU64::new(0),
                    memory: MemoryStore::with_max_callers(cfg.max_callers.max(1)),
                })
                .collect(),
            fleet,
            gateway: (uuid::Uuid::new_v4().as_u64_pair().0 >> 11).max(1),
            heartbeat: cfg.fleet_heartbeat.0,
            key: format!("{}gateways", cfg.key_prefix),
            started: AtomicBool::new(false),
            beat_warnings: crate::logging::Throttle::new(),
        })
    }

    fn local(&self, shard: usize) -> &Local {
        &self.shards[shard.min(self.shards.len() - 1)]
    }

    /// The divisor local mode of `shard` would take now.
    fn divisor_now(&self, shard: usize) -> u64 {
        match self.fleet {
            Fleet::Fixed(n) => n,
            Fleet::Auto => self.local(shard).seen.load(Ordering::Relaxed).max(1),
        }
    }

    /// `shard`'s divisor while it is in local mode; `None` when it is not.
    pub(super) fn active_divisor(&self, shard: usize) -> Option<u64> {
        let l = self.local(shard);
        l.active
            .load(Ordering::Relaxed)
            .then(|| l.divisor.load(Ordering::Relaxed))
    }

    /// Whether each shard is in local mode, in order (`tollgate_store_fallback_active`).
    pub(super) fn actives(&self) -> Vec<bool> {
        self.shards
            .iter()
            .map(|l| l.active.load(Ordering::Relaxed))
            .collect()
    }

    /// A call of `shard` failed with `error`: local mode, if not already.
    fn enter(&self, shard: usize, error: &StoreError) {
        let l = self.local(shard);
        if l.active.load(Ordering::Relaxed) {
            return;
        }
        let divisor = self.divisor_now(shard);
        l.divisor.store(divisor, Ordering::Relaxed);
        if !l.active.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                shard,
                divisor,
                error = %error,
                "store shard unreachable: enforcing its limits in this gateway's memory, each quota divided by {divisor} (store.on_error = \"local\")"
            );
        }
    }

    /// A call of `shard` succeeded: back to Redis, local states dropped.
    fn leave(&self, shard: usize) {
        let l = self.local(shard);
        if l.active.load(Ordering::Relaxed) && l.active.swap(false, Ordering::AcqRel) {
            let dropped = l.memory.clear();
            tracing::info!(
                shard,
                dropped,
                "store shard reachable again: its limits are enforced in Redis again (local counts dropped, not replayed)"
            );
        }
    }

    /// `policy` with its quota and burst divided by `divisor` (rounded down, at least 1).
    pub(super) fn share(policy: &Policy, divisor: u64) -> Policy {
        Policy {
            quota: (policy.quota / divisor).max(1),
            burst: (policy.burst / divisor).max(1),
            ..*policy
        }
    }

    /// Replace the failed answers of `answers` (one per item of `copies`, in order) by
    /// the local store's, at `now_ms` (the gateway's clock, ms since the epoch), and
    /// enter or leave each shard's local mode by what its answers say.
    pub(super) fn answer(&self, answers: &mut Answers, copies: &[Copied], now_ms: u64) {
        for (r, c) in answers.iter().zip(copies) {
            if let Err(e) = r {
                self.enter(c.0, e);
            }
        }
        for (r, &(shard, state, policy, op)) in answers.iter_mut().zip(copies) {
            match r {
                Err(_) => {
                    let l = self.local(shard);
                    let divisor = l.divisor.load(Ordering::Relaxed);
                    *r = l
                        .memory
                        .apply_state(&state, &Self::share(&policy, divisor), op, now_ms);
                }
                Ok(_) => self.leave(shard),
            }
        }
    }

    /// A LEASE of `shard` answered `result`: on failure, the local store's grant of
    /// `want` units of the divided `quota`.
    pub(super) fn lease(
        &self,
        shard: usize,
        result: Result<Grant, StoreError>,
        key: &crate::limiter::key::LimitKey,
        (want, quota, window_ms, now_ms): (u64, u64, u64, u64),
    ) -> Result<Grant, StoreError> {
        match result {
            Ok(g) => {
                self.leave(shard);
                Ok(g)
            }
            Err(e) => {
                self.enter(shard, &e);
                let l = self.local(shard);
                let quota = (quota / l.divisor.load(Ordering::Relaxed)).max(1);
                l.memory.lease_now(key, want, quota, window_ms, now_ms)
            }
        }
    }

    /// A refund of `shard` answered `result`: on failure, given back locally.
    pub(super) fn refund(
        &self,
        shard: usize,
        result: Result<WindowState, StoreError>,
        key: &crate::limiter::key::LimitKey,
        units: u64,
        reset_at_ms: u64,
    ) -> Result<WindowState, StoreError> {
        match result {
            Ok(w) => {
                self.leave(shard);
                Ok(w)
            }
            Err(e) => {
                self.enter(shard, &e);
                Ok(self.local(shard).memory.refund_now(key, units, reset_at_ms))
            }
        }
    }

    /// Forget `keys` in every local store (`POST /callers/{id}/reset`).
    pub(super) fn reset(&self, keys: &[crate::limiter::key::LimitKey]) {
        for l in self.shards.iter() {
            l.memory.reset_now(keys);
        }
    }

    /// Drop the local states past their reset, in every shard's store.
    fn sweep(&self, now_ms: u64) {
        for l in self.shards.iter() {
            l.memory.sweep(now_ms);
        }
    }

    /// Start the background task of the fallback: the local stores' sweep every
    /// `sweep_every` and, with `fleet_size = "auto"`, the heartbeat on each shard's
    /// primary every `store.fleet_heartbeat`. It ends with the store. Must be called
    /// inside a Tokio runtime. Calling it again does nothing.
    pub(super) fn start(
        self: &Arc<Self>,
        live: &Topology,
        scripts: Arc<Scripts>,
        clock: crate::clock::SharedClock,
        sweep_every: Duration,
    ) {
        if self.started.swap(true, Ordering::Relaxed) {
            return;
        }
        let targets: Vec<Target> = match live {
            Topology::Sharded(shards) => shards
                .iter()
                .map(|s| Target::Shard(Arc::downgrade(s)))
                .collect(),
            Topology::Cluster(c) => vec![Target::Cluster(Arc::downgrade(c))],
        };
        let weak = Arc::downgrade(self);
        let beat = (self.fleet == Fleet::Auto).then_some(self.heartbeat);
        tokio::spawn(async move {
            let every = beat.map_or(sweep_every, |b| b.min(sweep_every));
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_sweep = 0;
            loop {
                tick.tick().await;
                let Some(fb) = weak.upgrade() else {
                    return;
                };
                let now_ms = clock.now_ms();
                if now_ms.saturating_sub(last_sweep) >= sweep_every.as_millis() as u64 {
                    fb.sweep(now_ms);
                    last_sweep = now_ms;
                }
                if beat.is_some() && !fb.beat(&targets, &scripts).await {
                    return;
                }
            }
        });
    }

    /// One heartbeat on each target; false once the store is gone.
    async fn beat(&self, targets: &[Target], scripts: &Scripts) -> bool {
        let ttl = (self.heartbeat * HEARTBEAT_TTL_FACTOR).as_millis() as u64;
        let args = [self.gateway, ttl.max(1)];
        for (i, t) in targets.iter().enumerate() {
            let reply = match t {
                Target::Shard(w) => match w.upgrade() {
                    Some(s) => {
                        s.on_primary_aside(&scripts.heartbeat, &[&self.key], &args)
                            .await
                    }
                    None => return false,
                },
                Target::Cluster(w) => match w.upgrade() {
                    Some(c) => c.call(&scripts.heartbeat, &[&self.key], &args).await,
                    None => return false,
                },
            };
            match reply.as_deref() {
                Ok([n]) if *n >= 1 => {
                    let before = self.shards[i].seen.swap(*n as u64, Ordering::Relaxed);
                    if before != *n as u64 {
                        tracing::info!(
                            shard = i,
                            gateways = n,
                            "gateways alive sharing the store (store.fleet_size = \"auto\")"
                        );
                    }
                }
                Ok(other) => {
                    tracing::debug!(shard = i, reply = ?other, "heartbeat: unexpected reply")
                }
                // Unreachable: what local mode is for, and logged by it.
                Err(e) if e.suggests_failover() || matches!(e, StoreError::BreakerOpen(_)) => {
                    tracing::debug!(shard = i, error = %e, "heartbeat failed")
                }
                // Refused (an ACL without ZCARD or PEXPIRE, say): worth a warning.
                Err(e) => {
                    if let Some(suppressed) = self.beat_warnings.due(60_000) {
                        tracing::warn!(shard = i, error = %e, suppressed, "heartbeat failed (store.fleet_size = \"auto\"): the gateways alive are not counted until it succeeds");
                    }
                }
            }
        }
        true
    }
}

/// Where a heartbeat goes: a shard's primary, or the cluster.
enum Target {
    Shard(Weak<Shard>),
    Cluster(Weak<super::cluster::Cluster>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::algorithm::{OpKind, Verdict};
    use crate::limiter::key::KeyScheme;

    fn cfg(fleet: Option<FleetSize>) -> StoreConfig {
        StoreConfig {
            on_error: crate::config::OnError::Local,
            fleet_size: fleet,
            ..StoreConfig::default()
        }
    }

    /// Quotas and bursts are divided, rounded down, never below 1.
    #[test]
    fn a_share_is_the_quota_divided_rounded_down_at_least_one() {
        let p = Policy::fixed(10, 60_000);
        assert_eq!(Fallback::share(&p, 2).quota, 5);
        assert_eq!(Fallback::share(&p, 3).quota, 3);
        assert_eq!(Fallback::share(&p, 3).burst, 3);
        assert_eq!(Fallback::share(&p, 20).quota, 1);
        assert_eq!(Fallback::share(&p, 1), p);
    }

    /// Failed answers are answered locally by the divided policy; the first success
    /// leaves local mode and drops the local counts.
    #[test]
    fn failed_answers_are_answered_locally_until_one_succeeds() {
        let fb = Fallback::new(&cfg(Some(FleetSize::Count(2))), 1).unwrap();
        assert!(Fallback::new(&StoreConfig::default(), 1).is_none());
        let key = KeyScheme::new("t:", None).key("core", "ip:1.2.3.4");
        let charge = Op {
            kind: OpKind::Reserve,
            cost: 1,
            id: 1,
        };
        let copies = [(0, key.state, Policy::fixed(10, 60_000), charge)];
        let mut admitted = 0;
        for _ in 0..8 {
            let mut answers: Answers = vec![Err(StoreError::Timeout(50))];
            fb.answer(&mut answers, &copies, 1_000);
            admitted += u64::from(answers[0].as_ref().unwrap().admitted);
        }
        assert_eq!(admitted, 5, "10 / 2 gateways");
        assert_eq!(fb.active_divisor(0), Some(2));
        let ok = Verdict {
            admitted: true,
            used: 1,
            reset_at_ms: 61_000,
            retry_at_ms: 0,
            more_at_ms: 61_000,
            epoch: 61_000,
            ..Verdict::default()
        };
        let mut answers: Answers = vec![Ok(ok)];
        fb.answer(&mut answers, &copies, 1_000);
        assert_eq!(answers[0].as_ref().unwrap(), &ok, "Redis's answer stands");
        assert_eq!(fb.active_divisor(0), None);
        let mut answers: Answers = vec![Err(StoreError::Timeout(50))];
        fb.answer(&mut answers, &copies, 1_000);
        assert_eq!(
            answers[0].as_ref().unwrap().used,
            1,
            "a later fault starts afresh"
        );
    }

    /// Every algorithm runs by the model under the divided policy: GCRA's burst of 10
    /// is 5 on each of 2 gateways; a lease grants at most the divided quota.
    #[test]
    fn gcra_bursts_and_leases_are_divided_too() {
        let fb = Fallback::new(&cfg(Some(FleetSize::Count(2))), 1).unwrap();
        let key = KeyScheme::new("t:", None).key("core", "ip:1.2.3.4");
        let gcra = Policy {
            algorithm: crate::limiter::algorithm::Algorithm::Gcra,
            ..Policy::fixed(10, 60_000)
        };
        let reserve = Op {
            kind: OpKind::Reserve,
            cost: 1,
            id: 1,
        };
        let copies = [(0, key.state, gcra, reserve)];
        let admitted = (0..8)
            .filter(|_| {
                let mut answers: Answers = vec![Err(StoreError::Timeout(50))];
                fb.answer(&mut answers, &copies, 1_000);
                answers[0].as_ref().unwrap().admitted
            })
            .count();
        assert_eq!(admitted, 5, "a burst of 10 / 2 at one instant");
        let other = KeyScheme::new("t:", None).key("lease", "ip:1.2.3.4");
        let grant = fb
            .lease(
                0,
                Err(StoreError::Timeout(50)),
                &other,
                (100, 10, 60_000, 1_000),
            )
            .unwrap();
        assert_eq!(grant.granted, 5, "a lease of 100 gets the quota's share");
    }

    /// `"auto"` divides by the gateways seen before the fault (1 before any).
    #[test]
    fn auto_divides_by_the_gateways_last_seen() {
        let fb = Fallback::new(&cfg(None), 2).unwrap();
        assert_eq!(fb.divisor_now(1), 1);
        fb.shards[1].seen.store(3, Ordering::Relaxed);
        fb.enter(1, &StoreError::Timeout(50));
        assert_eq!(fb.active_divisor(1), Some(3));
        assert_eq!(fb.active_divisor(0), None);
        fb.shards[1].seen.store(4, Ordering::Relaxed);
        assert_eq!(fb.active_divisor(1), Some(3), "frozen while local");
    }
}
