//! Counters of the Redis store, per node and per shard. They are plain atomics, read by
//! [`super::RedisStore::report`] (and so by the metrics endpoint).

use crate::limiter::store::status::{latency_histogram, NodeCounts};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one Redis node (a primary or a replica).
#[derive(Debug)]
pub(super) struct NodeStats {
    /// Latency of answered calls, seconds (buckets 100 µs to 1 s).
    pub(super) latency: prometheus_client::metrics::histogram::Histogram,
    /// Script calls attempted (including ones refused by an open breaker).
    pub(super) calls: AtomicU64,
    /// Calls that failed with an error (connection, server error), not counting timeouts.
    pub(super) errors: AtomicU64,
    /// Calls that took longer than `store.timeout`.
    pub(super) timeouts: AtomicU64,
    /// Calls refused at once because the breaker was open.
    pub(super) rejected_by_breaker: AtomicU64,
    /// Breaker state changes.
    pub(super) breaker_changes: AtomicU64,
    /// Successful (re)connections.
    pub(super) connects: AtomicU64,
}

impl Default for NodeStats {
    fn default() -> Self {
        Self {
            latency: latency_histogram(),
            calls: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            rejected_by_breaker: AtomicU64::new(0),
            breaker_changes: AtomicU64::new(0),
            connects: AtomicU64::new(0),
        }
    }
}

/// Counters of one shard beyond its nodes'.
#[derive(Debug, Default)]
pub(super) struct ShardStats {
    /// CHECKs meant for a replica that the primary answered instead.
    pub(super) replica_fallbacks: AtomicU64,
}

impl NodeStats {
    /// Read every counter.
    pub(super) fn counts(&self) -> NodeCounts {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NodeCounts {
            calls: r(&self.calls),
            errors: r(&self.errors),
            timeouts: r(&self.timeouts),
            rejected_by_breaker: r(&self.rejected_by_breaker),
            breaker_changes: r(&self.breaker_changes),
            connects: r(&self.connects),
        }
    }
}

pub(super) fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}
