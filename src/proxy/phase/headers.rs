//! Phase 7, headers: `X-RateLimit-*` of the most constrained limit, and/or the IETF
//! `RateLimit-Policy` (every applied limit) and `RateLimit` ([`crate::proxy::headers`]);
//! the concurrency slots go with the response body, given back when it ends.

use super::settle::Settled;
use crate::limiter::{most_constrained, Applied, Usage};
use crate::proxy::access::AccessLog;
use crate::proxy::headers::Policy;
use crate::proxy::{Body, Gate};
use http::Response;

/// `response` with the rate-limit headers of `settled` (the limit with the fewest
/// remaining units, noted in `log`) and its concurrency slots held by the body.
#[inline]
pub fn headers(
    snap: &Gate<'_>,
    mut response: Response<Body>,
    settled: Settled,
    log: &mut AccessLog,
) -> Response<Body> {
    if let Some(usage) = most_constrained(&settled.usages) {
        put(snap, &mut response, usage, &settled.applied, settled.now_ms);
        log.usage = Some(usage.clone());
    }
    if let Some(guard) = settled.slots {
        response = response.map(|body| crate::response::with_guard(body, guard));
    }
    response
}

/// The rate-limit headers of a request in the styles of `headers.style`: `usage` is the
/// limit they describe, `applied` every limit that applied (for `RateLimit-Policy`),
/// `now_ms` milliseconds since the Unix epoch.
pub fn put(
    snap: &Gate<'_>,
    response: &mut Response<Body>,
    usage: &Usage,
    applied: &[Applied],
    now_ms: u64,
) {
    crate::proxy::headers::put(
        response.headers_mut(),
        snap.headers,
        usage,
        applied.iter().map(Policy::of),
        now_ms,
    );
}
