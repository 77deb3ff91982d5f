//! Refusals and units a hostile or unlucky timeline could
//! get wrong, against the real gateway, real upstreams and real `redis-server`s.
//!
//! - a refusal that requests in flight or reservations caused is never kept in the
//!   over-limit cache, and a refund forgets a kept one (no poisoned refusals);
//! - a unit is never counted in flight and in the store at once (a CHARGE whose reply is
//!   slow does not make the next request look over the limit), and a burst admits
//!   exactly the quota, 50 times in a row, on both stores;
//! - a gateway killed with `kill -9` in lease mode strands its leased units for at most
//!   `lease_ttl`.

use crate::support;
use crate::support::{get, get_with, h2_client, RedisServer, TestGateway, Upstream};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::limiter::store::StoreStatus;

/// `[store]` for the memory store (none) or one Redis shard at `url`.
fn store_section(redis_url: Option<&str>) -> String {
    match redis_url {
        None => String::new(),
        Some(url) => format!(
            "[store]\nbackend = \"redis\"\ntimeout = \"2s\"\n[[store.shards]]\nprimary = \"{url}\"\n"
        ),
    }
}

/// One route on `upstream` with one limit (`limit` is the body of its `[[limits]]`).
fn config(upstream: &Upstream, store: &str, limit: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

{store}

[rate_limit_endpoint]
path = "/rate_limit"

[[upstreams]]
name = "api"
targets = ["{up}"]
response_timeout = "10s"

[[limits]]
name = "core"
{limit}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        up = upstream.url()
    )
}

/// `n` concurrent GETs of `path` (with `headers`); their statuses, sorted.
async fn burst(gw: &TestGateway, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    let client = h2_client();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let mut req = http::Request::get(gw.url(path));
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let req = req.body(http_body_util::Empty::new()).unwrap();
            tokio::spawn(client.request(req))
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().unwrap().status().as_u16());
    }
    statuses.sort();
    statuses
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

