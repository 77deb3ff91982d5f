//! `store.mode = "cluster"`: a Redis Cluster, one [`Node`] per master.
//!
//! The gateway keeps its own slot map (slot → master `HOST:PORT`), read with
//! `CLUSTER SLOTS` from the seeds or any known master, refreshed every
//! [`REFRESH_EVERY`] and at once after a redirection, a `READONLY` or a failure that
//! looks like a failover. Each master is a [`Node`] of its own: its multiplexed
//! connection (scripts preloaded on each connect), its `ROLE` probe, its circuit breaker
//! and its counters. A call is sent to the master of its key's slot (CRC16 of the hash
//! tag, modulo 16384: every tollgate key carries one), so a dead master costs only the
//! callers whose slots it holds; the other masters' breakers never see its failures.
//!
//! Redirections (nothing was applied by a call answered with one of them, so it is
//! sent once more, at most [`MAX_RESENDS`] times in all):
//! - `MOVED slot HOST:PORT`: sent to `HOST:PORT`; the map is refreshed.
//! - `ASK slot HOST:PORT` (a slot being migrated): sent to `HOST:PORT` after `ASKING`.
//! - `READONLY` (a master demoted to replica while the map still pointed to it): the
//!   map is refreshed, asking the demoted node first, and the call sent to the slot's
//!   new master.
//!
//! `LOADING`, `MASTERDOWN`, `CLUSTERDOWN` and `TRYAGAIN` are answers from a live node
//! that cannot serve the call now: the call fails (`store.on_error` applies), never as
//! a dead connection (no reconnect); `CLUSTERDOWN`/`TRYAGAIN` count towards that
//! master's breaker and refresh the map, `LOADING`/`MASTERDOWN` do not count
//! ([`StoreError::is_not_serving`]). MOVED and ASK count as a success for the
//! breaker of the node that answered them.

mod slots;

use super::dial::{DialAs, Dialer, Endpoint};
use super::node::{Node, NodeSettings, Role, WhenDisconnected};
use super::scripts::{apply_writes, LuaScript, Scripts};
use crate::limiter::store::StoreError;
use arc_swap::ArcSwap;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ServerErrorKind, Value};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

use slots::{parse_slots, slot_of, Master, SlotMap};

/// How often the slot map is read again when nothing asked for it.
pub(super) const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// The shortest time between two map refreshes asked for by failed calls.
const REFRESH_AT_MOST_EVERY: Duration = Duration::from_millis(100);

/// How many times a call answered with a redirection (MOVED, ASK, READONLY) is sent
/// again, at most.
pub(super) const MAX_RESENDS: usize = 2;

/// What the slot-map refresh keeps between refreshes.
#[derive(Default)]
struct Topo {
    /// The connection `CLUSTER SLOTS` was last answered on, and its `HOST:PORT`.
    conn: Option<(String, MultiplexedConnection)>,
    /// When the last successful refresh started.
    refreshed: Option<Instant>,
}

/// One master's place in [`Cluster::report`].
#[derive(Debug, Clone)]
pub(super) struct MasterReport {
    pub addr: String,
    pub slots: String,
    pub node: Arc<Node>,
}

/// See the module documentation.
pub(crate) struct Cluster {
    pub(super) label: String,
    /// The seed nodes (`store.nodes`); a master's connection copies the first seed's
    /// settings (TLS, credentials, database) with the master's address.
    seeds: Vec<Endpoint>,
    scripts: Arc<Scripts>,
    settings: NodeSettings,
    map: ArcSwap<SlotMap>,
    /// Bumped at each map change (0: no map yet).
    version: watch::Sender<u64>,
    topo: tokio::sync::Mutex<Topo>,
    /// Asks the refresh task for a refresh now.
    wake: Notify,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// A cluster reached through `seeds`. Spawns the task that reads the slot map
    /// (ends when the cluster is dropped); must be called inside a Tokio runtime.
    pub(super) fn spawn(
        seeds: Vec<Endpoint>,
        label: String,
        scripts: Arc<Scripts>,
        settings: NodeSettings,
    ) -> Arc<Self> {
        let cluster = Arc::new(Self {
            label,
            seeds,
            scripts,
            settings,
            map: ArcSwap::default(),
            version: watch::channel(0).0,
            topo: tokio::sync::Mutex::default(),
            wake: Notify::new(),
        });
        tokio::spawn(keep_map(Arc::downgrade(&cluster)));
        cluster
    }

