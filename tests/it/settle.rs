//! Settling a reservation to the upstream's cost (issue 48, item 4): a route with
//! `charge = "on_request"` reserves its `cost` before forwarding; when the upstream
//! reports the real cost (`upstreams.cost_header`), the reservation is settled to it:
//! the difference refunded when it is less, the excess charged (past the quota) when it
//! is more. A missing header keeps the reservation, an uncharged status refunds it all.
//! Every algorithm that counts cost, on the memory store and on a real `redis-server`,
//! and lease mode, which takes its units before forwarding too.

use crate::support::{
    self, capture_logs, get, log_lines, store_toml, Backend, RedisServer, TestGateway, Upstream,
};
use std::time::Duration;

/// A gateway on `store` whose route `/` reserves 10 units (`charge = "on_request"`) of
/// the limit `tokens` (`algorithm`, 30 units an hour for anonymous callers, `extra`),
/// the upstream reporting the real cost in `x-tollgate-cost` (`/cost/N`).
async fn start(
    store: &str,
    algorithm: &str,
    extra: &str,
    route_extra: &str,
) -> (Upstream, TestGateway) {
    let upstream = Upstream::start().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

{store}

[[upstreams]]
name = "api"
targets = ["{up}"]
cost_header = "x-tollgate-cost"

[[limits]]
name = "tokens"
algorithm = "{algorithm}"
window = "1h"
quota = {{ anonymous = 30 }}
{extra}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["tokens"]
cost = 10
{route_extra}
"#,
        up = upstream.url()
    );
    let gw = TestGateway::start(&toml).await;
    (upstream, gw)
}

/// The units the one window in `redis` counts, as the algorithm stores them (`None`
/// for GCRA, which stores a time).
fn stored(redis: &RedisServer, algorithm: &str) -> Option<u64> {
    let keys = redis.keys();
    assert!(keys.len() <= 1, "one window: {keys:?}");
    let Some(k) = keys.first() else {
        return Some(0);
    };
    match algorithm {
        "fixed_window" => Some(redis.cmd::<Option<u64>>(&["HGET", k, "count"]).unwrap_or(0)),
        "sliding_window" => Some(redis.cmd::<Option<u64>>(&["HGET", k, "cur"]).unwrap_or(0)),
        "sliding_log" => {
            let members: Vec<String> = redis.cmd(&["ZRANGE", k, "0", "-1"]);
            Some(
                members
                    .iter()
                    .map(|m| m.rsplit(':').next().unwrap().parse::<u64>().unwrap())
                    .sum(),
            )
        }
        _ => None,
    }
}

/// The scenario on `gw`: reserve 10, the upstream reports 3 (7 refunded); no header (10
/// kept); an uncharged status (all refunded); reserve 10, the upstream reports 25 (15
/// more charged, past the quota); the next request refused. With `redis`, the stored
/// count follows.
async fn reserve_ten_settle_each_way(
    gw: &TestGateway,
    what: &str,
    algorithm: &str,
    redis: Option<&RedisServer>,
) {
    let settles_at = async |used: u64| {
        if let Some(redis) = redis {
            support::wait_until(
                Duration::from_secs(5),
                &format!("{what}: {used} stored in Redis"),
                || stored(redis, algorithm).is_none_or(|n| n == used),
            )
            .await;
        }
    };

    let r = get(&gw.url("/cost/3")).await;
    assert_eq!(r.status, 200, "{what}");
    assert_eq!(r.header("x-tollgate-cost"), "", "{what}: stripped");
    assert_eq!(
        r.num("x-ratelimit-used"),
        3,
        "{what}: 10 reserved, 7 refunded"
    );
    assert_eq!(r.num("x-ratelimit-remaining"), 27, "{what}");
    settles_at(3).await;

    let r = get(&gw.url("/plain")).await;
    assert_eq!(r.status, 200, "{what}");
    assert_eq!(r.num("x-ratelimit-used"), 13, "{what}: no header, 10 kept");
    assert_eq!(r.num("x-ratelimit-remaining"), 17, "{what}");
    settles_at(13).await;

    let r = get(&gw.url("/set-headers?status=304&x-tollgate-cost=5")).await;
    assert_eq!(r.status, 304, "{what}");
    assert_eq!(
        r.num("x-ratelimit-used"),
        13,
        "{what}: uncharged, all refunded"
    );
    settles_at(13).await;

    // 10 fit (13 + 10 <= 30); the upstream's 25 is settled in full past the quota.
    let r = get(&gw.url("/cost/25")).await;
    assert_eq!(r.status, 200, "{what}");
    assert_eq!(r.num("x-ratelimit-used"), 38, "{what}: 15 more charged");
    assert_eq!(r.num("x-ratelimit-remaining"), 0, "{what}");
    settles_at(38).await;

    let r = get(&gw.url("/cost/1")).await;
    assert_eq!(r.status, 429, "{what}: over the quota");
    assert_eq!(r.num("x-ratelimit-remaining"), 0, "{what}");
    settles_at(38).await;
}

