//! Natural batching of one shard's script calls.
//!
//! Every CHECK (or CHARGE) meant for one node of a shard goes through that node's
//! [`Batcher`]: a task that sends one script call at a time and, while it waits for the
//! reply, collects what arrives meanwhile into the next call. An idle shard adds no
//! delay (a lone request is sent at once); a busy one sends fewer, larger calls, so
//! Redis runs one script per batch instead of one per request. The scripts take any
//! number of keys (`lua/apply.lua`); a request's own items always
//! travel in one call.

use super::StoreError;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// Most keys sent in one script call (a Lua call blocks Redis while it runs).
pub(super) const MAX_KEYS: usize = 256;

/// Integers `lua/apply.lua` answers per key.
pub(super) const REPLY_WIDTH: usize = 5;

/// Sends one script call for a batch: keys, their arguments (a fixed number per key, in
/// key order) → [`REPLY_WIDTH`] integers per key.
pub(super) type Flush = Box<
    dyn Fn(
            Vec<String>,
            Vec<u64>,
        ) -> Pin<Box<dyn Future<Output = Result<Vec<i64>, StoreError>> + Send>>
        + Send
        + Sync,
>;

/// One request's items for the batch.
struct Pending {
    keys: Vec<String>,
    args: Vec<u64>,
    reply: oneshot::Sender<Result<Vec<i64>, StoreError>>,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Batcher {
    tx: mpsc::UnboundedSender<Pending>,
    /// Bound on one submission, queueing included.
    timeout: Duration,
}

impl Batcher {
    /// Start the batching task (inside a Tokio runtime). It ends when the batcher is
    /// dropped.
    pub(super) fn spawn(flush: Flush, timeout: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(rx, flush));
        Self { tx, timeout }
    }

    /// Hand `keys` with `args` (the same number per key) to the next call, at once: the
    /// queue is FIFO, so what is handed over first runs first in Redis. The returned
    /// future answers [`REPLY_WIDTH`] integers per key, bounded by twice `store.timeout`
    /// (one call ahead in the queue, then this one).
    pub(super) fn enqueue(
        &self,
        keys: Vec<String>,
        args: Vec<u64>,
    ) -> impl Future<Output = Result<Vec<i64>, StoreError>> + Send + 'static {
        let (reply, rx) = oneshot::channel();
        let sent = self.tx.send(Pending { keys, args, reply }).is_ok();
        let limit = self.timeout * 2;
        async move {
            if !sent {
                return Err(StoreError::NotStarted);
            }
            match tokio::time::timeout(limit, rx).await {
                Ok(Ok(result)) => result,
                Ok(Err(_)) => Err(StoreError::NotStarted),
                Err(_) => Err(StoreError::Timeout(limit.as_millis() as u64)),
            }
        }
    }
}

async fn run(mut rx: mpsc::UnboundedReceiver<Pending>, flush: Flush) {
    while let Some(first) = rx.recv().await {
        let mut n = first.keys.len();
        let mut batch = vec![first];
        while n < MAX_KEYS {
            match rx.try_recv() {
                Ok(p) => {
                    n += p.keys.len();
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        let counts: Vec<usize> = batch.iter().map(|p| p.keys.len()).collect();
        let mut keys = Vec::with_capacity(n);
        let mut args = Vec::with_capacity(batch.iter().map(|p| p.args.len()).sum());
        let mut replies = Vec::with_capacity(batch.len());
        for mut p in batch {
            keys.append(&mut p.keys);
            args.append(&mut p.args);
            replies.push(p.reply);
        }
        let result = flush(keys, args).await;
        deliver(replies, &counts, result);
    }
}

/// Give each request its slice of the reply ([`REPLY_WIDTH`] integers per key), or the error.
fn deliver(
    replies: Vec<oneshot::Sender<Result<Vec<i64>, StoreError>>>,
    counts: &[usize],
    result: Result<Vec<i64>, StoreError>,
) {
    match result {
        Ok(reply) if reply.len() == REPLY_WIDTH * counts.iter().sum::<usize>() => {
            let mut at = 0;
            for (tx, n) in replies.into_iter().zip(counts) {
                let _ = tx.send(Ok(reply[at..at + REPLY_WIDTH * n].to_vec()));
                at += REPLY_WIDTH * n;
            }
        }
        Ok(reply) => {
            let e = StoreError::BadReply(format!(
                "{} integers for {} keys",
                reply.len(),
                counts.iter().sum::<usize>()
            ));
            for tx in replies {
                let _ = tx.send(Err(e.clone()));
            }
        }
        Err(e) => {
            for tx in replies {
                let _ = tx.send(Err(e.clone()));
            }
        }
    }
}
