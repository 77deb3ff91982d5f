//! Step 4 of the request path: forward to an upstream target, streaming both bodies.

use super::body::RequestBody;
use super::error::{causes, BadResponse, ProxyError};
use super::pool::{Connector, Pool, PoolError, PooledBody, SendError};
use super::Body;
use crate::config::{Problems, UpstreamConfig, UpstreamProtocol};
use crate::wire::Incoming;
use crate::http::upgrade::Upgrade;
use crate::http::{always_hop_by_hop, strip_hop_by_hop};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// One `http[s]://HOST:PORT[/BASE]` target.
#[derive(Debug, Clone)]
struct Target {
    /// `http` or `https`.
    scheme: Scheme,
    authority: Authority,
    /// Path prepended to the request's path, without a trailing `/` ("" for none).
    base_path: String,
}

/// A target with its connections and its passive health.
#[derive(Debug)]
struct Member {
    target: Target,
    pool: Arc<Pool>,
    /// Consecutive refused connections (reset by any response).
    failures: AtomicU32,
    /// Skipped until this time, in milliseconds since [`epoch`] (0: not ejected).
    ejected_until_ms: AtomicU64,
}

/// The longest a target is ejected for, however many times in a row it refused.
pub const MAX_EJECTION: Duration = Duration::from_secs(300);

/// The process's reference instant for ejection times.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl Member {
    fn ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }
}

/// A named set of targets, used round robin (skipping ejected ones), each with its
/// connections.
#[derive(Debug)]
pub struct Upstream {
    /// The `[[upstreams]]` name (an `Arc` so that metric labels share it).
    pub name: Arc<str>,
    targets: Vec<Member>,
    next: AtomicUsize,
    response_timeout: Duration,
    protocol: UpstreamProtocol,
    /// `upstreams.eject_for`: the first ejection of a target that refused a connection.
    eject_for: Duration,
    /// `upstreams.cost_header` (lowercase): the response header in which the upstream
    /// says what a request cost, in cost units. `None`: off.
    pub cost_header: Option<HeaderName>,
    /// Warnings about invalid cost headers: at most one per [`COST_WARN_INTERVAL_MS`].
    cost_warnings: crate::logging::Throttle,
    /// `upstreams.max_response_header_bytes`: a larger response head gives 502.
    max_response_header_bytes: usize,
}

/// Idle keep-alive connections kept per target.
const MAX_IDLE_PER_TARGET: usize = 256;
/// How long an idle connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Milliseconds between two warnings about an upstream's invalid cost headers.
pub const COST_WARN_INTERVAL_MS: u64 = 10_000;

