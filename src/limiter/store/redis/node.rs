//! One Redis node (a primary or a replica): its multiplexed connection, kept up by a
//! background task, its circuit breaker and its counters.
//!
//! The task connects (with backoff), loads every script on the new connection — so a
//! restarted or flushed Redis never sees a NOSCRIPT stampede — and publishes the
//! connection. A call that finds the connection dropped wakes the task to reconnect.
//! Sentinel may point the node at a new address ([`Node::retarget`]).
//!
//! On a `per_core` gateway each worker also opens a connection of its own to the node
//! ([`WorkerConns`]), on its own runtime, so that the connection's I/O task runs on the
//! worker's thread: a call a worker sends, and its reply, then wake no other thread.
//! Those connections follow the node's: they are used only while the node's own
//! connection is up, and are dropped whenever it is replaced (reconnect, failover).

use super::breaker::{Breaker, BreakerState};
use super::stats::{bump, NodeStats};
use super::Scripts;
use crate::limiter::store::StoreError;
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// How often a connected node is probed with PING when nothing else talks to it.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How long a worker waits after its own connection to a node failed to open before it
/// tries again (meanwhile it uses the node's shared connection).
const WORKER_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The `CLIENT SETNAME` of a node's shared connection (`CLIENT LIST` shows it).
const SHARED_NAME: &str = "tollgate";

/// Settings shared by every node of a store.
#[derive(Debug, Clone)]
pub(super) struct NodeSettings {
    pub timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_cooloff: Duration,
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct Node {
    pub(super) label: String,
    target: Mutex<Option<redis::Client>>,
    conn: watch::Sender<Option<MultiplexedConnection>>,
    /// Each `per_core` worker's own connection (see the module documentation).
    workers: Arc<WorkerConns>,
    wake: Arc<Notify>,
    breaker: Breaker,
    pub(super) stats: Arc<NodeStats>,
    scripts: Arc<Scripts>,
    settings: NodeSettings,
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
    /// A node that connects to `client` (or waits for [`Node::retarget`] when `None`).
    /// Must be called inside a Tokio runtime: it spawns the connection task, which ends
    /// when the node is dropped.
    pub(super) fn spawn(
        label: String,
        client: Option<redis::Client>,
        scripts: Arc<Scripts>,
        settings: NodeSettings,
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
            .map(|c| c.get_connection_info().addr().to_string())
            .unwrap_or_default()
    }

    /// Point the node at a new address (after a failover) and reconnect.
    pub(super) fn retarget(&self, client: redis::Client) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = Some(client);
        self.publish(None);
        self.wake.notify_one();
    }

    /// Whether the node has a connection now.
    pub(super) fn is_connected(&self) -> bool {
        self.conn.borrow().is_some()
    }

    /// Whether a call would be tried now (connected and breaker not open).
    pub(super) fn is_available(&self) -> bool {
        self.is_connected() && self.breaker.is_available()
    }

