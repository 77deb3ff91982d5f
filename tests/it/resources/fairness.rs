//! Against the `tollgate` binary: one client must not take the
//! gateway's descriptors from everyone else, through auth callouts it abandons or through
//! stalled uploads.
//!
//! - A callout whose client hung up runs to its end and gives its connection back (or
//!   closes it): the gateway's open descriptors (`/proc/PID/fd`) and the auth service's
//!   open connections return near where they started.
//! - Callouts under way are bounded in all (503) and per client address (429), without
//!   a callout past either.
//! - One client address holds at most `server.descriptor_share_per_ip` of the descriptor
//!   budget: past it its requests get 429, while another address is served.

use crate::support::client::get;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A slow auth service: answers every callout 401 after `delay`, counting callouts and
/// the connections open to it now (from its side).
struct SlowAuth {
    addr: SocketAddr,
    callouts: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
}

/// Counts a connection as open until dropped.
struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl SlowAuth {
    async fn start(delay: Duration) -> SlowAuth {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (callouts, open) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (c, o) = (callouts.clone(), open.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                o.fetch_add(1, Ordering::SeqCst);
                let guard = Open(o.clone());
                let c = c.clone();
                tokio::spawn(async move {
                    let _guard = guard;
                    let svc = service_fn(move |_req: Request<Incoming>| {
                        c.fetch_add(1, Ordering::SeqCst);
                        async move {
                            tokio::time::sleep(delay).await;
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(401)
                                    .body(Full::new(Bytes::from_static(b"who are you")))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        SlowAuth {
            addr,
            callouts,
            open,
        }
    }

    fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

/// A config with an admin listener and `[identity.auth_request]` at `auth` (`auth_extra`
/// in that table, `server_extra` in `[server]`).
fn config(
    port: u16,
    admin: u16,
    upstream: &str,
    auth: Option<&SlowAuth>,
    server_extra: &str,
    auth_extra: &str,
) -> String {
    let default = if auth.is_some() {
        ", default = 1000000"
    } else {
        ""
    };
    let auth = match auth {
        Some(a) => format!(
            "[identity.auth_request]\nurl = \"http://{}/auth\"\ntimeout = \"5s\"\n{auth_extra}\n",
            a.addr
        ),
        None => String::new(),
    };
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
watch_config = false
{server_extra}

[identity]
failed_auth_limit = {{ quota = 0, window = "1m" }}

{auth}
[[upstreams]]
name = "api"
targets = ["{upstream}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 1000000{default} }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#
    )
}

/// Descriptors the process `pid` has open.
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// The value of an unlabelled (or fully labelled) metric in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the metrics:\n{text}"))
}

async fn metrics(admin: u16) -> String {
    tokio::time::timeout(
        Duration::from_secs(5),
        get(&format!("http://127.0.0.1:{admin}/metrics")),
    )
    .await
    .expect("/metrics within 5s")
    .text()
}

/// A connection to the gateway from the loopback address `from` (127.0.0.x).
async fn connect_from(from: [u8; 4], port: u16) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((from, 0))).unwrap();
    socket
        .connect(SocketAddr::from(([127, 0, 0, 1], port)))
        .await
        .unwrap()
}

/// The status of `request` sent on a new connection from `from`, within `within`.
async fn status_from(from: [u8; 4], port: u16, request: String, within: Duration) -> u16 {
    let mut s = connect_from(from, port).await;
    s.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(within, s.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer)
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

fn keyed(key: &str) -> String {
    format!(
        "GET /x HTTP/1.1\r\nhost: a\r\nauthorization: Bearer {key}\r\nconnection: close\r\n\r\n"
    )
}

/// 300 requests with unknown keys hang up after 50 ms while the auth
/// service takes 300 ms. Every callout runs to its end: the auth service's connections
/// are given back to the pool (at most 16 kept idle) or closed, and the gateway's open
/// descriptors return near their start. Before the fix each abandoned callout kept its
/// connection (and descriptor) open for good: 300 more of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_auth_callouts_end_and_give_their_sockets_back() {
    let upstream = crate::support::Upstream::start().await;
    let auth = SlowAuth::start(Duration::from_millis(300)).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let (port, admin) = (
        crate::support::redis::free_port(),
        crate::support::redis::free_port(),
    );
    let text = config(
        port,
        admin,
        &upstream.url(),
        Some(&auth),
        "max_connections_per_ip = 5000",
        "max_concurrent = 1000\nmax_concurrent_per_ip = 1000",
    );
    std::fs::write(&path, text).unwrap();
    let gw = crate::support::Binary::spawn(&path, port, &[]);
    let pid = gw.child.id();
    // The start-up probe's connection is closed first.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !metrics(admin).await.contains("tollgate_open_connections 0") {
        assert!(Instant::now() < deadline, "connections still open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let start = fds(pid);

    let n = 300;
    let mut clients = Vec::new();
    for i in 0..n {
        clients.push(tokio::spawn(async move {
            let mut s = connect_from([127, 0, 0, 1], port).await;
            s.write_all(keyed(&format!("unknown-{i}")).as_bytes())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(s); // hang up before the service answers
        }));
        // Paced a little, so that the gateway reads each request within its 50 ms.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for c in clients {
        c.await.unwrap();
    }
    // The requests the gateway read before their client left made their callouts (on
    // a loaded machine not every one is read within 50 ms): wait until no more come.
    let mut seen = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = auth.callouts.load(Ordering::SeqCst);
        if now == seen {
            break;
        }
        seen = now;
    }
    assert!(seen >= n / 2, "only {seen} callouts of {n}");
    // The callouts end 300 ms later: their connections are kept idle (at most 16) or
    // closed, and the descriptors come back.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (open, now) = (auth.open(), fds(pid));
        if open <= 16 && now <= start + 16 + 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "auth service connections open: {open}; gateway descriptors {start} -> {now}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The sockets to the service are counted (and only those still open).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = metrics(admin).await;
        let counted = metric(&text, "tollgate_auth_request_connections") as usize;
        let under_way = metric(&text, "tollgate_auth_request_callouts");
        if counted == auth.open() && under_way == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "counted {counted}, open {}, callouts under way {under_way}",
            auth.open()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The gateway still serves: an unknown key gets the service's 401.
    let status = status_from(
        [127, 0, 0, 1],
        port,
        keyed("unknown-after"),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status, 401);
    let logs = gw.logs();
    assert!(!logs.contains("Too many open files"), "{logs}");
}

/// Callouts under way are bounded per client address (past it: 429)
/// and in all (past it: 503), and no callout is made past either. The service takes
/// 1 s, so every callout is under way at once: 127.0.0.1 sends 8 new keys with
/// `max_concurrent_per_ip = 4` (4 callouts, 4 × 429), then 127.0.0.2 sends 4 with
/// `max_concurrent = 6` (2 callouts, 2 × 503). Before the fix all 12 made a callout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callouts_are_bounded_in_all_and_per_address() {
    let upstream = crate::support::Upstream::start().await;
    let auth = SlowAuth::start(Duration::from_secs(1)).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let (port, admin) = (
        crate::support::redis::free_port(),
        crate::support::redis::free_port(),
    );
    let text = config(
        port,
        admin,
        &upstream.url(),
        Some(&auth),
        "",
        "max_concurrent = 6\nmax_concurrent_per_ip = 4",
    );
    std::fs::write(&path, text).unwrap();
    let _gw = crate::support::Binary::spawn(&path, port, &[]);

    let ask = |from: [u8; 4], key: String| {
        tokio::spawn(async move {
            let started = Instant::now();
            let status = status_from(from, port, keyed(&key), Duration::from_secs(5)).await;
            (status, started.elapsed())
        })
    };
    let mut first = Vec::new();
    for i in 0..8 {
        first.push(ask([127, 0, 0, 1], format!("one-{i}")));
        // Each in turn, so that the first 4 are under way when the next come.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut second = Vec::new();
    for i in 0..4 {
        second.push(ask([127, 0, 0, 2], format!("two-{i}")));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let statuses = |answers: Vec<(u16, Duration)>| {
        let mut s: Vec<u16> = answers.iter().map(|a| a.0).collect();
        s.sort();
        for (status, took) in &answers {
            if *status != 401 {
                assert!(
                    *took < Duration::from_millis(700),
                    "{status} after {took:?}: not at once"
                );
            }
        }
        s
    };
    let mut one = Vec::new();
    for a in first {
        one.push(a.await.unwrap());
    }
    let mut two = Vec::new();
    for a in second {
        two.push(a.await.unwrap());
    }
    assert_eq!(statuses(one), [401, 401, 401, 401, 429, 429, 429, 429]);
    assert_eq!(statuses(two), [401, 401, 503, 503]);
    assert_eq!(
        auth.callouts.load(Ordering::SeqCst),
        6,
        "no callout past a bound"
    );
    let text = metrics(admin).await;
    assert_eq!(
        metric(
            &text,
            "tollgate_auth_requests_total{result=\"max_concurrent_per_ip\"}"
        ),
        4.0,
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "tollgate_auth_requests_total{result=\"max_concurrent\"}"
        ),
        2.0,
        "{text}"
    );
    // Once they ended, the same address makes callouts again.
    let status = status_from(
        [127, 0, 0, 1],
        port,
        keyed("one-later"),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status, 401);
}

/// Under `ulimit -n 256` (192 descriptors for traffic, the default
/// share of 50 %: 96 per address): 127.0.0.1 opens 2 HTTP/2 connections × 100 streams,
/// each a POST whose body never comes. It holds its share (its connections and 94
/// streams, each with an upstream socket) and its streams past it get 429 at once; the
/// descriptor budget is never spent, so 127.0.0.2 is served 200 meanwhile. Before the
/// fix the first address's streams took every descriptor and the other got 503 until
/// `server.body_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_at_most_its_share_of_the_descriptor_budget() {
    let upstream = crate::support::Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let (port, admin) = (
        crate::support::redis::free_port(),
        crate::support::redis::free_port(),
    );
    let text = config(port, admin, &upstream.url(), None, "", "");
    std::fs::write(&path, text).unwrap();
    let gw = crate::support::Binary::spawn_with_open_files(&path, port, 256);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !metrics(admin).await.contains("tollgate_open_connections 0") {
        assert!(Instant::now() < deadline, "connections still open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut held = Vec::new();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let tcp = connect_from([127, 0, 0, 1], port).await;
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let mut client = client.ready().await.unwrap();
        // Let the server's SETTINGS (100 streams) arrive.
        tokio::time::sleep(Duration::from_millis(200)).await;
        for _ in 0..100 {
            client = client.ready().await.unwrap();
            let req = http::Request::post(format!("http://127.0.0.1:{port}/upload"))
                .body(())
                .unwrap();
            let (response, send) = client.send_request(req, false).unwrap();
            held.push(send);
            answers.push(tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(20), response).await {
                    Ok(Ok(r)) => Some((
                        r.status().as_u16(),
                        r.headers()
                            .get("retry-after")
                            .map(|v| v.to_str().unwrap().to_string()),
                    )),
                    _ => None,
                }
            }));
        }
    }
    // The first address holds its share: its streams past it were refused with 429.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics(admin).await;
        let refused = metric(
            &text,
            "tollgate_overload_refusals_total{limit=\"descriptor_share_per_ip\"}",
        );
        let upstream_sockets = metric(&text, "tollgate_upstream_connections");
        if refused >= 100.0 && upstream_sockets >= 80.0 {
            assert!(upstream_sockets <= 96.0, "{text}");
            assert_eq!(
                metric(
                    &text,
                    "tollgate_overload_refusals_total{limit=\"descriptors\"}"
                ),
                0.0,
                "the budget is never spent:\n{text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "share never reached:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Meanwhile another address is served at once.
    for i in 0..5 {
        let started = Instant::now();
        let status = status_from(
            [127, 0, 0, 2],
            port,
            "GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n".to_string(),
            Duration::from_secs(3),
        )
        .await;
        assert_eq!(status, 200, "another address, request {i}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
    // A new connection of the first address is refused like one past
    // `max_connections_per_ip` (503, closed): it holds its share.
    let status = status_from(
        [127, 0, 0, 1],
        port,
        "GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n".to_string(),
        Duration::from_secs(3),
    )
    .await;
    assert_eq!(status, 503, "a new connection of the first address");
    // Its streams past its share were answered 429 with `Retry-After: 1`.
    let deadline = Instant::now() + Duration::from_secs(10);
    while answers.iter().filter(|a| a.is_finished()).count() < 100 {
        assert!(
            Instant::now() < deadline,
            "streams past the share not answered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut refused = 0;
    for answer in answers {
        if !answer.is_finished() {
            answer.abort();
            continue;
        }
        let (status, retry_after) = answer.await.unwrap().expect("an answer");
        assert_eq!((status, retry_after.as_deref()), (429, Some("1")));
        refused += 1;
    }
    assert!(refused >= 100, "{refused} × 429");
    drop(held);
    let logs = gw.logs();
    assert!(!logs.contains("Too many open files"), "{logs}");
}
