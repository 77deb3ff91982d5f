//! Natural batching of one shard's script calls.
//!
//! Every CHECK (or CHARGE) meant for one node of a shard goes through that node's
//! [`Batcher`], which has at most one script call in flight. The first submitter to an
//! idle batcher sends its call itself, from its own task (no hop through another task);
//! what is submitted while a call is in flight waits in a FIFO queue, and when the call
//! is answered, everything queued goes out as the next call (at most [`MAX_KEYS`] keys
//! a call), from a task on the `per_core` worker whose call was answered, else on the
//! runtime the batcher was made on. Since one call at a time is in flight, the calls
//! keep their order whichever connection (a worker's own, or the node's) carries them.
//! An idle shard adds no delay (a lone request is sent at once); a busy one sends
//! fewer, larger calls, so Redis runs one script per batch instead of one per request.
//! The scripts take any number of keys (`lua/apply.lua`); a request's own items always
//! travel in one call.
//!
//! Order: calls reach the node in the order they were submitted (one in flight, then
//! the queue in order), whoever sends them. A submitter that goes away never loses its
//! call: a call not yet sent, or in flight, is finished on the batcher's runtime.
//!
//! Bound: a submission is answered within twice `store.timeout` (one call ahead, then its
//! own) without a timer of its own. A call that a submitter sends itself is bounded by
//! the flush: each node call the store makes is bounded by `store.timeout` (its breaker's
//! guard), and a CHECK asks at most a replica and then the primary. What is queued
//! while a call is in flight shares one deadline, twice `store.timeout` after the first
//! of them was queued, which the queue's task keeps with one timer per call: at the
//! deadline its submitters are answered with a timeout, and the call is still finished
//! before the next goes out. One timer per call instead of one per submission: about
//! 700 instructions fewer per request through a busy shard (BENCHMARKS.md).
//!
//! Answers go home in one hop per worker: a call carries the items of submitters on
//! every `per_core` worker, and waking a task of another worker's runtime costs a
//! system call (Tokio writes to that runtime's eventfd), so the items of each other
//! worker are handed to it together, as one task spawned there that gives each its
//! slice, instead of one cross-thread wake per item (see [`deliver`]).

use crate::limiter::store::{StoreCall, StoreError};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// Most keys sent in one script call (a Lua call blocks Redis while it runs).
pub(super) const MAX_KEYS: usize = 256;

/// Integers `lua/apply.lua` answers per key (see [`super::scripts::verdicts`]).
pub(super) const REPLY_WIDTH: usize = 4;

/// A script call's outcome: [`REPLY_WIDTH`] integers per key, or the error; and the
/// node it went to (and its breaker as found), for the traces of its requests.
pub(super) type Outcome = (Result<Vec<i64>, StoreError>, StoreCall);

/// A script call under way.
type Call = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// A storage key, shared with the limit it belongs to ([`crate::limiter::key::LimitKey`]):
/// handed to a batch without a copy.
pub(super) type Key = Arc<str>;

/// Sends one script call for a batch: keys, their arguments (a fixed number per key, in
/// key order) → [`REPLY_WIDTH`] integers per key.
pub(super) type Flush = Box<dyn Fn(Vec<Key>, Vec<u64>) -> Call + Send + Sync>;

/// One submitter's integers: [`REPLY_WIDTH`] per key, held inline for a one-key
/// submission (the usual request's), so that its slice of a shared reply is handed over
/// without an allocation.
pub(super) type Integers = smallvec::SmallVec<[i64; REPLY_WIDTH]>;

/// What a submitter is answered.
pub(super) type Answer = Result<Integers, StoreError>;

/// Where a submitter waits for its answer and the call's description (with the batch's
/// size: its operations and requests).
type Reply = oneshot::Sender<(Answer, StoreCall)>;

/// One request's items for the batch.
struct Pending {
    keys: Vec<Key>,
    args: Vec<u64>,
    reply: Reply,
    /// When its submitter is answered with a timeout if its call has not been answered:
    /// the deadline of the first item queued behind the same call in flight (see the
    /// module documentation).
    deadline: Instant,
    /// The submitter's `per_core` worker, whose runtime its answer is delivered on
    /// when the call was answered on another worker (see [`Shared::home`]).
    home: Option<usize>,
}

/// See the module documentation.
pub(super) struct Batcher {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Batcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("limit", &self.shared.limit)
            .finish_non_exhaustive()
    }
}

/// What the submitters and the batcher's task share.
struct Shared {
    flush: Flush,
    /// Bound on one submission, queueing included: twice `store.timeout`.
    limit: Duration,
    /// The runtime the batcher was made on: where queued calls, and calls whose
    /// submitter went away, are sent from.
    runtime: tokio::runtime::Handle,
    /// Each `per_core` worker's runtime, by worker index, kept the first time the
    /// worker queues an item (made when the first worker does).
    workers: OnceLock<Box<[OnceLock<tokio::runtime::Handle>]>>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// A call is in flight (sent by a submitter, or by the queue's task).
    busy: bool,
    /// Submitted while busy, in order.
    queue: Vec<Pending>,
}

