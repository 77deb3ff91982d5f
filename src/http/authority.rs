//! One authority per request: the host a request is routed, limited and forwarded on is
//! named once, and the upstream receives exactly that Host.
//!
//! - More than one `Host` field: 400 (RFC 9112 §3.2), whatever the values.
//! - An HTTP/1.1 request without `Host` and without an absolute-form target: 400 (RFC
//!   9112 §3.2). HTTP/1.0 may go without (then no host-specific route matches it).
//! - HTTP/1.x absolute-form (`GET http://api.example.com/ HTTP/1.1`): the target's
//!   authority replaces `Host` (RFC 9112 §3.2.2); a `Host` that differs is ignored, and
//!   replaced by the authority before anything reads it.
//! - HTTP/2: `:authority` and a `Host` that name different hosts or ports: 400 (RFC 9113
//!   §8.3.1, a malformed request). Without `Host`, the `:authority` is the Host.
//! - A Host that is not `host[:port]` (not ASCII, userinfo `user@`, a path, a port that
//!   is not a number, empty): 400 (RFC 9110 §4.2.4 treats userinfo as an error).
//!
//! After [`settle`], the request has at most one `Host` header and it is the authority;
//! [`settle`] answers it, routing reads its name with [`host_name`], and the forwarder
//! sends it on unchanged (taking it from [`settle`]'s answer, not looking it up again).

use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Uri, Version};

/// Why a request does not name one authority (each is a 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthorityError {
    /// More than one `Host` field (RFC 9112 §3.2).
    #[error("more than one Host header")]
    TwoHosts,
    /// An HTTP/1.1 request without `Host` and without an absolute-form target.
    #[error("an HTTP/1.1 request needs a Host header")]
    NoHost,
    /// HTTP/2: `Host` names another host or port than `:authority`.
    #[error("Host {host:?} disagrees with :authority {authority:?}")]
    Disagree {
        /// The `Host` header (at most 256 characters of it).
        host: String,
        /// The `:authority` pseudo-header.
        authority: String,
    },
    /// The Host (or the target's authority) is not `host[:port]`.
    #[error("Host is not host[:port]: {0}")]
    Invalid(String),
}

/// Settle the one authority of a request as the server read it (its URI has an
/// authority for an absolute-form target and for HTTP/2's `:authority`): afterwards
/// the request has at most one `Host`, and it is that authority. Answers that `Host`
/// (a copy that shares its bytes), `None` when the request has none (HTTP/1.0 may go
/// without).
///
/// Errors: see [`AuthorityError`]; the request must then be answered 400, not routed.
pub fn settle<B>(req: &mut Request<B>) -> Result<Option<HeaderValue>, AuthorityError> {
    Ok(match decide(req.version(), req.uri(), req.headers())? {
        Settled::Kept(host) => host,
        Settled::Replaced(value) => {
            req.headers_mut().insert(header::HOST, value.clone());
            Some(value)
        }
    })
}

/// What [`settle`] does with a request's `Host`.
enum Settled {
    /// The request's own (if any) stands.
    Kept(Option<HeaderValue>),
    /// It becomes this (the target's authority).
    Replaced(HeaderValue),
}

/// The `Host` that [`settle`] must set, or the request's own if it stands.
fn decide(version: Version, uri: &Uri, headers: &HeaderMap) -> Result<Settled, AuthorityError> {
    let mut hosts = headers.get_all(header::HOST).iter();
    let host = hosts.next().cloned();
    if hosts.next().is_some() {
        return Err(AuthorityError::TwoHosts);
    }
    let Some(authority) = uri.authority() else {
        return match host {
            Some(host) => {
                let text = host
                    .to_str()
                    .map_err(|_| AuthorityError::Invalid("not ASCII".into()))?;
                split(text)?;
                Ok(Settled::Kept(Some(host)))
            }
            None if version == Version::HTTP_11 => Err(AuthorityError::NoHost),
            None => Ok(Settled::Kept(None)),
        };
    };
    let authority = authority.as_str();
    let (name, port) = split(authority)?;
    if let (Some(host), Version::HTTP_2) = (&host, version) {
        let text = host
            .to_str()
            .map_err(|_| AuthorityError::Invalid("not ASCII".into()))?;
        let (host_name, host_port) = split(text)?;
        let default = match uri.scheme_str() {
            Some("https") => Some("443"),
            Some("http") => Some("80"),
            _ => None,
        };
        let same =
            host_name.eq_ignore_ascii_case(name) && host_port.or(default) == port.or(default);
        if !same {
            return Err(AuthorityError::Disagree {
                host: text.chars().take(256).collect(),
                authority: authority.chars().take(256).collect(),
            });
        }
    }
    HeaderValue::from_str(authority)
        .map(Settled::Replaced)
        .map_err(|_| AuthorityError::Invalid("not a header value".into()))
}

