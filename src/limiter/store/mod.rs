//! Where windows are kept: the [`Store`] trait and its two implementations.
//!
//! Both stores run every limit algorithm by the same rules: the memory store calls the
//! reference model in [`crate::limiter::algorithm`], Redis runs `lua/apply.lua`, and the
//! store-contract tests hold the two to the same answers. One [`Store::apply`] call
//! applies one operation (peek, charge, reserve, refund) to each limit of a request.
//! Reset times are stored, never derived from a TTL. Lease mode (fixed windows only)
//! has its own two calls, [`Store::lease`] and [`Store::refund`]; [`Store::reset`]
//! deletes a caller's windows.

pub mod call;
pub mod memory;
pub mod redis;
pub mod status;

pub use call::{CallNote, StoreCall};
pub use status::{primaries_ready, shard_unready, StoreStatus};

use super::algorithm::{Op, Policy, Verdict};
use super::key::LimitKey;
use crate::clock::SharedClock;
use std::future::Future;

/// One answer per item of a store call.
pub type Answers = Vec<Result<Verdict, StoreError>>;

/// The answers of a store call and where it went (for the request's trace).
#[derive(Debug, Default)]
pub struct Answered {
    /// One result per item, in order.
    pub answers: Answers,
    /// The (first) call that answered them: shard, node, script, batch.
    pub call: StoreCall,
    /// Calls made: one per shard (and kind) the items live on.
    pub calls: u32,
}

/// The answers of a call handed to the store ([`Store::submit`]): one result per item.
/// The memory store's are ready at once (no allocation); Redis's arrive later.
pub enum Submitted {
    /// Answered already (taken by the first poll).
    Ready(Option<Answered>),
    /// On its way.
    Waiting(std::pin::Pin<Box<dyn Future<Output = Answered> + Send>>),
}

impl std::fmt::Debug for Submitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Submitted::Ready(_) => "Submitted::Ready",
            Submitted::Waiting(_) => "Submitted::Waiting",
        })
    }
}

impl Future for Submitted {
    type Output = Answered;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.get_mut() {
            Submitted::Ready(answers) => std::task::Poll::Ready(answers.take().unwrap_or_default()),
            Submitted::Waiting(future) => future.as_mut().poll(cx),
        }
    }
}

/// What became of a reservation whose call timed out ([`Store::late_reservation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Late {
    /// It ran and reserved: its units are counted; `epoch` is what a refund of it
    /// quotes (as a [`Verdict`]'s).
    Landed {
        /// The verdict's epoch.
        epoch: u64,
    },
    /// It did not reserve: it was refused, or never ran.
    NotLanded,
    /// Not known within the bound: it may have landed, or may still.
    Unknown,
}

/// A fixed window as lease mode sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowState {
    /// Units charged in the window.
    pub used: u64,
    /// End of the window, milliseconds since the Unix epoch; 0 when there is no live window.
    pub reset_at_ms: u64,
}

/// A store call that did not produce an answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The call took longer than `store.timeout`.
    #[error("store call timed out after {0} ms")]
    Timeout(u64),
    /// Redis answered with an error or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// The store's connections were never opened ([`redis::RedisStore::start`]).
    #[error("store not started")]
    NotStarted,
    /// The node has no connection (it is being re-established in the background).
    #[error("{0}: not connected")]
    NotConnected(String),
    /// The node's circuit breaker is open: failing fast.
    #[error("{0}: circuit breaker open")]
    BreakerOpen(String),
    /// The memory store holds `store.max_callers` states and this caller would be a new
    /// one.
    #[error("memory store full: store.max_callers ({0}) states held")]
    Full(usize),
    /// The script's reply did not have the expected shape.
    #[error("unexpected reply from store: {0}")]
    BadReply(String),
    /// A check of a shard whose primary's writes fail (a failed or demoted primary):
    /// answered as a failed call, whatever a replica would say, so that a caller is never
    /// admitted by reads while nothing can be counted.
    #[error("{0}: writes to the shard's primary fail; its checks fail until they succeed")]
    NotWritable(String),
}

impl StoreError {
    /// Whether the node answered but does not serve for now: `LOADING` (loading its data
    /// set) or `MASTERDOWN` (a replica cut off from its primary with
    /// `replica-serve-stale-data no`). The one place these are classified: such a node
    /// is alive — not reconnected, not a circuit-breaker failure — and a replica that
    /// answers so is skipped for reads until it serves again.
    pub fn is_not_serving(&self) -> bool {
        match self {
            StoreError::Redis(e) => matches!(
                e.kind(),
                ::redis::ErrorKind::Server(
                    ::redis::ServerErrorKind::BusyLoading | ::redis::ServerErrorKind::MasterDown
                )
            ),
            _ => false,
        }
    }

    /// Whether the operation may still have run in the store although its caller got
    /// this error: a timeout, or a connection that failed after the call was sent (a
    /// write answered so may land later). A refused connection, an open breaker, a
    /// store not started or full, or an error reply from Redis mean it did not run.
    pub fn may_have_run(&self) -> bool {
        match self {
            StoreError::Timeout(_) => true,
            StoreError::Redis(e) => {
                (e.is_io_error() || e.is_connection_dropped() || e.is_timeout())
                    && !e.is_connection_refusal()
            }
            _ => false,
        }
    }

