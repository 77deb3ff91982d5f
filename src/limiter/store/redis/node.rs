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

use super::breaker::{Breaker, BreakerState};
use super::dial::{DialAs, Dialer, Endpoint};
use super::stats::{bump, NodeStats};
use super::Scripts;
use crate::limiter::store::StoreError;
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
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
    sentinel: OnceLock<Weak<super::sentinel::SentinelWatch>>,
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
    pub(super) fn follow(&self, sentinel: &Arc<super::sentinel::SentinelWatch>) {
        let _ = self.sentinel.set(Arc::downgrade(sentinel));
    }

    /// Run a writing `script` on this primary ([`Node::call`], waiting for the
    /// connection) and record whether writes succeed ([`Node::writable`]).
    pub(super) async fn write(
        &self,
        script: &super::LuaScript,
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

    /// Run `script` with `keys` and `args`, bounded by `store.timeout` (including the
    /// wait for a connection). NOSCRIPT is handled by loading the script and retrying.
    ///
    /// A primary that answers `READONLY` has become a replica: the connection is dropped,
    /// the connection task reconnects (a new TCP connect, the host name resolved again)
    /// and publishes a connection only to a server that says it is a master, and the
    /// call is sent once more on that connection, within the same timeout. That never
    /// counts twice: a script that fails with `READONLY` applied nothing. Redis 7 runs a
    /// script without flags (ours have no `#!lua` line) on a replica until its first
    /// write command, which fails with `-READONLY You can't write against a read only
    /// replica.` and aborts the script (ours use no `pcall`); every write before it
    /// would have failed the same way, so none was applied (checked with EVAL on a
    /// Redis 7.0 replica: `SET` then `SET` answers READONLY and leaves no key). A
    /// flagged script would be refused before it ran.
    ///
    /// `LOADING` and `MASTERDOWN` fail the call but are not a dead node: no reconnect, no
    /// breaker failure; the node is skipped for reads until its probe says it serves.
    pub(super) async fn call(
        &self,
        script: &super::LuaScript,
        keys: &[&str],
        args: &[u64],
        when: WhenDisconnected,
    ) -> Result<Vec<i64>, StoreError> {
        self.call_with(script, keys, args, when, false).await
    }

    /// [`Node::call`], preceded by `ASKING` when `asking` (a cluster's `ASK`
    /// redirection: the slot is being migrated to this node).
    pub(super) async fn call_with(
        &self,
        script: &super::LuaScript,
        keys: &[&str],
        args: &[u64],
        when: WhenDisconnected,
        asking: bool,
    ) -> Result<Vec<i64>, StoreError> {
        let attempt = self.attempt(script, keys, args, when, asking);
        let result = self
            .breaker
            .guard(&self.stats, self.settings.timeout, attempt)
            .await;
        if let Err(e) = &result {
            if e.is_not_serving() {
                self.set_not_serving(e);
            }
        }
        result
    }

    /// One script call, without the breaker or a time bound: on the connection `when`
    /// allows, `ASKING` first when `asking`; a primary's `READONLY` is followed (see
    /// [`Node::call`]), and a broken connection is handed to the connection task.
    async fn attempt(
        &self,
        script: &super::LuaScript,
        keys: &[&str],
        args: &[u64],
        when: WhenDisconnected,
        asking: bool,
    ) -> Result<Vec<i64>, StoreError> {
        let (mut conn, generation) = match self.connection(when).await {
            Some(c) => c,
            None => return Err(StoreError::NotConnected(self.label.clone())),
        };
        let first = if asking {
            super::invoke_asking(script, keys, args, &mut conn).await
        } else {
            super::invoke(script, keys, args, &mut conn).await
        };
        match first {
            Err(StoreError::Redis(e))
                if self.role == Role::Primary
                    && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly) =>
            {
                tracing::warn!(node = %self.label, error = %e, "redis primary answered READONLY: it is a replica now; reconnecting to follow the failover");
                self.set_unwritable(&e);
                self.suspect();
                self.drop_connection(generation);
                // Sent once more on the next connection (a master's: see `maintain`).
                let (mut conn, generation) = match self.connection(WhenDisconnected::Wait).await
                {
                    Some(c) => c,
                    None => return Err(StoreError::Redis(e)),
                };
                super::invoke(script, keys, args, &mut conn)
                    .await
                    .map_err(|e| (e, generation))
            }
            other => other.map_err(|e| (e, generation)),
        }
        .map_err(|(e, generation)| {
            if let StoreError::Redis(re) = &e {
                if breaks_connection(re) {
                    // Let the connection task reconnect (and reload the scripts).
                    self.drop_connection(generation);
                }
            }
            e
        })
    }

    /// Ask Sentinel again (a primary that says it is a replica).
    fn suspect(&self) {
        if let Some(s) = self.sentinel.get().and_then(Weak::upgrade) {
            s.suspect();
        }
    }

    /// Like [`Node::call`] for `lua/apply.lua` (`scripts.apply`), but the script call is
    /// not abandoned when its caller is answered with a timeout (`store.timeout`, through
    /// the breaker as usual): it runs on, as a task of its own, until it ends or `late`
    /// has passed since it started, and `on_late` gets its outcome when it ends after
    /// the caller was answered. A call that never got a connection ends as
    /// [`StoreError::NotConnected`] (it did not run). For calls that carry reservations,
    /// whose late answers say whether they landed ([`super::late`]).
    pub(super) async fn call_keeping_late(
        self: &Arc<Self>,
        scripts: Arc<Scripts>,
        keys: Vec<Arc<str>>,
        args: Vec<u64>,
        late: Duration,
        on_late: impl FnOnce(Result<Vec<i64>, StoreError>) + Send + 'static,
    ) -> Result<Vec<i64>, StoreError> {
        let node = self.clone();
        let attempt = async move {
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let deadline = tokio::time::Instant::now() + late;
                let names: Vec<&str> = keys.iter().map(|k| &**k).collect();
                // A connection is waited for within the caller's own bound only: a call
                // that had none by then did not run, and is never sent later (its
                // request was answered already; a reservation landing seconds later
                // would fill the caller's window until its refund).
                let connected = tokio::time::timeout(
                    node.settings.timeout,
                    node.connection(WhenDisconnected::Wait),
                )
                .await;
                let when = match connected {
                    Ok(Some(_)) => WhenDisconnected::Wait,
                    _ => WhenDisconnected::FailFast,
                };
                let call = node.attempt(&scripts.apply, &names, &args, when, false);
                let result = match tokio::time::timeout_at(deadline, call).await {
                    Ok(answer) => answer,
                    Err(_) => Err(StoreError::Timeout(late.as_millis() as u64)),
                };
                if let Err(result) = tx.send(result) {
                    on_late(result);
                }
            });
            rx.await.unwrap_or(Err(StoreError::NotStarted))
        };
        self.breaker
            .guard(&self.stats, self.settings.timeout, attempt)
            .await
    }

    /// `INFO replication` on this node (for the replica-freshness sampler,
    /// [`super::freshness`]): bounded by `store.timeout`, without waiting for a
    /// connection, and outside the breaker (a failed sample only keeps keys pinned to
    /// the primary).
    pub(super) async fn info_replication(&self) -> Result<String, StoreError> {
        let (mut conn, _) = self
            .connection(WhenDisconnected::FailFast)
            .await
            .ok_or_else(|| StoreError::NotConnected(self.label.clone()))?;
        let mut cmd = redis::cmd("INFO");
        cmd.arg("replication");
        let info = cmd.query_async::<String>(&mut conn);
        match tokio::time::timeout(self.settings.timeout, info).await {
            Ok(answer) => Ok(answer?),
            Err(_) => Err(StoreError::Timeout(self.settings.timeout.as_millis() as u64)),
        }
    }

    /// Replace the node's shared connection (`None`: disconnected), which drops every
    /// worker's own connection too.
    fn publish(&self, conn: Option<MultiplexedConnection>) {
        // Under the channel's lock, so that `drop_connection` sees both change together.
        self.conn.send_modify(|c| {
            self.workers.generation.fetch_add(1, Ordering::AcqRel);
            *c = conn;
        });
    }

    /// The connection a call uses: on a `per_core` worker its own once open, else the
    /// node's shared one.
    /// With the generation of the node's connection it belongs to (for
    /// [`Node::drop_connection`]).
    async fn connection(&self, when: WhenDisconnected) -> Option<(MultiplexedConnection, u64)> {
        let generation = self.workers.generation.load(Ordering::Acquire);
        let connected = self.conn.borrow().is_some();
        if connected {
            if let Some(c) = self.worker_connection() {
                return Some((c, generation));
            }
            if let Some(c) = self.conn.borrow().clone() {
                return Some((c, generation));
            }
        }
        if when == WhenDisconnected::FailFast {
            return None;
        }
        let mut rx = self.conn.subscribe();
        let c = rx.wait_for(Option::is_some).await.ok()?.clone()?;
        Some((c, self.workers.generation.load(Ordering::Acquire)))
    }

    /// This `per_core` worker's own connection to the node, while the node's shared
    /// connection (of the same generation) is up. When it is not open yet, a task on
    /// the worker's runtime opens it (scripts loaded first) and `None` is returned: the
    /// call goes over the shared connection meanwhile.
    fn worker_connection(&self) -> Option<MultiplexedConnection> {
        let (index, count) = crate::worker::current()?;
        let slots = self
            .workers
            .slots
            .get_or_init(|| (0..count).map(|_| Mutex::default()).collect());
        let generation = self.workers.generation.load(Ordering::Acquire);
        let mut slot = slots.get(index)?.lock().unwrap_or_else(|e| e.into_inner());
        if slot.generation != generation {
            // Opened for a connection of the node that has since been replaced.
            slot.conn = None;
            slot.failed_at = None;
            slot.generation = generation;
        }
        if let Some(c) = &slot.conn {
            return Some(c.clone());
        }
        if slot.connecting
            || slot
                .failed_at
                .is_some_and(|t| t.elapsed() < WORKER_RETRY_AFTER)
        {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let client = self
            .target
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        slot.connecting = true;
        drop(slot);
        let workers = self.workers.clone();
        let scripts = self.scripts.clone();
        let dialer = self.settings.dialer.clone();
        let label = self.label.clone();
        let timeout = self.settings.timeout.max(Duration::from_millis(500));
        runtime.spawn(async move {
            let name = format!("{SHARED_NAME}-worker-{index}");
            let opened = connect(&dialer, &client, &scripts, timeout, &name).await;
            let Some(slot) = workers.slots.get().and_then(|s| s.get(index)) else {
                return;
            };
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            slot.connecting = false;
            let current = workers.generation.load(Ordering::Acquire);
            match opened {
                Ok(conn) if slot.generation == generation && current == generation => {
                    tracing::debug!(node = %label, worker = index, "worker's own redis connection open");
                    slot.conn = Some(conn);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(node = %label, worker = index, error = %e, "worker's own redis connection failed to open; using the shared one");
                    slot.failed_at = Some(Instant::now());
                }
            }
        });
        None
    }
}

