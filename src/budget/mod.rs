//! The descriptor budget: one count of the file descriptors the proxy holds for its
//! traffic (client connections, upstream sockets, and both ends of every tunnel), bounded
//! by the process's open-file limit less a reserve, so that running out is met with 503
//! answers, never with failing `accept`s that would take the admin listener down too.
//!
//! A [`Descriptor`] is one counted socket. It travels with its socket ([`Counted`]): a
//! client connection that becomes a WebSocket tunnel, or an upstream connection handed
//! to one, keeps its descriptor counted until the socket is closed. Tunnels are also
//! counted on their own, up to `server.max_tunnels` ([`Budget::tunnel`]). Client
//! connections are also counted per client address, up to
//! `server.max_connections_per_ip`, so that one client cannot take every connection, and
//! one client address may hold at most `server.descriptor_share_per_ip` percent of the
//! descriptor budget with its connections and its requests in flight (each HTTP/1.1
//! request or HTTP/2 stream stands for the upstream socket it may hold), so that one
//! client's stalled uploads cannot take every descriptor ([`Budget::share`]). Sockets to
//! the auth service (`[identity.auth_request]`) are counted too ([`Budget::sockets`]).

mod address;
mod counted;
#[cfg(test)]
mod tests;

pub use address::ShareSlot;
pub use counted::{Counted, Descriptor, TunnelSlot};

use crate::metrics::{Metrics, RefusalLabels};
use address::PerAddress;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// File descriptors kept out of the budget for what is not proxied traffic: the
/// listeners, the admin listener's connections, Redis connections, config and
/// certificate files, and connections being refused.
pub const FD_RESERVE: u64 = 64;

/// Connections being answered 503 at once, each holding its socket for a moment; past
/// it, a refused connection is written its answer without waiting and closed.
const MAX_REFUSING: usize = (FD_RESERVE / 2) as usize;

/// What the budget bounds, and the gauges it keeps.
#[derive(Debug)]
pub struct Budget {
    /// Client connections (`server.max_connections`, as lowered to fit the fd limit).
    connections: Arc<Semaphore>,
    max_connections: usize,
    /// Client connections per client address (`server.max_connections_per_ip`), and
    /// what each address holds of the descriptor budget (`server.descriptor_share_per_ip`).
    per_address: Arc<PerAddress>,
    /// Descriptors for client connections and upstream sockets.
    descriptors: Arc<Semaphore>,
    total_descriptors: usize,
    /// Open tunnels (`server.max_tunnels`).
    tunnels: Arc<Semaphore>,
    max_tunnels: usize,
    /// `server.tunnel_idle_timeout` (or `server.idle_timeout`).
    pub tunnel_idle_timeout: Duration,
    /// Connections being refused (see [`MAX_REFUSING`]).
    refusing: Arc<Semaphore>,
    open_connections: Gauge,
    upstream_connections: Gauge,
    auth_connections: Gauge,
    open_tunnels: Gauge,
    refusals: Family<RefusalLabels, Counter>,
}

/// What a [`Budget`] is built from.
#[derive(Debug, Clone, Copy)]
pub struct BudgetLimits {
    /// Client connections at once (already fitted to the fd limit).
    pub max_connections: usize,
    /// Client connections at once from one client address (as keyed by the caller of
    /// [`Budget::client`]).
    pub max_connections_per_ip: usize,
    /// `server.descriptor_share_per_ip`: the percentage (1 to 100) of the descriptors one
    /// client address may hold with its connections and requests in flight.
    pub descriptor_share_per_ip: u8,
    /// Descriptors for client connections and upstream sockets together; `None`: the
    /// open-file limit is unknown or unlimited, so only `max_connections` bounds clients.
    pub descriptors: Option<usize>,
    /// Tunnels open at once.
    pub max_tunnels: usize,
    /// An open tunnel that moves no byte either way for this long is closed.
    pub tunnel_idle_timeout: Duration,
}

