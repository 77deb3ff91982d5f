//! `store.clock`: whose clock the limit rules read "now" from, against real
//! `redis-server` processes. With `"redis"`, `lua/apply.lua` and `lua/lease.lua` read
//! Redis's `TIME`, so a gateway whose clock is far off still reports resets in Redis's
//! time, and gateways whose clocks disagree still share one window; with `"gateway"`
//! (the default) the gateway's clock rules.

use crate::support::topology::{evalsha_calls, ReplicatedShard};
use crate::support::{
    check, get, store_report, wait_connected, RedisServer, TestGateway, Upstream,
};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const HOUR_S: u64 = 3_600;
const TEN_DAYS: Duration = Duration::from_secs(10 * 24 * HOUR_S);
/// How far a reported reset may be from the expected one: the test's own run time and
/// the rounding of `X-RateLimit-Reset` up to whole seconds.
const SLACK_S: u64 = 5;

/// The system's real time, UTC epoch seconds.
fn real_now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Assert that `actual` (epoch seconds) is within [`SLACK_S`] of `expected`.
fn assert_near(actual: u64, expected: u64, what: &str) {
    assert!(
        actual.abs_diff(expected) <= SLACK_S,
        "{what}: {actual} is {} s away from {expected}",
        actual as i64 - expected as i64
    );
}

/// `[store]` on one Redis primary (or a primary and its replicas) with `clock`.
fn store(clock: &str, prefix: &str, primary: &RedisServer, replicas: &[RedisServer]) -> String {
    let replicas: Vec<String> = replicas
        .iter()
        .map(|r| format!("\"{}\"", r.url()))
        .collect();
    format!(
        "[store]\nbackend = \"redis\"\nclock = \"{clock}\"\ntimeout = \"2s\"\non_error = \"deny\"\nkey_prefix = \"{prefix}\"\n\n[[store.shards]]\nprimary = \"{}\"\nreplicas = [{}]\n",
        primary.url(),
        replicas.join(", ")
    )
}

