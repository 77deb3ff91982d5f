//! The contract's rate-limit behaviour, end to end over TCP, on both stores: the memory
//! store and real `redis-server` processes.

use crate::support::{
    get, get_with, sha256_hex, store_section, store_toml, Backend, RedisServer, TestGateway,
    Upstream,
};
use std::time::Duration;

const KEY: &str = "acme-secret-key";

/// A gateway in front of a real upstream on `backend`, with:
/// - `core`: 1h, anonymous 3, default 5 (route `/`)
/// - `tight`: 10s, 2 for everyone (route `/two` has core and tight)
/// - `fast`: 1s, 2 for everyone (route `/fast`)
struct Setup {
    gw: TestGateway,
    upstream: Upstream,
    _redis: Option<RedisServer>,
}

fn config(
    backend: Backend,
    redis: Option<&RedisServer>,
    upstream: &Upstream,
    trusted: &str,
) -> String {
    let shards: Vec<&RedisServer> = redis.into_iter().collect();
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_grace = "2s"

{store}

[identity]
trusted_proxies = [{trusted}]
failed_auth_limit = {{ quota = 3, window = "1m" }}

[[identity.clients]]
id = "acme"
key_sha256 = "{key}"
tier = "default"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 3, default = 5 }}

[[limits]]
name = "tight"
window = "10s"
quota = {{ anonymous = 2, default = 2 }}

[[limits]]
name = "fast"
window = "1s"
quota = {{ anonymous = 2, default = 2 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]

[[routes]]
path_prefix = "/two"
upstream = "api"
limits = ["core", "tight"]

[[routes]]
path_prefix = "/fast"
upstream = "api"
limits = ["fast"]
"#,
        store = store_toml(backend, &shards, "deny", "500ms"),
        key = sha256_hex(KEY),
        up = upstream.url(),
    )
}

async fn setup_with(backend: Backend, trusted: &str) -> Setup {
    let upstream = Upstream::start().await;
    let redis = (backend == Backend::Redis).then(RedisServer::start);
    let gw = TestGateway::start(&config(backend, redis.as_ref(), &upstream, trusted)).await;
    Setup {
        gw,
        upstream,
        _redis: redis,
    }
}

async fn setup(backend: Backend) -> Setup {
    setup_with(backend, "\"127.0.0.1/32\"").await
}

macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::$name(super::Backend::Memory).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                super::$name(super::Backend::Redis).await
            }
        }
    )*};
}

on_both_stores!(
    anonymous_and_keyed_callers_have_their_own_budgets,
    unknown_key_is_401_and_not_forwarded,
    over_the_limit_is_429_with_headers_and_body_and_is_not_charged,
    reset_is_the_same_on_every_response_of_a_window,
    a_moved_clock_starts_a_new_window,
    a_real_one_second_window_resets,
    not_modified_is_not_charged,
    forwarded_for_is_believed_only_from_trusted_proxies,
    several_limits_report_the_most_constrained,
    guessing_keys_is_limited_per_client_ip,
);

async fn anonymous_and_keyed_callers_have_their_own_budgets(backend: Backend) {
    let s = setup(backend).await;
    let auth = format!("Bearer {KEY}");

    let anon = get(&s.gw.url("/")).await;
    assert_eq!(anon.status, 200);
    assert_eq!(anon.header("x-ratelimit-limit"), "3");
    assert_eq!(anon.header("x-ratelimit-remaining"), "2");
    assert_eq!(anon.header("x-ratelimit-used"), "1");
    assert_eq!(anon.header("x-ratelimit-resource"), "core");

    for expected_remaining in [4, 3] {
        let keyed = get_with(&s.gw.url("/"), &[("authorization", &auth)]).await;
        assert_eq!(keyed.status, 200);
        assert_eq!(keyed.header("x-ratelimit-limit"), "5");
        assert_eq!(keyed.num("x-ratelimit-remaining"), expected_remaining);
    }
    // `token KEY` is the same caller.
    let token = get_with(
        &s.gw.url("/"),
        &[("authorization", &format!("token {KEY}"))],
    )
    .await;
    assert_eq!(token.num("x-ratelimit-remaining"), 2);

    // The anonymous budget was not touched by the keyed requests.
    let anon = get(&s.gw.url("/")).await;
    assert_eq!(anon.num("x-ratelimit-remaining"), 1);
    assert_eq!(s.upstream.hits(), 5);
}

