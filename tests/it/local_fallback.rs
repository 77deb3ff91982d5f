//! `store.on_error = "local"`, with real `redis-server` processes and real gateway
//! binaries: while the shard's primary is down, each gateway enforces the shard's limits
//! in its own memory with each quota divided by the fleet size (given, or counted from
//! the heartbeats in Redis), and returns to Redis when it comes back.
//!
//! Every test asserts what a caller sees (statuses, headers), what the metrics and logs
//! say, and what Redis holds.

use crate::support::redis::free_port;
use crate::support::{check, get, wait_until, Binary, RedisServer, Upstream};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tollgate::limiter::key::KeyScheme;

/// A gateway binary with its admin listener, its config in a temp dir.
struct Gw {
    bin: Binary,
    port: u16,
    admin: u16,
    _dir: tempfile::TempDir,
}

impl Gw {
    /// Start the binary on `redis` with `on_error = "local"` and `fleet` (the
    /// `fleet_size` and `fleet_heartbeat` lines): route `/` limited by `core`, `quota` an
    /// hour for the anonymous caller (the test).
    fn start(redis: &RedisServer, fleet: &str, quota: u64, upstream: &Upstream) -> Gw {
        Gw::start_with(redis, fleet, quota, upstream, "", "")
    }

    /// [`Gw::start`] with more lines in the `core` limit and in the route.
    fn start_with(
        redis: &RedisServer,
        fleet: &str,
        quota: u64,
        upstream: &Upstream,
        limit: &str,
        route: &str,
    ) -> Gw {
        let dir = tempfile::tempdir().unwrap();
        let (port, admin) = (free_port(), free_port());
        let text = format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
watch_config = false

[store]
backend = "redis"
on_error = "local"
timeout = "200ms"
breaker_cooloff = "300ms"
{fleet}

[[store.shards]]
primary = "{redis}"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = {quota} }}
{limit}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
{route}
"#,
            redis = redis.url(),
            up = upstream.url()
        );
        let path: PathBuf = dir.path().join("tollgate.toml");
        std::fs::write(&path, text).unwrap();
        let bin = Binary::spawn(&path, port, &[]);
        Gw {
            bin,
            port,
            admin,
            _dir: dir,
        }
    }

    async fn get(&self) -> crate::support::client::Reply {
        get(&format!("http://127.0.0.1:{}/", self.port)).await
    }

    /// Wait until `/readyz` answers 200.
    async fn wait_ready(&self) {
        let started = Instant::now();
        while get(&format!("http://127.0.0.1:{}/readyz", self.admin))
            .await
            .status
            != 200
        {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "not ready:\n{}",
                self.bin.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn metrics(&self) -> String {
        get(&format!("http://127.0.0.1:{}/metrics", self.admin))
            .await
            .text()
    }

    /// The sum of `tollgate_requests_total` rows with `decision` and `status`.
    async fn decisions(&self, decision: &str, status: u16) -> u64 {
        let label = format!("status=\"{status}\",decision=\"{decision}\"");
        self.metrics()
            .await
            .lines()
            .filter(|l| l.starts_with("tollgate_requests_total{") && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// `tollgate_store_fallback_active` of shard 0, as rendered.
    async fn fallback_active(&self) -> Option<String> {
        self.metrics()
            .await
            .lines()
            .find(|l| l.starts_with("tollgate_store_fallback_active{shard=\"0\"}"))
            .and_then(|l| l.rsplit(' ').next().map(str::to_string))
    }

    /// How many lines of its log contain `needle`.
    fn logged(&self, needle: &str) -> usize {
        self.bin
            .logs()
            .lines()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Send `n` requests one after the other; their statuses.
    async fn statuses(&self, n: usize) -> Vec<u16> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(self.get().await.status.as_u16());
        }
        out
    }
}

/// The `count` of the test caller's `core` window on `server` (0 when absent).
fn count_on(server: &RedisServer) -> u64 {
    let key = KeyScheme::new("tollgate:", None)
        .key("core", "ip:127.0.0.1")
        .key
        .to_string();
    server
        .cmd::<Option<u64>>(&["HGET", &key, "count"])
        .unwrap_or(0)
}

const ENTERED: &str = "store shard unreachable: enforcing its limits in this gateway's memory";
const LEFT: &str = "store shard reachable again";

/// Two gateways, `fleet_size = 2`, a quota of 10 an hour. Redis is killed mid-run: each
/// gateway then admits 10 / 2 = 5 and refuses the rest with 429 (not 503, not
/// unlimited), reporting its share in the headers, counted as `decision="local"`,
/// `tollgate_store_fallback_active` = 1, logged once. Redis restarted on the same port:
/// the gateways return to it (gauge 0, logged once) and count there again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_each_gateway_holds_its_share_and_returns_when_redis_does() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let fleet = "fleet_size = 2";
    let gws = [
        Gw::start(&redis, fleet, 10, &upstream),
        Gw::start(&redis, fleet, 10, &upstream),
    ];
    for gw in &gws {
        gw.wait_ready().await;
        assert_eq!(gw.statuses(2).await, [200, 200]);
        assert_eq!(gw.fallback_active().await.as_deref(), Some("0"));
    }
    wait_until(Duration::from_secs(5), "Redis holds 4", || {
        count_on(&redis) == 4
    })
    .await;

    redis.kill();
    for gw in &gws {
        let statuses = gw.statuses(8).await;
        assert_eq!(
            statuses,
            [200, 200, 200, 200, 200, 429, 429, 429],
            "each gateway admits its share, 10 / 2, afresh\n{}",
            gw.bin.logs()
        );
        let refused = gw.get().await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("x-ratelimit-limit"), "5", "the local share");
        assert_eq!(refused.header("x-ratelimit-remaining"), "0");
        assert_eq!(gw.fallback_active().await.as_deref(), Some("1"));
        assert_eq!(gw.decisions("local", 200).await, 5);
        assert_eq!(gw.decisions("local", 429).await, 4);
        assert_eq!(gw.decisions("store_error_allowed", 200).await, 0);
        assert_eq!(gw.logged(ENTERED), 1, "{}", gw.bin.logs());
        assert!(gw.bin.logs().contains("divided by 2"), "{}", gw.bin.logs());
    }

    redis.restart();
    for gw in &gws {
        let started = Instant::now();
        while gw.fallback_active().await.as_deref() != Some("0") {
            assert!(
                started.elapsed() < Duration::from_secs(8),
                "still local:\n{}",
                gw.bin.logs()
            );
            let _ = gw.get().await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(gw.logged(LEFT), 1, "{}", gw.bin.logs());
    }
    // Redis restarted empty: what it holds now was counted there since the return.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = count_on(&redis);
    let locals = gws[0].decisions("local", 200).await + gws[0].decisions("local", 429).await;
    for gw in &gws {
        assert_eq!(gw.statuses(2).await, [200, 200], "{}", gw.bin.logs());
    }
    wait_until(
        Duration::from_secs(5),
        "the four requests counted in Redis",
        || count_on(&redis) == before + 4,
    )
    .await;
    assert_eq!(
        gws[0].decisions("local", 200).await + gws[0].decisions("local", 429).await,
        locals,
        "nothing decided locally once back"
    );
    assert_eq!(gws[0].logged(ENTERED), 1, "{}", gws[0].bin.logs());
}

/// `fleet_size = "auto"`: each gateway's heartbeat is in Redis (a sorted set of
/// gateway ids); a third gateway joining makes the divisor 3, so with a quota of 9 each
/// gateway admits 3 once Redis is down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fleet_size_auto_the_gateways_alive_before_the_fault_share_the_quota() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let fleet = "fleet_size = \"auto\"\nfleet_heartbeat = \"100ms\"";
    let mut gws = vec![
        Gw::start(&redis, fleet, 9, &upstream),
        Gw::start(&redis, fleet, 9, &upstream),
    ];
    let alive = |redis: &RedisServer| redis.cmd::<u64>(&["ZCARD", "tollgate:gateways"]);
    wait_until(Duration::from_secs(5), "two heartbeats", || {
        alive(&redis) == 2
    })
    .await;
    for gw in &gws {
        gw.wait_ready().await;
        let started = Instant::now();
        while gw.logged("gateways=2") == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{}",
                gw.bin.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    gws.push(Gw::start(&redis, fleet, 9, &upstream));
    wait_until(Duration::from_secs(5), "three heartbeats", || {
        alive(&redis) == 3
    })
    .await;
    let ttl: i64 = redis.cmd(&["PTTL", "tollgate:gateways"]);
    assert!((1..=300).contains(&ttl), "three heartbeats' TTL: {ttl}");
    for gw in &gws {
        gw.wait_ready().await;
        let started = Instant::now();
        while gw.logged("gateways=3") == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{}",
                gw.bin.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    redis.kill();
    for gw in &gws {
        assert_eq!(
            gw.statuses(5).await,
            [200, 200, 200, 429, 429],
            "9 / 3 each\n{}",
            gw.bin.logs()
        );
        assert!(gw.bin.logs().contains("divided by 3"), "{}", gw.bin.logs());
        assert_eq!(gw.fallback_active().await.as_deref(), Some("1"));
    }
}

/// Another algorithm and reservations (`charge = "on_request"`) are enforced locally
/// too, by the same rules: a sliding window of 6 on a fleet of 3 admits 2 per gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_reserved_on_request_holds_its_share_too() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let gw = Gw::start_with(
        &redis,
        "fleet_size = 3",
        6,
        &upstream,
        "algorithm = \"sliding_window\"",
        "charge = \"on_request\"",
    );
    gw.wait_ready().await;
    assert_eq!(gw.statuses(1).await, [200]);
    redis.kill();
    assert_eq!(
        gw.statuses(4).await,
        [200, 200, 429, 429],
        "6 / 3, afresh\n{}",
        gw.bin.logs()
    );
    let refused = gw.get().await;
    assert_eq!(refused.header("x-ratelimit-limit"), "2");
    assert!(refused.num("retry-after") >= 1);
    assert_eq!(gw.decisions("local", 429).await, 3);
}

/// `store.fleet_size` must be a count of at least 1, or `"auto"`: an error at its line.
#[test]
fn fleet_size_zero_is_an_error_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    for (value, says) in [
        (
            "0",
            "store.fleet_size: 0 gateways: must be at least 1, or \"auto\"",
        ),
        (
            "\"all\"",
            "store.fleet_size: \"all\": must be a number of gateways",
        ),
    ] {
        std::fs::write(
            &path,
            format!(
                "[store]\nbackend = \"redis\"\non_error = \"local\"\nfleet_size = {value}\n\n[[store.shards]]\nprimary = \"redis://127.0.0.1:6379\"\n"
            ),
        )
        .unwrap();
        let (code, _, stderr) = check(&path);
        assert_eq!(code, 1, "{stderr}");
        let expected = format!("{}:4:", path.display());
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(&expected) && l.contains(says)),
            "{expected}… {says} in:\n{stderr}"
        );
    }
}
