//! `store.mode = "cluster"`: a Redis Cluster through redis-rs's cluster client, which
//! follows the slot map and handles MOVED/ASK. Every key carries a hash tag (`{…}`), so
//! all keys of one caller share a slot.

use super::breaker::Breaker;
use super::cluster_dial::Dialed;
use super::stats::{bump, NodeStats};
use super::Scripts;
use crate::limiter::store::StoreError;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// A Redis Cluster seen as one store node (one breaker, one set of counters).
pub(crate) struct ClusterNode {
    pub(super) label: String,
    conn: watch::Sender<Option<ClusterConnection<Dialed>>>,
    breaker: Breaker,
    pub(super) stats: Arc<NodeStats>,
    timeout: Duration,
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

impl ClusterNode {
    pub(super) fn spawn(
        client: ClusterClient,
        label: String,
        scripts: Arc<Scripts>,
        timeout: Duration,
        failures: u32,
        cooloff: Duration,
    ) -> Arc<Self> {
        let stats = Arc::new(NodeStats::default());
        let node = Arc::new(Self {
            breaker: Breaker::new(label.clone(), failures, cooloff, timeout * 4, stats.clone()),
            label,
            conn: watch::channel(None).0,
            stats,
            timeout,
        });
        let weak = Arc::downgrade(&node);
        tokio::spawn(async move {
            let mut backoff = super::backoff::Backoff::new();
            loop {
                let connected = async {
                    // Each node's connection through the store's dialer (TLS, credentials).
                    let mut conn = client.get_async_generic_connection::<Dialed>().await?;
                    // Load every script on every primary (SCRIPT LOAD goes to all of them).
                    for script in scripts.all() {
                        script.load(&mut conn).await?;
                    }
                    Ok::<_, redis::RedisError>(conn)
                };
                match connected.await {
                    Ok(conn) => {
                        let Some(node) = weak.upgrade() else { return };
                        bump(&node.stats.connects);
                        node.conn.send_replace(Some(conn));
                        tracing::info!(node = %node.label, "redis cluster connected, scripts loaded");
                        return;
                    }
                    Err(e) => {
                        if weak.strong_count() == 0 {
                            return;
                        }
                        tracing::warn!(error = %e, "redis cluster unreachable; retrying");
                        tokio::time::sleep(backoff.next_wait()).await;
                    }
                }
            }
        });
        node
    }

    pub(super) fn is_connected(&self) -> bool {
        self.conn.borrow().is_some()
    }

    pub(super) fn breaker_state(&self) -> super::breaker::BreakerState {
        self.breaker.state()
    }

    pub(super) async fn call(
        &self,
        script: &super::LuaScript,
        keys: &[&str],
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        let attempt = async {
            let mut conn = {
                let mut rx = self.conn.subscribe();
                let c = rx
                    .wait_for(Option::is_some)
                    .await
                    .map_err(|_| StoreError::NotConnected(self.label.clone()))?;
                c.clone()
                    .ok_or_else(|| StoreError::NotConnected(self.label.clone()))?
            };
            super::invoke(script, keys, args, &mut conn).await
        };
        self.breaker.guard(&self.stats, self.timeout, attempt).await
    }
}