    /// Every master of the map, ordered by its first slot (empty before the first map).
    pub(super) fn masters(&self) -> Vec<MasterReport> {
        let map = self.map.load();
        map.masters
            .iter()
            .enumerate()
            .map(|(i, m)| MasterReport {
                addr: m.addr.clone(),
                slots: map.slots_of(i),
                node: m.node.clone(),
            })
            .collect()
    }

    /// Run `script` on the master of `keys`' slot (all keys share a hash tag), each
    /// attempt bounded by `store.timeout`; redirections are followed (see the module
    /// documentation), so a call takes at most `1 + MAX_RESENDS` attempts, each after
    /// at most one wait of `store.timeout` (for the first slot map, or a refresh).
    /// Errors: the last attempt's (`BreakerOpen` while the slot's master's breaker is
    /// open; `NotConnected` when no map has been read yet or no master serves the slot).
    pub(super) async fn call(
        &self,
        script: &LuaScript,
        keys: &[&str],
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        let slot = keys.first().map_or(0, |k| slot_of(k.as_bytes()));
        let writes = !std::ptr::eq(script, &self.scripts.apply) || apply_writes(args);
        let mut redirect: Option<(Arc<Node>, bool)> = None;
        let mut resends = 0;
        loop {
            let (node, asking) = match redirect.take() {
                Some(to) => to,
                None => (self.owner(slot).await?, false),
            };
            // A master whose writes fail (one that answers reads but refuses writes:
            // out of memory, `min-replicas-to-write`, ...) fails its checks too, so that
            // `store.on_error` decides them rather than a count nothing is added to.
            if !writes && !node.writable() {
                return Err(StoreError::NotWritable(node.label.clone()));
            }
            let started = Instant::now();
            let confirmed = node.writes_confirmed();
            let result = node
                .call_with(script, keys, args, WhenDisconnected::Wait, asking)
                .await;
            let redirected = result.as_ref().err().is_some_and(|e| {
                e.is_redirect()
                    || matches!(e, StoreError::Redis(r) if r.kind() == redis::ErrorKind::Server(ServerErrorKind::ReadOnly))
            });
            if writes && !redirected {
                node.record_write(confirmed, &result);
            }
            let e = match &result {
                Ok(_) => return result,
                Err(StoreError::Redis(e)) => e,
                Err(e) => {
                    // A dead or unreachable master (or its open breaker): its replica
                    // may be promoted any moment, so the map is read again soon
                    // (at most every REFRESH_AT_MOST_EVERY), not only every second.
                    if e.suggests_failover() || matches!(e, StoreError::BreakerOpen(_)) {
                        self.wake.notify_one();
                    }
                    return result;
                }
            };
            let kind = match e.kind() {
                redis::ErrorKind::Server(kind) => Some(kind),
                _ => None,
            };
            match kind {
                Some(ServerErrorKind::Moved | ServerErrorKind::Ask) if resends < MAX_RESENDS => {
                    let Some((addr, _)) = e.redirect_node() else {
                        return result;
                    };
                    let asking = kind == Some(ServerErrorKind::Ask);
                    if !asking {
                        self.wake.notify_one();
                    }
                    let Some(to) = self.node_at(addr, started).await else {
                        return result;
                    };
                    tracing::debug!(cluster = %self.label, slot, to = addr, asking, "redirected");
                    redirect = Some((to, asking));
                }
                Some(ServerErrorKind::ReadOnly) if resends < MAX_RESENDS => {
                    // The node was demoted: ask it (it knows its new master) first.
                    let from = self
                        .map
                        .load()
                        .masters
                        .iter()
                        .find(|m| Arc::ptr_eq(&m.node, &node))
                        .map(|m| m.addr.clone());
                    tracing::info!(cluster = %self.label, slot, node = ?from, "READONLY: the master was demoted; refreshing the slot map and sending once more");
                    self.refresh_within(started, from.as_deref()).await;
                }
                _ => {
                    if result
                        .as_ref()
                        .err()
                        .is_some_and(StoreError::suggests_failover)
                        || matches!(
                            kind,
                            Some(ServerErrorKind::ClusterDown | ServerErrorKind::TryAgain)
                        )
                    {
                        self.wake.notify_one();
                    }
                    return result;
                }
            }
            resends += 1;
        }
    }

