//! What identifying a caller, or reloading the keys file, can end in.

use super::auth_request;
use http::HeaderValue;

/// Why a caller could not be identified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// An API key was presented but matches no client (HTTP 401).
    #[error("Bad credentials")]
    BadCredentials,
    /// A JWT was presented and failed verification (HTTP 401); the reason, e.g.
    /// `expired`.
    #[error("invalid token: {0}")]
    InvalidToken(String),
    /// The credential header is not exactly one credential: sent twice, several
    /// credentials in one value, or a key scheme without a key (HTTP 400). What the
    /// gateway cannot identify unambiguously, it must not forward either.
    #[error("malformed credentials: {0}")]
    Malformed(&'static str),
    /// `[identity.auth_request]` answered 401 or 403: passed to the client as it is.
    #[error("refused by the auth service")]
    Refused {
        /// 401 or 403.
        status: u16,
        /// The answer's `Content-Type`.
        content_type: Option<HeaderValue>,
        /// The answer's body (at most 64 KB).
        body: bytes::Bytes,
    },
    /// `[identity.auth_request]` failed (why: `error`, `timeout`, `breaker_open`) and
    /// its `on_error = "deny"` (HTTP 503).
    #[error("authentication service unavailable")]
    AuthUnavailable(&'static str),
    /// A callout to `[identity.auth_request]` was needed and none was made:
    /// `identity.auth_request.max_concurrent` are under way (HTTP 503), or
    /// `max_concurrent_per_ip` for the request's client address (`per_address`: HTTP 429).
    #[error("too many auth callouts under way")]
    AuthBusy {
        /// Whether the client address's own bound was the one reached.
        per_address: bool,
    },
    /// `[identity.auth_request]` answered another 4xx (the status): it could not judge
    /// this request, e.g. 431 for a long `X-Original-URI`. This request only gets a 4xx.
    #[error("the authentication service could not judge this request ({0})")]
    AuthRejected(u16),
    /// What a callout would send is larger than its bound, so none is made: the URI
    /// (414) or the credential and forwarded headers (431).
    #[error("{0:?}")]
    TooLargeToAsk(auth_request::Oversize),
}

/// What a reload of the keys file did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeysReload {
    /// The new set is in use.
    Applied {
        /// Clients (distinct ids) of the new set.
        clients: usize,
        /// Keys of the new set.
        keys: usize,
    },
    /// The new set would remove too many keys: the running set stays until SIGHUP.
    Held {
        /// Keys in use that the new set does not have.
        removed: usize,
        /// Keys in use.
        running: usize,
        /// Keys of the new set.
        keys: usize,
    },
}
