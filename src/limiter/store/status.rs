//! How a store shows itself to the server, the admin endpoints and the metrics, in
//! terms that name no backend: [`StoreStatus`], its per-shard [`ShardReport`] and
//! per-node [`NodeReport`], and the readiness rules built on them.

use crate::clock::SharedClock;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::histogram::Histogram;

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
    fn report(&self) -> Vec<ShardReport>;
    /// Whether limits can be enforced now: always for the memory store; with Redis, when
    /// every shard's primary (or the cluster) is connected, its breaker is not open and
    /// its writes succeed ([`ShardReport::writable`]).
    fn ready(&self) -> bool {
        primaries_ready(&self.report())
    }
    /// Write the store's own metric families (`tollgate_store_*`, read at scrape time)
    /// into `enc`; the memory store has none. Errors: only `enc`'s.
    fn encode_metrics(&self, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let _ = enc;
        Ok(())
    }
}

/// The state of one shard (in cluster mode, of one master).
#[derive(Debug, Clone)]
pub struct ShardReport {
    /// Position in `[[store.shards]]`; in cluster mode, the master's position in the
    /// slot map, ordered by its first slot.
    pub index: usize,
    /// CHECKs meant for a replica that the primary answered.
    pub replica_fallbacks: u64,
    /// Whether the primary's writes succeed: false from a failed write (or a primary that
    /// says it is a replica) until a write succeeds or the primary is reconnected as a
    /// master. While false, the shard's checks fail and `store.on_error` decides. Always
    /// true in cluster mode.
    pub writable: bool,
    /// The primary first, then the replicas.
    pub nodes: Vec<NodeReport>,
}

impl ShardReport {
    /// The shard's primary (or the cluster).
    pub fn primary(&self) -> &NodeReport {
        &self.nodes[0]
    }
}

/// The state of one node of a shard.
#[derive(Debug, Clone)]
pub struct NodeReport {
    /// What the node is in its shard (a cluster's masters are primaries, each in a
    /// [`ShardReport`] of its own).
    pub role: NodeRole,
    /// Name used in logs.
    pub label: String,
    /// `HOST:PORT` it points at now.
    pub addr: String,
    /// Whether it has a live connection.
    pub connected: bool,
    /// False while it answers that it does not serve (Redis: `LOADING` or `MASTERDOWN`;
    /// a replica is then skipped for reads), until its probe says it serves again.
    pub serving: bool,
    /// Its circuit breaker.
    pub breaker: BreakerState,
    /// Its counters.
    pub counts: NodeCounts,
    /// Its call latency histogram, seconds (shared with the node; read at scrape time).
    pub latency: Histogram,
    /// In cluster mode, the hash slots the master serves, e.g. `"0-5460"` or
    /// `"0-99,200-300"` (empty for a master a redirection named before the slot map
    /// listed it); `None` in sharded mode.
    pub slots: Option<String>,
}

/// What a node is in its shard, shown as `"primary"` or `"replica"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// Takes the writes (and the reads when no replica serves them).
    Primary,
    /// Answers checks while it serves.
    Replica,
}

impl NodeRole {
    /// `"primary"` or `"replica"`.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeRole::Primary => "primary",
            NodeRole::Replica => "replica",
        }
    }
}

impl std::fmt::Display for NodeRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role equals its name (`"primary"`, `"replica"`).
impl PartialEq<&str> for NodeRole {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// A node's circuit breaker, as reported by `/readyz`, the metrics and the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls fail at once until the cool-off ends.
    Open,
    /// One probe call is allowed.
    HalfOpen,
}

impl BreakerState {
    /// `"closed"`, `"open"` or `"half_open"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }

    /// The value of `tollgate_store_breaker_state`: 0 closed, 1 half-open, 2 open.
    pub fn gauge(&self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }
}

/// A node's counters, read at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeCounts {
    /// Calls attempted (including ones refused by an open breaker).
    pub calls: u64,
    /// Calls that failed with an error (connection, server error), not counting timeouts.
    pub errors: u64,
    /// Calls that took longer than `store.timeout`.
    pub timeouts: u64,
    /// Calls refused at once because the breaker was open.
    pub rejected_by_breaker: u64,
    /// Breaker state changes.
    pub breaker_changes: u64,
    /// Successful (re)connections.
    pub connects: u64,
}

/// Every shard's primary (or the cluster) connected with its breaker not open and its
/// writes succeeding; false when there are no shards.
pub fn primaries_ready(report: &[ShardReport]) -> bool {
    !report.is_empty() && report.iter().all(|s| shard_unready(s).is_none())
}

/// Why a shard cannot enforce its limits now (`None`: it can): its primary is not
/// connected, its breaker is open, or its writes fail. Shown by `/readyz`.
pub fn shard_unready(s: &ShardReport) -> Option<&'static str> {
    let p = s.primary();
    if !s.writable {
        Some("writes to the primary fail (a failed or demoted primary); checks follow store.on_error")
    } else if !p.connected {
        Some("primary not connected")
    } else if p.breaker == BreakerState::Open {
        Some("primary's circuit breaker open")
    } else {
        None
    }
}

/// Latency bucket bounds in seconds: 100 µs to 1 s (store calls and upstream responses
/// alike).
pub const LATENCY_BUCKETS: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A latency histogram with [`LATENCY_BUCKETS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}