impl Upstream {
    /// Build from config, recording problems under `upstreams[index]`. The only I/O is
    /// reading the PEM files of `https://` targets (`ca`, `client_cert`, `client_key`,
    /// relative to `base_dir`, the config file's directory) or the system's roots.
    /// `pool_parts`: the parts of each target's connection pool (one per `per_core`
    /// worker, see [`Pool::new`]).
    pub fn build(
        index: usize,
        cfg: &UpstreamConfig,
        base_dir: &Path,
        pool_parts: usize,
        problems: &mut Problems,
    ) -> Option<Self> {
        let at = format!("upstreams[{index}]");
        let before = problems.errors.len();
        if cfg.name.trim().is_empty() {
            problems.error(format!("{at}.name"), "must not be empty");
        }
        if cfg.targets.is_empty() {
            problems.error(
                format!("{at}.targets"),
                "needs at least one target, e.g. \"http://127.0.0.1:9000\"",
            );
        }
        let mut targets = Vec::new();
        for (j, t) in cfg.targets.iter().enumerate() {
            match parse_target(t) {
                Ok(target) => targets.push(target),
                Err(msg) => problems.error(format!("{at}.targets[{j}]"), msg),
            }
        }
        if cfg.connect_timeout.0.is_zero() {
            problems.error(format!("{at}.connect_timeout"), "must be more than 0");
        }
        if cfg.response_timeout.0.is_zero() {
            problems.error(format!("{at}.response_timeout"), "must be more than 0");
        }
        if cfg.eject_for.0.is_zero() {
            problems.error(format!("{at}.eject_for"), "must be more than 0");
        }
        if cfg.max_response_header_bytes < 1024 {
            problems.error(
                format!("{at}.max_response_header_bytes"),
                "must be at least 1024 (bytes)",
            );
        }
        let any_tls = targets.iter().any(|t: &Target| t.scheme == Scheme::HTTPS);
        let tls_keys = [
            ("ca", cfg.ca.is_some()),
            ("client_cert", cfg.client_cert.is_some()),
            ("client_key", cfg.client_key.is_some()),
        ];
        let tls = if any_tls {
            super::tls::client_config(&at, cfg, base_dir, problems)
        } else {
            for (key, set) in tls_keys {
                if set && !targets.is_empty() {
                    problems.error(
                        format!("{at}.{key}"),
                        "applies to https:// targets only, and this upstream has none",
                    );
                }
            }
            None
        };
        let cost_header = cfg.cost_header.as_ref().and_then(|h| {
            match HeaderName::from_bytes(h.to_ascii_lowercase().as_bytes()) {
                Ok(name) if always_hop_by_hop(&name) => {
                    problems.error(
                        format!("{at}.cost_header"),
                        format!("{h:?} is a hop-by-hop header, which is never passed on: pick another name, e.g. \"x-tollgate-cost\""),
                    );
                    None
                }
                Ok(name) => Some(name),
                Err(_) => {
                    problems.error(
                        format!("{at}.cost_header"),
                        format!("{h:?} is not a valid header name (e.g. \"x-tollgate-cost\")"),
                    );
                    None
                }
            }
        });
        if problems.errors.len() != before {
            return None;
        }
        let mut members = Vec::with_capacity(targets.len());
        for (j, t) in targets.into_iter().enumerate() {
            let tls = match (&tls, t.scheme == Scheme::HTTPS) {
                (Some(config), true) => {
                    let host = t
                        .authority
                        .host()
                        .trim_start_matches('[')
                        .trim_end_matches(']');
                    match rustls::pki_types::ServerName::try_from(host.to_string()) {
                        Ok(name) => Some((tokio_rustls::TlsConnector::from(config.clone()), name)),
                        Err(e) => {
                            problems.error(
                                format!("{at}.targets[{j}]"),
                                format!("{host:?} cannot be a TLS server name: {e}"),
                            );
                            return None;
                        }
                    }
                }
                _ => None,
            };
            let connector = Connector {
                authority: t.authority.clone(),
                connect_timeout: cfg.connect_timeout.0,
                tls,
                protocol: cfg.protocol,
                max_response_header_bytes: cfg.max_response_header_bytes,
            };
            members.push(Member {
                target: t,
                pool: Pool::new(connector, MAX_IDLE_PER_TARGET, IDLE_TIMEOUT, pool_parts),
                failures: AtomicU32::new(0),
                ejected_until_ms: AtomicU64::new(0),
            });
        }
        Some(Self {
            name: cfg.name.as_str().into(),
            targets: members,
            next: AtomicUsize::new(0),
            response_timeout: cfg.response_timeout.0,
            protocol: cfg.protocol,
            eject_for: cfg.eject_for.0,
            cost_header,
            cost_warnings: crate::logging::Throttle::default(),
            max_response_header_bytes: cfg.max_response_header_bytes,
        })
    }

    /// Remove the cost header (`upstreams.cost_header`) from a response of this upstream
    /// and return the cost it gives, in cost units: `Some` for one value that is a
    /// non-negative integer; `None` when the upstream has no cost header, or the response
    /// none, or an invalid one (several values, not an integer), which is logged at warn
    /// (at most once per [`COST_WARN_INTERVAL_MS`] per upstream). The header is removed
    /// whatever it holds.
    pub fn take_cost(&self, headers: &mut HeaderMap) -> Option<u64> {
        let name = self.cost_header.as_ref()?;
        let mut values = headers.get_all(name).iter();
        let value = values.next()?;
        let cost = match values.next() {
            None => parse_cost(value.as_bytes()),
            Some(_) => None,
        };
        if cost.is_none() {
            if let Some(suppressed) = self.cost_warnings.due(COST_WARN_INTERVAL_MS) {
                let shown = &value.as_bytes()[..value.len().min(64)];
                tracing::warn!(
                    upstream = %self.name,
                    header = %name,
                    value = %String::from_utf8_lossy(shown),
                    suppressed,
                    "invalid cost header (expected one non-negative integer); charging the route's cost"
                );
            }
        }
        headers.remove(name);
        cost
    }

