//! One Redis node (a primary or a replica): its multiplexed connection, kept up by a
//! background task, its circuit breaker and its counters.
//!
//! The task connects (with backoff), loads every script on the new connection — so a
//! restarted or flushed Redis never sees a NOSCRIPT stampede — and publishes the
//! connection. A call that finds the connection dropped wakes the task to reconnect.
//! Sentinel may point the node at a new address ([`Node::retarget`]).
//!
//! **Roles and failovers.** A shard's primary node ([`Role::Primary`]) publishes a
//! connection only once the server says it is a master (`ROLE`), and checks it again at
//! every probe: a primary demoted behind a stable address (a DNS name, a Kubernetes
//! Service, HAProxy: the address now reaches a replica, or the old primary was made a
//! replica) is dropped and reconnected — each TCP connect resolves the host name again
//! (redis-rs calls `tokio::net::lookup_host` per connect; nothing here keeps an
//! address) — with backoff until a master answers, asking Sentinel again meanwhile. A
//! write answered `READONLY` does the same and is sent once more on the new connection.
//! While the primary's writes fail, [`Node::writable`] is false and the shard's checks
//! follow `store.on_error` (see `Shard::check`). `LOADING` and `MASTERDOWN` answers are
//! not a dead node ([`StoreError::is_not_serving`]): no reconnect, no breaker failure; a
//! replica answering them is skipped for reads until its probe says it serves again.
//! A primary that comes back as another Redis process whose replication history does not
//! continue the old one's (a restart without persistence) is logged at warn.
//!
//! On a `per_core` gateway each worker also opens a connection of its own to the node
//! ([`WorkerConns`]), on its own runtime, so that the connection's I/O task runs on the
//! worker's thread: a call a worker sends, and its reply, then wake no other thread.
//! Those connections follow the node's: they are used only while the node's own
//! connection is up, and are dropped whenever it is replaced (reconnect, failover).

mod call;
mod connection;

use super::breaker::Breaker;
use super::dial::{Dialer, Endpoint};
use super::scripts::{LuaScript, Scripts};
use super::stats::NodeStats;
use super::watch::SentinelWatch;
use crate::limiter::store::status::BreakerState;
use crate::limiter::store::StoreError;
use arc_swap::ArcSwap;
use connection::{maintain, WorkerConns};
use redis::aio::MultiplexedConnection;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// How often a connected node is probed with `ROLE` (its role, and whether it answers).
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// The longest wait between two connects while a primary's address reaches a replica:
/// the address (a DNS name, a Service) may move to the new primary at any moment, and
/// each wait is time the shard's callers get `store.on_error`.
const REPLICA_RETRY_MAX: Duration = Duration::from_millis(250);

/// How long a worker waits after its own connection to a node failed to open before it
/// tries again (meanwhile it uses the node's shared connection).
const WORKER_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The `CLIENT SETNAME` of a node's shared connection (`CLIENT LIST` shows it).
const SHARED_NAME: &str = "tollgate";

/// What a node is in its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// The shard's primary: takes the writes, must say it is a master (`ROLE`).
    Primary,
    /// A replica: answers checks while it serves.
    Replica,
    /// A Redis Cluster master: the cluster's slot map ([`super::cluster`]) follows its
    /// failovers (`MOVED`, `READONLY`), so its node publishes whatever `ROLE` says; its
    /// failed writes fail its checks as a shard primary's do ([`Node::writable`]).
    ClusterMaster,
}

/// A shard's nodes, as the tasks that follow them (Sentinel's watcher, the
/// replica-freshness sampler) see them.
pub(super) trait ShardNodes: Send + Sync + 'static {
    /// The shard's position in `[[store.shards]]`.
    fn index(&self) -> usize;
    /// The shard's primary.
    fn primary(&self) -> &Node;
    /// The shard's replicas now (Sentinel's watcher replaces them).
    fn replicas(&self) -> &ArcSwap<Vec<Arc<Node>>>;
}

