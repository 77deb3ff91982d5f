//! A node's script calls: through its breaker, bounded by `store.timeout`, a primary's
//! `READONLY` followed to the new master, a broken connection handed back to the
//! connection task.

use super::{Node, Role, WhenDisconnected};
use crate::limiter::store::redis::scripts::{invoke, invoke_asking, LuaScript, Scripts};
use crate::limiter::store::StoreError;
use std::sync::{Arc, Weak};
use std::time::Duration;

impl Node {
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
    pub(in crate::limiter::store::redis) async fn call(
        &self,
        script: &LuaScript,
        keys: &[&str],
        args: &[u64],
        when: WhenDisconnected,
    ) -> Result<Vec<i64>, StoreError> {
        self.call_with(script, keys, args, when, false).await
    }

    /// [`Node::call`], preceded by `ASKING` when `asking` (a cluster's `ASK`
    /// redirection: the slot is being migrated to this node).
    pub(in crate::limiter::store::redis) async fn call_with(
        &self,
        script: &LuaScript,
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
    pub(super) async fn attempt(
        &self,
        script: &LuaScript,
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
            invoke_asking(script, keys, args, &mut conn).await
        } else {
            invoke(script, keys, args, &mut conn).await
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
                invoke(script, keys, args, &mut conn)
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
    pub(super) fn suspect(&self) {
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
    /// whose late answers say whether they landed ([`super::super::late`]).
    pub(in crate::limiter::store::redis) async fn call_keeping_late(
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
    /// [`super::super::freshness`]): bounded by `store.timeout`, without waiting for a
    /// connection, and outside the breaker (a failed sample only keeps keys pinned to
    /// the primary).
    pub(in crate::limiter::store::redis) async fn info_replication(
        &self,
    ) -> Result<String, StoreError> {
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
}

/// Whether a failed call means the connection itself is broken, so that the node
/// reconnects: a dropped connection, an I/O error, or what redis-rs deems unrecoverable
/// (a protocol error). An error reply from a live node — `LOADING`, `MASTERDOWN`,
/// `CLUSTERDOWN`, `TRYAGAIN`, `READONLY`, `MOVED`, `ASK`, `NOSCRIPT`, a script error —
/// never does: it is counted by the breaker, without connection churn.
pub(super) fn breaks_connection(e: &redis::RedisError) -> bool {
    e.is_connection_dropped() || e.is_io_error() || e.is_unrecoverable_error()
}