    /// The next target round robin, skipping ejected ones and `not` while any other is
    /// available; when all are ejected, the next one anyway. A one-target upstream is never
    /// asked to skip its target (requests are retried only with several targets).
    fn pick(&self, not: Option<usize>) -> usize {
        let n = self.targets.len();
        if n == 1 {
            // One target: nothing to skip to (and no clock read on the hot path).
            return 0;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let now = now_ms();
        let candidates = (0..n).map(|k| (start + k) % n).filter(|&i| Some(i) != not);
        let mut fallback = None;
        for i in candidates {
            if !self.targets[i].ejected(now) {
                return i;
            }
            fallback.get_or_insert(i);
        }
        // At least one of several targets is not `not`.
        fallback.unwrap_or(start)
    }

    /// Record that target `i` refused a connection: eject it for `eject_for`, doubled
    /// per earlier consecutive refusal, at most [`MAX_EJECTION`].
    fn eject(&self, i: usize, error: &PoolError) {
        let m = &self.targets[i];
        let failures = m.failures.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        let back_off = back_off(self.eject_for, failures);
        let until =
            now_ms().saturating_add(u64::try_from(back_off.as_millis()).unwrap_or(u64::MAX));
        m.ejected_until_ms.store(until, Ordering::Relaxed);
        tracing::warn!(
            upstream = %self.name,
            target = %m.target.authority,
            failures,
            eject_ms = u64::try_from(back_off.as_millis()).unwrap_or(u64::MAX),
            error = %error_chain(error),
            "upstream target ejected"
        );
    }

    /// Record that target `i` answered: it is healthy again.
    fn healthy(&self, i: usize) {
        let m = &self.targets[i];
        if m.failures.load(Ordering::Relaxed) != 0 {
            m.failures.store(0, Ordering::Relaxed);
            m.ejected_until_ms.store(0, Ordering::Relaxed);
        }
    }
}

/// How long a target is ejected after its `failures`-th consecutive refusal (from 1):
/// `eject_for`, doubled per earlier refusal, at most [`MAX_EJECTION`].
fn back_off(eject_for: Duration, failures: u32) -> Duration {
    let doubling = 1u32 << failures.saturating_sub(1).min(16);
    eject_for.saturating_mul(doubling).min(MAX_EJECTION)
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

/// A cost header's value: ASCII digits only (no sign, no space), fitting a `u64`.
fn parse_cost(value: &[u8]) -> Option<u64> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

fn parse_target(s: &str) -> Result<Target, String> {
    let uri: Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    let scheme = match uri.scheme() {
        Some(scheme) if *scheme == Scheme::HTTP || *scheme == Scheme::HTTPS => scheme.clone(),
        _ => {
            return Err(format!(
                "{s:?}: expected http://HOST:PORT or https://HOST:PORT"
            ))
        }
    };
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| format!("{s:?} has no host"))?;
    if uri.query().is_some() {
        return Err(format!("{s:?}: a target may not have a query string"));
    }
    let base_path = uri.path().trim_end_matches('/').to_string();
    Ok(Target {
        scheme,
        authority,
        base_path,
    })
}

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
}

