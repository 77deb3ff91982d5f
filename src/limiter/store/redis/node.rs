//! One Redis node (a primary or a replica): its multiplexed connection, kept up by a
//! background task, its circuit breaker and its counters.
//!
//! The task connects (with backoff), loads every script on the new connection — so a
//! restarted or flushed Redis never sees a NOSCRIPT stampede — and publishes the
//! connection. A call that finds the connection dropped wakes the task to reconnect.
//! Sentinel may point the node at a new address ([`Node::retarget`]).

use super::breaker::{Breaker, BreakerState};
use super::stats::{bump, NodeStats};
use super::Scripts;
use crate::limiter::store::StoreError;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Script};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::{watch, Notify};

/// How often a connected node is probed with PING when nothing else talks to it.
const PROBE_EVERY: Duration = Duration::from_secs(1);

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
        self.conn.send_replace(None);
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
        script: &Script,
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
                self.conn.send_replace(None);
                self.wake.notify_one();
            }
        }
        result
    }

    async fn connection(&self, when: WhenDisconnected) -> Option<MultiplexedConnection> {
        if let Some(c) = self.conn.borrow().as_ref() {
            return Some(c.clone());
        }
        if when == WhenDisconnected::FailFast {
            return None;
        }
        let mut rx = self.conn.subscribe();
        let c = rx.wait_for(Option::is_some).await.ok()?;
        c.clone()
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

        match connect(&client, &scripts, connect_timeout).await {
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
                n.conn.send_replace(Some(conn.clone()));
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
                        n.conn.send_replace(None);
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

/// Open a multiplexed connection and load every script on it.
async fn connect(
    client: &redis::Client,
    scripts: &Scripts,
    timeout: Duration,
) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout * 4));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    for script in scripts.all() {
        script.prepare_invoke().load_async(&mut conn).await?;
    }
    Ok(conn)
}
