//! What a Sentinel-managed shard's watcher ([`super::sentinel`]) is asked to do: the
//! master's name, the Sentinels to ask, and a trigger that any part of the shard (its
//! primary's node, a failed call) pulls when a failover may have happened.

use super::dial::Endpoint;
use std::sync::Arc;
use tokio::sync::Notify;

/// Re-resolution trigger for one Sentinel-managed shard.
#[derive(Debug)]
pub(super) struct SentinelWatch {
    /// The master's name in Sentinel.
    pub master: String,
    /// The Sentinels, asked in order.
    pub sentinels: Vec<Endpoint>,
    /// The announced primary and replicas are dialled with TLS (the Sentinels' URLs are
    /// `rediss://`).
    pub tls: bool,
    trigger: Notify,
}

impl SentinelWatch {
    pub(super) fn new(master: String, sentinels: Vec<Endpoint>) -> Arc<Self> {
        Arc::new(Self {
            master,
            tls: sentinels.iter().any(|s| s.tls),
            sentinels,
            trigger: Notify::new(),
        })
    }

    /// A call to the primary failed in a way a failover explains: ask Sentinel again.
    pub(super) fn suspect(&self) {
        self.trigger.notify_one();
    }

    /// Resolves once [`SentinelWatch::suspect`] was called (since the last time it
    /// resolved).
    pub(super) async fn suspected(&self) {
        self.trigger.notified().await;
    }
}
