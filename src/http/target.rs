//! What a request is routed on, so that routing and the upstream agree on which
//! resource and method a request is for.
//!
//! - **The routing path**: servlet containers drop each segment's `;…` parameters (RFC
//!   3986 §3.3: `/admin;jsessionid=1/users` is `/admin/users`) and IIS trims trailing
//!   dots from segments (`/admin./users`), so a route is matched on the path with both
//!   removed (and the dot segments that uncovers, as in `/public/..;/admin`, resolved).
//!   The upstream still receives the path as sent: this is for routing only.
//! - **Overrides**: `X-HTTP-Method-Override`, `X-Method-Override` and `X-HTTP-Method` name
//!   another method, `X-Original-URL` and `X-Rewrite-URL` another URL, which many
//!   frameworks execute instead of the request line. They are believed (kept, and the
//!   request routed on them) only where the route they select has
//!   `trust_method_override = true`; everywhere else they are stripped.

use http::{HeaderMap, HeaderName, Method};
use std::borrow::Cow;

/// Headers that name another method for the request.
pub static METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-method-override"),
    HeaderName::from_static("x-http-method"),
];

/// Headers that name another URL for the request.
pub static URL_OVERRIDES: [HeaderName; 2] = [
    HeaderName::from_static("x-original-url"),
    HeaderName::from_static("x-rewrite-url"),
];

/// The path a request is routed on: `path` (already in normal form, see
/// `proxy::path`) with each segment's `;…` parameters and trailing dots removed, and the
/// dot segments this uncovers resolved. The asterisk-form `*` (`OPTIONS *`) is routed as
/// `/`. Borrowed when nothing changes (the common case).
pub fn routing_path(path: &str) -> Cow<'_, str> {
    if path == "*" {
        return Cow::Borrowed("/");
    }
    // One pass over the bytes: a `;` anywhere, or a `.` that ends a segment.
    let bytes = path.as_bytes();
    let touched = bytes.iter().enumerate().any(|(i, &b)| {
        b == b';' || (b == b'.' && bytes.get(i + 1).is_none_or(|&next| next == b'/'))
    });
    if !touched || !path.starts_with('/') {
        return Cow::Borrowed(path);
    }
    let mut segments: Vec<&str> = Vec::new();
    for segment in path[1..].split('/') {
        let segment = segment.split(';').next().unwrap_or("");
        match segment {
            "." => {}
            ".." => {
                segments.pop();
            }
            s => {
                let s = s.trim_end_matches('.');
                if !s.is_empty() {
                    segments.push(s);
                }
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    out.push('/');
    out.push_str(&segments.join("/"));
    if path.ends_with('/') && !out.ends_with('/') {
        out.push('/');
    }
    if out == path {
        Cow::Borrowed(path)
    } else {
        Cow::Owned(out)
    }
}

/// What a request's override headers ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Override {
    /// No override header.
    None,
    /// Override headers that cannot be believed anywhere: methods or URLs that disagree,
    /// a method that is not a token, a URL that does not start with `/`.
    Unusable,
    /// The request asks to be executed with this method and/or at this URL (as sent:
    /// the path, maybe with a query).
    Asks {
        /// The overriding method (in capitals).
        method: Option<Method>,
        /// The overriding URL.
        url: Option<String>,
    },
}

/// Read the override headers of a request (every value of each).
pub fn requested(headers: &HeaderMap) -> Override {
    // One pass over the names (a length switch each) rather than five lookups, each
    // hashing a long custom name: nearly every request has none of them.
    let present = headers.keys().any(|n| {
        matches!(
            n.as_str(),
            "x-http-method-override"
                | "x-method-override"
                | "x-http-method"
                | "x-original-url"
                | "x-rewrite-url"
        )
    });
    if !present {
        return Override::None;
    }
    let one = |names: &[HeaderName]| -> Result<Option<String>, ()> {
        let mut found: Option<String> = None;
        for value in names.iter().flat_map(|n| headers.get_all(n)) {
            let v = value.to_str().map_err(|_| ())?.trim();
            match &found {
                Some(f) if !f.eq_ignore_ascii_case(v) => return Err(()),
                Some(_) => {}
                None => found = Some(v.to_string()),
            }
        }
        Ok(found)
    };
    let (Ok(method), Ok(url)) = (one(&METHOD_OVERRIDES), one(&URL_OVERRIDES)) else {
        return Override::Unusable;
    };
    let method = match method {
        None => None,
        Some(m) => match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
            Ok(m) if !m.as_str().is_empty() => Some(m),
            _ => return Override::Unusable,
        },
    };
    if url.as_deref().is_some_and(|u| !u.starts_with('/')) {
        return Override::Unusable;
    }
    Override::Asks { method, url }
}

/// Remove every override header.
pub fn strip_overrides(headers: &mut HeaderMap) {
    for name in METHOD_OVERRIDES.iter().chain(&URL_OVERRIDES) {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn parameters_and_trailing_dots_are_not_routed_on() {
        for (path, routed) in [
            ("/admin;x/users", "/admin/users"),
            ("/admin;jsessionid=1/users", "/admin/users"),
            ("/admin./users", "/admin/users"),
            ("/admin.../users", "/admin/users"),
            ("/admin;/users", "/admin/users"),
            ("/public/..;/admin/users", "/admin/users"),
            ("/a;x/", "/a/"),
            ("/a.", "/a"),
            ("*", "/"),
            ("/v1.2/x", "/v1.2/x"),
        ] {
            assert_eq!(routing_path(path), routed, "{path}");
        }
        assert!(matches!(routing_path("/v1/orders"), Cow::Borrowed(_)));
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn overrides_must_agree() {
        assert_eq!(requested(&headers(&[("x-other", "1")])), Override::None);
        assert_eq!(
            requested(&headers(&[
                ("x-http-method-override", "delete"),
                ("x-method-override", "DELETE")
            ])),
            Override::Asks {
                method: Some(Method::DELETE),
                url: None
            }
        );
        assert_eq!(
            requested(&headers(&[
                ("x-http-method-override", "DELETE"),
                ("x-http-method", "PUT")
            ])),
            Override::Unusable
        );
        assert_eq!(
            requested(&headers(&[("x-original-url", "http://evil/")])),
            Override::Unusable
        );
        let mut h = headers(&[("x-rewrite-url", "/a"), ("x-http-method", "GET")]);
        strip_overrides(&mut h);
        assert!(h.is_empty());
    }

    #[test]
    fn every_override_name_is_noticed() {
        for name in METHOD_OVERRIDES.iter().chain(&URL_OVERRIDES) {
            let mut h = HeaderMap::new();
            h.insert(http::header::ACCEPT, http::HeaderValue::from_static("*/*"));
            h.insert(name.clone(), http::HeaderValue::from_static("/x"));
            assert_ne!(requested(&h), Override::None, "{name}");
        }
    }
}