/// Send `req` to the next target of `upstream` and return its response, whose body
/// streams from the upstream as the client reads it.
///
/// Errors: [`ProxyError::UpstreamTimeout`] when the connect or the response headers take
/// longer than configured (504); [`ProxyError::UpstreamUnreachable`] when the target
/// refuses, resets or cannot be reached (502); [`ProxyError::Overloaded`] when the
/// descriptor budget has no room for an upstream socket, or `server.max_tunnels` are
/// open for an upgrade (503); [`ProxyError::BodyTimeout`] when the request body stops
/// arriving for `server.body_timeout` before the response (408).
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

        // `TE: trailers` is hop-by-hop, yet says what the upstream may send: passed on
        // (only that value), as gRPC servers require.
        let te_trailers = crate::http::hop::strip_request_hop_by_hop(&mut parts.headers);
        let h = &mut parts.headers;
        if te_trailers {
            h.insert(header::TE, HeaderValue::from_static("trailers"));
            if upstream.protocol == UpstreamProtocol::Http1 {
                h.append(header::CONNECTION, HeaderValue::from_static("te"));
            }
        }
        if let Some(via) = down.via {
            via.append(h, downstream_version);
        }
        if let Some(protocol) = &upgrade {
            h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            h.insert(header::UPGRADE, protocol.clone());
        }
        if h2_websocket {
            // RFC 8441 to RFC 6455: the HTTP/1.1 handshake the upstream expects.
            parts.method = Method::GET;
            parts.extensions.remove::<hyper::ext::Protocol>();
            let h = &mut parts.headers;
            h.insert(header::SEC_WEBSOCKET_KEY, websocket_key());
            if !h.contains_key(header::SEC_WEBSOCKET_VERSION) {
                h.insert(
                    header::SEC_WEBSOCKET_VERSION,
                    HeaderValue::from_static("13"),
                );
            }
        }
        let h = &mut parts.headers;
        if upstream.protocol == UpstreamProtocol::Http1
            && !body.is_end_stream()
            && body.size_hint().exact().is_none()
            && !h.contains_key(header::CONTENT_LENGTH)
        {
            // A body of unknown length (chunked, or HTTP/2 DATA without Content-Length):
            // hyper's client sends a GET or HEAD without it unless told, and the upstream
            // must get what the client sent, never a silently shortened request.
            h.insert(
                header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
        append_forwarded_for(h, down.peer);
        if !down.peer_trusted || !h.contains_key(&X_FORWARDED_PROTO) {
            h.insert(
                X_FORWARDED_PROTO.clone(),
                HeaderValue::from_static(down.scheme),
            );
        }
        if let Some(host) = &host {
            if !down.peer_trusted || !h.contains_key(&X_FORWARDED_HOST) {
                h.insert(X_FORWARDED_HOST.clone(), host.clone());
            }
        }
        // The client the limiter used: what an upstream reading X-Real-IP must see (most
        // often the peer, whose address is rendered once per connection).
        let real_ip = if down.client_ip == down.peer.ip() {
            Some(down.peer.ip_header.clone())
        } else {
            HeaderValue::from_str(&down.client_ip.to_string()).ok()
        };
        if let Some(ip) = real_ip {
            h.insert(crate::http::X_REAL_IP.clone(), ip);
        }
        // Sent again to another target only when nothing of it was sent and it carries no
        // body that would have to be sent twice.
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
            let target = &upstream.targets[i].target;
            address(
                upstream.protocol,
                target,
                &path,
                host.as_ref(),
                &mut request,
            )?;
            let failed = |what: &str, detail: String| {
                tracing::warn!(
                    upstream = %upstream.name,
                    addr = %target.authority,
                    request_id = down.request_id.to_str().unwrap_or("-"),
                    error = %detail,
                    "upstream {what}"
                );
            };
            let send =
                upstream.targets[i]
                    .pool
                    .send(request, down.budget, Some(&down.peer.upstream));
            let sent = if downstream_version < Version::HTTP_2 {
                // HTTP/1 serves one request of a connection at a time: its timer is theirs.
                down.peer.response_timer.within(deadline, send).await
            } else {
                tokio::time::timeout_at(deadline, send).await.ok()
            };
            let error = match sent {
                Some(Ok(mut response)) => {
                    upstream.healthy(i);
                    let head = head_bytes(response.headers());
                    if head > upstream.max_response_header_bytes {
                        // HTTP/2 enforces this while decoding; HTTP/1.1 here, on the
                        // parsed head, so that both protocols draw the same line.
                        failed(
                            "sent a response head past upstreams.max_response_header_bytes",
                            format!("{head} bytes, limit {}", upstream.max_response_header_bytes),
                        );
                        return Err(ProxyError::UpstreamBadResponse(
                            upstream.name.to_string(),
                            BadResponse::HeadersTooLarge,
                        ));
                    }
                    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                        let offered = upgrade.as_ref();
                        let answered = response.headers().get(header::UPGRADE);
                        if !offered
                            .is_some_and(|o| crate::http::upgrade::switched_to_offered(o, answered))
                        {
                            // No tunnel to a protocol that was not asked for (and allowed).
                            failed(
                                "switched protocols without being asked",
                                format!("101 with Upgrade {answered:?}, offered {offered:?}"),
                            );
                            return Err(ProxyError::UpstreamUnreachable(
                                upstream.name.to_string(),
                                "the upstream switched to a protocol that was not asked for".into(),
                            ));
                        }
                    }
                    if let (Some((client, slot)), StatusCode::SWITCHING_PROTOCOLS) =
                        (client_upgrade, response.status())
                    {
                        let upstream_side = hyper::upgrade::on(&mut response);
                        tokio::spawn(tunnel(
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
                        failed("sent a response of unknown length", e.to_string());
                        ProxyError::UpstreamBadResponse(
                            upstream.name.to_string(),
                            BadResponse::Framing,
                        )
                    });
                }
                None => {
                    failed(
                        "timed out",
                        format!("no response headers within {:?}", upstream.response_timeout),
                    );
                    return Err(ProxyError::UpstreamTimeout(upstream.name.to_string()));
                }
                Some(Err(SendError {
                    error: PoolError::NoDescriptor(_),
                    ..
                })) => {
                    static LOG: crate::logging::Throttle = crate::logging::Throttle::new();
                    if let Some(suppressed) = LOG.due(1_000) {
                        tracing::warn!(
                            upstream = %upstream.name,
                            addr = %target.authority,
                            suppressed,
                            "no descriptor left for an upstream connection (open-file limit); answered 503"
                        );
                    }
                    return Err(ProxyError::Overloaded("too many open connections"));
                }
                Some(Err(SendError { error, unsent })) => {
                    if error.is_refusal() {
                        upstream.eject(i, &error);
                    }
                    match unsent {
                        Some(back) if retriable && tried.is_none() => {
                            if error.is_refusal() {
                                // The refusal was logged (at warn) by the ejection.
                                tracing::debug!(
                                    upstream = %upstream.name,
                                    addr = %target.authority,
                                    error = %error_chain(&error),
                                    "connect failed before the request was sent; trying another target"
                                );
                            } else {
                                failed("failed; trying another target", error_chain(&error));
                            }
                            tried = Some(i);
                            request = back;
                            continue;
                        }
                        _ => error,
                    }
                }
            };
            if let Some(super::body::TooLarge(max)) = super::body::too_large(&error) {
                // The client's body went past the route's limit: its fault, not the upstream's.
                return Err(ProxyError::BodyTooLarge(max));
            }
            if let Some(super::body::BodyTimedOut(after)) = super::body::timed_out(&error) {
                tracing::debug!(
                    upstream = %upstream.name,
                    request_id = down.request_id.to_str().unwrap_or("-"),
                    "request body stopped arriving (server.body_timeout)"
                );
                return Err(ProxyError::BodyTimeout(after));
            }
            if super::body::client_body(&error) {
                tracing::debug!(
                    upstream = %upstream.name,
                    request_id = down.request_id.to_str().unwrap_or("-"),
                    error = %error_chain(&error),
                    "client request body failed"
                );
                return Err(ProxyError::BadRequest(
                    "the request body could not be read".into(),
                ));
            }
            if matches!(error, PoolError::ConnectTimeout(_)) || is_timeout(&error) {
                failed("timed out", error_chain(&error));
                return Err(ProxyError::UpstreamTimeout(upstream.name.to_string()));
            }
            let detail = error_chain(&error);
            if let Some(bad) = BadResponse::of(&error) {
                // The upstream answered, with a head that cannot be passed on: say so.
                failed("sent a bad response", detail);
                return Err(ProxyError::UpstreamBadResponse(
                    upstream.name.to_string(),
                    bad,
                ));
            }
            failed("failed", detail.clone());
            return Err(ProxyError::UpstreamUnreachable(
                upstream.name.to_string(),
                detail,
            ));
        }
    }
}