/// `used` of the limit `core` as `GET /rate_limit` reports it (a read, never charged),
/// once refunds sent in the background have landed: waits up to 3 s for `want`.
async fn used_settles_at(gw: &TestGateway, headers: &[(&str, &str)], want: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let used = get_with(&gw.url("/rate_limit"), headers).await.json()["resources"]["core"]
            ["used"]
            .as_u64()
            .unwrap_or(0);
        if used == want || Instant::now() > deadline {
            return used;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Six concurrent requests on a global limit of 5 that the upstream answers 304
/// after 0.5 s: five are admitted, one is refused (the others were in flight), none is
/// charged. The refusal must not be kept: the next caller is admitted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_caused_by_requests_in_flight_never_poison_the_cache() {
    for redis in [None, Some(RedisServer::start())] {
        let url = redis.as_ref().map(|r| r.url());
        for algorithm in ["fixed_window", "gcra", "sliding_window"] {
            let upstream = Upstream::start().await;
            let limit = format!(
                "algorithm = \"{algorithm}\"\nwindow = \"1m\"\nquota = {{ anonymous = 5 }}\nby = \"global\""
            );
            let gw = TestGateway::start(&config(&upstream, &store_section(url.as_deref()), &limit))
                .await;
            let what = format!("redis {}, {algorithm}", redis.is_some());
            let statuses = burst(&gw, "/slow/500?status=304", &[], 6).await;
            assert_eq!(count(&statuses, 304), 5, "{what}: {statuses:?}");
            assert_eq!(count(&statuses, 429), 1, "{what}: {statuses:?}");
            assert_eq!(
                used_settles_at(&gw, &[], 0).await,
                0,
                "{what}: 304s are not charged"
            );
            // Every caller of the global limit is admitted again: nothing was charged.
            let r = get(&gw.url("/")).await;
            assert_eq!(r.status, 200, "{what}: the refusal was kept: {}", r.text());
            assert_eq!(r.header("x-ratelimit-used"), "1", "{what}");
        }
    }
}

/// A fixed window with 49 of 50 used and a slow 304 in flight: a concurrent
/// request is refused (the 304 might have been charged), but once the 304 is refunded
/// the caller is admitted at once, not refused from the cache for the rest of the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_that_a_refund_undoes_is_forgotten() {
    for redis in [None, Some(RedisServer::start())] {
        let url = redis.as_ref().map(|r| r.url());
        let upstream = Upstream::start().await;
        let limit = "window = \"1h\"\nquota = { anonymous = 50 }";
        let gw =
            TestGateway::start(&config(&upstream, &store_section(url.as_deref()), limit)).await;
        let what = format!("redis {}", redis.is_some());
        for _ in 0..49 {
            assert_eq!(get(&gw.url("/")).await.status, 200, "{what}");
        }
        let slow_url = gw.url("/slow/600?status=304");
        let slow = tokio::spawn(async move { get(&slow_url).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        let refused = get(&gw.url("/")).await;
        assert_eq!(refused.status, 429, "{what}: 49 used and one in flight");
        assert_eq!(refused.header("x-ratelimit-remaining"), "0", "{what}");
        assert_eq!(slow.await.unwrap().status, 304, "{what}");
        // The 304 was not charged: the 50th unit is free again, at once.
        let deadline = Instant::now() + Duration::from_millis(1500);
        let mut refusals = 0;
        loop {
            let r = get(&gw.url("/")).await;
            if r.status == 200 {
                assert_eq!(r.header("x-ratelimit-used"), "50", "{what}");
                break;
            }
            refusals += 1;
            assert!(
                Instant::now() < deadline,
                "{what}: still refused {refusals} times after the refund"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            refusals <= 2,
            "{what}: {refusals} refusals after the refund"
        );
    }
}

/// A TCP proxy in front of `target` that passes what the client sends at once and
/// holds every reply from `target` for `delay` (in order), like a slow network between
/// the gateway and Redis.
async fn delaying_proxy(target: std::net::SocketAddr, delay: Duration) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                continue;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut cr, &mut sw).await;
            });
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0
                        || tx
                            .send((Instant::now() + delay, buf[..n].to_vec()))
                            .is_err()
                    {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                while let Some((due, bytes)) = rx.recv().await {
                    tokio::time::sleep_until(due.into()).await;
                    if cw.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// With every Redis reply 300 ms late, A is admitted; B, sent while A's CHARGE
/// reply is still on its way, is admitted too (quota 2: A is counted once, in the store,
/// not also as in flight), and C is refused with the store's own numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_whose_charge_is_on_its_way_is_counted_once() {
    let redis = RedisServer::start();
    let target: std::net::SocketAddr = format!("127.0.0.1:{}", redis.port).parse().unwrap();
    let proxy = delaying_proxy(target, Duration::from_millis(300)).await;
    let upstream = Upstream::start().await;
    let limit = "window = \"1h\"\nquota = { anonymous = 2 }";
    let store = store_section(Some(&format!("redis://{proxy}")));
    let gw = TestGateway::start(&config(&upstream, &store, limit)).await;
    // Connections and scripts come up through the proxy, slowly.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gw.gateway.snapshot().limiter.store().ready() {
        assert!(
            Instant::now() < deadline,
            "store not ready through the proxy"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A: check (300 ms), forward, charge (reply after 300 ms more).
    let a_url = gw.url("/");
    let a = tokio::spawn(async move { get(&a_url).await });
    tokio::time::sleep(Duration::from_millis(450)).await;
    // B arrives while A's CHARGE reply is in transit.
    let b = get(&gw.url("/")).await;
    let a = a.await.unwrap();
    assert_eq!(a.status, 200);
    assert_eq!(a.header("x-ratelimit-used"), "1");
    assert_eq!(b.status, 200, "B was refused: {}", b.text());
    assert_eq!(b.header("x-ratelimit-used"), "2");
    let c = get(&gw.url("/")).await;
    assert_eq!(c.status, 429);
    assert_eq!(c.header("x-ratelimit-used"), "2", "the store holds 2");
    let stored: Vec<String> = redis.keys();
    let window = stored
        .iter()
        .find(|k| k.contains("core"))
        .expect("a window key");
    let held: String = redis.cmd(&["HGET", window, "count"]);
    assert_eq!(held, "2");
}

/// 50 bursts of 40 concurrent quick requests of one caller against a quota of
/// 20, on both stores: each admits exactly 20, and the store holds exactly 20.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_bursts_each_admit_exactly_the_quota() {
    for redis in [None, Some(RedisServer::start())] {
        let url = redis.as_ref().map(|r| r.url());
        let upstream = Upstream::start().await;
        let limit = "window = \"1h\"\nquota = { anonymous = 20 }\nby = \"header:x-tenant\"";
        let gw =
            TestGateway::start(&config(&upstream, &store_section(url.as_deref()), limit)).await;
        let what = format!("redis {}", redis.is_some());
        for rep in 0..50 {
            let tenant = format!("t{rep}");
            let headers = [("x-tenant", tenant.as_str())];
            let statuses = burst(&gw, "/", &headers, 40).await;
            assert_eq!(
                count(&statuses, 200),
                20,
                "{what}, burst {rep}: {statuses:?}"
            );
            assert_eq!(
                count(&statuses, 429),
                20,
                "{what}, burst {rep}: {statuses:?}"
            );
            assert_eq!(
                used_settles_at(&gw, &headers, 20).await,
                20,
                "{what}, burst {rep}: the store holds the admitted requests"
            );
        }
    }
}

/// A gateway killed with `kill -9` in lease mode strands the units of its
/// lease only until `lease_ttl`: after 5 crashes, the caller's quota is back but for
/// what the crashed gateways served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_gateway_strands_its_lease_for_at_most_lease_ttl() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let port = support::redis::free_port();
    let text = config(
        &upstream,
        &store_section(Some(&redis.url())),
        "window = \"1h\"\nquota = { anonymous = 100 }\nlease = 10\nlease_ttl = \"2s\"",
    )
    .replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    std::fs::write(&path, text).unwrap();
    let url = format!("http://127.0.0.1:{port}/");
    for _ in 0..5 {
        let mut child = support::tollgate()
            .args(["--config"])
            .arg(&path)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "the gateway did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(get(&url).await.status, 200);
        // One request served (a lease of 10 taken), two more from the lease.
        for _ in 0..2 {
            assert_eq!(get(&url).await.status, 200);
        }
        // kill -9: no chance to give the lease back.
        let _ = std::process::Command::new("kill")
            .args(["-9", &child.id().to_string()])
            .status();
        let _ = child.wait();
    }
    // 5 crashes × 3 served = 15 used; 5 × 7 units stranded until lease_ttl.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let gw = TestGateway::start(&config(
        &upstream,
        &store_section(Some(&redis.url())),
        "window = \"1h\"\nquota = { anonymous = 100 }\nlease = 10\nlease_ttl = \"2s\"",
    ))
    .await;
    let mut admitted = 0;
    while admitted < 200 {
        let r = get(&gw.url("/")).await;
        if r.status != 200 {
            assert_eq!(r.status, 429);
            break;
        }
        admitted += 1;
    }
    assert!(
        admitted >= 85,
        "only {admitted} admitted after the crashes: stranded lease units were never given back"
    );
    assert!(admitted <= 100, "{admitted} admitted: more than the quota");
}
