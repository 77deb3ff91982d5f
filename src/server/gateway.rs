//! The gateway's lifecycle: [`Gateway::start`] builds the first snapshot, starts its
//! store, binds the proxy listener (one, or one per `per_core` worker) and the admin
//! listener and starts serving; a [`Gateway`] then reloads, reports and shuts down.

use super::accept::{accept_loop, ConnLimits};
use super::runtime;
use super::shared::{Shared, LOG_TARGET};
use crate::admin;
use crate::budget::Budget;
use crate::clock::SharedClock;
use crate::config::{ConfigFile, ConfigReport, RuntimeShape};
use crate::limiter::store::StoreStatus;
use crate::metrics::{Metrics, ReloadLabels};
use crate::reload::{ReloadOutcome, Reloader};
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use std::net::SocketAddr;
use std::sync::Arc;
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
    /// A `per_core` worker's runtime or thread could not be created.
    #[error("cannot start the per_core workers: {0}")]
    Runtime(std::io::Error),
}

/// A running gateway: its listeners' addresses, its current snapshot, and its shutdown.
#[derive(Debug)]
pub struct Gateway {
    local_addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    shared: Arc<Shared>,
    reloader: Reloader,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
    admin_task: Option<JoinHandle<()>>,
}

impl Gateway {
    /// Read the files `file` names ([`crate::load::Loaded::load`]), build its snapshot, start its
    /// store, bind `server.listen` (and `server.admin_listen`) and serve.
    ///
    /// Errors: [`StartError::Config`] for an invalid file, [`StartError::Bind`] when a
    /// listener cannot be bound.
    pub async fn start(file: &ConfigFile, clock: SharedClock) -> Result<Gateway, StartError> {
        let mut snap = Snapshot::build(file, &crate::load::Loaded::load(file, None), None)?;
        snap.generation = 1;
        for w in &snap.warnings {
            tracing::warn!(target: LOG_TARGET, "{w}");
        }
        start_store(&snap, clock.clone());
        let bind = |addr: SocketAddr| async move {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { addr, source })?;
            let local = listener
                .local_addr()
                .map_err(|source| StartError::Bind { addr, source })?;
            Ok::<_, StartError>((listener, local))
        };
        // The proxy listener: one for the multi-thread runtime, or one per worker.
        let proxy_listener = match snap.config.server.runtime {
            RuntimeShape::MultiThread => ProxyListener::One(bind(snap.listen).await?.0),
            RuntimeShape::PerCore => {
                let addr = snap.listen;
                let count = runtime::worker_count(&snap.config.server);
                let listeners = runtime::bind_listeners(addr, count)
                    .map_err(|source| StartError::Bind { addr, source })?;
                ProxyListener::PerCore(listeners)
            }
        };
        let local_addr = proxy_listener
            .local_addr()
            .map_err(|source| StartError::Bind {
                addr: snap.listen,
                source,
            })?;
        let admin = match snap.admin_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let limits = ConnLimits::of(&snap.config.server);
        let max_delayed = snap.config.server.max_delayed;
        // Whether the listener speaks TLS is decided here; its certificates reload.
        let tls_listener = snap.tls.is_some();
        let grace = snap.config.server.shutdown_grace.0;
        let tls_now = snap.tls.clone();
        let snapshot = Arc::new(ArcSwap::from_pointee(snap));
        // The metrics read the store of whatever snapshot is current at scrape time.
        let current = Arc::downgrade(&snapshot);
        let metrics = Metrics::new(Box::new(move || {
            let snap = current.upgrade()?.load_full();
            let store: Arc<dyn StoreStatus> = snap.limiter.store().clone();
            Some(crate::metrics::StoreMetrics {
                cache_hits: snap.limiter.cache().hits(),
                blocks_started: snap.limiter.blocks_started().rows(),
                store,
            })
        }));
        metrics.config_generation.set(1);
        if let Some(tracer) = &snapshot.load().tracer {
            tracer.start(&metrics);
        }
        metrics.set_tls_certs(tls_now.as_deref());
        let _ = metrics
            .reloads
            .get_or_create(&ReloadLabels { result: "ok" });
        let _ = metrics
            .reloads
            .get_or_create(&ReloadLabels { result: "failed" });
        let budget = Budget::new(limits.budget, &metrics);
        tracing::debug!(target: LOG_TARGET,
            max_connections = budget.max_connections(),
            max_connections_per_ip = budget.max_connections_per_ip(),
            descriptors = budget.descriptors(),
            max_tunnels = budget.max_tunnels(),
            "connection budget"
        );
        let reloader = Reloader::new(
            snapshot.clone(),
            clock.clone(),
            metrics.clone(),
            start_store,
        );
        let shared = Arc::new(Shared {
            snapshot,
            clock,
            delayed: metrics.delay_budget(max_delayed),
            metrics,
            budget,
            body_timeout: limits.body_timeout,
        });
        let (shutdown, rx) = watch::channel(false);
        let task = match proxy_listener {
            ProxyListener::One(listener) => {
                let shared = shared.clone();
                let rx = rx.clone();
                tokio::spawn(async move {
                    accept_loop(listener, shared.clone(), rx, limits, grace, tls_listener).await;
                    return_leases(&shared).await;
                })
            }
            ProxyListener::PerCore(listeners) => {
                let count = listeners.len();
                let (worker_shared, worker_rx) = (shared.clone(), rx.clone());
                let workers = runtime::Workers::start(listeners, move |listener| {
                    accept_loop(
                        listener,
                        worker_shared.clone(),
                        worker_rx.clone(),
                        limits,
                        grace,
                        tls_listener,
                    )
                })
                .map_err(StartError::Runtime)?;
                tracing::info!(target: LOG_TARGET,
                    workers = count,
                    "per_core runtime: one listener and runtime per worker"
                );
                let shared = shared.clone();
                tokio::spawn(async move {
                    workers.wait().await;
                    return_leases(&shared).await;
                })
            }
        };
        let mut admin_task = None;
        let admin_addr = admin.map(|(listener, addr)| {
            admin_task = Some(tokio::spawn(admin::serve(
                listener,
                shared.snapshot.clone(),
                shared.metrics.clone(),
                rx.clone(),
                grace,
            )));
            tracing::info!(target: LOG_TARGET, admin_listen = %addr, "admin endpoints listening");
            addr
        });
        tracing::info!(target: LOG_TARGET, listen = %local_addr, tls = tls_listener, "tollgate listening");
        Ok(Gateway {
            local_addr,
            admin_addr,
            shared,
            reloader,
            shutdown,
            task,
            admin_task,
        })
    }

    /// The address the proxy listener is bound to (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The address the admin listener is bound to, when configured.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// The snapshot new requests start with.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.shared.snapshot.load_full()
    }

    /// The gateway's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// A handle that reloads this gateway's config; it can be moved into tasks.
    pub fn reloader(&self) -> Reloader {
        self.reloader.clone()
    }

    /// See [`Reloader::reload`].
    pub fn reload(&self, file: &ConfigFile) -> Result<ReloadOutcome, ConfigReport> {
        self.reloader().reload(file)
    }

    /// See [`Reloader::reload_from`].
    pub fn reload_from(
        &self,
        path: &std::path::Path,
        skip_unchanged: bool,
    ) -> Result<ReloadOutcome, ConfigReport> {
        self.reloader().reload_from(path, skip_unchanged)
    }

    /// Stop accepting connections and let in-flight requests finish (up to
    /// `server.shutdown_grace`). Returns at once; [`Gateway::wait`] waits for the end.
    pub fn shutdown(&self) {
        let _ = self.shutdown.send(true);
    }

    /// Wait until the gateway has stopped (after [`Gateway::shutdown`]): both
    /// listeners closed and their connections drained.
    pub async fn wait(self) {
        let _ = self.task.await;
        if let Some(admin) = self.admin_task {
            let _ = admin.await;
        }
    }
}

