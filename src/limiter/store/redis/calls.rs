//! The [`Store`] calls of the Redis store: `lua/apply.lua` for the items of requests,
//! grouped by shard and kind and handed to each shard's batcher; lease, refund and
//! reset on the primaries; and the late answers of reservations whose calls timed out.

use super::batch;
use super::fallback::Copied;
use super::scripts::{verdicts, LuaScript};
use super::shard::Kind;
use super::{RedisStore, Topology, LATE_BOUND_FACTOR};
use crate::limiter::algorithm::{OpKind, Verdict};
use crate::limiter::key::LimitKey;
use crate::limiter::store::call::{BreakerSeen, NodeRole, Script};
use crate::limiter::store::{
    Answered, Grant, Item, Late, Lessee, Store, StoreCall, StoreError, Submitted, WindowState,
};
use futures_util::future::{join_all, Either};
use futures_util::FutureExt;
use std::future::Future;

/// The indices `0..16`: the members of a call that takes every item of a request
/// ([`RedisStore::submit_many`]'s usual case), with no list made for them.
const FIRST_INDICES: [usize; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

impl RedisStore {
    /// Hand `items` to `lua/apply.lua` at once: one call per shard and kind (peeks, which
    /// may go to a replica, apart from writes), through the shard's batcher (so
    /// concurrent requests share calls), or per hash tag in cluster mode. The items are
    /// in their shard's queue when this returns; the future answers one result per item,
    /// in order. `now_ms` is the script's `now` argument (0: the node's `TIME`).
    ///
    /// Ordering: when a shard's reads go to its primary, its peeks and writes share one
    /// FIFO queue and one connection, so a call handed over later runs later in Redis
    /// (what [`crate::limiter::Limiter`] relies on to never count a unit both in flight
    /// and in the store). When its reads go to replicas, the peeks of windows this
    /// gateway wrote and a replica may not have seen yet join that queue too
    /// ([`freshness`]); the other peeks read windows every replica has seen this
    /// gateway's writes of. Cluster mode gives no such order.
    fn submit_many(&self, items: &[Item<'_>], now_ms: u64) -> Submitted {
        let Some(live) = self.live.get() else {
            let n = items.len();
            return Submitted::Ready(Some(Answered {
                answers: (0..n).map(|_| Err(StoreError::NotStarted)).collect(),
                call: StoreCall::default(),
                calls: 0,
            }));
        };
        // Group items: by kind, and by shard or by hash tag (the subject's digest) in
        // cluster mode.
        let group_of = |i: &Item<'_>| {
            let kind = if i.op.kind == OpKind::Peek {
                Kind::Check
            } else {
                Kind::Charge
            };
            let g = match live {
                Topology::Cluster(_) => i.key.shard_hash(),
                Topology::Sharded(_) => self.shard_of(i.key) as u64,
            };
            (kind, g)
        };
        // The usual case, every item of one kind on one shard: one call, no grouping.
        if let Some(first) = items.first().map(group_of) {
            if items.len() <= FIRST_INDICES.len() && items[1..].iter().all(|i| group_of(i) == first)
            {
                let (kind, group) = first;
                let members = &FIRST_INDICES[..items.len()];
                let call = self.call_group(live, kind, group, items, members, now_ms);
                return Submitted::Waiting(Box::pin(call.map(|(answers, call)| Answered {
                    answers,
                    call,
                    calls: 1,
                })));
            }
        }
        let mut groups: Vec<((Kind, u64), Vec<usize>)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let g = group_of(item);
            match groups.iter_mut().find(|(id, _)| *id == g) {
                Some((_, members)) => members.push(i),
                None => groups.push((g, vec![i])),
            }
        }
        let n = items.len();
        let calls: Vec<_> = groups
            .into_iter()
            .map(|((kind, group), members)| {
                let call = self.call_group(live, kind, group, items, &members, now_ms);
                (members, call)
            })
            .collect();
        Submitted::Waiting(Box::pin(async move {
            let (members, calls): (Vec<_>, Vec<_>) = calls.into_iter().unzip();
            let replies = join_all(calls).await;
            let mut out: Vec<Option<Result<Verdict, StoreError>>> = (0..n).map(|_| None).collect();
            // The trace shows the first call's shard and node, and a breaker any call
            // found open.
            let mut first: Option<StoreCall> = None;
            let calls = replies.len() as u32;
            for (members, (results, call)) in members.iter().zip(replies) {
                let f = first.get_or_insert(call);
                if f.breaker == BreakerSeen::No {
                    f.breaker = call.breaker;
                }
                for (&i, r) in members.iter().zip(results) {
                    out[i] = Some(r);
                }
            }
            Answered {
                answers: out
                    .into_iter()
                    .map(|r| r.unwrap_or(Err(StoreError::NotStarted)))
                    .collect(),
                call: first.unwrap_or_default(),
                calls,
            }
        }))
    }

    /// One script call for the items `members` of `items` that share a kind and a shard
    /// (or a hash tag in cluster mode), handed to the shard's batcher now.
    fn call_group(
        &self,
        live: &Topology,
        kind: Kind,
        group: u64,
        items: &[Item<'_>],
        members: &[usize],
        now_ms: u64,
    ) -> impl Future<Output = (Vec<Result<Verdict, StoreError>>, StoreCall)> + Send + 'static {
        let names: Vec<batch::Key> = members.iter().map(|&i| items[i].key.key.clone()).collect();
        let flat: Vec<u64> = members
            .iter()
            .flat_map(|&i| {
                let (p, op) = (items[i].policy, items[i].op);
                [
                    op.kind.code(),
                    p.algorithm.code(),
                    p.quota,
                    p.window_ms,
                    p.burst,
                    p.align.code(),
                    p.block_ms,
                    op.cost,
                    now_ms,
                    op.id,
                ]
            })
            .collect();
        let count = members.len();
        // A shard's batch is held inline (the future this returns is boxed once, by
        // `submit_many`); cluster calls and the store not started are boxed.
        type Other = std::pin::Pin<Box<dyn Future<Output = (batch::Answer, StoreCall)> + Send>>;
        let reply = match live {
            Topology::Cluster(c) => {
                let (c, scripts) = (c.clone(), self.scripts.clone());
                Either::Right(Box::pin(async move {
                    let names: Vec<&str> = names.iter().map(|k| &**k).collect();
                    let reply = c.call(&scripts.apply, &names, &flat).await;
                    let call = StoreCall {
                        node: NodeRole::Cluster,
                        operations: count.min(u16::MAX as usize) as u16,
                        requests: 1,
                        breaker: BreakerSeen::of(NodeRole::Cluster, &reply, || false),
                        ..StoreCall::default()
                    };
                    (reply.map(batch::Integers::from_vec), call)
                }) as Other)
            }
            Topology::Sharded(shards) => match shards.get(group as usize) {
                None => Either::Right(Box::pin(async {
                    (Err(StoreError::NotStarted), StoreCall::default())
                }) as Other),
                Some(shard) => {
                    let kind = shard.route(kind, &names, &flat);
                    Either::Left(shard.batcher(kind).enqueue(names, flat))
                }
            },
        };
        async move {
            let (reply, call) = reply.await;
            let answers = match reply {
                Ok(r) if r.len() == batch::REPLY_WIDTH * count => verdicts(&r),
                Ok(r) => vec![
                    Err(StoreError::BadReply(format!(
                        "{} integers for {} keys",
                        r.len(),
                        count
                    )));
                    count
                ],
                Err(e) => vec![Err(e); count],
            };
            (answers, call)
        }
    }

    /// The address of `node` of shard `shard` now (see [`crate::limiter::store::AnyStore::node_addr`]).
    pub(crate) fn node_addr(&self, shard: u16, node: NodeRole) -> String {
        let shards = match self.live.get() {
            Some(Topology::Sharded(shards)) => shards,
            _ => return node.as_str().to_string(),
        };
        let Some(s) = shards.get(usize::from(shard)) else {
            return String::new();
        };
        match node {
            NodeRole::Replica(i) => s
                .replicas
                .load()
                .get(usize::from(i))
                .map(|r| r.addr())
                .unwrap_or_default(),
            _ => s.primary.addr(),
        }
    }

    /// The call a lease refill of `key` made on its primary, and its breaker as
    /// `result` found it (see [`crate::limiter::store::AnyStore::lease_call`]).
    pub(crate) fn lease_call<T>(
        &self,
        key: &LimitKey,
        result: &Result<T, StoreError>,
    ) -> StoreCall {
        let shard = self.shard_of(key);
        let call = match self.live.get() {
            Some(Topology::Sharded(shards)) => match shards.get(shard) {
                Some(s) => s.call_of(NodeRole::Primary, result),
                None => StoreCall::default(),
            },
            _ => StoreCall {
                node: NodeRole::Cluster,
                breaker: BreakerSeen::of(NodeRole::Cluster, result, || false),
                ..StoreCall::default()
            },
        };
        StoreCall {
            script: Script::Lease,
            operations: 1,
            requests: 1,
            ..call
        }
    }

    /// Run a one-key script on the primary holding `key` (lease and refund: rare, so
    /// not batched).
    async fn on_primary(
        &self,
        script: &LuaScript,
        key: &LimitKey,
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        match self.live.get() {
            None => Err(StoreError::NotStarted),
            Some(Topology::Cluster(c)) => c.call(script, &[&key.key], args).await,
            Some(Topology::Sharded(shards)) => match shards.get(self.shard_of(key)) {
                None => Err(StoreError::NotStarted),
                Some(shard) => shard.on_primary(script, &[&key.key], args).await,
            },
        }
    }

    /// `lua/lease.lua` on the primary holding `key` (see [`Store::lease`]).
    async fn lease_on_primary(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
        lessee: &Lessee,
    ) -> Result<Grant, StoreError> {
        let reply = self
            .on_primary(
                &self.scripts.lease,
                key,
                &[
                    want,
                    quota,
                    window_ms,
                    self.now_arg(now_ms),
                    lessee.gateway,
                    lessee.ttl_ms,
                    lessee.kept,
                    lessee.kept_reset_at_ms,
                ],
            )
            .await?;
        match reply.as_slice() {
            [granted, used, reset_at] if *granted >= 0 && *used >= 0 && *reset_at >= 0 => {
                Ok(Grant {
                    granted: *granted as u64,
                    window: WindowState {
                        used: *used as u64,
                        reset_at_ms: *reset_at as u64,
                    },
                })
            }
            other => Err(StoreError::BadReply(format!("{other:?}"))),
        }
    }

    /// `lua/refund.lua` on the primary holding `key` (see [`Store::refund`]).
    async fn refund_on_primary(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
        gateway: u64,
    ) -> Result<WindowState, StoreError> {
        let reply = self
            .on_primary(&self.scripts.refund, key, &[units, reset_at_ms, gateway])
            .await?;
        match reply.as_slice() {
            [used, reset_at] if *used >= 0 && *reset_at >= 0 => Ok(WindowState {
                used: *used as u64,
                reset_at_ms: *reset_at as u64,
            }),
            other => Err(StoreError::BadReply(format!("{other:?}"))),
        }
    }

    /// Delete `keys` on the primaries that hold them (`lua/reset.lua`): one call per
    /// shard (per hash tag in cluster mode). Returns how many keys existed; the first
    /// failing call's error when any fails (the other shards' keys are deleted anyway).
    async fn reset_keys(&self, keys: &[LimitKey]) -> Result<u64, StoreError> {
        let live = self.live.get().ok_or(StoreError::NotStarted)?;
        let mut groups: Vec<(u64, Vec<&str>)> = Vec::new();
        for k in keys {
            let g = match live {
                Topology::Cluster(_) => k.shard_hash(),
                Topology::Sharded(_) => self.shard_of(k) as u64,
            };
            match groups.iter_mut().find(|(id, _)| *id == g) {
                Some((_, names)) => names.push(&k.key),
                None => groups.push((g, vec![&k.key])),
            }
        }
        let calls = groups.iter().map(|(g, names)| async move {
            match live {
                Topology::Cluster(c) => c.call(&self.scripts.reset, names, &[]).await,
                Topology::Sharded(shards) => match shards.get(*g as usize) {
                    None => Err(StoreError::NotStarted),
                    Some(shard) => shard.on_primary(&self.scripts.reset, names, &[]).await,
                },
            }
        });
        let mut deleted = 0;
        for reply in join_all(calls).await {
            match reply?.as_slice() {
                [n] if *n >= 0 => deleted += *n as u64,
                other => return Err(StoreError::BadReply(format!("{other:?}"))),
            }
        }
        Ok(deleted)
    }
}

