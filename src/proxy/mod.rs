//! The request path, one phase per file under [`phase`], in the order [`serve`] runs
//! them:
//!
//! 1. **edge** ([`phase::edge`]): one spelling per path, only the headers that may cross
//!    the edge, one Host; on TLS, a connection for the host asked (else 421).
//! 2. **identify** ([`phase::identify`], [`crate::identity`]): API key or JWT → client and
//!    tier; no key → client IP; unknown key or invalid JWT → 401.
//! 3. **route** ([`phase::route`]): the rate-limit endpoint, else the route by host and
//!    longest path prefix ([`route`]) → upstream and limits; none → 404.
//! 4. **check** ([`phase::check`], [`crate::limiter::Limiter::check`]) every limit: over
//!    a limit → 429 whose headers come from that same read; store failing →
//!    `store.on_error`.
//! 5. **forward** ([`phase::forward`], [`forward`]) to the upstream, streaming both
//!    bodies; 502 / 504.
//! 6. **settle** ([`phase::settle`]): charge every limit once the response status is
//!    known, unless it is uncharged: the route's `cost`, or what the upstream's cost
//!    header says ([`upstream::Upstream::take_cost`]).
//! 7. **headers** ([`phase::headers`]): `X-RateLimit-*` of the most constrained limit,
//!    and/or the IETF `RateLimit-Policy` (every applied limit) and `RateLimit`
//!    ([`headers`]).
//!
//! Each phase returns `Result<T, Answer>`: an [`Answer`] ends the request with its
//! response and its access-log decision. [`handle`] wraps [`serve`] with the request
//! id, the metrics and the access log ([`access`]), whose line is written when the
//! response ends (the log phase).

pub mod access;
pub mod body;
pub mod deadline;
pub mod downstream;
pub mod error;
pub mod forward;
pub mod framing;
pub mod grpc;
pub mod headers;
pub mod path;
pub mod peer;
pub mod phase;
pub mod pool;
pub mod refusal;
pub mod rewrite;
pub mod route;
pub(crate) mod tls;
pub mod tunnel;
pub mod upstream;

use crate::config::LogClientIp;
use crate::identity::Identities;
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::wire::Incoming;
use access::AccessLog;
use error::ProxyError;
use headers::Styles;
use http::{Request, Response};
use peer::Peer;
pub use phase::Answer;
use route::Router;

pub use crate::response::Body;

/// The parts of a config snapshot that the request path reads, borrowed from the
/// snapshot the request started with (`Snapshot::gate`). The request path does not
/// know the snapshot type itself: it sees only these parts.
#[derive(Debug, Clone, Copy)]
pub struct Gate<'a> {
    /// The edge phase: what of a request crosses the edge ([`crate::http`]).
    pub edge: &'a crate::http::Edge,
    /// The identify phase: API keys, tiers, trusted proxies.
    pub identities: &'a Identities,
    /// The route phase: routes.
    pub router: &'a Router,
    /// The check and settle phases: the store and its policy.
    pub limiter: &'a Limiter,
    /// Every `[[limits]]` entry (for the rate-limit endpoint).
    pub limits: &'a [std::sync::Arc<crate::limiter::Limit>],
    /// `rate_limit_endpoint.path`: where a `GET` answers the caller's limits.
    pub rate_limit_path: Option<&'a str>,
    /// `log.client_ip`: how the access log shows the client.
    pub log_client_ip: LogClientIp,
    /// `headers.style`: which rate-limit headers responses carry.
    pub headers: Styles,
    /// `[tracing]`: the tracer; `None` when tracing is off.
    pub tracer: Option<&'a std::sync::Arc<crate::otel::Tracer>>,
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
/// rust-lang/rust#62958); these futures are written and moved on every request (measured
/// when this was written: `forward`'s 3,248 → 2,392 bytes, `serve`'s 2,520 → 1,944, this
/// one's 888 → 616).
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
        if let Some(tracer) = snap.tracer {
            log.trace = Some(tracer.begin(&mut req, || snap.identities.trusts(peer.ip())));
        }
        let grpc = grpc::is_grpc(req.headers());
        // One address holds at most its share of the descriptor budget: a request past
        // it gets 429 before anything else (other addresses are still served).
        let share = ctx.address.map(|a| ctx.budget.share(a));
        // Not boxed here: the server boxes the whole request's future once, in place
        // (see `server::Connection::serve`).
        let answered = match &share {
            Some(None) => Err(Answer::from(ProxyError::Busy(
                "this client address holds its share of the gateway's connections",
            ))),
            _ => serve(snap, ctx, req, peer, &mut log).await,
        };
        let mut response = match answered {
            Ok(response) => response,
            Err(answer) => answer.logged(&mut log),
        };
        let span = match snap.tracer {
            Some(tracer) => log.trace_end(tracer, snap, response.status().as_u16()),
            None => None,
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
                _span: span,
            },
        )
    }
}

