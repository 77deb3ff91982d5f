//! Every way the gateway itself answers a request, with its status and JSON body.

use crate::limiter::Usage;
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
    /// Over a limit: 429 with the headers of the CHECK that found it.
    #[error("API rate limit exceeded for {caller}.")]
    OverLimit {
        /// The usage of the limit that rejected the request.
        usage: Usage,
        /// Whole seconds until the reset, at least 1.
        retry_after_s: u64,
        /// Caller id or client IP.
        caller: String,
    },
    /// `[identity.auth_request]` failed and its `on_error = "deny"`: 503.
    #[error("authentication service unavailable")]
    AuthUnavailable,
    /// The store failed and `store.on_error = "deny"`: 503.
    #[error("rate limit store unavailable")]
    StoreUnavailable,
    /// The upstream refused, reset or could not be reached: 502.
    #[error("upstream {0:?} unreachable")]
    UpstreamUnreachable(String, String),
    /// The upstream took too long to connect or to send response headers: 504.
    #[error("upstream {0:?} timed out")]
    UpstreamTimeout(String),
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
    /// The request body stopped arriving for `server.body_timeout` (the timeout): 408.
    #[error("request body timed out: nothing arrived for {0:?}")]
    BodyTimeout(std::time::Duration),
    /// A budget is spent: the descriptor budget (no upstream socket may be opened) or
    /// `server.max_tunnels` (what ran out is said): 503 with `Retry-After: 1`.
    #[error("{0}")]
    Overloaded(&'static str),
}

impl ProxyError {
    /// The HTTP status the caller sees.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BadCredentials | ProxyError::InvalidToken(_) => StatusCode::UNAUTHORIZED,
            ProxyError::NoRoute => StatusCode::NOT_FOUND,
            ProxyError::OverLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::StoreUnavailable | ProxyError::AuthUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::UpstreamUnreachable(..) => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::Misdirected(_) => StatusCode::MISDIRECTED_REQUEST,
            ProxyError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ProxyError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The JSON response: `{"message": ...}` plus, for 429, `limit`, `remaining`, `reset`,
    /// `resource` and `retry_after`, with a `Retry-After` header (whole seconds). The
    /// rate-limit headers are the request path's to add ([`super::headers::put`]), in the
    /// styles `headers.style` selects.
    pub fn into_response(self) -> Response<Body> {
        use std::fmt::Write;
        let status = self.status();
        // Sized for the usual message and body: no growth while they are written.
        let mut message = String::with_capacity(96);
        let _ = write!(message, "{self}");
        let mut body = ErrorBody {
            message: &message,
            limit: None,
            remaining: None,
            reset: None,
            resource: None,
            retry_after: None,
        };
        if let ProxyError::OverLimit {
            usage,
            retry_after_s,
            ..
        } = &self
        {
            body.limit = Some(usage.quota);
            body.remaining = Some(0);
            body.reset = Some(usage.reset_epoch_s());
            body.resource = Some(&usage.resource);
            body.retry_after = Some(*retry_after_s);
        }
        // Serializing a struct of plain fields cannot fail.
        let mut bytes = Vec::with_capacity(message.len() + 128);
        if serde_json::to_writer(&mut bytes, &body).is_err() {
            bytes.clear();
        }
        let mut response = json_bytes_response(status, bytes);
        match &self {
            ProxyError::OverLimit { retry_after_s, .. } => {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_s));
            }
            ProxyError::Overloaded(_) => {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        response
    }
}

/// The JSON body of the gateway's own answers (a struct, not a `serde_json::Value`: the
/// 429 path is hot under abuse).
#[derive(serde::Serialize)]
struct ErrorBody<'a> {
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    remaining: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reset: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    resource: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after: Option<u64>,
}

/// `error` and its sources, outermost first (following [`Error::source`]).
pub(crate) fn causes<'a>(
    error: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(Some(error), |&e| e.source())
}
