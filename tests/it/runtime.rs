//! `server.runtime = "per_core"`: one single-threaded runtime per
//! worker, each with its own `SO_REUSEPORT` listener, upstream pools and Redis
//! batchers. Connections are spread over the workers' listeners, the connection budget
//! is shared, shutdown drains every worker, reloads reach every worker, the store
//! counts right across workers. (The other test files run under this shape with
//! `TOLLGATE_TEST_RUNTIME=per_core`.)

use crate::support;
use crate::support::{get, with_runtime, Binary, RedisServer, TestGateway, Upstream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(upstream: &Upstream, workers: usize, quota: u64, store: &str) -> String {
    with_runtime(
        &format!(
            r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
shutdown_grace = "5s"
workers = {workers}

{store}

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
        ),
        "per_core",
    )
}

/// Sockets listening on `port` (IPv4 and IPv6), from /proc/net/tcp{,6}.
fn listening_sockets(port: u16) -> usize {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| t.lines().skip(1).map(str::to_owned).collect::<Vec<_>>())
        .filter(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            // local_address ends with the port; state 0A is LISTEN.
            cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
        })
        .count()
}

/// The value of the sample `name` (with its labels) in Prometheus text, or 0.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn metrics(gw: &TestGateway) -> String {
    get(&format!(
        "http://{}/metrics",
        gw.gateway.admin_addr().unwrap()
    ))
    .await
    .text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_serves_connections_on_one_listener_per_worker() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 3, 100_000, "")).await;
    assert_eq!(
        listening_sockets(gw.addr.port()),
        3,
        "one SO_REUSEPORT listener per worker on the port"
    );
    // 48 connections, each with one request: the kernel spreads them over the three
    // listeners (all on one: probability 3 * (1/3)^48).
    let mut tasks = Vec::new();
    for _ in 0..48 {
        let url = gw.url("/");
        tasks.push(tokio::spawn(async move { get(&url).await.status }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let text = metrics(&gw).await;
    let per_worker: Vec<f64> = (0..3)
        .map(|w| {
            sample(
                &text,
                &format!("tollgate_worker_connections_total{{worker=\"{w}\"}}"),
            )
        })
        .collect();
    assert_eq!(per_worker.iter().sum::<f64>(), 48.0, "{per_worker:?}");
    assert!(
        per_worker.iter().all(|n| *n > 0.0),
        "every worker accepted connections: {per_worker:?}"
    );
    // The one window, counted across the workers' requests.
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 49);
    // HTTP/2 (prior knowledge) on a worker too.
    let h2 = support::h2_client();
    let resp = h2.get(gw.url("/").parse().unwrap()).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_workers_keep_their_own_upstream_connections() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 3, 100_000, "")).await;
    // Sequential requests, each on a new client connection, over the three workers: a
    // worker reuses its own idle upstream connection, never another worker's, so there
    // are as many upstream connections as workers that served (a pool shared by the
    // workers would carry every one of them on a single connection). A client
    // connection keeps its upstream connection until it closes: the pause lets the
    // gateway see each close before the next client connects.
    for _ in 0..30 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = metrics(&gw).await;
    let served = (0..3)
        .filter(|w| {
            sample(
                &text,
                &format!("tollgate_worker_connections_total{{worker=\"{w}\"}}"),
            ) > 0.0
        })
        .count();
    assert!(served >= 2, "the connections spread: {text}");
    assert_eq!(
        upstream.connections(),
        served,
        "one upstream connection per worker that served"
    );
    assert_eq!(upstream.hits(), 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_shares_one_connection_budget_across_workers() {
    let upstream = Upstream::start().await;
    let text = config(&upstream, 2, 100_000, "")
        .replace("workers = 2", "workers = 2\nmax_connections = 4");
    let gw = TestGateway::start(&text).await;
    // Four idle connections, wherever the kernel put them, hold the budget.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(s);
    }
    // Whichever listener the next ones land on, they are refused.
    for _ in 0..6 {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
            .await
            .expect("refused at once")
            .unwrap();
        let head = String::from_utf8_lossy(&buf);
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        assert!(head.contains("too many connections"), "{head}");
    }
    drop(held);
    // Once the gateway has seen them close, the budget is back for new connections.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
        if buf.starts_with(b"HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "the budget came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_graceful_shutdown_drains_every_worker() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 2, 100_000, "")).await;
    let ok = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    // 20 requests on their own connections (so on both workers), in flight at shutdown.
    for _ in 0..20 {
        let (url, ok) = (gw.url("/slow/800"), ok.clone());
        tasks.push(tokio::spawn(async move {
            let r = get(&url).await;
            assert_eq!(r.status, 200);
            assert_eq!(r.text(), "slow ok");
            ok.fetch_add(1, Ordering::SeqCst);
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    gw.gateway.shutdown();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(ok.load(Ordering::SeqCst), 20, "no request lost");
    let TestGateway { gateway, addr, .. } = gw;
    tokio::time::timeout(Duration::from_secs(10), gateway.wait())
        .await
        .expect("every worker stopped after draining");
    assert!(started.elapsed() < Duration::from_secs(5));
    // No worker listens any more.
    assert_eq!(listening_sockets(addr.port()), 0);
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_reload_reaches_every_worker() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, 2, 1000, "")).await;
    assert_eq!(get(&gw.url("/")).await.header("x-ratelimit-limit"), "1000");
    gw.reload(&config(&upstream, 2, 2000, "")).unwrap();
    // New connections, spread over both workers, all see the new quota; the window
    // carries on.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let url = gw.url("/");
        tasks.push(tokio::spawn(async move { get(&url).await }));
    }
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit"), "2000");
    }
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 18);
}

