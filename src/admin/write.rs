//! The admin listener's write endpoints: `POST /callers/{id}/reset[?limit=NAME]`.
//!
//! They need `server.admin_token_sha256`: the request must carry `Authorization:
//! Bearer TOKEN` where the SHA-256 of TOKEN is that value. Without it configured they
//! are off (403, with a JSON body saying how to turn them on); a missing or wrong token
//! gets 401 (`WWW-Authenticate: Bearer`). Every reset is logged at info with who asked
//! (the token's fingerprint: the first 8 hex digits of its SHA-256; the peer address),
//! the caller and the limits cleared. The id is a client's, or an anonymous caller's as
//! `GET /top` shows it (its address's keyed hash, or the address): see
//! [`crate::limiter::reset`].

use crate::limiter::reset::ResetError;
use crate::response::{json_response, Body};
use crate::snapshot::Snapshot;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use subtle::ConstantTimeEq;

/// Whether `path` is one of the write endpoints (answered by [`handle`]).
pub(super) fn is_write(path: &str) -> bool {
    path.strip_prefix("/callers/")
        .is_some_and(|rest| rest.ends_with("/reset"))
}

/// Answer a request to a write endpoint (`is_write(path)`), from `peer`.
pub(super) async fn handle(
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    snap: &Snapshot,
    peer: SocketAddr,
) -> Response<Body> {
    let not_found = || {
        json_response(
            StatusCode::NOT_FOUND,
            &json!({ "message": "not found; try POST /callers/{id}/reset[?limit=NAME]" }),
        )
    };
    let Some(segment) = path
        .strip_prefix("/callers/")
        .and_then(|rest| rest.strip_suffix("/reset"))
    else {
        return not_found();
    };
    let id = match caller_id(segment) {
        Ok(id) => id,
        // As before the id was shared with `GET /callers/{id}`: not a reset path.
        Err(BadId::Empty | BadId::Escape) => return not_found(),
        Err(bad) => return bad.response(),
    };
    if method != Method::POST {
        let mut r = json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({ "message": "use POST" }),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return r;
    }
    let token = match authorize(headers, snap) {
        Ok(fingerprint) => fingerprint,
        Err(denied) => {
            let refusal = denied.response();
            tracing::warn!(peer = %peer, caller = %id, "admin write refused: {}", refusal.status());
            return refusal;
        }
    };
    let only = match query.map(limit_param) {
        Some(Err(())) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                &json!({ "message": "bad query: the only parameter is limit=NAME" }),
            )
        }
        Some(Ok(Some(name))) if has_control_or_format(&name) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                &json!({ "message": "a limit name has no control or format characters (Unicode Cc, Cf, such as U+202E)" }),
            )
        }
        Some(Ok(only)) => only,
        None => None,
    };
    match snap
        .limiter
        .reset_caller(&snap.limits, &id, only.as_deref(), |ip| {
            snap.identities.ip_key(ip)
        })
        .await
    {
        Ok(report) => {
            let cleared: Vec<&str> = report.cleared.iter().map(|l| &**l).collect();
            tracing::info!(
                token = %token,
                peer = %peer,
                caller = %id,
                anonymous = report.anonymous,
                limits = ?cleared,
                windows = report.deleted,
                "caller reset"
            );
            let skipped: Vec<_> = report
                .skipped
                .iter()
                .map(|(l, why)| json!({ "limit": &**l, "reason": why }))
                .collect();
            json_response(
                StatusCode::OK,
                &json!({
                    "caller": id,
                    "anonymous": report.anonymous,
                    "cleared": cleared,
                    "skipped": skipped,
                    "windows_deleted": report.deleted,
                }),
            )
        }
        Err(e) => {
            let status = match e {
                ResetError::UnknownLimit(_) => StatusCode::NOT_FOUND,
                ResetError::NotPerCaller(..) => StatusCode::BAD_REQUEST,
                ResetError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
            };
            tracing::warn!(token = %token, peer = %peer, caller = %id, error = %e, "caller reset failed");
            json_response(status, &json!({ "message": e.to_string() }))
        }
    }
}

/// Why the `{id}` of a `/callers/{id}` path names no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BadId {
    /// Nothing, or more than one path segment.
    Empty,
    /// A bad `%XX` escape, or bytes that are not UTF-8.
    Escape,
    /// A control or format character (Unicode Cc, Cf).
    ControlOrFormat,
}

impl BadId {
    /// 400 with a JSON message.
    pub(super) fn response(self) -> Response<Body> {
        let message = match self {
            BadId::Empty => "a caller id is one non-empty path segment (percent-encode any /)",
            BadId::Escape => "a caller id is percent-encoded UTF-8",
            BadId::ControlOrFormat => {
                "a caller id has no control or format characters (Unicode Cc, Cf, such as U+202E)"
            }
        };
        json_response(StatusCode::BAD_REQUEST, &json!({ "message": message }))
    }
}

