//! Phase 1, the edge: one spelling per path (so that no spelling dodges a route's
//! limits), only the headers that may cross the edge, one sane Host, and on TLS a
//! connection that is for the host asked.

use super::Answer;
use crate::proxy::error::ProxyError;
use crate::proxy::peer::Peer;
use crate::proxy::{path, Gate};
use crate::wire::Incoming;
use http::{HeaderValue, Request};

/// What the edge settled about a request, for the phases after it.
#[derive(Debug)]
pub struct Edge {
    /// Whether the socket peer is one of `identity.trusted_proxies`.
    pub peer_trusted: bool,
    /// The request's one authority ([`crate::http::authority::settle`]): routed,
    /// limited and forwarded on; `None` for an HTTP/1.0 request without `Host`.
    pub host: Option<HeaderValue>,
    /// The TLS connection's facts (`None` on plain HTTP).
    pub tls: Option<crate::tls::TlsInfo>,
}

impl Edge {
    /// The host name of [`Edge::host`] (no port, no trailing dot), as routes match it.
    #[inline]
    pub fn host_name(&self) -> Option<&str> {
        self.host
            .as_ref()
            .and_then(crate::http::authority::host_name)
    }
}

/// Admit `req` at the edge: its path in normal form, the headers that may not cross
/// removed, its authority settled.
///
/// Errors: 400 for a malformed path or Host, 501 for a transfer coding tollgate does not
/// implement (both logged `bad_request`), 421 for a TLS connection that is not for the
/// host asked (when the listener has more than one certificate).
pub fn edge(snap: &Gate<'_>, req: &mut Request<Incoming>, peer: &Peer) -> Result<Edge, Answer> {
    normalize_path(req)?;
    let peer_trusted = snap.identities.trusts(peer.ip());
    if let Err(e) = snap.edge.admit(req.headers_mut(), peer_trusted) {
        return Err(Answer::new(
            ProxyError::NotImplemented(e.to_string()).into_response(),
            crate::proxy::access::Decision::BadRequest,
        ));
    }
    let host =
        crate::http::authority::settle(req).map_err(|e| ProxyError::BadRequest(e.to_string()))?;
    let edge = Edge {
        peer_trusted,
        host,
        tls: req.extensions().get::<crate::tls::TlsInfo>().cloned(),
    };
    // The host name only on TLS: a tuple of both would find it for every request.
    if let Some(info) = &edge.tls {
        if let Some(host) = edge.host_name().filter(|host| info.misdirected(host)) {
            return Err(ProxyError::Misdirected(host.chars().take(256).collect()).into());
        }
    }
    Ok(edge)
}

/// Rewrite the request's path to its normal form ([`path::normalize`]), keeping the
/// query, so that routing and the upstream see the same path. The asterisk-form of
/// `OPTIONS *` is kept as it is (and routed as `/`).
///
/// Errors: 400 for a path with an encoded slash or a malformed escape, and for `*` with
/// any method but `OPTIONS`.
fn normalize_path(req: &mut Request<Incoming>) -> Result<(), ProxyError> {
    if req.uri().path() == "*" {
        return match *req.method() {
            http::Method::OPTIONS => Ok(()),
            _ => Err(ProxyError::BadRequest(
                "the asterisk-form `*` is for OPTIONS only".into(),
            )),
        };
    }
    let normal =
        path::normalize(req.uri().path()).map_err(|e| ProxyError::BadRequest(e.to_string()))?;
    let Some(normal) = normal else {
        return Ok(());
    };
    let pq = match req.uri().query() {
        Some(q) => format!("{normal}?{q}"),
        None => normal,
    };
    let mut parts = req.uri().clone().into_parts();
    parts.path_and_query = Some(
        pq.parse()
            .map_err(|_| ProxyError::BadRequest("path cannot be normalised".into()))?,
    );
    *req.uri_mut() = http::Uri::from_parts(parts)
        .map_err(|_| ProxyError::BadRequest("path cannot be normalised".into()))?;
    Ok(())
}