    /// The master of `slot`, waiting (within `store.timeout`) for the first map.
    async fn owner(&self, slot: u16) -> Result<Arc<Node>, StoreError> {
        if *self.version.borrow() == 0 {
            let mut rx = self.version.subscribe();
            let first = tokio::time::timeout(self.settings.timeout, rx.wait_for(|v| *v > 0));
            if !matches!(first.await, Ok(Ok(_))) {
                return Err(StoreError::NotConnected(format!(
                    "{}: no slot map yet",
                    self.label
                )));
            }
        }
        match self.map.load().owner(slot) {
            Some(m) => Ok(m.node.clone()),
            None => {
                self.wake.notify_one();
                Err(StoreError::NotConnected(format!(
                    "{}: no master serves slot {slot}",
                    self.label
                )))
            }
        }
    }

    /// The node at `addr` (a redirection's target): a known master, else after a
    /// refresh asking `addr` first, else a new node added to the map's masters until
    /// the next refresh.
    async fn node_at(&self, addr: &str, since: Instant) -> Option<Arc<Node>> {
        if let Some(m) = self.map.load().find(addr) {
            return Some(m.node.clone());
        }
        self.refresh_within(since, Some(addr)).await;
        let map = self.map.load();
        if let Some(m) = map.find(addr) {
            return Some(m.node.clone());
        }
        let node = self.spawn_node(addr)?;
        let mut masters = map.masters.clone();
        masters.push(Master {
            addr: addr.to_string(),
            node: node.clone(),
        });
        self.map.store(Arc::new(SlotMap {
            ranges: map.ranges.clone(),
            masters,
        }));
        Some(node)
    }

    /// A node for the master at `addr` (`HOST:PORT`), with the first seed's settings.
    fn spawn_node(&self, addr: &str) -> Option<Arc<Node>> {
        let (host, port) = addr.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let endpoint = self.endpoint_for(host, port)?;
        Some(Node::spawn(
            format!("cluster primary {addr}"),
            Some(endpoint),
            self.scripts.clone(),
            self.settings.clone(),
            Role::ClusterMaster,
        ))
    }

    /// The first seed's connection settings (TLS, the URL's credentials, database) with
    /// the address `host:port`: the nodes a cluster announces are dialled like its seeds.
    fn endpoint_for(&self, host: &str, port: u16) -> Option<Endpoint> {
        let seed = self.seeds.first()?;
        let announced = Endpoint::announced(host, port, seed.tls);
        Some(Endpoint {
            host: announced.host,
            port,
            ..seed.clone()
        })
    }

    /// Refresh the map unless a refresh started after `since`, bounded by
    /// `store.timeout`; `first` is asked first.
    async fn refresh_within(&self, since: Instant, first: Option<&str>) {
        let bound = self.settings.timeout;
        let _ = tokio::time::timeout(bound, self.refresh(since, first)).await;
    }

