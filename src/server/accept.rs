//! The accept loop of one proxy listener: each connection accepted is counted against
//! the connection limits and the descriptor budget (refused with 503 past them), then
//! served in a task of its own ([`super::connection`]); at shutdown the loop stops
//! accepting and waits (up to `server.shutdown_grace`) for its connections to end.

use super::connection::Connection;
use super::limits;
use super::shared::{Shared, LOG_TARGET};
use crate::budget::{Budget, BudgetLimits, Counted, Refused};
use crate::wire::{alpn, h2server};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

/// The `[server]` settings that bound client connections (read at start).
#[derive(Debug, Clone, Copy)]
pub(super) struct ConnLimits {
    pub(super) header_read_timeout: Duration,
    pub(super) idle_timeout: Duration,
    pub(super) send_timeout: Duration,
    pub(super) max_header_bytes: usize,
    pub(super) http2_max_streams: u32,
    pub(super) body_timeout: Duration,
    pub(super) budget: BudgetLimits,
}

impl ConnLimits {
    pub(super) fn of(cfg: &crate::config::ServerConfig) -> Self {
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

/// Accept connections on `listener` and serve each in a task of its own until
/// `shutdown`; then wait for them to end, at most `grace`. `tls_listener`: whether its
/// connections start with a TLS handshake.
pub(super) async fn accept_loop(
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
    let http2 = h2server::Settings {
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
                            tracing::warn!(target: LOG_TARGET, error = %e, suppressed, "accept failed; backing off");
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
                                Refused::MaxConnections => tracing::warn!(target: LOG_TARGET, %peer, max_connections = shared.budget.max_connections(), suppressed, "connection refused: server.max_connections open"),
                                Refused::MaxConnectionsPerIp => tracing::warn!(target: LOG_TARGET, %peer, max_connections_per_ip = shared.budget.max_connections_per_ip(), suppressed, "connection refused: server.max_connections_per_ip open from this client address"),
                                Refused::Descriptors => tracing::warn!(target: LOG_TARGET, %peer, descriptors = shared.budget.descriptors(), suppressed, "connection refused: the descriptor budget (open-file limit) is spent by client connections and upstream sockets"),
                                Refused::DescriptorShare => tracing::warn!(target: LOG_TARGET, %peer, descriptor_share_per_ip = shared.budget.descriptor_share_per_ip(), suppressed, "connection refused: this client address holds its share of the descriptor budget (server.descriptor_share_per_ip)"),
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
                tokio::spawn(conn.run(stream, tls));
            }
            _ = shutdown.changed() => break,
        }
    }

    drop(listener);
    drop(drained_tx);
    tracing::info!(target: LOG_TARGET, grace = ?grace, "shutting down: no new connections, draining in-flight requests");
    tokio::select! {
        _ = drained.recv() => tracing::info!(target: LOG_TARGET, "all connections drained"),
        _ = tokio::time::sleep(grace) => tracing::warn!(target: LOG_TARGET, "shutdown_grace elapsed; closing remaining connections"),
    }
}
