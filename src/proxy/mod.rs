//! The request path, in order:
//!
//! 1. **identify** the caller ([`crate::identity`]): API key or JWT → client and tier;
//!    no key → client IP; unknown key or invalid JWT → 401.
//! 2. **route** by host and longest path prefix ([`route`]) → upstream and limits; none → 404.
//! 3. **check** every limit ([`crate::limiter::Limiter::check`]): over a limit → 429 whose
//!    headers come from that same read; store failing → `store.on_error`.
//! 4. **forward** to the upstream ([`forward`]), streaming both bodies; 502 / 504.
//! 5. **charge** every limit once the response status is known, unless it is uncharged:
//!    the route's `cost`, or what the upstream's cost header says
//!    ([`forward::Upstream::take_cost`]).
//! 6. **headers**: `X-RateLimit-*` of the most constrained limit, and/or the IETF
//!    `RateLimit-Policy` (every applied limit) and `RateLimit` ([`headers`]).
//!
//! [`serve`] is that list as code; [`handle`] wraps it with the request id, the metrics
//! and the access log ([`access`]).

pub mod access;
pub mod body;
pub mod deadline;
pub mod error;
pub mod forward;
pub mod framing;
pub mod grpc;
pub mod headers;
pub mod path;
pub mod pool;
pub mod refusal;
pub mod route;
pub(crate) mod tls;

use crate::clock::Clock;
use crate::config::LogClientIp;
use crate::wire::Incoming;
use crate::http::target::{self, Override};
use crate::identity::auth_request::Oversize;
use crate::identity::{Identities, IdentityError};
use crate::limiter::{most_constrained, Applied, Limiter, Refusal, Usage};
use crate::metrics::Metrics;
use access::{AccessLog, Decision};
use error::ProxyError;
use forward::{Downstream, Peer};
use headers::{Policy, Styles};
use http::{header, Request, Response};
use route::Router;

pub use crate::response::Body;

/// The parts of a config snapshot that the request path reads, borrowed from the
/// snapshot the request started with (`Snapshot::gate`). The request path does not
/// know the snapshot type itself: it sees only these parts.
#[derive(Debug, Clone, Copy)]
pub struct Gate<'a> {
    /// Step 0: what of a request crosses the edge ([`crate::http`]).
    pub edge: &'a crate::http::Edge,
    /// Step 1: API keys, tiers, trusted proxies.
    pub identities: &'a Identities,
    /// Step 2: routes.
    pub router: &'a Router,
    /// Steps 3 and 5: the store and its policy.
    pub limiter: &'a Limiter,
    /// Every `[[limits]]` entry (for the rate-limit endpoint).
    pub limits: &'a [std::sync::Arc<crate::limiter::Limit>],
    /// `rate_limit_endpoint.path`: where a `GET` answers the caller's limits.
    pub rate_limit_path: Option<&'a str>,
    /// `log.client_ip`: how the access log shows the client.
    pub log_client_ip: LogClientIp,
    /// `headers.style`: which rate-limit headers responses carry.
    pub headers: Styles,
}

impl Gate<'_> {
    /// The client IP as the access log shows it (`log.client_ip`): the address, the
    /// keyed digest of what keys it in per-IP counts (for IPv6, its network of
    /// `identity.ipv6_prefix_len` bits: the hash tag of the caller's by-IP Redis keys),
    /// or nothing.
    pub fn log_client(&self, ip: std::net::IpAddr) -> Option<String> {
        match self.log_client_ip {
            LogClientIp::None => None,
            LogClientIp::Ip => Some(ip.to_string()),
            LogClientIp::Hash => Some(self.limiter.ip_hash(self.identities.ip_key(ip))),
        }
    }
}

