//! Redis Cluster faults, with real processes: one breaker per master (a dead master
//! fails open or closed only the callers whose slots it holds), a killed master's
//! promoted replica followed within the failover time, and a demoted master's calls
//! (MOVED / READONLY) sent once more, to its successor, and counted exactly once.
//!
//! The measurement of the "Cluster master killed" row of docs/redis.md:
//! `cargo test --test it cluster_failover::killed_master -- --nocapture` prints
//! `fault=cluster_master_killed failed_open=… window_ms=…`.

use crate::support;
use crate::support::cluster_replicas::{ReplicatedCluster, NODE_TIMEOUT_MS};
use crate::support::{as_ip, store_report, TestGateway, Upstream};
use std::time::{Duration, Instant};
use tollgate::limiter::key::KeyScheme;
use tollgate::limiter::store::redis::BreakerState;

/// The gateway config around a cluster: `core` (route `/`) is 1h with 3 for an
/// anonymous caller; `bulk` (route `/bulk`) is 1h with 1000.
fn config(on_error: &str, timeout: &str, cluster: &ReplicatedCluster, up: &Upstream) -> String {
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis"
mode = "cluster"
nodes = [{nodes}]
on_error = "{on_error}"
timeout = "{timeout}"
breaker_cooloff = "500ms"

[identity]
trusted_proxies = ["127.0.0.1/32"]

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 3 }}

[[limits]]
name = "bulk"
window = "1h"
quota = {{ anonymous = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]

[[routes]]
path_prefix = "/bulk"
upstream = "api"
limits = ["bulk"]
"#,
        nodes = nodes.join(", "),
        up = up.url()
    )
}

/// The Redis key of an anonymous caller's window of `limit`.
fn key_of(limit: &str, ip: &str) -> String {
    KeyScheme::new("tollgate:", None)
        .key(limit, &format!("ip:{ip}"))
        .key
        .to_string()
}

/// `count` anonymous callers (IPs) whose `limit` window lives on master `master`.
fn ips_on(cluster: &ReplicatedCluster, limit: &str, master: usize, count: usize) -> Vec<String> {
    let ips: Vec<String> = (1..=250)
        .map(|i| format!("198.51.100.{i}"))
        .filter(|ip| cluster.master_for_key(&key_of(limit, ip)) == master)
        .take(count)
        .collect();
    assert_eq!(ips.len(), count, "not enough callers on master {master}");
    ips
}

