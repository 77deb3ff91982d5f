//! The Redis store: windows in sharded, replicated Redis (or a Redis Cluster), shared by
//! a fleet of gateways.
//!
//! - **Shards.** `[[store.shards]]` lists primary/replica groups; a key's shard is
//!   [`jump_consistent_hash`] of its digest over the shard list (see
//!   [`crate::limiter::key`]). A shard's primary and replicas are given directly or found
//!   through Sentinel ([`sentinel`]).
//! - **Reads and writes.** CHECKs go to a healthy replica when `store.read_from =
//!   "replica"` (the default when a shard lists replicas), spread round robin; a replica
//!   that is down, slow, loading or cut off from its primary is skipped and the primary
//!   answers. CHARGEs always go to the primary. A window this gateway has written is
//!   checked on the primary, through the writes' queue, until every replica has caught
//!   up with that write ([`freshness`]): a gateway reads its own writes. A stale replica
//!   can at worst admit a request the primary would have rejected (of a window only
//!   other gateways wrote lately): expiry is judged by the stored `reset_at` against
//!   "now", never by Redis's TTLs, and a 429 carries the numbers of the read that made
//!   it.
//! - **Late reservations.** A call that carries reservations and times out is finished
//!   in the background, and what became of each reservation is kept for its request
//!   ([`late`]), so that a request let through without an answer is counted once.
//! - **Clock.** "Now" is the gateway's clock, passed in every call (`store.clock =
//!   "gateway"`), or, with `store.clock = "redis"`, [`NOW_FROM_REDIS`] in its place: the
//!   scripts then read `TIME` on the node that runs them, once per call.
//! - **Failures.** Each node has a multiplexed connection kept up in the background, a
//!   circuit breaker and counters ([`node`], [`breaker`], [`stats`]); each call is
//!   bounded by `store.timeout`. A sick shard costs its own callers at most
//!   `store.timeout` per call until its breaker opens, and other shards nothing.
//! - **Scripts.** Each operation is one Lua script in `lua/`, loaded on every new
//!   connection and run with EVALSHA; NOSCRIPT still reloads and retries.

mod backoff;
mod batch;
mod breaker;
mod cluster;
mod dial;
mod freshness;
mod late;
mod node;
mod sentinel;
pub mod stats;

pub use breaker::BreakerState;

use super::{Grant, Item, Store, StoreError, WindowState};
use crate::config::{Problems, ReadFrom, StoreClock, StoreConfig, StoreMode};
use crate::limiter::algorithm::{OpKind, Verdict};
use crate::limiter::key::{jump_consistent_hash, LimitKey};
use arc_swap::ArcSwap;
use batch::Batcher;
use cluster::Cluster;
use dial::{DialSettings, Dialer, Endpoint};
use futures_util::future::{join_all, Either};
use node::{Node, NodeSettings, Role, WhenDisconnected};
use sentinel::SentinelWatch;
use stats::{bump, Counts, ShardStats};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};

/// `lua/apply.lua`: one operation on each of several limits, every algorithm.
pub static APPLY_LUA: &str = include_str!("../../../../lua/apply.lua");
/// `lua/lease.lua`: take up to N units of a window for local admission.
pub static LEASE_LUA: &str = include_str!("../../../../lua/lease.lua");
/// `lua/refund.lua`: give back unused units of a window.
pub static REFUND_LUA: &str = include_str!("../../../../lua/refund.lua");
/// `lua/reset.lua`: delete a caller's windows (`POST /callers/{id}/reset`).
pub static RESET_LUA: &str = include_str!("../../../../lua/reset.lua");

/// The `now` argument (ms) that tells `lua/apply.lua` and `lua/lease.lua` to read the
/// time from the Redis node's `TIME` instead (`store.clock = "redis"`): 0, the Unix epoch
/// itself, which no gateway clock gives.
pub const NOW_FROM_REDIS: u64 = 0;

/// A call that carries reservations runs on for up to this many `store.timeout`s after
/// it was sent, when its caller was answered with a timeout (see [`late`]): past the
/// connection's own bound on an answer (4 × `store.timeout`).
pub const LATE_BOUND_FACTOR: u32 = 5;

/// Integers per key in `lua/apply.lua`'s arguments: kind, algorithm, quota, window,
/// burst, align, cost, now, id (see `RedisStore::call_group`).
const ARGS_PER_KEY: usize = 9;

/// Every script the store runs, loaded on each new connection.
#[derive(Debug)]
pub(crate) struct Scripts {
    apply: LuaScript,
    lease: LuaScript,
    refund: LuaScript,
    reset: LuaScript,
}

impl Scripts {
    fn new() -> Self {
        Self {
            apply: LuaScript::new(APPLY_LUA, ArgStyle::Packed, ReplyStyle::Packed),
            lease: LuaScript::new(LEASE_LUA, ArgStyle::Decimal, ReplyStyle::Integers),
            refund: LuaScript::new(REFUND_LUA, ArgStyle::Decimal, ReplyStyle::Integers),
            reset: LuaScript::new(RESET_LUA, ArgStyle::Decimal, ReplyStyle::Integers),
        }
    }

    fn all(&self) -> [&LuaScript; 4] {
        [&self.apply, &self.lease, &self.refund, &self.reset]
    }
}

/// How a script takes its integer arguments (ARGV).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArgStyle {
    /// One ARGV entry per integer, in decimal (`lease.lua`, `refund.lua`, `reset.lua`).
    Decimal,
    /// All the integers in ARGV[1], each as 8 bytes, unsigned, little-endian
    /// (`apply.lua`, which reads them with `struct.unpack`): two arguments a key instead
    /// of ten, and no decimal parsing, for the script every request runs.
    Packed,
}

/// How a script answers its integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReplyStyle {
    /// An array of integers (`lease.lua`, `refund.lua`, `reset.lua`).
    Integers,
    /// One bulk string holding every integer, each as 8 bytes, signed, little-endian
    /// (`apply.lua`, which writes them with `struct.pack`; read by [`unpack_integers`]):
    /// redis-rs parses one value per call instead of one per integer, about 800
    /// instructions apiece, for the script every request runs.
    Packed,
}