/// Whether a failed call means the connection itself is broken, so that the node
/// reconnects: a dropped connection, an I/O error, or what redis-rs deems unrecoverable
/// (a protocol error). An error reply from a live node — `LOADING`, `MASTERDOWN`,
/// `CLUSTERDOWN`, `TRYAGAIN`, `READONLY`, `MOVED`, `ASK`, `NOSCRIPT`, a script error —
/// never does: it is counted by the breaker, without connection churn.
fn breaks_connection(e: &redis::RedisError) -> bool {
    e.is_connection_dropped() || e.is_io_error() || e.is_unrecoverable_error()
}

/// Each `per_core` worker's own connection to a node (see the module documentation).
#[derive(Debug, Default)]
struct WorkerConns {
    /// One per worker, by its index; sized by the first worker to call.
    slots: OnceLock<Box<[Mutex<WorkerSlot>]>>,
    /// Bumped whenever the node's shared connection is replaced
    /// ([`Node::publish`]): a worker's connection of an older generation is dropped.
    generation: AtomicU64,
}

/// One worker's connection to a node.
#[derive(Default)]
struct WorkerSlot {
    conn: Option<MultiplexedConnection>,
    /// The generation of the node's shared connection `conn` was opened under.
    generation: u64,
    /// A task is opening `conn`.
    connecting: bool,
    /// When the last attempt to open it failed.
    failed_at: Option<Instant>,
}

