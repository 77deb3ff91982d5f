//! The Redis store: windows in sharded, replicated Redis (or a Redis Cluster), shared by
//! a fleet of gateways.
//!
//! - **Shards.** `[[store.shards]]` lists primary/replica groups; a key's shard is
//!   [`jump_consistent_hash`] of its digest over the shard list (see
//!   [`crate::limiter::key`]). A shard's primary and replicas are given directly or found
//!   through Sentinel ([`sentinel`]).
//! - **Reads and writes.** CHECKs go to a healthy replica when `store.read_from =
//!   "replica"` (the default when a shard lists replicas), spread round robin; a replica
//!   that is down, slow, loading or cut off from its primary is skipped and the primary
//!   answers. CHARGEs always go to the primary. A window this gateway has written is
//!   checked on the primary, through the writes' queue, until every replica has caught
//!   up with that write ([`freshness`]): a gateway reads its own writes. A stale replica
//!   can at worst admit a request the primary would have rejected (of a window only
//!   other gateways wrote lately): expiry is judged by the stored `reset_at` against
//!   "now", never by Redis's TTLs, and a 429 carries the numbers of the read that made
//!   it.
//! - **Late reservations.** A call that carries reservations and times out is finished
//!   in the background, and what became of each reservation is kept for its request
//!   ([`late`]), so that a request let through without an answer is counted once.
//! - **Clock.** "Now" is the gateway's clock, passed in every call (`store.clock =
//!   "gateway"`), or, with `store.clock = "redis"`, [`NOW_FROM_REDIS`] in its place: the
//!   scripts then read `TIME` on the node that runs them, once per call.
//! - **Failures.** Each node has a multiplexed connection kept up in the background, a
//!   circuit breaker and counters ([`node`], [`breaker`], [`stats`]); each call is
//!   bounded by `store.timeout`. A sick shard costs its own callers at most
//!   `store.timeout` per call until its breaker opens, and other shards nothing.
//! - **Scripts.** Each operation is one Lua script in `lua/`, loaded on every new
//!   connection and run with EVALSHA; NOSCRIPT still reloads and retries.

mod backoff;
mod batch;
mod breaker;
mod calls;
mod cluster;
mod collector;
mod dial;
mod fallback;
mod freshness;
mod late;
mod node;
mod report;
mod scripts;
mod sentinel;
mod shard;
mod stats;
mod watch;

pub use super::status::{BreakerState, NodeReport, ShardReport};
pub use scripts::{unpack_integers, APPLY_LUA, HEARTBEAT_LUA, LEASE_LUA, REFUND_LUA, RESET_LUA};

use crate::config::{Files, Problems, ReadFrom, StoreClock, StoreConfig, StoreMode};
use crate::limiter::key::{jump_consistent_hash, LimitKey};
use cluster::Cluster;
use dial::{DialSettings, Dialer, Endpoint};
use node::{Node, NodeSettings, Role};
use scripts::Scripts;
use shard::Shard;
use std::sync::{Arc, OnceLock};
use watch::SentinelWatch;

/// The `now` argument (ms) that tells `lua/apply.lua` and `lua/lease.lua` to read the
/// time from the Redis node's `TIME` instead (`store.clock = "redis"`): 0, the Unix epoch
/// itself, which no gateway clock gives.
pub const NOW_FROM_REDIS: u64 = 0;

/// A call that carries reservations runs on for up to this many `store.timeout`s after
/// it was sent, when its caller was answered with a timeout (see [`late`]): past the
/// connection's own bound on an answer (4 × `store.timeout`).
pub const LATE_BOUND_FACTOR: u32 = 5;

/// Where the store's calls go once it has started: its shards, or a Redis Cluster.
enum Topology {
    /// `[[store.shards]]`, in order.
    Sharded(Vec<Arc<Shard>>),
    /// `mode = "cluster"`.
    Cluster(Arc<Cluster>),
}