/// One script of `lua/`: its text (and SHA1), and how it takes its arguments and
/// answers.
#[derive(Debug)]
pub(crate) struct LuaScript {
    script: redis::Script,
    args: ArgStyle,
    reply: ReplyStyle,
}

impl LuaScript {
    fn new(code: &str, args: ArgStyle, reply: ReplyStyle) -> Self {
        Self {
            script: redis::Script::new(code),
            args,
            reply,
        }
    }

    /// SCRIPT LOAD it on `conn` (in cluster mode, on every primary).
    async fn load(&self, conn: &mut impl redis::aio::ConnectionLike) -> redis::RedisResult<()> {
        self.script
            .prepare_invoke()
            .load_async(conn)
            .await
            .map(drop)
    }

    /// The EVALSHA of `keys` and `args` (see [`ArgStyle`]).
    fn command(&self, keys: &[&str], args: &[u64]) -> redis::Cmd {
        let (arg_count, arg_bytes) = match self.args {
            ArgStyle::Decimal => (args.len(), 20 * args.len()),
            ArgStyle::Packed => (1, 8 * args.len()),
        };
        let mut cmd = redis::Cmd::with_capacity(
            3 + keys.len() + arg_count,
            64 + keys.iter().map(|k| k.len()).sum::<usize>() + arg_bytes,
        );
        cmd.arg("EVALSHA")
            .arg(self.script.get_hash())
            .arg(keys.len());
        for k in keys {
            cmd.arg(*k);
        }
        match self.args {
            ArgStyle::Decimal => {
                for a in args {
                    cmd.arg(*a);
                }
            }
            ArgStyle::Packed => {
                use redis::RedisWrite;
                use std::io::Write;
                // Written straight into the command's buffer, one argument.
                let mut packed = cmd.writer_for_next_arg();
                for a in args {
                    // Into a `Vec`: cannot fail.
                    let _ = packed.write_all(&a.to_le_bytes());
                }
            }
        }
        cmd
    }
}

/// Run `script` with `keys` and integer arguments on `conn` (EVALSHA; on NOSCRIPT the
/// script is loaded and the call retried once), and answer its integers.
async fn invoke(
    script: &LuaScript,
    keys: &[&str],
    args: &[u64],
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<Vec<i64>, StoreError> {
    let cmd = script.command(keys, args);
    let reply = match cmd.query_async::<redis::Value>(conn).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.load(conn).await?;
            cmd.query_async::<redis::Value>(conn).await?
        }
        answer => answer?,
    };
    decode(script, reply)
}

/// [`invoke`] on a cluster node that answered `ASK` (the slot is being migrated to
/// it): `ASKING` and the EVALSHA in one pipeline, so that the node takes the call for
/// the slot it is importing. No NOSCRIPT retry: the node's connection loaded every
/// script when it opened.
async fn invoke_asking(
    script: &LuaScript,
    keys: &[&str],
    args: &[u64],
    conn: &mut impl redis::aio::ConnectionLike,
) -> Result<Vec<i64>, StoreError> {
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING")
        .ignore()
        .add_command(script.command(keys, args));
    let (reply,): (redis::Value,) = pipe.query_async(conn).await?;
    decode(script, reply)
}

/// A script's reply as its integers (see [`ReplyStyle`]).
fn decode(script: &LuaScript, reply: redis::Value) -> Result<Vec<i64>, StoreError> {
    match (script.reply, reply) {
        (ReplyStyle::Packed, redis::Value::BulkString(bytes)) => unpack_integers(&bytes),
        (ReplyStyle::Integers, reply) => {
            Ok(redis::from_redis_value(reply).map_err(redis::RedisError::from)?)
        }
        (ReplyStyle::Packed, other) => Err(StoreError::BadReply(format!(
            "expected one string of packed integers, got {other:?}"
        ))),
    }
}