/// The host name a request is routed on, from the `Host` [`settle`] answered: without
/// its port and without a trailing dot (`api.example.com.` is `api.example.com`),
/// borrowed as sent (routes compare hosts in any case). `None` when it is not usable.
/// (The Host was checked by [`settle`], so it is not checked again: only cut.)
pub fn host_name(host: &HeaderValue) -> Option<&str> {
    // Its bytes were checked (visible ASCII) by `settle`: UTF-8 is all that is asked
    // here, which a word-at-a-time scan answers, where `to_str` checks byte by byte.
    let text = std::str::from_utf8(host.as_bytes()).ok()?;
    let (name, _) = cut(text);
    let name = name.strip_suffix('.').unwrap_or(name);
    (!name.is_empty()).then_some(name)
}

/// `host[:port]` cut into the name (an IPv6 literal with its brackets) and the rest
/// (`""` or `:` and the port), unchecked.
fn cut(raw: &str) -> (&str, &str) {
    if raw.starts_with('[') {
        let end = raw.find(']').map_or(raw.len(), |i| i + 1);
        raw.split_at(end)
    } else {
        // A byte scan from the end: `:` is ASCII, so its index is a char boundary (and
        // this is several times cheaper than `rsplit_once`'s char searcher).
        match raw.bytes().rposition(|b| b == b':') {
            Some(i) => raw.split_at(i),
            None => (raw, ""),
        }
    }
}

/// `host[:port]` → the host name (trailing dot removed; an IPv6 literal keeps its
/// brackets) and the port.
///
/// Errors: [`AuthorityError::Invalid`] for userinfo, characters an authority cannot
/// hold (a path, spaces), a port that is not a number of at most 5 digits, and an empty
/// name.
fn split(raw: &str) -> Result<(&str, Option<&str>), AuthorityError> {
    if let Some(parts) = simple(raw) {
        return Ok(parts);
    }
    let invalid = |why: &str| AuthorityError::Invalid(format!("{why}: {:?}", short(raw)));
    if raw.contains('@') {
        return Err(invalid("userinfo is not allowed"));
    }
    if http::uri::Authority::try_from(raw).is_err() {
        return Err(invalid("not an authority"));
    }
    let (name, rest) = cut(raw);
    let port = match rest.strip_prefix(':') {
        None if rest.is_empty() => None,
        Some(p) if !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()) => {
            Some(p)
        }
        _ => return Err(invalid("bad port")),
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    if name.is_empty() {
        return Err(invalid("empty host"));
    }
    Ok((name, port))
}

