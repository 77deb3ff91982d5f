//! Step 6 of the request path: the `X-RateLimit-*` headers (GitHub's names).

use crate::limiter::Usage;
use http::{HeaderMap, HeaderValue};

/// Put `usage` on a response as `X-RateLimit-Limit`, `-Remaining`, `-Used`, `-Reset`
/// (UTC epoch seconds) and `-Resource`, replacing any the upstream sent.
pub fn put_usage(headers: &mut HeaderMap, usage: &Usage) {
    headers.insert("x-ratelimit-limit", HeaderValue::from(usage.quota));
    headers.insert(
        "x-ratelimit-remaining",
        HeaderValue::from(usage.remaining()),
    );
    headers.insert("x-ratelimit-used", HeaderValue::from(usage.used));
    headers.insert(
        "x-ratelimit-reset",
        HeaderValue::from(usage.reset_epoch_s()),
    );
    if let Ok(v) = HeaderValue::from_str(&usage.resource) {
        headers.insert("x-ratelimit-resource", v);
    }
}