/// The integers of a packed reply ([`ReplyStyle::Packed`], `lua/apply.lua`'s): 8 bytes
/// each, signed, little-endian. Errors: a length that is not a multiple of 8.
pub fn unpack_integers(bytes: &[u8]) -> Result<Vec<i64>, StoreError> {
    if !bytes.len().is_multiple_of(8) {
        return Err(StoreError::BadReply(format!(
            "{} bytes, not a whole number of 8-byte integers",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|b| {
            let mut le = [0; 8];
            le.copy_from_slice(b);
            i64::from_le_bytes(le)
        })
        .collect())
}

/// The integers per key that `lua/apply.lua` answers ([`batch::REPLY_WIDTH`]), as
/// verdicts: `[used, reset_at ms, epoch]` when admitted, `[-(used + 1), reset_at ms,
/// retry_at ms]` when refused (a refusal's epoch is 0, an admission's retry_at 0).
fn verdicts(reply: &[i64]) -> Vec<Result<Verdict, StoreError>> {
    reply
        .chunks(batch::REPLY_WIDTH)
        .map(|v| match *v {
            [signed_used, reset_at, third] if reset_at >= 0 && third >= 0 => {
                let admitted = signed_used >= 0;
                let (used, retry_at, epoch) = if admitted {
                    (signed_used, 0, third)
                } else {
                    (-(signed_used + 1), third, 0)
                };
                Ok(Verdict {
                    admitted,
                    used: used as u64,
                    reset_at_ms: reset_at as u64,
                    retry_at_ms: retry_at as u64,
                    epoch: epoch as u64,
                })
            }
            ref other => Err(StoreError::BadReply(format!("{other:?}"))),
        })
        .collect()
}

/// The indices `0..16`: the members of a call that takes every item of a request
/// ([`RedisStore::submit_many`]'s usual case), with no list made for them.
const FIRST_INDICES: [usize; 16] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];

/// One primary/replica group.
#[derive(Debug)]
pub(crate) struct Shard {
    index: usize,
    primary: Arc<Node>,
    replicas: ArcSwap<Vec<Arc<Node>>>,
    read_from: ReadFrom,
    next_replica: AtomicUsize,
    stats: ShardStats,
    sentinel: Option<Arc<SentinelWatch>>,
    /// Peeks (CHECKs) of concurrent requests, sent together ([`batch`]), to a replica
    /// when reads go to replicas.
    checks: Batcher,
    /// Writing operations of concurrent requests, sent together to the primary.
    charges: Batcher,
    /// With `server.runtime = "per_core"` and reads on replicas: each worker's own
    /// CHECK batcher, made on its first call, whose task runs on its runtime (so that a
    /// peek does not wake another thread to be batched). Sized by the first worker to
    /// call. The primary's queue (`charges`) stays one per shard: see [`Shard::batcher`].
    per_worker: OnceLock<Box<[OnceLock<Batcher>]>>,
    /// This shard, for the batchers made later.
    me: Weak<Shard>,
    scripts: Arc<Scripts>,
    timeout: std::time::Duration,
    /// With reads on replicas: the keys this gateway wrote that a replica may not have
    /// seen yet, checked on the primary ([`freshness`]).
    freshness: Option<Arc<freshness::Freshness>>,
    /// The late answers of reservations whose calls timed out (shared by the shards).
    late: Arc<late::LateAnswers>,
}

impl Shard {
    /// The two batchers (CHECKs, CHARGEs) of the shard that `weak` will point to.
    fn batchers(
        weak: &Weak<Shard>,
        scripts: &Arc<Scripts>,
        timeout: std::time::Duration,
    ) -> (Batcher, Batcher) {
        (
            Shard::batcher_of(weak, scripts, timeout, Kind::Check),
            Shard::batcher_of(weak, scripts, timeout, Kind::Charge),
        )
    }

    /// A batcher for calls of `kind` to the shard `weak` points to, its task on the
    /// current runtime.
    fn batcher_of(
        weak: &Weak<Shard>,
        scripts: &Arc<Scripts>,
        timeout: std::time::Duration,
        kind: Kind,
    ) -> Batcher {
        let (w, s) = (weak.clone(), scripts.clone());
        Batcher::spawn(
            Box::new(move |keys, args| {
                let (w, s) = (w.clone(), s.clone());
                Box::pin(async move {
                    let shard = w.upgrade().ok_or(StoreError::NotStarted)?;
                    let owned = keys;
                    let keys: Vec<&str> = owned.iter().map(|k| &**k).collect();
                    match kind {
                        Kind::Check => shard.check(&s, &keys, &args).await,
                        Kind::Charge => {
                            let reply = if reserves(&args) {
                                let (o, a) = (owned.clone(), args.clone());
                                shard.reserve_on_primary(&s, o, a).await
                            } else {
                                shard.on_primary(&s.apply, &keys, &args).await
                            };
                            if let Some(fresh) = &shard.freshness {
                                fresh.written(&keys, &args, reply.is_ok());
                            }
                            reply
                        }
                    }
                })
            }),
            timeout,
        )
    }

    /// The batcher for calls of `kind`: peeks have their own when reads go to replicas;
    /// otherwise peeks share the writes' queue, so that the primary runs every call of
    /// the shard in the order it was handed over.
    ///
    /// The primary's queue is one per shard for every worker of a `per_core` gateway
    /// too: the in-flight accounting (`limiter::in_flight::InFlightUnits`) relies on one
    /// FIFO per shard, where a CHARGE handed over before a CHECK runs before it. Peeks
    /// on replicas promise no such order, so on a `per_core` worker they go to the
    /// worker's own batcher.
    fn batcher(&self, kind: Kind) -> &Batcher {
        match kind {
            Kind::Check if self.read_from == ReadFrom::Replica => {
                self.worker_checks().unwrap_or(&self.checks)
            }
            _ => &self.charges,
        }
    }

    /// Where a call of `kind` with `keys` (and their `lua/apply.lua` arguments `args`)
    /// goes, told to the replica-freshness pins (reads on replicas only): a write pins
    /// the keys it writes; a check of a pinned key goes to the primary, through the
    /// writes' FIFO queue ([`Kind::Charge`]), so that it reads this gateway's own
    /// writes in the order they were handed over ([`freshness`]).
    fn route(&self, kind: Kind, keys: &[batch::Key], args: &[u64]) -> Kind {
        let Some(fresh) = &self.freshness else {
            return kind;
        };
        match kind {
            Kind::Charge => {
                fresh.wrote(keys, args);
                Kind::Charge
            }
            Kind::Check if fresh.pinned(keys) => Kind::Charge,
            Kind::Check => Kind::Check,
        }
    }

    /// On a `per_core` worker thread, its own CHECK batcher (see `per_worker`).
    fn worker_checks(&self) -> Option<&Batcher> {
        let (index, count) = crate::worker::current()?;
        let all = self
            .per_worker
            .get_or_init(|| (0..count).map(|_| OnceLock::new()).collect());
        Some(
            all.get(index)?.get_or_init(|| {
                Shard::batcher_of(&self.me, &self.scripts, self.timeout, Kind::Check)
            }),
        )
    }

    /// Peek `keys` (arguments per key in `args`) on a healthy replica when reads go to
    /// replicas, else (or when the replica fails) on the primary.
    async fn check(
        &self,
        scripts: &Scripts,
        keys: &[&str],
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        if !self.primary.writable() {
            // Nothing could be counted: a replica's (or the demoted primary's) answer
            // must not admit anyone. `store.on_error` decides.
            return Err(StoreError::NotWritable(self.primary.label.clone()));
        }
        if self.read_from == ReadFrom::Replica {
            let replicas = self.replicas.load();
            if !replicas.is_empty() {
                let start = self.next_replica.fetch_add(1, Ordering::Relaxed);
                let candidate = (0..replicas.len())
                    .map(|i| &replicas[(start + i) % replicas.len()])
                    .find(|r| r.is_available());
                if let Some(replica) = candidate {
                    match replica
                        .call(&scripts.apply, keys, args, WhenDisconnected::FailFast)
                        .await
                    {
                        Ok(reply) => return Ok(reply),
                        Err(e) => {
                            tracing::debug!(node = %replica.label, error = %e, "replica failed; asking the primary")
                        }
                    }
                }
                bump(&self.stats.replica_fallbacks);
            }
        }
        self.on_primary(&scripts.apply, keys, args).await
    }

    /// Run `script` on the primary: a write (anything but a `lua/apply.lua` call of
    /// peeks only) records whether the primary's writes succeed ([`Node::writable`]); a
    /// peek while they fail is refused as [`StoreError::NotWritable`].
    async fn on_primary(
        &self,
        script: &LuaScript,
        keys: &[&str],
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        let writes = !std::ptr::eq(script, &self.scripts.apply) || apply_writes(args);
        let result = if writes {
            self.primary.write(script, keys, args).await
        } else if !self.primary.writable() {
            Err(StoreError::NotWritable(self.primary.label.clone()))
        } else {
            self.primary
                .call(script, keys, args, WhenDisconnected::Wait)
                .await
        };
        self.after_primary(&result);
        result
    }

    /// A failure on the primary that a failover explains: ask Sentinel.
    fn after_primary<T>(&self, result: &Result<T, StoreError>) {
        if let (Err(e), Some(sentinel)) = (result, &self.sentinel) {
            if e.suggests_failover() {
                sentinel.suspect();
            }
        }
    }

    /// [`Shard::on_primary`] for a `lua/apply.lua` call that carries reservations: when
    /// it times out, it runs on, and what became of each reservation is kept by its op
    /// id for the request that was admitted without an answer ([`late`]).
    async fn reserve_on_primary(
        &self,
        scripts: &Arc<Scripts>,
        keys: Vec<batch::Key>,
        args: Vec<u64>,
    ) -> Result<Vec<i64>, StoreError> {
        let reservations: Vec<(usize, u64)> = args
            .chunks(ARGS_PER_KEY)
            .enumerate()
            .filter(|(_, a)| a.first() == Some(&OpKind::Reserve.code()))
            .map(|(i, a)| (i, a.get(ARGS_PER_KEY - 1).copied().unwrap_or(0)))
            .collect();
        let late = self.late.clone();
        let confirmed = self.primary.writes_confirmed();
        let result = self
            .primary
            .call_keeping_late(
                scripts.clone(),
                keys,
                args,
                self.timeout * LATE_BOUND_FACTOR,
                move |result| late.publish(late_outcomes(&reservations, &result)),
            )
            .await;
        self.primary.record_write(confirmed, &result);
        self.after_primary(&result);
        result
    }
}

/// Whether a `lua/apply.lua` call's arguments ([`ARGS_PER_KEY`] per key, the
/// operation's kind first) hold anything but peeks.
fn apply_writes(args: &[u64]) -> bool {
    args.chunks(ARGS_PER_KEY)
        .any(|a| a.first() != Some(&OpKind::Peek.code()))
}

/// Whether a `lua/apply.lua` call with these arguments carries a reservation.
fn reserves(args: &[u64]) -> bool {
    args.chunks(ARGS_PER_KEY)
        .any(|a| a.first() == Some(&OpKind::Reserve.code()))
}

/// What became of each reservation (its index in the call, its op id) of a call that
/// ended late with `result`.
fn late_outcomes(
    reservations: &[(usize, u64)],
    result: &Result<Vec<i64>, StoreError>,
) -> Vec<(u64, super::Late)> {
    use super::Late;
    reservations
        .iter()
        .map(|&(i, id)| {
            let outcome = match result {
                Ok(reply) => match reply.get(i * batch::REPLY_WIDTH) {
                    Some(&used) if used >= 0 => Late::Landed {
                        epoch: reply
                            .get(i * batch::REPLY_WIDTH + 2)
                            .map_or(0, |&e| e.max(0) as u64),
                    },
                    Some(_) => Late::NotLanded,
                    None => Late::Unknown,
                },
                Err(e) if e.may_have_run() => Late::Unknown,
                Err(_) => Late::NotLanded,
            };
            (id, outcome)
        })
        .collect()
}

enum Topology {
    Sharded(Vec<Arc<Shard>>),
    Cluster(Arc<Cluster>),
}

/// Fixed windows in Redis. Built without I/O by [`RedisStore::from_config`]; connections
/// are opened by [`RedisStore::start`].
pub struct RedisStore {
    /// Boxed: `[store]` with its credentials and `[store.tls]` is large, and the
    /// store is one variant of [`super::AnyStore`].
    cfg: Box<StoreConfig>,
    scripts: Arc<Scripts>,
    live: OnceLock<Topology>,
    /// Credentials and TLS settings every new connection reads (see [`dial`]).
    dialer: Arc<Dialer>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("mode", &self.cfg.mode)
            .field("shards", &self.cfg.shards.len())
            .finish()
    }
}

