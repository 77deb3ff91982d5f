//! What one client address can take, against the real gateway,
//! a real upstream and a real `redis-server`.
//!
//! - anonymous IPv6 callers are keyed by their network prefix
//!   (`identity.ipv6_prefix_len`, default 64): rotating addresses inside one /64 does
//!   not dodge a per-IP limit, the failed-authentication limit or the access log's
//!   client hash; with 128 every address is its own caller;
//! - `server.max_connections_per_ip`: one address cannot take every connection.
//!
//! Several IPv6 source addresses on loopback: the gateway trusts 127.0.0.1 as a proxy and
//! reads the client from `X-Forwarded-For`.

use crate::support;
use crate::support::{get_with, Backend, RedisServer, TestGateway, Upstream};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Routes `/search` (limit `search`, 3 per hour for anonymous callers, by caller) and
/// `/lookup` (limit `lookup`, 3 per hour by IP for every tier), behind a trusted proxy
/// at 127.0.0.1; `identity` is extra `[identity]` lines.
fn config(upstream: &Upstream, store: &str, identity: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

{store}

[identity]
trusted_proxies = ["127.0.0.1"]
failed_auth_limit = {{ quota = 3, window = "1m" }}
{identity}

[[identity.clients]]
id = "acme"
key_sha256 = "{acme}"
tier = "gold"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "search"
window = "1h"
quota = {{ anonymous = 3 }}

[[limits]]
name = "lookup"
window = "1h"
by = "ip"
quota = {{ anonymous = 3, gold = 3 }}

[[routes]]
path_prefix = "/search"
upstream = "api"
limits = ["search"]

[[routes]]
path_prefix = "/lookup"
upstream = "api"
limits = ["lookup"]

[[routes]]
path_prefix = "/"
upstream = "api"
"#,
        acme = support::sha256_hex("acme-key"),
        up = upstream.url()
    )
}

fn store(backend: Backend, redis: Option<&RedisServer>) -> String {
    match redis {
        Some(r) => support::store_toml(backend, &[r], "deny", "2s"),
        None => String::new(),
    }
}

/// The statuses of GETs of `path` from each of `clients` (through the trusted proxy),
/// with `headers` added.
async fn statuses(
    gw: &TestGateway,
    path: &str,
    clients: &[&str],
    headers: &[(&str, &str)],
) -> Vec<u16> {
    let mut out = Vec::new();
    for ip in clients {
        let mut h = vec![("x-forwarded-for", *ip)];
        h.extend_from_slice(headers);
        out.push(get_with(&gw.url(path), &h).await.status.as_u16());
    }
    out
}

const ONE_64: [&str; 6] = [
    "2001:db8:1:2::1",
    "2001:db8:1:2::2",
    "2001:db8:1:2::3",
    "2001:db8:1:2:aaaa::4",
    "2001:db8:1:2:ffff:ffff:ffff:5",
    "2001:db8:1:2::6",
];

/// Six addresses of one /64 are one anonymous caller (3 admitted, then 429), on
/// `by = "caller"` and `by = "ip"` limits, on both stores; another /64 has its own window;
/// the upstream still sees the full address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_callers_of_one_64_share_their_per_ip_windows() {
    for backend in [Backend::Memory, Backend::Redis] {
        let redis = (backend == Backend::Redis).then(RedisServer::start);
        let upstream = Upstream::start().await;
        let gw = TestGateway::start(&config(&upstream, &store(backend, redis.as_ref()), "")).await;

        let got = statuses(&gw, "/search", &ONE_64, &[]).await;
        assert_eq!(
            got,
            [200, 200, 200, 429, 429, 429],
            "{backend:?}: by caller"
        );
        let r = get_with(
            &gw.url("/search"),
            &[("x-forwarded-for", "2001:db8:1:2::7")],
        )
        .await;
        assert_eq!(r.header("x-ratelimit-used"), "3", "{backend:?}");
        // The message names the address that asked, not its network.
        assert!(
            r.text().contains("2001:db8:1:2::7"),
            "{backend:?}: {}",
            r.text()
        );

        // A different /64 (same /48) is another subscriber.
        let got = statuses(&gw, "/search", &["2001:db8:1:3::1"], &[]).await;
        assert_eq!(got, [200], "{backend:?}: another /64");

        // by = "ip" counts the network too, key or no key.
        let key = [("authorization", "Bearer acme-key")];
        let got = statuses(&gw, "/lookup", &ONE_64[..4], &key).await;
        assert_eq!(got, [200, 200, 200, 429], "{backend:?}: by ip, with a key");

        // IPv4 callers and IPv4-mapped IPv6 addresses are one caller per address.
        let got = statuses(
            &gw,
            "/search",
            &[
                "203.0.113.5",
                "::ffff:203.0.113.5",
                "203.0.113.5",
                "203.0.113.5",
            ],
            &[],
        )
        .await;
        assert_eq!(
            got,
            [200, 200, 200, 429],
            "{backend:?}: IPv4-mapped is IPv4"
        );
        let got = statuses(&gw, "/search", &["203.0.113.6"], &[]).await;
        assert_eq!(
            got,
            [200],
            "{backend:?}: the next IPv4 address is another caller"
        );

        // The upstream is told the full address.
        let r = get_with(&gw.url("/echo"), &[("x-forwarded-for", "2001:db8:1:2::9")]).await;
        assert_eq!(r.status, 200);
        let seen = r.json()["headers"].to_string();
        assert!(seen.contains("2001:db8:1:2::9"), "{backend:?}: {seen}");

        if let Some(redis) = &redis {
            let search: Vec<_> = redis
                .keys()
                .into_iter()
                .filter(|k| k.starts_with("tollgate:search:"))
                .collect();
            // One window for the /64, one for the other /64, two for the IPv4 callers.
            assert_eq!(search.len(), 4, "{search:?}");
        }
    }
}

