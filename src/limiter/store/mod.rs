//! Where windows are kept: the [`Store`] trait and its two implementations.
//!
//! Both stores run every limit algorithm by the same rules: the memory store calls the
//! reference model in [`crate::limiter::algorithm`], Redis runs `lua/apply.lua`, and the
//! store-contract tests hold the two to the same answers. One [`Store::apply`] call
//! applies one operation (peek, charge, reserve, refund) to each limit of a request.
//! Reset times are stored, never derived from a TTL. Lease mode (fixed windows only)
//! has its own two calls, [`Store::lease`] and [`Store::refund`].

pub mod memory;
pub mod redis;

use super::algorithm::{Op, Policy, Verdict};
use super::key::LimitKey;
use crate::clock::SharedClock;
use std::future::Future;

/// A fixed window as lease mode sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowState {
    /// Units charged in the window.
    pub used: u64,
    /// End of the window, milliseconds since the Unix epoch; 0 when there is no live window.
    pub reset_at_ms: u64,
}

/// A store call that did not produce an answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The call took longer than `store.timeout`.
    #[error("store call timed out after {0} ms")]
    Timeout(u64),
    /// Redis answered with an error or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// The store's connections were never opened ([`redis::RedisStore::start`]).
    #[error("store not started")]
    NotStarted,
    /// The node has no connection (it is being re-established in the background).
    #[error("{0}: not connected")]
    NotConnected(String),
    /// The node's circuit breaker is open: failing fast.
    #[error("{0}: circuit breaker open")]
    BreakerOpen(String),
    /// The memory store holds `store.max_callers` states and this caller would be a new
    /// one.
    #[error("memory store full: store.max_callers ({0}) states held")]
    Full(usize),
    /// The script's reply did not have the expected shape.
    #[error("unexpected reply from store: {0}")]
    BadReply(String),
}

impl StoreError {
    /// Whether the error is what a failover looks like from the client: the connection
    /// failed or timed out, or the node is now a read-only replica.
    pub fn suggests_failover(&self) -> bool {
        match self {
            StoreError::Timeout(_) | StoreError::NotConnected(_) => true,
            StoreError::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.code() == Some("READONLY")
            }
            _ => false,
        }
    }
}

/// One operation of a batch: `op` on the state of `key` under `policy`.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    /// Where the limit's state for one subject is kept.
    pub key: &'a LimitKey,
    /// The limit's algorithm and numbers.
    pub policy: &'a Policy,
    /// What to do.
    pub op: Op,
}

/// What a LEASE got ([`Store::lease`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Units granted to this gateway (0 when the window is full).
    pub granted: u64,
    /// The window after the grant; `used` counts every gateway's leased units.
    pub window: WindowState,
}

/// A place to keep limit state. All times are milliseconds since the Unix epoch, from
/// the gateway's clock (the `now_ms` arguments), except in a Redis store with
/// `store.clock = "redis"`: it ignores `now_ms` and its scripts read Redis's `TIME`, so
/// the times in its answers are Redis's. Batch calls answer one result per item, in
/// order; the Redis store sends the items that live on one shard in one script call.
pub trait Store: Send + Sync {
    /// Apply each item's operation at `now_ms` (ms since the Unix epoch; see
    /// [`crate::limiter::algorithm::apply`]). Items whose operations are all peeks may
    /// be answered from a stale copy (a replica); the others run on the primary.
    fn apply(
        &self,
        items: &[Item<'_>],
        now_ms: u64,
    ) -> impl Future<Output = Vec<Result<Verdict, StoreError>>> + Send;

    /// Take up to `want` units of `key`'s window for local admission (lease mode),
    /// never past `quota`: the granted units are counted in the window at once. A new
    /// window lasts `window_ms` from `now_ms` (ms since the Unix epoch).
    fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> impl Future<Output = Result<Grant, StoreError>> + Send;

    /// Give back `units` taken from the window that ends at `reset_at_ms`; nothing
    /// happens when that window is over. Returns the window after the refund.
    fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
    ) -> impl Future<Output = Result<WindowState, StoreError>> + Send;
}

/// How a store shows itself to the server, the admin endpoints and the metrics, none of
/// which match on the backend.
pub trait StoreStatus: Send + Sync {
    /// Start what the store needs in the background: the memory store's sweeper (every
    /// `store.sweep_interval`), or the Redis connections and script loading. Called for
    /// each new store; calling it again does nothing.
    fn start(&self, clock: SharedClock, sweep_every: std::time::Duration);
    /// `"memory"` or `"redis"`.
    fn kind(&self) -> &'static str;
    /// The state of every shard and node; empty for the memory store.
    fn report(&self) -> Vec<redis::ShardReport>;
    /// Whether limits can be enforced now: always for the memory store; with Redis, when
    /// every shard's primary (or the cluster) is connected and its breaker is not open.
    fn ready(&self) -> bool {
        primaries_ready(&self.report())
    }
}

/// Every shard's primary (or the cluster) connected with its breaker not open; false
/// when there are no shards.
pub fn primaries_ready(report: &[redis::ShardReport]) -> bool {
    !report.is_empty()
        && report.iter().all(|s| {
            let p = s.primary();
            p.connected && p.breaker != redis::BreakerState::Open
        })
}

impl StoreStatus for AnyStore {
    fn start(&self, clock: SharedClock, sweep_every: std::time::Duration) {
        match self {
            AnyStore::Memory(m) => m.start_sweeper(sweep_every, clock),
            AnyStore::Redis(r) => r.start(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            AnyStore::Memory(_) => "memory",
            AnyStore::Redis(_) => "redis",
        }
    }

    fn report(&self) -> Vec<redis::ShardReport> {
        match self {
            AnyStore::Memory(_) => Vec::new(),
            AnyStore::Redis(r) => r.report(),
        }
    }

    fn ready(&self) -> bool {
        match self {
            AnyStore::Memory(_) => true,
            AnyStore::Redis(_) => primaries_ready(&self.report()),
        }
    }
}

/// The store a gateway runs with, chosen by `store.backend`.
#[derive(Debug)]
pub enum AnyStore {
    /// `backend = "memory"`.
    Memory(memory::MemoryStore),
    /// `backend = "redis"`.
    Redis(redis::RedisStore),
}

impl Store for AnyStore {
    async fn apply(&self, items: &[Item<'_>], now_ms: u64) -> Vec<Result<Verdict, StoreError>> {
        match self {
            AnyStore::Memory(s) => s.apply(items, now_ms).await,
            AnyStore::Redis(s) => s.apply(items, now_ms).await,
        }
    }

    async fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> Result<Grant, StoreError> {
        match self {
            AnyStore::Memory(s) => s.lease(key, want, quota, window_ms, now_ms).await,
            AnyStore::Redis(s) => s.lease(key, want, quota, window_ms, now_ms).await,
        }
    }

    async fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
    ) -> Result<WindowState, StoreError> {
        match self {
            AnyStore::Memory(s) => s.refund(key, units, reset_at_ms).await,
            AnyStore::Redis(s) => s.refund(key, units, reset_at_ms).await,
        }
    }
}