/// Whether `url` is a usable `redis://` or `rediss://` URL (else a problem at `at`);
/// `tls` is set when it is `rediss://`.
fn check_url(url: &str, at: String, tls: &mut bool, problems: &mut Problems) -> bool {
    match Endpoint::parse(url) {
        Ok(ep) => {
            *tls |= ep.tls;
            true
        }
        Err(e) => {
            problems.error(
                at,
                format!(
                    "{:?} is not a usable Redis URL: {e}",
                    crate::config::redact_url(url)
                ),
            );
            false
        }
    }
}

impl RedisStore {
    /// Validate `[store]` for Redis (problems under `store.*`) and build the store;
    /// files named in `[store]` are relative to the working directory.
    pub fn from_config(cfg: &StoreConfig, problems: &mut Problems) -> Option<Self> {
        Self::from_config_in(cfg, std::path::Path::new("."), problems)
    }

    /// [`RedisStore::from_config`], reading the secret files (`store.password_file`,
    /// `store.sentinel_password_file`) and `[store.tls]`'s PEM files now, relative to
    /// `base_dir` (the config file's directory).
    pub fn from_config_in(
        cfg: &StoreConfig,
        base_dir: &std::path::Path,
        problems: &mut Problems,
    ) -> Option<Self> {
        let before = problems.errors.len();
        let mut tls = false;
        if cfg.breaker_failures == 0 {
            problems.error("store.breaker_failures", "must be at least 1");
        }
        if cfg.breaker_cooloff.0.is_zero() {
            problems.error("store.breaker_cooloff", "must be more than 0");
        }
        match cfg.mode {
            StoreMode::Cluster => {
                if cfg.nodes.is_empty() {
                    problems.error("store.nodes", "mode \"cluster\" needs at least one seed node, e.g. [\"redis://10.0.0.1:7000\"]");
                }
                for (i, n) in cfg.nodes.iter().enumerate() {
                    check_url(n, format!("store.nodes[{i}]"), &mut tls, problems);
                }
                if !cfg.shards.is_empty() {
                    problems.error(
                        "store.shards",
                        "mode \"cluster\" takes `nodes`, not [[store.shards]]",
                    );
                }
                if cfg.read_from == Some(ReadFrom::Replica) {
                    problems.error(
                        "store.read_from",
                        "replica reads are not supported in cluster mode; use \"primary\"",
                    );
                }
            }
            StoreMode::Sharded => {
                if cfg.shards.is_empty() {
                    problems.error(
                        "store.shards",
                        "backend \"redis\" needs at least one [[store.shards]] entry",
                    );
                }
                if !cfg.nodes.is_empty() {
                    problems.error(
                        "store.nodes",
                        "`nodes` is for mode = \"cluster\"; sharded mode uses [[store.shards]]",
                    );
                }
                for (i, s) in cfg.shards.iter().enumerate() {
                    let at = format!("store.shards[{i}]");
                    match (&s.primary, &s.sentinel) {
                        (Some(p), None) => {
                            check_url(p, format!("{at}.primary"), &mut tls, problems);
                        }
                        (None, Some(sen)) => {
                            if sen.master.trim().is_empty() {
                                problems.error(format!("{at}.sentinel.master"), "must name the master Sentinel monitors");
                            }
                            if sen.nodes.is_empty() {
                                problems.error(format!("{at}.sentinel.nodes"), "needs at least one Sentinel, e.g. [\"redis://10.0.0.1:26379\"]");
                            }
                            for (j, n) in sen.nodes.iter().enumerate() {
                                check_url(n, format!("{at}.sentinel.nodes[{j}]"), &mut tls, problems);
                            }
                            if !s.replicas.is_empty() {
                                problems.error(format!("{at}.replicas"), "with `sentinel`, replicas come from Sentinel; remove `replicas`");
                            }
                        }
                        (Some(_), Some(_)) => problems.error(at.clone(), "give either `primary` or `sentinel`, not both"),
                        (None, None) => problems.error(at.clone(), "needs `primary = \"redis://HOST:PORT\"` or `sentinel = { master = …, nodes = […] }`"),
                    }
                    for (j, r) in s.replicas.iter().enumerate() {
                        check_url(r, format!("{at}.replicas[{j}]"), &mut tls, problems);
                    }
                }
            }
        }
        let settings = DialSettings::load(cfg, tls, base_dir, problems);
        (problems.errors.len() == before).then(|| Self {
            cfg: Box::new(cfg.clone()),
            scripts: Arc::new(Scripts::new()),
            live: OnceLock::new(),
            dialer: Dialer::new(settings),
        })
    }

