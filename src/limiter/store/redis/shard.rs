//! One primary/replica group of the sharded Redis store: where its calls go (a
//! replica for checks when reads go to replicas, the primary's FIFO queue for writes
//! and for checks of windows this gateway wrote lately), its batchers, and what its
//! primary's failures tell Sentinel.

use super::batch::{self, Batcher};
use super::freshness;
use super::late;
use super::node::{Node, NodeSettings, ShardNodes, WhenDisconnected};
use super::scripts::{apply_writes, reserves, LuaScript, Scripts, ARGS_PER_KEY};
use super::sentinel;
use super::stats::{bump, ShardStats};
use super::watch::SentinelWatch;
use super::LATE_BOUND_FACTOR;
use crate::config::ReadFrom;
use crate::limiter::algorithm::OpKind;
use crate::limiter::store::call::{BreakerSeen, NodeRole};
use crate::limiter::store::{Late, StoreCall, StoreError};
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

/// One primary/replica group.
#[derive(Debug)]
pub(super) struct Shard {
    /// Position in `[[store.shards]]`.
    pub(super) index: usize,
    /// Takes the writes (and the checks when reads go to the primary).
    pub(super) primary: Arc<Node>,
    /// Answer checks when reads go to replicas (Sentinel's watcher replaces them).
    pub(super) replicas: ArcSwap<Vec<Arc<Node>>>,
    read_from: ReadFrom,
    next_replica: AtomicUsize,
    /// Counters beyond the nodes' own.
    pub(super) stats: ShardStats,
    sentinel: Option<Arc<SentinelWatch>>,
    /// Peeks (CHECKs) of concurrent requests, sent together ([`batch`]), to a replica
    /// when reads go to replicas.
    checks: Batcher,
    /// Writing operations of concurrent requests, sent together to the primary.
    charges: Batcher,
    /// With `server.runtime = "per_core"` and reads on replicas: each worker's own
    /// CHECK batcher, made on its first call, whose task runs on its runtime (so that a
    /// peek does not wake another thread to be batched). Sized by the first worker to
    /// call. The primary's queue (`charges`) stays one per shard: see [`Shard::batcher`].
    per_worker: OnceLock<Box<[OnceLock<Batcher>]>>,
    /// This shard, for the batchers made later.
    me: Weak<Shard>,
    scripts: Arc<Scripts>,
    timeout: std::time::Duration,
    /// With reads on replicas: the keys this gateway wrote that a replica may not have
    /// seen yet, checked on the primary ([`freshness`]).
    freshness: Option<Arc<freshness::Freshness>>,
    /// The late answers of reservations whose calls timed out (shared by the shards).
    pub(super) late: Arc<late::LateAnswers>,
}

impl ShardNodes for Shard {
    fn index(&self) -> usize {
        self.index
    }

    fn primary(&self) -> &Node {
        &self.primary
    }

    fn replicas(&self) -> &ArcSwap<Vec<Arc<Node>>> {
        &self.replicas
    }
}

