//! Redis-specific behaviour against real `redis-server` processes: stored windows,
//! shards, failures, scripts.

use crate::support::{
    get, get_with, sha256_hex, store_section, RedisServer, TestGateway, Upstream,
};
use std::time::{Duration, Instant};
use tollgate::clock::Clock;
use tollgate::limiter::key::{jump_consistent_hash, KeyScheme};

const KEY: &str = "acme-secret-key";

fn config(shards: &[&RedisServer], upstream: &Upstream, on_error: &str, timeout: &str) -> String {
    let mut s = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis"
timeout = "{timeout}"
on_error = "{on_error}"
key_prefix = "tollgate:"
"#
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

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 3, default = 5 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        key = sha256_hex(KEY),
        up = upstream.url()
    ));
    s
}

/// The Redis key of `core` for an anonymous caller at `ip` (as the gateway derives it).
fn key_for_ip(ip: &str) -> String {
    KeyScheme::new("tollgate:", None)
        .key("core", &format!("ip:{ip}"))
        .key
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_is_a_hash_with_count_and_stored_reset_at() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&[&redis], &upstream, "deny", "500ms")).await;

    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 200);
    let key = key_for_ip("127.0.0.1");
    assert_eq!(redis.keys(), vec![key.clone()]);
    let count: u64 = redis.cmd(&["HGET", &key, "count"]);
    let reset_at: u64 = redis.cmd(&["HGET", &key, "reset_at"]);
    assert_eq!(count, 1);
    assert_eq!(
        r.num("x-ratelimit-reset"),
        reset_at.div_ceil(1000),
        "Reset is the stored reset_at"
    );
    // Redis may clean up one second after the gateway stops trusting the window.
    let expire_at_ms: u64 = redis.cmd(&["PEXPIRETIME", &key]);
    assert_eq!(expire_at_ms, reset_at + 1000);
}