/// The proxy listener(s) bound by [`Gateway::start`], before serving starts.
enum ProxyListener {
    /// One listener, served by the caller's (multi-thread) runtime.
    One(TcpListener),
    /// One listener per `per_core` worker (see [`runtime`]).
    PerCore(Vec<std::net::TcpListener>),
}

impl ProxyListener {
    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match self {
            ProxyListener::One(l) => l.local_addr(),
            ProxyListener::PerCore(ls) => ls
                .first()
                .ok_or_else(|| std::io::Error::other("no listener"))?
                .local_addr(),
        }
    }
}

/// Start what a new store needs in the background (its own work, see
/// [`StoreStatus::start`]) and the sweeper that returns idle leases.
fn start_store(snap: &Snapshot, clock: SharedClock) {
    let store = snap.limiter.store();
    crate::limiter::lease::spawn_sweeper(snap.limiter.leases(), store, clock.clone());
    store.start(clock, snap.config.store.sweep_interval.0);
}

/// Once the proxy listener has stopped: in lease mode, give the units this gateway still
/// holds back to the fleet (within 2 s).
async fn return_leases(shared: &Shared) {
    // Lease mode: give the units this gateway still holds back to the fleet.
    let snap = shared.snapshot.load_full();
    let returned = tokio::time::timeout(
        Duration::from_secs(2),
        snap.limiter.return_leases(shared.clock.now_ms()),
    )
    .await;
    if let Ok(units) = returned {
        if units > 0 {
            tracing::info!(target: LOG_TARGET, units, "returned unused leased units");
        }
    }
}
