//! The listener: accept loop, HTTP/1.1 (hyper) and cleartext HTTP/2 (the h2 crate,
//! `h2`) on one port (or, with `[server.tls]`, TLS with ALPN `h2` / `http/1.1`, the
//! handshake inside each connection's task), graceful shutdown, and the running
//! [`Gateway`] that tests and `main` drive.

mod alpn;
mod guards;
mod h2;
mod limits;
mod linger;
mod minor_version;
pub mod runtime;

use crate::admin;
use crate::budget::{Budget, BudgetLimits, Counted, Refused};
use crate::clock::SharedClock;
use crate::config::{ConfigFile, ConfigReport, RuntimeShape};
use crate::limiter::store::StoreStatus;
use crate::metrics::{Metrics, ReloadLabels};
use crate::proxy;
pub use crate::reload::{ReloadOutcome, Reloader};
use crate::snapshot::Snapshot;
use arc_swap::ArcSwap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
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

/// State shared by every connection: the current snapshot, the clock, the metrics, the
/// descriptor budget and the request-body timeout.
#[derive(Debug)]
struct Shared {
    snapshot: Arc<ArcSwap<Snapshot>>,
    clock: SharedClock,
    metrics: Arc<Metrics>,
    /// `server.max_delayed` (read at start).
    delayed: crate::limiter::delayed::DelayBudget,
    budget: Arc<Budget>,
    /// `server.body_timeout` (read at start).
    body_timeout: Duration,
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
    /// Build the snapshot of `file`, start its store, bind `server.listen` (and
    /// `server.admin_listen`) and serve.
    ///
    /// Errors: [`StartError::Config`] for an invalid file, [`StartError::Bind`] when a
    /// listener cannot be bound.
    pub async fn start(file: &ConfigFile, clock: SharedClock) -> Result<Gateway, StartError> {
        let mut snap = Snapshot::build(file, None)?;
        snap.generation = 1;
        for w in &snap.warnings {
            tracing::warn!("{w}");
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
            Some((snap.limiter.cache().hits(), store))
        }));
        metrics.config_generation.set(1);
        metrics.set_tls_certs(tls_now.as_deref());
        let _ = metrics
            .reloads
            .get_or_create(&ReloadLabels { result: "ok" });
        let _ = metrics
            .reloads
            .get_or_create(&ReloadLabels { result: "failed" });
        let budget = Budget::new(limits.budget, &metrics);
        tracing::debug!(
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
                tracing::info!(
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
            tracing::info!(admin_listen = %addr, "admin endpoints listening");
            addr
        });
        tracing::info!(listen = %local_addr, tls = tls_listener, "tollgate listening");
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

/// One accepted connection, ready to serve HTTP once its transport (plain TCP, or TLS
/// after the handshake) is ready.
struct Connection {
    builders: Arc<alpn::Builders>,
    shutdown: watch::Receiver<bool>,
    idle_timeout: Duration,
    send_timeout: Duration,
    header_read_timeout: Duration,
    shared: Arc<Shared>,
    peer: SocketAddr,
    /// The key of the peer's address whose share of the descriptor budget each request
    /// takes (`server.descriptor_share_per_ip`); `None` for a trusted proxy.
    address: Option<std::net::IpAddr>,
    /// Held until the connection ends: the accept loop waits for every one at shutdown.
    /// (`server.max_connections`, `server.max_connections_per_ip` and the descriptor
    /// budget count the socket itself, a
    /// [`Counted`] one, for as long as it is open: in a tunnel too.)
    _held: mpsc::Sender<()>,
}

/// The `[server]` settings that bound client connections (read at start).
#[derive(Debug, Clone, Copy)]
struct ConnLimits {
    header_read_timeout: Duration,
    idle_timeout: Duration,
    send_timeout: Duration,
    max_header_bytes: usize,
    http2_max_streams: u32,
    body_timeout: Duration,
    budget: BudgetLimits,
}

impl ConnLimits {
    fn of(cfg: &crate::config::ServerConfig) -> Self {
        Self {
            header_read_timeout: cfg.header_read_timeout.0,
            idle_timeout: cfg.idle_timeout.0,
            send_timeout: cfg.send_timeout.0,
            max_header_bytes: cfg.max_header_bytes,
            http2_max_streams: cfg.http2_max_streams,
            body_timeout: cfg.body_timeout.0,
            budget: BudgetLimits {
                max_connections: limits::effective_max_connections(cfg.max_connections),
                max_connections_per_ip: cfg.max_connections_per_ip,
                descriptor_share_per_ip: cfg.descriptor_share_per_ip,
                descriptors: limits::descriptor_budget(),
                max_tunnels: cfg.max_tunnels,
                tunnel_idle_timeout: cfg.tunnel_idle_timeout.unwrap_or(cfg.idle_timeout).0,
            },
        }
    }
}

