//! Step 6 of the request path: the rate-limit headers, in the styles `headers.style`
//! selects: GitHub's `X-RateLimit-*`, and the IETF draft's `RateLimit-Policy` and
//! `RateLimit` (draft-ietf-httpapi-ratelimit-headers, RFC 8941 structured fields).

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
/// `"name";q=QUOTA;w=WINDOW_SECONDS`.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (IETF): the most constrained limit, as
/// `"name";r=REMAINING;t=SECONDS_UNTIL_RESET`.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// The largest integer an RFC 8941 sf-integer may hold (15 digits).
const SF_INTEGER_MAX: u64 = 999_999_999_999_999;

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
}

impl Styles {
    /// The styles listed in `headers.style`.
    pub fn new(styles: &[HeaderStyle]) -> Self {
        Self {
            github: styles.contains(&HeaderStyle::Github),
            ietf: styles.contains(&HeaderStyle::Ietf),
            problem_details: false,
        }
    }

    /// The `[headers]` section: its styles and `problem_details`.
    pub fn of(config: &crate::config::HeadersConfig) -> Self {
        Self {
            problem_details: config.problem_details,
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
}

impl<'a> Policy<'a> {
    /// The policy of a limit as it applied to one request (the caller's tier's quota).
    pub fn of(applied: &'a Applied) -> Self {
        Self::of_limit(applied.limit(), applied.quota())
    }

    /// The policy of `limit` for a caller whose quota in it is `quota` units per window.
    pub fn of_limit(limit: &'a Limit, quota: u64) -> Self {
        Self {
            name: &limit.name,
            quota,
            window_ms: limit.window_ms,
        }
    }

    /// The window in whole seconds, rounded up (`w`).
    pub fn window_s(&self) -> u64 {
        self.window_ms.div_ceil(1000)
    }
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
        put_ietf(headers, usage, policies, now_ms);
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
/// seconds from `now_ms` until its reset) on a response, replacing any the upstream
/// sent. A field that cannot be serialized (a name that is not printable ASCII) is
/// removed instead.
pub fn put_ietf<'a>(
    headers: &mut HeaderMap,
    usage: &Usage,
    policies: impl IntoIterator<Item = Policy<'a>>,
    now_ms: u64,
) {
    match policy_value(policies) {
        Some(v) => headers.insert(RATELIMIT_POLICY.clone(), v),
        None => headers.remove(&RATELIMIT_POLICY),
    };
    match ratelimit_value(usage, now_ms) {
        Some(v) => headers.insert(RATELIMIT.clone(), v),
        None => headers.remove(&RATELIMIT),
    };
}

/// `"burst";q=100;w=60, "daily";q=1000;w=86400`; `None` for an empty list or a name that
/// is not printable ASCII.
pub fn policy_value<'a>(policies: impl IntoIterator<Item = Policy<'a>>) -> Option<HeaderValue> {
    let mut out = String::with_capacity(64);
    for p in policies {
        if !out.is_empty() {
            out.push_str(", ");
        }
        push_sf_string(&mut out, p.name)?;
        let _ = write!(
            out,
            ";q={};w={}",
            p.quota.min(SF_INTEGER_MAX),
            p.window_s().min(SF_INTEGER_MAX)
        );
    }
    if out.is_empty() {
        return None;
    }
    HeaderValue::try_from(out).ok()
}

/// `"burst";r=42;t=17`: remaining units, and whole seconds from `now_ms` until the
/// reset (rounded up, at least 0); `None` for a name that is not printable ASCII.
pub fn ratelimit_value(usage: &Usage, now_ms: u64) -> Option<HeaderValue> {
    let mut out = String::with_capacity(32);
    push_sf_string(&mut out, &usage.resource)?;
    let t = usage.reset_at_ms.saturating_sub(now_ms).div_ceil(1000);
    let _ = write!(
        out,
        ";r={};t={}",
        usage.remaining().min(SF_INTEGER_MAX),
        t.min(SF_INTEGER_MAX)
    );
    HeaderValue::try_from(out).ok()
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
mod tests {
    use super::*;

    fn usage(name: &str, quota: u64, used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: name.into(),
            quota,
            used,
            reset_at_ms,
            retry_at_ms: 0,
            blocked_until_ms: 0,
        }
    }

    fn policy(name: &str, quota: u64, window_ms: u64) -> Policy<'_> {
        Policy {
            name,
            quota,
            window_ms,
        }
    }