/// GitHub's replica bug: Redis still holds a window whose reset has passed (replicas
/// do not expire keys by themselves). The gateway must treat it as empty: no 429 with a
/// stale count, and the next charge starts a fresh window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_window_still_in_redis_is_treated_as_empty() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&[&redis], &upstream, "deny", "500ms")).await;
    let key = key_for_ip("127.0.0.1");
    let now = gw.clock.now_ms();
    let past = (now - 5_000).to_string();
    redis.cmd::<()>(&["HSET", &key, "count", "999", "reset_at", &past]);
    redis.cmd::<()>(&["PEXPIRE", &key, "600000"]);

    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 200, "an expired window must not reject");
    assert_eq!(r.header("x-ratelimit-used"), "1");
    assert_eq!(r.header("x-ratelimit-remaining"), "2");
    assert!(r.num("x-ratelimit-reset") * 1000 >= now + 3_600_000 - 1000);
    let count: u64 = redis.cmd(&["HGET", &key, "count"]);
    assert_eq!(count, 1);

    // And a live window written by another gateway is honoured, Reset and all.
    let future = now + 1_234_567;
    redis.cmd::<()>(&["HSET", &key, "count", "3", "reset_at", &future.to_string()]);
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-remaining"), "0");
    assert_eq!(r.header("x-ratelimit-used"), "3");
    assert_eq!(r.num("x-ratelimit-reset"), future.div_ceil(1000));
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_spread_over_two_shards_and_keys_hide_keys_and_ips() {
    let (a, b) = (RedisServer::start(), RedisServer::start());
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&[&a, &b], &upstream, "deny", "500ms")).await;

    let ips: Vec<String> = (1..=40).map(|i| format!("198.51.100.{i}")).collect();
    for ip in &ips {
        let r = get_with(&gw.url("/"), &[("x-forwarded-for", ip)]).await;
        assert_eq!(r.status, 200);
    }
    let r = get_with(&gw.url("/"), &[("authorization", &format!("Bearer {KEY}"))]).await;
    assert_eq!(r.num("x-ratelimit-limit"), 5);

    let (ka, kb) = (a.keys(), b.keys());
    assert!(
        !ka.is_empty() && !kb.is_empty(),
        "both shards hold windows: {} and {}",
        ka.len(),
        kb.len()
    );
    assert_eq!(ka.len() + kb.len(), 41);
    for k in ka.iter().chain(&kb) {
        let hash = k
            .strip_prefix("tollgate:core:{")
            .and_then(|h| h.strip_suffix('}'))
            .unwrap_or_else(|| panic!("unexpected key {k}"));
        assert!(
            hash.len() == 32 && hash.bytes().all(|c| c.is_ascii_hexdigit()),
            "{k}"
        );
        assert!(
            !k.contains("198.51") && !k.contains(KEY) && !k.contains("acme"),
            "{k}"
        );
    }
    // Each caller is on the shard the documented hash picks.
    let scheme = KeyScheme::new("tollgate:", None);
    for ip in &ips {
        let k = scheme.key("core", &format!("ip:{ip}"));
        let shard = jump_consistent_hash(k.shard_hash(), 2);
        let holder = if shard == 0 { &ka } else { &kb };
        assert!(
            holder.contains(&k.key.to_string()),
            "{ip} should be on shard {shard}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_share_every_budget() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let one = TestGateway::start(&config(&[&redis], &upstream, "deny", "500ms")).await;
    let two = TestGateway::start(&config(&[&redis], &upstream, "deny", "500ms")).await;
    assert_eq!(get(&one.url("/")).await.num("x-ratelimit-remaining"), 2);
    assert_eq!(get(&two.url("/")).await.num("x-ratelimit-remaining"), 1);
    assert_eq!(get(&one.url("/")).await.num("x-ratelimit-remaining"), 0);
    let r = get(&two.url("/")).await;
    assert_eq!(r.status, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_fail_open_forwards_within_the_timeout() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&[&redis], &upstream, "allow", "100ms")).await;
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-remaining"), 2);

    redis.kill();
    for _ in 0..5 {
        let started = Instant::now();
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 200, "on_error = allow forwards");
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            "",
            "no limit headers without a store answer"
        );
        assert!(
            started.elapsed() < Duration::from_millis(1000),
            "took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(upstream.hits(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_fail_closed_answers_503_within_the_timeout() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&[&redis], &upstream, "deny", "100ms")).await;
    assert_eq!(get(&gw.url("/")).await.status, 200);

    redis.kill();
    for _ in 0..5 {
        let started = Instant::now();
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 503, "on_error = deny");
        assert_eq!(r.header("content-type"), "application/json");
        assert!(r.json()["message"]
            .as_str()
            .unwrap()
            .contains("unavailable"));
        assert!(
            started.elapsed() < Duration::from_millis(1000),
            "took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(upstream.hits(), 1);

    // Redis comes back (empty): limiting resumes.
    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = get(&gw.url("/")).await;
        if r.status == 200 {
            assert_eq!(r.header("x-ratelimit-used"), "1");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "limiting did not resume after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A Redis that accepts connections but never answers (SIGSTOP) must not hang requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_is_cut_off_by_the_timeout() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&[&redis], &upstream, "deny", "150ms")).await;
    assert_eq!(get(&gw.url("/")).await.status, 200);
    let pid = redis.pid().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let started = Instant::now();
    let r = get(&gw.url("/")).await;
    let took = started.elapsed();
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    assert_eq!(r.status, 503);
    assert!(
        took >= Duration::from_millis(140) && took < Duration::from_millis(1000),
        "took {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_does_not_fail_a_request() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&[&redis], &upstream, "deny", "500ms")).await;
    let auth = format!("Bearer {KEY}");
    let r = get_with(&gw.url("/"), &[("authorization", &auth)]).await;
    assert_eq!(r.header("x-ratelimit-used"), "1");

    for used in 2..=4 {
        redis.cmd::<()>(&["SCRIPT", "FLUSH"]);
        let r = get_with(&gw.url("/"), &[("authorization", &auth)]).await;
        assert_eq!(
            r.status, 200,
            "NOSCRIPT must be handled by reloading the script"
        );
        assert_eq!(r.num("x-ratelimit-used"), used);
    }
    // The scripts are run by SHA (EVALSHA), and were loaded again after each flush.
    let info: String = redis.cmd(&["INFO", "commandstats"]);
    assert!(info.contains("cmdstat_evalsha"), "{info}");
    assert!(
        info.contains("cmdstat_script|load") || info.contains("cmdstat_script"),
        "{info}"
    );
}

/// Two gateways on one Redis shard, `after_response`, quota 20, 100 requests from 20
/// threads split over both: a caller's 429 afterwards (from the store or the over-limit
/// cache) reports the count Redis holds, never in-flight units as charged ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_reports_the_count_the_store_holds() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
{store}
[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 20 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        store = store_section(Some(&redis)),
        up = upstream.url()
    );
    for round in 0..8 {
        let _: String = redis.cmd(&["FLUSHALL"]);
        let a = TestGateway::start(&text).await;
        let b = TestGateway::start(&text).await;
        let urls = [a.url("/"), b.url("/")];
        let tasks: Vec<_> = (0..20)
            .map(|t| {
                let url = urls[t % 2].clone();
                tokio::spawn(async move {
                    let mut ok = 0;
                    for _ in 0..5 {
                        ok += u32::from(get(&url).await.status == 200);
                    }
                    ok
                })
            })
            .collect();
        let mut admitted = 0;
        for t in tasks {
            admitted += t.await.unwrap();
        }
        // On a loaded machine a call may time out (503 with the default `on_error`) and
        // leave the quota unspent: top it up until the store refuses, so that the
        // refusals below are the quota's.
        let mut topped_up = 0;
        loop {
            let status = get(&urls[0]).await.status;
            if status == 429 {
                break;
            }
            admitted += u32::from(status == 200);
            topped_up += 1;
            assert!(
                topped_up < 100,
                "round {round}: no 429 after the quota was spent"
            );
        }
        // Each admitted request is charged after its response: wait until every charge
        // has landed (at most 5 s), then Redis holds exactly what was admitted.
        let key = redis
            .keys()
            .into_iter()
            .find(|k| k.contains("core"))
            .expect("a window");
        let count = || redis.cmd::<String>(&["HGET", &key, "count"]);
        let deadline = Instant::now() + Duration::from_secs(5);
        while count() != admitted.to_string() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let held: String = count();
        assert_eq!(
            held,
            admitted.to_string(),
            "round {round}: Redis counts the admitted requests"
        );
        let held_n: u64 = held.parse().unwrap();
        // A refusal from the over-limit cache repeats a count the store held within the
        // last second (docs/redis.md): between the quota and today's count, never more.
        for gw in [&a, &b] {
            let r = get(&gw.url("/")).await;
            assert_eq!(r.status, 429, "round {round}");
            let used = r.num("x-ratelimit-used");
            assert!(
                (20..=held_n).contains(&used),
                "round {round}: the 429 says {used}, Redis holds {held_n}"
            );
            assert_eq!(r.header("x-ratelimit-remaining"), "0", "round {round}");
        }
        // Past the cache's bound, a refusal says exactly what Redis holds.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        for gw in [&a, &b] {
            let r = get(&gw.url("/")).await;
            assert_eq!(r.status, 429, "round {round}");
            assert_eq!(
                r.header("x-ratelimit-used"),
                held,
                "round {round}: the 429 says what Redis holds"
            );
            assert_eq!(r.header("x-ratelimit-remaining"), "0", "round {round}");
        }
    }
}
