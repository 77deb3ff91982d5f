//! Counters of the Redis store, per node and per shard. They are plain atomics, read by
//! [`super::RedisStore::report`] (and by the metrics endpoint).

use prometheus_client::metrics::histogram::Histogram;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bucket bounds in seconds: 100 µs to 1 s (store calls and upstream responses alike).
pub const LATENCY_BUCKETS: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A latency histogram with [`LATENCY_BUCKETS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Counters of one Redis node (a primary or a replica).
#[derive(Debug)]
pub struct NodeStats {
    /// Latency of answered calls, seconds (buckets 100 µs to 1 s).
    pub latency: prometheus_client::metrics::histogram::Histogram,
    /// Script calls attempted (including ones refused by an open breaker).
    pub calls: AtomicU64,
    /// Calls that failed with an error (connection, server error), not counting timeouts.
    pub errors: AtomicU64,
    /// Calls that took longer than `store.timeout`.
    pub timeouts: AtomicU64,
    /// Calls refused at once because the breaker was open.
    pub rejected_by_breaker: AtomicU64,
    /// Breaker state changes.
    pub breaker_changes: AtomicU64,
    /// Successful (re)connections.
    pub connects: AtomicU64,
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
pub struct ShardStats {
    /// CHECKs meant for a replica that the primary answered instead.
    pub replica_fallbacks: AtomicU64,
}

/// A plain copy of counters, for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// See [`NodeStats::calls`].
    pub calls: u64,
    /// See [`NodeStats::errors`].
    pub errors: u64,
    /// See [`NodeStats::timeouts`].
    pub timeouts: u64,
    /// See [`NodeStats::rejected_by_breaker`].
    pub rejected_by_breaker: u64,
    /// See [`NodeStats::breaker_changes`].
    pub breaker_changes: u64,
    /// See [`NodeStats::connects`].
    pub connects: u64,
}

impl NodeStats {
    /// Read every counter.
    pub fn counts(&self) -> Counts {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counts {
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