    #[test]
    fn policy_lists_every_limit() {
        let v = policy_value([
            policy("burst", 100, 60_000),
            policy("daily", 1000, 86_400_000),
        ]);
        assert_eq!(
            v.unwrap().to_str().unwrap(),
            r#""burst";q=100;w=60, "daily";q=1000;w=86400"#
        );
        assert_eq!(policy_value([]), None);
        // Whole seconds, rounded up.
        let v = policy_value([policy("x", 1, 1_500)]).unwrap();
        assert_eq!(v.to_str().unwrap(), r#""x";q=1;w=2"#);
    }

    #[test]
    fn ratelimit_counts_seconds_up_and_never_below_zero() {
        let u = usage("burst", 100, 58, 17_000);
        assert_eq!(ratelimit_value(&u, 0).unwrap(), r#""burst";r=42;t=17"#);
        assert_eq!(ratelimit_value(&u, 16_001).unwrap(), r#""burst";r=42;t=1"#);
        assert_eq!(ratelimit_value(&u, 17_000).unwrap(), r#""burst";r=42;t=0"#);
        assert_eq!(ratelimit_value(&u, 20_000).unwrap(), r#""burst";r=42;t=0"#);
        let over = usage("burst", 100, 130, 17_000);
        assert_eq!(ratelimit_value(&over, 0).unwrap(), r#""burst";r=0;t=17"#);
    }

    #[test]
    fn names_are_escaped_and_non_ascii_is_refused() {
        let v = policy_value([policy(r#"a"b\c"#, 1, 1_000)]).unwrap();
        assert_eq!(v.to_str().unwrap(), r#""a\"b\\c";q=1;w=1"#);
        assert_eq!(policy_value([policy("café", 1, 1_000)]), None);
        assert_eq!(ratelimit_value(&usage("café", 1, 0, 0), 0), None);
    }

    #[test]
    fn integers_are_clamped_to_the_sf_integer_range() {
        let v = policy_value([policy("x", u64::MAX, u64::MAX)]).unwrap();
        assert_eq!(
            v.to_str().unwrap(),
            r#""x";q=999999999999999;w=999999999999999"#
        );
    }

    #[test]
    fn styles_select_the_fields() {
        let u = usage("core", 10, 3, 5_000);
        let p = [policy("core", 10, 60_000)];
        let mut h = HeaderMap::new();
        h.insert("ratelimit", HeaderValue::from_static("upstream"));
        put(&mut h, Styles::new(&[HeaderStyle::Ietf]), &u, p, 1_000);
        assert_eq!(h["ratelimit"], r#""core";r=7;t=4"#, "replaced");
        assert_eq!(h["ratelimit-policy"], r#""core";q=10;w=60"#);
        assert!(h.get("x-ratelimit-limit").is_none());

        let mut h = HeaderMap::new();
        put(&mut h, Styles::new(&[]), &u, p, 1_000);
        assert!(h.is_empty());

        let mut h = HeaderMap::new();
        put(&mut h, Styles::default(), &u, p, 1_000);
        assert_eq!(h["x-ratelimit-remaining"], "7");
        assert!(h.get("ratelimit").is_none());
    }

    #[test]
    fn numbers_are_written_as_http_writes_them() {
        for n in [
            0,
            1,
            9,
            10,
            99,
            1000,
            4_294_967_296,
            999_999_999_999_999,
            u64::MAX,
        ] {
            assert_eq!(number(n), HeaderValue::from(n), "{n}");
        }
    }

    #[test]
    fn remembered_numbers_are_the_numbers() {
        for n in [60, 60, 61, 60, 0, u64::MAX, u64::MAX, 1_700_000_000] {
            assert_eq!(remembered(Remembered::Quota, n), number(n));
            assert_eq!(remembered(Remembered::Reset, n / 2), number(n / 2));
        }
    }

    #[test]
    fn the_resource_memo_gives_each_name_its_own_value() {
        let (a, b): (Arc<str>, Arc<str>) = ("burst".into(), "daily".into());
        for name in [&a, &a, &b, &a, &b, &b] {
            assert_eq!(resource_value(name).unwrap(), name.as_ref());
        }
        // The same text in another allocation (a reload) gives the same value.
        assert_eq!(resource_value(&Arc::from("daily")).unwrap(), "daily");
        // A name that cannot be a header value gives none, and forgets nothing wrong.
        assert!(resource_value(&Arc::from("bad\nname")).is_none());
        assert_eq!(resource_value(&b).unwrap(), "daily");
    }
}
