//! Step 6 of the request path: the rate-limit headers, in the styles `headers.style`
//! selects: GitHub's `X-RateLimit-*`, and the IETF draft's `RateLimit-Policy` and
//! `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11, RFC 9651 structured fields):
//! `t` is the seconds until the caller has more quota (for every algorithm, not only a
//! window's end), concurrency limits carry `qu="concurrent-requests"`, and
//! `headers.partition_key` adds `pk`, the caller's keyed hash as a byte sequence.

use crate::config::HeaderStyle;
use crate::limiter::{Applied, Limit, Usage};
use crate::memo::Memo;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use std::fmt::Write;
use std::sync::Arc;

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
/// `RateLimit-Policy` (IETF): every limit that applied, as a list of
/// `"name";q=QUOTA;w=WINDOW_SECONDS` (and `qu`, `pk`: see [`policy_value`]).
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF): the most constrained limit, as
/// `"name";r=REMAINING;t=SECONDS_UNTIL_MORE_QUOTA` (and `pk`: see [`ratelimit_value`]).
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The largest integer an RFC 8941 sf-integer may hold (15 digits).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

/// The draft's quota unit (`qu`) of a concurrency limit: requests in flight.
pub const QU_CONCURRENT: &str = "concurrent-requests";

/// Which rate-limit header styles responses carry (`headers.style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Styles {
    /// GitHub's `X-RateLimit-*`.
    pub github: bool,
    /// The IETF draft's `RateLimit-Policy` and `RateLimit`.
    pub ietf: bool,
    /// `headers.problem_details`: refusals (a caller's 429, a failed store's 503) as
    /// RFC 9457 problem details instead of the GitHub-style JSON. Not a header style,
    /// but what the gateway's refusals look like, read where the styles are.
    pub problem_details: bool,
    /// `headers.partition_key`: the IETF fields carry `pk`, the caller's keyed hash
    /// (the digest in its storage keys) as an sf-binary.
    pub partition_key: bool,
}

impl Styles {
    /// The styles listed in `headers.style`.
    pub fn new(styles: &[HeaderStyle]) -> Self {
        Self {
            github: styles.contains(&HeaderStyle::Github),
            ietf: styles.contains(&HeaderStyle::Ietf),
            problem_details: false,
            partition_key: false,
        }
    }

    /// The `[headers]` section: its styles, `problem_details` and `partition_key`.
    pub fn of(config: &crate::config::HeadersConfig) -> Self {
        Self {
            problem_details: config.problem_details,
            partition_key: config.partition_key,
            ..Self::new(&config.style)
        }
    }
}

impl Default for Styles {
    /// `["github"]`, the default of `headers.style`.
    fn default() -> Self {
        Self {
            github: true,
            ietf: false,
            problem_details: false,
            partition_key: false,
        }
    }
}

/// One limit that applied to a request, as `RateLimit-Policy` lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy<'a> {
    /// The limit's name.
    pub name: &'a str,
    /// The caller's quota: cost units per window.
    pub quota: u64,
    /// The window's length in milliseconds (the header gives whole seconds, rounded up).
    pub window_ms: u64,
    /// The quota unit (`qu`) when it is not the draft's default, `"request"`:
    /// [`QU_CONCURRENT`] for a concurrency limit.
    pub unit: Option<&'static str>,
    /// The caller's partition of this limit: its storage key (`prefix:limit:{HEX}`),
    /// whose keyed digest is `pk` with `headers.partition_key` (read only then);
    /// `None` when unknown.
    pub partition: Option<&'a str>,
}

impl<'a> Policy<'a> {
    /// The policy of a limit as it applied to one request (the caller's tier's quota).
    pub fn of(applied: &'a Applied) -> Self {
        Self {
            partition: Some(&applied.key().key),
            ..Self::of_limit(applied.limit(), applied.quota())
        }
    }

    /// The policy of `limit` for a caller whose quota in it is `quota` units per window.
    pub fn of_limit(limit: &'a Limit, quota: u64) -> Self {
        Self {
            name: &limit.name,
            quota,
            window_ms: limit.window_ms,
            unit: (limit.algorithm == crate::config::Algorithm::Concurrency)
                .then_some(QU_CONCURRENT),
            partition: None,
        }
    }

    /// The window in whole seconds, rounded up (`w`).
    pub fn window_s(&self) -> u64 {
        self.window_ms.div_ceil(1000)
    }
}

