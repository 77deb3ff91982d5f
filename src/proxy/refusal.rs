//! The 429 of a caller over a limit: the gateway's one renderer of it ([`over_limit`],
//! for the route's limits and `identity.failed_auth_limit` alike), rendered once per
//! distinct answer on each thread.
//!
//! A refused caller often retries in a tight loop, and its refusals are one answer
//! repeated: the same `Retry-After`, `X-RateLimit-*` headers and JSON body until
//! `Retry-After` ticks down a second, or the caller, its usage or the limit changes.
//! Each thread keeps the last 429 it rendered (once the same one has been asked for twice
//! in a row, so that callers refused in turn never pay for a copy), and answers an
//! identical one with copies of that header map and body (two allocations and a
//! reference count per value)
//! instead of building the map again (seven inserts, each hashing its name) and writing
//! the body again: about 2,800 fewer instructions per 429 (callgrind, BENCHMARKS.md).
//! The bytes on the wire are the same either way ([`render`] makes both; the tests
//! hold the copy to it); the request id is set afterwards ([`super::access::AccessLog::finish`], in the
//! line kept for it) and `Date` by hyper.
//!
//! Only for `headers.style = ["github"]` and `headers.problem_details = false`, the
//! defaults: the IETF style's `RateLimit` counts the seconds to the reset on the clock,
//! so with it every 429 is rendered afresh, as is one without rate-limit headers, and
//! one as problem details (which keeps the default's path as it was). The memo holds
//! only 429s of the defaults, whose bytes depend on nothing else, so a reload that
//! switches either key takes effect on the next 429.

use super::access::REQUEST_ID;
use super::error::{over_limit_body, over_limit_problem_body, PROBLEM_JSON};
use super::headers::{self, Policy, Styles};
use super::Body;
use crate::limiter::Usage;
use crate::memo::Memo;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use std::sync::Arc;

/// What a 429's bytes depend on: the limit's name, the caller's quota and units used,
/// the reset (UTC epoch seconds), `Retry-After` (seconds) and the caller as the body
/// names it.
#[derive(Debug, PartialEq, Eq)]
struct Inputs<'a> {
    resource: &'a str,
    quota: u64,
    used: u64,
    reset_s: u64,
    retry_after_s: u64,
    caller: &'a str,
}

/// The last 429 a thread rendered: what it was rendered from, and its headers and body
/// once it has been asked for twice in a row (a memo that would only be replaced costs
/// a copy of the map for nothing: callers refused in turn never repeat).
struct Last {
    resource: Arc<str>,
    quota: u64,
    used: u64,
    reset_s: u64,
    retry_after_s: u64,
    caller: Box<str>,
    rendered: Option<(HeaderMap, Bytes)>,
}

impl Last {
    fn inputs(&self) -> Inputs<'_> {
        Inputs {
            resource: &self.resource,
            quota: self.quota,
            used: self.used,
            reset_s: self.reset_s,
            retry_after_s: self.retry_after_s,
            caller: &self.caller,
        }
    }
}

thread_local! {
    /// The last 429 this thread rendered (see the module documentation).
    static LAST: Memo<Last, 1> = const { Memo::new() };
}

/// The 429 for a caller over the limit `usage` describes: `Retry-After` in whole
/// seconds (`retry_after_s`), the rate-limit headers of `styles` (`policies`: every
/// limit that applied, for the IETF style; `now_ms`: milliseconds since the Unix epoch)
/// and the JSON body naming `caller` (its client id or IP): GitHub-style, or RFC 9457
/// problem details with `styles.problem_details` (`headers.problem_details`).
pub fn over_limit<'a>(
    usage: &Usage,
    retry_after_s: u64,
    caller: &str,
    styles: Styles,
    policies: impl IntoIterator<Item = Policy<'a>>,
    now_ms: u64,
) -> Response<Body> {
    if !styles.github || styles.ietf || styles.problem_details {
        let (headers, body) = render(usage, retry_after_s, caller, styles, policies, now_ms);
        return response(headers, body);
    }
    let inputs = Inputs {
        resource: &usage.resource,
        quota: usage.quota,
        used: usage.used,
        reset_s: usage.reset_epoch_s(),
        retry_after_s,
        caller,
    };
    let (headers, body) = LAST.with(|memo| {
        memo.slot_mut(0, |last| match last {
            Some(l) if l.inputs() == inputs => match &l.rendered {
                Some((headers, body)) => (headers.clone(), body.clone()),
                None => {
                    // Asked for twice in a row: kept from now on.
                    let (headers, body) = render_github(usage, retry_after_s, caller);
                    l.rendered = Some((headers.clone(), body.clone()));
                    (headers, body)
                }
            },
            _ => {
                *last = Some(Last {
                    resource: usage.resource.clone(),
                    quota: inputs.quota,
                    used: inputs.used,
                    reset_s: inputs.reset_s,
                    retry_after_s,
                    caller: caller.into(),
                    rendered: None,
                });
                render_github(usage, retry_after_s, caller)
            }
        })
    });
    response(headers, body)
}

