//! What the forward phase tells the forwarder about the downstream side of a request:
//! the client connection, the edge's settled `Host`, the route's body bound, the
//! budgets and deadlines ([`Downstream`]). Read by [`super::forward`] and
//! [`super::rewrite`].

use super::peer::Peer;
use crate::http::upgrade::Upgrade;
use http::HeaderValue;
use std::net::IpAddr;
use std::time::Duration;

/// What the forwarder needs to know about the downstream connection.
#[derive(Debug, Clone)]
pub struct Downstream<'a> {
    /// The socket peer: its IP, rendered once per connection.
    pub peer: &'a Peer,
    /// Whether the peer is a trusted proxy (its X-Forwarded-Proto/-Host are kept).
    pub peer_trusted: bool,
    /// `"http"`, or `"https"` on a TLS listener (`X-Forwarded-Proto`).
    pub scheme: &'static str,
    /// The request id, named in the log line of an upstream failure.
    pub request_id: HeaderValue,
    /// The request's `Host` as the edge settled it ([`crate::http::authority::settle`]:
    /// an absolute-form target's or HTTP/2's `:authority` has become it), passed on as
    /// `X-Forwarded-Host`; `None` when the request has none (HTTP/1.0 without `Host`).
    pub host: Option<HeaderValue>,
    /// The route's `max_request_bytes`: the request body is cut off past it (413).
    pub max_request_bytes: Option<u64>,
    /// The client IP the limiter used (`X-Real-IP`).
    pub client_ip: IpAddr,
    /// The upgrade the edge let through for this route ([`crate::http::upgrade::decide`]);
    /// `None`: a plain request, whatever `Upgrade` it carried.
    pub upgrade: Option<Upgrade>,
    /// `server.body_timeout`: a request body that stops arriving for this long ends the
    /// request (408).
    pub body_timeout: Duration,
    /// Where new upstream sockets and tunnels are counted (503 when spent).
    pub budget: &'a crate::budget::Budget,
    /// `server.via`: the `Via` entries added both ways; `None` adds none.
    pub via: Option<&'a crate::http::via::Via>,
    /// Where an HTTP/1.1 client's 1xx responses go (see `wire::interim`); an HTTP/2
    /// stream's handle is in the request's extensions instead.
    pub informational: Option<&'a crate::wire::Informational>,
    /// When the request was handed to the upstream: `upstreams.response_timeout` counts
    /// from here, over every attempt.
    pub started: std::time::Instant,
    /// Where the attempts are noted for the request's trace (`[tracing]`); `None` when
    /// it is not recorded.
    pub attempts: Option<&'a crate::otel::span::Attempts>,
}