/// The settled cost in the access log: what the upstream reported, or the route's.
fn assert_logged_costs(what: &str) {
    let costs: Vec<String> = log_lines(&["tollgate::access", "decision=\"allowed\""])
        .iter()
        .filter_map(|l| {
            let path = l.split(" path=\"").nth(1)?.split('"').next()?;
            let cost = l.split(" cost=").nth(1)?.split(' ').next()?;
            Some(format!("{path} {cost}"))
        })
        .collect();
    for want in ["/cost/3 3", "/plain 10", "/cost/25 25"] {
        assert!(
            costs.iter().any(|c| c == want),
            "{what}: {want} in {costs:#?}"
        );
    }
}

const ALGORITHMS: [(&str, &str); 4] = [
    ("fixed_window", ""),
    ("sliding_window", ""),
    ("sliding_log", ""),
    ("gcra", ""),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_is_settled_to_the_reported_cost_on_the_memory_store() {
    capture_logs();
    for (algorithm, extra) in ALGORITHMS {
        let store = store_toml(Backend::Memory, &[], "deny", "2s");
        let (upstream, gw) = start(&store, algorithm, extra, "charge = \"on_request\"").await;
        let what = format!("memory {algorithm}");
        reserve_ten_settle_each_way(&gw, &what, algorithm, None).await;
        assert_eq!(upstream.hits(), 4, "{what}");
    }
    assert_logged_costs("memory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_is_settled_to_the_reported_cost_in_redis() {
    capture_logs();
    let redis = RedisServer::start();
    for (algorithm, extra) in ALGORITHMS {
        let _: () = redis.cmd(&["FLUSHALL"]);
        let store = store_toml(Backend::Redis, &[&redis], "deny", "2s");
        let (upstream, gw) = start(&store, algorithm, extra, "charge = \"on_request\"").await;
        support::wait_connected(&gw).await;
        let what = format!("redis {algorithm}");
        reserve_ten_settle_each_way(&gw, &what, algorithm, Some(&redis)).await;
        assert_eq!(upstream.hits(), 4, "{what}");
        drop(gw);
    }
    assert_logged_costs("redis");
}

/// Lease mode takes the route's cost from the gateway's lease before forwarding; it is
/// settled the same way: the difference goes back to the lease, the excess is taken
/// from it (or charged in the store when the lease does not hold it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_is_settled_to_the_reported_cost_on_both_stores() {
    let redis = RedisServer::start();
    for backend in [Backend::Memory, Backend::Redis] {
        let store = match backend {
            Backend::Memory => store_toml(backend, &[], "deny", "2s"),
            Backend::Redis => store_toml(backend, &[&redis], "deny", "2s"),
        };
        let (_upstream, gw) = start(&store, "fixed_window", "lease = 10", "").await;
        if backend == Backend::Redis {
            support::wait_connected(&gw).await;
        }
        let what = format!("lease {backend:?}");
        let r = get(&gw.url("/cost/3")).await;
        assert_eq!(r.num("x-ratelimit-used"), 3, "{what}: 7 back to the lease");
        let r = get(&gw.url("/plain")).await;
        assert_eq!(r.num("x-ratelimit-used"), 13, "{what}: no header, 10 kept");
        let r = get(&gw.url("/status/304")).await;
        assert_eq!(r.status, 304);
        assert_eq!(r.num("x-ratelimit-used"), 13, "{what}: all back");
        let r = get(&gw.url("/cost/25")).await;
        assert_eq!(r.status, 200, "{what}");
        assert_eq!(r.num("x-ratelimit-used"), 38, "{what}: 15 more");
        assert_eq!(r.num("x-ratelimit-remaining"), 0, "{what}");
        assert_eq!(get(&gw.url("/cost/1")).await.status, 429, "{what}");
        if backend == Backend::Redis {
            // The window counts the units leased (13 + 10 for the 304, whose units went
            // back to the lease) and the 15 the lease did not hold.
            support::wait_until(Duration::from_secs(5), "38 counted in Redis", || {
                stored(&redis, "fixed_window") == Some(38)
            })
            .await;
        }
    }
}

/// The example of docs/operations.md's "Metering model APIs" is a valid config whose
/// route reserves its estimate and whose upstream reports the real count.
#[test]
fn the_metering_example_in_the_docs_is_valid() {
    let doc = std::fs::read_to_string("docs/operations.md").unwrap();
    let section = doc
        .split("## Metering model APIs")
        .nth(1)
        .expect("the section");
    let example = section
        .split("```toml\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("a TOML example");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.toml");
    std::fs::write(&path, example).unwrap();
    let file = tollgate::config::read(&path).unwrap_or_else(|r| panic!("{:#?}", r.error_lines()));
    let files = tollgate::load::Loaded::load(&file, None);
    if let Err(r) = tollgate::snapshot::Snapshot::build(&file, &files, None) {
        panic!("{:#?}", r.error_lines());
    }
    let route = &file.config.routes[0];
    assert_eq!(route.charge, tollgate::config::ChargeAt::OnRequest);
    assert_eq!(route.cost, 1000);
    assert_eq!(
        file.config.upstreams[0].cost_header.as_deref(),
        Some("x-tokens-used")
    );
}
