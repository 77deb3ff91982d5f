//! What an intermediary says about itself and how far a request may go: `Via`
//! (RFC 9110 §7.6.3) and `Max-Forwards` (§7.6.2).

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Version};

/// The `Via` entries tollgate adds, rendered once per config: `"1.1 tollgate"` and the
/// like for each HTTP version a message may arrive in (`server.via`).
#[derive(Debug, Clone)]
pub struct Via {
    http10: HeaderValue,
    http11: HeaderValue,
    http2: HeaderValue,
}

impl Via {
    /// The entries for `pseudonym` (`server.via`'s name, e.g. `"tollgate"`).
    ///
    /// Errors: a message when `pseudonym` is not an RFC 9110 token (letters, digits and
    /// ``!#$%&'*+-.^_`|~``, at least one), which a `Via` received-by must be.
    pub fn new(pseudonym: &str) -> Result<Self, String> {
        let token = !pseudonym.is_empty()
            && pseudonym
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !token {
            return Err(format!(
                "{pseudonym:?} is not a token (letters, digits, `-`, `.`, `_` ...), e.g. \"edge-1\""
            ));
        }
        let entry = |version: &str| {
            HeaderValue::from_str(&format!("{version} {pseudonym}"))
                .map_err(|e| format!("{pseudonym:?}: {e}"))
        };
        Ok(Self {
            http10: entry("1.0")?,
            http11: entry("1.1")?,
            http2: entry("2")?,
        })
    }

    /// Append tollgate's entry for a message received in `version` to `headers`' `Via`
    /// (after the entries of earlier intermediaries).
    pub fn append(&self, headers: &mut HeaderMap, version: Version) {
        let entry = match version {
            Version::HTTP_09 | Version::HTTP_10 => &self.http10,
            Version::HTTP_2 | Version::HTTP_3 => &self.http2,
            _ => &self.http11,
        };
        headers.append(header::VIA, entry.clone());
    }
}

/// What `Max-Forwards` says of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hops {
    /// Forward it (any method but `OPTIONS` and `TRACE`, or no valid `Max-Forwards`;
    /// otherwise the header has been decremented).
    Forward,
    /// `OPTIONS` or `TRACE` with `Max-Forwards: 0`: the gateway is the last hop and
    /// answers it itself.
    LastHop,
}

/// Apply `Max-Forwards` (RFC 9110 §7.6.2) to a request of `method`: on `OPTIONS` and
/// `TRACE`, a value of 0 makes this the last hop; any other value is decremented on
/// the way on. Other methods, and a value that is not a decimal integer, are left as
/// they are.
pub fn max_forwards(method: &Method, headers: &mut HeaderMap) -> Hops {
    if *method != Method::OPTIONS && *method != Method::TRACE {
        return Hops::Forward;
    }
    let Some(value) = headers.get(header::MAX_FORWARDS) else {
        return Hops::Forward;
    };
    let text = value.as_bytes();
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return Hops::Forward;
    }
    // Past u64: as good as unlimited, and left as it is.
    let Some(hops) = std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
    else {
        return Hops::Forward;
    };
    if hops == 0 {
        return Hops::LastHop;
    }
    headers.insert(header::MAX_FORWARDS, HeaderValue::from(hops - 1));
    Hops::Forward
}

/// Request headers a `TRACE` answer never reflects: credentials and cookies (RFC 9110
/// §9.3.8).
const SENSITIVE: [&str; 4] = [
    "authorization",
    "cookie",
    "proxy-authorization",
    "x-api-key",
];

/// The `message/http` body of a `TRACE` answered as the last hop: the request line and
/// headers as received, without [`SENSITIVE`] ones and those `hidden` says (the
/// configured credential header and the other names tollgate reads or sets).
pub fn trace_echo(
    method: &Method,
    target: &str,
    version: Version,
    headers: &HeaderMap,
    hidden: impl Fn(&str) -> bool,
) -> Vec<u8> {
    let version = match version {
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2",
        _ => "HTTP/1.1",
    };
    let mut out = format!("{method} {target} {version}\r\n").into_bytes();
    for (name, value) in headers {
        let n = name.as_str();
        if SENSITIVE.contains(&n) || hidden(n) {
            continue;
        }
        out.extend_from_slice(n.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn via_entries_follow_the_received_version() {
        let via = Via::new("tollgate").unwrap();
        let mut h = HeaderMap::new();
        h.insert(header::VIA, HeaderValue::from_static("1.0 fred"));
        via.append(&mut h, Version::HTTP_2);
        via.append(&mut h, Version::HTTP_11);
        let all: Vec<_> = h.get_all(header::VIA).iter().collect();
        assert_eq!(all, ["1.0 fred", "2 tollgate", "1.1 tollgate"]);
        assert!(Via::new("two words").is_err());
        assert!(Via::new("").is_err());
        assert!(Via::new("edge-1.eu").is_ok());
    }

    #[test]
    fn max_forwards_counts_down_on_options_and_trace_only() {
        let mut h = HeaderMap::new();
        h.insert(header::MAX_FORWARDS, HeaderValue::from_static("3"));
        assert_eq!(max_forwards(&Method::OPTIONS, &mut h), Hops::Forward);
        assert_eq!(h[header::MAX_FORWARDS], "2");
        assert_eq!(max_forwards(&Method::GET, &mut h), Hops::Forward);
        assert_eq!(h[header::MAX_FORWARDS], "2");
        h.insert(header::MAX_FORWARDS, HeaderValue::from_static("0"));
        assert_eq!(max_forwards(&Method::TRACE, &mut h), Hops::LastHop);
        assert_eq!(max_forwards(&Method::GET, &mut h), Hops::Forward);
        for junk in ["-1", "x", "", "1 "] {
            h.insert(header::MAX_FORWARDS, HeaderValue::from_static(junk));
            assert_eq!(max_forwards(&Method::OPTIONS, &mut h), Hops::Forward);
            assert_eq!(h[header::MAX_FORWARDS], junk);
        }
    }

    #[test]
    fn trace_echo_leaves_out_credentials() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        h.insert("x-key", HeaderValue::from_static("k"));
        h.insert("x-seen", HeaderValue::from_static("1"));
        let body = trace_echo(&Method::TRACE, "/a", Version::HTTP_11, &h, |n| n == "x-key");
        assert_eq!(
            String::from_utf8(body).unwrap(),
            "TRACE /a HTTP/1.1\r\nx-seen: 1\r\n\r\n"
        );
    }
}
