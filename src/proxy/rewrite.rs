//! What the gateway changes in what it passes on: the request head as the upstream
//! gets it (hop-by-hop headers, `Via`, `X-Forwarded-*`, `X-Real-IP`, its URI and
//! `Host` for the target), and the response head as the client gets it.

use super::downstream::Downstream;
use super::error::ProxyError;
use super::peer::Peer;
use super::pool::PooledBody;
use super::upstream::Target;
use super::Body;
use crate::config::UpstreamProtocol;
use crate::http::strip_hop_by_hop;
use crate::wire::Incoming;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery};
use http::{Method, Request, Response, Uri, Version};
use http_body::Body as _;
use http_body_util::BodyExt;

/// Rewrite the head of a request for `protocol`'s upstream: hop-by-hop headers out (but
/// `TE: trailers`), `Via`, the upgrade asked (`upgrade`; `h2_websocket`: an HTTP/2
/// WebSocket turned into the HTTP/1.1 handshake), `Transfer-Encoding: chunked` for a
/// `body` of unknown length, and the `X-Forwarded-*` and `X-Real-IP` headers of `down`
/// (`host`: the Host the edge settled).
#[inline]
pub(super) fn request_head(
    parts: &mut http::request::Parts,
    body: &Incoming,
    protocol: UpstreamProtocol,
    upgrade: Option<&HeaderValue>,
    h2_websocket: bool,
    host: Option<&HeaderValue>,
    down: &Downstream<'_>,
) {
    // `TE: trailers` is hop-by-hop, yet says what the upstream may send: passed on
    // (only that value), as gRPC servers require.
    let te_trailers = crate::http::hop::strip_request_hop_by_hop(&mut parts.headers);
    let h = &mut parts.headers;
    if te_trailers {
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        if protocol == UpstreamProtocol::Http1 {
            h.append(header::CONNECTION, HeaderValue::from_static("te"));
        }
    }
    if let Some(via) = down.via {
        via.append(h, parts.version);
    }
    if let Some(protocol) = upgrade {
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
    if protocol == UpstreamProtocol::Http1
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
    if let Some(host) = host {
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
}

/// Point `req` at `target`: for HTTP/1.1 an origin-form URI (`/BASE/path?query`, or the
/// asterisk-form `*` as it came) and `Host`; for HTTP/2 an absolute URI whose authority
/// is the client's Host (the target's when the client sent none), and no `Host` header.
pub(super) fn address(
    protocol: UpstreamProtocol,
    target: &Target,
    path: &PathAndQuery,
    host: Option<&HeaderValue>,
    req: &mut Request<super::body::RequestBody>,
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

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(super) static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
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

/// A 101 answer to the client: the upstream's, with its `Upgrade` and `Connection`.
pub(super) fn respond_upgraded(
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
pub(super) fn respond(
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
pub(super) fn respond_switched(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_is_appended_to_every_forwarded_for_received() {
        let peer = Peer::new("192.0.2.7:4000".parse().unwrap(), None);
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
}