/// A `[store]` on `redis`, one shard, failing closed.
fn redis_store(redis: &RedisServer) -> String {
    format!(
        "[store]\nbackend = \"redis\"\ntimeout = \"2s\"\non_error = \"deny\"\n[[store.shards]]\nprimary = \"{}\"\n",
        redis.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_redis_store_counts_right_across_workers() {
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = redis_store(&redis);
    let gw = TestGateway::start(&config(&upstream, 2, 25, &store)).await;
    // 40 requests on their own connections, 20 at a time, over both workers' batchers:
    // exactly the quota is let through.
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let url = gw.url("/");
            tasks.push(tokio::spawn(async move { get(&url).await.status }));
        }
        for t in tasks {
            statuses.push(t.await.unwrap());
        }
    }
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, limited), (25, 15), "{statuses:?}");
    let text = metrics(&gw).await;
    for w in 0..2 {
        assert!(
            sample(
                &text,
                &format!("tollgate_worker_connections_total{{worker=\"{w}\"}}")
            ) > 0.0,
            "worker {w} served some: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_workers_send_their_redis_calls_over_their_own_connections() {
    let mut redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let store = redis_store(&redis);
    let gw = TestGateway::start(&config(&upstream, 2, 1000, &store)).await;
    let served = until_workers_use_their_own_connections(&gw, &redis).await;
    // Every request counted once, whichever connection carried it.
    let count_in = |redis: &RedisServer| {
        let keys = redis.keys();
        assert_eq!(keys.len(), 1, "{keys:?}");
        redis.cmd::<String>(&["HGET", &keys[0], "count"])
    };
    assert_eq!(count_in(&redis), served.to_string());
    assert_eq!(
        get(&gw.url("/")).await.header("x-ratelimit-remaining"),
        (1000 - served - 1).to_string()
    );

    // Redis restarts (empty): the workers' connections are opened again, to it.
    redis.restart();
    let served = until_workers_use_their_own_connections(&gw, &redis).await;
    assert_eq!(count_in(&redis), served.to_string());
}

/// The lines of `CLIENT LIST` text of connections named `name`.
fn named(list: &str, name: &str) -> Vec<String> {
    list.lines()
        .filter(|l| l.split(' ').any(|f| f == format!("name={name}")))
        .map(str::to_owned)
        .collect()
}

/// Requests on new connections (so on both workers of `gw`) until each worker's own
/// connection to `redis` has run a script call (EVALSHA) last, within 10 s; then checks
/// that each worker has one such connection beside the node's shared one. Returns the
/// requests answered 200 (a 503 while the gateway reconnects is not counted).
async fn until_workers_use_their_own_connections(gw: &TestGateway, redis: &RedisServer) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut served = 0;
    let list = loop {
        match get(&gw.url("/")).await.status.as_u16() {
            200 => served += 1,
            503 => tokio::time::sleep(Duration::from_millis(50)).await,
            other => panic!("status {other}"),
        }
        let list: String = redis.cmd(&["CLIENT", "LIST"]);
        let ready = (0..2).all(|w| {
            named(&list, &format!("tollgate-worker-{w}"))
                .iter()
                .any(|l| l.contains(" cmd=evalsha "))
        });
        if ready || Instant::now() > deadline {
            break list;
        }
    };
    for w in 0..2 {
        let own = named(&list, &format!("tollgate-worker-{w}"));
        assert_eq!(own.len(), 1, "worker {w}'s own connection: {list}");
        assert!(own[0].contains(" cmd=evalsha "), "{list}");
    }
    assert_eq!(
        named(&list, "tollgate").len(),
        1,
        "the node's shared one: {list}"
    );
    served
}

/// Threads of a process named `name`.
fn threads_named(pid: u32, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|n| n.trim() == name)
        .count()
}

fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_core_binary_reloads_on_sighup_and_drains_on_sigterm() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let port = support::redis::free_port();
    let text = |quota: u64| {
        config(&upstream, 2, quota, "")
            .replace(
                "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"",
                &format!("listen = \"127.0.0.1:{port}\"\nwatch_config = false"),
            )
            .replace("[server]", "[log]\nformat = \"json\"\n\n[server]")
    };
    write(&path, &text(10));
    let mut gw = Binary::spawn(&path, port, &[]);
    let pid = gw.child.id();
    // Two worker threads (started just after the listeners were bound); the runtime
    // that runs everything else has no tokio workers.
    let deadline = Instant::now() + Duration::from_secs(10);
    while threads_named(pid, "tollgate-worker") != 2 {
        assert!(
            Instant::now() < deadline,
            "{} worker threads",
            threads_named(pid, "tollgate-worker")
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(threads_named(pid, "tokio-rt-worker"), 0);
    assert_eq!(listening_sockets(port), 2);
    let url = format!("http://127.0.0.1:{port}/");
    assert_eq!(get(&url).await.header("x-ratelimit-limit"), "10");

    write(&path, &text(20));
    gw.signal("-HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&url).await.header("x-ratelimit-limit") != "20" {
        assert!(Instant::now() < deadline, "reload not applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // SIGTERM with requests in flight on both workers: they finish, exit 0.
    let mut in_flight = Vec::new();
    for _ in 0..8 {
        let url = format!("http://127.0.0.1:{port}/slow/1000");
        in_flight.push(tokio::spawn(async move { get(&url).await }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    gw.signal("-TERM");
    for t in in_flight {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "the in-flight request completes");
        assert_eq!(r.text(), "slow ok");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = gw.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "did not exit");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let logs = gw.logs();
    assert_eq!(status.code(), Some(0), "{logs}");
    assert!(logs.contains("SIGTERM received"), "{logs}");
    assert!(logs.contains("\"workers\":2"), "{logs}");
}
