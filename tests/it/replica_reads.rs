//! Replica reads that read this gateway's own writes: a shard whose replica lags behind
//! its primary (the replication stream held by a TCP forwarder, `support::lag`) still
//! admits exactly the quota to a burst of one caller on one gateway, and at most one
//! request per gateway more across a fleet (docs/redis.md, "Reading your own writes
//! from replicas").

use crate::support::lag::LaggingShard;
use crate::support::topology::evalsha_calls;
use crate::support::{get_with, wait_connected, TestGateway, Upstream};
use std::time::Duration;
use tollgate::limiter::key::KeyScheme;

/// How long the forwarder holds the replication stream.
const LAG: Duration = Duration::from_millis(60);

/// A gateway on one shard (`primary`, with `replica` for reads; `read_from` left to its
/// default, "replica"): limit `core`, 1 h fixed window, `quota` per anonymous caller
/// (by client IP, from X-Forwarded-For).
fn config(primary: &str, replica: &str, upstream: &Upstream, quota: u64) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis"
on_error = "deny"
timeout = "1s"

[[store.shards]]
primary = "{primary}"
replicas = ["{replica}"]

[identity]
trusted_proxies = ["127.0.0.1/32"]

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = {quota} }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        up = upstream.url()
    )
}

/// The window key of the anonymous caller `ip` in limit `core`.
fn window_of(ip: &str) -> String {
    KeyScheme::new("tollgate:", None)
        .key("core", &format!("ip:{ip}"))
        .key
        .to_string()
}

/// The count the primary holds for `ip`'s window (0 when there is none).
fn stored(shard: &LaggingShard, ip: &str) -> u64 {
    shard
        .primary
        .cmd::<Option<u64>>(&["HGET", &window_of(ip), "count"])
        .unwrap_or(0)
}

/// `n` concurrent requests of caller `ip`, spread round robin over `gateways`: the number
/// answered 200 (every other answer must be 429).
async fn burst(gateways: &[&TestGateway], ip: &str, n: usize) -> u64 {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let url = gateways[i % gateways.len()].url("/");
            let ip = ip.to_string();
            tokio::spawn(async move { get_with(&url, &[("x-forwarded-for", &ip)]).await.status })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let status = t.await.unwrap();
        assert!(status == 200 || status == 429, "unexpected status {status}");
        ok += u64::from(status == 200);
    }
    ok
}

/// One gateway, a replica 60 ms behind its primary: per repetition a fresh caller
/// with a quota of 20 sends 4 requests one after another (each read back right after
/// its own charge), then a burst of 32 concurrent requests. Exactly 16 of the burst
/// are admitted and the primary holds exactly 20, every repetition; and the replica
/// did answer checks (the first of each caller's), so replica reads were on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_replica_never_lets_one_gateway_overshoot() {
    let shard = LaggingShard::start(LAG);
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(
        &shard.primary.url(),
        &shard.replica.url(),
        &upstream,
        20,
    ))
    .await;
    wait_connected(&gw).await;
    let replica_calls_before = evalsha_calls(&shard.replica);
    let reps = 50;
    for rep in 0..reps {
        let ip = format!("198.51.100.{}", rep + 1);
        for n in 1..=4u64 {
            let r = get_with(&gw.url("/"), &[("x-forwarded-for", &ip)]).await;
            assert_eq!(r.status, 200, "repetition {rep}, request {n}");
            assert_eq!(
                r.num("x-ratelimit-used"),
                n,
                "repetition {rep}, request {n}"
            );
        }
        let admitted = burst(&[&gw], &ip, 32).await;
        assert_eq!(admitted, 16, "repetition {rep}: 16 units were left");
        assert_eq!(stored(&shard, &ip), 20, "repetition {rep}: Redis count");
    }
    let (p, r) = shard.offsets();
    eprintln!("offsets after the last burst: primary {p}, replica {r}");
    let replica_calls = evalsha_calls(&shard.replica) - replica_calls_before;
    assert!(
        replica_calls >= reps,
        "the replica answered {replica_calls} checks: replica reads were not exercised"
    );
}

/// Four gateways on the same lagging shard: per repetition a fresh caller with a quota
/// of 20 sends 4 requests one after another through each gateway in turn, then a burst
/// of 32 concurrent requests spread over the gateways. Of the burst, 16 units were left:
/// at most one request per gateway more is admitted, and the primary counts exactly the
/// requests admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_on_a_lagging_replica_overshoots_by_at_most_one_request_per_gateway() {
    let shard = LaggingShard::start(LAG);
    let upstream = Upstream::start().await;
    let toml = config(&shard.primary.url(), &shard.replica.url(), &upstream, 20);
    let mut gws = Vec::new();
    for _ in 0..4 {
        let gw = TestGateway::start(&toml).await;
        wait_connected(&gw).await;
        gws.push(gw);
    }
    let fleet: Vec<&TestGateway> = gws.iter().collect();
    let mut worst = 0;
    for rep in 0..20 {
        let ip = format!("203.0.113.{}", rep + 1);
        for (n, gw) in fleet.iter().enumerate() {
            let r = get_with(&gw.url("/"), &[("x-forwarded-for", &ip)]).await;
            assert_eq!(r.status, 200, "repetition {rep}, request {n}");
        }
        let admitted = burst(&fleet, &ip, 32).await;
        worst = worst.max(admitted);
        assert!(
            (16..=16 + fleet.len() as u64).contains(&admitted),
            "repetition {rep}: admitted {admitted} of the 16 units left, on {} gateways",
            fleet.len()
        );
        assert_eq!(
            stored(&shard, &ip),
            4 + admitted,
            "repetition {rep}: Redis count"
        );
    }
    eprintln!("most admitted by a burst: {worst} of 16 units left");
}
