//! Phase 5, forward to the route's upstream ([`crate::proxy::forward`]), streaming both
//! bodies, telling the upstream who called. A request that failed there is not
//! charged (unless its client stopped sending its body); its answer keeps the check's
//! decision and carries the rate-limit headers of what the check found.

use super::check::Checked;
use super::edge::Edge;
use super::route::Routed;
use super::Answer;
use crate::identity::Caller;
use crate::limiter::most_constrained;
use crate::proxy::access::AccessLog;
use crate::proxy::body::BodyFailure;
use crate::proxy::error::Fault;
use crate::proxy::forward::Downstream;
use crate::proxy::peer::Peer;
use crate::proxy::{Body, Context, Gate};
use crate::wire::Incoming;
use http::{Request, Response};

/// Forward `req` as `edge`, `caller` and `routed` say, noting the upstream's time in
/// `log`; the upstream's response, whose body streams as the client reads it.
///
/// Errors: the gateway's answer to a failed exchange (502, 503, 504; 400, 408, 413 for
/// what the client sent), logged with the check's decision. Every such request but a
/// body that stopped arriving (408, charged like a client that went away) is released:
/// not charged, its reservations given back.
///
/// Not an `async fn`, for the reason [`crate::proxy::handle`] gives (arguments kept once).
#[allow(clippy::manual_async_fn, clippy::too_many_arguments)]
pub fn forward<'r, 'c: 'r>(
    snap: &'r Gate<'r>,
    ctx: &'r Context<'r>,
    mut req: Request<Incoming>,
    peer: &'r Peer,
    edge: Edge,
    caller: &'r Caller,
    routed: Routed<'r>,
    checked: &'r mut Checked<'c>,
    log: &'r mut AccessLog,
) -> impl std::future::Future<Output = Result<Response<Body>, Answer>> + use<'r, 'c> {
    async move {
        let route = routed.route;
        snap.identities.to_upstream(caller, req.headers_mut());
        // `[tracing]`: tollgate's traceparent upstream; the attempts noted when recorded.
        let attempts = crate::otel::span::Attempts::default();
        let traced = match log.trace.as_deref_mut() {
            Some(trace) => {
                let http2 = route.upstream.protocol == crate::config::UpstreamProtocol::Http2;
                trace.to_upstream(&route.upstream.name, http2, req.headers_mut())
            }
            None => false,
        };
        let down = Downstream {
            peer,
            peer_trusted: edge.peer_trusted,
            client_ip: caller.ip,
            upgrade: routed.upgrade,
            scheme: if edge.tls.is_some() { "https" } else { "http" },
            request_id: log.request_id().clone(),
            host: edge.host,
            max_request_bytes: route.max_request_bytes,
            body_timeout: ctx.body_timeout,
            budget: ctx.budget,
            via: snap.edge.via(),
            informational: ctx.informational,
            started: std::time::Instant::now(),
            attempts: traced.then_some(&attempts),
        };
        let upstream_started = down.started;
        // Held inline (the whole request's future is boxed once, in place, by the server:
        // a box of its own here cost an allocation and a copy of about 2.4 KB).
        let forwarded = crate::proxy::forward::forward(&route.upstream, req, down);
        tokio::pin!(forwarded);
        let forwarded = forwarded.await;
        log.upstream_took(&route.upstream.name, ctx.metrics, upstream_started);
        if traced {
            if let Some(trace) = log.trace.as_deref_mut() {
                let (i, count, retry_ns) = attempts.read();
                let target = route
                    .upstream
                    .targets
                    .get(i)
                    .map(|m| std::sync::Arc::from(m.target.authority.as_str()));
                trace.upstream_done(target.as_ref(), count, retry_ns);
            }
        }
        match forwarded {
            Ok(response) => Ok(response),
            // The client stopped sending its body while the upstream had the request:
            // charged like a client that went away (dropping `checked.ticket` charges
            // it; reservations and leased units stand).
            Err(e) if matches!(e.fault(), Some(Fault::Body(BodyFailure::TimedOut(_)))) => {
                Err(Answer::keeping_decision(e.into_response()))
            }
            Err(e) => {
                let now_ms = ctx.clock.now_ms();
                let applied = checked.ticket.applied().clone();
                let usages = checked.ticket.release(now_ms);
                log.uncharged = Some(crate::proxy::access::Uncharged::ForwardFailed);
                let mut response = e.into_response();
                if let Some(usage) = most_constrained(&usages) {
                    super::headers::put(snap, &mut response, usage, &applied, now_ms);
                    log.usage = Some(usage.clone());
                }
                // Dropping `checked` (as the request ends) gives the concurrency slots
                // back.
                Err(Answer::keeping_decision(response))
            }
        }
    }
}
