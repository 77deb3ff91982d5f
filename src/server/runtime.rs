//! The runtime shape (`server.runtime`): where the proxy listener's connections are
//! served. This module is the one seam between the two shapes; the rest of the server
//! and the proxy do not know which one runs.
//!
//! - `multi_thread` (the default): one work-stealing Tokio runtime, the caller's, serves
//!   every connection from one listener. A request may wake tasks on any of its threads.
//! - `per_core`: [`Workers`]: `server.workers` single-threaded Tokio runtimes, each on an
//!   OS thread of its own ([`WORKER_THREAD`]), each accepting on a listener of its own
//!   bound to `server.listen` with `SO_REUSEPORT` (Linux: the kernel spreads new
//!   connections over them; elsewhere they share one listener) and serving what it
//!   accepted to the end. What a request needs per thread is kept per worker, found by
//!   [`crate::worker::current`]: the upstream connection pools (`proxy::pool`) and the
//!   Redis batchers (`limiter::store::redis`). The config snapshot, the metrics and the connection
//!   budget are shared (atomics and an `ArcSwap`). The admin listener, the reloader
//!   (SIGHUP, the file watcher), the store's background tasks and the sweepers stay on
//!   the caller's runtime, off the proxy threads.

use crate::config::ServerConfig;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::{mpsc, watch};

/// The name of every `per_core` worker thread (as `ps -T` and `/proc/PID/task/*/comm`
/// show it; at most 15 bytes).
pub const WORKER_THREAD: &str = "tollgate-worker";

/// Connections a listener's accept queue holds (as Tokio's own `TcpListener::bind`).
const BACKLOG: i32 = 1024;

/// `server.workers`, or one per CPU the process may use (at least 1).
pub fn worker_count(cfg: &ServerConfig) -> usize {
    crate::worker::count(cfg.workers)
}

/// `count` listeners on `addr`, bound now (so that a bind error is the caller's). On
/// Linux each is a socket of its own with `SO_REUSEPORT`, all on the port the first one
/// got (`addr` may have port 0); elsewhere they are one socket, duplicated.
///
/// Errors: the OS error of creating, binding or listening on a socket.
pub fn bind_listeners(
    addr: SocketAddr,
    count: usize,
) -> std::io::Result<Vec<std::net::TcpListener>> {
    let count = count.max(1);
    let first = bind_one(addr)?;
    let local = first.local_addr()?;
    let mut listeners = vec![first];
    while listeners.len() < count {
        let next = if cfg!(target_os = "linux") {
            bind_one(local)?
        } else {
            listeners[0].try_clone()?
        };
        listeners.push(next);
    }
    Ok(listeners)
}

/// One non-blocking listening socket on `addr` (`SO_REUSEADDR` as Tokio sets it, and
/// `SO_REUSEPORT` on Linux).
fn bind_one(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    #[cfg(target_os = "linux")]
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

/// One worker still serving, counted in a gateway's shared count from before its thread
/// starts until it has served its last request (or its thread failed to start, or
/// panicked: the count goes down when this is dropped).
struct Serving {
    count: Arc<watch::Sender<usize>>,
}

impl Serving {
    fn enter(count: &Arc<watch::Sender<usize>>) -> Serving {
        count.send_modify(|n| *n += 1);
        Serving {
            count: count.clone(),
        }
    }

    /// This worker has served its last request: leave the count, then wait until every
    /// other worker has too.
    async fn wait_for_all(self) {
        let mut rx = self.count.subscribe();
        drop(self);
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.count.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The `per_core` worker threads of one gateway; see the module documentation.
#[derive(Debug)]
pub(crate) struct Workers {
    /// Every thread holds a sender: when all are dropped, every worker has stopped.
    stopped: mpsc::Receiver<()>,
}

impl Workers {
    /// Start one worker thread per listener in `listeners`: each builds a
    /// single-threaded runtime, takes its listener into it and runs `serve` with it
    /// until `serve` returns (after a shutdown and the drain); its runtime keeps running
    /// its other tasks until every worker's `serve` has returned (they may carry other
    /// workers' Redis calls), and is then dropped with any task still on it (after at
    /// most 1 s).
    ///
    /// Errors: a runtime or a thread could not be created (the threads started before
    /// are told to stop by the caller's shutdown signal).
    pub(crate) fn start<F, Fut>(
        listeners: Vec<std::net::TcpListener>,
        serve: F,
    ) -> std::io::Result<Workers>
    where
        F: Fn(tokio::net::TcpListener) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let serve = Arc::new(serve);
        let count = listeners.len();
        let (done, stopped) = mpsc::channel::<()>(1);
        let serving = Arc::new(watch::Sender::new(0usize));
        // Every worker is counted before any starts: a worker whose `serve` returns at
        // once must not find the count at zero while the others are still being made.
        let entered: Vec<Serving> = (0..count).map(|_| Serving::enter(&serving)).collect();
        for ((index, listener), still) in listeners.into_iter().enumerate().zip(entered) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (serve, done) = (serve.clone(), done.clone());
            std::thread::Builder::new()
                .name(WORKER_THREAD.into())
                .spawn(move || {
                    crate::worker::enter(index, count);
                    runtime.block_on(async move {
                        match tokio::net::TcpListener::from_std(listener) {
                            Ok(listener) => serve(listener).await,
                            Err(e) => {
                                tracing::error!(worker = index, error = %e, "worker cannot use its listener")
                            }
                        }
                        // This runtime's tasks may carry other workers' calls (a Redis
                        // shard's queued calls go out from the worker whose call was
                        // answered): keep them going until every worker has served its
                        // last request.
                        still.wait_for_all().await;
                    });
                    // Connections still open after the drain end here, with their tasks.
                    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
                    drop(done);
                })?;
        }
        Ok(Workers { stopped })
    }

    /// Wait until every worker thread has stopped.
    pub(crate) async fn wait(mut self) {
        while self.stopped.recv().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    /// A task on a worker that has finished serving still runs to its end while another
    /// worker serves (a worker's tasks may carry other workers' Redis calls).
    #[tokio::test]
    async fn a_workers_tasks_run_until_every_worker_has_served() {
        let listeners: Vec<_> = (0..2)
            .map(|_| bind_one("127.0.0.1:0".parse().unwrap()).unwrap())
            .collect();
        let ran = Arc::new(AtomicBool::new(false));
        let (index_of, seen) = (
            Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            ran.clone(),
        );
        let workers = Workers::start(listeners, move |_listener| {
            let (index_of, seen) = (index_of.clone(), seen.clone());
            async move {
                if index_of.fetch_add(1, Ordering::SeqCst) == 0 {
                    // The first worker to serve returns at once, leaving a task behind
                    // that needs 200 ms.
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        seen.store(true, Ordering::SeqCst);
                    });
                } else {
                    // The other serves until that task has run, or 5 s (then the task
                    // was dropped): no race between two timers on a loaded machine.
                    for _ in 0..500 {
                        if seen.load(Ordering::SeqCst) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        })
        .unwrap();
        tokio::time::timeout(Duration::from_secs(10), workers.wait())
            .await
            .expect("both workers stopped");
        assert!(
            ran.load(Ordering::SeqCst),
            "the first worker's task was dropped when it stopped serving"
        );
    }
}