/// Fixed windows in Redis. Built without I/O by [`RedisStore::from_config`]; connections
/// are opened by [`RedisStore::start`].
pub struct RedisStore {
    /// Boxed: `[store]` with its credentials and `[store.tls]` is large, and the
    /// store is one variant of [`super::AnyStore`].
    cfg: Box<StoreConfig>,
    scripts: Arc<Scripts>,
    live: OnceLock<Topology>,
    /// Credentials and TLS settings every new connection reads (see [`dial`]).
    dialer: Arc<Dialer>,
    /// `on_error = "local"`: the local enforcement of failing shards; `None` otherwise.
    fallback: Option<Arc<fallback::Fallback>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("mode", &self.cfg.mode)
            .field("shards", &self.cfg.shards.len())
            .finish()
    }
}

/// Whether `url` is a usable `redis://` or `rediss://` URL (else a problem at `at`);
/// `tls` is set when it is `rediss://`.
fn check_url(url: &str, at: String, tls: &mut bool, problems: &mut Problems) -> bool {
    match Endpoint::parse(url) {
        Ok(ep) => {
            *tls |= ep.tls;
            true
        }
        Err(e) => {
            problems.error(
                at,
                format!(
                    "{:?} is not a usable Redis URL: {e}",
                    crate::config::redact_url(url)
                ),
            );
            false
        }
    }
}

impl RedisStore {
    /// Validate `[store]` for Redis (problems under `store.*`) and build the store;
    /// the files named in `[store]` are read now, relative to the working directory.
    pub fn from_config(cfg: &StoreConfig, problems: &mut Problems) -> Option<Self> {
        let dir = std::path::Path::new(".");
        let mut files = Files::read(crate::config::files::store(cfg, dir));
        if crate::config::files::store_wants_system_roots(cfg) {
            files = files.with_system_roots();
        }
        Self::from_loaded(cfg, &files, problems)
    }

    /// [`RedisStore::from_config`] without I/O: the secret files
    /// (`store.password_file`, `store.sentinel_password_file`) and `[store.tls]`'s PEM
    /// files come from `files`, read by the loading step.
    pub fn from_loaded(cfg: &StoreConfig, files: &Files, problems: &mut Problems) -> Option<Self> {
        let before = problems.errors.len();
        let mut tls = false;
        if cfg.breaker_failures == 0 {
            problems.error("store.breaker_failures", "must be at least 1");
        }
        if cfg.breaker_cooloff.0.is_zero() {
            problems.error("store.breaker_cooloff", "must be more than 0");
        }
        match cfg.mode {
            StoreMode::Cluster => {
                if cfg.nodes.is_empty() {
                    problems.error("store.nodes", "mode \"cluster\" needs at least one seed node, e.g. [\"redis://10.0.0.1:7000\"]");
                }
                for (i, n) in cfg.nodes.iter().enumerate() {
                    check_url(n, format!("store.nodes[{i}]"), &mut tls, problems);
                }
                if !cfg.shards.is_empty() {
                    problems.error(
                        "store.shards",
                        "mode \"cluster\" takes `nodes`, not [[store.shards]]",
                    );
                }
                if cfg.read_from == Some(ReadFrom::Replica) {
                    problems.error(
                        "store.read_from",
                        "replica reads are not supported in cluster mode; use \"primary\"",
                    );
                }
            }
            StoreMode::Sharded => {
                if cfg.shards.is_empty() {
                    problems.error(
                        "store.shards",
                        "backend \"redis\" needs at least one [[store.shards]] entry",
                    );
                }
                if !cfg.nodes.is_empty() {
                    problems.error(
                        "store.nodes",
                        "`nodes` is for mode = \"cluster\"; sharded mode uses [[store.shards]]",
                    );
                }
                for (i, s) in cfg.shards.iter().enumerate() {
                    let at = format!("store.shards[{i}]");
                    match (&s.primary, &s.sentinel) {
                        (Some(p), None) => {
                            check_url(p, format!("{at}.primary"), &mut tls, problems);
                        }
                        (None, Some(sen)) => {
                            if sen.master.trim().is_empty() {
                                problems.error(format!("{at}.sentinel.master"), "must name the master Sentinel monitors");
                            }
                            if sen.nodes.is_empty() {
                                problems.error(format!("{at}.sentinel.nodes"), "needs at least one Sentinel, e.g. [\"redis://10.0.0.1:26379\"]");
                            }
                            for (j, n) in sen.nodes.iter().enumerate() {
                                check_url(n, format!("{at}.sentinel.nodes[{j}]"), &mut tls, problems);
                            }
                            if !s.replicas.is_empty() {
                                problems.error(format!("{at}.replicas"), "with `sentinel`, replicas come from Sentinel; remove `replicas`");
                            }
                        }
                        (Some(_), Some(_)) => problems.error(at.clone(), "give either `primary` or `sentinel`, not both"),
                        (None, None) => problems.error(at.clone(), "needs `primary = \"redis://HOST:PORT\"` or `sentinel = { master = …, nodes = […] }`"),
                    }
                    for (j, r) in s.replicas.iter().enumerate() {
                        check_url(r, format!("{at}.replicas[{j}]"), &mut tls, problems);
                    }
                }
            }
        }
        let settings = DialSettings::load(cfg, tls, files, problems);
        let shard_count = match cfg.mode {
            StoreMode::Cluster => 1,
            StoreMode::Sharded => cfg.shards.len(),
        };
        (problems.errors.len() == before).then(|| Self {
            fallback: fallback::Fallback::new(cfg, shard_count).map(Arc::new),
            cfg: Box::new(cfg.clone()),
            scripts: Arc::new(Scripts::new()),
            live: OnceLock::new(),
            dialer: Dialer::new(settings),
        })
    }