/// Settings shared by every node of a store.
#[derive(Debug, Clone)]
pub(super) struct NodeSettings {
    pub timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_cooloff: Duration,
    /// Opens every connection, with the store's current credentials and TLS settings.
    pub dialer: Arc<Dialer>,
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct Node {
    pub(super) label: String,
    target: Mutex<Option<Endpoint>>,
    conn: watch::Sender<Option<MultiplexedConnection>>,
    /// Each `per_core` worker's own connection (see the module documentation).
    workers: Arc<WorkerConns>,
    wake: Arc<Notify>,
    breaker: Breaker,
    pub(super) stats: Arc<NodeStats>,
    scripts: Arc<Scripts>,
    settings: NodeSettings,
    /// Primary or replica (see the module documentation).
    role: Role,
    /// False from a `LOADING` or `MASTERDOWN` answer until a probe says the node serves
    /// again (`ROLE`: a master, or a replica whose link to its master is up): a replica
    /// is skipped for reads meanwhile.
    serving: AtomicBool,
    /// Primary only: false while its writes fail (see [`Node::writable`]).
    writable: AtomicBool,
    /// Bumped each time the server confirms it is a writable master (a connection
    /// published after `ROLE` said master, a probe saying master, a write that
    /// succeeded): a write that fails only clears `writable` when no confirmation came
    /// since it started, so a late failure on a replaced connection cannot undo it.
    confirmed: AtomicU64,
    /// The last master's identity (`run_id`, `master_replid`), to tell a restart without
    /// persistence from a failover (primary only).
    identity: Mutex<Option<Identity>>,
    /// Sentinel to ask again when the primary says it is a replica.
    sentinel: OnceLock<Weak<SentinelWatch>>,
}

/// Who a primary's server is: `INFO server` and `INFO replication` fields.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Identity {
    run_id: String,
    replid: String,
    replid2: String,
}

/// What [`Node::call`] should do when the node is not connected at the moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WhenDisconnected {
    /// Wait for the connection, within the call's timeout (primaries).
    Wait,
    /// Fail at once so that another node can answer (replicas).
    FailFast,
}

impl Node {
    /// A node that connects to `client` (or waits for [`Node::retarget`] when `None`),
    /// through `settings.dialer`.
    /// Must be called inside a Tokio runtime: it spawns the connection task, which ends
    /// when the node is dropped.
    pub(super) fn spawn(
        label: String,
        client: Option<Endpoint>,
        scripts: Arc<Scripts>,
        settings: NodeSettings,
        role: Role,
    ) -> Arc<Node> {
        let stats = Arc::new(NodeStats::default());
        let breaker = Breaker::new(
            label.clone(),
            settings.breaker_failures,
            settings.breaker_cooloff,
            settings.timeout * 4,
            stats.clone(),
        );
        let node = Arc::new(Node {
            label,
            target: Mutex::new(client),
            conn: watch::channel(None).0,
            workers: Arc::default(),
            wake: Arc::new(Notify::new()),
            breaker,
            stats,
            scripts,
            settings,
            role,
            serving: AtomicBool::new(true),
            writable: AtomicBool::new(true),
            confirmed: AtomicU64::new(0),
            identity: Mutex::new(None),
            sentinel: OnceLock::new(),
        });
        tokio::spawn(maintain(Arc::downgrade(&node), node.wake.clone()));
        node
    }

    /// The address this node points at, e.g. `127.0.0.1:6379` ("" before Sentinel answered).
    pub(super) fn addr(&self) -> String {
        self.target
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(Endpoint::addr)
            .unwrap_or_default()
    }