/// A 429 of `headers` and `body`.
fn response(headers: HeaderMap, body: Bytes) -> Response<Body> {
    let mut response = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    *response.headers_mut() = headers;
    response
}

/// [`render`] in the default style, `["github"]` (which needs no clock nor policies).
fn render_github(usage: &Usage, retry_after_s: u64, caller: &str) -> (HeaderMap, Bytes) {
    render(
        usage,
        retry_after_s,
        caller,
        Styles::default(),
        std::iter::empty(),
        0,
    )
}

/// The headers and body of a 429, in the order the gateway's other answers put them:
/// `Content-Type` (`application/json`, or `application/problem+json` with
/// `styles.problem_details`), `Retry-After`, the rate-limit headers of `styles` ([`headers::put`]),
/// then `X-Request-Id` with a placeholder value that
/// [`super::access::AccessLog::finish`] replaces (it puts the request id on every
/// response, in place where the line is there already). The line is there so that a
/// copy of a kept map, which has no room to spare, never grows: growing it reallocated
/// its lines and copied them on every repeated 429.
fn render<'a>(
    usage: &Usage,
    retry_after_s: u64,
    caller: &str,
    styles: Styles,
    policies: impl IntoIterator<Item = Policy<'a>>,
    now_ms: u64,
) -> (HeaderMap, Bytes) {
    let (body, content_type) = if styles.problem_details {
        (
            over_limit_problem_body(usage, retry_after_s, caller),
            PROBLEM_JSON,
        )
    } else {
        (
            over_limit_body(usage, retry_after_s, caller),
            "application/json",
        )
    };
    let body = Bytes::from(body);
    // Room for every rate-limit header of both styles: no growth.
    let mut headers = HeaderMap::with_capacity(12);
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(RETRY_AFTER, headers::number(retry_after_s));
    headers::put(&mut headers, styles, usage, policies, now_ms);
    headers.insert(REQUEST_ID.clone(), HeaderValue::from_static("-"));
    (headers, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(resource: &str, quota: u64, used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: resource.into(),
            quota,
            used,
            reset_at_ms,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        }
    }

    /// A 429 built by hand, as the gateway's other JSON answers are: the body, then
    /// `Retry-After`, then the rate-limit headers of `styles`.
    fn by_hand<'a>(
        usage: &Usage,
        retry_after_s: u64,
        caller: &str,
        styles: Styles,
        policies: impl IntoIterator<Item = Policy<'a>>,
        now_ms: u64,
    ) -> Response<Body> {
        let mut response = if styles.problem_details {
            let mut r = crate::response::json_bytes_response(
                StatusCode::TOO_MANY_REQUESTS,
                over_limit_problem_body(usage, retry_after_s, caller),
            );
            r.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
            r
        } else {
            crate::response::json_bytes_response(
                StatusCode::TOO_MANY_REQUESTS,
                over_limit_body(usage, retry_after_s, caller),
            )
        };
        response
            .headers_mut()
            .insert(RETRY_AFTER, headers::number(retry_after_s));
        headers::put(response.headers_mut(), styles, usage, policies, now_ms);
        response
    }

    /// What the gateway answers without the memo, in the default style.
    fn fresh(usage: &Usage, retry_after_s: u64, caller: &str) -> Response<Body> {
        by_hand(
            usage,
            retry_after_s,
            caller,
            Styles::default(),
            std::iter::empty(),
            0,
        )
    }

    /// A response as the client reads it: status, every header line in order, and the body.
    type Wire = (u16, Vec<(String, String)>, Bytes);

    /// (After `AccessLog::finish` has put the request id on it, as it does on every
    /// response.)
    async fn wire(mut response: Response<Body>) -> Wire {
        response
            .headers_mut()
            .insert(REQUEST_ID.clone(), HeaderValue::from_static("an-id"));
        let (parts, body) = response.into_parts();
        let lines = parts
            .headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
            .collect();
        let body = body.collect().await.unwrap().to_bytes();
        (parts.status.as_u16(), lines, body)
    }

    #[tokio::test]
    async fn a_repeated_429_is_the_same_bytes_as_one_rendered_afresh_and_any_change_shows() {
        let cases = [
            (usage("core", 60, 60, 1_795_802_428_000), 3598, "127.0.0.1"),
            // The same again, twice: kept the first time, answered from the memo the next.
            (usage("core", 60, 60, 1_795_802_428_000), 3598, "127.0.0.1"),
            (usage("core", 60, 60, 1_795_802_428_000), 3598, "127.0.0.1"),
            // A second later, Retry-After has ticked down.
            (usage("core", 60, 60, 1_795_802_428_000), 3597, "127.0.0.1"),
            // Another caller, units used, quota, reset and limit, each on its own.
            (usage("core", 60, 60, 1_795_802_428_000), 3597, "acme"),
            (usage("core", 60, 61, 1_795_802_428_000), 3597, "acme"),
            (usage("core", 5000, 61, 1_795_802_428_000), 3597, "acme"),
            (usage("core", 5000, 61, 1_795_802_429_000), 3597, "acme"),
            (usage("search", 5000, 61, 1_795_802_429_000), 3597, "acme"),
            // Text that the body escapes.
            (
                usage("se\"arch", 5000, 61, 1_795_802_429_000),
                1,
                "a\\c\"me\u{1}",
            ),
            (
                usage("se\"arch", 5000, 61, 1_795_802_429_000),
                1,
                "a\\c\"me\u{1}",
            ),
            (
                usage("se\"arch", 5000, 61, 1_795_802_429_000),
                1,
                "a\\c\"me\u{1}",
            ),
        ];
        // The cases that repeat the one before them, and those of them answered from
        // the memo (the third of a run).
        let repeats = [1, 2, 10, 11];
        let from_memo = [2, 11];
        let mut previous: Option<Wire> = None;
        for (i, (u, retry, caller)) in cases.iter().enumerate() {
            let got = wire(over_limit(
                u,
                *retry,
                caller,
                Styles::default(),
                std::iter::empty(),
                0,
            ))
            .await;
            let want = wire(fresh(u, *retry, caller)).await;
            assert_eq!(got, want, "{u:?} retry {retry} caller {caller}");
            assert_eq!(got.0, 429);
            let names: Vec<&str> = got.1.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(
                names,
                [
                    "content-type",
                    "retry-after",
                    "x-ratelimit-limit",
                    "x-ratelimit-remaining",
                    "x-ratelimit-used",
                    "x-ratelimit-reset",
                    "x-ratelimit-resource",
                    "x-request-id"
                ]
            );
            assert_eq!(got.1[7].1, "an-id");
            if let Some(p) = &previous {
                // Consecutive cases differ in one input, but for the repeats; the body of
                // one answered from the memo is the memo's own (the same bytes in memory
                // as the one before it, which was kept), never a copy.
                assert_eq!(p == &got, repeats.contains(&i), "case {i}");
                assert_eq!(
                    p.2.as_ptr() == got.2.as_ptr(),
                    from_memo.contains(&i),
                    "case {i}"
                );
            }
            previous = Some(got);
        }
    }

    #[tokio::test]
    async fn the_ietf_style_and_no_style_are_rendered_afresh() {
        let u = usage("core", 60, 60, 1_795_802_428_000);
        let policy = Policy {
            name: "core",
            quota: 60,
            window_ms: 3_600_000,
            unit: None,
            partition: None,
        };
        for styles in [
            Styles {
                github: true,
                ietf: true,
                problem_details: false,
                partition_key: false,
            },
            Styles {
                github: false,
                ietf: true,
                problem_details: false,
                partition_key: false,
            },
            Styles {
                github: false,
                ietf: false,
                problem_details: false,
                partition_key: false,
            },
            Styles {
                problem_details: true,
                ..Styles::default()
            },
            Styles {
                github: true,
                ietf: true,
                problem_details: true,
                partition_key: false,
            },
        ] {
            for now_ms in [1_795_798_830_000, 1_795_798_831_000] {
                let got = wire(over_limit(&u, 3598, "acme", styles, [policy], now_ms)).await;
                let want = by_hand(&u, 3598, "acme", styles, [policy], now_ms);
                assert_eq!(got, wire(want).await, "{styles:?} at {now_ms}");
            }
        }
    }

    #[test]
    fn a_429_response_carries_the_body_retry_after_and_json_type() {
        let u = usage("core", 10, 10, 2_000_000_000_500);
        for styles in [
            Styles::default(),
            Styles {
                github: false,
                ietf: true,
                problem_details: false,
                partition_key: false,
            },
        ] {
            let r = over_limit(&u, 42, "10.0.0.7", styles, std::iter::empty(), 0);
            assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(r.headers()[RETRY_AFTER], "42");
            assert_eq!(r.headers()[CONTENT_TYPE], "application/json");
        }
    }

    #[tokio::test]
    async fn a_kept_429_never_answers_for_the_other_body_after_a_switch() {
        // The same refusal, kept in the default mode, then asked for as problem details
        // (a reload switching `headers.problem_details`), then in the default mode again.
        let u = usage("core", 60, 60, 1_795_802_428_000);
        let problem = Styles {
            problem_details: true,
            ..Styles::default()
        };
        for styles in [
            Styles::default(),
            Styles::default(),
            Styles::default(),
            problem,
            problem,
            problem,
            Styles::default(),
            Styles::default(),
        ] {
            let got = wire(over_limit(&u, 5, "acme", styles, std::iter::empty(), 0)).await;
            let want = wire(by_hand(&u, 5, "acme", styles, std::iter::empty(), 0)).await;
            assert_eq!(got, want, "{styles:?}");
            let content_type = &got.1[0].1;
            assert_eq!(
                content_type,
                if styles.problem_details {
                    "application/problem+json"
                } else {
                    "application/json"
                }
            );
            let v: serde_json::Value = serde_json::from_slice(&got.2).expect("valid JSON");
            assert_eq!(v.get("violated-policies").is_some(), styles.problem_details);
            assert_eq!(v.get("message").is_some(), !styles.problem_details);
        }
    }
}
