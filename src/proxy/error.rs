//! Every way the gateway itself answers a request, with its status and JSON body.
//!
//! A request answered before it was forwarded gets one of [`ProxyError`]'s own variants.
//! A forwarded request that failed gets [`ProxyError::Forwarded`], whose
//! [`ForwardError`] carries what failed ([`Fault`]), the step ([`Step`]), whether it
//! may be sent again, and the upstream and target. Each fact is read once, where it is
//! known, and nothing downstream looks into an error's causes to decide a status:
//!
//! - connecting, the TLS handshake, the HTTP handshake and the exchange: the pool
//!   (`src/proxy/pool/error.rs`, [`crate::proxy::pool::PoolError::fault`]) from the
//!   typed errors of tokio, rustls, hyper and h2;
//! - an HTTP/1.1 connection whose I/O timed out: hyper keeps that `io::Error` only as
//!   an untyped cause, so the pool reads it there once, in the one function that looks
//!   into an error's causes by type (`io_timed_out` in `src/proxy/pool/error.rs`, whose
//!   documentation says why), into a typed fact;
//! - the request body (too large, stopped arriving, unreadable): the body itself, where
//!   it fails ([`crate::proxy::body::BodyState::failure`]), read by the pool; it decides
//!   the answer whatever the connection then reports;
//! - no response head within `response_timeout`, a head past
//!   `max_response_header_bytes`, an unasked-for 101, a response of unknown length: the
//!   forward loop (`src/proxy/forward.rs`), which also decides on the one retry from
//!   [`ForwardError::retry_safe`].

mod body;
mod forwarded;

use body::Problem;
pub(super) use body::{over_limit_body, over_limit_problem_body};
pub use body::{
    PROBLEM_JSON, QUOTA_EXCEEDED, QUOTA_EXCEEDED_TITLE, TEMPORARY_REDUCED_CAPACITY,
    TEMPORARY_REDUCED_CAPACITY_TITLE,
};
pub use forwarded::{BadResponse, Fault, ForwardError, Step};

use super::access::Decision;
use crate::response::{json_bytes_response, Body};
use http::{header, HeaderValue, Response, StatusCode};
use std::error::Error;

/// A request the gateway answers itself instead of (or after failing at) forwarding.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// An API key was presented and matches no client: 401.
    #[error("Bad credentials")]
    BadCredentials,
    /// A JWT was presented and failed verification: 401 with the reason.
    #[error("invalid token: {0}")]
    InvalidToken(String),
    /// No route matches the host and path: 404.
    #[error("no route for this host and path")]
    NoRoute,
    /// `[identity.auth_request]` failed and its `on_error = "deny"`: 503.
    #[error("authentication service unavailable")]
    AuthUnavailable,
    /// `[identity.auth_request]` answered another 4xx than 401/403 (the status): it
    /// could not judge this request. The same status (400 for 407, 408, 421 and 426,
    /// which would mean something else to the client).
    #[error("the authentication service could not judge this request ({0})")]
    AuthRejected(u16),
    /// The URI is longer than `identity.auth_request.max_uri_bytes` (the bound, bytes),
    /// so no callout was made: 414.
    #[error("URI longer than {0} bytes: too long to authenticate")]
    UriTooLongToAsk(usize),
    /// The credential and forwarded headers are larger than
    /// `identity.auth_request.max_header_bytes` (the bound, bytes), so no callout was
    /// made: 431.
    #[error("credential and forwarded headers larger than {0} bytes: too large to authenticate")]
    HeadersTooLargeToAsk(usize),
    /// The store failed and `store.on_error = "deny"`: 503.
    #[error("rate limit store unavailable")]
    StoreUnavailable,
    /// The request was forwarded and failed: the upstream refused, reset, timed out
    /// or answered what cannot be passed on (502, 504), no descriptor was left for a
    /// connection (503), or the request body failed on its way (413, 408, 400). The
    /// status and message are the failure's ([`ForwardError`]).
    #[error("{0}")]
    Forwarded(ForwardError),
    /// The request body is larger than the route's `max_request_bytes` (bytes): 413.
    #[error("request body larger than {0} bytes")]
    BodyTooLarge(u64),
    /// The request cannot be forwarded as sent: 400.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The request's host (the string) is one another certificate of the TLS listener
    /// is for than the one this connection's SNI chose: 421.
    #[error("misdirected request: this connection is not for {0:?}")]
    Misdirected(String),
    /// The request uses something tollgate does not implement (a transfer coding other
    /// than `chunked`): 501.
    #[error("not implemented: {0}")]
    NotImplemented(String),
    /// A budget is spent: `server.max_tunnels` (what ran out is said): 503 with
    /// `Retry-After: 1`. (A spent descriptor budget is a forwarded request's
    /// [`Fault::NoDescriptor`], answered alike.)
    #[error("{0}")]
    Overloaded(&'static str),
    /// The client (its address) holds its share of a bound shared with others (what is
    /// said): `server.descriptor_share_per_ip`: 429 with `Retry-After: 1`.
    #[error("{0}")]
    Busy(&'static str),
    /// Too many `[identity.auth_request]` callouts are under way: for this client
    /// address (`per_address`, `max_concurrent_per_ip`: 429) or in all
    /// (`max_concurrent`: 503); both with `Retry-After: 1`, and answered without a
    /// callout.
    #[error("{}", auth_busy(.per_address))]
    AuthBusy {
        /// Whether this address's share is spent (else the gateway's bound).
        per_address: bool,
    },
}

/// The message of [`ProxyError::AuthBusy`].
fn auth_busy(per_address: &bool) -> &'static str {
    if *per_address {
        "too many auth callouts under way for this client address"
    } else {
        "too many auth callouts under way"
    }
}

