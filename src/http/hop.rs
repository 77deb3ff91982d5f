//! Hop-by-hop headers: they describe one connection, not the message (RFC 9110
//! §7.6.1), so they are never forwarded, in either direction.

use http::header::{self, HeaderMap, HeaderName};

/// `HTTP2-Settings`: the settings of an `h2c` upgrade (RFC 7540 §3.2.1), meaningful on
/// one connection only. tollgate never forwards an `h2c` upgrade, so never this either.
pub static HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

/// Whether `name` is hop-by-hop whatever `Connection` says: `Connection`, `Keep-Alive`,
/// `TE`, `Transfer-Encoding`, `Upgrade`, `HTTP2-Settings` and every `Proxy-*` header
/// (`Proxy-Authenticate`, `Proxy-Authorization`, `Proxy-Connection`...). (`Trailer` is
/// not: it declares the trailer fields of the message, which cross with it; hyper's
/// HTTP/1.1 encoder sends only the trailer fields it declares.)
pub fn always_hop_by_hop(name: &HeaderName) -> bool {
    // The standard names compare as enum values; the text is read only for the rest.
    if name == header::CONNECTION
        || name == header::TE
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::PROXY_AUTHENTICATE
        || name == header::PROXY_AUTHORIZATION
    {
        return true;
    }
    let s = name.as_str();
    s.starts_with("proxy-") || s == "keep-alive" || s == "http2-settings"
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
    strip(headers, false);
}

/// [`strip_hop_by_hop`] for a request going upstream, answering whether its `TE`
/// accepted trailer fields ([`accepts_trailers`]), which the caller passes on as
/// `TE: trailers` (the one `TE` value that crosses, as gRPC servers require). `TE` is
/// read only when the pass over the names finds one (most requests have none).
pub fn strip_request_hop_by_hop(headers: &mut HeaderMap) -> bool {
    strip(headers, true)
}

/// [`strip_hop_by_hop`], and with `read_te` whether `TE` accepted trailers (read
/// before it is removed).
fn strip(headers: &mut HeaderMap, read_te: bool) -> bool {
    // The common cases without a list: nothing to remove, or only a `Connection` that
    // names no header (`keep-alive`, `close`), as upstream responses have.
    let mut connection = false;
    for name in headers.keys() {
        if *name == header::CONNECTION {
            connection = true;
        } else if always_hop_by_hop(name) {
            let te_trailers = read_te && accepts_trailers(headers);
            strip_listed(headers);
            return te_trailers;
        }
    }
    if !connection {
        return false;
    }
    if headers.get_all(header::CONNECTION).iter().all(|v| {
        // Most often the whole value is one token: no split.
        let b = v.as_bytes();
        b.eq_ignore_ascii_case(b"keep-alive")
            || b.eq_ignore_ascii_case(b"close")
            || v.to_str().is_ok_and(|v| v.split(',').all(names_no_header))
    }) {
        headers.remove(header::CONNECTION);
        return false;
    }
    // (No `TE` here: the pass found no name on the fixed list.)
    strip_listed(headers);
    false
}

/// Whether a `Connection` token names no header: `keep-alive` (on the list already),
/// `close`, or nothing.
fn names_no_header(token: &str) -> bool {
    let t = token.trim();
    t.is_empty() || t.eq_ignore_ascii_case("keep-alive") || t.eq_ignore_ascii_case("close")
}

/// `strip_hop_by_hop`'s general case: collect what to remove, then remove it.
fn strip_listed(headers: &mut HeaderMap) {
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
            .filter(|t| !names_no_header(t))
            // (from_bytes folds case itself.)
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok()),
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

    #[test]
    fn a_request_going_upstream_says_whether_te_accepted_trailers() {
        let stripped = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(HeaderName::from_static(k), HeaderValue::from_static(v));
            }
            let trailers = strip_request_hop_by_hop(&mut h);
            let mut left: Vec<_> = h.keys().map(|k| k.as_str().to_string()).collect();
            left.sort();
            (trailers, left)
        };
        let kept = vec!["accept".to_string()];
        for (pairs, trailers) in [
            (vec![("te", "trailers"), ("accept", "*/*")], true),
            (
                vec![("te", "gzip"), ("te", "Trailers;q=1"), ("accept", "*/*")],
                true,
            ),
            (
                vec![("connection", "te"), ("te", "trailers"), ("accept", "*/*")],
                true,
            ),
            (vec![("te", "gzip"), ("accept", "*/*")], false),
            (vec![("connection", "keep-alive"), ("accept", "*/*")], false),
            (
                vec![("connection", "x-a"), ("x-a", "1"), ("accept", "*/*")],
                false,
            ),
            (vec![("accept", "*/*")], false),
        ] {
            assert_eq!(stripped(&pairs), (trailers, kept.clone()), "{pairs:?}");
        }
    }

    #[test]
    fn a_connection_naming_no_header_goes_alone_and_one_naming_headers_takes_them() {
        let build = |connection: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONNECTION, HeaderValue::from_static(connection));
            h.insert(header::SERVER, HeaderValue::from_static("nginx"));
            h.insert(
                HeaderName::from_static("x-private"),
                HeaderValue::from_static("1"),
            );
            strip_hop_by_hop(&mut h);
            let mut left: Vec<_> = h.keys().map(|k| k.as_str().to_string()).collect();
            left.sort();
            left
        };
        assert_eq!(build("keep-alive"), ["server", "x-private"]);
        assert_eq!(build("Close"), ["server", "x-private"]);
        assert_eq!(build(" keep-alive , , close"), ["server", "x-private"]);
        assert_eq!(build("keep-alive, X-Private"), ["server"]);
        assert_eq!(build("close,x-private,server"), Vec::<String>::new());
    }

    #[test]
    fn the_hop_by_hop_names_in_every_spelling_and_only_them() {
        for name in [
            "connection",
            "Keep-Alive",
            "TE",
            "transfer-encoding",
            "Upgrade",
            "proxy-authenticate",
            "Proxy-Authorization",
            "proxy-connection",
            "proxy-x",
            "HTTP2-Settings",
        ] {
            let n = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert!(always_hop_by_hop(&n), "{name}");
        }
        for name in [
            "trailer",
            "host",
            "content-length",
            "x-upgrade",
            "tee",
            "keep-alive2",
            "proxy",
        ] {
            let n = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert!(!always_hop_by_hop(&n), "{name}");
        }
    }
}
