//! Which protocol upgrades may cross (`routes.upgrades`, default `["websocket"]`).
//!
//! An upgrade turns the connection into a tunnel the limiter no longer sees, so only
//! protocols on the route's allow-list are forwarded. `h2c` never is (RFC 9113 §3.1
//! deprecates it, and its tunnel would carry any number of unlimited requests). A request
//! asking for any other protocol is served as if it had no `Upgrade` at all: a plain
//! request. A WebSocket upgrade must be a complete RFC 6455 handshake (`GET`,
//! `Sec-WebSocket-Key` of 16 bytes in base64, `Sec-WebSocket-Version: 13`), or it is
//! refused (400) before it is limited or forwarded.

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Version};

/// One protocol of `routes.upgrades`: a name, optionally with a version
/// (`websocket`, `foo/2`), lowercase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protocol(String);

impl Protocol {
    /// `websocket`, the default allow-list's only entry.
    pub fn websocket() -> Self {
        Self("websocket".into())
    }

    /// Parse one entry of `routes.upgrades`.
    ///
    /// Errors: a message for a name that is not an RFC 9110 token (with an optional
    /// `/version` token), and for `h2c`, which is never forwarded.
    pub fn parse(s: &str) -> Result<Self, String> {
        let lower = s.trim().to_ascii_lowercase();
        let (name, version) = match lower.split_once('/') {
            Some((n, v)) => (n, Some(v)),
            None => (lower.as_str(), None),
        };
        if !is_token(name) || version.is_some_and(|v| !is_token(v)) {
            return Err(format!(
                "{s:?} is not a protocol name (a token, optionally with /VERSION), e.g. \"websocket\""
            ));
        }
        if name == "h2c" {
            return Err(
                "\"h2c\" is never forwarded: RFC 9113 §3.1 deprecates it, and its tunnel would carry requests no limit sees"
                    .into(),
            );
        }
        Ok(Self(lower))
    }

    /// The protocol as written in the config (lowercase).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether a token of a request's `Upgrade` header is this protocol: the same name
    /// in any case and, when this entry has a version, the same version; `h2c` never.
    fn admits(&self, token: &str) -> bool {
        let name = token.split('/').next().unwrap_or(token);
        if name.eq_ignore_ascii_case("h2c") {
            return false;
        }
        if self.0.contains('/') {
            token.eq_ignore_ascii_case(&self.0)
        } else {
            name.eq_ignore_ascii_case(&self.0)
        }
    }
}

/// An RFC 9110 token: one or more tchars.
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// An upgrade that may be forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upgrade {
    /// The `Upgrade` value to forward: the request's protocols that are on the list.
    pub protocols: HeaderValue,
    /// A WebSocket over HTTP/2 (an extended CONNECT, RFC 8441), to be turned into the
    /// HTTP/1.1 handshake for the upstream.
    pub h2_websocket: bool,
}

/// Why an upgrade request is refused (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpgradeError {
    /// A WebSocket upgrade that is not a complete RFC 6455 handshake.
    #[error("a WebSocket upgrade needs {0}")]
    WebSocketHandshake(&'static str),
    /// An HTTP/2 extended CONNECT for a protocol the route does not allow (over HTTP/2
    /// there is no plain request to fall back to).
    #[error("protocol {0:?} is not allowed on this route")]
    NotAllowed(String),
}

/// The upgrade `req` asks for that may be forwarded on a route that allows `allowed`:
/// `Ok(None)` for a request that asks for none, or only for protocols off the list (it is
/// then a plain request: the caller strips `Upgrade` with the other hop-by-hop headers).
///
/// Errors: [`UpgradeError::WebSocketHandshake`] for an allowed WebSocket upgrade without
/// the RFC 6455 handshake; [`UpgradeError::NotAllowed`] for an HTTP/2 extended CONNECT
/// whose protocol is off the list (or is not WebSocket, the only one tunnelled over
/// HTTP/2).
pub fn decide<B>(req: &Request<B>, allowed: &[Protocol]) -> Result<Option<Upgrade>, UpgradeError> {
    if req.method() == Method::CONNECT && req.version() == Version::HTTP_2 {
        let Some(protocol) = req.extensions().get::<hyper::ext::Protocol>() else {
            return Ok(None);
        };
        let name = protocol.as_str();
        if !name.eq_ignore_ascii_case("websocket") || !allowed.iter().any(|p| p.admits(name)) {
            return Err(UpgradeError::NotAllowed(name.to_string()));
        }
        return Ok(Some(Upgrade {
            protocols: HeaderValue::from_static("websocket"),
            h2_websocket: true,
        }));
    }
    if req.version() != Version::HTTP_11 || !lists(req.headers(), header::CONNECTION, "upgrade") {
        return Ok(None);
    }
    let kept: Vec<&str> = req
        .headers()
        .get_all(header::UPGRADE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| allowed.iter().any(|p| p.admits(t)))
        .collect();
    if kept.is_empty() {
        return Ok(None);
    }
    let websocket = |t: &&str| {
        t.split('/')
            .next()
            .is_some_and(|n| n.eq_ignore_ascii_case("websocket"))
    };
    if kept.iter().any(websocket) {
        websocket_handshake(req.method(), req.headers())?;
    }
    let protocols = HeaderValue::from_str(&kept.join(", "))
        .map_err(|_| UpgradeError::NotAllowed(kept.join(", ")))?;
    Ok(Some(Upgrade {
        protocols,
        h2_websocket: false,
    }))
}

