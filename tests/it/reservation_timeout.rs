//! A reservation whose call times out is never counted twice: with the primary paused
//! past `store.timeout` and `on_error = "allow"`, requests held by reservations are
//! admitted (fail open), and once everything has settled Redis holds exactly one unit
//! per admitted request, whether the late reservation landed or not (docs/redis.md,
//! "A reservation that timed out").

use crate::support::{get_with, RedisServer, TestGateway, Upstream};
use std::time::Duration;
use tollgate::limiter::key::KeyScheme;

/// `[store]` extras and the route's `charge`, per case.
struct Case {
    name: &'static str,
    store: &'static str,
    charge: &'static str,
}

const CASES: [Case; 3] = [
    // A burst's first request is checked by a read, the others are held by reservations.
    Case {
        name: "held reservations (charge after the response)",
        store: "",
        charge: "after_response",
    },
    Case {
        name: "store.reserve_in_flight",
        store: "reserve_in_flight = true\n",
        charge: "after_response",
    },
    Case {
        name: "charge = \"on_request\"",
        store: "",
        charge: "on_request",
    },
];

fn config(primary: &RedisServer, upstream: &Upstream, case: &Case) -> String {
    config_with(primary, upstream, case, "allow")
}

fn config_with(primary: &RedisServer, upstream: &Upstream, case: &Case, on_error: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis"
on_error = "{on_error}"
timeout = "50ms"
breaker_failures = 1000
{extra}
[[store.shards]]
primary = "{primary}"

[identity]
trusted_proxies = ["127.0.0.1/32"]

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
charge = "{charge}"
"#,
        extra = case.store,
        primary = primary.url(),
        up = upstream.url(),
        charge = case.charge,
    )
}

/// The count the primary holds for `ip`'s window in limit `core` (0: none).
fn stored(primary: &RedisServer, ip: &str) -> u64 {
    let key = KeyScheme::new("tollgate:", None)
        .key("core", &format!("ip:{ip}"))
        .key
        .to_string();
    primary
        .cmd::<Option<u64>>(&["HGET", &key, "count"])
        .unwrap_or(0)
}

/// What Redis holds for `ip` once everything has settled: the late calls land when the
/// pause ends, and what the gateway does about them (within 5 x store.timeout) is done.
/// Waits 400 ms, then until the count is `expected` (up to 5 s: a loaded machine runs
/// the refunds late), then 300 ms more, and returns the count then, so that a count
/// that passes `expected` on its way (a unit counted twice, a refund lost) still shows.
async fn settled(primary: &RedisServer, ip: &str, expected: u64) -> u64 {
    tokio::time::sleep(Duration::from_millis(400)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stored(primary, ip) != expected && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stored(primary, ip)
}

/// For each case, 3 tries of 2 and then 8 concurrent requests of a fresh caller while
/// the primary is paused for 150 ms (`CLIENT PAUSE 150 WRITE`: every script waits),
/// three times `store.timeout`: every request is admitted, and after everything has
/// settled the window holds exactly the number admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_reservation_is_never_counted_twice() {
    let primary = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut caller = 0;
    for case in &CASES {
        let gw = TestGateway::start(&config(&primary, &upstream, case)).await;
        // Connected and scripts loaded: a first request of another caller passes.
        let warm = get_with(&gw.url("/"), &[("x-forwarded-for", "192.0.2.250")]).await;
        assert_eq!(warm.status, 200, "{}", case.name);
        for n in [2usize, 8] {
            for attempt in 0..3 {
                caller += 1;
                let ip = format!("198.51.100.{caller}");
                primary.cmd::<()>(&["CLIENT", "PAUSE", "150", "WRITE"]);
                let tasks: Vec<_> = (0..n)
                    .map(|_| {
                        let url = gw.url("/");
                        let ip = ip.clone();
                        tokio::spawn(async move {
                            get_with(&url, &[("x-forwarded-for", &ip)]).await.status
                        })
                    })
                    .collect();
                let mut admitted = 0;
                for t in tasks {
                    let status = t.await.unwrap();
                    assert_eq!(status, 200, "{}: fail open", case.name);
                    admitted += 1;
                }
                assert_eq!(
                    settled(&primary, &ip, admitted).await,
                    admitted,
                    "{}: {n} concurrent requests, try {attempt}: Redis counts each admitted request once",
                    case.name
                );
            }
        }
    }
}

