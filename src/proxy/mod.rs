//! The request path, in order:
//!
//! 1. **identify** the caller ([`crate::identity`]): API key → client and tier; no key →
//!    client IP; unknown key → 401.
//! 2. **route** by host and longest path prefix ([`route`]) → upstream and limits; none → 404.
//! 3. **check** every limit ([`crate::limiter::Limiter::check`]): over a limit → 429 whose
//!    headers come from that same read; store failing → `store.on_error`.
//! 4. **forward** to the upstream ([`forward`]), streaming both bodies; 502 / 504.
//! 5. **charge** every limit once the response status is known, unless it is uncharged.
//! 6. **headers**: `X-RateLimit-*` of the most constrained limit ([`headers`]).
//!
//! [`handle`] is that list as code.

pub mod error;
pub mod forward;
pub mod headers;
pub mod route;

use crate::clock::Clock;
use crate::limiter::{most_constrained, Refusal};
use crate::snapshot::Snapshot;
use bytes::Bytes;
use error::ProxyError;
use forward::Downstream;
use http::{header, Request, Response};
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use std::net::SocketAddr;

/// The body of every response the gateway sends: streamed from the upstream, or JSON.
pub type Body = BoxBody<Bytes, hyper::Error>;

/// Serve one request on the snapshot it started with.
pub async fn handle(
    snap: &Snapshot,
    clock: &dyn Clock,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    // 1. Identify the caller.
    let caller = match snap.identities.identify(req.headers(), peer.ip()) {
        Ok(caller) => caller,
        Err(_) => return ProxyError::BadCredentials.into_response(),
    };

    // 2. Route by host and longest path prefix.
    let host = request_host(&req);
    let Some(route) = snap.router.find(host.as_deref(), req.uri().path()) else {
        return ProxyError::NoRoute.into_response();
    };

    // 3. Check every limit of the route (a read; may be stale, never written).
    let applied = snap
        .limiter
        .applicable(&route.limits, &caller, req.headers());
    let checked = match snap
        .limiter
        .check(&applied, route.cost, clock.now_ms())
        .await
    {
        Ok(usages) => usages,
        Err(Refusal::OverLimit(usage)) => {
            let retry_after_s = usage.retry_after_s(clock.now_ms());
            return ProxyError::OverLimit {
                usage,
                retry_after_s,
                caller: caller.label(),
            }
            .into_response();
        }
        Err(Refusal::StoreDenied(_)) => return ProxyError::StoreUnavailable.into_response(),
    };

    // 4. Forward upstream, streaming both bodies.
    let down = Downstream {
        peer: peer.ip(),
        peer_trusted: snap.identities.trusts(peer.ip()),
        scheme: "http",
    };
    let mut response = match forward::forward(&route.upstream, req, down).await {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(upstream = %route.upstream.name, error = ?e, "upstream failed");
            let mut response = e.into_response();
            if let Some(usage) = most_constrained(&checked) {
                headers::put_usage(response.headers_mut(), usage);
            }
            return response;
        }
    };

    // 5. Charge, unless the status is uncharged (then the check's numbers stand).
    let usages = if route.charges(response.status()) {
        snap.limiter
            .charge(&applied, route.cost, clock.now_ms(), checked)
            .await
    } else {
        checked
    };

    // 6. Headers of the limit with the fewest remaining units.
    if let Some(usage) = most_constrained(&usages) {
        headers::put_usage(response.headers_mut(), usage);
    }
    response
}

/// The host a request is for: the `Host` header, or the URI authority (HTTP/2).
fn request_host(req: &Request<Incoming>) -> Option<String> {
    req.headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()))
}
