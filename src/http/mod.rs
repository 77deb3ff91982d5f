//! The edge: what of a client's request crosses into tollgate and on to an upstream.
//!
//! The rule is an allow-list, decided here in one place, below identity and the proxy
//! (both take their header rules from this module):
//!
//! - **hop-by-hop** headers never cross ([`hop`]);
//! - **upgrades** cross only for protocols on the route's allow-list, `h2c` never
//!   ([`upgrade`]);
//! - **headers tollgate reads, sets or strips** (the caller and tier headers, the
//!   credential header, `X-Forwarded-*`, `Forwarded`, `X-Real-IP`, `X-RateLimit-*`,
//!   `RateLimit*`, the override headers, hop-by-hop and framing headers) cannot be sent in
//!   another spelling: a header whose name, with `_` read as `-` and in any case, is one
//!   of them is dropped, since CGI-style upstreams (RFC 3875 §4.1.18: WSGI, PHP, Rack)
//!   read `X_Consumer_Id` as `X-Consumer-Id`. By default every header with `_` in its
//!   name is dropped, as nginx does (`server.underscores_in_headers`) ([`Edge`]);
//! - a client's `X-RateLimit-*` / `RateLimit*` request headers, and its `Forwarded`
//!   unless it is a trusted proxy, are dropped; `X-Real-IP` is always the client IP the
//!   limiter used (set by the forwarder);
//! - the **routing path and method** are those the upstream will execute ([`target`]);
//! - the **host** is named once: two `Host` fields, or an HTTP/2 `Host` that disagrees
//!   with `:authority`, are 400, and an absolute-form target's authority replaces
//!   `Host`; routing, limits and the upstream all see that one authority ([`authority`]);
//! - a **transfer coding** other than `chunked` is not implemented: 501;
//! - `Via` names the gateway both ways (`server.via`), and `OPTIONS`/`TRACE` with
//!   `Max-Forwards: 0` are answered by the gateway ([`via`]).

pub mod authority;
pub mod hop;
pub mod target;
pub mod upgrade;
pub mod via;

pub use hop::{always_hop_by_hop, strip_hop_by_hop};

use http::header::{self, HeaderMap, HeaderName};

/// `Forwarded` (RFC 7239): believed and kept only from a trusted proxy.
pub static FORWARDED: HeaderName = HeaderName::from_static("forwarded");
/// `X-Real-IP`: the client IP the limiter used, set by the forwarder; never the
/// client's.
pub static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// Names (dash form, lowercase) that tollgate reads, sets or strips whatever the
/// config; a client header that spells one of them with `_` is always dropped.
const RESERVED: [&str; 20] = [
    "host",
    "content-length",
    "authorization",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
    "forwarded",
    "x-real-ip",
    "x-http-method-override",
    "x-method-override",
    "x-http-method",
    "x-original-url",
    "x-rewrite-url",
    "sec-websocket-key",
    "sec-websocket-version",
    "x-request-id",
];

/// Prefixes (dash form) of reserved names: `X-Forwarded-*`, `X-RateLimit-*`,
/// `RateLimit*`, `Proxy-*`.
const RESERVED_PREFIXES: [&str; 4] = ["x-forwarded-", "x-ratelimit-", "ratelimit", "proxy-"];

/// Why a request cannot cross the edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EdgeError {
    /// `Transfer-Encoding` names a coding other than `chunked` (RFC 9112 §6.1): 501.
    #[error(
        "transfer coding {0:?} is not implemented; send the body chunked or with a Content-Length"
    )]
    UnsupportedTransferCoding(String),
}

/// The header rules of the edge for one config: `server.underscores_in_headers` and
/// the configured names tollgate reads or sets (caller and tier headers, the credential
/// header, `by = "header:NAME"` limits).
#[derive(Debug, Clone, Default)]
pub struct Edge {
    underscores: bool,
    /// Configured names in dash form, lowercase.
    configured: Vec<String>,
    /// `server.via`: tollgate's `Via` entries; `None` adds none.
    via: Option<via::Via>,
}

