//! Step 4 of the request path: forward to an upstream target, streaming both bodies.

use super::error::ProxyError;
use super::pool::{Pool, PoolError};
use super::Body;
use crate::config::{Problems, UpstreamConfig};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One `http://HOST:PORT[/BASE]` target.
#[derive(Debug, Clone)]
struct Target {
    authority: Authority,
    /// Path prepended to the request's path, without a trailing `/` ("" for none).
    base_path: String,
}

/// A named set of targets, used round robin, each with its pool of keep-alive
/// connections.
#[derive(Debug)]
pub struct Upstream {
    /// The `[[upstreams]]` name (an `Arc` so that metric labels share it).
    pub name: Arc<str>,
    targets: Vec<(Target, Arc<Pool>)>,
    next: AtomicUsize,
    response_timeout: Duration,
    /// `upstreams.cost_header` (lowercase): the response header in which the upstream
    /// says what a request cost, in cost units. `None`: off.
    pub cost_header: Option<HeaderName>,
    /// Warnings about invalid cost headers: at most one per [`COST_WARN_INTERVAL_MS`].
    cost_warnings: crate::logging::Throttle,
}

/// Idle keep-alive connections kept per target.
const MAX_IDLE_PER_TARGET: usize = 256;
/// How long an idle connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Milliseconds between two warnings about an upstream's invalid cost headers.
pub const COST_WARN_INTERVAL_MS: u64 = 10_000;

impl Upstream {
    /// Build from config (no I/O), recording problems under `upstreams[index]`.
    pub fn build(index: usize, cfg: &UpstreamConfig, problems: &mut Problems) -> Option<Self> {
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
        let targets = targets
            .into_iter()
            .map(|t: Target| {
                let pool = Pool::new(
                    t.authority.clone(),
                    MAX_IDLE_PER_TARGET,
                    IDLE_TIMEOUT,
                    cfg.connect_timeout.0,
                );
                (t, pool)
            })
            .collect();
        Some(Self {
            name: cfg.name.as_str().into(),
            targets,
            next: AtomicUsize::new(0),
            response_timeout: cfg.response_timeout.0,
            cost_header,
            cost_warnings: crate::logging::Throttle::default(),
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

    fn pick(&self) -> &(Target, Arc<Pool>) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.targets.len();
        &self.targets[i]
    }
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
    match uri.scheme() {
        Some(scheme) if *scheme == Scheme::HTTP => {}
        Some(scheme) if *scheme == Scheme::HTTPS => {
            return Err(format!(
                "{s:?}: https upstreams are not supported yet (TLS comes later)"
            ))
        }
        _ => return Err(format!("{s:?}: expected http://HOST:PORT")),
    }
    let authority = uri
        .authority()
        .cloned()
        .ok_or_else(|| format!("{s:?} has no host"))?;
    if uri.query().is_some() {
        return Err(format!("{s:?}: a target may not have a query string"));
    }
    let base_path = uri.path().trim_end_matches('/').to_string();
    Ok(Target {
        authority,
        base_path,
    })
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1), and are
/// never forwarded.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Whether `name` is hop-by-hop whatever `Connection` says.
fn always_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || name.as_str().starts_with("proxy-")
}

/// Remove hop-by-hop headers: the fixed list, every `Proxy-*` header, and every header
/// named in `Connection`. One pass over the names finds what to remove; most messages
/// have nothing to remove or only `Connection` itself.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let mut doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|name| always_hop_by_hop(name))
        .cloned()
        .collect();
    if doomed.is_empty() {
        return;
    }
    doomed.extend(
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| {
                HeaderName::from_bytes(name.trim().to_ascii_lowercase().as_bytes()).ok()
            }),
    );
    for name in doomed {
        headers.remove(name);
    }
}

/// What the forwarder needs to know about the downstream connection.
#[derive(Debug, Clone)]
pub struct Downstream<'a> {
    /// The socket peer: its IP, rendered once per connection.
    pub peer: &'a Peer,
    /// Whether the peer is a trusted proxy (its X-Forwarded-Proto/-Host are kept).
    pub peer_trusted: bool,
    /// `"http"` (or `"https"` once TLS exists).
    pub scheme: &'static str,
    /// The request id, named in the log line of an upstream failure.
    pub request_id: HeaderValue,
}