    /// Take the credentials and TLS settings `fresh` read (a reload that keeps this
    /// store because `[store]` is unchanged): connections opened from now on use them;
    /// open ones are left alone.
    pub fn take_dial_settings(&self, fresh: &RedisStore) {
        self.dialer.replace(fresh.dialer.settings());
    }

    /// The `now` to pass to the scripts, in ms since the Unix epoch: the gateway's
    /// `now_ms`, or [`NOW_FROM_REDIS`] with `store.clock = "redis"`.
    fn now_arg(&self, now_ms: u64) -> u64 {
        match self.cfg.clock {
            StoreClock::Gateway => now_ms,
            StoreClock::Redis => NOW_FROM_REDIS,
        }
    }

    fn settings(&self) -> NodeSettings {
        NodeSettings {
            timeout: self.cfg.timeout.0,
            breaker_failures: self.cfg.breaker_failures,
            breaker_cooloff: self.cfg.breaker_cooloff.0,
            dialer: self.dialer.clone(),
        }
    }

    /// Open every node's connection in the background (scripts are loaded on each new
    /// connection). Calling it again does nothing. Must be called inside a Tokio runtime.
    pub fn start(&self) {
        self.live.get_or_init(|| match self.cfg.mode {
            StoreMode::Cluster => {
                // Validated in from_config: every seed is a usable URL.
                let seeds = self
                    .cfg
                    .nodes
                    .iter()
                    .filter_map(|n| Endpoint::parse(n).ok())
                    .collect();
                Topology::Cluster(Cluster::spawn(
                    seeds,
                    format!(
                        "cluster {}",
                        self.cfg
                            .nodes
                            .iter()
                            .map(|n| crate::config::redact_url(n))
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    self.scripts.clone(),
                    self.settings(),
                ))
            }
            StoreMode::Sharded => Topology::Sharded(self.start_shards()),
        });
    }

    fn start_shards(&self) -> Vec<Arc<Shard>> {
        let settings = self.settings();
        let mut shards = Vec::new();
        // The late answers of reservations whose calls timed out ([`late`]): one table
        // for every shard.
        let late = Arc::new(late::LateAnswers::default());
        for (index, s) in self.cfg.shards.iter().enumerate() {
            let read_from =
                self.cfg
                    .read_from
                    .unwrap_or(if s.replicas.is_empty() && s.sentinel.is_none() {
                        ReadFrom::Primary
                    } else {
                        ReadFrom::Replica
                    });
            let open = |url: &str| Endpoint::parse(url).ok();
            let primary_client = s.primary.as_deref().and_then(open);
            let primary_label = match (&s.primary, &s.sentinel) {
                (Some(p), _) => format!("shard {index} primary {}", crate::config::redact_url(p)),
                (None, Some(sen)) => {
                    format!("shard {index} primary (sentinel master {})", sen.master)
                }
                (None, None) => format!("shard {index} primary"),
            };
            let primary = Node::spawn(
                primary_label,
                primary_client,
                self.scripts.clone(),
                settings.clone(),
                Role::Primary,
            );
            let replicas: Vec<Arc<Node>> = s
                .replicas
                .iter()
                .filter_map(|r| {
                    Some(Node::spawn(
                        format!("shard {index} replica {}", crate::config::redact_url(r)),
                        Some(open(r)?),
                        self.scripts.clone(),
                        settings.clone(),
                        Role::Replica,
                    ))
                })
                .collect();
            let sentinel = s.sentinel.as_ref().map(|sen| {
                SentinelWatch::new(
                    sen.master.clone(),
                    sen.nodes.iter().filter_map(|n| open(n)).collect(),
                )
            });
            let shard = Arc::new_cyclic(|weak| {
                let (checks, charges) = Shard::batchers(weak, &self.scripts, settings.timeout);
                Shard {
                    index,
                    primary,
                    replicas: ArcSwap::from_pointee(replicas),
                    read_from,
                    next_replica: AtomicUsize::new(0),
                    stats: ShardStats::default(),
                    sentinel: sentinel.clone(),
                    checks,
                    charges,
                    per_worker: OnceLock::new(),
                    me: weak.clone(),
                    scripts: self.scripts.clone(),
                    timeout: settings.timeout,
                    freshness: (read_from == ReadFrom::Replica)
                        .then(|| Arc::new(freshness::Freshness::new(settings.timeout))),
                    late: late.clone(),
                }
            });
            if shard.freshness.is_some() {
                tokio::spawn(freshness::sample(Arc::downgrade(&shard)));
            }
            if let Some(sentinel) = sentinel {
                shard.primary.follow(&sentinel);
                sentinel.start(&shard, self.scripts.clone(), settings.clone());
            }
            shards.push(shard);
        }
        shards
    }

    /// The index of the shard that holds `key` (always 0 in cluster mode).
    pub fn shard_of(&self, key: &LimitKey) -> usize {
        match self.cfg.mode {
            StoreMode::Cluster => 0,
            StoreMode::Sharded => {
                jump_consistent_hash(key.shard_hash(), self.cfg.shards.len() as u32) as usize
            }
        }
    }

    /// Number of shards (1 in cluster mode).
    pub fn shard_count(&self) -> usize {
        match self.cfg.mode {
            StoreMode::Cluster => 1,
            StoreMode::Sharded => self.cfg.shards.len(),
        }
    }

    /// Hand `items` to `lua/apply.lua` at once: one call per shard and kind (peeks, which
    /// may go to a replica, apart from writes), through the shard's batcher (so
    /// concurrent requests share calls), or per hash tag in cluster mode. The items are
    /// in their shard's queue when this returns; the future answers one result per item,
    /// in order. `now_ms` is the script's `now` argument (0: the node's `TIME`).
    ///
    /// Ordering: when a shard's reads go to its primary, its peeks and writes share one
    /// FIFO queue and one connection, so a call handed over later runs later in Redis
    /// (what [`crate::limiter::Limiter`] relies on to never count a unit both in flight
    /// and in the store). When its reads go to replicas, the peeks of windows this
    /// gateway wrote and a replica may not have seen yet join that queue too
    /// ([`freshness`]); the other peeks read windows every replica has seen this
    /// gateway's writes of. Cluster mode gives no such order.
    fn submit_many(&self, items: &[Item<'_>], now_ms: u64) -> super::Submitted {
        let Some(live) = self.live.get() else {
            let n = items.len();
            return super::Submitted::Ready(Some(
                (0..n).map(|_| Err(StoreError::NotStarted)).collect(),
            ));
        };
        // Group items: by kind, and by shard or by hash tag (the subject's digest) in
        // cluster mode.
        let group_of = |i: &Item<'_>| {
            let kind = if i.op.kind == OpKind::Peek {
                Kind::Check
            } else {
                Kind::Charge
            };
            let g = match live {
                Topology::Cluster(_) => i.key.shard_hash(),
                Topology::Sharded(_) => self.shard_of(i.key) as u64,
            };
            (kind, g)
        };
        // The usual case, every item of one kind on one shard: one call, no grouping.
        if let Some(first) = items.first().map(group_of) {
            if items.len() <= FIRST_INDICES.len() && items[1..].iter().all(|i| group_of(i) == first)
            {
                let (kind, group) = first;
                let members = &FIRST_INDICES[..items.len()];
                return super::Submitted::Waiting(Box::pin(
                    self.call_group(live, kind, group, items, members, now_ms),
                ));
            }
        }
        let mut groups: Vec<((Kind, u64), Vec<usize>)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let g = group_of(item);
            match groups.iter_mut().find(|(id, _)| *id == g) {
                Some((_, members)) => members.push(i),
                None => groups.push((g, vec![i])),
            }
        }
        let n = items.len();
        let calls: Vec<_> = groups
            .into_iter()
            .map(|((kind, group), members)| {
                let call = self.call_group(live, kind, group, items, &members, now_ms);
                (members, call)
            })
            .collect();
        super::Submitted::Waiting(Box::pin(async move {
            let (members, calls): (Vec<_>, Vec<_>) = calls.into_iter().unzip();
            let replies = join_all(calls).await;
            let mut out: Vec<Option<Result<Verdict, StoreError>>> = (0..n).map(|_| None).collect();
            for (members, results) in members.iter().zip(replies) {
                for (&i, r) in members.iter().zip(results) {
                    out[i] = Some(r);
                }
            }
            out.into_iter()
                .map(|r| r.unwrap_or(Err(StoreError::NotStarted)))
                .collect()
        }))
    }