    /// Whether the error is what a failover looks like from the client: the connection
    /// failed or timed out, or the node is now a read-only replica.
    pub fn suggests_failover(&self) -> bool {
        match self {
            StoreError::Timeout(_) | StoreError::NotConnected(_) => true,
            StoreError::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.code() == Some("READONLY")
            }
            _ => false,
        }
    }

    /// Whether the error is a Redis Cluster redirection (`MOVED`, `ASK`): the node is
    /// alive and answered, but another one serves the key's slot; nothing was applied.
    pub fn is_redirect(&self) -> bool {
        match self {
            StoreError::Redis(e) => matches!(
                e.kind(),
                ::redis::ErrorKind::Server(
                    ::redis::ServerErrorKind::Moved | ::redis::ServerErrorKind::Ask
                )
            ),
            _ => false,
        }
    }
}

/// One operation of a batch: `op` on the state of `key` under `policy`.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    /// Where the limit's state for one subject is kept.
    pub key: &'a LimitKey,
    /// The limit's algorithm and numbers.
    pub policy: &'a Policy,
    /// What to do.
    pub op: Op,
}

/// Who asks for a LEASE ([`Store::lease`]) and what it holds already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lessee {
    /// The gateway's id: random per process.
    pub gateway: u64,
    /// `lease_ttl`: how long the store keeps this gateway's unused units for it without
    /// hearing from it, milliseconds.
    pub ttl_ms: u64,
    /// Units of earlier grants this gateway still holds, unused.
    pub kept: u64,
    /// The end of the window those units belong to, ms since the epoch (0: none).
    pub kept_reset_at_ms: u64,
}

/// What a LEASE got ([`Store::lease`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Units granted to this gateway (0 when the window is full).
    pub granted: u64,
    /// The window after the grant; `used` counts every gateway's leased units.
    pub window: WindowState,
}

/// A place to keep limit state. All times are milliseconds since the Unix epoch, from
/// the gateway's clock (the `now_ms` arguments), except in a Redis store with
/// `store.clock = "redis"`: it ignores `now_ms` and its scripts read Redis's `TIME`, so
/// the times in its answers are Redis's. Batch calls answer one result per item, in
/// order; the Redis store sends the items that live on one shard in one script call.
pub trait Store: Send + Sync {
    /// Hand each item's operation at `now_ms` (ms since the Unix epoch; see
    /// [`crate::limiter::algorithm::apply`]) to the store now, and return a future of
    /// the answers, one per item, in order. Items whose operations are all peeks may be
    /// answered from a stale copy (a replica); the others run on the primary.
    ///
    /// What "now" means is the point of this method: when it returns, the memory store
    /// has applied the items, and a Redis shard has them in its primary's FIFO queue,
    /// behind every call submitted before and ahead of every call submitted after (the
    /// limiter orders its in-flight bookkeeping by it): every item when its reads go to
    /// its primary; writes, and peeks of windows this gateway wrote that a replica may
    /// not have seen yet, when they go to replicas (the other peeks go to a replica that
    /// has seen every write of this gateway to their windows).
    fn submit(&self, items: &[Item<'_>], now_ms: u64) -> Submitted;

    /// [`Store::submit`], awaited.
    fn apply(
        &self,
        items: &[Item<'_>],
        now_ms: u64,
    ) -> impl Future<Output = Vec<Result<Verdict, StoreError>>> + Send {
        let submitted = self.submit(items, now_ms);
        async move { submitted.await.answers }
    }

    /// Take up to `want` units of `key`'s window for local admission (lease mode),
    /// never past `quota`: the granted units are counted in the window at once. A new
    /// window lasts `window_ms` from `now_ms` (ms since the Unix epoch).
    ///
    /// `lessee` says which gateway asks, what it still holds and for how long the
    /// store keeps its unused units for it (`lease_ttl`; the Redis store gives units of a
    /// gateway not heard from within it back to the window, see `lua/lease.lua`; the
    /// memory store dies with its gateway and ignores it).
    fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
        lessee: &Lessee,
    ) -> impl Future<Output = Result<Grant, StoreError>> + Send;

    /// Give back `units` that the gateway `gateway` ([`Lessee::gateway`]) took from the
    /// window that ends at `reset_at_ms`; nothing happens when that window is over, or
    /// (Redis) for units whose lease record lapsed already. Returns the window after
    /// the refund.
    fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
        gateway: u64,
    ) -> impl Future<Output = Result<WindowState, StoreError>> + Send;

    /// Delete the state of each of `keys` (`POST /callers/{id}/reset`): the subject's
    /// next request starts afresh, as if never seen. The memory store removes the keys;
    /// Redis runs `lua/reset.lua` on each shard's primary (one call per shard). Returns
    /// how many of the keys held state.
    fn reset(&self, keys: &[LimitKey]) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// What became of the reservation (a [`super::algorithm::OpKind::Reserve`] op) with
    /// op id `id` whose call answered an error that [`StoreError::may_have_run`]: Redis
    /// finishes such a call in the background and says so once it ends, within
    /// [`redis::LATE_BOUND_FACTOR`] × `store.timeout` of being sent; the answer is
    /// given once. The memory store never times out: [`Late::Unknown`].
    fn late_reservation(&self, id: u64) -> impl Future<Output = Late> + Send {
        let _ = id;
        std::future::ready(Late::Unknown)
    }
}

impl StoreStatus for AnyStore {
    fn start(&self, clock: SharedClock, sweep_every: std::time::Duration) {
        match self {
            AnyStore::Memory(m) => m.start_sweeper(sweep_every, clock),
            AnyStore::Redis(r) => {
                r.start();
                r.start_fallback(clock, sweep_every);
            }
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            AnyStore::Memory(_) => "memory",
            AnyStore::Redis(_) => "redis",
        }
    }

