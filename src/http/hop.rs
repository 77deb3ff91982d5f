//! Hop-by-hop headers: they describe one connection, not the message (RFC 9110
//! §7.6.1), so they are never forwarded, in either direction.

use http::header::{self, HeaderMap, HeaderName};

/// `HTTP2-Settings`: the settings of an `h2c` upgrade (RFC 7540 §3.2.1), meaningful on
/// one connection only. tollgate never forwards an `h2c` upgrade, so never this either.
pub static HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

/// Headers that are hop-by-hop whatever `Connection` says. (`Trailer` is not: it
/// declares the trailer fields of the message, which cross with it; hyper's HTTP/1.1
/// encoder sends only the trailer fields it declares.)
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    HeaderName::from_static("http2-settings"),
];

/// Whether `name` is hop-by-hop whatever `Connection` says: the fixed list above and
/// every `Proxy-*` header.
pub fn always_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || name.as_str().starts_with("proxy-")
}

/// Whether the request's `TE` accepts trailer fields (`TE: trailers`, RFC 9110
/// §10.1.4): the one `TE` value that is passed on to the upstream.
pub fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| {
            t.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("trailers"))
        })
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
            .map(str::trim)
            // The usual tokens: `keep-alive` is on the list already, `close` names no
            // header. (from_bytes folds case itself.)
            .filter(|t| !t.eq_ignore_ascii_case("keep-alive") && !t.eq_ignore_ascii_case("close"))
            .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok()),
    );
    for name in doomed {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

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
            ("http2-settings", "AAMAAABkAAQAAP__"),
            ("x-kept", "yes"),
        ] {
            h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["x-kept"]);
    }

    #[test]
    fn trailer_crosses_and_te_trailers_is_seen() {
        let mut h = HeaderMap::new();
        h.insert(header::TRAILER, HeaderValue::from_static("grpc-status"));
        h.insert(header::TE, HeaderValue::from_static("gzip, Trailers;q=1"));
        assert!(accepts_trailers(&h));
        strip_hop_by_hop(&mut h);
        assert_eq!(
            h.keys().map(|k| k.as_str()).collect::<Vec<_>>(),
            ["trailer"]
        );
        h.insert(header::TE, HeaderValue::from_static("gzip"));
        assert!(!accepts_trailers(&h));
    }
}