/// The 32 hex digits of the keyed digest in a storage key (`prefix:limit:{HEX}`).
fn partition_of(key: &str) -> Option<&str> {
    let hex = key.strip_suffix('}')?.rsplit_once('{')?.1;
    (hex.len() == 32).then_some(hex)
}

/// Put the rate-limit headers of one request on its response, in the styles `styles`
/// selects, replacing any of them that the upstream sent: `usage` is the limit the
/// headers describe (the most constrained one, or the one that refused), `policies`
/// every limit that applied, and `now_ms` the time in milliseconds since the Unix epoch
/// (for `RateLimit`'s seconds until the reset). Headers of a style not selected are
/// left as the upstream sent them.
pub fn put<'a>(
    headers: &mut HeaderMap,
    styles: Styles,
    usage: &Usage,
    policies: impl IntoIterator<Item = Policy<'a>>,
    now_ms: u64,
) {
    if styles.github {
        put_usage(headers, usage);
    }
    if styles.ietf {
        put_ietf(headers, usage, policies, now_ms, styles.partition_key);
    }
}

/// Put `usage` on a response as `X-RateLimit-Limit`, `-Remaining`, `-Used`, `-Reset`
/// (UTC epoch seconds) and `-Resource`, replacing any the upstream sent.
pub fn put_usage(headers: &mut HeaderMap, usage: &Usage) {
    headers.insert(LIMIT.clone(), remembered(Remembered::Quota, usage.quota));
    headers.insert(REMAINING.clone(), number(usage.remaining()));
    headers.insert(USED.clone(), number(usage.used));
    headers.insert(
        RESET.clone(),
        remembered(Remembered::Reset, usage.reset_epoch_s()),
    );
    if let Some(v) = resource_value(&usage.resource) {
        headers.insert(RESOURCE.clone(), v);
    }
}

/// `n` in decimal as a header value: formatted on the stack, copied once. (http's
/// `From<u64>` writes through `fmt::Write` into a growing `BytesMut`, about three
/// times the instructions; this runs four times per response.)
pub fn number(n: u64) -> HeaderValue {
    let mut buf = itoa::Buffer::new();
    let digits = buf.format(n).as_bytes();
    HeaderValue::from_maybe_shared(Bytes::copy_from_slice(digits))
        .unwrap_or_else(|_| HeaderValue::from(n))
}

/// The numbers a thread's responses mostly repeat: the quota (the same for every
/// caller of a tier) and the reset (the same until the window ends).
#[derive(Clone, Copy)]
enum Remembered {
    Quota = 0,
    Reset = 1,
}

/// [`number`], from a per-thread memo of the last value of `which`: the value is shared
/// (a reference count) instead of formatted, allocated and checked again.
fn remembered(which: Remembered, n: u64) -> HeaderValue {
    thread_local! {
        static LAST: Memo<(u64, HeaderValue), 2> = const { Memo::new() };
    }
    LAST.with(|last| {
        last.get_or_put(
            which as u64,
            |(m, _)| *m == n,
            || (n, number(n)),
            |(_, v)| v.clone(),
        )
    })
}

/// A limit's name as the value of `X-RateLimit-Resource` (`None` when the name cannot
/// be one), from a one-entry memo per thread: a thread's requests mostly report the
/// same limit, whose value is then shared instead of copied and checked again. The memo
/// is keyed by the name's text, so a reload's new limits of the same name reuse it and
/// one of another name replaces it.
fn resource_value(name: &Arc<str>) -> Option<HeaderValue> {
    thread_local! {
        static LAST: Memo<(Arc<str>, HeaderValue), 1> = const { Memo::new() };
    }
    LAST.with(|last| {
        if let Some(v) = last.get(0, |(n, v)| (**n == **name).then(|| v.clone())) {
            return Some(v);
        }
        let v = HeaderValue::from_str(name).ok()?;
        drop(last.put(0, (name.clone(), v.clone())));
        Some(v)
    })
}

