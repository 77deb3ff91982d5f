//! `[[limits]].block_for`: once a limit refuses a caller, every request of that caller
//! on that limit is refused until the block ends, whatever the window says.
//!
//! The rule is the model's ([`super::algorithm`], `block.rs`; `lua/apply.lua` in Redis):
//! the block's end is kept in the store with the limit's state, as an absolute time, so
//! every gateway sharing the store honours it. A CHECK may be a read-only peek (on a
//! replica), so the block is not written by the check that found the caller over the
//! limit: when an enforced limit with `block_for` refuses (and was not already blocked),
//! the refusal makes one more store call, a [`OpKind::Block`] on the primary, before the
//! 429 is answered. It judges the store's state alone (the units this gateway has in
//! flight are not counted, so a refusal they caused starts no block) and, if it still
//! refuses, starts the block; the 429 then reports the block's end. Only refusals of
//! limits with `block_for` pay that call, once per block (while a block is on, checks
//! see it and the over-limit cache answers repeats).
//!
//! [`BlocksStarted`] counts the blocks this gateway started
//! (`tollgate_blocked_total{limit}`).

use super::algorithm::{Op, OpKind};
use super::check::Refusal;
use super::store::{Item, Store};
use super::{Applied, Limiter, Usage, CACHE_TRUST_MS};
use std::sync::{Arc, Mutex};

/// Blocks started by this gateway's refusals, by limit name (kept across reloads).
#[derive(Debug, Default)]
pub struct BlocksStarted {
    counts: Mutex<Vec<(Arc<str>, u64)>>,
}

impl BlocksStarted {
    /// One more block of `limit`.
    pub fn inc(&self, limit: &Arc<str>) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        match counts.iter_mut().find(|(l, _)| l == limit) {
            Some((_, n)) => *n += 1,
            None => counts.push((limit.clone(), 1)),
        }
    }

    /// Every limit that started a block, with how many.
    pub fn rows(&self) -> Vec<(Arc<str>, u64)> {
        self.counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Limiter {
    /// Count blocks in `blocks` (the previous snapshot's, across a reload).
    pub fn with_blocks_started(mut self, blocks: Arc<BlocksStarted>) -> Self {
        self.blocks_started = blocks;
        self
    }

    /// The blocks this gateway started (`tollgate_blocked_total`).
    pub fn blocks_started(&self) -> &Arc<BlocksStarted> {
        &self.blocks_started
    }

    /// After a refusal: a BLOCK of `cost` for each limit of `applied` at `refused`
    /// (enforced, with `block_for`, not blocked yet), in one store call per shard. Each
    /// that answers blocked is kept in the over-limit cache and, when it started the
    /// block, counted; the refusal returned is the block's when it is of the refusing
    /// limit, else the one that frees latest. A store error
    /// keeps `refusal` as it was (the next refusal tries again).
    pub(super) async fn start_blocks(
        &self,
        applied: &[Applied],
        refused: &[usize],
        refusal: Refusal,
        cost: u64,
        now_ms: u64,
    ) -> Refusal {
        let items: Vec<Item<'_>> = refused
            .iter()
            .map(|&i| Item {
                key: &applied[i].key,
                policy: &applied[i].policy,
                op: Op {
                    kind: OpKind::Block,
                    cost,
                    id: 0,
                },
            })
            .collect();
        let answers = self.store.apply(&items, now_ms).await;
        let mut over = match refusal {
            Refusal::OverLimit(u) => u,
            other => return other,
        };
        for (&i, answer) in refused.iter().zip(answers) {
            let a = &applied[i];
            let v = match answer {
                Ok(v) if v.blocked => v,
                _ => continue,
            };
            let u = a.usage(&v);
            if v.block_started {
                self.blocks_started.inc(&a.limit.name);
                tracing::debug!(
                    limit = %a.limit.name,
                    until_ms = u.blocked_until_ms,
                    "block_for: a refusal started a block"
                );
            }
            self.remember_block(a, &u, now_ms);
            // The block replaces the refusal of its own limit (even when the window
            // frees later: the block is what the store now says); another limit's
            // refusal stays if it frees later.
            if u.resource == over.resource
                || u.reset_at_ms >= over.retry_at_ms.max(over.reset_at_ms)
            {
                over = u;
            }
        }
        Refusal::OverLimit(over)
    }

    /// Keep a refusal by a block in the over-limit cache, for requests of any cost,
    /// until the block's end or for at most [`CACHE_TRUST_MS`] (a caller reset on
    /// another gateway lifts the block there first).
    pub(super) fn remember_block(&self, a: &Applied, u: &Usage, now_ms: u64) {
        let trusted_until = now_ms.saturating_add(CACHE_TRUST_MS);
        self.cache.insert_until(&a.key, u, 1, now_ms, trusted_until);
    }
}