impl Connection {
    /// Serve HTTP/1.1 or HTTP/2 on `io` until the connection ends (only the protocol
    /// `alpn` names, when the TLS handshake negotiated one); `tls` (what the handshake
    /// told) goes into every request's extensions. `io`'s reads tell `activity`
    /// ([`limits::Reads`]).
    async fn serve<T>(
        self,
        io: T,
        tls: Option<crate::tls::TlsInfo>,
        alpn: Option<Vec<u8>>,
        activity: Arc<limits::Activity>,
    ) where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let io = match alpn.as_deref() {
            Some(b"h2") => limits::Reads::http2(io, activity.clone()),
            _ => limits::Reads::new(io, activity.clone()),
        };
        // 1xx responses reach HTTP/1.1 clients through the socket itself (hyper's server
        // cannot send them; HTTP/2 ones get theirs on their stream): see
        // `proxy::interim`.
        let io = proxy::interim::Interim::new(io);
        let informational = io.handle();
        let Connection {
            builders,
            mut shutdown,
            idle_timeout,
            send_timeout,
            header_read_timeout,
            shared,
            peer,
            address,
            _held,
        } = self;
        let conn_peer = Arc::new(proxy::forward::Peer::new(peer));
        let conn_activity = activity.clone();
        let handler = move |mut req: http::Request<crate::http::incoming::Incoming>| {
            let shared = shared.clone();
            let peer = conn_peer.clone();
            if let Some(info) = &tls {
                req.extensions_mut().insert(info.clone());
            }
            // Where 1xx responses go: an HTTP/1.1 request's, through this connection's
            // socket (passed along, not in the request's extensions: a first extension
            // allocates a map per request); HTTP/2 streams come with their own in the
            // extensions (see `h2`).
            let informational =
                (req.version() == http::Version::HTTP_11).then(|| informational.clone());
            // Busy until the response body ends (the guard travels with it).
            let busy = conn_activity.request();
            // Boxed: hyper's dispatcher holds the service's future and moves it whole
            // when it takes it; boxed, it moves a pointer (the request path's future is
            // several KB). Written into the allocation (`Box::write`) rather than built
            // and then moved there (`Box::pin`), which copies all of it once more. One box
            // per request, in place, instead of a `Box::pin` each for `proxy::serve`'s and
            // `proxy::forward`'s futures: 818 instructions fewer per proxied request and
            // 443 per 429 (issue 16, callgrind).
            Box::into_pin(Box::write(Box::new_uninit(), async move {
                let snap = shared.snapshot.load_full();
                let ctx = proxy::Context {
                    clock: &shared.clock,
                    metrics: &shared.metrics,
                    delayed: &shared.delayed,
                    budget: &shared.budget,
                    address,
                    body_timeout: shared.body_timeout,
                    informational: informational.as_ref(),
                };
                let (response, finished) = proxy::handle(&snap.gate(), &ctx, req, &peer).await;
                // Watch the response body's progress for `server.send_timeout`; the
                // request's access line and in-flight count end with the body.
                Ok::<_, Infallible>(
                    response.map(|body| limits::SendWatch::new(body, finished, busy)),
                )
            }))
        };
        let conn = builders.serve(alpn.as_deref(), io, handler);
        tokio::pin!(conn);
        // Close gracefully (a response under way finishes first) at shutdown, or once
        // no request has been handled for `idle_timeout`; drop it when an HTTP/1 request
        // head has taken `header_read_timeout`, or the client has stopped reading a
        // response for `send_timeout`. One timer, re-armed when it fires: requests set
        // none.
        let mut closing = *shutdown.borrow();
        if closing {
            conn.graceful_shutdown();
        }
        let idle_check =
            tokio::time::sleep(idle_timeout.min(send_timeout).min(header_read_timeout));
        tokio::pin!(idle_check);
        let second = Duration::from_secs(1);
        // The guards (shutdown, the timer) are polled only when they woke the task, not
        // on each of a request's wakes (see `guards`).
        let guards = guards::Guards::new();
        let changed = shutdown.changed();
        tokio::pin!(changed);
        loop {
            let fired = std::future::poll_fn(|cx| {
                guards.poll(
                    cx,
                    |cx| conn.as_mut().poll(cx).map(Fired::Ended),
                    |cx| {
                        if !closing && changed.as_mut().poll(cx).is_ready() {
                            return Poll::Ready(Fired::Shutdown);
                        }
                        idle_check.as_mut().poll(cx).map(|()| Fired::Check)
                    },
                )
            })
            .await;
            guards.rearm();
            match fired {
                Fired::Ended(ended) => {
                    if let Err(e) = ended {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                Fired::Shutdown => {
                    closing = true;
                    conn.graceful_shutdown();
                }
                Fired::Check => {
                    let head_for = activity.head_for();
                    if head_for >= header_read_timeout {
                        tracing::debug!(%peer, ?head_for, "request head incomplete; connection closed (server.header_read_timeout)");
                        return;
                    }
                    let stalled_for = activity.stalled_for();
                    if stalled_for >= send_timeout {
                        // A response waits for a client that stopped reading (a graceful
                        // close would wait for it too): drop the connection.
                        tracing::debug!(%peer, ?stalled_for, "client stopped reading; connection closed (server.send_timeout)");
                        return;
                    }
                    let idle_for = activity.idle_for();
                    if closing && idle_for > Duration::ZERO {
                        // Shut down gracefully, yet a client still holds the connection
                        // with nothing in flight (e.g. it never answers HTTP/2's closing
                        // PING): close it.
                        return;
                    }
                    let mut next = if !closing && idle_for >= idle_timeout {
                        tracing::debug!(%peer, ?idle_for, "idle connection closed");
                        closing = true;
                        conn.graceful_shutdown();
                        second
                    } else if closing {
                        second
                    } else {
                        idle_timeout - idle_for
                    };
                    if stalled_for > Duration::ZERO {
                        next = next.min(send_timeout - stalled_for);
                    } else {
                        next = next.min(send_timeout);
                    }
                    // A head begun since this check is found by the next one, at most
                    // `header_read_timeout` away, which then waits for what it has left.
                    next = next.min(header_read_timeout - head_for);
                    let next = next.max(Duration::from_millis(10));
                    idle_check
                        .as_mut()
                        .reset(tokio::time::Instant::now() + next);
                }
            }
        }
    }
}

/// What ended a wait of a connection's task: the connection (its result), the shutdown
/// signal, or the connection's timer (idle, header read, send: see `Connection::serve`).
enum Fired<R> {
    Ended(R),
    Shutdown,
    Check,
}

/// The answer to a connection past `server.max_connections`,
/// `server.max_connections_per_ip` or the descriptor budget.
const REFUSAL: &str = concat!(
    "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n",
    "content-length: 34\r\nconnection: close\r\nretry-after: 1\r\n\r\n",
    r#"{"message":"too many connections"}"#
);

/// Answer a connection past `server.max_connections` (`server.max_connections_per_ip`,
/// or the descriptor budget) with
/// 503 and close it: in a task of its own while few are being refused, else at once
/// (what fits the fresh socket's send buffer, which the answer always does) so that
/// refused sockets never pile up. On a TLS listener it is closed without a byte: a
/// plaintext 503 would reach the client where it expects a TLS record (a "corrupt
/// message", not an answer), and a handshake to answer in TLS would spend what the
/// limit protects.
fn refuse(stream: tokio::net::TcpStream, budget: &Budget, tls_listener: bool) {
    use tokio::io::AsyncWriteExt;
    if tls_listener {
        drop(stream);
        return;
    }
    let Some(refusing) = budget.refusing() else {
        let _ = stream.try_write(REFUSAL.as_bytes());
        return;
    };
    tokio::spawn(async move {
        let mut stream = stream;
        let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(REFUSAL.as_bytes()))
            .await;
        let _ = stream.shutdown().await;
        drop(refusing);
    });
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
    limits: ConnLimits,
    grace: Duration,
    tls_listener: bool,
) {
    // A head past max_header_bytes gets 431 (hyper's buffer holds at least 8 KiB).
    let max_buf = limits.max_header_bytes.max(8192);
    let mut http1 = hyper::server::conn::http1::Builder::new();
    // `server.header_read_timeout` is the connection's own deadline (see
    // `Connection::serve`), not a hyper timer re-armed for every request.
    http1.header_read_timeout(None).max_buf_size(max_buf);
    let http2 = h2::Settings {
        max_streams: limits.http2_max_streams,
        max_header_list: limits.max_header_bytes.min(u32::MAX as usize) as u32,
        // A peer that stops answering PINGs is dropped.
        keep_alive: Duration::from_secs(20),
    };
    let builders = Arc::new(alpn::Builders::new(http1, http2));
    // Every connection holds a sender: when all are dropped, every connection ended.
    let (drained_tx, mut drained) = mpsc::channel::<()>(1);
    let refused_log = crate::logging::Throttle::new();
    let accept_log = crate::logging::Throttle::new();
    // On a per_core worker: its count of accepted connections.
    let accepted_here = crate::worker::current().map(|(worker, _)| {
        shared
            .metrics
            .worker_connections
            .get_or_create(&crate::metrics::WorkerLabels {
                worker: worker as u32,
            })
            .clone()
    });

    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // e.g. EMFILE: back off instead of spinning, and say so at most
                        // once a second.
                        if let Some(suppressed) = accept_log.due(1_000) {
                            tracing::warn!(error = %e, suppressed, "accept failed; backing off");
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                if let Some(accepted) = &accepted_here {
                    accepted.inc();
                }
                // Counted per client address: an IPv6 peer by its network
                // (identity.ipv6_prefix_len); a trusted proxy, which carries many
                // clients, not at all.
                let address = {
                    let snap = shared.snapshot.load();
                    let ip = peer.ip();
                    (!snap.identities.trusts(ip)).then(|| snap.identities.ip_key(ip))
                };
                let descriptor = match shared.budget.client(address) {
                    Ok(descriptor) => descriptor,
                    Err(why) => {
                        if let Some(suppressed) = refused_log.due(1_000) {
                            match why {
                                Refused::MaxConnections => tracing::warn!(%peer, max_connections = shared.budget.max_connections(), suppressed, "connection refused: server.max_connections open"),
                                Refused::MaxConnectionsPerIp => tracing::warn!(%peer, max_connections_per_ip = shared.budget.max_connections_per_ip(), suppressed, "connection refused: server.max_connections_per_ip open from this client address"),
                                Refused::Descriptors => tracing::warn!(%peer, descriptors = shared.budget.descriptors(), suppressed, "connection refused: the descriptor budget (open-file limit) is spent by client connections and upstream sockets"),
                                Refused::DescriptorShare => tracing::warn!(%peer, descriptor_share_per_ip = shared.budget.descriptor_share_per_ip(), suppressed, "connection refused: this client address holds its share of the descriptor budget (server.descriptor_share_per_ip)"),
                            }
                        }
                        refuse(stream, &shared.budget, tls_listener);
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let stream = Counted::new(stream, descriptor);
                // New handshakes use the certificates of the snapshot current now.
                let tls = if tls_listener { shared.snapshot.load().tls.clone() } else { None };
                let conn = Connection {
                    builders: builders.clone(), // an Arc
                    shutdown: shutdown.clone(),
                    idle_timeout: limits.idle_timeout,
                    send_timeout: limits.send_timeout,
                    header_read_timeout: limits.header_read_timeout,
                    shared: shared.clone(),
                    peer,
                    address,
                    _held: drained_tx.clone(),
                };
                tokio::spawn(async move {
                    let activity = limits::Activity::new();
                    match tls {
                        None => conn.serve(stream, None, None, activity).await,
                        Some(tls) => {
                            let handshake = tls.acceptor().accept(stream);
                            match tokio::time::timeout(tls.handshake_timeout, handshake).await {
                                Ok(Ok(stream)) => {
                                    let session = stream.get_ref().1;
                                    let info = tls.info(session);
                                    let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
                                    if alpn.as_deref() == Some(b"h2") {
                                        // Only HTTP/2: an invalid preface gets GOAWAY.
                                        let timeout = limits.header_read_timeout;
                                        if let Some(stream) = alpn::h2_preface(stream, timeout).await {
                                            conn.serve(stream, Some(info), alpn, activity).await;
                                        }
                                    } else {
                                        conn.serve(stream, Some(info), alpn, activity).await;
                                    }
                                }
                                Ok(Err(e)) => {
                                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                }
                                Err(_) => tracing::debug!(
                                    %peer,
                                    timeout = ?tls.handshake_timeout,
                                    "TLS handshake timed out; connection closed"
                                ),
                            }
                        }
                    }
                });
            }
            _ = shutdown.changed() => break,
        }
    }

    drop(listener);
    drop(drained_tx);
    tracing::info!(grace = ?grace, "shutting down: no new connections, draining in-flight requests");
    tokio::select! {
        _ = drained.recv() => tracing::info!("all connections drained"),
        _ = tokio::time::sleep(grace) => tracing::warn!("shutdown_grace elapsed; closing remaining connections"),
    }
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
            tracing::info!(units, "returned unused leased units");
        }
    }
}
