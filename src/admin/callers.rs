//! `GET /callers/{id}`: every limit that applies to one caller, read from the store
//! without charging anything (with Redis, the whole fleet's count).
//!
//! The id is read as `POST /callers/{id}/reset` reads it ([`super::write::caller_id`]):
//! a client of the config or the keys file, else an anonymous caller by its address or
//! its address's keyed hash (as `GET /top` and the access log show it); a client whose
//! id is also an address is the client. The same token rules as the reset decide who
//! may read it ([`super::write::authorize`]). See [`crate::limiter::read`] for which
//! window of each limit is read.

use super::write::{authorize, caller_id};
use crate::limiter::read::Named;
use crate::response::{json_response, Body};
use crate::snapshot::Snapshot;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode};
use serde_json::json;
use std::net::SocketAddr;

/// Answer a request to `/callers/...` that is not a reset (see [`super::write`]).
pub(super) async fn handle(
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    snap: &Snapshot,
    peer: SocketAddr,
) -> Response<Body> {
    let segment = path.strip_prefix("/callers/").unwrap_or_default();
    if segment.contains('/') {
        return json_response(
            StatusCode::NOT_FOUND,
            &json!({ "message": "not found; try GET /callers/{id} or POST /callers/{id}/reset[?limit=NAME]" }),
        );
    }
    let id = match caller_id(segment) {
        Ok(id) => id,
        Err(bad) => return bad.response(),
    };
    if *method != Method::GET && *method != Method::HEAD {
        let mut r = json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({ "message": "use GET" }),
        );
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if let Err(denied) = authorize(headers, snap) {
        let refusal = denied.response();
        tracing::warn!(peer = %peer, caller = %id, "admin read refused: {}", refusal.status());
        return refusal;
    }
    if query.is_some_and(|q| !q.is_empty()) {
        return json_response(
            StatusCode::BAD_REQUEST,
            &json!({ "message": "bad query: GET /callers/{id} takes no parameters" }),
        );
    }
    let (named, tier) = match snap.identities.keys().client(&id) {
        Some(client) => (Named::Client(client.clone()), client.tier.clone()),
        None => match snap
            .limiter
            .anonymous_named(&id, |ip| snap.identities.ip_key(ip))
        {
            Some(digest) => (
                Named::Anonymous(digest),
                snap.identities.anonymous_tier().clone(),
            ),
            None => {
                return json_response(
                    StatusCode::NOT_FOUND,
                    &json!({ "message": format!(
                        "no client {id:?} in identity.clients or the keys file, and not an address or an address's keyed hash"
                    ) }),
                )
            }
        },
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    match snap
        .limiter
        .read_caller(&snap.limits, &named, &tier, now_ms)
        .await
    {
        Ok(limits) => {
            let limits: Vec<_> = limits
                .iter()
                .map(|l| {
                    let u = l.usage.as_ref();
                    json!({
                        "name": &*l.limit.name,
                        "algorithm": l.limit.algorithm.name(),
                        "by": by_name(&l.limit.by),
                        "quota": l.quota,
                        "used": u.map(|u| u.used),
                        "remaining": u.map(|u| u.remaining()),
                        "reset": u.map(|u| u.reset_epoch_s()),
                        "window": l.limit.window_ms.div_ceil(1000),
                        "blocked_until": u
                            .filter(|u| u.blocked_until_ms > 0)
                            .map(|u| u.blocked_until_ms.div_ceil(1000)),
                        "leases": l.leased,
                    })
                })
                .collect();
            json_response(
                StatusCode::OK,
                &json!({
                    "caller": id,
                    "anonymous": matches!(named, Named::Anonymous(_)),
                    "tier": &*tier,
                    "limits": limits,
                }),
            )
        }
        Err(e) => {
            tracing::warn!(peer = %peer, caller = %id, error = %e, "caller read failed");
            json_response(
                StatusCode::SERVICE_UNAVAILABLE,
                &json!({ "message": format!("store: {e}") }),
            )
        }
    }
}

/// A limit's `by`, as the config writes it.
fn by_name(by: &crate::limiter::By) -> String {
    use crate::limiter::By;
    match by {
        By::Caller => "caller".into(),
        By::Ip => "ip".into(),
        By::Global => "global".into(),
        By::Header(h) | By::TrustedHeader(h) => format!("header:{h}"),
    }
}