/// What the request path needs besides the snapshot: the clock and the metrics.
#[derive(Debug)]
pub struct Context<'a> {
    /// Where "now" comes from (shared: work that outlives the request's future, such as
    /// giving back concurrency slots when the body ends, holds it too).
    pub clock: &'a crate::clock::SharedClock,
    /// Where request metrics go.
    pub metrics: &'a Metrics,
    /// `server.max_delayed`: the requests `on_limit = "delay"` may hold on this gateway.
    pub delayed: &'a crate::limiter::delayed::DelayBudget,
    /// The descriptor budget new upstream sockets and tunnels are counted in.
    pub budget: &'a crate::budget::Budget,
    /// The key of the client connection's address, whose share of the descriptor budget
    /// the request takes until its response ends (`server.descriptor_share_per_ip`:
    /// past it, 429); `None`: not counted (a peer in `identity.trusted_proxies`).
    pub address: Option<std::net::IpAddr>,
    /// `server.body_timeout`: how long a request body may stop arriving.
    pub body_timeout: std::time::Duration,
    /// Where an HTTP/1.1 request's 1xx responses go (its connection's socket); `None`
    /// for HTTP/2 streams, whose handle is in the request's extensions, and HTTP/1.0.
    pub informational: Option<&'a crate::wire::Informational>,
}

/// Serve one request on the snapshot it started with (its [`Gate`]): set its request id, run
/// [`serve`], record metrics; the access log line is written when the [`Finished`] that
/// comes with the response is dropped, which the caller keeps with the response body (the
/// request is in flight until then).
///
/// A plain function around an `async move` block, not an `async fn`: an `async fn`
/// keeps each argument twice in its state (its parameters, then the body's copies:
/// rust-lang/rust#62958); these futures are written and moved on every request (issue 16:
/// `forward`'s 3,248 → 2,392 bytes, `serve`'s 2,520 → 1,944, this one's 888 → 616).
#[allow(clippy::manual_async_fn)]
pub fn handle<'a>(
    snap: &'a Gate<'a>,
    ctx: &'a Context<'a>,
    mut req: Request<Incoming>,
    peer: &'a Peer,
) -> impl std::future::Future<Output = (Response<Body>, Finished)> + 'a {
    async move {
        let in_flight = access::InFlight::new(&ctx.metrics.in_flight);
        let mut log = AccessLog::start(&mut req, ctx.metrics);
        let grpc = grpc::is_grpc(req.headers());
        // One address holds at most its share of the descriptor budget: a request past
        // it gets 429 before anything else (other addresses are still served).
        let share = ctx.address.map(|a| ctx.budget.share(a));
        // Not boxed here: the server boxes the whole request's future once, in place
        // (see `server::Connection::serve`).
        let mut response = match &share {
            Some(None) => {
                log.decision = Decision::Rejected;
                ProxyError::Busy("this client address holds its share of the gateway's connections")
                    .into_response()
            }
            _ => serve(snap, ctx, req, peer, &mut log).await,
        };
        let line = log.finish(&mut response);
        if grpc {
            // Logged and counted with its HTTP status; a gRPC client reads grpc-status.
            response = grpc::gateway_error(response);
        }
        (
            response,
            Finished {
                _in_flight: in_flight,
                _line: line.map(Box::new),
                _share: share.flatten(),
            },
        )
    }
}

/// A request [`handle`] has answered: in flight (`tollgate_in_flight_requests`) until this
/// is dropped, and its access line written then. Kept with the response body, so that both
/// happen when the body has been sent, has failed, or the client went away (held by the
/// body itself rather than by a second boxed body around it: one allocation less per
/// request, issue 16). Two words: the access line, when there is one (`log.level` shows
/// access lines), is boxed, so that the response body that carries this stays small as
/// hyper moves it.
#[derive(Debug)]
pub struct Finished {
    _in_flight: access::InFlight,
    _line: Option<Box<access::AccessLine>>,
    /// The request's place in its address's share of the descriptor budget.
    _share: Option<crate::budget::ShareSlot>,
}