/// Whether a 101 answer switched to a protocol that was asked for: its `Upgrade` names
/// one of `offered` (the value forwarded). An upstream that switches to anything else,
/// or says nothing, must not get a tunnel.
pub fn switched_to_offered(offered: &HeaderValue, answered: Option<&HeaderValue>) -> bool {
    let Some(answered) = answered.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let offered = offered.to_str().unwrap_or("");
    answered.split(',').map(str::trim).all(|a| {
        !a.is_empty()
            && offered
                .split(',')
                .map(str::trim)
                .any(|o| o.eq_ignore_ascii_case(a))
    })
}

/// RFC 6455 §4.1: `GET`, a `Sec-WebSocket-Key` that is 16 bytes in base64, and
/// `Sec-WebSocket-Version: 13`.
fn websocket_handshake(method: &Method, headers: &HeaderMap) -> Result<(), UpgradeError> {
    use base64::Engine;
    if method != Method::GET {
        return Err(UpgradeError::WebSocketHandshake("the GET method"));
    }
    let mut keys = headers.get_all(header::SEC_WEBSOCKET_KEY).iter();
    let key = match (keys.next(), keys.next()) {
        (Some(key), None) => key,
        _ => return Err(UpgradeError::WebSocketHandshake("one Sec-WebSocket-Key")),
    };
    let decoded = base64::engine::general_purpose::STANDARD.decode(key.as_bytes().trim_ascii());
    if decoded.map(|k| k.len()) != Ok(16) {
        return Err(UpgradeError::WebSocketHandshake(
            "a Sec-WebSocket-Key of 16 bytes in base64",
        ));
    }
    let mut versions = headers.get_all(header::SEC_WEBSOCKET_VERSION).iter();
    match (versions.next(), versions.next()) {
        (Some(v), None) if v.as_bytes().trim_ascii() == b"13" => Ok(()),
        _ => Err(UpgradeError::WebSocketHandshake(
            "Sec-WebSocket-Version: 13",
        )),
    }
}

/// Whether a comma-separated header lists `token` (in any case).
fn lists(headers: &HeaderMap, name: header::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(lines: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::get("/");
        for (k, v) in lines {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    const KEY: (&str, &str) = ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==");
    const V13: (&str, &str) = ("sec-websocket-version", "13");

    #[test]
    fn only_listed_protocols_pass() {
        let ws = [Protocol::websocket()];
        let up = |v: &str| req(&[("connection", "Upgrade"), ("upgrade", v), KEY, V13]);
        assert_eq!(decide(&up("h2c"), &ws), Ok(None));
        assert_eq!(decide(&up("foo/1"), &ws), Ok(None));
        let kept = decide(&up("h2c, WebSocket"), &ws).unwrap().unwrap();
        assert_eq!(kept.protocols, "WebSocket");
        assert_eq!(decide(&up("websocket"), &[]), Ok(None));
        // Without `Connection: upgrade` there is no upgrade.
        assert_eq!(
            decide(&req(&[("upgrade", "websocket"), KEY, V13]), &ws),
            Ok(None)
        );
        // A versioned entry matches that version only.
        let foo2 = [Protocol::parse("Foo/2").unwrap()];
        assert!(decide(&up("foo/2"), &foo2).unwrap().is_some());
        assert_eq!(decide(&up("foo/3"), &foo2), Ok(None));
    }

    #[test]
    fn websocket_needs_the_handshake() {
        let ws = [Protocol::websocket()];
        let base = [("connection", "upgrade"), ("upgrade", "websocket")];
        let with = |extra: &[(&'static str, &'static str)]| {
            let mut all = base.to_vec();
            all.extend_from_slice(extra);
            decide(&req(&all), &ws)
        };
        assert!(with(&[KEY, V13]).unwrap().is_some());
        assert!(with(&[V13]).is_err());
        assert!(with(&[KEY]).is_err());
        assert!(with(&[KEY, ("sec-websocket-version", "8")]).is_err());
        assert!(with(&[("sec-websocket-key", "c2hvcnQ="), V13]).is_err());
    }

    #[test]
    fn config_entries_parse_and_h2c_is_refused() {
        assert_eq!(Protocol::parse("WebSocket").unwrap().as_str(), "websocket");
        assert!(Protocol::parse("h2c").is_err());
        assert!(Protocol::parse("H2C/1").is_err());
        assert!(Protocol::parse("a b").is_err());
        assert!(Protocol::parse("").is_err());
        assert!(Protocol::parse("foo/").is_err());
    }

    #[test]
    fn a_101_must_name_what_was_offered() {
        let offered = HeaderValue::from_static("websocket");
        assert!(switched_to_offered(
            &offered,
            Some(&HeaderValue::from_static("WebSocket"))
        ));
        assert!(!switched_to_offered(
            &offered,
            Some(&HeaderValue::from_static("h2c"))
        ));
        assert!(!switched_to_offered(&offered, None));
    }
}
