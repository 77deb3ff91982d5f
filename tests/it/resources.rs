//! What one client holds cannot starve the others. Upstream
//! connections whose request body is still being sent are never handed to another
//! request; descriptors (client connections, upstream sockets, tunnels) share one budget
//! met with 503; tunnels are bounded and closed when idle; a request body that stops
//! arriving ends the request with 408.

use crate::support;
use crate::support::{get, TestGateway};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw HTTP/1.1 upstream that answers like nginx's `return 401`: a `POST` gets 401 as
/// soon as its head has arrived, before a byte of its body is read, on a connection
/// kept alive; its body is then read and thrown away. Any other request gets 200 "ok".
/// Counts the connections it accepted.
struct EarlyAnswerer {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
}

impl EarlyAnswerer {
    async fn start() -> EarlyAnswerer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let count = connections.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(Self::serve(stream));
            }
        });
        EarlyAnswerer { addr, connections }
    }

    async fn serve(mut s: TcpStream) {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 64 * 1024];
        loop {
            // One request head.
            let end = loop {
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                match s.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            };
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end);
            if head.starts_with("POST") {
                let _ = s
                    .write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")
                    .await;
                // Whatever follows is thrown away, as it comes.
                while let Ok(n) = s.read(&mut chunk).await {
                    if n == 0 {
                        return;
                    }
                }
                return;
            }
            if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .is_err()
            {
                return;
            }
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

fn early_config(upstream: &EarlyAnswerer) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "api"
targets = ["http://{}"]

[[routes]]
path_prefix = "/"
upstream = "api"
"#,
        upstream.addr
    )
}

/// The status of the first answer on `s` (0 when it closed without one), within 10 s.
async fn status_of(s: &mut TcpStream) -> u16 {
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("an answer within 10s")
        .unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// GETs from another client, each answered 200 well within `bound` (bounded at 10 s
/// so that a stalled one fails the test instead of hanging it).
async fn unrelated_gets_are_quick(gw: &TestGateway, bound: Duration, what: &str) {
    for i in 0..5 {
        let started = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(10), get(&gw.url("/other")))
            .await
            .unwrap_or_else(|_| panic!("{what}: GET {i} still waiting after 10s"));
        let took = started.elapsed();
        assert_eq!(r.status, 200, "{what}: GET {i}");
        assert!(took < bound, "{what}: GET {i} took {took:?}");
    }
}

/// An upstream that answers before it has read the body (an early
/// 401) while client A's upload is stalled, or trickles: the connection carrying A's
/// body is never handed to another request, so an unrelated GET from client B is
/// answered at once (on another connection), not after A's upload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_upload_never_holds_up_another_clients_request() {
    let upstream = EarlyAnswerer::start().await;
    let gw = TestGateway::start(&early_config(&upstream)).await;
    // Warm the pool: one clean keep-alive connection.
    assert_eq!(get(&gw.url("/warm")).await.status, 200);

    // A: 1 MiB of a 10 MiB upload, then nothing.
    let mut stalled = TcpStream::connect(gw.addr).await.unwrap();
    stalled
        .write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 10485760\r\n\r\n")
        .await
        .unwrap();
    stalled.write_all(&vec![b'x'; 1024 * 1024]).await.unwrap();
    assert_eq!(status_of(&mut stalled).await, 401);
    tokio::time::sleep(Duration::from_millis(100)).await;
    unrelated_gets_are_quick(&gw, Duration::from_millis(500), "stalled upload").await;

    // A again, uploading slowly: 1 KiB every 20 ms for as long as the GETs take.
    let mut slow = TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 10485760\r\n\r\n")
        .await
        .unwrap();
    slow.write_all(&[b'y'; 1024]).await.unwrap();
    assert_eq!(status_of(&mut slow).await, 401);
    let trickle = tokio::spawn(async move {
        let mut sent = 0;
        while slow.write_all(&[b'y'; 1024]).await.is_ok() && sent < 500 {
            sent += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        slow
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    unrelated_gets_are_quick(&gw, Duration::from_millis(500), "slow upload").await;
    trickle.abort();
    // The pool still reuses clean connections: 2 uploads, and the GETs on few
    // connections (not one each).
    assert!(
        upstream.connections() <= 6,
        "{} upstream connections",
        upstream.connections()
    );
    drop(stalled);
}

/// A WebSocket echo server on a free loopback port: its `http://` base URL, and the
/// number of handshakes it accepted.
async fn echo_server() -> (String, Arc<AtomicUsize>) {
    use futures_util::{SinkExt, StreamExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let count = count.clone();
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                while let Some(Ok(msg)) = ws.next().await {
                    if (msg.is_text() || msg.is_binary()) && ws.send(msg).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), accepted)
}

type Ws = tokio_tungstenite::WebSocketStream<TcpStream>;

/// Open a WebSocket through the gateway at `addr`: the socket, or the HTTP status it
/// was refused with.
async fn open_ws(addr: std::net::SocketAddr) -> Result<Ws, u16> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let url = format!("ws://{addr}/ws");
    match tokio::time::timeout(
        Duration::from_secs(10),
        tokio_tungstenite::client_async(url.as_str(), stream),
    )
    .await
    .expect("a WebSocket handshake answered within 10s")
    {
        Ok((ws, response)) => {
            assert_eq!(response.status(), 101);
            Ok(ws)
        }
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            Err(response.status().as_u16())
        }
        Err(e) => panic!("WebSocket handshake failed: {e}"),
    }
}