impl Batcher {
    /// A batcher whose queued calls are sent from the current Tokio runtime (call it
    /// inside one). `flush` must bound each of its calls (the store's node calls are
    /// bounded by `timeout`, `store.timeout`, each; a CHECK makes at most two).
    pub(super) fn spawn(flush: Flush, timeout: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                flush,
                limit: timeout * 2,
                runtime: tokio::runtime::Handle::current(),
                workers: OnceLock::new(),
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// Hand `keys` with `args` (the same number per key) over, at once: to be sent by
    /// the returned future when the batcher is idle (its first poll sends it), else into
    /// the queue for the next call. What is handed over first runs first in Redis. The
    /// returned future answers [`REPLY_WIDTH`] integers per key, bounded by twice
    /// `store.timeout` (one call ahead, then this one; see the module documentation).
    pub(super) fn enqueue(
        &self,
        keys: Vec<Key>,
        args: Vec<u64>,
    ) -> impl Future<Output = (Answer, StoreCall)> + Send + 'static {
        let mut state = self.shared.lock();
        let turn = if state.busy {
            let (reply, rx) = oneshot::channel();
            let deadline = match state.queue.first() {
                Some(first) => first.deadline,
                None => Instant::now() + self.shared.limit,
            };
            state.queue.push(Pending {
                keys,
                args,
                reply,
                deadline,
                // Only a queued item is answered from elsewhere: a submitter that sends
                // its own call is answered on its own thread.
                home: self.shared.home(),
            });
            Turn::Queued(rx)
        } else {
            state.busy = true;
            let operations = keys.len().min(u16::MAX as usize) as u16;
            Turn::Send(
                operations,
                Sending {
                    shared: self.shared.clone(),
                    call: Some((self.shared.flush)(keys, args)),
                },
            )
        };
        drop(state);
        async move {
            match turn {
                Turn::Send(operations, sending) => {
                    let (answer, call) = sending.await;
                    let call = StoreCall {
                        operations,
                        requests: 1,
                        ..call
                    };
                    (answer.map(Integers::from_vec), call)
                }
                Turn::Queued(rx) => rx
                    .await
                    .unwrap_or((Err(StoreError::NotStarted), StoreCall::default())),
            }
        }
    }
}

/// Whose turn a submission is: to send now, or to wait for its slice of a queued call.
enum Turn {
    /// Sent by the submitter: its call of this many operations.
    Send(u16, Sending),
    Queued(oneshot::Receiver<(Answer, StoreCall)>),
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// On a `per_core` worker, its index, its runtime kept (once) for delivering its
    /// answers; `None` on any other thread.
    fn home(&self) -> Option<usize> {
        let (index, count) = crate::worker::current()?;
        let slot = self
            .workers
            .get_or_init(|| (0..count).map(|_| OnceLock::new()).collect())
            .get(index)?;
        if slot.get().is_none() {
            let _ = slot.set(tokio::runtime::Handle::try_current().ok()?);
        }
        Some(index)
    }

    /// The runtime of worker `index`, kept by [`Shared::home`].
    fn worker_runtime(&self, index: usize) -> Option<&tokio::runtime::Handle> {
        self.workers.get()?.get(index)?.get()
    }

    /// The call in flight has been answered: send what was queued meanwhile (from a
    /// task, one call at a time), or become idle.
    fn answered(self: &Arc<Self>) {
        let mut state = self.lock();
        if state.queue.is_empty() {
            state.busy = false;
            return;
        }
        let queued = std::mem::take(&mut state.queue);
        drop(state);
        // On a `per_core` worker, the queue goes out from this worker (over its own
        // connection, waking no other thread); elsewhere from the batcher's runtime.
        let here =
            crate::worker::current().and_then(|_| tokio::runtime::Handle::try_current().ok());
        here.as_ref()
            .unwrap_or(&self.runtime)
            .spawn(drain(self.clone(), queued));
    }
}

/// A submitter's own call, sent from its task. Dropped before it is answered (the
/// submitter went away, or timed out), the call is finished on the batcher's runtime,
/// so that it is never lost and the queue behind it goes on.
struct Sending {
    shared: Arc<Shared>,
    call: Option<Call>,
}

impl Future for Sending {
    type Output = Outcome;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(call) = self.call.as_mut() else {
            return Poll::Ready((Err(StoreError::NotStarted), StoreCall::default()));
        };
        let answer = std::task::ready!(call.as_mut().poll(cx));
        self.call = None;
        self.shared.answered();
        Poll::Ready(answer)
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            let shared = self.shared.clone();
            self.shared.runtime.spawn(async move {
                let _ = call.await;
                shared.answered();
            });
        }
    }
}