/// Wait until the gateway's slot map lists `masters` masters, every one connected.
async fn wait_masters(gw: &TestGateway, masters: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = store_report(gw);
        if r.len() == masters && r.iter().all(|s| s.primary().connected) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway never saw {masters} connected masters: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The count held for `key` on node `i` (`HGET key count`; 0 when absent).
fn count_on(cluster: &ReplicatedCluster, i: usize, key: &str) -> u64 {
    let held: Option<u64> = cluster.nodes[i].cmd(&["HGET", key, "count"]);
    held.unwrap_or(0)
}

/// Whether a response was counted in Redis (a failed-open one carries no
/// X-RateLimit-Used).
fn counted(r: &support::client::Reply) -> bool {
    !r.header("x-ratelimit-used").is_empty()
}

/// (a) Three masters, no replicas, one killed: the callers of the two others are
/// limited exactly (200, 200, 200, then 429, counted 3 in Redis), before and after the
/// cluster marks the dead master failed; the dead master's callers fail open
/// (`on_error = "allow"`), and only its breaker opens; `/readyz` names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_fails_open_only_the_callers_whose_slots_it_holds() {
    let mut cluster = ReplicatedCluster::start(3, 0);
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config("allow", "300ms", &cluster, &upstream)).await;
    wait_masters(&gw, 3).await;
    let victim = 0;
    let healthy: Vec<usize> = vec![1, 2];
    let victim_ips = ips_on(&cluster, "core", victim, 2);
    let healthy_ips: Vec<(usize, Vec<String>)> = healthy
        .iter()
        .map(|&m| (m, ips_on(&cluster, "core", m, 4)))
        .collect();
    let victim_addr = format!("127.0.0.1:{}", cluster.nodes[victim].port);

    cluster.kill(victim);
    let killed = Instant::now();

    // The dead master's callers fail open: 200 beyond the quota, no headers counted.
    for ip in &victim_ips {
        for _ in 0..5 {
            let r = as_ip(&gw, "/", ip).await;
            assert_eq!(r.status, 200, "{ip} fails open");
            assert!(!counted(&r), "{ip}: nothing counted on a dead master");
        }
    }
    // Everyone else is limited exactly, right after the kill (first two callers of
    // each master) and after the cluster has marked the master failed (the others).
    let limited_exactly = |ips: Vec<String>, m: usize| {
        let gw = &gw;
        let cluster = &cluster;
        async move {
            for ip in &ips {
                for remaining in [2, 1, 0] {
                    let r = as_ip(gw, "/", ip).await;
                    assert_eq!(
                        (r.status.as_u16(), r.num("x-ratelimit-remaining")),
                        (200, remaining),
                        "{ip} on healthy master {m}"
                    );
                }
                let r = as_ip(gw, "/", ip).await;
                assert_eq!(r.status, 429, "{ip} on healthy master {m} is limited");
                assert_eq!(count_on(cluster, m, &key_of("core", ip)), 3, "{ip}");
            }
        }
    };
    for (m, ips) in &healthy_ips {
        limited_exactly(ips[..2].to_vec(), *m).await;
    }
    let rep = store_report(&gw);
    let dead = rep
        .iter()
        .find(|s| s.primary().addr == victim_addr)
        .expect("the dead master is still in the report");
    assert!(!dead.primary().connected, "{rep:?}");
    assert_ne!(dead.primary().breaker, BreakerState::Closed, "{rep:?}");
    for s in rep.iter().filter(|s| s.primary().addr != victim_addr) {
        assert!(s.primary().connected, "{rep:?}");
        assert_eq!(s.primary().breaker, BreakerState::Closed, "{rep:?}");
        assert_eq!(s.primary().counts.errors, 0, "{rep:?}");
        assert_eq!(s.primary().role, "primary");
        assert!(!s.primary().slots.as_deref().unwrap_or("").is_empty());
    }
    let (ready, body) = tollgate::admin::readiness(&gw.gateway.snapshot());
    assert!(!ready, "one master of three is down: not ready ({body})");
    let down: Vec<&serde_json::Value> = body["shards"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["nodes"].as_array().unwrap())
        .filter(|n| n["connected"] == false)
        .collect();
    assert_eq!(down.len(), 1, "{body}");
    assert_eq!(down[0]["addr"], victim_addr.as_str(), "{body}");

    // After the cluster marks the master failed (cluster-node-timeout), the others
    // still serve their slots (cluster-require-full-coverage no).
    let failed_after = Duration::from_millis(NODE_TIMEOUT_MS * 2 + 500);
    tokio::time::sleep(failed_after.saturating_sub(killed.elapsed())).await;
    for (m, ips) in &healthy_ips {
        limited_exactly(ips[2..].to_vec(), *m).await;
    }
    for ip in &victim_ips {
        assert_eq!(
            as_ip(&gw, "/", ip).await.status,
            200,
            "{ip} still fails open"
        );
    }
}

/// The same with `on_error = "deny"`: the dead master's callers fail closed (503),
/// the others are limited exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_fails_closed_only_its_own_callers() {
    let mut cluster = ReplicatedCluster::start(3, 0);
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config("deny", "300ms", &cluster, &upstream)).await;
    wait_masters(&gw, 3).await;
    let victim_ips = ips_on(&cluster, "core", 2, 1);
    let healthy_ips = ips_on(&cluster, "core", 0, 2);
    cluster.kill(2);
    for _ in 0..4 {
        let r = as_ip(&gw, "/", &victim_ips[0]).await;
        assert_eq!(r.status, 503, "fails closed");
    }
    for ip in &healthy_ips {
        for remaining in [2, 1, 0] {
            let r = as_ip(&gw, "/", ip).await;
            assert_eq!(
                (r.status.as_u16(), r.num("x-ratelimit-remaining")),
                (200, remaining),
                "{ip}"
            );
        }
        assert_eq!(as_ip(&gw, "/", ip).await.status, 429);
        assert_eq!(count_on(&cluster, 0, &key_of("core", ip)), 3);
    }
}