/// A gateway config around `store`: `core` (`/`) is a 1h fixed window of `quota`,
/// `leased` (`/lease`) the same in lease mode, `smooth` (`/gcra`) a GCRA of 10 an hour
/// (one unit every 360 s), `other` (`/other`) another 1h fixed window.
fn config(store: &str, upstream: &Upstream, quota: u64) -> String {
    format!(
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
quota = {{ anonymous = {quota} }}

[[limits]]
name = "leased"
window = "1h"
quota = {{ anonymous = 100 }}
lease = 10

[[limits]]
name = "smooth"
algorithm = "gcra"
window = "1h"
quota = {{ anonymous = 10 }}

[[limits]]
name = "other"
window = "1h"
quota = {{ anonymous = 100 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]

[[routes]]
path_prefix = "/lease"
upstream = "api"
limits = ["leased"]

[[routes]]
path_prefix = "/gcra"
upstream = "api"
limits = ["smooth"]

[[routes]]
path_prefix = "/other"
upstream = "api"
limits = ["other"]
"#,
        up = upstream.url()
    )
}

/// A gateway whose clock is `ahead` of real time.
async fn gateway(toml: &str, ahead: Duration) -> TestGateway {
    let gw = TestGateway::start(toml).await;
    gw.clock.advance(ahead);
    wait_connected(&gw).await;
    gw
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_redis_clock_resets_follow_redis_whatever_the_gateway_clock_says() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = gateway(
        &config(&store("redis", "r:", &redis, &[]), &upstream, 5),
        TEN_DAYS,
    )
    .await;
    let now = real_now_s();
    for (path, reset_in, what) in [
        ("/", HOUR_S, "fixed window (lua/apply.lua)"),
        ("/lease", HOUR_S, "lease mode (lua/lease.lua)"),
        ("/gcra", 360, "GCRA (lua/apply.lua)"),
    ] {
        let r = get(&gw.url(path)).await;
        assert_eq!(r.status, 200, "{what}");
        assert_eq!(r.num("x-ratelimit-used"), 1, "{what}");
        assert_near(r.num("x-ratelimit-reset"), now + reset_in, what);
    }
    // The key's clean-up expiry is in Redis's time too.
    let keys = redis.keys();
    let core = keys
        .iter()
        .find(|k| k.starts_with("r:core:"))
        .expect("core key");
    let pttl: i64 = redis.cmd(&["PTTL", core]);
    assert!(
        (0..=(HOUR_S as i64 + 2) * 1_000).contains(&pttl),
        "PTTL {pttl}"
    );

    // The same with the gateway's clock: resets follow the gateway, 10 days ahead.
    let gw = gateway(
        &config(&store("gateway", "g:", &redis, &[]), &upstream, 5),
        TEN_DAYS,
    )
    .await;
    let now = real_now_s() + TEN_DAYS.as_secs();
    for (path, reset_in, what) in [
        ("/", HOUR_S, "fixed window"),
        ("/lease", HOUR_S, "lease mode"),
        ("/gcra", 360, "GCRA"),
    ] {
        let r = get(&gw.url(path)).await;
        assert_eq!(r.status, 200, "{what}");
        assert_near(
            r.num("x-ratelimit-reset"),
            now + reset_in,
            &format!("{what}, gateway clock"),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_an_hour_apart_share_one_window_only_with_the_redis_clock() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    for clock in ["redis", "gateway"] {
        let toml = config(
            &store(clock, &format!("{clock}:"), &redis, &[]),
            &upstream,
            5,
        );
        let early = gateway(&toml, Duration::ZERO).await;
        let late = gateway(&toml, Duration::from_secs(HOUR_S)).await;
        let first = get(&early.url("/")).await;
        let second = get(&late.url("/")).await;
        assert_eq!(first.status, 200);
        assert_eq!(second.status, 200);
        assert_eq!(first.num("x-ratelimit-used"), 1, "{clock}");
        if clock == "redis" {
            // One clock for both: the second request counts in the first one's window.
            assert_eq!(second.num("x-ratelimit-used"), 2);
            assert_eq!(
                second.header("x-ratelimit-reset"),
                first.header("x-ratelimit-reset")
            );
            assert_near(first.num("x-ratelimit-reset"), real_now_s() + HOUR_S, clock);
        } else {
            // Each gateway its own clock: by the late one's, the window has ended.
            assert_eq!(second.num("x-ratelimit-used"), 1);
            assert_near(
                second.num("x-ratelimit-reset"),
                first.num("x-ratelimit-reset") + HOUR_S,
                clock,
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peeks_on_a_replica_read_redis_time_too() {
    let shard = ReplicatedShard::start(1);
    let upstream = Upstream::start().await;
    let toml = config(
        &store("redis", "tollgate:", &shard.primary, &shard.replicas),
        &upstream,
        1,
    );
    let gw = gateway(&toml, TEN_DAYS).await;
    let now = real_now_s();
    let first = get(&gw.url("/")).await;
    assert_eq!(first.status, 200);
    shard.wait_replicated();
    // A window this gateway has just charged is read on the primary until its
    // replica-freshness sampler (every 10 ms) sees the replica caught up with the charge
    // (docs/redis.md, "Reading your own writes from replicas"): let it.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    // The replica's read (read-only, TIME included) finds the window live by Redis's
    // time and refuses; the 429 carries that read's numbers.
    let refused = get(&gw.url("/")).await;
    assert_eq!(refused.status, 429, "{}", refused.text());
    assert_eq!(refused.num("x-ratelimit-used"), 1);
    assert_near(
        refused.num("x-ratelimit-reset"),
        now + HOUR_S,
        "replica read",
    );
    assert_eq!(
        refused.header("x-ratelimit-reset"),
        first.header("x-ratelimit-reset")
    );
    assert_eq!(
        evalsha_calls(&shard.replicas[0]),
        2,
        "both checks on the replica"
    );
    assert_eq!(
        evalsha_calls(&shard.primary),
        1,
        "one charge on the primary"
    );
    assert_eq!(store_report(&gw)[0].replica_fallbacks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_clock_on_reload_builds_a_new_store() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = gateway(
        &config(&store("gateway", "tollgate:", &redis, &[]), &upstream, 5),
        TEN_DAYS,
    )
    .await;
    let before = get(&gw.url("/other")).await;
    assert_near(
        before.num("x-ratelimit-reset"),
        real_now_s() + TEN_DAYS.as_secs() + HOUR_S,
        "gateway clock",
    );
    let old_store = gw.gateway.snapshot().limiter.store().clone();
    gw.reload(&config(
        &store("redis", "tollgate:", &redis, &[]),
        &upstream,
        5,
    ))
    .unwrap_or_else(|r| panic!("reload:\n{r}"));
    assert!(
        !std::sync::Arc::ptr_eq(&old_store, gw.gateway.snapshot().limiter.store()),
        "a changed store.clock builds a new store"
    );
    wait_connected(&gw).await;
    // A window untouched so far starts by Redis's time. (The window of `/other`, written
    // 10 days ahead, stays live by Redis's time until it ends.)
    let after = get(&gw.url("/")).await;
    assert_eq!(after.status, 200);
    assert_near(
        after.num("x-ratelimit-reset"),
        real_now_s() + HOUR_S,
        "redis clock after reload",
    );
}

#[test]
fn the_redis_clock_needs_the_redis_backend() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[store]\nbackend = \"memory\"\nclock = \"redis\"\n\n[[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9000\"]\n\n[[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\n",
    )
    .unwrap();
    let (code, _, stderr) = check(&bad);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(&format!(
            "{}:3:1: store.clock: \"redis\" needs backend = \"redis\"",
            bad.display()
        )),
        "{stderr}"
    );

    let typo = dir.path().join("typo.toml");
    std::fs::write(&typo, "[store]\nclock = \"ntp\"\n").unwrap();
    let (code, _, stderr) = check(&typo);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("store.clock"), "{stderr}");

    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "[store]\nbackend = \"redis\"\nclock = \"redis\"\n\n[[store.shards]]\nprimary = \"redis://127.0.0.1:6379\"\n\n[[upstreams]]\nname = \"api\"\ntargets = [\"http://127.0.0.1:9000\"]\n\n[[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\n",
    )
    .unwrap();
    let (code, stdout, stderr) = check(&good);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("redis store with 1 shard(s), redis clock"),
        "{stdout}"
    );
}

/// `RedisStore::apply` with `store.clock = "redis"`: one batched call over every
/// algorithm ignores the gateway's `now_ms` (10 days off), and every key of the call sees
/// the same instant, read from `TIME` during the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_call_reads_time_once_for_every_algorithm() {
    use tollgate::config::{Problems, StoreConfig};
    use tollgate::limiter::algorithm::{Algorithm, Align, Op, OpKind, Policy};
    use tollgate::limiter::key::KeyScheme;
    use tollgate::limiter::store::redis::RedisStore;
    use tollgate::limiter::store::{primaries_ready, Item, Store};

    let redis = RedisServer::start();
    let cfg: StoreConfig = toml::from_str(&format!(
        "backend = \"redis\"\nclock = \"redis\"\ntimeout = \"2s\"\n[[shards]]\nprimary = \"{}\"\n",
        redis.url()
    ))
    .unwrap();
    let store = RedisStore::from_config(&cfg, &mut Problems::default()).expect("store config");
    store.start();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !primaries_ready(&store.report()) {
        assert!(Instant::now() < deadline, "redis store never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    const W: u64 = 60_000;
    let policy = |algorithm| Policy {
        algorithm,
        quota: 60,
        window_ms: W,
        burst: 60,
        align: Align::FirstRequest,
        block_ms: 0,
    };
    let algorithms = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::Gcra,
        Algorithm::Concurrency,
    ];
    let policies: Vec<Policy> = algorithms.iter().map(|a| policy(*a)).collect();
    let scheme = KeyScheme::new("t:", None);
    let keys: Vec<_> = algorithms
        .iter()
        .map(|a| scheme.key(a.name(), "caller:1"))
        .collect();
    let items: Vec<Item<'_>> = (0..algorithms.len())
        .map(|i| Item {
            key: &keys[i],
            policy: &policies[i],
            op: Op {
                kind: OpKind::Reserve,
                cost: 1,
                id: 7 + i as u64,
            },
        })
        .collect();
    let redis_ms = || -> u64 {
        let t: Vec<u64> = redis.cmd(&["TIME"]);
        t[0] * 1_000 + t[1] / 1_000
    };
    let before = redis_ms();
    let gateway_now = before + TEN_DAYS.as_millis() as u64;
    let verdicts: Vec<_> = store
        .apply(&items, gateway_now)
        .await
        .into_iter()
        .map(|v| v.expect("redis answers"))
        .collect();
    let after = redis_ms();
    assert!(verdicts.iter().all(|v| v.admitted && v.used == 1));
    let [fixed, sliding, log, gcra, slots] = &verdicts[..] else {
        unreachable!()
    };
    // A fixed window ends `W` after the call's now.
    let now = fixed.reset_at_ms - W;
    assert!(
        (before..=after).contains(&now),
        "now {now} not in Redis's [{before}, {after}]"
    );
    assert_eq!(log.reset_at_ms, now + W, "sliding log");
    assert_eq!(slots.reset_at_ms, now + W, "concurrency");
    assert_eq!(
        gcra.reset_at_ms,
        now + W / 60,
        "GCRA: one emission interval"
    );
    assert_eq!(sliding.reset_at_ms, now / W * W + 2 * W, "sliding window");
    assert_eq!(sliding.epoch, now / W * W, "sliding window epoch");
    // The clean-up expiry is by Redis's clock too.
    let pttl: i64 = redis.cmd(&["PTTL", &keys[0].key]);
    assert!((0..=W as i64 + 1_000).contains(&pttl), "PTTL {pttl}");
}