    /// Take the credentials and TLS settings `fresh` read (a reload that keeps this
    /// store because `[store]` is unchanged): connections opened from now on use them;
    /// open ones are left alone.
    pub fn take_dial_settings(&self, fresh: &RedisStore) {
        self.dialer.replace(fresh.dialer.settings());
    }

    /// The `now` to pass to the scripts, in ms since the Unix epoch: the gateway's
    /// `now_ms`, or [`NOW_FROM_REDIS`] with `store.clock = "redis"`.
    fn now_arg(&self, now_ms: u64) -> u64 {
        match self.cfg.clock {
            StoreClock::Gateway => now_ms,
            StoreClock::Redis => NOW_FROM_REDIS,
        }
    }

    fn settings(&self) -> NodeSettings {
        NodeSettings {
            timeout: self.cfg.timeout.0,
            breaker_failures: self.cfg.breaker_failures,
            breaker_cooloff: self.cfg.breaker_cooloff.0,
            dialer: self.dialer.clone(),
        }
    }

    /// Open every node's connection in the background (scripts are loaded on each new
    /// connection). Calling it again does nothing. Must be called inside a Tokio runtime.
    pub fn start(&self) {
        self.live.get_or_init(|| match self.cfg.mode {
            StoreMode::Cluster => {
                // Validated in from_config: every seed is a usable URL.
                let seeds = self
                    .cfg
                    .nodes
                    .iter()
                    .filter_map(|n| Endpoint::parse(n).ok())
                    .collect();
                Topology::Cluster(Cluster::spawn(
                    seeds,
                    format!(
                        "cluster {}",
                        self.cfg
                            .nodes
                            .iter()
                            .map(|n| crate::config::redact_url(n))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    self.scripts.clone(),
                    self.settings(),
                ))
            }
            StoreMode::Sharded => Topology::Sharded(self.start_shards()),
        });
    }

    /// Start the background task of `on_error = "local"` (the local stores' sweep
    /// every `sweep_every`, the heartbeats of `fleet_size = "auto"`), after
    /// [`RedisStore::start`]; nothing without it. Calling it again does nothing.
    pub fn start_fallback(
        &self,
        clock: crate::clock::SharedClock,
        sweep_every: std::time::Duration,
    ) {
        if let (Some(fb), Some(live)) = (&self.fallback, self.live.get()) {
            fb.start(live, self.scripts.clone(), clock, sweep_every);
        }
    }

    /// With `on_error = "local"`, the divisor of each quota of `key`'s limits while its
    /// shard is enforced in this gateway's memory; `None` when it is not (or without
    /// `"local"`).
    pub fn local_divisor(&self, key: &LimitKey) -> Option<u64> {
        self.fallback.as_ref()?.active_divisor(self.shard_of(key))
    }

    /// With `on_error = "local"`: whether each shard is enforced locally now, in
    /// order; empty otherwise.
    pub fn fallback_actives(&self) -> Vec<bool> {
        self.fallback
            .as_ref()
            .map_or_else(Vec::new, |fb| fb.actives())
    }

    fn start_shards(&self) -> Vec<Arc<Shard>> {
        let settings = self.settings();
        let mut shards = Vec::new();
        // The late answers of reservations whose calls timed out ([`late`]): one table
        // for every shard.
        let late = Arc::new(late::LateAnswers::default());
        for (index, s) in self.cfg.shards.iter().enumerate() {
            let read_from =
                self.cfg
                    .read_from
                    .unwrap_or(if s.replicas.is_empty() && s.sentinel.is_none() {
                        ReadFrom::Primary
                    } else {
                        ReadFrom::Replica
                    });
            let open = |url: &str| Endpoint::parse(url).ok();
            let primary_client = s.primary.as_deref().and_then(open);
            let primary_label = match (&s.primary, &s.sentinel) {
                (Some(p), _) => format!("shard {index} primary {}", crate::config::redact_url(p)),
                (None, Some(sen)) => {
                    format!("shard {index} primary (sentinel master {})", sen.master)
                }
                (None, None) => format!("shard {index} primary"),
            };
            let primary = Node::spawn(
                primary_label,
                primary_client,
                self.scripts.clone(),
                settings.clone(),
                Role::Primary,
            );
            let replicas: Vec<Arc<Node>> = s
                .replicas
                .iter()
                .filter_map(|r| {
                    Some(Node::spawn(
                        format!("shard {index} replica {}", crate::config::redact_url(r)),
                        Some(open(r)?),
                        self.scripts.clone(),
                        settings.clone(),
                        Role::Replica,
                    ))
                })
                .collect();
            let sentinel = s.sentinel.as_ref().map(|sen| {
                SentinelWatch::new(
                    sen.master.clone(),
                    sen.nodes.iter().filter_map(|n| open(n)).collect(),
                )
            });
            shards.push(Shard::spawn(
                index,
                primary,
                replicas,
                read_from,
                sentinel,
                self.scripts.clone(),
                &settings,
                late.clone(),
            ));
        }
        shards
    }

    /// The index of the shard that holds `key` (always 0 in cluster mode).
    pub fn shard_of(&self, key: &LimitKey) -> usize {
        match self.cfg.mode {
            StoreMode::Cluster => 0,
            StoreMode::Sharded => {
                jump_consistent_hash(key.shard_hash(), self.cfg.shards.len() as u32) as usize
            }
        }
    }

    /// Number of shards (1 in cluster mode).
    pub fn shard_count(&self) -> usize {
        match self.cfg.mode {
            StoreMode::Cluster => 1,
            StoreMode::Sharded => self.cfg.shards.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::limiter::store::StoreError;

    /// LOADING and MASTERDOWN are a live node that does not serve; READONLY and a
    /// connection error are not.
    #[test]
    fn loading_and_masterdown_are_not_serving_readonly_is_not() {
        let reply = |text: &[u8]| match redis::parse_redis_value(text) {
            Ok(redis::Value::ServerError(e)) => StoreError::Redis(redis::RedisError::from(e)),
            other => panic!("{other:?}"),
        };
        assert!(reply(b"-LOADING Redis is loading the dataset in memory\r\n").is_not_serving());
        assert!(reply(b"-MASTERDOWN Link with MASTER is down\r\n").is_not_serving());
        let readonly = reply(b"-READONLY You can't write against a read only replica.\r\n");
        assert!(!readonly.is_not_serving());
        assert!(readonly.suggests_failover());
        assert!(!StoreError::Timeout(50).is_not_serving());
    }
}
