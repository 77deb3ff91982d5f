//! Production-shaped Redis topologies, started for real: shards with replicas
//! (`--replicaof`), Sentinel, Redis Cluster. Checks that reads go to replicas and writes
//! to primaries, that failures stay inside their shard, that failovers are followed, and
//! that the over-limit cache spares Redis.

use crate::support;
use crate::support::topology::{cmd_calls, evalsha_calls, Cluster, ReplicatedShard, Sentinels};
use crate::support::{
    as_ip, get, get_with, sha256_hex, store_report, wait_connected, RedisServer, TestGateway,
    Upstream,
};
use std::time::{Duration, Instant};
use tollgate::limiter::key::{jump_consistent_hash, KeyScheme};
use tollgate::limiter::store::redis::BreakerState;

const KEY: &str = "acme-secret-key";

/// The gateway config around a `[store]` section: `core` is 1h with anonymous 3 and
/// default 5; `bulk` (route `/bulk`) is 1h with 1000 for everyone.
fn config(store: &str, upstream: &Upstream) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

{store}

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

[[limits]]
name = "bulk"
window = "1h"
quota = {{ anonymous = 1000, default = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]

[[routes]]
path_prefix = "/bulk"
upstream = "api"
limits = ["bulk"]
"#,
        key = sha256_hex(KEY),
        up = upstream.url()
    )
}

fn store_header(on_error: &str, timeout: &str, extra: &str) -> String {
    format!("[store]\nbackend = \"redis\"\non_error = \"{on_error}\"\ntimeout = \"{timeout}\"\nbreaker_cooloff = \"500ms\"\n{extra}\n")
}

fn shard_with_replicas(shard: &ReplicatedShard) -> String {
    let replicas: Vec<String> = shard
        .replicas
        .iter()
        .map(|r| format!("\"{}\"", r.url()))
        .collect();
    format!(
        "[[store.shards]]\nprimary = \"{}\"\nreplicas = [{}]\n",
        shard.primary.url(),
        replicas.join(", ")
    )
}

fn plain_shard(r: &RedisServer) -> String {
    format!("[[store.shards]]\nprimary = \"{}\"\n", r.url())
}

/// An anonymous caller (by X-Forwarded-For from the trusted test client) on `shard` of `n`.
fn ips_on_shard(shard: u32, n: u32, count: usize) -> Vec<String> {
    let scheme = KeyScheme::new("tollgate:", None);
    (1..=250)
        .map(|i| format!("198.51.100.{i}"))
        .filter(|ip| {
            jump_consistent_hash(scheme.key("core", &format!("ip:{ip}")).shard_hash(), n) == shard
        })
        .take(count)
        .collect()
}

