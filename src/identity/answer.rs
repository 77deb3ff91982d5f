//! What `[identity.auth_request]`'s service answered about one credential
//! ([`Answer`]), and how a response of the service is read into one.

use super::Client;
use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Largest body of a 401/403 answer passed on to the client (and cached), in bytes. A
/// longer body (or one whose `Content-Type` is longer than 256 bytes) is replaced by the
/// gateway's own JSON refusal: `{"message":"Bad credentials"}` for a 401,
/// `{"message":"Forbidden"}` for a 403.
pub const MAX_REFUSAL_BODY: usize = 4 * 1024;

/// Largest `Content-Type` of a refusal passed on, in bytes.
const MAX_CONTENT_TYPE: usize = 256;

/// What the auth service said about one credential.
#[derive(Debug, Clone)]
pub enum Answer {
    /// A 2xx naming the caller.
    Caller(Arc<Client>),
    /// A 401 or 403, passed to the client as it is.
    Refused {
        /// 401 or 403.
        status: u16,
        /// Its `Content-Type`, if any.
        content_type: Option<HeaderValue>,
        /// Its body (at most [`MAX_REFUSAL_BODY`] bytes).
        body: Bytes,
    },
    /// Another 4xx (its status): the service could not judge this request (e.g. 431 for
    /// a long `X-Original-URI`). Answers this request only: not cached, and not a
    /// failure of the service (the breaker does not count it).
    Rejected(u16),
    /// No usable answer (`on_error` decides): why, for the logs and the metric.
    Failed(&'static str),
    /// No callout was made: `max_concurrent` callouts are under way, or
    /// `max_concurrent_per_ip` for the request's client address (`per_address`).
    Busy {
        /// Whether the client address's own bound was the one reached.
        per_address: bool,
    },
}

/// What the callout would forward is larger than its bound: the request gets this
/// status without a callout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oversize {
    /// The URI (sent as `X-Original-URI`) is longer than `max_uri_bytes` (the bound,
    /// bytes): 414.
    Uri(usize),
    /// The credential and forwarded headers (names and values) are larger than
    /// `max_header_bytes` (the bound, bytes): 431.
    Headers(usize),
}

/// What reading an answer needs (owned, for the callout's future).
pub(super) struct Parsed {
    pub(super) caller_header: HeaderName,
    pub(super) tier_header: HeaderName,
    pub(super) quota_prefix: String,
    pub(super) default_tier: String,
    pub(super) tiers: BTreeSet<Arc<str>>,
    pub(super) limits: HashMap<String, Arc<str>>,
}

impl Parsed {
    /// The answer of `parts` and `body` (`None`: longer than was read).
    pub(super) fn answer(&self, parts: http::response::Parts, body: Option<Bytes>) -> Answer {
        let status = parts.status.as_u16();
        if status == 401 || status == 403 {
            return refusal(status, parts.headers.get(http::header::CONTENT_TYPE), body);
        }
        if parts.status.is_client_error() {
            return Answer::Rejected(status);
        }
        if !parts.status.is_success() {
            return Answer::Failed("error");
        }
        let Some(id) = parts
            .headers
            .get(&self.caller_header)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|id| {
                !id.is_empty()
                    && id.len() <= 256
                    && !id.contains(',')
                    && !id.chars().any(char::is_control)
            })
        else {
            return Answer::Failed("error");
        };
        let tier = parts
            .headers
            .get(&self.tier_header)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .unwrap_or(&self.default_tier);
        let Some(tier) = self.tiers.get(tier).cloned() else {
            return Answer::Failed("error");
        };
        let mut quotas = Vec::new();
        for (name, v) in &parts.headers {
            let Some(limit) = name.as_str().strip_prefix(self.quota_prefix.as_str()) else {
                continue;
            };
            let (Some(limit), Some(n)) = (
                self.limits.get(limit),
                v.to_str().ok().and_then(|v| v.trim().parse::<u64>().ok()),
            ) else {
                continue;
            };
            if n > 0 {
                quotas.push((limit.clone(), n));
            }
        }
        let mut client = Client::new(id.into(), tier);
        if !quotas.is_empty() {
            client.quotas = Some(Box::new(quotas.into_boxed_slice()));
        }
        Answer::Caller(Arc::new(client))
    }
}

/// A 401/403 answer as kept and passed on: its body and `Content-Type` when they fit
/// their bounds (copied, so that the read buffer is not kept), else the gateway's own
/// JSON refusal.
pub(super) fn refusal(
    status: u16,
    content_type: Option<&HeaderValue>,
    body: Option<Bytes>,
) -> Answer {
    match body {
        Some(body)
            if body.len() <= MAX_REFUSAL_BODY
                && content_type.is_none_or(|c| c.len() <= MAX_CONTENT_TYPE) =>
        {
            Answer::Refused {
                status,
                content_type: content_type.cloned(),
                body: Bytes::copy_from_slice(&body),
            }
        }
        _ => Answer::Refused {
            status,
            content_type: Some(HeaderValue::from_static("application/json")),
            body: Bytes::from_static(if status == 403 {
                b"{\"message\":\"Forbidden\"}"
            } else {
                b"{\"message\":\"Bad credentials\"}"
            }),
        },
    }
}