impl std::fmt::Debug for WorkerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerSlot")
            .field("open", &self.conn.is_some())
            .field("generation", &self.generation)
            .field("connecting", &self.connecting)
            .finish()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Let the connection task see that the node is gone.
        self.wake.notify_one();
    }
}

/// What `ROLE` says about a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Said {
    /// A master.
    Master,
    /// A replica whose link to its master is up (`connected`): it serves reads.
    LinkedReplica,
    /// A replica whose link is down (or syncing).
    CutOffReplica,
    /// Alive, but its role is unknown (`ROLE` refused, e.g. by an ACL, or an odd reply).
    Unknown,
}

/// Ask `ROLE` (allowed while loading and on a stale replica). `Err`: the node did not
/// answer (connection or timeout).
async fn role(conn: &mut MultiplexedConnection, timeout: Duration) -> Result<Said, String> {
    let cmd = redis::cmd("ROLE");
    let asked = cmd.query_async::<redis::Value>(conn);
    match tokio::time::timeout(timeout, asked).await {
        Err(_) => Err(format!("no answer to ROLE within {timeout:?}")),
        Ok(Err(e))
            if e.is_io_error()
                || e.is_connection_dropped()
                || e.is_timeout()
                || e.is_unrecoverable_error() =>
        {
            Err(e.to_string())
        }
        // An error reply is an answer: the node is alive.
        Ok(Err(_)) => Ok(Said::Unknown),
        Ok(Ok(redis::Value::Array(items))) => {
            let text = |v: Option<&redis::Value>| match v {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(redis::Value::SimpleString(s)) => s.clone(),
                _ => String::new(),
            };
            Ok(match text(items.first()).as_str() {
                "master" => Said::Master,
                "slave" if text(items.get(3)) == "connected" => Said::LinkedReplica,
                "slave" => Said::CutOffReplica,
                _ => Said::Unknown,
            })
        }
        Ok(Ok(_)) => Ok(Said::Unknown),
    }
}