    /// The breaker's state.
    pub(super) fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }

    /// Run `script` with `keys` and `args`, bounded by `store.timeout` (including the
    /// wait for a connection). NOSCRIPT is handled by loading the script and retrying.
    pub(super) async fn call(
        &self,
        script: &super::LuaScript,
        keys: &[&str],
        args: &[u64],
        when: WhenDisconnected,
    ) -> Result<Vec<i64>, StoreError> {
        let attempt = async {
            let mut conn = match self.connection(when).await {
                Some(c) => c,
                None => return Err(StoreError::NotConnected(self.label.clone())),
            };
            super::invoke(script, keys, args, &mut conn).await
        };
        let result = self
            .breaker
            .guard(&self.stats, self.settings.timeout, attempt)
            .await;
        if let Err(StoreError::Redis(e)) = &result {
            if e.is_connection_dropped() || e.is_io_error() || e.is_unrecoverable_error() {
                // Let the connection task reconnect (and reload the scripts).
                self.publish(None);
                self.wake.notify_one();
            }
        }
        result
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
                let result = match tokio::time::timeout_at(
                    deadline,
                    node.connection(WhenDisconnected::Wait),
                )
                .await
                {
                    Ok(Some(mut conn)) => {
                        let call = super::invoke(&scripts.apply, &names, &args, &mut conn);
                        match tokio::time::timeout_at(deadline, call).await {
                            Ok(answer) => answer,
                            Err(_) => Err(StoreError::Timeout(late.as_millis() as u64)),
                        }
                    }
                    _ => Err(StoreError::NotConnected(node.label.clone())),
                };
                if let Err(StoreError::Redis(e)) = &result {
                    if e.is_connection_dropped() || e.is_io_error() || e.is_unrecoverable_error() {
                        node.publish(None);
                        node.wake.notify_one();
                    }
                }
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
        let mut conn = self
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
        self.workers.generation.fetch_add(1, Ordering::AcqRel);
        self.conn.send_replace(conn);
    }

    /// The connection a call uses: on a `per_core` worker its own once open, else the
    /// node's shared one.
    async fn connection(&self, when: WhenDisconnected) -> Option<MultiplexedConnection> {
        let connected = self.conn.borrow().is_some();
        if connected {
            if let Some(c) = self.worker_connection() {
                return Some(c);
            }
            if let Some(c) = self.conn.borrow().clone() {
                return Some(c);
            }
        }
        if when == WhenDisconnected::FailFast {
            return None;
        }
        let mut rx = self.conn.subscribe();
        let c = rx.wait_for(Option::is_some).await.ok()?;
        c.clone()
    }

    /// This `per_core` worker's own connection to the node, while the node's shared
    /// connection (of the same generation) is up. When it is not open yet, a task on
    /// the worker's runtime opens it (scripts loaded first) and `None` is returned: the
    /// call goes over the shared connection meanwhile.
    fn worker_connection(&self) -> Option<MultiplexedConnection> {
        let (index, count) = crate::server::runtime::worker()?;
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
        let label = self.label.clone();
        let timeout = self.settings.timeout.max(Duration::from_millis(500));
        runtime.spawn(async move {
            let name = format!("{SHARED_NAME}-worker-{index}");
            let opened = connect(&client, &scripts, timeout, &name).await;
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

/// Keep `node` connected until it is dropped.
async fn maintain(node: Weak<Node>, wake: Arc<Notify>) {
    let mut backoff = super::backoff::Backoff::new();
    let mut failing_since_logged = false;
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
        drop(n);

        match connect(&client, &scripts, connect_timeout, SHARED_NAME).await {
            Ok(conn) => {
                let Some(n) = node.upgrade() else { return };
                // A retarget while connecting makes this connection stale: try again.
                if n.target
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                    .map(|c| c.get_connection_info().addr().to_string())
                    != Some(client.get_connection_info().addr().to_string())
                {
                    continue;
                }
                bump(&n.stats.connects);
                n.publish(Some(conn.clone()));
                tracing::info!(node = %label, "redis node connected, scripts loaded");
                failing_since_logged = false;
                backoff.reset();
                let probe_timeout = n.settings.timeout.max(Duration::from_millis(500));
                drop(n);
                // Until a call finds the connection broken (and wakes us), PING it every
                // PROBE_EVERY, so that readiness follows the node without traffic.
                let mut conn = conn;
                loop {
                    tokio::select! {
                        _ = wake.notified() => break,
                        _ = tokio::time::sleep(PROBE_EVERY) => {}
                    }
                    let ping = redis::cmd("PING");
                    let answered =
                        tokio::time::timeout(probe_timeout, ping.query_async::<String>(&mut conn))
                            .await;
                    if !matches!(answered, Ok(Ok(_))) {
                        let Some(n) = node.upgrade() else { return };
                        tracing::warn!(node = %label, "redis node does not answer PING; reconnecting");
                        n.publish(None);
                        break;
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

/// Open a multiplexed connection named `name` (`CLIENT SETNAME`, where the server
/// allows it) and load every script on it. Its I/O task runs on the current runtime.
async fn connect(
    client: &redis::Client,
    scripts: &Scripts,
    timeout: Duration,
    name: &str,
) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout * 4));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
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
