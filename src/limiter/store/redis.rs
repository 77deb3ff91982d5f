//! The Redis store: windows on sharded Redis primaries, shared by a fleet of gateways.
//!
//! Each shard is one primary reached through one `redis::aio::ConnectionManager`: a
//! multiplexed connection that every request shares (concurrent calls are pipelined on
//! one socket) and that reconnects by itself after a failure. Each operation is one Lua
//! script from `lua/`, run with EVALSHA; on NOSCRIPT (a restarted or flushed Redis) the
//! script is loaded and the call retried, so the request does not fail. Scripts are also
//! loaded when the store starts. Every call is bounded by `store.timeout`.
//!
//! The shard of a key is [`jump_consistent_hash`] of its digest over the shard list.

use super::{Store, StoreError, WindowState};
use crate::config::{Problems, StoreConfig};
use crate::limiter::key::{jump_consistent_hash, LimitKey};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;
use std::sync::OnceLock;
use std::time::Duration;

/// `lua/check.lua`: read a window, treating a past one as empty.
pub static CHECK_LUA: &str = include_str!("../../../lua/check.lua");
/// `lua/charge.lua`: add cost to a window, starting a new one when needed.
pub static CHARGE_LUA: &str = include_str!("../../../lua/charge.lua");

/// One primary (replicas are accepted in config but not used yet).
struct Shard {
    url: String,
    client: redis::Client,
    conn: OnceLock<ConnectionManager>,
}

/// Fixed windows in sharded Redis.
pub struct RedisStore {
    shards: Vec<Shard>,
    timeout: Duration,
    check: Script,
    charge: Script,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<_> = self.shards.iter().map(|s| s.url.as_str()).collect();
        f.debug_struct("RedisStore")
            .field("shards", &urls)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl RedisStore {
    /// Validate `[store]` for Redis and build the store (no I/O: connections are made
    /// by [`RedisStore::start`]). Problems are recorded under `store.*`.
    pub fn from_config(cfg: &StoreConfig, problems: &mut Problems) -> Option<Self> {
        if cfg.shards.is_empty() {
            problems.error(
                "store.shards",
                "backend \"redis\" needs at least one [[store.shards]] entry",
            );
            return None;
        }
        let mut shards = Vec::new();
        for (i, s) in cfg.shards.iter().enumerate() {
            match redis::Client::open(s.primary.as_str()) {
                Ok(client) => shards.push(Shard {
                    url: s.primary.clone(),
                    client,
                    conn: OnceLock::new(),
                }),
                Err(e) => problems.error(
                    format!("store.shards[{i}].primary"),
                    format!("{:?} is not a Redis URL: {e}", s.primary),
                ),
            }
            for (j, r) in s.replicas.iter().enumerate() {
                if let Err(e) = redis::Client::open(r.as_str()) {
                    problems.error(
                        format!("store.shards[{i}].replicas[{j}]"),
                        format!("{r:?} is not a Redis URL: {e}"),
                    );
                }
            }
            if !s.replicas.is_empty() {
                problems.warn(
                    format!("store.shards[{i}].replicas"),
                    "replicas are accepted but not used for reads yet: checks go to the primary",
                );
            }
        }
        if shards.len() != cfg.shards.len() {
            return None;
        }
        Some(Self {
            shards,
            timeout: cfg.timeout.0,
            check: Script::new(CHECK_LUA),
            charge: Script::new(CHARGE_LUA),
        })
    }

    /// Open the connection of every shard (lazily; they reconnect on their own) and load
    /// the scripts in the background, retrying until each primary answers.
    /// Must be called inside a Tokio runtime.
    pub fn start(&self) {
        for shard in &self.shards {
            if shard.conn.get().is_none() {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.timeout.max(Duration::from_millis(500))))
                    .set_number_of_retries(2)
                    .set_min_delay(Duration::from_millis(50))
                    .set_max_delay(Duration::from_secs(1));
                match ConnectionManager::new_lazy_with_config(shard.client.clone(), config) {
                    Ok(c) => {
                        let _ = shard.conn.set(c);
                    }
                    Err(e) => {
                        tracing::error!(shard = %shard.url, error = %e, "cannot set up redis connection");
                        continue;
                    }
                }
            }
            let Some(conn) = shard.conn.get() else {
                continue;
            };
            let mut conn = conn.clone();
            let (check, charge, url) = (self.check.clone(), self.charge.clone(), shard.url.clone());
            tokio::spawn(async move {
                let mut delay = Duration::from_millis(100);
                loop {
                    let loaded = async {
                        check.prepare_invoke().load_async(&mut conn).await?;
                        charge.prepare_invoke().load_async(&mut conn).await
                    };
                    match tokio::time::timeout(Duration::from_secs(2), loaded).await {
                        Ok(Ok(_)) => {
                            tracing::info!(shard = %url, "redis shard ready, scripts loaded");
                            return;
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(shard = %url, error = %e, "redis shard not ready; retrying")
                        }
                        Err(_) => {
                            tracing::warn!(shard = %url, "redis shard not answering; retrying")
                        }
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            });
        }
    }

    /// The index of the shard that holds `key`.
    pub fn shard_of(&self, key: &LimitKey) -> usize {
        jump_consistent_hash(key.shard_hash, self.shards.len() as u32) as usize
    }

    /// Number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    async fn run(
        &self,
        script: &Script,
        key: &LimitKey,
        args: &[u64],
    ) -> Result<WindowState, StoreError> {
        let shard = &self.shards[self.shard_of(key)];
        let Some(conn) = shard.conn.get() else {
            return Err(StoreError::NotStarted);
        };
        let mut conn = conn.clone();
        let mut invocation = script.key(&key.key);
        for a in args {
            invocation.arg(*a);
        }
        let call = invocation.invoke_async::<Vec<i64>>(&mut conn);
        let reply = match tokio::time::timeout(self.timeout, call).await {
            Ok(reply) => reply?,
            Err(_) => return Err(StoreError::Timeout(self.timeout.as_millis() as u64)),
        };
        match reply.as_slice() {
            [used, reset_at] if *used >= 0 && *reset_at >= 0 => Ok(WindowState {
                used: *used as u64,
                reset_at_ms: *reset_at as u64,
            }),
            other => Err(StoreError::BadReply(format!("{other:?}"))),
        }
    }
}

impl Store for RedisStore {
    async fn check(&self, key: &LimitKey, now_ms: u64) -> Result<WindowState, StoreError> {
        self.run(&self.check, key, &[now_ms]).await
    }

    async fn charge(
        &self,
        key: &LimitKey,
        cost: u64,
        window_ms: u64,
        now_ms: u64,
    ) -> Result<WindowState, StoreError> {
        self.run(&self.charge, key, &[cost, window_ms, now_ms])
            .await
    }
}