/// One field of an `INFO` text.
fn info_field(info: &str, field: &str) -> String {
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The identity of the master on `conn` (`INFO server`, `INFO replication`); `None` if
/// it does not say (e.g. `INFO` refused by an ACL).
async fn identity(conn: &mut MultiplexedConnection, timeout: Duration) -> Option<Identity> {
    let asked = async {
        let server: String = redis::cmd("INFO").arg("server").query_async(conn).await?;
        let replication: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(conn)
            .await?;
        Ok::<_, redis::RedisError>(Identity {
            run_id: info_field(&server, "run_id"),
            replid: info_field(&replication, "master_replid"),
            replid2: info_field(&replication, "master_replid2"),
        })
    };
    let id = tokio::time::timeout(timeout, asked).await.ok()?.ok()?;
    (!id.run_id.is_empty()).then_some(id)
}

impl Node {
    /// The primary's server is `now`: log at warn when it is another process whose
    /// replication history does not continue the last one's (it restarted, and without
    /// persistence it came back empty and will empty its replicas).
    fn note_identity(&self, now: Identity) {
        let mut last = self.identity.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(before) = last.as_ref() {
            if before.run_id != now.run_id {
                let continues = !before.replid.is_empty()
                    && (now.replid == before.replid || now.replid2 == before.replid);
                if continues {
                    tracing::info!(node = %self.label, run_id = %now.run_id, "the shard's primary is another redis process that continues the last one's replication history (a failover): windows kept");
                } else {
                    tracing::warn!(node = %self.label, old_run_id = %before.run_id, run_id = %now.run_id, "the shard's primary is a new redis process (run_id changed) that does not continue the last one's data: it restarted. Without persistence it restarted empty, and its replicas resync to empty: the shard's windows were lost and callers' counts restart from 0. Configure persistence on shard primaries (see docs/redis.md, Persistence)");
                }
            }
        }
        *last = Some(now);
    }
}

/// Keep `node` connected until it is dropped.
///
/// A primary's connection is published only once `ROLE` says master; while it says
/// replica, the connection is closed and the task tries again with backoff (asking
/// Sentinel again). A connected node is probed with `ROLE` every [`PROBE_EVERY`]: a
/// primary that now says replica is dropped and reconnected; a node that does not answer
/// is reconnected; a `LOADING` or `MASTERDOWN` answer is alive.
async fn maintain(node: Weak<Node>, wake: Arc<Notify>) {
    let mut backoff = super::backoff::Backoff::new();
    let mut failing_since_logged = false;
    let mut replica_since_logged = false;
    loop {
        let Some(n) = node.upgrade() else { return };
        let client = n.target.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(client) = client else {
            drop(n);
            wake.notified().await;
            continue;
        };
        let connect_timeout = n.settings.timeout.max(Duration::from_millis(500));
        let scripts = n.scripts.clone();
        let label = n.label.clone();
        let node_role = n.role;
        let dialer = n.settings.dialer.clone();
        drop(n);

        match connect(&dialer, &client, &scripts, connect_timeout, SHARED_NAME).await {
            Ok(mut conn) => {
                let said = match role(&mut conn, connect_timeout).await {
                    Ok(said) => said,
                    Err(e) => {
                        tracing::debug!(node = %label, error = %e, "redis node did not answer ROLE after connecting");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff.next_wait()) => {}
                            _ = wake.notified() => {}
                        }
                        continue;
                    }
                };
                let Some(n) = node.upgrade() else { return };
                if node_role == Role::Primary
                    && matches!(said, Said::LinkedReplica | Said::CutOffReplica)
                {
                    if !replica_since_logged {
                        tracing::warn!(node = %label, addr = %client.addr(), "the shard's primary address reaches a replica (ROLE says slave): waiting for a master there (retrying with backoff, asking Sentinel again)");
                        replica_since_logged = true;
                    }
                    n.set_unwritable(&"ROLE says slave");
                    n.suspect();
                    drop(n);
                    drop(conn);
                    tokio::select! {
                        _ = tokio::time::sleep(backoff.next_wait().min(REPLICA_RETRY_MAX)) => {}
                        _ = wake.notified() => {}
                    }
                    continue;
                }
                // A retarget while connecting makes this connection stale: try again.
                if n.target.lock().unwrap_or_else(|e| e.into_inner()).as_ref() != Some(&client) {
                    continue;
                }
                if node_role == Role::Primary {
                    if let Some(id) = identity(&mut conn, connect_timeout).await {
                        n.note_identity(id);
                    }
                }
                bump(&n.stats.connects);
                n.publish(Some(conn.clone()));
                if said == Said::Master || node_role != Role::Primary {
                    // The failures the breaker counted were the old connection's; this
                    // one answered (and a primary said master): calls may go through.
                    n.breaker.success();
                }
                if matches!(said, Said::Master | Said::LinkedReplica) {
                    n.set_serving();
                }
                if said == Said::Master && node_role != Role::Replica {
                    n.confirm_writable("reconnected to a master");
                }
                tracing::info!(node = %label, "redis node connected, scripts loaded");
                failing_since_logged = false;
                replica_since_logged = false;
                backoff.reset();
                let probe_timeout = n.settings.timeout.max(Duration::from_millis(500));
                drop(n);
                // Until a call finds the connection broken (and wakes us), ask ROLE every
                // PROBE_EVERY, so that readiness and the primary's role follow the node
                // without traffic.
                loop {
                    tokio::select! {
                        _ = wake.notified() => break,
                        _ = tokio::time::sleep(PROBE_EVERY) => {}
                    }
                    let said = role(&mut conn, probe_timeout).await;
                    let Some(n) = node.upgrade() else { return };
                    match said {
                        Err(e) => {
                            tracing::warn!(node = %label, error = %e, "redis node does not answer; reconnecting");
                            n.publish(None);
                            break;
                        }
                        Ok(Said::LinkedReplica | Said::CutOffReplica)
                            if node_role == Role::Primary =>
                        {
                            tracing::warn!(node = %label, "the shard's primary now says it is a replica (ROLE): it was demoted; reconnecting to follow the failover");
                            n.set_unwritable(&"ROLE says slave");
                            n.suspect();
                            n.publish(None);
                            break;
                        }
                        Ok(said @ (Said::Master | Said::LinkedReplica)) => {
                            n.set_serving();
                            if said == Said::Master && node_role != Role::Replica {
                                n.confirm_writable("the primary says it is a master");
                            }
                        }
                        Ok(_) => {}
                    }
                }
            }
            Err(e) => {
                if !failing_since_logged {
                    tracing::warn!(node = %label, error = %e, "redis node unreachable; reconnecting in the background");
                    failing_since_logged = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next_wait()) => {}
                    _ = wake.notified() => {}
                }
            }
        }
    }
}