    /// One script call for the items `members` of `items` that share a kind and a shard
    /// (or a hash tag in cluster mode), handed to the shard's batcher now.
    fn call_group(
        &self,
        live: &Topology,
        kind: Kind,
        group: u64,
        items: &[Item<'_>],
        members: &[usize],
        now_ms: u64,
    ) -> impl Future<Output = Vec<Result<Verdict, StoreError>>> + Send + 'static {
        let names: Vec<batch::Key> = members.iter().map(|&i| items[i].key.key.clone()).collect();
        let flat: Vec<u64> = members
            .iter()
            .flat_map(|&i| {
                let (p, op) = (items[i].policy, items[i].op);
                [
                    op.kind.code(),
                    p.algorithm.code(),
                    p.quota,
                    p.window_ms,
                    p.burst,
                    p.align.code(),
                    op.cost,
                    now_ms,
                    op.id,
                ]
            })
            .collect();
        let count = members.len();
        // A shard's batch is held inline (the future this returns is boxed once, by
        // `submit_many`); cluster calls and the store not started are boxed.
        type Other = std::pin::Pin<Box<dyn Future<Output = batch::Answer> + Send>>;
        let reply = match live {
            Topology::Cluster(c) => {
                let (c, scripts) = (c.clone(), self.scripts.clone());
                Either::Right(Box::pin(async move {
                    let names: Vec<&str> = names.iter().map(|k| &**k).collect();
                    let reply = c.call(&scripts.apply, &names, &flat).await;
                    reply.map(batch::Integers::from_vec)
                }) as Other)
            }
            Topology::Sharded(shards) => match shards.get(group as usize) {
                None => Either::Right(Box::pin(async { Err(StoreError::NotStarted) }) as Other),
                Some(shard) => {
                    let kind = shard.route(kind, &names, &flat);
                    Either::Left(shard.batcher(kind).enqueue(names, flat))
                }
            },
        };
        async move {
            match reply.await {
                Ok(r) if r.len() == batch::REPLY_WIDTH * count => verdicts(&r),
                Ok(r) => vec![
                    Err(StoreError::BadReply(format!(
                        "{} integers for {} keys",
                        r.len(),
                        count
                    )));
                    count
                ],
                Err(e) => vec![Err(e); count],
            }
        }
    }

