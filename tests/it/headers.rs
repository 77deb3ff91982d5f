//! What a client sees of `[headers] style` (GitHub's `X-RateLimit-*`, the IETF draft's
//! `RateLimit-Policy` and `RateLimit`) and of `upstreams.cost_header` (the upstream says
//! what a request cost), end to end through the gateway.

use crate::support;
use crate::support::client::Reply;
use crate::support::{get, get_with, sha256_hex, TestGateway, Upstream};
use std::time::Duration;

const GITHUB: [&str; 5] = [
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-used",
    "x-ratelimit-reset",
    "x-ratelimit-resource",
];
const IETF: [&str; 2] = ["ratelimit-policy", "ratelimit"];

/// Anonymous callers get `burst` (5 a minute) and `daily` (1000 a day); `gold_only`
/// applies to gold clients only, so it never shows up for them.
fn config(upstream: &Upstream, style: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[headers]
style = {style}

[identity]
failed_auth_limit = {{ quota = 2, window = "1m" }}

[[identity.clients]]
id = "g"
key_sha256 = "{gold}"
tier = "gold"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "burst"
window = "1m"
quota = {{ anonymous = 5, gold = 50 }}

[[limits]]
name = "daily"
window = "1d"
quota = {{ anonymous = 1000, gold = 10000 }}

[[limits]]
name = "gold_only"
window = "1h"
quota = {{ gold = 7 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["burst", "daily", "gold_only"]
"#,
        up = upstream.url(),
        gold = sha256_hex("gold-key"),
    )
}

fn assert_none(r: &Reply, names: &[&str]) {
    for name in names {
        assert_eq!(
            r.header(name),
            "",
            "{name} should be absent: {:?}",
            r.headers
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_and_ietf_headers_describe_the_same_limits() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, r#"["github", "ietf"]"#)).await;

    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=5;w=60, "daily";q=1000;w=86400"#,
        "every limit that applied, with the caller's quota and the window in seconds"
    );
    assert_eq!(r.header("ratelimit"), r#""burst";r=4;t=60"#);
    assert_eq!(r.header("x-ratelimit-limit"), "5");
    assert_eq!(r.header("x-ratelimit-remaining"), "4");
    assert_eq!(r.header("x-ratelimit-used"), "1");
    assert_eq!(r.header("x-ratelimit-resource"), "burst");
    let reset = r.num("x-ratelimit-reset");

    // Ten seconds later: the same window, ten seconds closer to its end.
    gw.clock.advance(Duration::from_secs(10));
    let r = get(&gw.url("/")).await;
    assert_eq!(r.header("ratelimit"), r#""burst";r=3;t=50"#);
    assert_eq!(r.num("x-ratelimit-reset"), reset);
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=5;w=60, "daily";q=1000;w=86400"#
    );

    // A gold client: its own quotas, and gold_only applies to it too.
    let gold = [("authorization", "Bearer gold-key")];
    let r = get_with(&gw.url("/"), &gold).await;
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=50;w=60, "daily";q=10000;w=86400, "gold_only";q=7;w=3600"#
    );
    assert_eq!(r.header("ratelimit"), r#""gold_only";r=6;t=3600"#);
    assert_eq!(r.header("x-ratelimit-resource"), "gold_only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ietf_alone_replaces_the_upstreams_fields_and_adds_no_github_headers() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, r#"["ietf"]"#)).await;

    let r = get(&gw.url(
        "/set-headers?ratelimit=%22upstream%22;r=999;t=1&ratelimit-policy=%22upstream%22;q=999;w=1",
    ))
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=5;w=60, "daily";q=1000;w=86400"#
    );
    assert_eq!(r.header("ratelimit"), r#""burst";r=4;t=60"#);
    assert_eq!(r.headers.get_all("ratelimit").iter().count(), 1);
    assert_eq!(r.headers.get_all("ratelimit-policy").iter().count(), 1);
    assert_none(&r, &GITHUB);

    // GitHub's headers are not the gateway's in this style: the upstream's pass through.
    let r = get(&gw.url("/status/200")).await;
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        "999",
        "the upstream's own"
    );
    assert_eq!(r.header("ratelimit"), r#""burst";r=3;t=60"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_style_sends_no_rate_limit_headers_but_still_limits() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, "[]")).await;
    for _ in 0..5 {
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 200);
        assert_none(&r, &GITHUB);
        assert_none(&r, &IETF);
    }
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 429);
    assert_none(&r, &GITHUB);
    assert_none(&r, &IETF);
    assert!(r.num("retry-after") >= 59, "Retry-After stays");
    assert_eq!(r.json()["resource"], "burst", "the body still says why");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_carries_the_ratelimit_fields_of_the_limit_that_refused() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, r#"["github", "ietf"]"#)).await;
    for _ in 0..5 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
    }
    gw.clock.advance(Duration::from_secs(20));
    // The first refusal comes from the store's answer, the next from the over-limit cache.
    for _ in 0..2 {
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 429);
        assert_eq!(r.header("ratelimit"), r#""burst";r=0;t=40"#);
        assert_eq!(
            r.header("ratelimit-policy"),
            r#""burst";q=5;w=60, "daily";q=1000;w=86400"#
        );
        assert_eq!(r.header("x-ratelimit-remaining"), "0");
        assert_eq!(r.header("x-ratelimit-resource"), "burst");
        assert_eq!(r.header("retry-after"), "40");
    }
    assert_eq!(upstream.hits(), 5);

    // The 429 for too many unknown API keys describes the failed-auth limit.
    let bad = [("authorization", "Bearer nope")];
    for _ in 0..2 {
        assert_eq!(get_with(&gw.url("/"), &bad).await.status, 401);
    }
    let r = get_with(&gw.url("/"), &bad).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), r#""failed_auth";q=2;w=60"#);
    assert_eq!(r.header("ratelimit"), r#""failed_auth";r=0;t=60"#);
    assert_eq!(r.header("x-ratelimit-resource"), "failed_auth");
}

/// Route `/` costs 1, `/cost/` costs 2; the upstream `api` names its cost header in
/// capitals (it is matched in lowercase).
fn cost_config(upstream: &Upstream, limit: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "api"
targets = ["{up}"]
cost_header = "X-Tollgate-Cost"

[[limits]]
name = "points"
window = "1h"
quota = {{ anonymous = 20 }}
{limit}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["points"]

[[routes]]
path_prefix = "/cost/"
upstream = "api"
limits = ["points"]
cost = 2
"#,
        up = upstream.url(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_cost_header_is_charged_and_stripped() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&cost_config(&upstream, "")).await;

    let r = get(&gw.url("/cost/7")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-used"), 7, "7 charged, not the route's 2");
    assert_eq!(r.header("x-tollgate-cost"), "", "stripped");

    let r = get(&gw.url("/cost/0")).await;
    assert_eq!(r.num("x-ratelimit-used"), 7, "0: nothing charged");
    assert_eq!(r.header("x-tollgate-cost"), "");

    let r = get(&gw.url("/")).await;
    assert_eq!(r.num("x-ratelimit-used"), 8, "no header: the route's cost");

    // An uncharged status stays uncharged whatever the header says.
    let r = get(&gw.url("/set-headers?status=304&x-tollgate-cost=5")).await;
    assert_eq!(r.status, 304);
    assert_eq!(r.header("x-tollgate-cost"), "");
    assert_eq!(r.num("x-ratelimit-used"), 8);

    // The check before forwarding uses the route's cost (2 of the 12 left fit), and the
    // upstream's 15 is charged in full afterwards.
    let r = get(&gw.url("/cost/15")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-used"), 23);
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    let r = get(&gw.url("/cost/1")).await;
    assert_eq!(r.status, 429);
    assert_eq!(upstream.hits(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_cost_header_is_stripped_and_the_route_cost_charged() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&cost_config(&upstream, "")).await;
    let mut used = 0;
    for bad in ["abc", "-1", "1.5", "+3"] {
        let r = get(&gw.url(&format!("/cost/{bad}"))).await;
        assert_eq!(r.status, 200, "{bad}");
        used += 2;
        assert_eq!(r.num("x-ratelimit-used"), used, "{bad}: the route's cost");
        assert_eq!(r.header("x-tollgate-cost"), "", "{bad}: stripped");
    }
    // Two values: which one? Neither; the route's cost (1 on `/`).
    let r = get(&gw.url("/set-headers?x-tollgate-cost=1&x-tollgate-cost=2")).await;
    assert_eq!(r.num("x-ratelimit-used"), used + 1);
    assert_eq!(r.header("x-tollgate-cost"), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_limits_are_settled_to_the_upstreams_cost() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&cost_config(&upstream, "lease = 10")).await;
    // Lease-mode (like on_request) limits take the route's 2 before forwarding, and
    // are settled to the upstream's number: 3 more taken for 5.
    let r = get(&gw.url("/cost/5")).await;
    assert_eq!(r.num("x-ratelimit-used"), 5);
    assert_eq!(r.header("x-tollgate-cost"), "", "never reaches the client");
    // 1: one of the 2 goes back to the lease.
    assert_eq!(get(&gw.url("/cost/1")).await.num("x-ratelimit-used"), 6);
    // The "/" route costs 1.
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 7);
    // 0: nothing is charged, the 2 units go back to the lease.
    assert_eq!(get(&gw.url("/cost/0")).await.status, 200);
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 8);
}

/// `tollgate check` on `text`: exit code and stderr.
fn check(text: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    std::fs::write(&path, text).unwrap();
    let (code, _, stderr) = support::check(&path);
    (code, stderr)
}

#[test]
fn check_reports_bad_styles_and_cost_headers_by_key_path() {
    let base = r#"
[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9000"]
COST

[[limits]]
name = "café"
window = "1m"
quota = { anonymous = 1 }

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["café"]
"#;
    // An unknown style stops parsing, like any bad enumerated value.
    let (code, stderr) = check(&format!(
        "[headers]\nstyle = [\"github\", \"ietf2\"]\n{}",
        base.replace("COST", "")
    ));
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(
            "t.toml:2:20: headers.style[1]: unknown variant `ietf2`, expected `github` or `ietf`"
        ),
        "{stderr}"
    );

    // Everything else is reported together.
    let (code, stderr) = check(&format!(
        "[headers]\nstyle = [\"ietf\", \"github\", \"ietf\"]\n{}",
        base.replace("COST", "cost_header = \"x cost\"")
    ));
    assert_eq!(code, 1, "{stderr}");
    for expected in [
        "t.toml:2:28: headers.style[2]: \"ietf\" is listed twice",
        "upstreams[0].cost_header: \"x cost\" is not a valid header name",
        "limits[0].name: must be printable ASCII with headers.style \"ietf\"",
    ] {
        assert!(stderr.contains(expected), "{expected:?} not in:\n{stderr}");
    }
    assert_eq!(stderr.lines().count(), 3, "{stderr}");

    let (code, stderr) = check(&base.replace("COST", "cost_header = \"Connection\""));
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("upstreams[0].cost_header: \"Connection\" is a hop-by-hop header"),
        "{stderr}"
    );

    // The default style is GitHub's only, so a non-ASCII limit name is fine there.
    let (code, stderr) = check(&base.replace("COST", "cost_header = \"X-Tollgate-Cost\""));
    assert_eq!(code, 0, "{stderr}");
}

mod draft11;
mod upstream_framing;
