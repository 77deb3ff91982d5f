//! A node's connections: the shared one, kept up by a background task that checks the
//! server's role and loads every script on each new connection, and each `per_core`
//! worker's own, which follows it.

use super::{
    Identity, Node, Role, WhenDisconnected, PROBE_EVERY, REPLICA_RETRY_MAX, SHARED_NAME,
    WORKER_RETRY_AFTER,
};
use crate::limiter::store::redis::backoff::Backoff;
use crate::limiter::store::redis::dial::{DialAs, Dialer, Endpoint};
use crate::limiter::store::redis::scripts::Scripts;
use crate::limiter::store::redis::stats::bump;
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

impl Node {
    /// Replace the node's shared connection (`None`: disconnected), which drops every
    /// worker's own connection too.
    pub(super) fn publish(&self, conn: Option<MultiplexedConnection>) {
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
    pub(super) async fn connection(
        &self,
        when: WhenDisconnected,
    ) -> Option<(MultiplexedConnection, u64)> {
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

/// Each `per_core` worker's own connection to a node (see the module documentation).
#[derive(Debug, Default)]
pub(super) struct WorkerConns {
    /// One per worker, by its index; sized by the first worker to call.
    slots: OnceLock<Box<[Mutex<WorkerSlot>]>>,
    /// Bumped whenever the node's shared connection is replaced
    /// ([`Node::publish`]): a worker's connection of an older generation is dropped.
    pub(super) generation: AtomicU64,
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
pub(super) async fn maintain(node: Weak<Node>, wake: Arc<Notify>) {
    let mut backoff = Backoff::new();
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