/// Open a multiplexed connection to `client` through `dialer` (TLS, credentials), named
/// `name` (`CLIENT SETNAME`, where the server allows it), and load every script on it.
/// Its I/O task runs on the current runtime.
async fn connect(
    dialer: &Dialer,
    client: &Endpoint,
    scripts: &Scripts,
    timeout: Duration,
    name: &str,
) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new().set_response_timeout(Some(timeout * 4));
    let mut conn = dialer
        .connect(client, DialAs::Data, config, timeout)
        .await?;
    // Best effort: a server that renames or forbids CLIENT still serves the scripts.
    let _ = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(name)
        .query_async::<()>(&mut conn)
        .await;
    for script in scripts.all() {
        script.load(&mut conn).await?;
    }
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a node answers with `reply` (one RESP error line).
    fn answered(reply: &str) -> redis::RedisError {
        match redis::parse_redis_value(format!("-{reply}\r\n").as_bytes()) {
            Ok(v) => v.extract_error().expect_err("an error reply"),
            Err(e) => e,
        }
    }

    /// Error replies from a live node are not a dead connection: no reconnect.
    #[test]
    fn error_replies_from_a_live_node_keep_the_connection() {
        for reply in [
            "LOADING Redis is loading the dataset in memory",
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            "CLUSTERDOWN The cluster is down",
            "TRYAGAIN Multiple keys request during rehashing of slot",
            "READONLY You can't write against a read only replica.",
            "MOVED 3999 127.0.0.1:6381",
            "ASK 3999 127.0.0.1:6381",
            "NOSCRIPT No matching script.",
            "ERR Error running script",
        ] {
            let e = answered(reply);
            assert!(e.code().is_some(), "{reply}: {e:?}");
            assert!(!breaks_connection(&e), "{reply} must not reconnect");
        }
        let dropped =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(breaks_connection(&dropped));
    }
}