/// The caller id of the path segment `segment` of `/callers/{id}...` (percent-decoded):
/// the one reading of an id for `POST /callers/{id}/reset` and `GET /callers/{id}`.
/// Which caller it names is the limiter's business ([`crate::limiter::reset`]).
pub(super) fn caller_id(segment: &str) -> Result<String, BadId> {
    if segment.is_empty() || segment.contains('/') {
        return Err(BadId::Empty);
    }
    let id = percent_decode(segment).ok_or(BadId::Escape)?;
    if has_control_or_format(&id) {
        return Err(BadId::ControlOrFormat);
    }
    Ok(id)
}

/// Why a request to a token-guarded endpoint was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Denied {
    /// No `server.admin_token_sha256`: write endpoints are off (403).
    Off,
    /// No `Authorization: Bearer TOKEN` (401).
    Missing,
    /// A token whose SHA-256 is not the configured one (401).
    Wrong,
}

impl Denied {
    pub(super) fn response(self) -> Response<Body> {
        let (status, message) = match self {
            Denied::Off => (
                StatusCode::FORBIDDEN,
                "write endpoints are off: set server.admin_token_sha256 to the SHA-256 of a Bearer token to turn them on",
            ),
            Denied::Missing => (
                StatusCode::UNAUTHORIZED,
                "admin token required: Authorization: Bearer TOKEN",
            ),
            Denied::Wrong => (StatusCode::UNAUTHORIZED, "bad admin token"),
        };
        let mut r = json_response(status, &json!({ "message": message }));
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// The token's fingerprint (first 8 hex digits of its SHA-256) when `headers` carry
/// the admin token, else why not.
pub(super) fn authorize(headers: &HeaderMap, snap: &Snapshot) -> Result<String, Denied> {
    let want = snap
        .config
        .server
        .admin_token_sha256
        .as_deref()
        .and_then(|h| hex::decode(h).ok())
        .ok_or(Denied::Off)?;
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .ok_or(Denied::Missing)?;
    let digest = Sha256::digest(token.as_bytes());
    if bool::from(digest.as_slice().ct_eq(&want)) {
        Ok(hex::encode(&digest[..4]))
    } else {
        Err(Denied::Wrong)
    }
}

/// Whether `s` has a control (Unicode general category Cc) or format (Cf) character:
/// such characters (a bidi override such as U+202E, a zero-width space) can make a log
/// line or a terminal show something other than what is there.
fn has_control_or_format(s: &str) -> bool {
    use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};
    s.chars().any(|c| {
        matches!(
            c.general_category(),
            GeneralCategory::Control | GeneralCategory::Format
        )
    })
}

/// `limit=NAME` (decoded) from a query string; `Err` for any other parameter.
fn limit_param(query: &str) -> Result<Option<String>, ()> {
    let mut only = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("limit", v)) if only.is_none() => only = Some(percent_decode(v).ok_or(())?),
            _ => return Err(()),
        }
    }
    Ok(only)
}

/// Decode `%XX` escapes (and nothing else); `None` for a bad escape or bytes that are
/// not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        if b == b'%' {
            let hi = (bytes.next()? as char).to_digit(16)?;
            let lo = (bytes.next()? as char).to_digit(16)?;
            out.push((hi * 16 + lo) as u8);
        } else {
            out.push(b);
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_ids_and_the_limit_parameter() {
        assert_eq!(percent_decode("acme%2Fcorp").as_deref(), Some("acme/corp"));
        assert_eq!(percent_decode("caf%C3%A9").as_deref(), Some("café"));
        assert_eq!(percent_decode("bad%2"), None);
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(limit_param("limit=core"), Ok(Some("core".into())));
        assert_eq!(limit_param(""), Ok(None));
        assert_eq!(limit_param("limit=a&limit=b"), Err(()));
        assert_eq!(limit_param("n=3"), Err(()));
    }

    #[test]
    fn caller_ids_are_one_decoded_segment_without_control_characters() {
        assert_eq!(caller_id("acme"), Ok("acme".into()));
        assert_eq!(caller_id("a%2Fb"), Ok("a/b".into()));
        assert_eq!(caller_id("203.0.113.7"), Ok("203.0.113.7".into()));
        assert_eq!(caller_id(""), Err(BadId::Empty));
        assert_eq!(caller_id("a/b"), Err(BadId::Empty));
        assert_eq!(caller_id("bad%2"), Err(BadId::Escape));
        assert_eq!(caller_id("a%E2%80%AEb"), Err(BadId::ControlOrFormat));
    }

    #[test]
    fn control_and_format_characters_are_found() {
        for bad in [
            "a\u{202e}b",
            "\u{200b}",
            "x\u{feff}",
            "\u{7}",
            "a\nb",
            "\u{2066}",
        ] {
            assert!(has_control_or_format(bad), "{bad:?}");
        }
        for good in ["acme", "café", "東京", "a b", "ip:192.0.2.7"] {
            assert!(!has_control_or_format(good), "{good:?}");
        }
    }
}
