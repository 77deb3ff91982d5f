//! Phase 3, route: the rate-limit endpoint (the caller's own limits), then the route by
//! host and longest path prefix ([`crate::proxy::route`]), on the path and method the
//! upstream will execute; and what the route allows to cross (upgrades, body size,
//! `Max-Forwards`).

use super::Answer;
use crate::http::target::{self, Override};
use crate::http::upgrade::Upgrade;
use crate::identity::Caller;
use crate::limiter::{most_constrained, Applied, Usage};
use crate::proxy::access::{AccessLog, Decision};
use crate::proxy::error::ProxyError;
use crate::proxy::route::{Route, Router};
use crate::proxy::{path, Context, Gate};
use crate::wire::Incoming;
use http::{header, Request, Response};
use std::sync::Arc;

/// A routed request: its route and the upgrade the route lets through.
#[derive(Debug)]
pub struct Routed<'s> {
    /// The route the request takes (its upstream, limits, cost).
    pub route: &'s Arc<Route>,
    /// The upgrade the edge let through for this route ([`crate::http::upgrade::decide`]);
    /// `None`: a plain request, whatever `Upgrade` it carried.
    pub upgrade: Option<Upgrade>,
}

/// Whether `req` asks for the caller's own limits (`GET` on `rate_limit_endpoint.path`):
/// then [`own_limits`] answers it, never forwarded nor charged.
#[inline]
pub fn asks_own_limits(snap: &Gate<'_>, req: &Request<Incoming>) -> bool {
    req.method() == http::Method::GET && snap.rate_limit_path == Some(req.uri().path())
}

/// The answer of the rate-limit endpoint for `caller` (logged `rate_limit_status`, in
/// `log` from the start: a client that goes away while the store is read is logged so
/// too): what every limit that applies to it reads now ([`rate_limit_status`]).
pub async fn own_limits(
    snap: &Gate<'_>,
    ctx: &Context<'_>,
    req: &Request<Incoming>,
    caller: &Caller,
    log: &mut AccessLog,
) -> Answer {
    log.decision = Decision::RateLimitStatus;
    let applied = snap.limiter.applicable(snap.limits, caller, req.headers());
    let now_ms = ctx.clock.now_ms();
    let usages = Box::pin(snap.limiter.peek(&applied, now_ms)).await;
    Answer::new(
        rate_limit_status(&applied, &usages),
        Decision::RateLimitStatus,
    )
}

/// Route `req` (to `host`, the name the edge settled), noting the route in `log`. The
/// method and URL override headers count where the route they select trusts them
/// (`trust_method_override`); elsewhere they are stripped.
///
/// Errors: 404 when no route matches (`no_route`); the gateway's own answer to an
/// `OPTIONS` or `TRACE` with `Max-Forwards: 0` (`last_hop`); 400 for an upgrade request
/// the route cannot take (`bad_request`); 413 for a declared `Content-Length` past the
/// route's `max_request_bytes` (`too_large`).
pub fn route<'s>(
    snap: &Gate<'s>,
    req: &mut Request<Incoming>,
    host: Option<&str>,
    log: &mut AccessLog,
) -> Result<Routed<'s>, Answer> {
    // Without `;…` parameters and trailing dots, as the upstream will execute it.
    let routing_path = target::routing_path(req.uri().path());
    let (route, strip_overrides) = match target::requested(req.headers()) {
        Override::None => (snap.router.find(host, &routing_path, req.method()), false),
        asked => match believed_override(snap.router, host, &routing_path, req.method(), asked) {
            Some(route) => (Some(route), false),
            None => (snap.router.find(host, &routing_path, req.method()), true),
        },
    };
    if strip_overrides {
        target::strip_overrides(req.headers_mut());
    }
    let route = route.ok_or(ProxyError::NoRoute)?;
    log.route = Some(route.path_prefix.clone()); // an Arc: no copy

    // `OPTIONS`/`TRACE` with `Max-Forwards: 0` stop here (RFC 9110 §7.6.2): answered by
    // the gateway, neither forwarded nor charged; other values are counted down.
    if let Some(answer) = snap.edge.last_hop(req) {
        return Err(Answer::new(
            answer.map(crate::response::bytes_body),
            Decision::LastHop,
        ));
    }

    // Only an upgrade the route allows crosses; any other is a plain request.
    let upgrade = crate::http::upgrade::decide(req, &route.upgrades)
        .map_err(|e| ProxyError::BadRequest(e.to_string()))?;
    if let Some(max) = route.max_request_bytes {
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max) {
            return Err(ProxyError::BodyTooLarge(max).into());
        }
    }
    Ok(Routed { route, upgrade })
}

/// The route that override headers select ([`target::requested`]) when it trusts them
/// (`trust_method_override`): found by the overriding method, and by the overriding
/// URL's path in normal form and routing form. `None`: not believed (the overrides are
/// then stripped and the request routed as sent).
fn believed_override<'r>(
    router: &'r Router,
    host: Option<&str>,
    routing_path: &str,
    method: &http::Method,
    asked: Override,
) -> Option<&'r Arc<Route>> {
    let Override::Asks {
        method: overriding,
        url,
    } = asked
    else {
        return None;
    };
    let method = overriding.as_ref().unwrap_or(method);
    let route = match url {
        None => router.find(host, routing_path, method),
        Some(url) => {
            let p = url.split(['?', '#']).next().unwrap_or("/");
            let normal = path::normalize(p).ok()?;
            let normal = normal.as_deref().unwrap_or(p);
            router.find(host, &target::routing_path(normal), method)
        }
    };
    route.filter(|r| r.trust_method_override)
}

/// The answer of the rate-limit endpoint: `{"resources": {NAME: {...}}, "rate": {...}}`
/// with, per limit that applies to the caller, its `algorithm`, `limit`, `used`,
/// `remaining`, `reset` (UTC epoch seconds) and `window` (seconds), and for a limit
/// with `block_for` its `blocked_until` (UTC epoch seconds, `null` when not blocked;
/// `reset` is then the block's end); `rate` is the most constrained one (like GitHub's
/// `GET /rate_limit`). A limit whose store failed is left out.
fn rate_limit_status(
    applied: &[Applied],
    usages: &[Option<Usage>],
) -> Response<crate::proxy::Body> {
    let entry = |a: &Applied, u: &Usage| {
        let mut e = serde_json::json!({
            "algorithm": a.policy().algorithm.name(),
            "limit": u.quota,
            "used": u.used,
            "remaining": u.remaining(),
            "reset": u.reset_epoch_s(),
            "window": a.limit().window_ms.div_ceil(1000),
        });
        if a.limit().block_ms > 0 {
            e["blocked_until"] = (u.blocked_until_ms > 0)
                .then(|| u.blocked_until_ms.div_ceil(1000))
                .into();
        }
        e
    };
    let mut resources = serde_json::Map::new();
    for (a, u) in applied.iter().zip(usages) {
        if let Some(u) = u {
            resources.insert(a.limit().name.to_string(), entry(a, u));
        }
    }
    let rate = most_constrained(usages).and_then(|u| {
        let a = applied.iter().find(|a| a.limit().name == u.resource)?;
        Some(entry(a, u))
    });
    crate::response::json_response(
        http::StatusCode::OK,
        &serde_json::json!({ "resources": resources, "rate": rate }),
    )
}