/// [`split`]'s answer for the usual `Host`, a name of letters, digits, `.` and `-`
/// with a port of 1 to 5 digits or none, found in one pass over the bytes; `None` for
/// anything else (which [`split`] then checks in full).
fn simple(raw: &str) -> Option<(&str, Option<&str>)> {
    let bytes = raw.as_bytes();
    let end = bytes
        .iter()
        .position(|&b| !(b.is_ascii_alphanumeric() || b == b'.' || b == b'-'))
        .unwrap_or(bytes.len());
    // Everything before `end` is ASCII: slicing there is on a character boundary.
    let (name, port) = match bytes.get(end) {
        None => (raw, None),
        Some(b':') => {
            let port = &raw[end + 1..];
            let digits = port.bytes().all(|b| b.is_ascii_digit());
            if port.is_empty() || port.len() > 5 || !digits {
                return None;
            }
            (&raw[..end], Some(port))
        }
        Some(_) => return None,
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    (!name.is_empty()).then_some((name, port))
}

/// At most 256 characters of `s`, for an error message.
fn short(s: &str) -> String {
    s.chars().take(256).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settled(
        version: Version,
        uri: &str,
        hosts: &[&str],
    ) -> Result<Option<String>, AuthorityError> {
        let mut req = Request::get(uri).version(version);
        for host in hosts {
            req = req.header(header::HOST, *host);
        }
        let mut req = req.body(()).unwrap();
        let settled = settle(&mut req)?;
        let h = req.headers();
        assert!(h.get_all(header::HOST).iter().count() <= 1);
        // What settle answers is the request's Host from then on.
        assert_eq!(settled.as_ref(), h.get(header::HOST));
        Ok(settled.as_ref().and_then(host_name).map(str::to_string))
    }

    #[test]
    fn one_host_field_and_absolute_form_replaces_it() {
        let v11 = Version::HTTP_11;
        assert_eq!(
            settled(v11, "/", &["a.example:80"]),
            Ok(Some("a.example".into()))
        );
        assert_eq!(
            settled(v11, "/", &["a", "a"]),
            Err(AuthorityError::TwoHosts)
        );
        assert_eq!(settled(v11, "/", &[]), Err(AuthorityError::NoHost));
        assert_eq!(settled(Version::HTTP_10, "/", &[]), Ok(None));
        assert_eq!(
            settled(v11, "http://api.example/x", &["open.example"]),
            Ok(Some("api.example".into()))
        );
        assert_eq!(
            settled(v11, "http://api.example./x", &[]),
            Ok(Some("api.example".into()))
        );
        assert_eq!(settled(v11, "/", &["[::1]:8080"]), Ok(Some("[::1]".into())));
        for bad in ["u@a", "a/b", "a:x", "a:", ":80", "a:123456", "."] {
            assert!(
                matches!(settled(v11, "/", &[bad]), Err(AuthorityError::Invalid(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            settled(v11, "http://u@api.example/", &[]),
            Err(AuthorityError::Invalid(_))
        ));
    }

    #[test]
    fn on_http2_host_must_name_the_authority() {
        let v2 = Version::HTTP_2;
        assert_eq!(
            settled(v2, "https://api.example/", &["API.example:443"]),
            Ok(Some("api.example".into()))
        );
        assert_eq!(
            settled(v2, "http://api.example:8080/", &[]),
            Ok(Some("api.example".into()))
        );
        for host in ["open.example", "api.example:8080"] {
            assert!(
                matches!(
                    settled(v2, "https://api.example/", &[host]),
                    Err(AuthorityError::Disagree { .. })
                ),
                "{host}"
            );
        }
    }

    #[test]
    fn the_usual_host_is_split_as_the_full_check_splits_it() {
        let full = |raw: &str| -> Result<(String, Option<String>), String> {
            if raw.contains('@') || http::uri::Authority::try_from(raw).is_err() {
                return Err("invalid".into());
            }
            let (name, rest) = cut(raw);
            let port = match rest.strip_prefix(':') {
                None if rest.is_empty() => None,
                Some(p)
                    if !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    Some(p.to_string())
                }
                _ => return Err("invalid".into()),
            };
            let name = name.strip_suffix('.').unwrap_or(name);
            if name.is_empty() {
                return Err("invalid".into());
            }
            Ok((name.to_string(), port))
        };
        let alphabet = ['a', '9', '.', '-', ':', '0', '_'];
        let mut all = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..6 {
            last = last
                .iter()
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            all.extend(last.iter().cloned());
        }
        all.extend(
            [
                "api.example.com:8080",
                "127.0.0.1:65535",
                "h:123456",
                "H.Example.COM.",
                "\u{e9}.example:80",
                "example:8\u{e9}",
                "ex ample:80",
                "[::1]:8080",
            ]
            .map(String::from),
        );
        let mut fast = 0;
        for raw in &all {
            if let Some((name, port)) = simple(raw) {
                fast += 1;
                assert_eq!(
                    full(raw),
                    Ok((name.to_string(), port.map(str::to_string))),
                    "{raw:?}"
                );
            }
            assert_eq!(
                split(raw)
                    .map(|(n, p)| (n.to_string(), p.map(str::to_string)))
                    .map_err(|_| "invalid".to_string()),
                full(raw),
                "{raw:?}"
            );
        }
        assert!(fast > 1000, "{fast}");
    }
}