/// Point `req` at `target`: for HTTP/1.1 an origin-form URI (`/BASE/path?query`, or the
/// asterisk-form `*` as it came) and `Host`; for HTTP/2 an absolute URI whose authority
/// is the client's Host (the target's when the client sent none), and no `Host` header.
fn address(
    protocol: UpstreamProtocol,
    target: &Target,
    path: &PathAndQuery,
    host: Option<&HeaderValue>,
    req: &mut Request<RequestBody>,
) -> Result<(), ProxyError> {
    // The asterisk-form (`OPTIONS *`) names the server, not a path: sent as it is.
    let path_and_query = if target.base_path.is_empty() || path.as_str() == "*" {
        path.clone()
    } else {
        PathAndQuery::try_from(format!("{}{}", target.base_path, path.as_str()))
            .map_err(|e| ProxyError::BadRequest(format!("cannot build upstream URI: {e}")))?
    };
    match protocol {
        UpstreamProtocol::Http1 => {
            *req.uri_mut() = Uri::from(path_and_query);
            *req.version_mut() = Version::HTTP_11;
            let value = match host {
                Some(host) => host.clone(),
                // HTTP/1.0 without Host: name the target.
                None => HeaderValue::from_str(target.authority.as_str())
                    .unwrap_or(HeaderValue::from_static("localhost")),
            };
            req.headers_mut().insert(header::HOST, value);
        }
        UpstreamProtocol::Http2 => {
            let authority = host
                .and_then(|h| Authority::try_from(h.as_bytes()).ok())
                .unwrap_or_else(|| target.authority.clone());
            let mut uri = http::uri::Parts::default();
            uri.scheme = Some(target.scheme.clone());
            uri.authority = Some(authority);
            uri.path_and_query = Some(path_and_query);
            *req.uri_mut() = Uri::from_parts(uri)
                .map_err(|e| ProxyError::BadRequest(format!("cannot build upstream URI: {e}")))?;
            *req.version_mut() = Version::HTTP_2;
            req.headers_mut().remove(header::HOST);
        }
    }
    Ok(())
}

