//! Shards managed by Redis Sentinel: find the primary and replicas, follow failovers.
//!
//! A watcher task asks the Sentinels (in order, first answer wins)
//! `SENTINEL get-master-addr-by-name NAME` and `SENTINEL replicas NAME`, and points the
//! shard's primary [`Node`] at the answer. It asks again every 10 s, at once when a call
//! to the primary fails (connection error, timeout, `READONLY`: the shard asks through
//! [`SentinelWatch::suspect`]; the primary's node asks too when its `ROLE` says it is a
//! replica), and when any Sentinel publishes `+switch-master` (a subscription per
//! Sentinel).
//!
//! Every connection goes through the store's [`Dialer`]: Sentinels with
//! `store.sentinel_username` / `store.sentinel_password`, the nodes they announce with
//! `store.username` / `store.password`. When a shard's Sentinel URLs are `rediss://`,
//! the Sentinels and the nodes they announce are dialled with TLS.

use super::dial::{DialAs, Dialer, Endpoint};
use super::node::{Node, NodeSettings, Role, ShardNodes};
use super::scripts::Scripts;
use super::watch::SentinelWatch;
use futures_util::StreamExt;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Start the watcher and the `+switch-master` subscriptions of `watch` for `shard`.
pub(super) fn start<S: ShardNodes>(
    watch: &Arc<SentinelWatch>,
    shard: &Arc<S>,
    scripts: Arc<Scripts>,
    settings: NodeSettings,
) {
    tokio::spawn(follow(
        Arc::downgrade(shard),
        watch.clone(),
        scripts,
        settings.clone(),
    ));
    for sentinel in &watch.sentinels {
        tokio::spawn(subscribe(
            Arc::downgrade(watch),
            sentinel.clone(),
            watch.master.clone(),
            settings.dialer.clone(),
        ));
    }
}

/// What Sentinel says about a master.
#[derive(Debug, PartialEq, Eq)]
struct Resolved {
    primary: String,
    replicas: Vec<String>,
}

async fn resolve(watch: &SentinelWatch, dialer: &Dialer, timeout: Duration) -> Option<Resolved> {
    for sentinel in &watch.sentinels {
        let asked = async {
            let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(timeout));
            let mut conn = dialer
                .connect(sentinel, DialAs::Sentinel, config, timeout)
                .await?;
            let (host, port): (String, u16) = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(&watch.master)
                .query_async(&mut conn)
                .await?;
            let replicas: Vec<std::collections::HashMap<String, String>> = redis::cmd("SENTINEL")
                .arg("replicas")
                .arg(&watch.master)
                .query_async(&mut conn)
                .await?;
            let replicas = replicas
                .into_iter()
                .filter(|r| {
                    let flags = r.get("flags").map(String::as_str).unwrap_or("");
                    !flags.contains("down")
                        && !flags.contains("disconnected")
                        && r.get("master-link-status").is_none_or(|s| s == "ok")
                })
                .filter_map(|r| Some(format!("{}:{}", r.get("ip")?, r.get("port")?)))
                .collect();
            Ok::<_, redis::RedisError>(Resolved {
                primary: format!("{host}:{port}"),
                replicas,
            })
        };
        match tokio::time::timeout(timeout, asked).await {
            Ok(Ok(r)) => return Some(r),
            Ok(Err(e)) => {
                tracing::debug!(master = %watch.master, sentinel = %sentinel.addr(), error = %e, "sentinel did not answer")
            }
            Err(_) => tracing::debug!(master = %watch.master, "sentinel timed out"),
        }
    }
    None
}

/// The node Sentinel announced at `addr` (`HOST:PORT`), dialled with TLS when `tls`.
fn client_for(addr: &str, tls: bool) -> Option<Endpoint> {
    let (host, port) = addr.rsplit_once(':')?;
    Some(Endpoint::announced(host, port.parse().ok()?, tls))
}

/// Point `shard`'s nodes at what Sentinel announces: at start, every 10 s, and soon
/// after each [`SentinelWatch::suspect`]. Ends when the shard is dropped.
async fn follow<S: ShardNodes>(
    shard: Weak<S>,
    watch: Arc<SentinelWatch>,
    scripts: Arc<Scripts>,
    settings: NodeSettings,
) {
    let mut last: Option<Resolved> = None;
    loop {
        match resolve(&watch, &settings.dialer, Duration::from_secs(1)).await {
            Some(resolved) if last.as_ref() != Some(&resolved) => {
                let Some(shard) = shard.upgrade() else { return };
                if last.as_ref().map(|l| &l.primary) != Some(&resolved.primary) {
                    match client_for(&resolved.primary, watch.tls) {
                        Some(client) => {
                            tracing::warn!(shard = shard.index(), master = %watch.master, primary = %resolved.primary, "sentinel: primary is now {}", resolved.primary);
                            shard.primary().retarget(client);
                        }
                        None => {
                            tracing::error!(primary = %resolved.primary, "sentinel gave an unusable address")
                        }
                    }
                }
                let replicas: Vec<Arc<Node>> = resolved
                    .replicas
                    .iter()
                    .filter_map(|addr| {
                        let label = format!("shard {} replica {addr}", shard.index());
                        Some(Node::spawn(
                            label,
                            Some(client_for(addr, watch.tls)?),
                            scripts.clone(),
                            settings.clone(),
                            Role::Replica,
                        ))
                    })
                    .collect();
                shard.replicas().store(Arc::new(replicas));
                last = Some(resolved);
            }
            Some(_) => {}
            None => {
                tracing::warn!(master = %watch.master, "no sentinel answered; keeping the last known primary")
            }
        }
        if shard.strong_count() == 0 {
            return;
        }
        tokio::select! {
            _ = watch.suspected() => {
                // Let a burst of failures collapse into one question.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            _ = tokio::time::sleep(Duration::from_secs(10)) => {}
        }
    }
}

/// Listen for `+switch-master` on one Sentinel and trigger re-resolution.
async fn subscribe(
    watch: Weak<SentinelWatch>,
    sentinel: Endpoint,
    master: String,
    dialer: Arc<Dialer>,
) {
    loop {
        if watch.strong_count() == 0 {
            return;
        }
        let opened = dialer
            .pubsub(&sentinel, DialAs::Sentinel, Duration::from_secs(2))
            .await;
        if let Ok(mut pubsub) = opened {
            if pubsub.subscribe("+switch-master").await.is_ok() {
                let mut messages = pubsub.on_message();
                loop {
                    let next = tokio::time::timeout(Duration::from_secs(5), messages.next()).await;
                    let Some(watch) = watch.upgrade() else { return };
                    match next {
                        Ok(Some(msg)) => {
                            let payload: String = msg.get_payload().unwrap_or_default();
                            if payload.split(' ').next() == Some(master.as_str()) {
                                tracing::info!(%master, %payload, "sentinel: +switch-master");
                                watch.suspect();
                            }
                        }
                        Ok(None) => break,
                        Err(_) => {}
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