/// Send `req` to the next target of `upstream` and return its response, whose body
/// streams from the upstream as the client reads it.
///
/// Errors: [`ProxyError::UpstreamTimeout`] when the connect or the response headers take
/// longer than configured (504); [`ProxyError::UpstreamUnreachable`] when the target
/// refuses, resets or cannot be reached (502).
pub async fn forward(
    upstream: &Upstream,
    req: Request<Incoming>,
    down: Downstream<'_>,
) -> Result<Response<Body>, ProxyError> {
    let (target, pool) = upstream.pick();
    let (mut parts, body) = req.into_parts();
    let downstream_version = parts.version;

    // The Host the client asked for (HTTP/2 carries it in the URI's authority).
    let host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });

    let path = parts
        .uri
        .path_and_query()
        .map(PathAndQuery::as_str)
        .unwrap_or("/");
    // Origin-form (`/path?query`): the request line of a request to an origin server.
    let uri = if target.base_path.is_empty() {
        Uri::from_maybe_shared(Bytes::copy_from_slice(path.as_bytes()))
    } else {
        Uri::try_from(format!("{}{}", target.base_path, path))
    };
    parts.uri =
        uri.map_err(|e| ProxyError::BadRequest(format!("cannot build upstream URI: {e}")))?;
    parts.version = Version::HTTP_11;

    strip_hop_by_hop(&mut parts.headers);
    let h = &mut parts.headers;
    match &host {
        Some(host) => h.insert(header::HOST, host.clone()),
        // HTTP/1.0 without Host: name the target.
        None => h.insert(
            header::HOST,
            HeaderValue::from_str(target.authority.as_str())
                .unwrap_or(HeaderValue::from_static("localhost")),
        ),
    };
    append_forwarded_for(h, down.peer);
    if !down.peer_trusted || !h.contains_key(&X_FORWARDED_PROTO) {
        h.insert(
            X_FORWARDED_PROTO.clone(),
            HeaderValue::from_static(down.scheme),
        );
    }
    if let Some(host) = host {
        if !down.peer_trusted || !h.contains_key(&X_FORWARDED_HOST) {
            h.insert(X_FORWARDED_HOST.clone(), host);
        }
    }

    let request = Request::from_parts(parts, body);
    let failed = |what: &str, detail: String| {
        tracing::warn!(
            upstream = %upstream.name,
            addr = %target.authority,
            request_id = down.request_id.to_str().unwrap_or("-"),
            error = %detail,
            "upstream {what}"
        );
    };
    let response = match tokio::time::timeout(upstream.response_timeout, pool.send(request)).await {
        Err(_) => {
            failed(
                "timed out",
                format!("no response headers within {:?}", upstream.response_timeout),
            );
            return Err(ProxyError::UpstreamTimeout(upstream.name.to_string()));
        }
        Ok(Err(e)) if matches!(e, PoolError::ConnectTimeout(_)) || is_timeout(&e) => {
            failed("timed out", error_chain(&e));
            return Err(ProxyError::UpstreamTimeout(upstream.name.to_string()));
        }
        Ok(Err(e)) => {
            let detail = error_chain(&e);
            failed("failed", detail.clone());
            return Err(ProxyError::UpstreamUnreachable(
                upstream.name.to_string(),
                detail,
            ));
        }
        Ok(Ok(r)) => r,
    };
    let (mut parts, body) = response.into_parts();
    // Answer in the client's HTTP version, whatever the upstream spoke.
    parts.version = downstream_version;
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, body.boxed()))
}

/// The client end of a downstream connection, with what the forwarder adds for it
/// rendered once per connection rather than once per request.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The socket address.
    pub addr: std::net::SocketAddr,
    /// The IP as a header value (`X-Forwarded-For` when the client sent none).
    ip_header: HeaderValue,
}

impl Peer {
    /// Describe the peer at `addr`.
    pub fn new(addr: std::net::SocketAddr) -> Self {
        let ip_header = HeaderValue::from_str(&addr.ip().to_string())
            .unwrap_or(HeaderValue::from_static("unknown"));
        Self { addr, ip_header }
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
fn append_forwarded_for(h: &mut HeaderMap, peer: &Peer) {
    let mut prior = h.get_all(&X_FORWARDED_FOR).iter();
    let value = match (prior.next(), prior.next()) {
        (None, _) => peer.ip_header.clone(),
        (Some(one), None) => {
            let mut v = Vec::with_capacity(one.len() + 2 + peer.ip_header.len());
            v.extend_from_slice(one.as_bytes());
            v.extend_from_slice(b", ");
            v.extend_from_slice(peer.ip_header.as_bytes());
            match HeaderValue::from_bytes(&v) {
                Ok(v) => v,
                Err(_) => return,
            }
        }
        (Some(_), Some(_)) => {
            let all: Vec<&[u8]> = h
                .get_all(&X_FORWARDED_FOR)
                .iter()
                .map(HeaderValue::as_bytes)
                .chain([peer.ip_header.as_bytes()])
                .collect();
            match HeaderValue::from_bytes(&all.join(&b", "[..])) {
                Ok(v) => v,
                Err(_) => return,
            }
        }
    };
    h.insert(X_FORWARDED_FOR.clone(), value);
}

fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        out.push_str(": ");
        out.push_str(&err.to_string());
        cur = err.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_connection_listed() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("x-private", "1"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("upgrade", "websocket"),
            ("x-kept", "yes"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-kept"]);
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
    fn targets_parse() {
        let t = parse_target("http://127.0.0.1:9000/base/").unwrap();
        assert_eq!(t.authority.as_str(), "127.0.0.1:9000");
        assert_eq!(t.base_path, "/base");
        assert!(parse_target("https://x")
            .unwrap_err()
            .contains("not supported yet"));
        assert!(parse_target("ftp://x").is_err());
    }
}