/// The six steps of the request path.
///
/// Not an `async fn`, for the reason [`handle`] gives (arguments kept once).
#[allow(clippy::manual_async_fn)]
pub fn serve<'a>(
    snap: &'a Gate<'a>,
    ctx: &'a Context<'a>,
    mut req: Request<Incoming>,
    peer: &'a Peer,
    log: &'a mut AccessLog,
) -> impl std::future::Future<Output = Response<Body>> + 'a {
    async move {
        let clock: &dyn Clock = &**ctx.clock;

        // 0. One spelling per path (so no spelling dodges a route's limits), only the
        //    headers that may cross the edge, and one sane Host.
        if let Err(e) = normalize_path(&mut req) {
            log.decision = Decision::BadRequest;
            return e.into_response();
        }
        let peer_trusted = snap.identities.trusts(peer.ip());
        if let Err(e) = snap.edge.admit(req.headers_mut(), peer_trusted) {
            log.decision = Decision::BadRequest;
            return ProxyError::NotImplemented(e.to_string()).into_response();
        }
        // One authority: routed, limited and forwarded on (the upstream gets this Host).
        let settled_host = match crate::http::authority::settle(&mut req) {
            Ok(host) => host,
            Err(e) => {
                log.decision = Decision::BadRequest;
                return ProxyError::BadRequest(e.to_string()).into_response();
            }
        };
        let host = settled_host
            .as_ref()
            .and_then(crate::http::authority::host_name);

        // On TLS, the connection must be for the host asked (when the listener has more
        // than one certificate): else 421, never forwarded nor charged.
        let tls = req.extensions().get::<crate::tls::TlsInfo>().cloned();
        if let (Some(info), Some(host)) = (&tls, host) {
            if info.misdirected(host) {
                log.decision = Decision::Misdirected;
                return ProxyError::Misdirected(host.chars().take(256).collect()).into_response();
            }
        }

        // 1. Identify the caller (on TLS, a verified client certificate's CN may name it).
        //    An address past identity.failed_auth_limit presents no credential that is
        //    looked up (nor asked about) until the window resets: 429 for all of them.
        if snap.limiter.blocks_any() && snap.identities.presents_credential(req.headers()) {
            let ip = snap.identities.client_ip(req.headers(), peer.ip());
            let now_ms = clock.now_ms();
            let blocked = snap
                .limiter
                .failed_auth_blocked(snap.identities.ip_key(ip), now_ms);
            if let Some(usage) = blocked {
                if access::enabled() {
                    log.client = snap.log_client(ip);
                }
                return failed_auth_refusal(snap, log, usage, ip, now_ms);
            }
        }
        let cert_cn = tls.as_ref().and_then(|t| t.client_cn.as_deref());
        let identified = match snap
            .identities
            .identify_with_cert(req.headers(), peer.ip(), cert_cn)
        {
            // No local key: [identity.auth_request] may know it.
            Err(IdentityError::BadCredentials) => snap
                .identities
                .ask_auth_service(
                    req.headers(),
                    peer.ip(),
                    req.method(),
                    req.uri(),
                    ctx.budget,
                    ctx.metrics,
                )
                .await
                .unwrap_or(Err(IdentityError::BadCredentials)),
            identified => identified,
        };
        if access::enabled() {
            let ip = match &identified {
                Ok(caller) => caller.ip,
                Err(_) => snap.identities.client_ip(req.headers(), peer.ip()),
            };
            log.client = snap.log_client(ip);
        }
        let caller = match identified {
            Ok(caller) => caller,
            Err(IdentityError::AuthUnavailable(why)) => {
                tracing::warn!(
                    reason = why,
                    "auth service unavailable; identity.auth_request.on_error = \"deny\""
                );
                log.decision = Decision::Unauthenticated;
                return ProxyError::AuthUnavailable.into_response();
            }
            // Too many callouts under way (in all, or for this address): answered at once,
            // without a callout; not a failed authentication.
            Err(IdentityError::AuthBusy { per_address }) => {
                log.decision = Decision::Unauthenticated;
                return if per_address {
                    ProxyError::Busy("too many auth callouts under way for this client address")
                } else {
                    ProxyError::Overloaded("too many auth callouts under way")
                }
                .into_response();
            }
            Err(failure) => {
                // Guessing keys is limited per client IP (identity.failed_auth_limit), an
                // IPv6 client's by its network (identity.ipv6_prefix_len).
                let ip = snap.identities.client_ip(req.headers(), peer.ip());
                let key = snap.identities.ip_key(ip);
                // Boxed: a rare path, kept out of the request future's size (every request
                // allocates that much for it, see `server::Connection::serve`).
                if let Some(usage) = Box::pin(snap.limiter.failed_auth(key, ctx.clock)).await {
                    return failed_auth_refusal(snap, log, usage, ip, clock.now_ms());
                }
                log.decision = Decision::Unauthenticated;
                return match failure {
                    IdentityError::Refused {
                        status,
                        content_type,
                        body,
                    } => return crate::response::passed_on(status, content_type, body),
                    IdentityError::BadCredentials
                    | IdentityError::AuthUnavailable(_)
                    | IdentityError::AuthBusy { .. } => ProxyError::BadCredentials,
                    IdentityError::InvalidToken(reason) => ProxyError::InvalidToken(reason),
                    e @ IdentityError::Malformed(_) => ProxyError::BadRequest(e.to_string()),
                    IdentityError::AuthRejected(status) => ProxyError::AuthRejected(status),
                    IdentityError::TooLargeToAsk(Oversize::Uri(max)) => {
                        ProxyError::UriTooLongToAsk(max)
                    }
                    IdentityError::TooLargeToAsk(Oversize::Headers(max)) => {
                        ProxyError::HeadersTooLargeToAsk(max)
                    }
                }
                .into_response();
            }
        };
        log.caller = caller.client.as_ref().map(|c| c.id.clone());
        log.set_tier(&caller.tier);
        log.key_label = caller.key_label.clone();

        // The caller's own limits (rate_limit_endpoint.path): answered here, never charged.
        if req.method() == http::Method::GET && snap.rate_limit_path == Some(req.uri().path()) {
            log.decision = Decision::RateLimitStatus;
            let applied = snap.limiter.applicable(snap.limits, &caller, req.headers());
            let now_ms = clock.now_ms();
            let usages = Box::pin(snap.limiter.peek(&applied, now_ms)).await;
            return rate_limit_status(&applied, &usages);
        }

        // 2. Route by host and longest path prefix, on the path and method the upstream will
        //    execute: without `;…` parameters and trailing dots, and with the method / URL
        //    override headers where the route they select trusts them (else stripped).
        let routing_path = target::routing_path(req.uri().path());
        let (route, strip_overrides) = match target::requested(req.headers()) {
            Override::None => (snap.router.find(host, &routing_path, req.method()), false),
            asked => match believed_override(snap.router, host, &routing_path, req.method(), asked)
            {
                Some(route) => (Some(route), false),
                None => (snap.router.find(host, &routing_path, req.method()), true),
            },
        };
        if strip_overrides {
            target::strip_overrides(req.headers_mut());
        }
        let Some(route) = route else {
            log.decision = Decision::NoRoute;
            return ProxyError::NoRoute.into_response();
        };
        log.route = Some(route.path_prefix.clone()); // an Arc: no copy

        // `OPTIONS`/`TRACE` with `Max-Forwards: 0` stop here (RFC 9110 §7.6.2): answered by
        // the gateway, neither forwarded nor charged; other values are counted down.
        if let Some(answer) = snap.edge.last_hop(&mut req) {
            log.decision = Decision::LastHop;
            return answer.map(crate::response::bytes_body);
        }

        // Only an upgrade the route allows crosses; any other is a plain request.
        let upgrade = match crate::http::upgrade::decide(&req, &route.upgrades) {
            Ok(upgrade) => upgrade,
            Err(e) => {
                log.decision = Decision::BadRequest;
                return ProxyError::BadRequest(e.to_string()).into_response();
            }
        };
        if let Some(max) = route.max_request_bytes {
            let declared = req
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            if declared.is_some_and(|n| n > max) {
                log.decision = Decision::TooLarge;
                return ProxyError::BodyTooLarge(max).into_response();
            }
        }

        // 3. Check every limit of the route: a read (may be stale, never written), or a
        //    reservation (`charge = "on_request"`, `store.reserve_in_flight`).
        let applied: std::sync::Arc<[Applied]> =
            snap.limiter
                .applicable_to(&route.limits, &caller, req.headers());
        let reserve = snap.limiter.reserves(route.on_request);
        // One reading of the clock for the check and what is counted with it.
        let now_ms = clock.now_ms();
        let mut ticket = match snap
            .limiter
            .check_or_delay(
                &applied,
                route.cost,
                reserve,
                ctx.clock,
                ctx.delayed,
                now_ms,
            )
            .await
        {
            Ok(ticket) => ticket,
            Err(Refusal::OverLimit(usage)) => {
                log.decision = Decision::Rejected;
                // A delayed refusal came later than `now_ms`: read the clock again.
                let now_ms = clock.now_ms();
                snap.limiter.count_refused(&usage.resource, &caller, now_ms);
                ctx.metrics.rejections.inc(&usage.resource, &caller.tier);
                let label;
                let response = refusal::over_limit(
                    &usage,
                    usage.retry_after_s(now_ms),
                    match &caller.client {
                        // The peer's address, rendered once per connection.
                        None if caller.ip == peer.ip() => peer.ip_text(),
                        _ => {
                            label = caller.label();
                            &label
                        }
                    },
                    snap.headers,
                    applied.iter().map(Policy::of),
                    now_ms,
                );
                log.usage = Some(usage);
                return response;
            }
            Err(Refusal::StoreDenied(_)) => {
                log.decision = Decision::StoreErrorDenied;
                return ProxyError::StoreUnavailable.into_response();
            }
        };
        snap.limiter
            .count_used(&applied, &caller, route.cost, now_ms);
        if ticket.usages().iter().any(Option::is_none) {
            log.decision = Decision::StoreErrorAllowed;
        }
        for usage in ticket.shadowed() {
            log.decision = Decision::ShadowRejected;
            shadow_rejection(ctx.metrics, usage, &caller);
        }
        // Concurrency slots are given back when the response body ends (or fails, or the
        // client goes away): the guard travels with the body.
        let slots = ticket.slots();

        // From here on the request is the upstream's: if the client goes away before the
        // charge below, it is charged all the same (when the ticket is dropped).

        // 4. Forward upstream, streaming both bodies (telling the upstream who called).
        snap.identities.to_upstream(&caller, req.headers_mut());
        let down = Downstream {
            peer,
            peer_trusted,
            client_ip: caller.ip,
            upgrade,
            scheme: if tls.is_some() { "https" } else { "http" },
            request_id: log.request_id().clone(),
            host: settled_host,
            max_request_bytes: route.max_request_bytes,
            body_timeout: ctx.body_timeout,
            budget: ctx.budget,
            via: snap.edge.via(),
            informational: ctx.informational,
            started: std::time::Instant::now(),
        };
        let upstream_started = down.started;
        // Held inline (the whole request's future is boxed once, in place, by the server:
        // a box of its own here cost an allocation and a copy of about 2.4 KB).
        let forwarded = forward::forward(&route.upstream, req, down).await;
        log.upstream_took(&route.upstream.name, ctx.metrics, upstream_started);
        let mut response = match forwarded {
            Ok(response) => response,
            Err(e @ ProxyError::BodyTimeout(_)) => {
                // The client stopped sending its body while the upstream had the request:
                // charged like a client that went away (dropping the ticket charges it;
                // reservations and leased units stand).
                return e.into_response();
            }
            Err(e) => {
                let now_ms = clock.now_ms();
                let usages = ticket.release(now_ms);
                let mut response = e.into_response();
                if let Some(usage) = most_constrained(&usages) {
                    put_headers(snap, &mut response, usage, &applied, now_ms);
                    log.usage = Some(usage.clone());
                }
                return response; // dropping `slots` gives them back
            }
        };

        // 5. Charge, unless the status is uncharged (then the check's numbers stand, and
        //    reservations and lease units are given back). The upstream may say what the
        //    request cost (upstreams.cost_header; the header never reaches the client): that
        //    is what limits checked before forwarding are charged. Reserved (on_request) and
        //    lease-mode limits keep the route's cost, taken before forwarding.
        let cost = route
            .upstream
            .take_cost(response.headers_mut())
            .unwrap_or(route.cost);
        // One reading of the clock for the charge and the headers. The charge is handed
        // to the store when `charge` is called, so a client going away from here on does
        // not count it twice.
        let now_ms = clock.now_ms();
        let usages = if route.charges(response.status()) && cost > 0 {
            log.cost = cost;
            ticket.charge(cost, now_ms).await
        } else {
            ticket.release(now_ms)
        };

        // 6. Headers of the limit with the fewest remaining units (and every applied limit's
        //    policy, for the IETF style).
        if let Some(usage) = most_constrained(&usages) {
            put_headers(snap, &mut response, usage, &applied, now_ms);
            log.usage = Some(usage.clone());
        }
        if let Some(guard) = slots {
            response = response.map(|body| crate::response::with_guard(body, guard));
        }
        response
    }
}