    /// Run a one-key script on the primary holding `key` (lease and refund: rare, so
    /// not batched).
    async fn on_primary(
        &self,
        script: &LuaScript,
        key: &LimitKey,
        args: &[u64],
    ) -> Result<Vec<i64>, StoreError> {
        match self.live.get() {
            None => Err(StoreError::NotStarted),
            Some(Topology::Cluster(c)) => c.call(script, &[&key.key], args).await,
            Some(Topology::Sharded(shards)) => match shards.get(self.shard_of(key)) {
                None => Err(StoreError::NotStarted),
                Some(shard) => shard.on_primary(script, &[&key.key], args).await,
            },
        }
    }

    /// Delete `keys` on the primaries that hold them (`lua/reset.lua`): one call per
    /// shard (per hash tag in cluster mode). Returns how many keys existed; the first
    /// failing call's error when any fails (the other shards' keys are deleted anyway).
    async fn reset_keys(&self, keys: &[LimitKey]) -> Result<u64, StoreError> {
        let live = self.live.get().ok_or(StoreError::NotStarted)?;
        let mut groups: Vec<(u64, Vec<&str>)> = Vec::new();
        for k in keys {
            let g = match live {
                Topology::Cluster(_) => k.shard_hash(),
                Topology::Sharded(_) => self.shard_of(k) as u64,
            };
            match groups.iter_mut().find(|(id, _)| *id == g) {
                Some((_, names)) => names.push(&k.key),
                None => groups.push((g, vec![&k.key])),
            }
        }
        let calls = groups.iter().map(|(g, names)| async move {
            match live {
                Topology::Cluster(c) => c.call(&self.scripts.reset, names, &[]).await,
                Topology::Sharded(shards) => match shards.get(*g as usize) {
                    None => Err(StoreError::NotStarted),
                    Some(shard) => shard.on_primary(&self.scripts.reset, names, &[]).await,
                },
            }
        });
        let mut deleted = 0;
        for reply in join_all(calls).await {
            match reply?.as_slice() {
                [n] if *n >= 0 => deleted += *n as u64,
                other => return Err(StoreError::BadReply(format!("{other:?}"))),
            }
        }
        Ok(deleted)
    }

    /// The state and counters of every shard and node, for health checks and metrics.
    pub fn report(&self) -> Vec<ShardReport> {
        match self.live.get() {
            None => Vec::new(),
            Some(Topology::Cluster(c)) => c
                .masters()
                .into_iter()
                .enumerate()
                .map(|(index, m)| ShardReport {
                    index,
                    replica_fallbacks: 0,
                    writable: m.node.writable(),
                    nodes: vec![NodeReport {
                        role: "primary",
                        label: m.node.label.clone(),
                        addr: m.addr,
                        connected: m.node.is_connected(),
                        serving: m.node.is_serving(),
                        breaker: m.node.breaker_state(),
                        counts: m.node.stats.counts(),
                        latency: m.node.stats.latency.clone(),
                        slots: Some(m.slots),
                    }],
                })
                .collect(),
            Some(Topology::Sharded(shards)) => shards
                .iter()
                .map(|s| {
                    let node = |role, n: &Arc<Node>| NodeReport {
                        role,
                        label: n.label.clone(),
                        addr: n.addr(),
                        connected: n.is_connected(),
                        serving: n.is_serving(),
                        breaker: n.breaker_state(),
                        counts: n.stats.counts(),
                        latency: n.stats.latency.clone(),
                        slots: None,
                    };
                    let mut nodes = vec![node("primary", &s.primary)];
                    nodes.extend(s.replicas.load().iter().map(|r| node("replica", r)));
                    ShardReport {
                        index: s.index,
                        replica_fallbacks: s.stats.replica_fallbacks.load(Ordering::Relaxed),
                        writable: s.primary.writable(),
                        nodes,
                    }
                })
                .collect(),
        }
    }
}

/// Where a batched `lua/apply.lua` call may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Only peeks: a replica may answer.
    Check,
    /// Writes: the primary.
    Charge,
}

/// The state of one shard (in cluster mode, of one master).
#[derive(Debug, Clone)]
pub struct ShardReport {
    /// Position in `[[store.shards]]`; in cluster mode, the master's position in the
    /// slot map, ordered by its first slot.
    pub index: usize,
    /// CHECKs meant for a replica that the primary answered.
    pub replica_fallbacks: u64,
    /// Whether the primary's writes succeed: false from a failed write (or a primary that
    /// says it is a replica) until a write succeeds or the primary is reconnected as a
    /// master. While false, the shard's checks fail and `store.on_error` decides. Always
    /// true in cluster mode.
    pub writable: bool,
    /// The primary first, then the replicas.
    pub nodes: Vec<NodeReport>,
}