/// `identity.ipv6_prefix_len = 128` keys every address on its own (inside a
/// cluster or a LAN, where hosts share one /64).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_prefix_len_128_every_ipv6_address_is_its_own_caller() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, "", "ipv6_prefix_len = 128")).await;
    let got = statuses(&gw, "/search", &ONE_64, &[]).await;
    assert_eq!(got, [200; 6]);
    let got = statuses(&gw, "/search", &[ONE_64[0]; 3], &[]).await;
    assert_eq!(got, [200, 200, 429], "each address still has its limit");

    // A /48 keys the whole site.
    gw.reload(&config(&upstream, "", "ipv6_prefix_len = 48"))
        .unwrap();
    let got = statuses(
        &gw,
        "/search",
        &[
            "2001:db8:7:1::1",
            "2001:db8:7:2::1",
            "2001:db8:7:ff::1",
            "2001:db8:7:3::1",
        ],
        &[],
    )
    .await;
    assert_eq!(got, [200, 200, 200, 429]);
}

/// `identity.ipv6_prefix_len` must be 1..=128, with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_prefix_len_out_of_range_is_a_clear_error() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    for bad in ["0", "129"] {
        let path = dir.path().join("tollgate.toml");
        std::fs::write(
            &path,
            config(&upstream, "", &format!("ipv6_prefix_len = {bad}")),
        )
        .unwrap();
        let (code, _, err) = support::check(&path);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("identity.ipv6_prefix_len") && err.contains("between 1 and 128"),
            "{err}"
        );
    }
}

/// Guessing keys from rotating addresses of one /64 is one guesser for
/// `identity.failed_auth_limit` (3 a minute here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_authentications_from_one_64_are_counted_together() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, "", "")).await;
    let wrong = [("authorization", "Bearer wrong")];
    let got = statuses(&gw, "/", &ONE_64[..4], &wrong).await;
    assert_eq!(got, [401, 401, 401, 429]);
    let got = statuses(&gw, "/", &["2001:db8:1:3::1"], &wrong).await;
    assert_eq!(got, [401], "another /64 guesses on its own");
    assert_eq!(upstream.hits(), 0);
}

/// The access log's client hash (`log.client_ip = "hash"`) is the network's, so
/// the lines of one subscriber match each other and its by-IP keys; `"ip"` logs the full
/// address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_hash_is_the_networks_and_the_plain_ip_is_the_address() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let clients = [
        "2001:db8:1:2::1",
        "2001:db8:1:2::2",
        "2001:db8:1:3::1",
        "2001:db8:1:2::1",
    ];
    let mut logged = Vec::new();
    for client_ip in ["hash", "ip"] {
        let port = support::redis::free_port();
        let path = dir.path().join(format!("{client_ip}.toml"));
        let text = config(&upstream, "", "").replace(
            "listen = \"127.0.0.1:0\"",
            &format!(
                "listen = \"127.0.0.1:{port}\"\nwatch_config = false\n\n[log]\nformat = \"json\"\nclient_ip = \"{client_ip}\""
            ),
        );
        std::fs::write(&path, text).unwrap();
        let gw = support::Binary::spawn(&path, port, &[]);
        for ip in clients {
            let r = get_with(
                &format!("http://127.0.0.1:{port}/echo"),
                &[("x-forwarded-for", ip)],
            )
            .await;
            assert_eq!(r.status, 200);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let lines = loop {
            let lines: Vec<String> = gw
                .logs()
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| v["target"] == "tollgate::access")
                .map(|v| v["client"].as_str().unwrap_or_default().to_string())
                .collect();
            if lines.len() == clients.len() {
                break lines;
            }
            assert!(Instant::now() < deadline, "{}", gw.logs());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        logged.push(lines);
    }
    let hash = &logged[0];
    assert!(hash.iter().all(|h| h.len() == 32), "{hash:?}");
    assert_eq!(hash[0], hash[1], "one /64, one hash");
    assert_ne!(hash[0], hash[2], "another /64, another hash");
    assert_eq!(hash[0], hash[3]);
    assert_eq!(
        logged[1], clients,
        "log.client_ip = \"ip\" logs the address"
    );
}