impl Edge {
    /// The rules with `underscores_in_headers` and the configured header `names`
    /// (any case, `_` or `-`).
    pub fn new<'a>(underscores_in_headers: bool, names: impl IntoIterator<Item = &'a str>) -> Self {
        let mut configured: Vec<String> = names.into_iter().map(dash_form).collect();
        configured.sort();
        configured.dedup();
        Self {
            underscores: underscores_in_headers,
            configured,
            via: None,
        }
    }

    /// These rules with `via` as tollgate's `Via` entries (`server.via`).
    pub fn with_via(mut self, via: Option<via::Via>) -> Self {
        self.via = via;
        self
    }

    /// Tollgate's `Via` entries, or `None` when `server.via = false`.
    pub fn via(&self) -> Option<&via::Via> {
        self.via.as_ref()
    }

    /// The answer of the gateway as the last hop of an `OPTIONS` or `TRACE` request
    /// with `Max-Forwards: 0` ([`via::max_forwards`]): `OPTIONS` gets 200 with
    /// `Allow`, `TRACE` gets 200 `message/http` reflecting the request without its
    /// credentials or the headers tollgate reads or sets. `None`: forward it (its
    /// `Max-Forwards` decremented).
    pub fn last_hop<B>(&self, req: &mut http::Request<B>) -> Option<http::Response<Vec<u8>>> {
        let method = req.method().clone();
        if via::max_forwards(&method, req.headers_mut()) == via::Hops::Forward {
            return None;
        }
        let (body, name, value) = if method == http::Method::TRACE {
            let target = req
                .uri()
                .path_and_query()
                .map_or("/", http::uri::PathAndQuery::as_str);
            let echo = via::trace_echo(&method, target, req.version(), req.headers(), |n| {
                self.reserved(n)
            });
            (echo, header::CONTENT_TYPE, "message/http")
        } else {
            let allow = "GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS";
            (Vec::new(), header::ALLOW, allow)
        };
        let mut response = http::Response::new(Vec::new());
        let h = response.headers_mut();
        h.insert(name, http::HeaderValue::from_static(value));
        h.insert(header::CONTENT_LENGTH, body.len().into());
        *response.body_mut() = body;
        Some(response)
    }

    /// Whether a header name (in dash form) is one tollgate reads, sets or strips.
    fn reserved(&self, dash: &str) -> bool {
        RESERVED.contains(&dash)
            || RESERVED_PREFIXES.iter().any(|p| dash.starts_with(p))
            || self.configured.iter().any(|c| c == dash)
    }

    /// Apply the header rules to a request as it arrives, before anything reads it:
    /// drop headers with `_` in their name (all of them, or with
    /// `underscores_in_headers` those that spell a reserved name), the client's
    /// `X-RateLimit-*`, `RateLimit*` and `X-Real-IP`, and its `Forwarded` unless
    /// `peer_trusted` (the socket peer is in `identity.trusted_proxies`).
    ///
    /// Errors: [`EdgeError::UnsupportedTransferCoding`] when `Transfer-Encoding` names
    /// a coding other than `chunked` (hyper de-chunks the body and would forward it
    /// without the coding).
    pub fn admit(&self, headers: &mut HeaderMap, peer_trusted: bool) -> Result<(), EdgeError> {
        // One pass over the names finds what to drop and whether `Transfer-Encoding` is
        // there at all (most requests have none: no lookup of it then).
        let mut transfer_encoding = false;
        let mut doomed: Vec<HeaderName> = Vec::new();
        for name in headers.keys() {
            if *name == header::TRANSFER_ENCODING {
                transfer_encoding = true;
                continue;
            }
            let n = name.as_str();
            let drop = if n.as_bytes().contains(&b'_') {
                !self.underscores || self.reserved(&dash_form(n))
            } else {
                n.starts_with("x-ratelimit-")
                    || n.starts_with("ratelimit")
                    || *name == X_REAL_IP
                    || (*name == FORWARDED && !peer_trusted)
            };
            if drop {
                doomed.push(name.clone());
            }
        }
        if transfer_encoding {
            for value in headers.get_all(header::TRANSFER_ENCODING) {
                let text = String::from_utf8_lossy(value.as_bytes());
                for coding in text.split(',').map(str::trim).filter(|c| !c.is_empty()) {
                    if !coding.eq_ignore_ascii_case("chunked") {
                        return Err(EdgeError::UnsupportedTransferCoding(coding.to_string()));
                    }
                }
            }
        }
        for name in doomed {
            headers.remove(name);
        }
        Ok(())
    }
}

/// A header name with `_` read as `-`, lowercase.
fn dash_form(name: &str) -> String {
    name.trim()
        .bytes()
        .map(|b| match b {
            b'_' => '-',
            b => char::from(b.to_ascii_lowercase()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn names(h: &HeaderMap) -> Vec<&str> {
        let mut n: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        n.sort();
        n
    }

    #[test]
    fn underscores_are_dropped_and_reserved_spellings_always() {
        let all = [
            ("x_consumer_id", "alice"),
            ("x_custom", "1"),
            ("x_forwarded_for", "6.6.6.6"),
            ("x_ratelimit_remaining", "9"),
            ("x_api_key", "k"),
            ("x-kept", "1"),
        ];
        let mut h = headers(&all);
        Edge::new(false, ["x-consumer-id"])
            .admit(&mut h, false)
            .unwrap();
        assert_eq!(names(&h), ["x-kept"]);
        let mut h = headers(&all);
        Edge::new(true, ["X-Consumer-Id", "x-api-key"])
            .admit(&mut h, false)
            .unwrap();
        assert_eq!(names(&h), ["x-kept", "x_custom"]);
    }

    #[test]
    fn client_rate_limit_real_ip_and_forwarded_headers() {
        let all = [
            ("x-ratelimit-remaining", "9"),
            ("ratelimit", "\"a\";r=9"),
            ("ratelimit-policy", "\"a\";q=9"),
            ("x-real-ip", "6.6.6.6"),
            ("forwarded", "for=6.6.6.6"),
            ("x-kept", "1"),
        ];
        let mut h = headers(&all);
        Edge::default().admit(&mut h, false).unwrap();
        assert_eq!(names(&h), ["x-kept"]);
        let mut h = headers(&all);
        Edge::default().admit(&mut h, true).unwrap();
        assert_eq!(names(&h), ["forwarded", "x-kept"]);
    }

    #[test]
    fn only_chunked_is_a_transfer_coding_that_crosses() {
        let mut h = headers(&[("transfer-encoding", "chunked")]);
        assert!(Edge::default().admit(&mut h, false).is_ok());
        for te in ["gzip, chunked", "GZIP,chunked"] {
            let mut h = headers(&[("transfer-encoding", te)]);
            assert!(Edge::default().admit(&mut h, false).is_err(), "{te}");
        }
        let mut h = headers(&[
            ("transfer-encoding", "gzip"),
            ("transfer-encoding", "chunked"),
        ]);
        assert_eq!(
            Edge::default().admit(&mut h, false),
            Err(EdgeError::UnsupportedTransferCoding("gzip".into()))
        );
    }
}