/// Wait until every replica has every write of its primary, and for the gateway to
/// notice (its replica-freshness sampler asks every 10 ms): the windows it charged are
/// read on replicas again.
async fn caught_up(shards: &[ReplicatedShard]) {
    for s in shards {
        s.wait_replicated();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_are_served_by_replicas_and_charges_by_primaries() {
    let shards: Vec<ReplicatedShard> = (0..3).map(|_| ReplicatedShard::start(1)).collect();
    let upstream = Upstream::start().await;
    let mut store = store_header("deny", "500ms", "");
    for s in &shards {
        store.push_str(&shard_with_replicas(s));
    }
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    wait_connected(&gw).await;

    let mut per_shard = [0u64; 3];
    for _ in 0..2 {
        for shard in 0..3u32 {
            for ip in ips_on_shard(shard, 3, 3) {
                assert_eq!(as_ip(&gw, "/", &ip).await.status, 200);
                per_shard[shard as usize] += 1;
            }
        }
        // A window this gateway has just charged is read on the primary until the
        // replica has caught up with the charge (docs/redis.md, "Reading your own
        // writes from replicas"): let it.
        caught_up(&shards).await;
    }
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(
            evalsha_calls(&s.replicas[0]),
            per_shard[i],
            "shard {i}: one check per request on the replica"
        );
        assert_eq!(
            evalsha_calls(&s.primary),
            per_shard[i],
            "shard {i}: one charge per request on the primary"
        );
    }
    assert!(store_report(&gw).iter().all(|s| s.replica_fallbacks == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replica_falls_back_to_the_primary_with_exact_answers() {
    let mut shard = ReplicatedShard::start(1);
    let upstream = Upstream::start().await;
    let store = store_header("deny", "300ms", "") + &shard_with_replicas(&shard);
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-remaining"), 2);
    // The next check would read the window on the primary anyway until the replica has
    // caught up with this charge: let it, so that the check is meant for the replica.
    caught_up(std::slice::from_ref(&shard)).await;

    shard.replicas[0].kill();
    let started = Instant::now();
    for remaining in [1, 0] {
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.num("x-ratelimit-remaining"), remaining);
    }
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("x-ratelimit-used"), "3");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "fallback took {:?}",
        started.elapsed()
    );
    assert!(store_report(&gw)[0].replica_fallbacks >= 1);
}

/// GitHub's bugs, on a replica that has lost its primary: it keeps serving an old window.
/// Headers must stay consistent: never a 429 with a full Remaining, never a Reset in the
/// past. At worst a request the primary would reject is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_its_primary_never_makes_headers_disagree() {
    let shard = ReplicatedShard::start(1);
    let upstream = Upstream::start().await;
    let store = store_header("deny", "500ms", "") + &shard_with_replicas(&shard);
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    for _ in 0..3 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
    }
    shard.wait_replicated();
    assert_eq!(
        get(&gw.url("/")).await.status,
        429,
        "the replica has the full window"
    );

    // Cut the link: the replica keeps (and serves) its copy of the window.
    let dead = support::redis::free_port().to_string();
    shard.replicas[0].cmd::<()>(&["REPLICAOF", "127.0.0.1", &dead]);
    // An hour later the stale window is past its reset: treated as empty, not a 429.
    gw.clock.advance(Duration::from_secs(3601));
    let now_s = || (tollgate::clock::Clock::now_ms(&*gw.clock) / 1000) as u64;
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let r = get(&gw.url("/")).await;
        assert!(r.num("x-ratelimit-reset") >= now_s(), "Reset in the past");
        if r.status == 429 {
            assert_eq!(r.header("x-ratelimit-remaining"), "0");
        }
        statuses.push((r.status.as_u16(), r.num("x-ratelimit-remaining")));
    }
    // The first check reads the stale replica (whose old window has ended: empty);
    // the window it then charged is read on the primary from then on, since the
    // cut-off replica never catches up with that charge (docs/redis.md, "Reading your
    // own writes from replicas"): exact answers, the primary's counts in the headers.
    assert_eq!(
        statuses,
        vec![(200, 2), (200, 1), (200, 0), (429, 0), (429, 0)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_primary_affects_only_its_own_shard() {
    let mut primaries: Vec<RedisServer> = (0..3).map(|_| RedisServer::start()).collect();
    let upstream = Upstream::start().await;
    let mut store = store_header("deny", "500ms", "breaker_failures = 3");
    for p in &primaries {
        store.push_str(&plain_shard(p));
    }
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    let victim = ips_on_shard(0, 3, 1).remove(0);
    let others: Vec<String> = [ips_on_shard(1, 3, 1), ips_on_shard(2, 3, 1)].concat();
    assert_eq!(as_ip(&gw, "/", &victim).await.status, 200);

    primaries[0].kill();
    for _ in 0..6 {
        let started = Instant::now();
        let r = as_ip(&gw, "/", &victim).await;
        assert_eq!(
            r.status, 503,
            "on_error = deny for the dead shard's callers"
        );
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "took {:?}",
            started.elapsed()
        );
    }
    // The other shards keep exact limits, fast.
    for ip in &others {
        for remaining in [2, 1, 0] {
            let started = Instant::now();
            let r = as_ip(&gw, "/", ip).await;
            assert_eq!(
                (r.status.as_u16(), r.num("x-ratelimit-remaining")),
                (200, remaining)
            );
            assert!(
                // Well under the dead shard's 500 ms timeout.
                started.elapsed() < Duration::from_millis(300),
                "other shard slowed: {:?}",
                started.elapsed()
            );
        }
        assert_eq!(as_ip(&gw, "/", ip).await.status, 429);
    }
    assert_eq!(store_report(&gw)[0].primary().breaker, BreakerState::Open);

    // The shard comes back (empty): limiting resumes for its callers.
    primaries[0].restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = as_ip(&gw, "/", &victim).await;
        if r.status == 200 {
            assert_eq!(r.header("x-ratelimit-used"), "1");
            break;
        }
        assert!(Instant::now() < deadline, "shard did not come back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(store_report(&gw)[0].primary().breaker, BreakerState::Closed);
}

/// A frozen primary (SIGSTOP): calls time out until the breaker opens, then fail fast;
/// after it thaws, a probe closes the breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_on_timeouts_fails_fast_and_closes_after_recovery() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = store_header("deny", "400ms", "breaker_failures = 2") + &plain_shard(&redis);
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    assert_eq!(get(&gw.url("/")).await.status, 200);
    let pid = redis.pid().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());

    let mut took = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        assert_eq!(get(&gw.url("/")).await.status, 503);
        took.push(started.elapsed());
    }
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    assert!(
        took[0] >= Duration::from_millis(390) && took[1] >= Duration::from_millis(390),
        "{took:?}"
    );
    assert!(
        took[2..].iter().all(|t| *t < Duration::from_millis(150)),
        "breaker open: fail fast {took:?}"
    );
    let r = store_report(&gw);
    assert_eq!(r[0].primary().breaker, BreakerState::Open);
    assert!(r[0].primary().counts.timeouts >= 2 && r[0].primary().counts.rejected_by_breaker >= 3);

    // Thawed: after the cool-off one probe goes through and closes the breaker.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 200);
    assert_eq!(store_report(&gw)[0].primary().breaker, BreakerState::Closed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_and_a_redis_restart_mid_traffic_fail_no_request() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = store_header("allow", "300ms", "") + &plain_shard(&redis);
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    let auth = format!("Bearer {KEY}");
    let mut last_used = 0;
    for i in 0..120 {
        if i == 30 {
            redis.cmd::<()>(&["SCRIPT", "FLUSH"]);
        }
        if i == 60 {
            redis.restart();
        }
        let r = get_with(&gw.url("/bulk"), &[("authorization", &auth)]).await;
        assert_eq!(r.status, 200, "request {i} failed");
        if !r.header("x-ratelimit-used").is_empty() {
            last_used = r.num("x-ratelimit-used");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Limiting resumed after the restart (the restarted Redis kept nothing).
    assert!(last_used > 0 && last_used < 120, "used {last_used}");
    assert!(cmd_calls(&redis, "evalsha") > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_over_limit_cache_spares_redis_until_reset() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = store_header("deny", "500ms", "") + &plain_shard(&redis);
    let toml = config(&store, &upstream);
    let gw = TestGateway::start(&toml).await;
    for _ in 0..3 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
    }
    let first = get(&gw.url("/")).await;
    assert_eq!(first.status, 429);
    let calls = evalsha_calls(&redis);
    for _ in 0..20 {
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 429);
        for h in [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-used",
            "x-ratelimit-reset",
            "x-ratelimit-resource",
        ] {
            assert_eq!(r.header(h), first.header(h), "{h}");
        }
    }
    assert_eq!(
        evalsha_calls(&redis),
        calls,
        "no Redis call for a caller known to be over the limit"
    );
    assert_eq!(gw.gateway.snapshot().limiter.cache().hits(), 20);

    // A reload that changes the limit drops the cached rejection.
    gw.reload(&toml.replace("anonymous = 3, default = 5", "anonymous = 10, default = 5"))
        .unwrap();
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-used"), "4");

    // Over again; past the reset the cache lets Redis answer again.
    for _ in 0..6 {
        get(&gw.url("/")).await;
    }
    assert_eq!(get(&gw.url("/")).await.status, 429);
    gw.clock.advance(Duration::from_secs(3601));
    let before = evalsha_calls(&redis);
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-ratelimit-used"), "1");
    assert_eq!(
        evalsha_calls(&redis),
        before + 2,
        "check and charge went to Redis"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_moves_charges_to_the_new_primary_and_counts_carry_over() {
    let mut topo = Sentinels::start("mymaster", 1, 1);
    let upstream = Upstream::start().await;
    let nodes: Vec<String> = topo
        .sentinels
        .iter()
        .map(|s| format!("\"{}\"", s.url()))
        .collect();
    let store = store_header("allow", "300ms", "")
        + &format!(
            "[[store.shards]]\nsentinel = {{ master = \"mymaster\", nodes = [{}] }}\n",
            nodes.join(", ")
        );
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    let auth = format!("Bearer {KEY}");
    for used in 1..=2 {
        let r = get_with(&gw.url("/"), &[("authorization", &auth)]).await;
        assert_eq!(r.num("x-ratelimit-used"), used);
    }
    topo.shard.wait_replicated();
    let old = topo.shard.primary.port;
    topo.shard.primary.kill();
    let new = topo.wait_failover(old, Duration::from_secs(20));
    assert_ne!(new, old);

    // Charges continue on the new primary; the count carried over through replication.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = get_with(&gw.url("/"), &[("authorization", &auth)]).await;
        assert_eq!(r.status, 200);
        if !r.header("x-ratelimit-used").is_empty() {
            assert_eq!(r.num("x-ratelimit-used"), 3, "the count carried over");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "charging did not resume on the new primary"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(store_report(&gw)[0]
        .primary()
        .addr
        .ends_with(&format!(":{new}")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_end_to_end() {
    let cluster = Cluster::start(3);
    let upstream = Upstream::start().await;
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let store = store_header(
        "deny",
        "1s",
        &format!("mode = \"cluster\"\nnodes = [{}]", nodes.join(", ")),
    );
    let gw = TestGateway::start(&config(&store, &upstream)).await;

    for i in 1..=30 {
        let ip = format!("203.0.113.{i}");
        for remaining in [2, 1, 0] {
            let r = as_ip(&gw, "/", &ip).await;
            assert_eq!(
                (r.status.as_u16(), r.num("x-ratelimit-remaining")),
                (200, remaining),
                "{ip}"
            );
        }
        let r = as_ip(&gw, "/", &ip).await;
        assert_eq!(r.status, 429);
    }
    let keys = cluster.all_keys();
    assert_eq!(keys.len(), 30);
    let holders: std::collections::HashSet<u16> =
        keys.iter().map(|k| cluster.node_for_key(k).port).collect();
    assert!(
        holders.len() >= 2,
        "keys spread over the cluster: {holders:?}"
    );
    assert!(keys
        .iter()
        .all(|k| k.starts_with("tollgate:core:{") && k.ends_with('}')));
}

/// A replica that refuses reads while cut off (`replica-serve-stale-data no` answers
/// MASTERDOWN) is skipped: the primary answers, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_answering_masterdown_is_skipped() {
    let shard = ReplicatedShard::start(1);
    let upstream = Upstream::start().await;
    let store = store_header("deny", "300ms", "") + &shard_with_replicas(&shard);
    let gw = TestGateway::start(&config(&store, &upstream)).await;
    wait_connected(&gw).await;
    let replica = &shard.replicas[0];
    replica.cmd::<()>(&["CONFIG", "SET", "replica-serve-stale-data", "no"]);
    let dead = support::redis::free_port().to_string();
    replica.cmd::<()>(&["REPLICAOF", "127.0.0.1", &dead]);
    let mut c = replica.conn().unwrap();
    let err = redis::cmd("GET")
        .arg("x")
        .query::<Option<String>>(&mut c)
        .unwrap_err();
    assert_eq!(err.code(), Some("MASTERDOWN"), "{err}");

    for remaining in [2, 1, 0] {
        let r = get(&gw.url("/")).await;
        assert_eq!(
            (r.status.as_u16(), r.num("x-ratelimit-remaining")),
            (200, remaining)
        );
    }
    assert_eq!(get(&gw.url("/")).await.status, 429);
    // The first check was meant for the replica; the window it then charged is read on
    // the primary directly (the replica never catches up with that charge).
    assert!(store_report(&gw)[0].replica_fallbacks >= 1);
}