/// A fresh `Sec-WebSocket-Key`: 16 random bytes, base64 (RFC 6455 section 4.1).
fn websocket_key() -> HeaderValue {
    use base64::Engine;
    let bytes = uuid::Uuid::new_v4().into_bytes();
    let key = base64::engine::general_purpose::STANDARD.encode(bytes);
    HeaderValue::from_str(&key).unwrap_or(HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ=="))
}

/// Copy bytes both ways between the client and the upstream once both connections
/// are upgraded, until either side closes or no byte has moved either way for
/// `idle_timeout`. `slot` (its place among `server.max_tunnels`) is held until then;
/// both sockets stay counted in the descriptor budget until they are dropped.
async fn tunnel(
    client: crate::wire::ClientSide,
    upstream: hyper::upgrade::OnUpgrade,
    mut slot: crate::budget::TunnelSlot,
    idle_timeout: Duration,
    request_id: HeaderValue,
) {
    let id = request_id.to_str().unwrap_or("-").to_string();
    let upstream = async { upstream.await.map_err(Into::into) };
    match futures_util::future::try_join(client, upstream).await {
        Ok((client, upstream)) => {
            slot.open();
            let opened = tokio::time::Instant::now();
            let last = Arc::new(AtomicU64::new(0));
            let mut client = Touch::new(client, opened, last.clone());
            let mut upstream = Touch::new(TokioIo::new(upstream), opened, last.clone());
            let copy = tokio::io::copy_bidirectional(&mut client, &mut upstream);
            tokio::pin!(copy);
            let idle = tokio::time::sleep(idle_timeout);
            tokio::pin!(idle);
            loop {
                tokio::select! {
                    copied = copy.as_mut() => {
                        match copied {
                            Ok((up, down)) => tracing::debug!(request_id = %id, bytes_up = up, bytes_down = down, "tunnel closed"),
                            Err(e) => tracing::debug!(request_id = %id, error = %e, "tunnel ended with an error"),
                        }
                        return;
                    }
                    _ = idle.as_mut() => {
                        let moved = opened + Duration::from_millis(last.load(Ordering::Relaxed));
                        let until = moved + idle_timeout;
                        if tokio::time::Instant::now() >= until {
                            tracing::debug!(request_id = %id, ?idle_timeout, "idle tunnel closed (server.tunnel_idle_timeout)");
                            return;
                        }
                        idle.as_mut().reset(until);
                    }
                }
            }
        }
        Err(e) => tracing::debug!(request_id = %id, error = %e, "upgrade failed"),
    }
}

/// One side of a tunnel, noting when it last read a byte (milliseconds since the
/// tunnel opened, shared by both sides).
struct Touch<T> {
    io: T,
    opened: tokio::time::Instant,
    last: Arc<AtomicU64>,
}

impl<T> Touch<T> {
    fn new(io: T, opened: tokio::time::Instant, last: Arc<AtomicU64>) -> Self {
        Self { io, opened, last }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Touch<T> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            let ms = u64::try_from(this.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
            this.last.store(ms, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Touch<T> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A 101 answer to the client: the upstream's, with its `Upgrade` and `Connection`.
fn respond_upgraded(
    response: Response<PooledBody>,
    downstream_version: Version,
    via: Option<&crate::http::via::Via>,
) -> Response<Body> {
    let upgrade = response.headers().get(header::UPGRADE).cloned();
    let mut response = respond_switched(response, downstream_version, via);
    let h = response.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    if let Some(upgrade) = upgrade {
        h.insert(header::UPGRADE, upgrade);
    }
    response
}

/// The upstream's response for the client: in the client's HTTP version, whatever the
/// upstream spoke, without hop-by-hop headers, with its framing headers settled for the
/// client ([`super::framing`]), with tollgate's `Via` entry for the version it came in
/// (`via`). [`super::framing::InvalidLength`] when its `Content-Length` values disagree.
fn respond(
    response: Response<PooledBody>,
    downstream_version: Version,
    via: Option<&crate::http::via::Via>,
) -> Result<Response<Body>, super::framing::InvalidLength> {
    let (mut parts, body) = response.into_parts();
    let chunked = parts.headers.contains_key(header::TRANSFER_ENCODING);
    super::framing::settle(&mut parts.headers, parts.status, chunked)?;
    Ok(relay(parts, body, downstream_version, via))
}

/// A `101` for the client ([`respond`] for a response that has no body to frame: no
/// `Content-Length`).
fn respond_switched(
    response: Response<PooledBody>,
    downstream_version: Version,
    via: Option<&crate::http::via::Via>,
) -> Response<Body> {
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    relay(parts, body, downstream_version, via)
}

/// The rest of [`respond`]: hop-by-hop headers out, `Via` in, the client's version.
fn relay(
    mut parts: http::response::Parts,
    body: PooledBody,
    downstream_version: Version,
    via: Option<&crate::http::via::Via>,
) -> Response<Body> {
    strip_hop_by_hop(&mut parts.headers);
    // Room for what the gateway adds (Via, the rate-limit headers, the request id) in
    // one growth of the map, instead of one or two as they are inserted.
    parts.headers.reserve(GATEWAY_RESPONSE_HEADERS);
    if let Some(via) = via {
        via.append(&mut parts.headers, parts.version);
    }
    parts.version = downstream_version;
    Response::from_parts(parts, body.boxed())
}

/// How many headers the gateway adds to a response at most in the usual case: `Via`,
/// five `X-RateLimit-*` (or the IETF pair), `X-Request-Id`.
const GATEWAY_RESPONSE_HEADERS: usize = 8;

/// The client end of a downstream connection, with what the forwarder adds for it
/// rendered once per connection rather than once per request.
#[derive(Debug)]
pub struct Peer {
    /// The socket address.
    pub addr: std::net::SocketAddr,
    /// The IP as a header value (`X-Forwarded-For` when the client sent none).
    ip_header: HeaderValue,
    /// The upstream connection this client connection used last, kept for its next
    /// request ([`super::pool::Affinity`]).
    pub upstream: super::pool::Affinity,
    /// The timer of `upstreams.response_timeout` for this connection's HTTP/1 requests
    /// ([`super::deadline`]).
    pub response_timer: super::deadline::ConnectionTimer,
}

impl Peer {
    /// The IP as text, rendered once per connection (what `IpAddr`'s `Display` writes).
    pub fn ip_text(&self) -> &str {
        self.ip_header.to_str().unwrap_or_default()
    }

    /// Describe the peer at `addr`.
    pub fn new(addr: std::net::SocketAddr) -> Self {
        let ip_header = HeaderValue::from_str(&addr.ip().to_string())
            .unwrap_or(HeaderValue::from_static("unknown"));
        Self {
            addr,
            ip_header,
            upstream: Default::default(),
            response_timer: Default::default(),
        }
    }

    /// The peer's IP.
    pub fn ip(&self) -> IpAddr {
        self.addr.ip()
    }
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Append the peer to `X-Forwarded-For` (joining several received headers into one).
/// One lookup of the name: most requests have none, and get the peer's address.
fn append_forwarded_for(h: &mut HeaderMap, peer: &Peer) {
    let mut prior = match h.entry(&X_FORWARDED_FOR) {
        http::header::Entry::Vacant(v) => {
            v.insert(peer.ip_header.clone());
            return;
        }
        http::header::Entry::Occupied(o) => o,
    };
    let joined: Vec<u8> = {
        let mut values = prior.iter();
        match (values.next(), values.next()) {
            (Some(one), None) => {
                let mut v = Vec::with_capacity(one.len() + 2 + peer.ip_header.len());
                v.extend_from_slice(one.as_bytes());
                v.extend_from_slice(b", ");
                v.extend_from_slice(peer.ip_header.as_bytes());
                v
            }
            _ => prior
                .iter()
                .map(HeaderValue::as_bytes)
                .chain([peer.ip_header.as_bytes()])
                .collect::<Vec<&[u8]>>()
                .join(&b", "[..]),
        }
    };
    // A value that cannot be one (it was one before) leaves the header as received.
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        prior.insert(v);
    }
}

fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    causes(e).any(|err| {
        err.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for (k, err) in causes(e).enumerate() {
        if k > 0 {
            out.push_str(": ");
        }
        // Writing to a String cannot fail.
        let _ = write!(out, "{err}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_is_appended_to_every_forwarded_for_received() {
        let peer = Peer::new("192.0.2.7:4000".parse().unwrap());
        let forwarded = |received: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in received {
                h.append(&X_FORWARDED_FOR, HeaderValue::from_static(v));
            }
            append_forwarded_for(&mut h, &peer);
            let all: Vec<_> = h.get_all(&X_FORWARDED_FOR).iter().cloned().collect();
            assert_eq!(all.len(), 1, "{all:?}");
            all[0].to_str().unwrap().to_string()
        };
        assert_eq!(forwarded(&[]), "192.0.2.7");
        assert_eq!(forwarded(&["203.0.113.5"]), "203.0.113.5, 192.0.2.7");
        assert_eq!(
            forwarded(&["203.0.113.5", "10.0.0.1, 10.0.0.2"]),
            "203.0.113.5, 10.0.0.1, 10.0.0.2, 192.0.2.7"
        );
    }

    #[test]
    fn cost_values_parse() {
        assert_eq!(parse_cost(b"0"), Some(0));
        assert_eq!(parse_cost(b"17"), Some(17));
        assert_eq!(parse_cost(b"007"), Some(7));
        for bad in [
            &b""[..],
            b"-1",
            b"+1",
            b"1.5",
            b" 1",
            b"1e3",
            b"abc",
            b"99999999999999999999",
        ] {
            assert_eq!(parse_cost(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn ejection_doubles_up_to_five_minutes() {
        let ten = Duration::from_secs(10);
        let secs: Vec<u64> = (1..=7).map(|n| back_off(ten, n).as_secs()).collect();
        assert_eq!(secs, [10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(back_off(ten, u32::MAX), MAX_EJECTION);
        assert_eq!(
            back_off(Duration::from_millis(100), 1),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn targets_parse() {
        let t = parse_target("http://127.0.0.1:9000/base/").unwrap();
        assert_eq!(t.authority.as_str(), "127.0.0.1:9000");
        assert_eq!(t.base_path, "/base");
        let t = parse_target("https://api.example.com").unwrap();
        assert_eq!(t.scheme, Scheme::HTTPS);
        assert!(parse_target("ftp://x").is_err());
    }
}