/// (b) A killed master's replica is promoted; within the cluster's failover time
/// (measured: until the replica says `role:master`) plus 1 s, counting on its slots
/// resumes on the new master, carrying over what was replicated, exactly. Meanwhile a
/// caller of another master is counted all along. Prints the measurement of
/// docs/redis.md's "Cluster master killed" row: each request during the failover comes
/// from a caller of its own on the dead master's slots (a failed-open request is still
/// charged after its response when it can be, so one caller's count would mix them),
/// and `failed_open` is how many of them went through unlimited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_master_is_followed_to_its_promoted_replica() {
    let mut cluster = ReplicatedCluster::start(3, 1);
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config("allow", "300ms", &cluster, &upstream)).await;
    wait_masters(&gw, 3).await;
    let ip = "198.51.100.1".to_string();
    let key = key_of("bulk", &ip);
    let victim = cluster.master_for_key(&key);
    let successor = cluster.replicas_of(victim)[0];
    // One fresh caller per request during the failover, all on the victim's slots.
    let ranges = cluster.slots_of(victim);
    let probes: Vec<String> = (0..1500u32)
        .map(|i| format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256))
        .filter(|p| {
            let slot = cluster.slot(&key_of("bulk", p));
            ranges.iter().any(|&(a, b)| (a..=b).contains(&slot))
        })
        .collect();
    // An untouched caller of another master, for the isolation check.
    let other = (0..cluster.nodes.len())
        .find(|&m| m != victim && cluster.role(m).as_deref() == Some("master"))
        .unwrap();
    let other_ip = ips_on(&cluster, "bulk", other, 1).remove(0);

    for used in 1..=5 {
        let r = as_ip(&gw, "/bulk", &ip).await;
        assert_eq!((r.status.as_u16(), r.num("x-ratelimit-used")), (200, used));
    }
    cluster.wait_replicated(victim);

    cluster.kill(victim);
    let killed = Instant::now();
    let mut failed_open = 0u64;
    let mut promoted_at: Option<Duration> = None;
    let mut other_used = 0;
    let mut probes = probes.iter();
    let window = loop {
        let probe = probes.next().expect("ran out of probe callers");
        let r = as_ip(&gw, "/bulk", probe).await;
        assert_eq!(r.status, 200);
        if counted(&r) {
            let window = killed.elapsed();
            assert_eq!(r.num("x-ratelimit-used"), 1, "{probe}");
            break window;
        }
        failed_open += 1;
        if promoted_at.is_none() && cluster.role(successor).as_deref() == Some("master") {
            promoted_at = Some(killed.elapsed());
        }
        // The other master's caller is counted all along.
        let o = as_ip(&gw, "/bulk", &other_ip).await;
        other_used += 1;
        assert_eq!(
            (o.status.as_u16(), o.num("x-ratelimit-used")),
            (200, other_used),
            "a caller of another master is counted during the failover"
        );
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "counting never resumed on the promoted replica"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let promoted_at = promoted_at.unwrap_or(window);
    println!(
        "fault=cluster_master_killed failed_open={failed_open} window_ms={} promoted_after_ms={} node_timeout_ms={NODE_TIMEOUT_MS}",
        window.as_millis(),
        promoted_at.as_millis()
    );
    assert!(
        window <= promoted_at + Duration::from_secs(1),
        "counting resumed {window:?} after the kill, the replica was promoted after {promoted_at:?}"
    );
    // The caller charged before the kill: its 5 replicated units carried over.
    for used in 6..=9 {
        let r = as_ip(&gw, "/bulk", &ip).await;
        assert_eq!((r.status.as_u16(), r.num("x-ratelimit-used")), (200, used));
    }
    assert_eq!(
        count_on(&cluster, successor, &key),
        9,
        "exact on the new master"
    );
    let rep = store_report(&gw);
    let new_addr = format!("127.0.0.1:{}", cluster.nodes[successor].port);
    assert!(
        rep.iter()
            .any(|s| s.primary().addr == new_addr && s.primary().connected),
        "{rep:?}"
    );
}

/// (c) A master demoted by `CLUSTER FAILOVER` on its replica while a caller keeps
/// charging: every call that reaches the demoted node (Redis 7 answers it `MOVED`; a
/// `READONLY` would be handled alike) is sent once more to the new master, so every
/// request is counted, each exactly once: the X-RateLimit-Used values run 1, 2, 3, …
/// with no gap, the new master holds the same total, and the demoted node refused at
/// least one call (the redirect path was taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_has_every_charge_land_once_on_its_successor() {
    let cluster = ReplicatedCluster::start(3, 1);
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config("allow", "1s", &cluster, &upstream)).await;
    wait_masters(&gw, 3).await;
    let ip = "198.51.100.7".to_string();
    let key = key_of("bulk", &ip);
    let old = cluster.master_for_key(&key);
    let successor = cluster.replicas_of(old)[0];
    let redirected_before = rejected_evalsha(&cluster, old);

    let mut used = 0;
    let mut charge = |r: support::client::Reply| {
        used += 1;
        assert_eq!(
            r.status,
            200,
            "request {used}: {:?} {}",
            r.headers,
            r.text()
        );
        assert!(counted(&r), "request {used} was not counted (failed open)");
        assert_eq!(r.num("x-ratelimit-used"), used, "counted once each");
    };
    for _ in 0..3 {
        charge(as_ip(&gw, "/bulk", &ip).await);
    }
    cluster.wait_replicated(old);
    cluster.nodes[successor].cmd::<()>(&["CLUSTER", "FAILOVER"]);
    let started = Instant::now();
    // Keep charging through the switch and for a while after it, one request every
    // 20 ms: at most 500 in the 10 s allowed, inside `bulk`'s quota of 1,000 however
    // long the failover takes (unpaced, a 4 s failover spent the quota and the
    // 1,001st request was rightly refused).
    while cluster.role(successor).as_deref() != Some("master")
        || started.elapsed() < Duration::from_millis(300)
    {
        charge(as_ip(&gw, "/bulk", &ip).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the manual failover did not complete"
        );
    }
    for _ in 0..3 {
        charge(as_ip(&gw, "/bulk", &ip).await);
    }
    let total = used;
    assert_eq!(
        count_on(&cluster, successor, &key),
        total,
        "exact on the new master"
    );
    assert_eq!(cluster.role(old).as_deref(), Some("slave"));
    assert!(
        rejected_evalsha(&cluster, old) > redirected_before,
        "no call reached the demoted master: the redirect path was not exercised"
    );
}