impl Shard {
    /// The shard `index` of `primary` and `replicas` (`sentinel`: the Sentinel watch
    /// that finds them), with its batchers, its replica-freshness sampler (reads on
    /// replicas) and its Sentinel watcher started. `late` is the table of late
    /// reservation answers every shard shares. Must be called inside a Tokio runtime.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn spawn(
        index: usize,
        primary: Arc<Node>,
        replicas: Vec<Arc<Node>>,
        read_from: ReadFrom,
        sentinel: Option<Arc<SentinelWatch>>,
        scripts: Arc<Scripts>,
        settings: &NodeSettings,
        late: Arc<late::LateAnswers>,
    ) -> Arc<Shard> {
        let freshness = (read_from == ReadFrom::Replica)
            .then(|| Arc::new(freshness::Freshness::new(settings.timeout)));
        let shard = Arc::new_cyclic(|weak| {
            let (checks, charges) = Shard::batchers(weak, &scripts, settings.timeout);
            Shard {
                index,
                primary,
                replicas: ArcSwap::from_pointee(replicas),
                read_from,
                next_replica: AtomicUsize::new(0),
                stats: ShardStats::default(),
                sentinel: sentinel.clone(),
                checks,
                charges,
                per_worker: OnceLock::new(),
                me: weak.clone(),
                scripts: scripts.clone(),
                timeout: settings.timeout,
                freshness: freshness.clone(),
                late,
            }
        });
        if let Some(fresh) = freshness {
            tokio::spawn(freshness::sample(Arc::downgrade(&shard), fresh));
        }
        if let Some(sentinel) = sentinel {
            shard.primary.follow(&sentinel);
            sentinel::start(&sentinel, &shard, scripts, settings.clone());
        }
        shard
    }

    /// The two batchers (CHECKs, CHARGEs) of the shard that `weak` will point to.
    fn batchers(
        weak: &Weak<Shard>,
        scripts: &Arc<Scripts>,
        timeout: std::time::Duration,
    ) -> (Batcher, Batcher) {
        (
            Shard::batcher_of(weak, scripts, timeout, Kind::Check),
            Shard::batcher_of(weak, scripts, timeout, Kind::Charge),
        )
    }

    /// A batcher for calls of `kind` to the shard `weak` points to, its task on the
    /// current runtime.
    fn batcher_of(
        weak: &Weak<Shard>,
        scripts: &Arc<Scripts>,
        timeout: std::time::Duration,
        kind: Kind,
    ) -> Batcher {
        let (w, s) = (weak.clone(), scripts.clone());
        Batcher::spawn(
            Box::new(move |keys, args| {
                let (w, s) = (w.clone(), s.clone());
                Box::pin(async move {
                    let Some(shard) = w.upgrade() else {
                        return (Err(StoreError::NotStarted), StoreCall::default());
                    };
                    let owned = keys;
                    let keys: Vec<&str> = owned.iter().map(|k| &**k).collect();
                    let (reply, node) = match kind {
                        Kind::Check => shard.check(&s, &keys, &args).await,
                        Kind::Charge => {
                            let reply = if reserves(&args) {
                                let (o, a) = (owned.clone(), args.clone());
                                shard.reserve_on_primary(&s, o, a).await
                            } else {
                                shard.on_primary(&s.apply, &keys, &args).await
                            };
                            if let Some(fresh) = &shard.freshness {
                                fresh.written(&keys, &args, reply.is_ok());
                            }
                            (reply, NodeRole::Primary)
                        }
                    };
                    let call = shard.call_of(node, &reply);
                    (reply, call)
                })
            }),
            timeout,
        )
    }

    /// The batcher for calls of `kind`: peeks have their own when reads go to replicas;
    /// otherwise peeks share the writes' queue, so that the primary runs every call of
    /// the shard in the order it was handed over.
    ///
    /// The primary's queue is one per shard for every worker of a `per_core` gateway
    /// too: the in-flight accounting (`limiter::in_flight::InFlightUnits`) relies on one
    /// FIFO per shard, where a CHARGE handed over before a CHECK runs before it. Peeks
    /// on replicas promise no such order, so on a `per_core` worker they go to the
    /// worker's own batcher.
    pub(super) fn batcher(&self, kind: Kind) -> &Batcher {
        match kind {
            Kind::Check if self.read_from == ReadFrom::Replica => {
                self.worker_checks().unwrap_or(&self.checks)
            }
            _ => &self.charges,
        }
    }

    /// Where a call of `kind` with `keys` (and their `lua/apply.lua` arguments `args`)
    /// goes, told to the replica-freshness pins (reads on replicas only): a write pins
    /// the keys it writes; a check of a pinned key goes to the primary, through the
    /// writes' FIFO queue ([`Kind::Charge`]), so that it reads this gateway's own
    /// writes in the order they were handed over ([`freshness`]).
    pub(super) fn route(&self, kind: Kind, keys: &[batch::Key], args: &[u64]) -> Kind {
        let Some(fresh) = &self.freshness else {
            return kind;
        };
        match kind {
            Kind::Charge => {
                fresh.wrote(keys, args);
                Kind::Charge
            }
            Kind::Check if fresh.pinned(keys) => Kind::Charge,
            Kind::Check => Kind::Check,
        }
    }

    /// On a `per_core` worker thread, its own CHECK batcher (see `per_worker`).
    fn worker_checks(&self) -> Option<&Batcher> {
        let (index, count) = crate::worker::current()?;
        let all = self
            .per_worker
            .get_or_init(|| (0..count).map(|_| OnceLock::new()).collect());
        Some(
            all.get(index)?.get_or_init(|| {
                Shard::batcher_of(&self.me, &self.scripts, self.timeout, Kind::Check)
            }),
        )
    }

    /// A call of this shard to `node` that answered `result`, its breaker as found
    /// (asked only after a failure), for the traces of its requests.
    pub(super) fn call_of<T>(&self, node: NodeRole, result: &Result<T, StoreError>) -> StoreCall {
        let breaker = BreakerSeen::of(node, result, || {
            let open =
                |n: &Node| n.breaker_state() == crate::limiter::store::status::BreakerState::Open;
            match node {
                NodeRole::Replica(i) => self
                    .replicas
                    .load()
                    .get(usize::from(i))
                    .is_some_and(|r| open(r)),
                _ => open(&self.primary),
            }
        });
        StoreCall {
            shard: self.index.min(u16::MAX as usize) as u16,
            node,
            breaker,
            ..StoreCall::default()
        }
    }

    /// Peek `keys` (arguments per key in `args`) on a healthy replica when reads go to
    /// replicas, else (or when the replica fails) on the primary; with the node that
    /// answered.
    async fn check(
        &self,
        scripts: &Scripts,
        keys: &[&str],
        args: &[u64],
    ) -> (Result<Vec<i64>, StoreError>, NodeRole) {
        if !self.primary.writable() {
            // Nothing could be counted: a replica's (or the demoted primary's) answer
            // must not admit anyone. `store.on_error` decides.
            let e = StoreError::NotWritable(self.primary.label.clone());
            return (Err(e), NodeRole::Primary);
        }
        if self.read_from == ReadFrom::Replica {
            let replicas = self.replicas.load();
            if !replicas.is_empty() {
                let start = self.next_replica.fetch_add(1, Ordering::Relaxed);
                let candidate = (0..replicas.len())
                    .map(|i| (start + i) % replicas.len())
                    .find(|&i| replicas[i].is_available());
                if let Some(at) = candidate {
                    let replica = &replicas[at];
                    match replica
                        .call(&scripts.apply, keys, args, WhenDisconnected::FailFast)
                        .await
                    {
                        Ok(reply) => {
                            let role = NodeRole::Replica(at.min(u8::MAX as usize) as u8);
                            return (Ok(reply), role);
                        }
                        Err(e) => {
                            tracing::debug!(node = %replica.label, error = %e, "replica failed; asking the primary")
                        }
                    }
                }
                bump(&self.stats.replica_fallbacks);
            }
        }
        let reply = self.on_primary(&scripts.apply, keys, args).await;
        (reply, NodeRole::Primary)
    }

    /// Run `script` on the primary: a write (anything but a `lua/apply.lua` call of
    /// peeks only) records whether the primary's writes succeed ([`Node::writable`]); a
    /// peek while they fail is refused as [`StoreError::NotWritable`].
    pub(super) async fn on_primary(
        &self,
        script: &LuaScript,
        keys: &[&str],
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        let writes = !std::ptr::eq(script, &self.scripts.apply) || apply_writes(args);
        let result = if writes {
            self.primary.write(script, keys, args).await
        } else if !self.primary.writable() {
            Err(StoreError::NotWritable(self.primary.label.clone()))
        } else {
            self.primary
                .call(script, keys, args, WhenDisconnected::Wait)
                .await
        };
        self.after_primary(&result);
        result
    }

    /// Run `script` on the primary outside the bookkeeping of its writes (a failure does
    /// not make the shard's checks fail, a success does not clear that), failing at once
    /// while it is disconnected: the heartbeat of `store.fleet_size = "auto"`
    /// ([`super::fallback`]), whose refusal (an ACL without its commands) must not
    /// decide how requests are answered.
    pub(super) async fn on_primary_aside(
        &self,
        script: &LuaScript,
        keys: &[&str],
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        self.primary
            .call(script, keys, args, WhenDisconnected::FailFast)
            .await
    }

    /// A failure on the primary that a failover explains: ask Sentinel.
    fn after_primary<T>(&self, result: &Result<T, StoreError>) {
        if let (Err(e), Some(sentinel)) = (result, &self.sentinel) {
            if e.suggests_failover() {
                sentinel.suspect();
            }
        }
    }

    /// [`Shard::on_primary`] for a `lua/apply.lua` call that carries reservations: when
    /// it times out, it runs on, and what became of each reservation is kept by its op
    /// id for the request that was admitted without an answer ([`late`]).
    async fn reserve_on_primary(
        &self,
        scripts: &Arc<Scripts>,
        keys: Vec<batch::Key>,
        args: Vec<u64>,
    ) -> Result<Vec<i64>, StoreError> {
        let reservations: Vec<(usize, u64)> = args
            .chunks(ARGS_PER_KEY)
            .enumerate()
            .filter(|(_, a)| a.first() == Some(&OpKind::Reserve.code()))
            .map(|(i, a)| (i, a.get(ARGS_PER_KEY - 1).copied().unwrap_or(0)))
            .collect();
        let late = self.late.clone();
        let confirmed = self.primary.writes_confirmed();
        let result = self
            .primary
            .call_keeping_late(
                scripts.clone(),
                keys,
                args,
                self.timeout * LATE_BOUND_FACTOR,
                move |result| late.publish(late_outcomes(&reservations, &result)),
            )
            .await;
        self.primary.record_write(confirmed, &result);
        self.after_primary(&result);
        result
    }
}

/// What became of each reservation (its index in the call, its op id) of a call that
/// ended late with `result`.
fn late_outcomes(
    reservations: &[(usize, u64)],
    result: &Result<Vec<i64>, StoreError>,
) -> Vec<(u64, Late)> {
    reservations
        .iter()
        .map(|&(i, id)| {
            let outcome = match result {
                Ok(reply) => match reply.get(i * batch::REPLY_WIDTH) {
                    Some(&used) if used >= 0 => Late::Landed {
                        epoch: reply
                            .get(i * batch::REPLY_WIDTH + 2)
                            .map_or(0, |&e| e.max(0) as u64),
                    },
                    Some(_) => Late::NotLanded,
                    None => Late::Unknown,
                },
                Err(e) if e.may_have_run() => Late::Unknown,
                Err(_) => Late::NotLanded,
            };
            (id, outcome)
        })
        .collect()
}

/// Where a batched `lua/apply.lua` call may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Only peeks: a replica may answer.
    Check,
    /// Writes: the primary.
    Charge,
}
