//! `headers.problem_details = true`: a caller's 429 and a failed store's 503 as RFC 9457
//! problem details (`application/problem+json`, the problem types of
//! draft-ietf-httpapi-ratelimit-headers), the rate-limit headers as they were, the
//! default GitHub-style body when off, a reload switching it, and gRPC callers still
//! answered with `grpc-status` (`RESOURCE_EXHAUSTED`, `UNAVAILABLE`).

use crate::support::{self, get, h2_client, TestGateway, Upstream};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};

const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";
const REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// One limit, `core` (1h, 2 requests), on the route `/`, with `store` as the `[store]`
/// section and `headers` as the `[headers]` section's keys.
fn config(upstream: &Upstream, store: &str, headers: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_grace = "2s"

{store}

[headers]
{headers}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 2 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        up = upstream.url()
    )
}

/// A `[store]` section on Redis at a port nothing listens on, failing closed.
fn unreachable_store() -> String {
    format!(
        "[store]\nbackend = \"redis\"\ntimeout = \"200ms\"\non_error = \"deny\"\n\n[[store.shards]]\nprimary = \"redis://127.0.0.1:{}\"\n",
        support::redis::free_port()
    )
}

/// GET `/` until it is refused (at most `n` times); the refusal.
async fn until_refused(gw: &TestGateway, n: usize) -> support::client::Reply {
    for _ in 0..n {
        let r = get(&gw.url("/")).await;
        if r.status != 200 {
            return r;
        }
    }
    panic!("not refused within {n} requests");
}

/// A 429 in problem-details form whose numbers agree with its `X-RateLimit-*` and
/// `Retry-After` headers.
fn assert_problem_429(r: &support::client::Reply) {
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), "application/problem+json");
    let body = r.json();
    let members: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut want = [
        "type",
        "title",
        "status",
        "detail",
        "violated-policies",
        "limit",
        "remaining",
        "reset",
        "resource",
        "retry_after",
    ];
    want.sort_unstable();
    assert_eq!(members, want, "{body}");
    assert_eq!(body["type"], QUOTA_EXCEEDED);
    assert_eq!(
        body["title"],
        "Request cannot be satisfied as assigned quota has been exceeded"
    );
    assert_eq!(body["status"], 429);
    assert_eq!(body["detail"], "API rate limit exceeded for 127.0.0.1.");
    assert_eq!(body["violated-policies"], serde_json::json!(["core"]));
    assert_eq!(body["limit"], r.num("x-ratelimit-limit"));
    assert_eq!(body["remaining"], r.num("x-ratelimit-remaining"));
    assert_eq!(body["remaining"], 0);
    assert_eq!(body["reset"], r.num("x-ratelimit-reset"));
    assert_eq!(body["resource"], r.header("x-ratelimit-resource"));
    assert_eq!(body["retry_after"], r.num("retry-after"));
}

#[tokio::test]
async fn a_429_is_problem_details_when_asked_and_agrees_with_the_headers() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(
        &up,
        "",
        "style = [\"github\", \"ietf\"]\nproblem_details = true",
    ))
    .await;
    let first = until_refused(&gw, 3).await;
    assert_problem_429(&first);
    // The policy names are those of RateLimit-Policy.
    assert_eq!(first.header("ratelimit-policy"), "\"core\";q=2;w=3600");
    // Repeated refusals (which the default mode answers from a kept copy) alike.
    for _ in 0..3 {
        assert_problem_429(&get(&gw.url("/")).await);
    }
    assert_eq!(up.hits(), 2, "refused requests are not forwarded");
}

/// The default body, with exactly its members.
fn assert_default_429(r: &support::client::Reply) {
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), "application/json");
    let body = r.json();
    let members: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        members,
        [
            "limit",
            "message",
            "remaining",
            "reset",
            "resource",
            "retry_after"
        ],
        "{body}"
    );
    assert_eq!(body["message"], "API rate limit exceeded for 127.0.0.1.");
    assert_eq!(body["limit"], r.num("x-ratelimit-limit"));
    assert_eq!(body["reset"], r.num("x-ratelimit-reset"));
    assert_eq!(body["retry_after"], r.num("retry-after"));
    assert_eq!(body["resource"], "core");
}

#[tokio::test]
async fn without_problem_details_the_429_body_is_the_github_style_json() {
    let up = Upstream::start().await;
    for headers in ["", "problem_details = false"] {
        let gw = TestGateway::start(&config(&up, "", headers)).await;
        for _ in 0..4 {
            assert_default_429(&until_refused(&gw, 3).await);
        }
    }
}

#[tokio::test]
async fn a_reload_switching_problem_details_changes_the_next_429_even_a_kept_one() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up, "", "")).await;
    // Refused three times in a row: the third answered from the thread's kept copy.
    for _ in 0..3 {
        assert_default_429(&until_refused(&gw, 3).await);
    }
    gw.reload(&config(&up, "", "problem_details = true"))
        .expect("reload");
    for _ in 0..3 {
        assert_problem_429(&until_refused(&gw, 3).await);
    }
    gw.reload(&config(&up, "", "problem_details = false"))
        .expect("reload");
    for _ in 0..3 {
        assert_default_429(&until_refused(&gw, 3).await);
    }
}

#[tokio::test]
async fn a_failed_store_denying_answers_503_as_temporary_reduced_capacity() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up, &unreachable_store(), "problem_details = true")).await;
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("content-type"), "application/problem+json");
    assert!(!r.header("x-request-id").is_empty(), "{:?}", r.headers);
    assert_eq!(
        r.json(),
        serde_json::json!({
            "type": REDUCED_CAPACITY,
            "title": "Request cannot be satisfied due to temporary server capacity constraints",
            "status": 503,
            "detail": "rate limit store unavailable",
        })
    );

    // Off: the JSON of the gateway's other answers.
    let gw = TestGateway::start(&config(&up, &unreachable_store(), "")).await;
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.header("content-type"), "application/json");
    assert_eq!(
        r.json(),
        serde_json::json!({"message": "rate limit store unavailable"})
    );
    assert_eq!(up.hits(), 0);
}

/// A gRPC call (HTTP/2, `Content-Type: application/grpc`) to `/`: its status, headers.
async fn grpc_call(gw: &TestGateway) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let req = http::Request::builder()
        .method("POST")
        .uri(gw.url("/test.Echo/Unary"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = h2_client().request(req).await.expect("gRPC call");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (parts.status, parts.headers, body)
}

#[tokio::test]
async fn grpc_callers_still_get_resource_exhausted_and_unavailable() {
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config(&up, "", "problem_details = true")).await;
    let mut refused = None;
    for _ in 0..3 {
        let (status, headers, body) = grpc_call(&gw).await;
        if headers.get("grpc-status").is_some() {
            refused = Some((status, headers, body));
            break;
        }
    }
    let (status, headers, body) = refused.expect("a refused gRPC call");
    assert_eq!(status, 200);
    assert_eq!(
        headers["grpc-status"], "8",
        "RESOURCE_EXHAUSTED: {headers:?}"
    );
    assert_eq!(headers["content-type"], "application/grpc");
    assert_eq!(headers["x-ratelimit-remaining"], "0");
    assert!(headers.get("retry-after").is_some());
    assert!(body.is_empty());

    let gw = TestGateway::start(&config(&up, &unreachable_store(), "problem_details = true")).await;
    let (status, headers, body) = grpc_call(&gw).await;
    assert_eq!(status, 200);
    assert_eq!(headers["grpc-status"], "14", "UNAVAILABLE: {headers:?}");
    assert_eq!(headers["content-type"], "application/grpc");
    assert!(body.is_empty());
}
