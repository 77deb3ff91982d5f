//! What the Redis store reports of its shards and nodes ([`StoreStatus::report`]), in
//! the store's backend-neutral terms.
//!
//! [`StoreStatus::report`]: crate::limiter::store::StoreStatus::report

use super::node::Node;
use super::{RedisStore, Topology};
use crate::limiter::store::status::{NodeReport, NodeRole, ShardReport};
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl RedisStore {
    /// The state and counters of every shard and node, for health checks and metrics.
    pub fn report(&self) -> Vec<ShardReport> {
        match self.live.get() {
            None => Vec::new(),
            Some(Topology::Cluster(c)) => c
                .masters()
                .into_iter()
                .enumerate()
                .map(|(index, m)| ShardReport {
                    index,
                    replica_fallbacks: 0,
                    writable: m.node.writable(),
                    nodes: vec![NodeReport {
                        role: NodeRole::Primary,
                        label: m.node.label.clone(),
                        addr: m.addr,
                        connected: m.node.is_connected(),
                        serving: m.node.is_serving(),
                        breaker: m.node.breaker_state(),
                        counts: m.node.stats.counts(),
                        latency: m.node.stats.latency.clone(),
                        slots: Some(m.slots),
                    }],
                })
                .collect(),
            Some(Topology::Sharded(shards)) => shards
                .iter()
                .map(|s| {
                    let node = |role, n: &Arc<Node>| NodeReport {
                        role,
                        label: n.label.clone(),
                        addr: n.addr(),
                        connected: n.is_connected(),
                        serving: n.is_serving(),
                        breaker: n.breaker_state(),
                        counts: n.stats.counts(),
                        latency: n.stats.latency.clone(),
                        slots: None,
                    };
                    let mut nodes = vec![node(NodeRole::Primary, &s.primary)];
                    nodes.extend(s.replicas.load().iter().map(|r| node(NodeRole::Replica, r)));
                    ShardReport {
                        index: s.index,
                        replica_fallbacks: s.stats.replica_fallbacks.load(Ordering::Relaxed),
                        writable: s.primary.writable(),
                        nodes,
                    }
                })
                .collect(),
        }
    }
}