async fn unknown_key_is_401_and_not_forwarded(backend: Backend) {
    let s = setup(backend).await;
    let r = get_with(&s.gw.url("/"), &[("authorization", "Bearer not-a-key")]).await;
    assert_eq!(r.status, 401);
    assert_eq!(r.header("content-type"), "application/json");
    assert_eq!(r.json()["message"], "Bad credentials");
    assert_eq!(s.upstream.hits(), 0);
}

async fn guessing_keys_is_limited_per_client_ip(backend: Backend) {
    let s = setup(backend).await;
    let guess = |ip: &'static str, key: &'static str| {
        let url = s.gw.url("/");
        async move { get_with(&url, &[("authorization", key), ("x-forwarded-for", ip)]).await }
    };
    for _ in 0..3 {
        assert_eq!(guess("203.0.113.9", "Bearer wrong").await.status, 401);
    }
    let r = guess("203.0.113.9", "Bearer wrong").await;
    assert_eq!(r.status, 429, "past identity.failed_auth_limit");
    assert_eq!(r.header("x-ratelimit-resource"), "failed_auth");
    assert_eq!(r.num("x-ratelimit-limit"), 3);
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    assert!(
        (1..=60).contains(&r.num("retry-after")),
        "{}",
        r.header("retry-after")
    );
    // Another IP still gets its own 401s and its right key; from the first IP, until the
    // window resets, even the right key gets 429 without being looked up, so
    // a 429 tells a guesser nothing.
    assert_eq!(guess("203.0.113.10", "Bearer wrong").await.status, 401);
    let r = guess("203.0.113.9", "Bearer acme-secret-key").await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-resource"), "failed_auth");
    assert_eq!(
        guess("203.0.113.10", "Bearer acme-secret-key").await.status,
        200
    );
    assert_eq!(s.upstream.hits(), 1);
    if let Some(redis) = &s._redis {
        assert!(
            redis
                .keys()
                .iter()
                .any(|k| k.starts_with("tollgate:failed_auth:{")),
            "counted in the same store as the limits: {:?}",
            redis.keys()
        );
    }
}

async fn over_the_limit_is_429_with_headers_and_body_and_is_not_charged(backend: Backend) {
    let s = setup(backend).await;
    let mut reset = 0;
    for remaining in [2, 1, 0] {
        let r = get(&s.gw.url("/")).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.num("x-ratelimit-remaining"), remaining);
        reset = r.num("x-ratelimit-reset");
    }
    for _ in 0..2 {
        let r = get(&s.gw.url("/")).await;
        assert_eq!(r.status, 429);
        assert_eq!(r.header("content-type"), "application/json");
        assert_eq!(r.header("x-ratelimit-limit"), "3");
        assert_eq!(r.header("x-ratelimit-remaining"), "0");
        assert_eq!(
            r.header("x-ratelimit-used"),
            "3",
            "a rejected request is not charged"
        );
        assert_eq!(r.header("x-ratelimit-resource"), "core");
        assert_eq!(r.num("x-ratelimit-reset"), reset);
        let retry_after = r.num("retry-after");
        assert!(
            (3590..=3600).contains(&retry_after),
            "Retry-After {retry_after}"
        );
        let body = r.json();
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("rate limit exceeded for 127.0.0.1"),
            "{body}"
        );
        assert_eq!(body["limit"], 3);
        assert_eq!(body["reset"], reset);
    }
    assert_eq!(s.upstream.hits(), 3, "rejected requests are not forwarded");
}