impl Store for RedisStore {
    fn submit(&self, items: &[Item<'_>], now_ms: u64) -> Submitted {
        let submitted = self.submit_many(items, self.now_arg(now_ms));
        let Some(fb) = &self.fallback else {
            return submitted;
        };
        // `on_error = "local"`: what a failed answer is answered with instead.
        let copies: Vec<Copied> = items
            .iter()
            .map(|i| (self.shard_of(i.key), i.key.state, *i.policy, i.op))
            .collect();
        let fb = fb.clone();
        Submitted::Waiting(Box::pin(async move {
            let mut answered = submitted.await;
            fb.answer(&mut answered.answers, &copies, now_ms);
            answered
        }))
    }

    async fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
        lessee: &Lessee,
    ) -> Result<Grant, StoreError> {
        let result = self
            .lease_on_primary(key, want, quota, window_ms, now_ms, lessee)
            .await;
        match &self.fallback {
            None => result,
            Some(fb) => fb.lease(
                self.shard_of(key),
                result,
                key,
                (want, quota, window_ms, now_ms),
            ),
        }
    }

    async fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
        gateway: u64,
    ) -> Result<WindowState, StoreError> {
        let result = self
            .refund_on_primary(key, units, reset_at_ms, gateway)
            .await;
        match &self.fallback {
            None => result,
            Some(fb) => fb.refund(self.shard_of(key), result, key, units, reset_at_ms),
        }
    }

    async fn reset(&self, keys: &[LimitKey]) -> Result<u64, StoreError> {
        if let Some(fb) = &self.fallback {
            fb.reset(keys);
        }
        self.reset_keys(keys).await
    }

    /// Waits up to [`LATE_BOUND_FACTOR`] × `store.timeout` (plus one, for the answer to
    /// be kept) for the reservation's late call to end (see [`late`]). In cluster mode
    /// calls are not kept running: [`Late::Unknown`] at once.
    async fn late_reservation(&self, id: u64) -> Late {
        let Some(Topology::Sharded(shards)) = self.live.get() else {
            return Late::Unknown;
        };
        let Some(late) = shards.first().map(|s| s.late.clone()) else {
            return Late::Unknown;
        };
        let bound = self.cfg.timeout.0 * (LATE_BOUND_FACTOR + 1);
        late.take(id, bound).await
    }
}