/// A request [`handle`] has answered: in flight (`tollgate_in_flight_requests`) until this
/// is dropped, and its access line written then. Kept with the response body, so that both
/// happen when the body has been sent, has failed, or the client went away (held by the
/// body itself rather than by a second boxed body around it: one allocation less per
/// request). Small: the access line, when there is one (`log.level` shows
/// access lines), and the span, when one is exported, are boxed, so that the response body that carries this stays small as
/// hyper moves it.
#[derive(Debug)]
pub struct Finished {
    _in_flight: access::InFlight,
    _line: Option<Box<access::AccessLine>>,
    /// The request's place in its address's share of the descriptor budget.
    _share: Option<crate::budget::ShareSlot>,
    /// The request's span (`[tracing]`, when exported): queued when the response ends.
    _span: Option<Box<crate::otel::Finishing>>,
}

/// The request path as a list of phases, one file each under [`phase`]: the response to
/// `req`, or the [`Answer`] of the phase that ended it (its response and its access-log
/// decision, which [`handle`] notes).
///
/// Not an `async fn`, for the reason [`handle`] gives (arguments kept once).
#[allow(clippy::manual_async_fn)]
pub fn serve<'a>(
    snap: &'a Gate<'a>,
    ctx: &'a Context<'a>,
    mut req: Request<Incoming>,
    peer: &'a Peer,
    log: &'a mut AccessLog,
) -> impl std::future::Future<Output = Result<Response<Body>, Answer>> + 'a {
    async move {
        // 1. Edge: one spelling per path, only the headers that may cross, one Host.
        let edge = phase::edge::edge(snap, &mut req, peer)?;
        // 2. Identify the caller: key, token, certificate, auth service, or client IP.
        let caller = phase::identify::identify(snap, ctx, &req, peer, &edge, log).await?;
        log.traced(|t| t.identified(&caller));
        // 3. Route: the caller's own limits, or the route by host and path prefix.
        if phase::route::asks_own_limits(snap, &req) {
            return Err(phase::route::own_limits(snap, ctx, &req, &caller, log).await);
        }
        let routed = phase::route::route(snap, &mut req, edge.host_name(), log)?;
        let route = routed.route;
        // 4. Check every limit of the route.
        log.traced(|t| t.check_starts());
        let checked = phase::check::check(snap, ctx, &req, peer, &caller, route, log).await;
        log.traced(|t| t.checked(checked.is_ok(), &req, &caller));
        let mut checked = checked?;
        // 5. Forward upstream, streaming both bodies.
        let mut response = phase::forward::forward(
            snap,
            ctx,
            req,
            peer,
            edge,
            &caller,
            routed,
            &mut checked,
            log,
        )
        .await?;
        // 6. Settle: charge, or release, once the status is known.
        log.traced(|t| t.charge_starts());
        let settled = phase::settle::settle(ctx, route, &mut checked, &mut response, log).await;
        log.traced(|t| t.charged());
        // 7. Headers: the rate-limit headers; the concurrency slots go with the body.
        Ok(phase::headers::headers(snap, response, settled, log))
    }
}
