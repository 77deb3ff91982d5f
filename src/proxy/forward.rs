//! The forward phase's work: send a request to an upstream target and retry it on
//! another when that is safe, streaming both bodies; the failures mapped to the
//! gateway's answers ([`ProxyError`]). What is changed in the request and response on
//! the way is in [`super::rewrite`], the tunnel after an upgrade in [`super::tunnel`].

use super::body::BodyFailure;
use super::body::RequestBody;
use super::error::{BadResponse, Fault, ForwardError, ProxyError, Step};
use super::pool::SendError;
use super::rewrite::{address, respond, respond_switched, respond_upgraded};
use super::Body;
use crate::config::UpstreamProtocol;
use crate::wire::Incoming;
use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Version};
use http_body::Body as _;

pub use super::downstream::Downstream;
pub use super::peer::Peer;
pub use super::upstream::{Upstream, COST_WARN_INTERVAL_MS, MAX_EJECTION};

/// Send `req` to the next target of `upstream` and return its response, whose body
/// streams from the upstream as the client reads it.
///
/// Errors: [`ProxyError::Forwarded`] for a request that failed once forwarded (its
/// [`ForwardError`] says what failed, where, and decides the status): the connect or the
/// response headers took longer than configured (504); the target refused, reset or
/// could not be reached, or answered a head that cannot be passed on (502); the
/// descriptor budget had no room for an upstream socket (503); the request body stopped
/// arriving for `server.body_timeout` before the response (408), or was too large (413)
/// or unreadable (400). [`ProxyError::Overloaded`] when `server.max_tunnels` are open
/// for an upgrade (503); [`ProxyError::BadRequest`] for a request that cannot be
/// forwarded as sent.
///
/// Not an `async fn`, for the reason [`super::handle`] gives (arguments kept once).
#[allow(clippy::manual_async_fn)]
pub fn forward<'a>(
    upstream: &'a Upstream,
    mut req: Request<Incoming>,
    mut down: Downstream<'a>,
) -> impl std::future::Future<Output = Result<Response<Body>, ProxyError>> + Send + 'a {
    async move {
        // An upgrade the route allows (WebSocket): the request goes upstream with its
        // Upgrade, and a 101 answer naming that protocol turns both connections into one
        // tunnel. Any other Upgrade is stripped with the hop-by-hop headers.
        let h2_websocket = down.upgrade.as_ref().is_some_and(|u| u.h2_websocket);
        let upgrade = down.upgrade.as_ref().map(|u| u.protocols.clone());
        let client_upgrade = match &upgrade {
            Some(_) if upstream.protocol == UpstreamProtocol::Http2 => {
                return Err(ProxyError::BadRequest(
                    "protocol upgrades (WebSocket) need an HTTP/1.1 upstream".into(),
                ))
            }
            Some(_) => {
                // Counted before anything goes upstream: past `server.max_tunnels`, 503.
                let slot = down
                    .budget
                    .tunnel()
                    .ok_or(ProxyError::Overloaded("too many open tunnels"))?;
                Some((crate::wire::client_upgrade(&mut req), slot))
            }
            None => None,
        };
        let (mut parts, body) = req.into_parts();
        let downstream_version = parts.version;

        // The Host the client asked for, as the edge settled it (an HTTP/2 request's
        // `:authority` included), so not looked up again.
        let host = down.host.take();
        // Shared with the request's URI, not copied. An empty one (an absolute-form
        // `http://host`) stands for "/".
        let path = match parts.uri.path_and_query() {
            Some(pq) if pq.as_str() != "/" => pq.clone(),
            _ => PathAndQuery::from_static("/"),
        };

        super::rewrite::request_head(
            &mut parts,
            &body,
            upstream.protocol,
            upgrade.as_ref(),
            h2_websocket,
            host.as_ref(),
            &down,
        );
        // May go to another target when a failure was safe to retry: with several
        // targets, an idempotent method and no body that would have to be sent twice.
        let retriable =
            upstream.targets.len() > 1 && idempotent(&parts.method) && body.is_end_stream();

        // Where 1xx go (see `wire::interim`): an HTTP/1.1 client's handle comes with
        // `down`, an HTTP/2 stream's in the extensions.
        let informational = match upstream.protocol {
            UpstreamProtocol::Http1 => down
                .informational
                .or_else(|| parts.extensions.get::<crate::wire::Informational>())
                .cloned(),
            // The HTTP/2 client takes it from the extensions itself.
            UpstreamProtocol::Http2 => {
                if let Some(client) = down.informational {
                    parts.extensions.insert(client.clone());
                }
                None
            }
        };
        let mut request = Request::from_parts(
            parts,
            RequestBody::new(body, down.max_request_bytes, down.body_timeout),
        );
        if let Some(client) = informational {
            // 1xx from the upstream (103 Early Hints, ...) go on to the client at once.
            hyper::ext::on_informational(&mut request, move |response| {
                client.send(response.status(), response.headers());
            });
        }
        let mut tried = None;
        let deadline = tokio::time::Instant::from_std(down.started) + upstream.response_timeout;
        loop {
            let i = upstream.pick(tried);
            if let Some(attempts) = down.attempts {
                attempts.attempt(i);
            }
            let target = &upstream.targets[i].target;
            address(
                upstream.protocol,
                target,
                &path,
                host.as_ref(),
                &mut request,
            )?;
            // A failure the forward loop finds itself (the pool's come with its answer).
            let failure =
                |fault, step| ForwardError::new(fault, step, &upstream.name, &target.authority);
            // Pinned where it is built: the timers below take a reference to it, where
            // taking it by value would copy the send's future (about 1 KB) into theirs
            // and theirs again into this future's await (docs/hot-path.md).
            let send =
                upstream.targets[i]
                    .pool
                    .send(request, down.budget, Some(&down.peer.upstream));
            tokio::pin!(send);
            let sent = if downstream_version < Version::HTTP_2 {
                // HTTP/1 serves one request of a connection at a time: its timer is theirs.
                down.peer.response_timer.within(deadline, send).await
            } else {
                tokio::time::timeout_at(deadline, send).await.ok()
            };
            let failure = match sent {
                Some(Ok(mut response)) => {
                    upstream.healthy(i);
                    let head = head_bytes(response.headers());
                    if head > upstream.max_response_header_bytes {
                        // HTTP/2 enforces this while decoding; HTTP/1.1 here, on the
                        // parsed head, so that both protocols draw the same line.
                        let failure = failure(
                            Fault::BadResponse(BadResponse::HeadersTooLarge),
                            Step::ResponseHead,
                        );
                        warn(
                            &failure,
                            &down.request_id,
                            "sent a response head past upstreams.max_response_header_bytes",
                            &format!("{head} bytes, limit {}", upstream.max_response_header_bytes),
                        );
                        return Err(ProxyError::Forwarded(failure));
                    }
                    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                        let offered = upgrade.as_ref();
                        let answered = response.headers().get(header::UPGRADE);
                        if !offered
                            .is_some_and(|o| crate::http::upgrade::switched_to_offered(o, answered))
                        {
                            // No tunnel to a protocol that was not asked for (and allowed).
                            let failure = failure(Fault::Failed, Step::ResponseHead);
                            warn(
                                &failure,
                                &down.request_id,
                                "switched protocols without being asked",
                                &format!("101 with Upgrade {answered:?}, offered {offered:?}"),
                            );
                            return Err(ProxyError::Forwarded(failure));
                        }
                    }
                    if let (Some((client, slot)), StatusCode::SWITCHING_PROTOCOLS) =
                        (client_upgrade, response.status())
                    {
                        let upstream_side = hyper::upgrade::on(&mut response);
                        tokio::spawn(super::tunnel::tunnel(
                            client,
                            upstream_side,
                            slot,
                            down.budget.tunnel_idle_timeout,
                            down.request_id.clone(),
                        ));
                        if h2_websocket {
                            // Over HTTP/2 the handshake is answered 200 (RFC 8441).
                            let mut response =
                                respond_switched(response, downstream_version, down.via);
                            *response.status_mut() = StatusCode::OK;
                            response.headers_mut().remove(header::SEC_WEBSOCKET_ACCEPT);
                            return Ok(response);
                        }
                        return Ok(respond_upgraded(response, downstream_version, down.via));
                    }
                    return respond(response, downstream_version, down.via).map_err(|e| {
                        let failure =
                            failure(Fault::BadResponse(BadResponse::Framing), Step::ResponseHead);
                        warn(
                            &failure,
                            &down.request_id,
                            "sent a response of unknown length",
                            &e.to_string(),
                        );
                        ProxyError::Forwarded(failure)
                    });
                }
                None => {
                    let failure = failure(Fault::Timeout, Step::ResponseHead);
                    warn(
                        &failure,
                        &down.request_id,
                        "timed out",
                        &format!("no response headers within {:?}", upstream.response_timeout),
                    );
                    return Err(ProxyError::Forwarded(failure));
                }
                Some(Err(SendError { failure, unsent })) => {
                    if failure.is_refusal() {
                        upstream.eject(i, &failure);
                    }
                    // Sent again, once, to another target: only when nothing of it was
                    // sent and it carries no body that would have to be sent twice.
                    let again = failure.retry_safe()
                        && failure.fault() != Fault::NoDescriptor
                        && retriable
                        && tried.is_none();
                    match unsent {
                        Some(back) if again => {
                            if failure.is_refusal() {
                                // The refusal was logged (at warn) by the ejection.
                                tracing::debug!(
                                    upstream = %failure.upstream(),
                                    addr = %failure.authority(),
                                    error = %failure.detail(),
                                    "connect failed before the request was sent; trying another target"
                                );
                            } else {
                                warn(
                                    &failure,
                                    &down.request_id,
                                    "failed; trying another target",
                                    &failure.detail(),
                                );
                            }
                            tried = Some(i);
                            request = back;
                            continue;
                        }
                        _ => {}
                    }
                    failure
                }
            };
            log(&failure, &down.request_id);
            return Err(ProxyError::Forwarded(failure));
        }
    }
}