/// Send `text` on `ws` and expect it echoed within 5 s.
async fn echoes(ws: &mut Ws, text: &str) {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    ws.send(Message::text(text)).await.unwrap();
    let echoed = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .expect("an echo within 5s")
        .expect("the tunnel is open")
        .unwrap();
    assert_eq!(echoed.into_text().unwrap().as_str(), text);
}

/// Whether the tunnel `ws` is closed by the gateway within `within`.
async fn closed_within(ws: &mut Ws, within: Duration) -> bool {
    use futures_util::StreamExt;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Err(_) => return false,
            Ok(None) | Ok(Some(Err(_))) => return true,
            Ok(Some(Ok(m))) if m.is_close() => return true,
            Ok(Some(Ok(_))) => continue,
        }
    }
}

/// The value of an unlabelled metric in Prometheus text.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} not in the metrics:\n{text}"))
}

fn tunnel_config(ws: &str, api: &str, server: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
{server}

[[upstreams]]
name = "ws"
targets = ["{ws}"]

[[upstreams]]
name = "api"
targets = ["{api}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 100000 }}

[[routes]]
path_prefix = "/ws"
upstream = "ws"

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]

[rate_limit_endpoint]
path = "/rate_limit"
"#
    )
}

/// `server.max_tunnels` bounds open tunnels (an upgrade past it gets
/// 503 and never reaches the upstream), tunnels count in `tollgate_open_connections`
/// and `tollgate_open_tunnels`, and a tunnel that moves no byte for
/// `server.tunnel_idle_timeout` is closed while a busy one stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_are_bounded_counted_and_closed_when_idle() {
    let (ws_url, handshakes) = echo_server().await;
    let api = support::Upstream::start().await;
    let gw = TestGateway::start(&tunnel_config(
        &ws_url,
        &api.url(),
        "max_tunnels = 3\ntunnel_idle_timeout = \"2s\"\nidle_timeout = \"30s\"",
    ))
    .await;
    let mut open = Vec::new();
    for i in 0..3 {
        let mut ws = open_ws(gw.addr).await.expect("within max_tunnels");
        echoes(&mut ws, &format!("hello {i}")).await;
        open.push(ws);
    }
    assert_eq!(open_ws(gw.addr).await.err(), Some(503), "past max_tunnels");
    assert_eq!(
        handshakes.load(Ordering::SeqCst),
        3,
        "the 4th never went upstream"
    );
    let text = gw.gateway.metrics().render();
    assert_eq!(metric(&text, "tollgate_open_tunnels"), 3.0, "{text}");
    assert!(metric(&text, "tollgate_open_connections") >= 3.0, "{text}");
    assert!(
        metric(&text, "tollgate_upstream_connections") >= 3.0,
        "{text}"
    );
    assert!(
        text.contains("tollgate_overload_refusals_total{limit=\"max_tunnels\"} 1"),
        "{text}"
    );

    // One tunnel keeps talking (every 500 ms, 3.5 s in all); the two others sit idle.
    let mut busy = open.pop().unwrap();
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(3500) {
        echoes(&mut busy, "still here").await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for (i, ws) in open.iter_mut().enumerate() {
        assert!(
            closed_within(ws, Duration::from_secs(5)).await,
            "idle tunnel {i} closed"
        );
    }
    echoes(&mut busy, "a busy tunnel stays open").await;
    // Once closed, their places are free again.
    let mut again = open_ws(gw.addr).await.expect("a freed place is used again");
    echoes(&mut again, "again").await;
    assert!(closed_within(&mut busy, Duration::from_secs(6)).await);
    assert!(closed_within(&mut again, Duration::from_secs(6)).await);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = gw.gateway.metrics().render();
        if metric(&text, "tollgate_open_tunnels") == 0.0
            && metric(&text, "tollgate_open_connections") == 0.0
        {
            break;
        }
        assert!(Instant::now() < deadline, "tunnels still counted:\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The number `used` of limit `core` on the rate-limit endpoint, once it reaches
/// `want` (charges land in the background), within 5 s.
async fn used_reaches(gw: &TestGateway, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let used = get(&gw.url("/rate_limit")).await.json()["resources"]["core"]["used"]
            .as_u64()
            .unwrap_or(0);
        if used == want {
            return;
        }
        assert!(Instant::now() < deadline, "used {used}, want {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A request body that stops arriving for `server.body_timeout` ends
/// the request with 408 (HTTP/1.1 and HTTP/2), charged like a request whose client went
/// away; a body that arrives slowly but steadily is never cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_arriving_gets_408_and_is_charged() {
    let api = support::Upstream::start().await;
    let gw = TestGateway::start(&tunnel_config(
        "http://127.0.0.1:9",
        &api.url(),
        "body_timeout = \"1s\"",
    ))
    .await;

    // HTTP/1.1: 10 of 100 bytes, then nothing.
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let started = Instant::now();
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 100\r\n\r\n0123456789")
        .await
        .unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut answer))
        .await
        .expect("an answer within 10s")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request body timed out"), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(900));
    used_reaches(&gw, 1).await;

    // HTTP/2: a POST whose body never comes.
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::post(format!("http://{}/upload", gw.addr))
        .body(())
        .unwrap();
    let (response, _send) = client.send_request(req, false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("an answer within 10s")
        .unwrap();
    assert_eq!(response.status(), 408);
    used_reaches(&gw, 2).await;

    // A byte every 300 ms for 3 s: slower than nothing for 1 s never happens.
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\nconnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.write_all(b"x").await.unwrap();
    }
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut answer))
        .await
        .expect("an answer within 10s")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("{\"bytes\":10}"), "{answer}");
    used_reaches(&gw, 3).await;
}