async fn reset_is_the_same_on_every_response_of_a_window(backend: Backend) {
    let s = setup(backend).await;
    let auth = format!("Bearer {KEY}");
    let mut resets = Vec::new();
    // Spread over more than a second so that second boundaries fall between calls.
    for _ in 0..7 {
        let r = get_with(&s.gw.url("/"), &[("authorization", &auth)]).await;
        resets.push(r.num("x-ratelimit-reset"));
        tokio::time::sleep(Duration::from_millis(230)).await;
    }
    assert!(
        resets.windows(2).all(|w| w[0] == w[1]),
        "Reset wobbled: {resets:?}"
    );
}

async fn a_moved_clock_starts_a_new_window(backend: Backend) {
    let s = setup(backend).await;
    for _ in 0..3 {
        assert_eq!(get(&s.gw.url("/")).await.status, 200);
    }
    let rejected = get(&s.gw.url("/")).await;
    assert_eq!(rejected.status, 429);
    let old_reset = rejected.num("x-ratelimit-reset");

    s.gw.clock.advance(Duration::from_secs(3601));
    let r = get(&s.gw.url("/")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-remaining"), 2);
    assert_eq!(r.num("x-ratelimit-used"), 1);
    assert!(
        r.num("x-ratelimit-reset") >= old_reset + 3600,
        "new window ends an hour later"
    );
}

async fn a_real_one_second_window_resets(backend: Backend) {
    let s = setup(backend).await;
    assert_eq!(get(&s.gw.url("/fast")).await.status, 200);
    assert_eq!(get(&s.gw.url("/fast")).await.status, 200);
    let r = get(&s.gw.url("/fast")).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), "1");
    assert_eq!(r.header("x-ratelimit-resource"), "fast");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = get(&s.gw.url("/fast")).await;
    assert_eq!(r.status, 200, "a new window after the real reset");
    assert_eq!(r.num("x-ratelimit-used"), 1);
}

async fn not_modified_is_not_charged(backend: Backend) {
    let s = setup(backend).await;
    for _ in 0..5 {
        let r = get(&s.gw.url("/status/304")).await;
        assert_eq!(r.status, 304);
        assert_eq!(r.header("x-ratelimit-used"), "0");
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            "3",
            "the gateway's header replaces the upstream's"
        );
    }
    let r = get(&s.gw.url("/status/200")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-used"), "1");
    let r = get(&s.gw.url("/status/304")).await;
    assert_eq!(r.header("x-ratelimit-used"), "1");
    assert_eq!(r.header("x-ratelimit-remaining"), "2");
}

