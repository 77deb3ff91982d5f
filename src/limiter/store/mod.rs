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
#[derive(Debug, thiserror::Error)]
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

/// A place to keep fixed windows. All times are milliseconds since the Unix epoch, from
/// the gateway's clock.
pub trait Store: Send + Sync {
    /// Read `key`'s window (a CHECK); past windows read as empty. May be served from a
    /// stale copy.
    fn check(
        &self,
        key: &LimitKey,
        now_ms: u64,
    ) -> impl Future<Output = Result<WindowState, StoreError>> + Send;

    /// Add `cost` units to `key`'s window (a CHARGE), starting a window of `window_ms`
    /// when none is live. Returns the window after the charge.
    fn charge(
        &self,
        key: &LimitKey,
        cost: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> impl Future<Output = Result<WindowState, StoreError>> + Send;
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
    async fn check(&self, key: &LimitKey, now_ms: u64) -> Result<WindowState, StoreError> {
        match self {
            AnyStore::Memory(s) => s.check(key, now_ms).await,
            AnyStore::Redis(s) => s.check(key, now_ms).await,
        }
    }

    async fn charge(
        &self,
        key: &LimitKey,
        cost: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> Result<WindowState, StoreError> {
        match self {
            AnyStore::Memory(s) => s.charge(key, cost, window_ms, now_ms).await,
            AnyStore::Redis(s) => s.charge(key, cost, window_ms, now_ms).await,
        }
    }
}