/// Why a client connection is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// `server.max_connections` client connections are open.
    MaxConnections,
    /// `server.max_connections_per_ip` client connections from the same address are
    /// open.
    MaxConnectionsPerIp,
    /// The descriptor budget is spent (by client connections and upstream sockets).
    Descriptors,
    /// The client address holds its share of the descriptor budget
    /// (`server.descriptor_share_per_ip`).
    DescriptorShare,
}

impl Refused {
    /// The `limit` label of `tollgate_overload_refusals_total`.
    pub fn label(self) -> &'static str {
        match self {
            Refused::MaxConnections => "max_connections",
            Refused::MaxConnectionsPerIp => "max_connections_per_ip",
            Refused::Descriptors => "descriptors",
            Refused::DescriptorShare => "descriptor_share_per_ip",
        }
    }
}

impl Budget {
    /// A budget of `limits`, keeping `metrics`' gauges.
    pub fn new(limits: BudgetLimits, metrics: &Metrics) -> Arc<Self> {
        let max = Semaphore::MAX_PERMITS;
        let descriptors = limits.descriptors.unwrap_or(max).clamp(1, max);
        let percent = usize::from(limits.descriptor_share_per_ip.clamp(1, 100));
        let share = if percent == 100 {
            // No share: the budget itself answers (503).
            usize::MAX
        } else {
            // At least a connection and its request.
            (descriptors / 100 * percent + descriptors % 100 * percent / 100).max(2)
        };
        Arc::new(Self {
            connections: Arc::new(Semaphore::new(limits.max_connections.clamp(1, max))),
            max_connections: limits.max_connections,
            per_address: Arc::new(PerAddress::new(limits.max_connections_per_ip.max(1), share)),
            descriptors: Arc::new(Semaphore::new(descriptors)),
            total_descriptors: descriptors,
            tunnels: Arc::new(Semaphore::new(limits.max_tunnels.min(max))),
            max_tunnels: limits.max_tunnels,
            tunnel_idle_timeout: limits.tunnel_idle_timeout,
            refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
            open_connections: metrics.open_connections.clone(),
            upstream_connections: metrics.upstream_connections.clone(),
            auth_connections: metrics.auth_connections.clone(),
            open_tunnels: metrics.open_tunnels.clone(),
            refusals: metrics.overload_refusals.clone(),
        })
    }

    /// `server.max_connections` as applied (connections).
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// `server.max_connections_per_ip` (connections from one client address).
    pub fn max_connections_per_ip(&self) -> usize {
        self.per_address.max
    }

    /// The descriptors one client address may hold with its connections and requests in
    /// flight (`server.descriptor_share_per_ip` of [`Budget::descriptors`]).
    pub fn descriptor_share_per_ip(&self) -> usize {
        self.per_address.share
    }

    /// The descriptors client connections and upstream sockets may hold together.
    pub fn descriptors(&self) -> usize {
        self.total_descriptors
    }

    /// `server.max_tunnels` (tunnels).
    pub fn max_tunnels(&self) -> usize {
        self.max_tunnels
    }

    fn refused(&self, limit: &'static str) {
        self.refusals.get_or_create(&RefusalLabels { limit }).inc();
    }

    /// A descriptor for a client connection just accepted from `address` (the key of its
    /// client address, see [`crate::identity::Identities::ip_key`]; `None`: not counted
    /// per address, e.g. a trusted proxy): one of `server.max_connections_per_ip` for
    /// that address, one of its share of the descriptor budget
    /// (`server.descriptor_share_per_ip`), one of `server.max_connections` and one of
    /// the descriptor budget. Counted in `tollgate_open_connections` until dropped.
    ///
    /// Errors: [`Refused`] when any is spent (the connection gets 503).
    pub fn client(&self, address: Option<IpAddr>) -> Result<Descriptor, Refused> {
        let refuse = |why: Refused| {
            self.refused(why.label());
            why
        };
        // `max_connections` first: an address that holds every connection the listener
        // takes is told so, not that it holds its share.
        let connection = self
            .connections
            .clone()
            .try_acquire_owned()
            .map_err(|_| refuse(Refused::MaxConnections))?;
        let per_address = match address {
            Some(address) => Some(self.per_address.take(address, true).map_err(refuse)?),
            None => None,
        };
        let fd = self
            .descriptors
            .clone()
            .try_acquire_owned()
            .map_err(|_| refuse(Refused::Descriptors))?;
        Ok(Descriptor::new(
            fd,
            Some(connection),
            per_address,
            &self.open_connections,
        ))
    }