    /// Point the node at a new address (after a failover) and reconnect.
    pub(super) fn retarget(&self, client: Endpoint) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = Some(client);
        self.publish(None);
        self.wake.notify_one();
    }

    /// Whether the node has a connection now.
    pub(super) fn is_connected(&self) -> bool {
        self.conn.borrow().is_some()
    }

    /// Whether a call would be tried now (connected, serving — not answering `LOADING`
    /// or `MASTERDOWN` — and breaker not open).
    pub(super) fn is_available(&self) -> bool {
        self.is_connected() && self.serving.load(Ordering::Acquire) && self.breaker.is_available()
    }

    /// Whether the node serves reads (false from a `LOADING` or `MASTERDOWN` answer
    /// until its probe says it serves again).
    pub(super) fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Acquire)
    }

    /// Primary: whether its writes succeed. False from a write that failed (any error,
    /// timeout included) or a `ROLE` that said replica, until a write succeeds or the
    /// (re)connected server says it is a master. Always true for a replica.
    pub(super) fn writable(&self) -> bool {
        self.writable.load(Ordering::Acquire)
    }

    /// Ask `sentinel` again whenever this primary says it is a replica.
    pub(super) fn follow(&self, sentinel: &Arc<SentinelWatch>) {
        let _ = self.sentinel.set(Arc::downgrade(sentinel));
    }

    /// Run a writing `script` on this primary ([`Node::call`], waiting for the
    /// connection) and record whether writes succeed ([`Node::writable`]).
    pub(super) async fn write(
        &self,
        script: &LuaScript,
        keys: &[&str],
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        let confirmed = self.writes_confirmed();
        let result = self.call(script, keys, args, WhenDisconnected::Wait).await;
        self.record_write(confirmed, &result);
        result
    }

    /// How many times the primary's writes have been confirmed so far: taken before a
    /// write, for [`Node::record_write`].
    pub(super) fn writes_confirmed(&self) -> u64 {
        self.confirmed.load(Ordering::Acquire)
    }

    /// The outcome of a write sent when [`Node::writes_confirmed`] said `confirmed`: a
    /// success confirms the primary's writes; a failure marks them failing, unless they
    /// were confirmed since (by a later write or a reconnect to a master).
    pub(super) fn record_write<T>(&self, confirmed: u64, result: &Result<T, StoreError>) {
        match result {
            Ok(_) => self.confirm_writable("a write succeeded"),
            Err(e) => {
                if self.writes_confirmed() == confirmed {
                    self.set_unwritable(e);
                }
            }
        }
    }

    /// The server has shown it takes writes: clear the failed-writes state.
    fn confirm_writable(&self, why: &str) {
        self.confirmed.fetch_add(1, Ordering::AcqRel);
        if !self.writable.swap(true, Ordering::AcqRel) {
            tracing::info!(node = %self.label, "redis primary writable again ({why}): the shard's checks are answered again");
        }
    }

    /// A write failed (or the server says it is a replica): the shard's checks follow
    /// `store.on_error` until it is writable again.
    fn set_unwritable(&self, why: &dyn std::fmt::Display) {
        if self.role != Role::Replica && self.writable.swap(false, Ordering::AcqRel) {
            tracing::warn!(node = %self.label, error = %why, "writes to the shard's primary fail: its checks follow store.on_error until a write succeeds or the primary is reconnected as a master");
        }
    }

    /// The connection of `generation` failed (or reached a replica): drop it, unless it
    /// has been replaced already, and let the connection task reconnect.
    fn drop_connection(&self, generation: u64) {
        let workers = &self.workers;
        self.conn.send_if_modified(|conn| {
            if workers.generation.load(Ordering::Acquire) != generation || conn.is_none() {
                return false;
            }
            workers.generation.fetch_add(1, Ordering::AcqRel);
            *conn = None;
            true
        });
        self.wake.notify_one();
    }

    /// The node answered `LOADING` or `MASTERDOWN`: alive, but skipped for reads until
    /// its probe says it serves again.
    fn set_not_serving(&self, e: &StoreError) {
        if self.serving.swap(false, Ordering::AcqRel) {
            tracing::warn!(node = %self.label, error = %e, "redis node is not serving (loading, or a replica cut off from its primary): reads skip it until it serves again");
        }
    }

    /// The node serves again (its probe said so).
    fn set_serving(&self) {
        if !self.serving.swap(true, Ordering::AcqRel) {
            tracing::info!(node = %self.label, "redis node serves again");
        }
    }

    /// The breaker's state.
    pub(super) fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Let the connection task see that the node is gone.
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod tests;
