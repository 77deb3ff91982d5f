//! The listener: accept loop, HTTP/1.1 and cleartext HTTP/2 on one port, graceful
//! shutdown, and the running [`Gateway`] that tests and `main` drive.

use crate::clock::SharedClock;
use crate::config::{ConfigFile, ConfigReport, StoreConfig};
use crate::limiter::store::AnyStore;
use crate::proxy;
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The config is invalid.
    #[error("invalid config:\n{0}")]
    Config(#[from] ConfigReport),
    /// The listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address from `server.listen`.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// State shared by every connection: the current snapshot and the clock.
#[derive(Debug)]
struct Shared {
    snapshot: ArcSwap<Snapshot>,
    clock: SharedClock,
}

/// A running gateway: its listener's address, its current snapshot, and its shutdown.
#[derive(Debug)]
pub struct Gateway {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Gateway {
    /// Build the snapshot of `file`, start its store, bind `server.listen` and serve.
    ///
    /// Errors: [`StartError::Config`] for an invalid file, [`StartError::Bind`] when the
    /// listener cannot be bound.
    pub async fn start(file: &ConfigFile, clock: SharedClock) -> Result<Gateway, StartError> {
        let snap = Snapshot::build(file, None)?;
        for w in &snap.warnings {
            tracing::warn!("{w}");
        }
        start_store(snap.limiter.store(), &snap.config.store, clock.clone());
        let listener = TcpListener::bind(snap.listen)
            .await
            .map_err(|source| StartError::Bind {
                addr: snap.listen,
                source,
            })?;
        let local_addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: snap.listen,
            source,
        })?;
        let header_read_timeout = snap.config.server.header_read_timeout.0;
        let grace = snap.config.server.shutdown_grace.0;
        let shared = Arc::new(Shared {
            snapshot: ArcSwap::from_pointee(snap),
            clock,
        });
        let (shutdown, rx) = watch::channel(false);
        let task = tokio::spawn(accept_loop(
            listener,
            shared.clone(),
            rx,
            header_read_timeout,
            grace,
        ));
        tracing::info!(listen = %local_addr, "tollgate listening");
        Ok(Gateway {
            local_addr,
            shared,
            shutdown,
            task,
        })
    }

    /// The address the proxy listener is bound to (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The snapshot new requests start with.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.shared.snapshot.load_full()
    }

    /// Build a new snapshot from `file` and swap it in; requests in flight finish on the
    /// one they started with. An invalid file changes nothing. The store (and its Redis
    /// connections) is kept when `[store]` did not change. Returns the new snapshot's
    /// warnings.
    ///
    /// Errors: the [`ConfigReport`] of an invalid file.
    pub fn reload(&self, file: &ConfigFile) -> Result<Vec<String>, ConfigReport> {
        let current = self.shared.snapshot.load_full();
        let snap = Snapshot::build(file, Some(&current))?;
        if !Arc::ptr_eq(snap.limiter.store(), current.limiter.store()) {
            start_store(
                snap.limiter.store(),
                &snap.config.store,
                self.shared.clock.clone(),
            );
        }
        let mut warnings = snap.warnings.clone();
        if snap.config.server != current.config.server {
            warnings.push(
                "[server] changed: listen addresses and timeouts take effect after a restart"
                    .into(),
            );
        }
        self.shared.snapshot.store(Arc::new(snap));
        Ok(warnings)
    }

    /// Stop accepting connections and let in-flight requests finish (up to
    /// `server.shutdown_grace`). Returns at once; [`Gateway::wait`] waits for the end.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }

    /// Wait until the gateway has stopped (after [`Gateway::shutdown`]).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Start what a new store needs in the background: the memory store's sweeper, or the
/// Redis connections and script loading.
fn start_store(store: &Arc<AnyStore>, cfg: &StoreConfig, clock: SharedClock) {
    match &**store {
        AnyStore::Memory(_) => {
            let weak: Weak<AnyStore> = Arc::downgrade(store);
            let every = cfg.sweep_interval.0;
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    // Stop when no snapshot uses this store any more.
                    let Some(store) = weak.upgrade() else { return };
                    if let AnyStore::Memory(m) = &*store {
                        let dropped = m.sweep(clock.now_ms());
                        tracing::trace!(dropped, "memory store swept");
                    }
                }
            });
        }
        AnyStore::Redis(r) => r.start(),
    }
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
    header_read_timeout: Duration,
    grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();

    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // e.g. EMFILE: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let service = service_fn(move |req| {
                    let shared = shared.clone();
                    async move {
                        let snap = shared.snapshot.load_full();
                        Ok::<_, Infallible>(proxy::handle(&snap, &*shared.clock, req, peer).await)
                    }
                });
                let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            _ = shutdown.changed() => break,
        }
    }

    drop(listener);
    tracing::info!(grace = ?grace, "shutting down: no new connections, draining in-flight requests");
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("all connections drained"),
        _ = tokio::time::sleep(grace) => tracing::warn!("shutdown_grace elapsed; closing remaining connections"),
    }
}
