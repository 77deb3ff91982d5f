//! The client end of a downstream connection, as the request path sees it.

use http::HeaderValue;
use std::net::IpAddr;

/// The client end of a downstream connection, with what the forwarder adds for it
/// rendered once per connection rather than once per request.
#[derive(Debug)]
pub struct Peer {
    /// The socket address.
    pub addr: std::net::SocketAddr,
    /// The IP as a header value (`X-Forwarded-For` when the client sent none).
    pub(super) ip_header: HeaderValue,
    /// The upstream connection this client connection used last, kept for its next
    /// request ([`super::pool::Affinity`]).
    pub upstream: super::pool::Affinity,
    /// The timer of `upstreams.response_timeout` for this connection's HTTP/1 requests
    /// ([`super::deadline`]).
    pub response_timer: super::deadline::ConnectionTimer,
    /// The key of this address's share of the descriptor budget
    /// (`server.descriptor_share_per_ip`); `None`: not counted (a peer in
    /// `identity.trusted_proxies`). See [`super::Context::address`].
    pub share: Option<IpAddr>,
}

impl Peer {
    /// The IP as text, rendered once per connection (what `IpAddr`'s `Display` writes).
    pub fn ip_text(&self) -> &str {
        self.ip_header.to_str().unwrap_or_default()
    }

    /// Describe the peer at `addr`, whose requests take `share`'s place in the
    /// descriptor budget ([`Peer::share`]).
    pub fn new(addr: std::net::SocketAddr, share: Option<IpAddr>) -> Self {
        let ip_header = HeaderValue::from_str(&addr.ip().to_string())
            .unwrap_or(HeaderValue::from_static("unknown"));
        Self {
            addr,
            ip_header,
            upstream: Default::default(),
            response_timer: Default::default(),
            share,
        }
    }

    /// The peer's IP.
    pub fn ip(&self) -> IpAddr {
        self.addr.ip()
    }
}