/// A kept-alive connection to `addr` from `from` (an IPv4 loopback address) that has been
/// answered one request (200).
async fn kept_alive(addr: std::net::SocketAddr, from: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 2048];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 200"), "from {from}: {head}");
    s
}

/// One request on a new connection from `from`, closed after it: the status line's code
/// (0 when closed without one) and all the bytes answered.
async fn one_request(addr: std::net::SocketAddr, from: &str) -> (u16, String) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    let _ = s
        .write_all(b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        .await;
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut all)).await;
    let text = String::from_utf8_lossy(&all).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

/// One address holding `server.max_connections_per_ip` idle connections gets
/// 503 for the next one (counted in `tollgate_overload_refusals_total`, logged), while
/// another address is served; a closed connection frees a place; a trusted proxy is not
/// capped (it carries many clients).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_every_connection() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (support::redis::free_port(), support::redis::free_port());
    let path = dir.path().join("tollgate.toml");
    let text = config(&upstream, "", "")
        .replace(
            "listen = \"127.0.0.1:0\"",
            &format!(
                "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nwatch_config = false\nmax_connections_per_ip = 3\nmax_connections = 20\nidle_timeout = \"60s\"\n\n[log]\nformat = \"json\""
            ),
        )
        .replace("trusted_proxies = [\"127.0.0.1\"]", "trusted_proxies = [\"127.0.0.3\"]");
    std::fs::write(&path, text).unwrap();
    let gw = support::Binary::spawn(&path, port, &[]);
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // Binary::spawn's probe connection (from 127.0.0.1) counts until the gateway sees
    // it closed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !get_with(&format!("http://127.0.0.1:{admin}/metrics"), &[])
        .await
        .text()
        .contains("tollgate_open_connections 0")
    {
        assert!(
            Instant::now() < deadline,
            "the probe connection never closed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(kept_alive(addr, "127.0.0.1").await);
    }
    let (status, answer) = one_request(addr, "127.0.0.1").await;
    assert_eq!(status, 503, "{answer}");
    assert!(answer.contains("too many connections"), "{answer}");

    // Another address is served meanwhile, up to its own cap.
    let mut others = Vec::new();
    for _ in 0..3 {
        others.push(kept_alive(addr, "127.0.0.2").await);
    }
    assert_eq!(one_request(addr, "127.0.0.2").await.0, 503);
    drop(others);

    // A trusted proxy is not capped per address.
    let mut proxy = Vec::new();
    for _ in 0..5 {
        proxy.push(kept_alive(addr, "127.0.0.3").await);
    }
    drop(proxy);

    // A closed connection gives its place back.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, answer) = one_request(addr, "127.0.0.1").await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{answer}");
        assert!(Instant::now() < deadline, "the place was never given back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let metrics = get_with(&format!("http://127.0.0.1:{admin}/metrics"), &[])
        .await
        .text();
    let refused: f64 = metrics
        .lines()
        .find(|l| {
            l.starts_with("tollgate_overload_refusals_total{limit=\"max_connections_per_ip\"}")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(refused >= 2.0, "{metrics}");
    assert!(
        !metrics.contains("tollgate_overload_refusals_total{limit=\"max_connections\"}")
            || metrics.contains("tollgate_overload_refusals_total{limit=\"max_connections\"} 0"),
        "{metrics}"
    );
    let logs = gw.logs();
    assert!(
        logs.contains("server.max_connections_per_ip"),
        "a log line says why: {logs}"
    );
}

/// `server.max_connections_per_ip` must be at least 1, with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_per_ip_of_zero_is_a_clear_error() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    std::fs::write(
        &path,
        config(&upstream, "", "").replace(
            "listen = \"127.0.0.1:0\"",
            "listen = \"127.0.0.1:0\"\nmax_connections_per_ip = 0",
        ),
    )
    .unwrap();
    let (code, _, err) = support::check(&path);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("server.max_connections_per_ip: must be at least 1"),
        "{err}"
    );
}