/// The status of a GET `path` sent on a new connection to `port` (0: closed without an
/// answer), within 3 s.
async fn quick_status(port: u16, path: &str) -> u16 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n");
    let _ = s.write_all(request.as_bytes()).await;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
        .await
        .unwrap_or_else(|_| panic!("GET {path} on port {port}: no answer within 3s"))
        .unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Against the binary under `ulimit -n 256` (192 descriptors for
/// traffic, 64 kept): 3 HTTP/2 connections × 100 streams, each a POST whose body never
/// comes and each wanting its own upstream socket, meet the descriptor budget with 503
/// (never "Too many open files"); meanwhile other clients are answered at once (503 or
/// 200, never a hang or a reset) and the admin listener answers `/healthz` and
/// `/metrics`. After `server.body_timeout` the held streams end with 408 and the
/// gateway serves again. WebSocket tunnels under the same limit are bounded by
/// `server.max_tunnels`, counted, and closed when idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_tunnels_meet_one_descriptor_budget_under_a_low_open_file_limit() {
    let api = support::Upstream::start().await;
    let (ws_url, handshakes) = echo_server().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tollgate.toml");
    let (port, admin) = (support::redis::free_port(), support::redis::free_port());
    let text = tunnel_config(
        &ws_url,
        &api.url(),
        // One address (the test's) takes the whole budget here: no share per address.
        "body_timeout = \"4s\"\nmax_tunnels = 8\ntunnel_idle_timeout = \"2s\"\ndescriptor_share_per_ip = 100",
    )
    .replace(
        "listen = \"127.0.0.1:0\"",
        &format!(
            "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nwatch_config = false"
        ),
    );
    std::fs::write(&path, text).unwrap();
    let gw = support::Binary::spawn_with_open_files(&path, port, 256);
    let admin_get = |p: &str| get_within(format!("http://127.0.0.1:{admin}{p}"));
    // The start-up probe's connection is closed first.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !admin_get("/metrics")
        .await
        .text()
        .contains("tollgate_open_connections 0")
    {
        assert!(Instant::now() < deadline, "connections still open");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // 3 HTTP/2 connections × 100 streams whose bodies never come.
    let mut held = Vec::new();
    let mut answers = Vec::new();
    for _ in 0..3 {
        let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
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
                let started = Instant::now();
                match tokio::time::timeout(Duration::from_secs(30), response).await {
                    Ok(Ok(r)) => Ok((r.status().as_u16(), started.elapsed())),
                    Ok(Err(e)) => Err(format!("reset: {e}")),
                    Err(_) => Err("no answer within 30s".to_string()),
                }
            }));
        }
    }
    // The budget is spent: upstream sockets past it were refused with 503 at once.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = admin_get("/metrics").await.text();
        // The row is there from the start, at 0: a refusal makes it at least 1.
        if metric(
            &text,
            "tollgate_overload_refusals_total{limit=\"descriptors\"}",
        ) >= 1.0
            && metric(&text, "tollgate_upstream_connections") >= 150.0
        {
            assert!(
                metric(&text, "tollgate_upstream_connections") <= 192.0,
                "{text}"
            );
            break;
        }
        assert!(Instant::now() < deadline, "budget never spent:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Meanwhile: other clients are answered at once, and the admin listener answers.
    for i in 0..5 {
        let started = Instant::now();
        let status = quick_status(port, "/").await;
        assert!(status == 503 || status == 200, "client {i}: {status}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
    assert_eq!(admin_get("/healthz").await.status, 200);
    assert_eq!(admin_get("/metrics").await.status, 200);

    // After body_timeout every held stream ends: 408 (held) or 503 (refused at once).
    let (mut timed_out, mut refused) = (0, 0);
    for answer in answers {
        match answer.await.unwrap() {
            Ok((408, took)) => {
                timed_out += 1;
                assert!(took >= Duration::from_secs(3), "408 after {took:?}");
            }
            Ok((503, _)) => refused += 1,
            other => panic!("a held stream ended with {other:?}"),
        }
    }
    assert!(
        timed_out >= 100 && refused >= 100,
        "{timed_out} × 408, {refused} × 503"
    );
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    while quick_status(port, "/").await != 200 {
        assert!(
            Instant::now() < deadline,
            "the gateway does not serve again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Tunnels: 8 open, the 9th gets 503 and never reaches the upstream.
    let mut tunnels = Vec::new();
    for i in 0..8 {
        let mut ws = open_ws(gw_addr(port)).await.expect("within max_tunnels");
        echoes(&mut ws, &format!("hello {i}")).await;
        tunnels.push(ws);
    }
    assert_eq!(open_ws(gw_addr(port)).await.err(), Some(503));
    assert_eq!(handshakes.load(Ordering::SeqCst), 8);
    let text = admin_get("/metrics").await.text();
    assert_eq!(metric(&text, "tollgate_open_tunnels"), 8.0, "{text}");
    assert!(metric(&text, "tollgate_open_connections") >= 8.0, "{text}");
    // Idle past tunnel_idle_timeout: closed, and counted no more.
    for (i, ws) in tunnels.iter_mut().enumerate() {
        assert!(
            closed_within(ws, Duration::from_secs(6)).await,
            "idle tunnel {i} closed"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(&admin_get("/metrics").await.text(), "tollgate_open_tunnels") != 0.0 {
        assert!(Instant::now() < deadline, "tunnels still counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(quick_status(port, "/").await, 200);
    let logs = gw.logs();
    assert!(!logs.contains("Too many open files"), "{logs}");
}

fn gw_addr(port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

/// GET `url` from the test client, bounded at 5 s.
async fn get_within(url: String) -> support::client::Reply {
    tokio::time::timeout(Duration::from_secs(5), get(&url))
        .await
        .unwrap_or_else(|_| panic!("GET {url}: no answer within 5s"))
}

mod fairness;