    fn report(&self) -> Vec<status::ShardReport> {
        match self {
            AnyStore::Memory(_) => Vec::new(),
            AnyStore::Redis(r) => r.report(),
        }
    }

    fn ready(&self) -> bool {
        match self {
            AnyStore::Memory(_) => true,
            AnyStore::Redis(_) => primaries_ready(&self.report()),
        }
    }

    fn encode_metrics(
        &self,
        enc: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        match self {
            AnyStore::Memory(_) => Ok(()),
            AnyStore::Redis(r) => r.encode_metrics(enc),
        }
    }
}

/// The store a gateway runs with, chosen by `store.backend`.
#[derive(Debug)]
pub enum AnyStore {
    /// `backend = "memory"`.
    Memory(memory::MemoryStore),
    /// `backend = "redis"`.
    Redis(redis::RedisStore),
}

impl AnyStore {
    /// The address of `node` of shard `shard` as it is now (`"127.0.0.1:6381"`), or
    /// `"memory"`, `"cluster"`: for a sampled request's trace only (it takes a lock
    /// and makes a string).
    pub fn node_addr(&self, shard: u16, node: call::NodeRole) -> String {
        match self {
            AnyStore::Memory(_) => node.as_str().to_string(),
            AnyStore::Redis(r) => r.node_addr(shard, node),
        }
    }

    /// The call a lease refill of `key` made and what it found (`result`): for a
    /// sampled request's trace only.
    pub fn lease_call<T>(&self, key: &LimitKey, result: &Result<T, StoreError>) -> StoreCall {
        match self {
            AnyStore::Memory(_) => StoreCall {
                script: call::Script::Lease,
                ..StoreCall::memory(1)
            },
            AnyStore::Redis(r) => r.lease_call(key, result),
        }
    }

    /// With `store.on_error = "local"`, the divisor of each quota of `key`'s limits
    /// while its Redis shard is enforced in this gateway's memory; `None` otherwise.
    pub fn local_divisor(&self, key: &LimitKey) -> Option<u64> {
        match self {
            AnyStore::Memory(_) => None,
            AnyStore::Redis(r) => r.local_divisor(key),
        }
    }
}

impl Store for AnyStore {
    fn submit(&self, items: &[Item<'_>], now_ms: u64) -> Submitted {
        match self {
            AnyStore::Memory(s) => s.submit(items, now_ms),
            AnyStore::Redis(s) => s.submit(items, now_ms),
        }
    }

    async fn apply(&self, items: &[Item<'_>], now_ms: u64) -> Vec<Result<Verdict, StoreError>> {
        match self {
            AnyStore::Memory(s) => s.apply(items, now_ms).await,
            AnyStore::Redis(s) => s.submit(items, now_ms).await.answers,
        }
    }

    async fn lease(
        &self,
        key: &LimitKey,
        want: u64,
        quota: u64,
        window_ms: u64,
        now_ms: u64,
        lessee: &Lessee,
    ) -> Result<Grant, StoreError> {
        match self {
            AnyStore::Memory(s) => s.lease(key, want, quota, window_ms, now_ms, lessee).await,
            AnyStore::Redis(s) => s.lease(key, want, quota, window_ms, now_ms, lessee).await,
        }
    }

    async fn refund(
        &self,
        key: &LimitKey,
        units: u64,
        reset_at_ms: u64,
        gateway: u64,
    ) -> Result<WindowState, StoreError> {
        match self {
            AnyStore::Memory(s) => s.refund(key, units, reset_at_ms, gateway).await,
            AnyStore::Redis(s) => s.refund(key, units, reset_at_ms, gateway).await,
        }
    }

    async fn reset(&self, keys: &[LimitKey]) -> Result<u64, StoreError> {
        match self {
            AnyStore::Memory(s) => s.reset(keys).await,
            AnyStore::Redis(s) => s.reset(keys).await,
        }
    }

    async fn late_reservation(&self, id: u64) -> Late {
        match self {
            AnyStore::Memory(s) => s.late_reservation(id).await,
            AnyStore::Redis(s) => s.late_reservation(id).await,
        }
    }
}
