//! Redis round trips per request, against real `redis-server` processes: the limits of
//! a request on one shard travel in one script call, concurrent requests share calls,
//! lease mode takes units in bulk, and two gateways on the same shards never admit
//! more than the quota in lease mode (the accuracy harness).

use crate::support::topology::evalsha_calls;
use crate::support::{get_with, sha256_hex, RedisServer, TestGateway, Upstream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

const KEY: &str = "acme-secret-key";

/// A Redis-backed gateway config: `limits_toml` holds the `[[limits]]` entries and
/// `route_limits` the route's `limits = [...]` list.
fn config(
    shards: &[&RedisServer],
    upstream: &Upstream,
    limits_toml: &str,
    route_limits: &str,
) -> String {
    let mut s = String::from(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"2s\"\n\n[store]\nbackend = \"redis\"\ntimeout = \"500ms\"\non_error = \"deny\"\n",
    );
    for r in shards {
        s.push_str(&format!("\n[[store.shards]]\nprimary = \"{}\"\n", r.url()));
    }
    s.push_str(&format!(
        r#"
[identity]
trusted_proxies = ["127.0.0.1/32"]

[[identity.clients]]
id = "acme"
key_sha256 = "{key}"

[[upstreams]]
name = "api"
targets = ["{up}"]

{limits_toml}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = [{route_limits}]
uncharged_statuses = [304]
"#,
        key = sha256_hex(KEY),
        up = upstream.url()
    ));
    s
}

fn auth() -> [(&'static str, &'static str); 1] {
    [("authorization", "Bearer acme-secret-key")]
}

/// The hash fields `count` of every window key on `redis`, summed.
fn total_count(redis: &RedisServer) -> u64 {
    redis
        .keys()
        .iter()
        .map(|k| redis.cmd::<Option<u64>>(&["HGET", k, "count"]).unwrap_or(0))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_of_a_request_on_one_shard_share_one_call() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let limits = r#"
[[limits]]
name = "hour"
window = "1h"
quota = { default = 1000 }

[[limits]]
name = "minute"
window = "1m"
quota = { default = 100 }

[[limits]]
name = "second"
window = "1s"
quota = { default = 50 }
"#;
    let gw = TestGateway::start(&config(
        &[&redis],
        &upstream,
        limits,
        "\"hour\", \"minute\", \"second\"",
    ))
    .await;
    let before = evalsha_calls(&redis);
    for i in 1..=10u64 {
        let r = get_with(&gw.url("/"), &auth()).await;
        assert_eq!(r.status, 200);
        // The most constrained of the three limits is reported.
        assert_eq!(r.header("x-ratelimit-resource"), "second");
        assert_eq!(r.num("x-ratelimit-used"), i);
    }
    let calls = evalsha_calls(&redis) - before;
    println!("3 limits x 10 requests: {calls} script calls");
    assert_eq!(
        calls, 20,
        "one CHECK and one CHARGE call per request, not one per limit"
    );
    let keys = redis.keys();
    assert_eq!(keys.len(), 3, "three windows: {keys:?}");
    for k in &keys {
        assert_eq!(redis.cmd::<u64>(&["HGET", k, "count"]), 10, "{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_script_calls() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let limits = "[[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { anonymous = 1000000 }\n";
    let gw = Arc::new(TestGateway::start(&config(&[&redis], &upstream, limits, "\"core\"")).await);
    let before = evalsha_calls(&redis);
    let n = 400;
    let mut tasks = Vec::new();
    for i in 0..n {
        let gw = gw.clone();
        // Many callers (one per client IP, believed from the trusted proxy on loopback).
        let ip = format!("10.0.{}.{}", i / 200, i % 200 + 1);
        tasks.push(tokio::spawn(async move {
            get_with(&gw.url("/"), &[("x-forwarded-for", ip.as_str())])
                .await
                .status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let calls = evalsha_calls(&redis) - before;
    println!(
        "{n} concurrent requests: {calls} script calls ({:.2} per request)",
        calls as f64 / n as f64
    );
    assert_eq!(total_count(&redis), n, "every request charged exactly once");
    assert!(
        calls < 2 * n,
        "concurrent CHECKs and CHARGEs must be batched: {calls} calls for {n} requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_takes_units_in_bulk_and_stops_at_the_quota() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let limits =
        "[[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { default = 50 }\nlease = 10\n";
    let gw = TestGateway::start(&config(&[&redis], &upstream, limits, "\"core\"")).await;
    let before = evalsha_calls(&redis);
    for i in 1..=50u64 {
        let r = get_with(&gw.url("/"), &auth()).await;
        assert_eq!(r.status, 200, "request {i}");
        assert_eq!(r.num("x-ratelimit-limit"), 50);
        assert_eq!(r.num("x-ratelimit-used"), i, "request {i}");
        assert_eq!(r.num("x-ratelimit-remaining"), 50 - i);
    }
    let calls = evalsha_calls(&redis) - before;
    assert_eq!(calls, 5, "50 requests, leases of 10: five lease calls");
    let r = get_with(&gw.url("/"), &auth()).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    assert!(r.num("retry-after") > 3500, "the window lasts an hour");
    // The rejection is remembered: further 429s cost no call.
    let calls_at_quota = evalsha_calls(&redis);
    for _ in 0..5 {
        assert_eq!(get_with(&gw.url("/"), &auth()).await.status, 429);
    }
    assert_eq!(evalsha_calls(&redis), calls_at_quota);
    assert_eq!(upstream.hits(), 50);
    assert_eq!(total_count(&redis), 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_uncharged_lease_units_go_back() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let limits =
        "[[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { default = 100 }\nlease = 20\n";
    let gw = TestGateway::start(&config(&[&redis], &upstream, limits, "\"core\"")).await;
    for _ in 0..3 {
        assert_eq!(get_with(&gw.url("/"), &auth()).await.status, 200);
    }
    // An uncharged status (304) gives its unit back to the lease.
    let r = get_with(&gw.url("/status/304"), &auth()).await;
    assert_eq!(r.status, 304);
    let r = get_with(&gw.url("/"), &auth()).await;
    assert_eq!(r.num("x-ratelimit-used"), 4, "the 304 was not counted");
    assert_eq!(total_count(&redis), 20, "one lease of 20 is held");
    // Idle for more than a second: the 16 unused units go back to the shared window.
    gw.clock.advance(Duration::from_millis(1_500));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while total_count(&redis) != 4 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(total_count(&redis), 4, "unused leased units returned");
}

/// Two gateways on the same two shards, one caller, 200 concurrent requests split over
/// both, quota 50: how many does each mode admit? Lease mode never exceeds the quota;
/// `store.reserve_in_flight` admits it exactly; after_response overshoots by at most
/// one request per gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accuracy_two_gateways_one_caller_200_concurrent_requests() {
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let upstream = Upstream::start().await;
    let quota = 50;
    let mut report = Vec::new();
    for (mode, lease) in [
        ("after_response", ""),
        ("reserve_in_flight", ""),
        ("lease = 10", "lease = 10\n"),
    ] {
        for r in [&a, &b] {
            r.cmd::<()>(&["FLUSHALL"]);
        }
        let limits = format!("[[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = {{ default = {quota} }}\n{lease}");
        let mut toml = config(&[&a, &b], &upstream, &limits, "\"core\"");
        if mode == "reserve_in_flight" {
            toml = toml.replace(
                "on_error = \"deny\"\n",
                "on_error = \"deny\"\nreserve_in_flight = true\n",
            );
        }
        let g1 = Arc::new(TestGateway::start(&toml).await);
        let g2 = Arc::new(TestGateway::start(&toml).await);
        let admitted = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..200 {
            let gw = if i % 2 == 0 { g1.clone() } else { g2.clone() };
            let admitted = admitted.clone();
            tasks.push(tokio::spawn(async move {
                let r = get_with(&gw.url("/"), &auth()).await;
                assert!(r.status == 200 || r.status == 429, "status {}", r.status);
                if r.status == 200 {
                    admitted.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let admitted = admitted.load(Ordering::Relaxed);
        let counted = total_count(&a) + total_count(&b);
        report.push(format!(
            "{mode:>15}: admitted {admitted:>3} of 200 (quota {quota}), Redis count {counted}"
        ));
        if !lease.is_empty() {
            assert!(
                admitted <= quota as usize,
                "lease mode admitted {admitted} > quota {quota}"
            );
            assert!(
                admitted >= quota as usize - 20,
                "lease mode admitted only {admitted} (Redis count {counted})"
            );
            assert!(counted <= quota);
        } else if mode == "reserve_in_flight" {
            // Every check reserves on the primary: the fleet admits the quota exactly.
            assert_eq!(
                admitted, quota as usize,
                "reserve_in_flight admitted {admitted}"
            );
            assert_eq!(counted, quota, "every admitted request charged once");
        } else {
            // Each gateway has at most one request of the caller in flight that the
            // other cannot see: the overshoot is at most one request
            // per gateway.
            assert!(
                (quota as usize..=quota as usize + 2).contains(&admitted),
                "after_response admitted {admitted} (quota {quota}, 2 gateways)"
            );
            assert_eq!(
                counted, admitted as u64,
                "every admitted request charged once"
            );
        }
        for g in [g1, g2] {
            let g = Arc::try_unwrap(g).ok().expect("no other handle");
            g.gateway.shutdown();
            g.gateway.wait().await;
        }
        if !lease.is_empty() {
            // Shutdown returned the units the gateways held but did not use.
            let counted = total_count(&a) + total_count(&b);
            assert_eq!(counted, admitted as u64, "leases returned at shutdown");
        }
    }
    println!(
        "two gateways, one caller, 200 concurrent requests:\n{}",
        report.join("\n")
    );
}

/// `store.reserve_in_flight`: a request's units are reserved on the primary at the check
/// (so they show in Redis while it is in flight, and in its own headers) and refunded
/// when its response is not charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_in_flight_holds_units_in_redis_and_refunds_uncharged_responses() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let limits = "[[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { default = 5 }\n";
    let toml = config(&[&redis], &upstream, limits, "\"core\"").replace(
        "on_error = \"deny\"\n",
        "on_error = \"deny\"\nreserve_in_flight = true\n",
    );
    let gw = Arc::new(TestGateway::start(&toml).await);

    // While a slow request is in flight, its unit is already in Redis.
    let slow = {
        let gw = gw.clone();
        tokio::spawn(async move { get_with(&gw.url("/slow/600"), &auth()).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(total_count(&redis), 1, "reserved at the check");
    let r = slow.await.unwrap();
    assert_eq!((r.status.as_u16(), r.num("x-ratelimit-used")), (200, 1));

    // 304 is uncharged: reserved, then refunded.
    for _ in 0..3 {
        let r = get_with(&gw.url("/status/304"), &auth()).await;
        assert_eq!(r.status.as_u16(), 304);
    }
    // Refunds are sent in the background.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while total_count(&redis) != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "304s not refunded: count {}",
            total_count(&redis)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = get_with(&gw.url("/"), &auth()).await;
    assert_eq!(r.num("x-ratelimit-used"), 2, "304s were refunded");
    assert_eq!(total_count(&redis), 2);
}

/// `config` with `store.check_from_charge` set to `bound`.
fn with_check_from_charge(toml: String, bound: &str) -> String {
    toml.replace(
        "on_error = \"deny\"\n",
        &format!("on_error = \"deny\"\ncheck_from_charge = \"{bound}\"\n"),
    )
}

/// `store.check_from_charge`: a caller's CHECK is answered from the gateway's own last
/// CHARGE reply while it is younger than the bound (one script call per request instead
/// of two), never past the bound, and never refuses: the 429 comes from a store read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_from_charge_answers_a_callers_checks_from_its_last_charge() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let limits = "[[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { default = 5 }\n";
    let toml = with_check_from_charge(config(&[&redis], &upstream, limits, "\"core\""), "10s");
    let gw = TestGateway::start(&toml).await;
    let before = evalsha_calls(&redis);
    let calls = || evalsha_calls(&redis) - before;
    let mut seen = Vec::new();
    for (i, advance) in [(1, false), (2, false), (3, false), (4, true), (5, false)] {
        if advance {
            // Past the bound: the next CHECK reads the store again.
            gw.clock.advance(Duration::from_secs(11));
        }
        let r = get_with(&gw.url("/"), &auth()).await;
        assert_eq!(r.status, 200, "request {i}");
        assert_eq!(r.num("x-ratelimit-used"), i, "request {i}");
        assert_eq!(r.num("x-ratelimit-remaining"), 5 - i, "request {i}");
        seen.push(calls());
    }
    // 1: peek + charge; 2, 3: charge only; 4 (past the bound): peek + charge; 5: charge.
    assert_eq!(seen, [2, 3, 4, 6, 7], "script calls after each request");
    // The view leaves no room: the store is read, and the refusal shows what it holds.
    let r = get_with(&gw.url("/"), &auth()).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.num("x-ratelimit-used"), 5);
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    assert_eq!(calls(), 8, "the refusal came from one store read");
    assert_eq!(
        total_count(&redis),
        5,
        "every admitted request charged once"
    );
    assert_eq!(gw.gateway.snapshot().limiter.recent().hits(), 3);
}

/// The staleness `store.check_from_charge` documents: charges by another gateway within
/// the bound are not seen by this one's view (it admits one more), and are once the
/// bound has passed; a gateway without the option never overshoots that way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_from_charge_sees_other_gateways_charges_after_its_bound() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let limits = "[[limits]]\nname = \"core\"\nwindow = \"1h\"\nquota = { default = 3 }\n";
    let plain = config(&[&redis], &upstream, limits, "\"core\"");
    let g1 = TestGateway::start(&with_check_from_charge(plain.clone(), "10s")).await;
    let g2 = TestGateway::start(&plain).await;
    assert_eq!(get_with(&g1.url("/"), &auth()).await.status, 200);
    for used in [2, 3] {
        let r = get_with(&g2.url("/"), &auth()).await;
        assert_eq!((r.status.as_u16(), r.num("x-ratelimit-used")), (200, used));
    }
    // g2, reading the store, refuses.
    assert_eq!(get_with(&g2.url("/"), &auth()).await.status, 429);
    // g1's view is younger than its bound and still says 1 of 3 used: it admits, and the
    // charge's answer shows the overshoot.
    let r = get_with(&g1.url("/"), &auth()).await;
    assert_eq!((r.status.as_u16(), r.num("x-ratelimit-used")), (200, 4));
    assert_eq!(total_count(&redis), 4);
    // Past the bound, g1 reads the store like g2.
    g1.clock.advance(Duration::from_secs(11));
    let r = get_with(&g1.url("/"), &auth()).await;
    assert_eq!(
        (r.status.as_u16(), r.num("x-ratelimit-remaining")),
        (429, 0)
    );
    assert_eq!(total_count(&redis), 4);
}