/// Where a failure came from, as [`ProxyError::origin`] tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The client: what it sent (or did not send) cannot be served.
    Client,
    /// The upstream, or the auth service: unreachable, too slow, or answering what
    /// cannot be passed on.
    Upstream,
    /// The rate-limit store.
    Store,
    /// The gateway itself: a budget of its own is spent.
    Internal,
}

impl ProxyError {
    /// The HTTP status the caller sees.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::AuthBusy { per_address: true } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::AuthBusy { per_address: false } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::BadCredentials | ProxyError::InvalidToken(_) => StatusCode::UNAUTHORIZED,
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::StoreUnavailable | ProxyError::AuthUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::AuthRejected(status) => match status {
                407 | 408 | 421 | 426 => StatusCode::BAD_REQUEST,
                s => StatusCode::from_u16(*s)
                    .ok()
                    .filter(StatusCode::is_client_error)
                    .unwrap_or(StatusCode::BAD_REQUEST),
            },
            ProxyError::UriTooLongToAsk(_) => StatusCode::URI_TOO_LONG,
            ProxyError::HeadersTooLargeToAsk(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::Forwarded(failure) => failure.status(),
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::Misdirected(_) => StatusCode::MISDIRECTED_REQUEST,
            ProxyError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ProxyError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The access-log decision of a request refused with this error before it was
    /// forwarded (`None` for the failures of a forwarded request, which keep the
    /// decision of its check: see [`super::phase::Answer`]).
    pub fn decision(&self) -> Option<Decision> {
        Some(match self {
            ProxyError::BadCredentials
            | ProxyError::InvalidToken(_)
            | ProxyError::AuthUnavailable
            | ProxyError::AuthRejected(_)
            | ProxyError::AuthBusy { .. }
            | ProxyError::UriTooLongToAsk(_)
            | ProxyError::HeadersTooLargeToAsk(_) => Decision::Unauthenticated,
            ProxyError::NoRoute => Decision::NoRoute,
            ProxyError::Busy(_) => Decision::Rejected,
            ProxyError::StoreUnavailable => Decision::StoreErrorDenied,
            ProxyError::BodyTooLarge(_) => Decision::TooLarge,
            ProxyError::BadRequest(_) | ProxyError::NotImplemented(_) => Decision::BadRequest,
            ProxyError::Misdirected(_) => Decision::Misdirected,
            ProxyError::Forwarded(_) | ProxyError::Overloaded(_) => return None,
        })
    }

    /// Where the failure came from: the client, the upstream (or the auth service), the
    /// store, or the gateway's own budgets.
    pub fn origin(&self) -> Origin {
        match self {
            ProxyError::BadCredentials
            | ProxyError::InvalidToken(_)
            | ProxyError::NoRoute
            | ProxyError::AuthRejected(_)
            | ProxyError::UriTooLongToAsk(_)
            | ProxyError::HeadersTooLargeToAsk(_)
            | ProxyError::BodyTooLarge(_)
            | ProxyError::BadRequest(_)
            | ProxyError::Misdirected(_)
            | ProxyError::NotImplemented(_)
            | ProxyError::Busy(_)
            | ProxyError::AuthBusy { per_address: true } => Origin::Client,
            ProxyError::AuthUnavailable => Origin::Upstream,
            ProxyError::Forwarded(failure) => failure.origin(),
            ProxyError::StoreUnavailable => Origin::Store,
            ProxyError::Overloaded(_) | ProxyError::AuthBusy { per_address: false } => {
                Origin::Internal
            }
        }
    }

    /// Whether nothing of the request reached an upstream, so that sending it (again)
    /// has no second effect there: true for every answer made before forwarding, and for
    /// a forwarded request whose failure came before a byte of it was sent
    /// ([`ForwardError::retry_safe`]).
    pub fn retry_safe(&self) -> bool {
        match self {
            ProxyError::Forwarded(failure) => failure.retry_safe(),
            _ => true,
        }
    }

    /// What failed, for a forwarded request ([`ForwardError::fault`]); `None` for an
    /// answer made before forwarding.
    pub fn fault(&self) -> Option<Fault> {
        match self {
            ProxyError::Forwarded(failure) => Some(failure.fault()),
            _ => None,
        }
    }

    /// The JSON response: `{"message": ...}`, with `Retry-After: 1` for the gateway's
    /// own overload answers. (A caller over a limit gets its 429 from
    /// [`super::refusal::over_limit`], with `limit`, `remaining`, `reset`, `resource` and
    /// `retry_after` in the body.) The rate-limit headers are the request path's to add
    /// ([`super::headers::put`]), in the styles `headers.style` selects.
    pub fn into_response(self) -> Response<Body> {
        let status = self.status();
        let bytes = {
            use std::fmt::Write;
            // Sized for the usual message and body: no growth while they are written.
            let mut message = String::with_capacity(96);
            let _ = write!(message, "{self}");
            let body = ErrorBody { message: &message };
            // Serializing a struct of plain fields cannot fail.
            let mut bytes = Vec::with_capacity(message.len() + 32);
            if serde_json::to_writer(&mut bytes, &body).is_err() {
                bytes.clear();
            }
            bytes
        };
        let mut response = json_bytes_response(status, bytes);
        let overloaded = match &self {
            ProxyError::Overloaded(_) | ProxyError::Busy(_) | ProxyError::AuthBusy { .. } => true,
            ProxyError::Forwarded(failure) => failure.fault() == Fault::NoDescriptor,
            _ => false,
        };
        if overloaded {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl ProxyError {
    /// [`Self::into_response`], or with `problem_details` (`headers.problem_details`)
    /// the answers the draft has a problem type for as RFC 9457 problem details:
    /// [`ProxyError::StoreUnavailable`] as `temporary-reduced-capacity`, with
    /// `Content-Type: application/problem+json` and the same other headers. Every other
    /// answer is [`Self::into_response`]'s.
    pub fn into_response_with(self, problem_details: bool) -> Response<Body> {
        if !problem_details || !matches!(self, ProxyError::StoreUnavailable) {
            return self.into_response();
        }
        let status = self.status();
        let detail = self.to_string();
        let body = Problem {
            kind: TEMPORARY_REDUCED_CAPACITY,
            title: TEMPORARY_REDUCED_CAPACITY_TITLE,
            status: status.as_u16(),
            detail: &detail,
        };
        let mut response = self.into_response();
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        let (parts, _) = response.into_parts();
        // Serializing a struct of plain fields cannot fail.
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        Response::from_parts(parts, crate::response::bytes_body(bytes))
    }
}

/// The JSON body of the gateway's own answers but the 429 (which [`over_limit_body`]
/// writes): `{"message": ...}`.
#[derive(serde::Serialize)]
struct ErrorBody<'a> {
    message: &'a str,
}

/// `error` and its sources, outermost first (following [`Error::source`]).
pub(crate) fn causes<'a>(
    error: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(Some(error), |&e| e.source())
}

/// `e` and its sources, outermost first, joined by `: ` (for log lines).
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for (k, err) in causes(e).enumerate() {
        if k > 0 {
            out.push_str(": ");
        }
        // Writing to a String cannot fail.
        let _ = write!(out, "{err}");
    }
    out
}