    /// Read the slot map (`CLUSTER SLOTS`) from `first`, the node asked last time, the
    /// known masters that are connected, the seeds, then the other masters, until one
    /// answers; unless a refresh that started after `since` has succeeded. Whether the
    /// map is fresh.
    async fn refresh(&self, since: Instant, first: Option<&str>) -> bool {
        let mut topo = self.topo.lock().await;
        if topo.refreshed.is_some_and(|t| t > since) {
            return true;
        }
        let started = Instant::now();
        let mut candidates: Vec<(String, Option<Endpoint>)> = Vec::new();
        let mut add = |addr: String, info: Option<Endpoint>| {
            if !candidates.iter().any(|(a, _)| *a == addr) {
                candidates.push((addr, info));
            }
        };
        if let Some(a) = first {
            add(a.to_string(), None);
        }
        if let Some((a, _)) = &topo.conn {
            add(a.clone(), None);
        }
        let map = self.map.load();
        for m in map.masters.iter().filter(|m| m.node.is_connected()) {
            add(m.addr.clone(), None);
        }
        for s in &self.seeds {
            add(s.addr(), Some(s.clone()));
        }
        for m in &map.masters {
            add(m.addr.clone(), None);
        }
        drop(map);
        let timeout = self.settings.timeout.max(Duration::from_millis(500));
        for (addr, info) in candidates {
            let mut conn = match &topo.conn {
                Some((a, c)) if *a == addr => c.clone(),
                _ => {
                    let info = match info.or_else(|| {
                        let (h, p) = addr.rsplit_once(':')?;
                        self.endpoint_for(h, p.parse().ok()?)
                    }) {
                        Some(i) => i,
                        None => continue,
                    };
                    match open(&self.settings.dialer, &info, timeout).await {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::debug!(cluster = %self.label, node = %addr, error = %e, "cannot ask for the slot map");
                            continue;
                        }
                    }
                }
            };
            let asked = tokio::time::timeout(
                timeout,
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<Value>(&mut conn),
            )
            .await;
            match asked.map_err(|_| "timed out".to_string()).and_then(|r| {
                r.map_err(|e| e.to_string())
                    .and_then(|v| parse_slots(&v, &addr))
            }) {
                Ok(ranges) if !ranges.is_empty() => {
                    self.apply(ranges);
                    topo.conn = Some((addr, conn));
                    topo.refreshed = Some(started);
                    return true;
                }
                Ok(_) => {
                    tracing::debug!(cluster = %self.label, node = %addr, "node serves no slots yet")
                }
                Err(e) => {
                    tracing::debug!(cluster = %self.label, node = %addr, error = %e, "slot map not read")
                }
            }
            if topo.conn.as_ref().is_some_and(|(a, _)| *a == addr) {
                topo.conn = None;
            }
        }
        false
    }

    /// Make `ranges` (`first`, `last`, master `HOST:PORT`) the map, keeping the nodes of
    /// masters already known.
    fn apply(&self, mut ranges: Vec<(u16, u16, String)>) {
        ranges.sort_by_key(|r| r.0);
        let old = self.map.load();
        let mut masters: Vec<Master> = Vec::new();
        let mut indexed = Vec::with_capacity(ranges.len());
        for (first, last, addr) in ranges {
            let i = match masters.iter().position(|m| m.addr == addr) {
                Some(i) => i,
                None => {
                    let node = match old.find(&addr) {
                        Some(m) => m.node.clone(),
                        None => match self.spawn_node(&addr) {
                            Some(n) => n,
                            None => continue,
                        },
                    };
                    masters.push(Master { addr, node });
                    masters.len() - 1
                }
            };
            indexed.push((first, last, i));
        }
        let same = old.ranges.len() == indexed.len()
            && old.ranges.iter().zip(&indexed).all(|(a, b)| {
                (a.0, a.1) == (b.0, b.1) && old.masters[a.2].addr == masters[b.2].addr
            })
            && old.masters.len() == masters.len();
        if same && *self.version.borrow() > 0 {
            return;
        }
        let names: Vec<&str> = masters.iter().map(|m| m.addr.as_str()).collect();
        tracing::info!(cluster = %self.label, masters = ?names, "cluster slot map read");
        self.map.store(Arc::new(SlotMap {
            ranges: indexed,
            masters,
        }));
        self.version.send_modify(|v| *v += 1);
    }
}

/// Keep the map fresh until the cluster is dropped: every [`REFRESH_EVERY`], and when a
/// call asks (at most every [`REFRESH_AT_MOST_EVERY`]).
async fn keep_map(cluster: Weak<Cluster>) {
    let mut backoff = super::backoff::Backoff::new();
    let mut failing_logged = false;
    loop {
        let Some(c) = cluster.upgrade() else { return };
        let fresh = c.refresh(Instant::now(), None).await;
        let wait = if fresh {
            backoff.reset();
            if failing_logged {
                tracing::info!(cluster = %c.label, "cluster slot map read again");
            }
            failing_logged = false;
            REFRESH_EVERY
        } else {
            if !failing_logged {
                tracing::warn!(cluster = %c.label, "no cluster node answers CLUSTER SLOTS; retrying in the background");
                failing_logged = true;
            }
            backoff.next_wait().min(REFRESH_EVERY)
        };
        let woken = async {
            c.wake.notified().await;
        };
        let asked = tokio::select! {
            _ = tokio::time::sleep(wait) => false,
            _ = woken => true,
        };
        drop(c);
        if asked {
            tokio::time::sleep(REFRESH_AT_MOST_EVERY).await;
        }
    }
}

/// A multiplexed connection to `endpoint` for `CLUSTER SLOTS`, through the store's
/// dialer (TLS, credentials).
async fn open(
    dialer: &Dialer,
    endpoint: &Endpoint,
    timeout: Duration,
) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    dialer
        .connect(endpoint, DialAs::Data, config, timeout)
        .await
}

#[cfg(test)]
mod tests;