/// Put `RateLimit-Policy` (every limit in `policies`) and `RateLimit` (`usage`, with the
/// seconds from `now_ms` until more quota) on a response, replacing any the upstream
/// sent; with `pk`, both carry each limit's partition key. A field that cannot be
/// serialized (a name that is not printable ASCII) is removed instead.
pub fn put_ietf<'a>(
    headers: &mut HeaderMap,
    usage: &Usage,
    policies: impl IntoIterator<Item = Policy<'a>>,
    now_ms: u64,
    pk: bool,
) {
    // The partition of the limit `RateLimit` describes, seen on the way.
    let mut partition = None;
    let policies = policies.into_iter().inspect(|p| {
        if pk && partition.is_none() && p.name == &*usage.resource {
            partition = p.partition;
        }
    });
    match policy_value(policies, pk) {
        Some(v) => headers.insert(RATELIMIT_POLICY.clone(), v),
        None => headers.remove(&RATELIMIT_POLICY),
    };
    match ratelimit_value(usage, now_ms, partition) {
        Some(v) => headers.insert(RATELIMIT.clone(), v),
        None => headers.remove(&RATELIMIT),
    };
}

/// `"burst";q=100;w=60, "daily";q=1000;w=86400`, with `;qu="concurrent-requests"` after
/// `q` for a concurrency limit and, with `pk`, `;pk=:BASE64:` last for a limit whose
/// partition is known; `None` for an empty list or a name that is not printable ASCII.
pub fn policy_value<'a>(
    policies: impl IntoIterator<Item = Policy<'a>>,
    pk: bool,
) -> Option<HeaderValue> {
    let mut out = String::with_capacity(64);
    for p in policies {
        if !out.is_empty() {
            out.push_str(", ");
        }
        push_sf_string(&mut out, p.name)?;
        let _ = write!(out, ";q={}", p.quota.min(SF_INTEGER_MAX));
        if let Some(unit) = p.unit {
            out.push_str(";qu=");
            push_sf_string(&mut out, unit)?;
        }
        let _ = write!(out, ";w={}", p.window_s().min(SF_INTEGER_MAX));
        if pk {
            if let Some(key) = p.partition {
                push_pk(&mut out, key);
            }
        }
    }
    if out.is_empty() {
        return None;
    }
    HeaderValue::try_from(out).ok()
}

/// `"burst";r=42;t=17`: remaining units, and `t`, whole seconds from `now_ms` until
/// the caller has one unit more ([`Usage::more_at_s`]: the window's end for a fixed
/// window, the next regained unit for GCRA and the sliding algorithms; never more than
/// `Retry-After` on a refusal); with a `partition` (a storage key), `;pk=:BASE64:`
/// last. `None` for a name that is not printable ASCII.
pub fn ratelimit_value(usage: &Usage, now_ms: u64, partition: Option<&str>) -> Option<HeaderValue> {
    let mut out = String::with_capacity(32);
    push_sf_string(&mut out, &usage.resource)?;
    let _ = write!(
        out,
        ";r={};t={}",
        usage.remaining().min(SF_INTEGER_MAX),
        usage.more_at_s(now_ms).min(SF_INTEGER_MAX)
    );
    if let Some(key) = partition {
        push_pk(&mut out, key);
    }
    HeaderValue::try_from(out).ok()
}

/// Append `;pk=:BASE64:`, the RFC 9651 byte sequence of the 16 bytes of the keyed
/// digest in the storage key `key` (never a raw key, id or address); nothing when
/// `key` holds no digest.
fn push_pk(out: &mut String, key: &str) {
    use base64::Engine as _;
    let mut bytes = [0u8; 16];
    let Some(hex) = partition_of(key) else {
        return;
    };
    if hex::decode_to_slice(hex, &mut bytes).is_err() {
        return;
    }
    let mut b64 = [0u8; 24];
    let Ok(n) = base64::engine::general_purpose::STANDARD.encode_slice(bytes, &mut b64) else {
        return;
    };
    out.push_str(";pk=:");
    out.push_str(std::str::from_utf8(&b64[..n]).unwrap_or_default());
    out.push(':');
}

/// Whether `name` can be written as an RFC 8941 sf-string (printable ASCII only).
pub fn is_sf_string(name: &str) -> bool {
    name.bytes().all(|b| (b' '..=b'~').contains(&b))
}

/// Append `s` as an RFC 8941 sf-string (`"` and `\` escaped); `None` when it holds a
/// character outside printable ASCII, which an sf-string cannot carry.
fn push_sf_string(out: &mut String, s: &str) -> Option<()> {
    if !is_sf_string(s) {
        return None;
    }
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    Some(())
}

#[cfg(test)]
mod tests;
