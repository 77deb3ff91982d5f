//! Step 6 of the request path: the `X-RateLimit-*` headers (GitHub's names).

use crate::limiter::Usage;
use http::{HeaderMap, HeaderName, HeaderValue};

/// `X-RateLimit-Limit`: the quota of the caller's tier, units per window.
pub static LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: units left in the window.
pub static REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Used`: units charged in the window.
pub static USED: HeaderName = HeaderName::from_static("x-ratelimit-used");
/// `X-RateLimit-Reset`: end of the window, UTC epoch seconds.
pub static RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// `X-RateLimit-Resource`: the limit's name.
pub static RESOURCE: HeaderName = HeaderName::from_static("x-ratelimit-resource");

/// Put `usage` on a response as `X-RateLimit-Limit`, `-Remaining`, `-Used`, `-Reset`
/// (UTC epoch seconds) and `-Resource`, replacing any the upstream sent.
pub fn put_usage(headers: &mut HeaderMap, usage: &Usage) {
    headers.insert(LIMIT.clone(), HeaderValue::from(usage.quota));
    headers.insert(REMAINING.clone(), HeaderValue::from(usage.remaining()));
    headers.insert(USED.clone(), HeaderValue::from(usage.used));
    headers.insert(RESET.clone(), HeaderValue::from(usage.reset_epoch_s()));
    if let Ok(v) = HeaderValue::from_str(&usage.resource) {
        headers.insert(RESOURCE.clone(), v);
    }
}
