//! What a store call did, for the trace of the request that made it (`[tracing]`):
//! [`StoreCall`] comes back with every answer (plain data, no allocation: the store
//! fills it as it answers whether the request is traced or not), and [`CallNote`] is
//! where a sampled request keeps it, with the node's address and the events of its
//! calls. An unsampled request (or tracing off) has no note: nothing is read.

use super::{AnyStore, StoreError};

/// Which node of a shard a call went to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NodeRole {
    /// The memory store (no node).
    #[default]
    Memory,
    /// The shard's primary.
    Primary,
    /// The shard's replica of this index (in its current list of replicas).
    Replica(u8),
    /// A Redis Cluster node (the cluster client picks it).
    Cluster,
}

impl NodeRole {
    /// `"primary"`, `"replica"`, `"memory"` or `"cluster"`.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeRole::Memory => "memory",
            NodeRole::Primary => "primary",
            NodeRole::Replica(_) => "replica",
            NodeRole::Cluster => "cluster",
        }
    }
}

/// The script a call ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Script {
    /// `lua/apply.lua` (peek, charge, reserve, refund of every algorithm).
    #[default]
    Apply,
    /// `lua/lease.lua` (lease mode's refills).
    Lease,
}

impl Script {
    /// The script's file name, e.g. `"apply.lua"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Script::Apply => "apply.lua",
            Script::Lease => "lease.lua",
        }
    }
}

/// A node's circuit breaker as a call found it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BreakerSeen {
    /// Closed (or not seen open).
    #[default]
    No,
    /// The call failed and the breaker of `node` was open after it: this call's failure
    /// (or one at the same time) opened it.
    Opened(NodeRole),
    /// The call was refused at once: the breaker of `node` was open (or, for a check
    /// on the primary, its writes fail while its breaker is open).
    Refused(NodeRole),
}

impl BreakerSeen {
    /// What a call to `node` that answered `result` tells of its breaker; `open`: whether
    /// the breaker is open now (asked only after a failure that was not a refusal).
    pub fn of<T>(
        node: NodeRole,
        result: &Result<T, StoreError>,
        open: impl FnOnce() -> bool,
    ) -> Self {
        match result {
            Ok(_) => BreakerSeen::No,
            Err(StoreError::BreakerOpen(_)) => BreakerSeen::Refused(node),
            // Not sent: the primary's writes fail; refused by its open breaker, if open.
            Err(e) => match (matches!(e, StoreError::NotWritable(_)), open()) {
                (_, false) => BreakerSeen::No,
                (true, true) => BreakerSeen::Refused(node),
                (false, true) => BreakerSeen::Opened(node),
            },
        }
    }
}

/// One store call as it was answered: the shard, the node, the script, and how many
/// operations and requests shared it (the batch).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCall {
    /// The shard's index in `[[store.shards]]` (0 in cluster mode and in memory).
    pub shard: u16,
    /// The node that answered (or failed) last.
    pub node: NodeRole,
    /// The script run.
    pub script: Script,
    /// Operations (keys) in the script call, this request's included.
    pub operations: u16,
    /// Requests whose operations shared the call, this one included (1: sent alone).
    pub requests: u16,
    /// The breaker of a node as the call found it.
    pub breaker: BreakerSeen,
}

impl StoreCall {
    /// A memory-store call of `operations` operations.
    pub fn memory(operations: usize) -> Self {
        StoreCall {
            operations: operations.min(u16::MAX as usize) as u16,
            requests: 1,
            ..StoreCall::default()
        }
    }
}

/// A lease refill a request made (lease mode): units asked and granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRefill {
    /// When it was answered, nanoseconds since the Unix epoch.
    pub at_ns: u64,
    /// Units asked for.
    pub wanted: u64,
    /// Units granted (0 on a failure, or a full window).
    pub granted: u64,
}

/// A breaker found open by one of a request's calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerEvent {
    /// When the call was answered, nanoseconds since the Unix epoch.
    pub at_ns: u64,
    /// The shard.
    pub shard: u16,
    /// The node's address (see [`CallNote::node`]).
    pub node: String,
    /// The call opened it (true), or was refused by it (false).
    pub opened: bool,
}

/// What a sampled request's check or charge notes of its store calls.
///
/// When its limits live on several shards (several calls), the attributes are the first
/// call's and `calls` counts them; every breaker found open is an event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallNote {
    /// The first call.
    pub first: Option<StoreCall>,
    /// The first call's node address: `"127.0.0.1:6381"`, `"memory"`, `"cluster"`.
    pub node: String,
    /// Calls made.
    pub calls: u32,
    /// Breakers found open.
    pub breakers: Vec<BreakerEvent>,
    /// The lease refill, if one was made.
    pub lease: Option<LeaseRefill>,
}

impl CallNote {
    /// Note `call` (the first of `calls` calls), answered now, made through `store`
    /// (which names its node).
    pub fn noted(&mut self, call: StoreCall, calls: u32, store: &AnyStore) {
        self.calls += calls;
        if self.first.is_none() {
            self.first = Some(call);
            self.node = store.node_addr(call.shard, call.node);
        }
        let (node, opened) = match call.breaker {
            BreakerSeen::No => return,
            BreakerSeen::Opened(n) => (n, true),
            BreakerSeen::Refused(n) => (n, false),
        };
        self.breakers.push(BreakerEvent {
            at_ns: crate::otel::span::now_ns(),
            shard: call.shard,
            node: store.node_addr(call.shard, node),
            opened,
        });
    }

    /// Note a lease refill of `wanted` units that got `granted`.
    pub fn refilled(&mut self, wanted: u64, granted: u64) {
        self.lease = Some(LeaseRefill {
            at_ns: crate::otel::span::now_ns(),
            wanted,
            granted,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refusal by the breaker, a failure after which it is open, and a check refused
    /// because the primary's writes fail while its breaker is open are told apart; an
    /// answer, or a failure with the breaker closed, shows nothing.
    #[test]
    fn a_call_tells_how_it_found_the_breaker() {
        let node = NodeRole::Primary;
        let ok: Result<(), StoreError> = Ok(());
        let open = || true;
        assert_eq!(BreakerSeen::of(node, &ok, open), BreakerSeen::No);
        let refused: Result<(), _> = Err(StoreError::BreakerOpen("n".into()));
        assert_eq!(
            BreakerSeen::of(node, &refused, || false),
            BreakerSeen::Refused(node)
        );
        let timeout: Result<(), _> = Err(StoreError::Timeout(50));
        assert_eq!(
            BreakerSeen::of(node, &timeout, open),
            BreakerSeen::Opened(node)
        );
        assert_eq!(BreakerSeen::of(node, &timeout, || false), BreakerSeen::No);
        let unwritable: Result<(), _> = Err(StoreError::NotWritable("n".into()));
        assert_eq!(
            BreakerSeen::of(node, &unwritable, open),
            BreakerSeen::Refused(node)
        );
        assert_eq!(
            BreakerSeen::of(node, &unwritable, || false),
            BreakerSeen::No
        );
    }
}