/// `n` concurrent requests of caller `ip` to `path` while the primary is paused for
/// 150 ms: their statuses.
async fn paused_burst(
    primary: &RedisServer,
    gw: &TestGateway,
    path: &str,
    ip: &str,
    n: usize,
) -> Vec<u16> {
    primary.cmd::<()>(&["CLIENT", "PAUSE", "150", "WRITE"]);
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let url = gw.url(path);
            let ip = ip.to_string();
            tokio::spawn(async move {
                get_with(&url, &[("x-forwarded-for", &ip)])
                    .await
                    .status
                    .as_u16()
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    statuses
}

/// A request whose reservation timed out and that is not charged after all is not
/// counted either: its reservation, which lands when the pause ends, is refunded.
/// Requests answered 304 (an uncharged status) with `on_error = "allow"`, and requests
/// refused 503 with `on_error = "deny"`, for held reservations and
/// `reserve_in_flight`: Redis then holds 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_reservation_of_a_request_not_charged_is_refunded() {
    let primary = RedisServer::start();
    let upstream = Upstream::start().await;
    let mut caller = 100;
    for case in &CASES[..2] {
        for (on_error, path, status) in [("allow", "/status/304", 304), ("deny", "/", 503)] {
            let gw = TestGateway::start(&config_with(&primary, &upstream, case, on_error)).await;
            let warm = get_with(&gw.url("/"), &[("x-forwarded-for", "192.0.2.250")]).await;
            assert_eq!(warm.status, 200, "{}", case.name);
            for n in [2usize, 8] {
                caller += 1;
                let ip = format!("198.51.100.{caller}");
                let statuses = paused_burst(&primary, &gw, path, &ip, n).await;
                assert!(
                    statuses.iter().all(|&s| s == status),
                    "{}, on_error = {on_error}: {statuses:?}",
                    case.name
                );
                assert_eq!(
                    settled(&primary, &ip, 0).await,
                    0,
                    "{}, on_error = {on_error}, {n} requests: nothing counted",
                    case.name
                );
            }
        }
    }
}

/// A concurrency slot whose call timed out and that lands when the pause ends is given
/// back when its response ends, like any slot: with the primary paused, 2 and then 8
/// concurrent requests are let through (`on_error = "allow"`), and once everything has
/// settled the caller holds no slot in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_concurrency_slot_is_given_back() {
    let primary = RedisServer::start();
    let upstream = Upstream::start().await;
    let toml = config(&primary, &upstream, &CASES[0]).replace(
        "window = \"1h\"",
        "algorithm = \"concurrency\"\nwindow = \"1m\"",
    );
    let gw = TestGateway::start(&toml).await;
    let warm = get_with(&gw.url("/"), &[("x-forwarded-for", "192.0.2.250")]).await;
    assert_eq!(warm.status, 200);
    for (caller, n) in [(201, 2usize), (202, 8)] {
        let ip = format!("198.51.100.{caller}");
        let statuses = paused_burst(&primary, &gw, "/", &ip, n).await;
        assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
        tokio::time::sleep(Duration::from_millis(400)).await;
        // The slots' key: the caller's digest in its hash tag, under the limit's name
        // and algorithm.
        let digest = KeyScheme::new("tollgate:", None)
            .key("core", &format!("ip:{ip}"))
            .key
            .rsplit_once('{')
            .map(|(_, tag)| format!("{{{tag}"))
            .unwrap();
        let held: u64 = primary
            .keys()
            .iter()
            .filter(|k| k.ends_with(&digest))
            .map(|k| primary.cmd::<u64>(&["ZCARD", k]))
            .sum();
        assert_eq!(held, 0, "{n} requests: every slot given back");
    }
}