impl ShardReport {
    /// The shard's primary (or the cluster).
    pub fn primary(&self) -> &NodeReport {
        &self.nodes[0]
    }
}

/// The state of one Redis node.
#[derive(Debug, Clone)]
pub struct NodeReport {
    /// `"primary"` or `"replica"` (a cluster's masters are `"primary"`, each in a
    /// [`ShardReport`] of its own).
    pub role: &'static str,
    /// Name used in logs.
    pub label: String,
    /// `HOST:PORT` it points at now.
    pub addr: String,
    /// Whether it has a live connection.
    pub connected: bool,
    /// False while it answers `LOADING` or `MASTERDOWN` (a replica is then skipped for
    /// reads), until its probe says it serves again.
    pub serving: bool,
    /// Its circuit breaker.
    pub breaker: BreakerState,
    /// Its counters.
    pub counts: Counts,
    /// Its call latency histogram (shared with the node; read at scrape time).
    pub latency: prometheus_client::metrics::histogram::Histogram,
    /// In cluster mode, the hash slots the master serves, e.g. `"0-5460"` or
    /// `"0-99,200-300"` (empty for a master a redirection named before the slot map
    /// listed it); `None` in sharded mode.
    pub slots: Option<String>,
}

impl Store for RedisStore {
    fn submit(&self, items: &[Item<'_>], now_ms: u64) -> super::Submitted {
        self.submit_many(items, self.now_arg(now_ms))
    }

    async fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
        lessee: &super::Lessee,
    ) -> Result<Grant, StoreError> {
        let reply = self
            .on_primary(
                &self.scripts.lease,
                key,
                &[
                    want,
                    quota,
                    window_ms,
                    self.now_arg(now_ms),
                    lessee.gateway,
                    lessee.ttl_ms,
                    lessee.kept,
                    lessee.kept_reset_at_ms,
                ],
            )
            .await?;
        match reply.as_slice() {
            [granted, used, reset_at] if *granted >= 0 && *used >= 0 && *reset_at >= 0 => {
                Ok(Grant {
                    granted: *granted as u64,
                    window: WindowState {
                        used: *used as u64,
                        reset_at_ms: *reset_at as u64,
                    },
                })
            }
            other => Err(StoreError::BadReply(format!("{other:?}"))),
        }
    }

    async fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
        gateway: u64,
    ) -> Result<WindowState, StoreError> {
        let reply = self
            .on_primary(&self.scripts.refund, key, &[units, reset_at_ms, gateway])
            .await?;
        match reply.as_slice() {
            [used, reset_at] if *used >= 0 && *reset_at >= 0 => Ok(WindowState {
                used: *used as u64,
                reset_at_ms: *reset_at as u64,
            }),
            other => Err(StoreError::BadReply(format!("{other:?}"))),
        }
    }

    async fn reset(&self, keys: &[LimitKey]) -> Result<u64, StoreError> {
        self.reset_keys(keys).await
    }

    /// Waits up to [`LATE_BOUND_FACTOR`] × `store.timeout` (plus one, for the answer to
    /// be kept) for the reservation's late call to end (see [`late`]). In cluster mode
    /// calls are not kept running: [`super::Late::Unknown`] at once.
    async fn late_reservation(&self, id: u64) -> super::Late {
        let Some(Topology::Sharded(shards)) = self.live.get() else {
            return super::Late::Unknown;
        };
        let Some(late) = shards.first().map(|s| s.late.clone()) else {
            return super::Late::Unknown;
        };
        let bound = self.cfg.timeout.0 * (LATE_BOUND_FACTOR + 1);
        late.take(id, bound).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard's primary batch is a write unless every key's operation is a peek: only a
    /// batch of peeks is refused while the primary's writes fail (and cannot clear it).
    #[test]
    fn a_batch_writes_unless_every_operation_is_a_peek() {
        let key = |kind: OpKind| [kind.code(), 0, 3, 60_000, 0, 0, 1, 1_800_000_000_000, 7];
        let peeks: Vec<u64> = [key(OpKind::Peek), key(OpKind::Peek)].concat();
        let mixed: Vec<u64> = [key(OpKind::Peek), key(OpKind::Charge)].concat();
        assert!(!apply_writes(&peeks));
        assert!(apply_writes(&mixed));
        assert!(apply_writes(&key(OpKind::Reserve)));
        assert!(!apply_writes(&[]));
    }

    /// LOADING and MASTERDOWN are a live node that does not serve; READONLY and a
    /// connection error are not.
    #[test]
    fn loading_and_masterdown_are_not_serving_readonly_is_not() {
        let reply = |text: &[u8]| match redis::parse_redis_value(text) {
            Ok(redis::Value::ServerError(e)) => StoreError::Redis(redis::RedisError::from(e)),
            other => panic!("{other:?}"),
        };
        assert!(reply(b"-LOADING Redis is loading the dataset in memory\r\n").is_not_serving());
        assert!(reply(b"-MASTERDOWN Link with MASTER is down\r\n").is_not_serving());
        let readonly = reply(b"-READONLY You can't write against a read only replica.\r\n");
        assert!(!readonly.is_not_serving());
        assert!(readonly.suggests_failover());
        assert!(!StoreError::Timeout(50).is_not_serving());
    }

    /// `lua/apply.lua`'s reply as `struct.pack("<i8i8i8", ...)` writes it: every integer
    /// back, negative ones (a refusal's `-(used + 1)`) and epoch milliseconds included;
    /// a length that is not whole integers is a bad reply, not a panic.
    #[test]
    fn a_packed_reply_unpacks_to_its_integers() {
        let sent = [-6_i64, 1_800_000_000_123, 0, 41, 1_800_000_060_000, 7];
        let bytes: Vec<u8> = sent.iter().flat_map(|n| n.to_le_bytes()).collect();
        assert_eq!(unpack_integers(&bytes).unwrap(), sent);
        assert_eq!(unpack_integers(&[]).unwrap(), Vec::<i64>::new());
        match unpack_integers(&bytes[..13]) {
            Err(StoreError::BadReply(why)) => assert!(why.contains("13 bytes"), "{why}"),
            other => panic!("expected a bad reply, got {other:?}"),
        }
    }
}