/// The answer of the rate-limit endpoint: `{"resources": {NAME: {...}}, "rate": {...}}`
/// with, per limit that applies to the caller, its `algorithm`, `limit`, `used`,
/// `remaining`, `reset` (UTC epoch seconds) and `window` (seconds); `rate` is the most
/// constrained one (like GitHub's `GET /rate_limit`). A limit whose store failed is
/// left out.
fn rate_limit_status(applied: &[Applied], usages: &[Option<Usage>]) -> Response<Body> {
    let entry = |a: &Applied, u: &Usage| {
        serde_json::json!({
            "algorithm": a.policy().algorithm.name(),
            "limit": u.quota,
            "used": u.used,
            "remaining": u.remaining(),
            "reset": u.reset_epoch_s(),
            "window": a.limit().window_ms.div_ceil(1000),
        })
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

/// The 429 of a request from the client IP `ip` past `identity.failed_auth_limit`
/// (`usage` is that limit's window), at `now_ms` (epoch milliseconds): not forwarded,
/// logged as rejected.
fn failed_auth_refusal(
    snap: &Gate<'_>,
    log: &mut AccessLog,
    usage: Usage,
    ip: std::net::IpAddr,
    now_ms: u64,
) -> Response<Body> {
    log.decision = Decision::Rejected;
    log.usage = Some(usage.clone());
    let policy = snap
        .limiter
        .failed_auth_limit()
        .map(|limit| Policy::of_limit(limit, usage.quota));
    let mut response = ProxyError::OverLimit {
        usage: usage.clone(),
        retry_after_s: usage.retry_after_s(now_ms),
        caller: ip.to_string(),
    }
    .into_response();
    headers::put(response.headers_mut(), snap.headers, &usage, policy, now_ms);
    response
}

/// A limit in shadow mode (or outside its `enforce_percent`) would have refused this
/// request: count it in `tollgate_shadow_rejections_total` and log it (at most once a
/// second, with the number held back).
fn shadow_rejection(metrics: &Metrics, usage: &Usage, caller: &crate::identity::Caller) {
    static LOG: crate::logging::Throttle = crate::logging::Throttle::new();
    metrics
        .shadow_rejections
        .get_or_create(&crate::metrics::RejectionLabels {
            limit: usage.resource.clone(),
            tier: caller.tier.clone(),
        })
        .inc();
    if let Some(suppressed) = LOG.due(1_000) {
        tracing::info!(
            limit = %usage.resource,
            tier = %caller.tier,
            used = usage.used,
            limit_units = usage.quota,
            suppressed,
            "shadow: would have refused with 429; let through"
        );
    }
}

/// The rate-limit headers of a request in the styles of `headers.style`: `usage` is the
/// limit they describe, `applied` every limit that applied (for `RateLimit-Policy`),
/// `now_ms` milliseconds since the Unix epoch.
fn put_headers(
    snap: &Gate<'_>,
    response: &mut Response<Body>,
    usage: &Usage,
    applied: &[Applied],
    now_ms: u64,
) {
    headers::put(
        response.headers_mut(),
        snap.headers,
        usage,
        applied.iter().map(Policy::of),
        now_ms,
    );
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
) -> Option<&'r std::sync::Arc<route::Route>> {
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

/// Rewrite the request's path to its normal form ([`path::normalize`]), keeping the
/// query, so that routing and the upstream see the same path. The asterisk-form of
/// `OPTIONS *` is kept as it is (and routed as `/`).
///
/// Errors: 400 for a path with an encoded slash or a malformed escape, and for `*` with
/// any method but `OPTIONS`.
fn normalize_path(req: &mut Request<Incoming>) -> Result<(), ProxyError> {
    if req.uri().path() == "*" {
        return match *req.method() {
            http::Method::OPTIONS => Ok(()),
            _ => Err(ProxyError::BadRequest(
                "the asterisk-form `*` is for OPTIONS only".into(),
            )),
        };
    }
    let normal =
        path::normalize(req.uri().path()).map_err(|e| ProxyError::BadRequest(e.to_string()))?;
    let Some(normal) = normal else {
        return Ok(());
    };
    let pq = match req.uri().query() {
        Some(q) => format!("{normal}?{q}"),
        None => normal,
    };
    let mut parts = req.uri().clone().into_parts();
    parts.path_and_query = Some(
        pq.parse()
            .map_err(|_| ProxyError::BadRequest("path cannot be normalised".into()))?,
    );
    *req.uri_mut() = http::Uri::from_parts(parts)
        .map_err(|_| ProxyError::BadRequest("path cannot be normalised".into()))?;
    Ok(())
}