/// Send `queued` (in order, at most [`MAX_KEYS`] keys a call) and whatever is queued
/// meanwhile, until the queue is empty.
async fn drain(shared: Arc<Shared>, mut queued: Vec<Pending>) {
    loop {
        let mut rest = Vec::new();
        let mut n = 0;
        let mut batch = Vec::with_capacity(queued.len());
        for p in queued {
            if n > 0 && n + p.keys.len() > MAX_KEYS || !rest.is_empty() {
                rest.push(p);
            } else {
                n += p.keys.len();
                batch.push(p);
            }
        }
        let counts: Vec<usize> = batch.iter().map(|p| p.keys.len()).collect();
        // The earliest deadline of the batch: its first item's (queued in order; a batch
        // always has one).
        let deadline = batch.first().map_or_else(Instant::now, |p| p.deadline);
        let mut keys = Vec::with_capacity(n);
        let mut args = Vec::with_capacity(batch.iter().map(|p| p.args.len()).sum());
        let mut replies = Vec::with_capacity(batch.len());
        for mut p in batch {
            keys.append(&mut p.keys);
            args.append(&mut p.args);
            replies.push((p.reply, p.home));
        }
        let mut call = (shared.flush)(keys, args);
        match tokio::time::timeout_at(deadline, &mut call).await {
            Ok((result, via)) => deliver(&shared, replies, &counts, result, via),
            Err(_) => {
                let limit_ms = shared.limit.as_millis() as u64;
                deliver(
                    &shared,
                    replies,
                    &counts,
                    Err(StoreError::Timeout(limit_ms)),
                    StoreCall::default(),
                );
                // Never lost, and in order: finished before the next call goes out.
                let _ = call.await;
            }
        }
        let mut state = shared.lock();
        rest.append(&mut state.queue);
        if rest.is_empty() {
            state.busy = false;
            return;
        }
        drop(state);
        queued = rest;
    }
}

/// Give each request its slice of the reply ([`REPLY_WIDTH`] integers per key), or the
/// error: at once to submitters of this thread (and of no worker), and to those of each
/// other `per_core` worker as one task spawned on that worker's runtime, which wakes one
/// thread once per call instead of once per item.
fn deliver(
    shared: &Shared,
    replies: Vec<(Reply, Option<usize>)>,
    counts: &[usize],
    result: Result<Vec<i64>, StoreError>,
    via: StoreCall,
) {
    let via = StoreCall {
        operations: counts.iter().sum::<usize>().min(u16::MAX as usize) as u16,
        requests: counts.len().min(u16::MAX as usize) as u16,
        ..via
    };
    let answers: Vec<Answer> = match result {
        Ok(reply) if reply.len() == REPLY_WIDTH * counts.iter().sum::<usize>() => {
            let mut at = 0;
            counts
                .iter()
                .map(|n| {
                    let slice = Integers::from_slice(&reply[at..at + REPLY_WIDTH * n]);
                    at += REPLY_WIDTH * n;
                    Ok(slice)
                })
                .collect()
        }
        Ok(reply) => {
            let e = StoreError::BadReply(format!(
                "{} integers for {} keys",
                reply.len(),
                counts.iter().sum::<usize>()
            ));
            counts.iter().map(|_| Err(e.clone())).collect()
        }
        Err(e) => counts.iter().map(|_| Err(e.clone())).collect(),
    };
    for (worker, group) in by_home(replies, answers) {
        let hand_over = move || {
            for (tx, answer) in group {
                let _ = tx.send((answer, via));
            }
        };
        match worker.and_then(|i| shared.worker_runtime(i)) {
            Some(runtime) => {
                runtime.spawn(async move { hand_over() });
            }
            None => hand_over(),
        }
    }
}

/// Submitters with their answers, delivered together: on the runtime of the worker
/// given, or at once (`None`).
type Group = (Option<usize>, Vec<(Reply, Answer)>);

/// Answers paired with their submitters, grouped by where they are delivered: `None`
/// (first, when there is any) for this thread's submitters and those of no worker, then
/// one group per other `per_core` worker with its runtime, each in submission order.
fn by_home(replies: Vec<(Reply, Option<usize>)>, answers: Vec<Answer>) -> Vec<Group> {
    let here = crate::worker::current().map(|(i, _)| i);
    let mut groups: Vec<Group> = vec![(None, Vec::new())];
    for ((tx, home), answer) in replies.into_iter().zip(answers) {
        let to = home.filter(|&w| Some(w) != here);
        match groups.iter_mut().find(|g| g.0 == to) {
            Some(group) => group.1.push((tx, answer)),
            None => groups.push((to, vec![(tx, answer)])),
        }
    }
    groups.retain(|g| !g.1.is_empty());
    groups
}

#[cfg(test)]
mod tests;