    /// A descriptor for a new upstream socket, counted in
    /// `tollgate_upstream_connections` until dropped; `None` when the budget is spent
    /// (the request gets 503).
    pub fn upstream(&self) -> Option<Descriptor> {
        let Ok(fd) = self.descriptors.clone().try_acquire_owned() else {
            self.refused("descriptors");
            return None;
        };
        Some(Descriptor::new(fd, None, None, &self.upstream_connections))
    }

    /// A place for one request (an HTTP/1.1 request or an HTTP/2 stream) from the client
    /// address `address` (as keyed for [`Budget::client`]) among its share of the
    /// descriptor budget (`server.descriptor_share_per_ip`), which its connections hold
    /// too: the request stands for the upstream socket it may hold until its response
    /// ends. Held until dropped; `None` when the address holds its share (the request
    /// gets 429), counted in `tollgate_overload_refusals_total{limit="descriptor_share_per_ip"}`.
    pub fn share(&self, address: IpAddr) -> Option<ShareSlot> {
        match self.per_address.take(address, false) {
            Ok(slot) => Some(ShareSlot::new(slot)),
            Err(why) => {
                self.refused(why.label());
                None
            }
        }
    }

    /// The descriptor budget as a handle of its own (owned, for a connector that lives
    /// outside the request path) for sockets to `[identity.auth_request]`'s service,
    /// counted in `tollgate_auth_request_connections`.
    pub fn sockets(&self) -> Sockets {
        Sockets {
            descriptors: self.descriptors.clone(),
            gauge: self.auth_connections.clone(),
            refusals: self.refusals.clone(),
        }
    }

    /// A place for one more tunnel (taken before the upgrade is forwarded); `None` when
    /// `server.max_tunnels` are open (the upgrade gets 503).
    pub fn tunnel(&self) -> Option<TunnelSlot> {
        let Ok(permit) = self.tunnels.clone().try_acquire_owned() else {
            self.refused("max_tunnels");
            return None;
        };
        Some(TunnelSlot::new(permit, &self.open_tunnels))
    }

    /// Whether a refused connection may be answered in a task of its own (at most
    /// [`MAX_REFUSING`] at once, so that refusals never eat the reserve); the permit is
    /// held until its answer is written.
    pub(crate) fn refusing(&self) -> Option<OwnedSemaphorePermit> {
        self.refusing.clone().try_acquire_owned().ok()
    }
}

/// An owned handle on the descriptor budget for sockets counted under a gauge of their
/// own (see [`Budget::sockets`]).
#[derive(Debug, Clone)]
pub struct Sockets {
    descriptors: Arc<Semaphore>,
    gauge: Gauge,
    refusals: Family<RefusalLabels, Counter>,
}

impl Sockets {
    /// A descriptor for one new socket, counted in the gauge until dropped; `None` when
    /// the budget is spent (counted in
    /// `tollgate_overload_refusals_total{limit="descriptors"}`).
    pub fn take(&self) -> Option<Descriptor> {
        let Ok(fd) = self.descriptors.clone().try_acquire_owned() else {
            self.refusals
                .get_or_create(&RefusalLabels {
                    limit: "descriptors",
                })
                .inc();
            return None;
        };
        Some(Descriptor::new(fd, None, None, &self.gauge))
    }
}