async fn forwarded_for_is_believed_only_from_trusted_proxies(backend: Backend) {
    // The test client connects from 127.0.0.1, which is trusted here.
    let s = setup(backend).await;
    for _ in 0..3 {
        let r = get_with(&s.gw.url("/echo"), &[("x-forwarded-for", "203.0.113.5")]).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            r.json()["headers"]["x-forwarded-for"],
            "203.0.113.5, 127.0.0.1"
        );
    }
    let r = get_with(&s.gw.url("/"), &[("x-forwarded-for", "203.0.113.5")]).await;
    assert_eq!(r.status, 429);
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("203.0.113.5"));
    // Another client behind the same proxy has its own budget.
    let r = get_with(&s.gw.url("/"), &[("x-forwarded-for", "203.0.113.6")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-remaining"), 2);

    // Not trusted: X-Forwarded-For is ignored, everyone from 127.0.0.1 shares one budget.
    let s = setup_with(backend, "").await;
    for (i, xff) in ["203.0.113.5", "203.0.113.6", "198.51.100.1"]
        .iter()
        .enumerate()
    {
        let r = get_with(&s.gw.url("/"), &[("x-forwarded-for", xff)]).await;
        assert_eq!(r.num("x-ratelimit-remaining"), 2 - i as u64);
    }
    let r = get_with(&s.gw.url("/"), &[("x-forwarded-for", "192.0.2.77")]).await;
    assert_eq!(r.status, 429);
    assert!(r.json()["message"].as_str().unwrap().contains("127.0.0.1"));
}

async fn several_limits_report_the_most_constrained(backend: Backend) {
    let s = setup(backend).await;
    let r = get(&s.gw.url("/two")).await;
    assert_eq!(r.status, 200);
    // core: 3 - 1 = 2 left; tight: 2 - 1 = 1 left.
    assert_eq!(r.header("x-ratelimit-resource"), "tight");
    assert_eq!(r.header("x-ratelimit-remaining"), "1");
    let r = get(&s.gw.url("/two")).await;
    assert_eq!(r.header("x-ratelimit-resource"), "tight");
    assert_eq!(r.header("x-ratelimit-remaining"), "0");
    // tight rejects although core still has room; the 429 names tight.
    let r = get(&s.gw.url("/two")).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-resource"), "tight");
    assert_eq!(r.header("x-ratelimit-limit"), "2");
    assert!(r.num("retry-after") <= 10);
    // core was charged twice, not three times.
    let r = get(&s.gw.url("/")).await;
    assert_eq!(r.header("x-ratelimit-resource"), "core");
    assert_eq!(r.header("x-ratelimit-used"), "3");
}

/// On a `charge = "on_request"` route, a response with an uncharged status (304) is
/// refunded, and its own rate-limit headers already show the state after the refund (the
/// same remaining and used counts as the request before it, the same reset), on both
/// stores, in both header styles, for a fixed window and for GCRA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncharged_status_on_an_on_request_route_shows_the_state_after_its_refund() {
    for redis in [None, Some(RedisServer::start())] {
        for algorithm in ["fixed_window", "gcra"] {
            let upstream = Upstream::start().await;
            let text = format!(
                r#"
[server]
listen = "127.0.0.1:0"
{store}
[headers]
style = ["github", "ietf"]

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
algorithm = "{algorithm}"
window = "1h"
quota = {{ anonymous = 3 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
charge = "on_request"
"#,
                store = store_section(redis.as_ref()),
                up = upstream.url()
            );
            let gw = TestGateway::start(&text).await;
            let what = format!("redis {}, {algorithm}", redis.is_some());
            let ok = get(&gw.url("/")).await;
            assert_eq!(ok.status, 200, "{what}");
            assert_eq!(ok.header("x-ratelimit-remaining"), "2", "{what}");
            assert_eq!(ok.header("x-ratelimit-used"), "1", "{what}");
            assert!(
                ok.header("ratelimit").contains(";r=2"),
                "{what}: {}",
                ok.header("ratelimit")
            );
            let not_modified = get(&gw.url("/status/304")).await;
            assert_eq!(not_modified.status, 304, "{what}");
            assert_eq!(not_modified.header("x-ratelimit-remaining"), "2", "{what}");
            assert_eq!(not_modified.header("x-ratelimit-used"), "1", "{what}");
            assert!(
                not_modified.header("ratelimit").contains(";r=2"),
                "{what}: {}",
                not_modified.header("ratelimit")
            );
            if algorithm == "fixed_window" {
                assert_eq!(
                    not_modified.header("x-ratelimit-reset"),
                    ok.header("x-ratelimit-reset"),
                    "{what}: the same window"
                );
            }
            // And the store agrees: two more are admitted, then 429.
            for left in [1, 0] {
                let r = get(&gw.url("/")).await;
                assert_eq!(r.status, 200, "{what}");
                assert_eq!(
                    r.header("x-ratelimit-remaining"),
                    left.to_string(),
                    "{what}"
                );
            }
            assert_eq!(get(&gw.url("/")).await.status, 429, "{what}");
        }
    }
}