/// The WARN line of a failed exchange: `upstream WHAT`, with the upstream, the target
/// tried, the request id and `detail` (what said so, as text).
fn warn(failure: &ForwardError, request_id: &HeaderValue, what: &str, detail: &str) {
    let request_id = request_id.to_str().unwrap_or("-");
    tracing::warn!(
        upstream = %failure.upstream(),
        addr = %failure.authority(),
        request_id,
        error = %detail,
        "upstream {what}"
    );
}

/// The log line of a forwarded request that failed in the pool, by what failed: the
/// upstream's failures at warn, a spent descriptor budget at warn once a second, the
/// client's body at debug (or not at all when it was too large).
fn log(failure: &ForwardError, request_id: &HeaderValue) {
    match failure.fault() {
        Fault::NoDescriptor => {
            static LOG: crate::logging::Throttle = crate::logging::Throttle::new();
            if let Some(suppressed) = LOG.due(1_000) {
                tracing::warn!(
                    upstream = %failure.upstream(),
                    addr = %failure.authority(),
                    suppressed,
                    "no descriptor left for an upstream connection (open-file limit); answered 503"
                );
            }
        }
        // The client's body went past the route's limit: its fault, not the upstream's.
        Fault::Body(BodyFailure::TooLarge(_)) => {}
        Fault::Body(BodyFailure::TimedOut(_)) => tracing::debug!(
            upstream = %failure.upstream(),
            request_id = request_id.to_str().unwrap_or("-"),
            "request body stopped arriving (server.body_timeout)"
        ),
        Fault::Body(BodyFailure::Unreadable) => tracing::debug!(
            upstream = %failure.upstream(),
            request_id = request_id.to_str().unwrap_or("-"),
            error = %failure.detail(),
            "client request body failed"
        ),
        Fault::Timeout => warn(failure, request_id, "timed out", &failure.detail()),
        // The upstream answered, with a head that cannot be passed on: say so.
        Fault::BadResponse(_) => warn(
            failure,
            request_id,
            "sent a bad response",
            &failure.detail(),
        ),
        Fault::Failed => warn(failure, request_id, "failed", &failure.detail()),
    }
}

/// Methods whose request may be sent again (RFC 9110 §9.2.2), when it has no body.
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE
    )
}

/// The size of a header list as HTTP/2 counts it (RFC 9113 §6.5.2): each field's
/// name and value, plus 32, in bytes.
fn head_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 32)
        .sum()
}