/// EVALSHA calls node `i` refused or failed (MOVED, READONLY): `rejected_calls` plus
/// `failed_calls` of `INFO commandstats`.
fn rejected_evalsha(cluster: &ReplicatedCluster, i: usize) -> u64 {
    let stats: String = cluster.nodes[i].cmd(&["INFO", "commandstats"]);
    let line = stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .unwrap_or("");
    ["rejected_calls=", "failed_calls="]
        .iter()
        .filter_map(|f| {
            line.split(',')
                .find_map(|kv| kv.split(':').next_back()?.strip_prefix(f))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

/// A master that answers reads but refuses writes (`min-replicas-to-write 1` and no
/// replica: every write `NOREPLICAS`): its callers' first charge fails, and from then on
/// their checks fail too, so with `on_error = "deny"` they get 503 rather than uncounted
/// 200s (the master still says master, so each `ROLE` probe, every second, lets about
/// one check through to find out); callers on the other masters are counted exactly
/// throughout; once the master takes writes again, its callers are counted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_refuses_writes_fails_only_its_callers_closed() {
    let cluster = ReplicatedCluster::start(3, 0);
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config("deny", "300ms", &cluster, &upstream)).await;
    wait_masters(&gw, 3).await;
    let sick = 0;
    let sick_ip = ips_on(&cluster, "core", sick, 1).remove(0);
    let healthy_ips = ips_on(&cluster, "core", 1, 2);

    let _: () = cluster.nodes[sick].cmd(&["CONFIG", "SET", "min-replicas-to-write", "1"]);
    let started = Instant::now();
    let mut statuses = Vec::new();
    while started.elapsed() < Duration::from_millis(2500) {
        statuses.push(as_ip(&gw, "/", &sick_ip).await.status.as_u16());
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 503),
        "{statuses:?}"
    );
    assert!(
        admitted <= 4,
        "at most about one uncounted request a second: {admitted} of {}",
        statuses.len()
    );
    assert_eq!(count_on(&cluster, sick, &key_of("core", &sick_ip)), 0);
    let sick_report = store_report(&gw)
        .into_iter()
        .find(|s| s.primary().addr == format!("127.0.0.1:{}", cluster.nodes[sick].port))
        .expect("the sick master is in the report");
    assert!(!sick_report.writable, "{sick_report:?}");
    // Callers on another master are counted exactly meanwhile.
    for ip in &healthy_ips {
        for remaining in [2, 1, 0] {
            let r = as_ip(&gw, "/", ip).await;
            assert_eq!(
                (r.status.as_u16(), r.num("x-ratelimit-remaining")),
                (200, remaining),
                "{ip}"
            );
        }
        assert_eq!(as_ip(&gw, "/", ip).await.status, 429, "{ip}");
        assert_eq!(count_on(&cluster, 1, &key_of("core", ip)), 3, "{ip}");
    }

    let _: () = cluster.nodes[sick].cmd(&["CONFIG", "SET", "min-replicas-to-write", "0"]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while count_on(&cluster, sick, &key_of("core", &sick_ip)) < 3 {
        assert!(Instant::now() < deadline, "counting did not resume");
        as_ip(&gw, "/", &sick_ip).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(as_ip(&gw, "/", &sick_ip).await.status, 429);
    assert_eq!(count_on(&cluster, sick, &key_of("core", &sick_ip)), 3);
}
