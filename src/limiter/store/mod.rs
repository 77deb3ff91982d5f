//! Where windows are kept: the [`Store`] trait and its two implementations.
//!
//! Both stores implement one fixed-window design (GitHub's, see `lua/`): a window is
//! `(used, reset_at_ms)`; a CHECK reads it and treats a window whose `reset_at_ms <= now`
//! as empty; a CHARGE starts a new window (`reset_at_ms = now + window`) when the stored
//! one is missing or past, then adds the cost. `reset_at` is stored, never derived from
//! a TTL.

pub mod memory;
pub mod redis;

use super::key::LimitKey;
use crate::clock::SharedClock;
use std::future::Future;

/// A fixed window as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowState {
    /// Units charged in the window.
    pub used: u64,
    /// End of the window, milliseconds since the Unix epoch; 0 when there is no live window.
    pub reset_at_ms: u64,
}

impl WindowState {
    /// True when no live window exists (never charged, or past its reset).
    pub fn is_empty(&self) -> bool {
        self.reset_at_ms == 0
    }
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
    /// The script's reply was not `{used, reset_at_ms}`.
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

/// One CHARGE of a batch: `cost` units on `key`'s window, starting a window of
/// `window_ms` milliseconds when none is live.
#[derive(Debug, Clone, Copy)]
pub struct Charge<'a> {
    /// The window.
    pub key: &'a LimitKey,
    /// Units to add (>= 1).
    pub cost: u64,
    /// Window length for a new window, milliseconds.
    pub window_ms: u64,
}

/// What a LEASE got ([`Store::lease`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Units granted to this gateway (0 when the window is full).
    pub granted: u64,
    /// The window after the grant; `used` counts every gateway's leased units.
    pub window: WindowState,
}

/// A place to keep fixed windows. All times are milliseconds since the Unix epoch, from
/// the gateway's clock. Batch calls answer one result per item, in order; the Redis
/// store sends the items that live on one shard in one script call.
pub trait Store: Send + Sync {
    /// Read each key's window (a CHECK); past windows read as empty. May be served from
    /// a stale copy (a replica).
    fn check(
        &self,
        keys: &[&LimitKey],
        now_ms: u64,
    ) -> impl Future<Output = Vec<Result<WindowState, StoreError>>> + Send;

    /// Add each item's cost to its window (a CHARGE), starting a window when none is
    /// live. Returns each window after the charge.
    fn charge(
        &self,
        items: &[Charge<'_>],
        now_ms: u64,
    ) -> impl Future<Output = Vec<Result<WindowState, StoreError>>> + Send;

    /// Take up to `want` units of `key`'s window for local admission (lease mode),
    /// never past `quota`: the granted units are counted in the window at once.
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
    async fn check(&self, keys: &[&LimitKey], now_ms: u64) -> Vec<Result<WindowState, StoreError>> {
        match self {
            AnyStore::Memory(s) => s.check(keys, now_ms).await,
            AnyStore::Redis(s) => s.check(keys, now_ms).await,
        }
    }

    async fn charge(
        &self,
        items: &[Charge<'_>],
        now_ms: u64,
    ) -> Vec<Result<WindowState, StoreError>> {
        match self {
            AnyStore::Memory(s) => s.charge(items, now_ms).await,
            AnyStore::Redis(s) => s.charge(items, now_ms).await,
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
