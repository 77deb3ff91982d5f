//! Step 4 of the request path: forward to an upstream target, streaming both bodies.

use super::error::ProxyError;
use super::Body;
use crate::config::{Problems, UpstreamConfig};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// One `http://HOST:PORT[/BASE]` target.
#[derive(Debug, Clone)]
struct Target {
    authority: Authority,
    /// Path prepended to the request's path, without a trailing `/` ("" for none).
    base_path: String,
}

/// A named pool of targets, used round robin through one pooled keep-alive client.
#[derive(Debug)]
pub struct Upstream {
    /// The `[[upstreams]]` name.
    pub name: String,
    targets: Vec<Target>,
    next: AtomicUsize,
    client: Client<HttpConnector, Incoming>,
    response_timeout: Duration,
}

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
        if problems.errors.len() != before {
            return None;
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.connect_timeout.0));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(256)
            .build(connector);
        Some(Self {
            name: cfg.name.clone(),
            targets,
            next: AtomicUsize::new(0),
            client,
            response_timeout: cfg.response_timeout.0,
        })
    }

    fn pick(&self) -> &Target {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.targets.len();
        &self.targets[i]
    }
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

/// Remove hop-by-hop headers: the fixed list, every `Proxy-*` header, and every header
/// named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().to_ascii_lowercase().as_bytes()).ok())
        .collect();
    for name in listed.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy {
        headers.remove(name);
    }
}

/// What the forwarder needs to know about the downstream connection.
#[derive(Debug, Clone, Copy)]
pub struct Downstream {
    /// The socket peer's IP.
    pub peer: IpAddr,
    /// Whether the peer is a trusted proxy (its X-Forwarded-Proto/-Host are kept).
    pub peer_trusted: bool,
    /// `"http"` (or `"https"` once TLS exists).
    pub scheme: &'static str,
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
    down: Downstream,
) -> Result<Response<Body>, ProxyError> {
    let target = upstream.pick();
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
    let path = format!("{}{}", target.base_path, path);
    parts.uri = Uri::builder()
        .scheme(Scheme::HTTP)
        .authority(target.authority.clone())
        .path_and_query(path)
        .build()
        .map_err(|e| ProxyError::BadRequest(format!("cannot build upstream URI: {e}")))?;
    parts.version = Version::HTTP_11;

    strip_hop_by_hop(&mut parts.headers);
    let h = &mut parts.headers;
    if let Some(host) = &host {
        h.insert(header::HOST, host.clone());
    }
    append_forwarded_for(h, down.peer);
    if !down.peer_trusted || !h.contains_key("x-forwarded-proto") {
        h.insert("x-forwarded-proto", HeaderValue::from_static(down.scheme));
    }
    if let Some(host) = host {
        if !down.peer_trusted || !h.contains_key("x-forwarded-host") {
            h.insert("x-forwarded-host", host);
        }
    }

    let request = Request::from_parts(parts, body);
    let response =
        match tokio::time::timeout(upstream.response_timeout, upstream.client.request(request))
            .await
        {
            Err(_) => return Err(ProxyError::UpstreamTimeout(upstream.name.clone())),
            Ok(Err(e)) if is_timeout(&e) => {
                return Err(ProxyError::UpstreamTimeout(upstream.name.clone()))
            }
            Ok(Err(e)) => {
                return Err(ProxyError::UpstreamUnreachable(
                    upstream.name.clone(),
                    error_chain(&e),
                ))
            }
            Ok(Ok(r)) => r,
        };
    let (mut parts, body) = response.into_parts();
    // Answer in the client's HTTP version, whatever the upstream spoke.
    parts.version = downstream_version;
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, body.boxed()))
}

fn append_forwarded_for(h: &mut HeaderMap, peer: IpAddr) {
    let prior: Vec<&str> = h
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let value = if prior.is_empty() {
        peer.to_string()
    } else {
        format!("{}, {}", prior.join(", "), peer)
    };
    if let Ok(v) = HeaderValue::from_str(&value) {
        h.insert("x-forwarded-for", v);
    }
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
