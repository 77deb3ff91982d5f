//! The proxy path against a real upstream: headers, errors, streaming, HTTP/2, timeouts,
//! graceful shutdown.

use crate::support;
use crate::support::{get, get_with, TestGateway, Upstream};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(targets: &[String], extra_server: &str) -> String {
    let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_grace = "5s"
{extra_server}

[[upstreams]]
name = "api"
targets = [{targets}]
connect_timeout = "500ms"
response_timeout = "400ms"

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]

[[routes]]
host = "other.example"
path_prefix = "/only-other"
upstream = "api"
"#,
        targets = targets.join(", ")
    )
}

async fn gateway(upstream: &Upstream) -> TestGateway {
    TestGateway::start(&config(&[upstream.url()], "")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_stripped_and_forwarding_headers_set() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    let r = get_with(
        &gw.url("/echo?q=1"),
        &[
            ("connection", "keep-alive, x-drop-me"),
            ("x-drop-me", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic Zm9vOmJhcg=="),
            // `TE: trailers` is passed on (tests/conformance.rs); any other TE is not.
            ("te", "gzip"),
            ("x-kept", "yes"),
            ("x-forwarded-for", "192.0.2.1"),
        ],
    )
    .await;
    assert_eq!(r.status, 200);
    let echo = r.json();
    let h = &echo["headers"];
    assert_eq!(echo["path"], "/echo?q=1");
    for dropped in ["x-drop-me", "keep-alive", "proxy-authorization", "te"] {
        assert!(h.get(dropped).is_none(), "{dropped} was forwarded: {h}");
    }
    assert_eq!(h["x-kept"], "yes");
    // No trusted proxies here: the client's X-Forwarded-For is kept and the peer appended.
    assert_eq!(h["x-forwarded-for"], "192.0.2.1, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["host"], gw.addr.to_string(), "Host is kept");
    assert_eq!(h["x-forwarded-host"], gw.addr.to_string());
    // Hop-by-hop headers of the response are stripped too.
    assert_eq!(r.header("x-upstream-private"), "");
    assert_eq!(r.header("keep-alive"), "");
    assert_eq!(r.header("x-ratelimit-limit"), "1000");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_route_is_404_json() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    // Only "other.example" has /only-other, but "/" catches everything else; a request for
    // another host still matches "/".
    let r = get_with(&gw.url("/only-other"), &[("host", "other.example:8080")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-limit"),
        "",
        "the host route has no limits"
    );

    let only_host = r#"
[server]
listen = "127.0.0.1:0"
[[upstreams]]
name = "api"
targets = ["UP"]
[[routes]]
host = "api.example"
path_prefix = "/v1/"
upstream = "api"
"#
    .replace("UP", &upstream.url());
    let gw = TestGateway::start(&only_host).await;
    let r = get(&gw.url("/v2/x")).await;
    assert_eq!(r.status, 404);
    assert_eq!(r.header("content-type"), "application/json");
    assert!(r.json()["message"].is_string());
    let r = get_with(&gw.url("/v1/x"), &[("host", "elsewhere.example")]).await;
    assert_eq!(r.status, 404);
    let r = get_with(&gw.url("/v1/x"), &[("host", "API.example")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(upstream.hits(), 2, "one from the first gateway, one here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_upstream_is_502_and_slow_upstream_is_504() {
    let upstream = Upstream::start().await;
    let closed_port = support::redis::free_port();
    let gw = TestGateway::start(&config(&[format!("http://127.0.0.1:{closed_port}")], "")).await;
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.header("content-type"), "application/json");
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("unreachable"));

    for protocol in ["http1", "http2"] {
        let text = config(&[upstream.url()], "").replace(
            "response_timeout = \"400ms\"",
            &format!("response_timeout = \"400ms\"\nprotocol = \"{protocol}\""),
        );
        let gw = TestGateway::start(&text).await;
        let started = Instant::now();
        let r = get(&gw.url("/slow/3000")).await;
        assert_eq!(r.status, 504, "{protocol}");
        assert!(started.elapsed() < Duration::from_millis(2000));
        assert!(r.json()["message"].as_str().unwrap().contains("timed out"));
        // The upstream connection (HTTP/2: the shared one) still serves.
        assert_eq!(get(&gw.url("/")).await.status, 200, "{protocol}");
    }
}

/// HTTP/1 requests of one client connection share one response timer, which each
/// re-arms: every request gets its own `response_timeout` (400 ms here), whatever came
/// before it on the connection (a slow request cut off, a quick one, an idle spell past
/// the last deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_of_a_connection_gets_its_own_response_timeout() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    let mut conn = h1_connection(&gw).await;
    for (path, status, idle_ms) in [
        ("/slow/50", 200, 0),
        ("/slow/3000", 504, 0),
        ("/slow/250", 200, 0),
        ("/slow/3000", 504, 600),
        ("/slow/250", 200, 600),
        ("/slow/3000", 504, 0),
        ("/", 200, 0),
    ] {
        tokio::time::sleep(Duration::from_millis(idle_ms)).await;
        let started = Instant::now();
        let r = send_on(&mut conn, http::Method::GET, path).await;
        let took = started.elapsed();
        assert_eq!(r.status(), status, "{path} after {idle_ms} ms idle");
        r.into_body().collect().await.unwrap();
        if status == 504 {
            assert!(
                took >= Duration::from_millis(400) && took < Duration::from_millis(2000),
                "{path} cut off after {took:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_are_used_round_robin() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let gw = TestGateway::start(&config(&[a.url(), b.url()], "")).await;
    for _ in 0..10 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
    }
    assert_eq!((a.hits(), b.hits()), (5, 5));
}

/// One HTTP/1.1 client connection to the gateway (requests on it go one at a time).
async fn h1_connection(gw: &TestGateway) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    tx
}

/// Send a `method` request for `path` on `tx` once it is ready; the response.
async fn send_on(
    tx: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    method: http::Method,
    path: &str,
) -> http::Response<hyper::body::Incoming> {
    tx.ready().await.unwrap();
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "a")
        .body(Full::new(Bytes::new()))
        .unwrap();
    tx.send_request(req).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    // Sequential requests of every shape that leaves the connection reusable: bodies
    // read to the end, empty bodies, a 304 (no body at all), a HEAD; all on one
    // keep-alive client connection (which keeps its upstream connection between
    // requests, see `a_client_connection_keeps_the_upstream_connection_it_last_used`).
    let mut conn = h1_connection(&gw).await;
    for i in 0..30 {
        let path = match i % 3 {
            0 => "/",
            1 => "/status/204",
            _ => "/status/304",
        };
        let resp = send_on(&mut conn, http::Method::GET, path).await;
        resp.into_body().collect().await.unwrap();
    }
    let head = send_on(&mut conn, http::Method::HEAD, "/").await;
    assert_eq!(head.status(), 200);
    let download = send_on(&mut conn, http::Method::GET, "/download/200000").await;
    assert_eq!(download.status(), 200);
    download.into_body().collect().await.unwrap();
    assert_eq!(upstream.hits(), 32);
    // One upstream connection carried every sequential request of the client connection.
    assert_eq!(upstream.connections(), 1);
    // A response the client abandons mid-body takes its connection with it; the next
    // request opens a new one and works.
    let r = send_on(&mut conn, http::Method::GET, "/download/50000000").await;
    drop(r);
    drop(conn);
    assert_eq!(get(&gw.url("/")).await.status, 200);
    assert_eq!(upstream.connections(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleartext_http2_is_served_on_the_same_listener() {
    let upstream = Upstream::start().await;
    let gw = gateway(&upstream).await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let resp = client
        .request(
            Request::get(gw.url("/echo"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.headers()["x-ratelimit-remaining"], "999");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        echo["headers"]["host"],
        gw.addr.to_string(),
        "HTTP/2 authority becomes Host"
    );
}

/// Send a header line every 100 ms until the gateway closes `s` (or answers: hyper may
/// answer 408 before closing); how long that took. Fails after 4 s.
async fn dribble_until_closed(s: &mut tokio::net::TcpStream) -> Duration {
    let started = Instant::now();
    for _ in 0..40 {
        if s.write_all(b"X-Slow: 1\r\n").await.is_err() {
            return started.elapsed();
        }
        let mut buf = [0u8; 256];
        if let Ok(_closed_or_answered) =
            tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await
        {
            return started.elapsed();
        }
    }
    panic!("connection still open after {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_dribbles_headers_is_cut_off() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(
        &[upstream.url()],
        "header_read_timeout = \"500ms\"",
    ))
    .await;
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let took = dribble_until_closed(&mut s).await;
    assert!(took < Duration::from_secs(2), "cut off after {took:?}");
    assert_eq!(upstream.hits(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_requests() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(
        &config(&[upstream.url()], "")
            .replace("response_timeout = \"400ms\"", "response_timeout = \"10s\""),
    )
    .await;
    let url = gw.url("/slow/800");
    let in_flight = tokio::spawn(async move { get(&url).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let addr = gw.addr;
    gw.gateway.shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // No new connections once shutdown has begun.
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener still accepting"
    );
    let r = in_flight.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.text(), "slow ok");
    tokio::time::timeout(Duration::from_secs(3), gw.gateway.wait())
        .await
        .expect("gateway stopped after draining");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_match_by_method_and_on_segment_boundaries() {
    let upstream = Upstream::start().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "writes"
window = "1h"
quota = {{ anonymous = 1 }}

[[limits]]
name = "orders"
window = "1h"
quota = {{ anonymous = 50 }}

[[limits]]
name = "other"
window = "1h"
quota = {{ anonymous = 100 }}

[[routes]]
path_prefix = "/v1/orders"
path_match = "segments"
methods = ["POST"]
upstream = "api"
limits = ["writes"]

[[routes]]
path_prefix = "/v1/orders"
path_match = "segments"
upstream = "api"
limits = ["orders"]

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["other"]
"#,
        up = upstream.url()
    );
    let gw = TestGateway::start(&toml).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let send = |method: &str, path: &str| {
        let req = http::Request::builder()
            .method(method)
            .uri(gw.url(path))
            .body(http_body_util::Empty::new())
            .unwrap();
        let fut = client.request(req);
        async move {
            let r = fut.await.unwrap();
            (
                r.status().as_u16(),
                r.headers()
                    .get("x-ratelimit-resource")
                    .map(|v| v.to_str().unwrap().to_string())
                    .unwrap_or_default(),
            )
        }
    };
    assert_eq!(send("POST", "/v1/orders").await, (200, "writes".into()));
    assert_eq!(send("POST", "/v1/orders/7").await, (429, "writes".into()));
    assert_eq!(send("GET", "/v1/orders").await, (200, "orders".into()));
    assert_eq!(send("GET", "/v1/orders/7").await, (200, "orders".into()));
    // Not a segment of /v1/orders: the catch-all route.
    assert_eq!(send("GET", "/v1/ordersummary").await, (200, "other".into()));
    assert_eq!(
        send("POST", "/v1/ordersummary").await,
        (200, "other".into())
    );
}

/// A client connection's requests go out on the upstream connection its
/// previous request used (pingora-style reuse), not on whichever the pool hands out:
/// two keep-alive clients taking turns each keep their own upstream connection (a pool
/// alone would hand both the one connection that just came back), and a connection the
/// client closes goes back to the pool for the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_connection_keeps_the_upstream_connection_it_last_used() {
    let upstream = Upstream::start().await;
    // One worker: one pool part, so that only the connection's own choice can keep the
    // two clients apart.
    let gw = TestGateway::start(&config(&[upstream.url()], "workers = 1")).await;
    async fn port(tx: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>) -> String {
        tx.ready().await.unwrap();
        let req = Request::get("/peer")
            .header("host", "a")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = tx.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&body).into_owned()
    }
    let (mut a, mut b) = (h1_connection(&gw).await, h1_connection(&gw).await);
    let (mut seen_a, mut seen_b) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        seen_a.push(port(&mut a).await);
        seen_b.push(port(&mut b).await);
    }
    assert!(seen_a.iter().all(|p| *p == seen_a[0]), "{seen_a:?}");
    assert!(seen_b.iter().all(|p| *p == seen_b[0]), "{seen_b:?}");
    assert_ne!(seen_a[0], seen_b[0], "each client keeps its own");
    assert_eq!(upstream.connections(), 2);
    // A closed client connection gives its upstream connection back to the pool.
    drop(a);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut c = h1_connection(&gw).await;
    let reused = port(&mut c).await;
    assert_eq!(reused, seen_a[0], "the closed client's upstream connection");
    assert_eq!(upstream.connections(), 2, "no new upstream connection");
}

/// `server.header_read_timeout` is the connection's own deadline, not a
/// hyper timer per request: it still cuts off a head dribbled after a first request on a
/// kept-alive connection, and it never closes an HTTP/2 connection that sits between
/// requests (its frames are not a request head).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_read_deadline_covers_every_head_of_a_connection_and_spares_http2() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(
        &[upstream.url()],
        "header_read_timeout = \"500ms\"\nidle_timeout = \"30s\"",
    ))
    .await;
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    // A second head, dribbled: cut off about 500 ms after its first byte.
    s.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let took = dribble_until_closed(&mut s).await;
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(1500),
        "cut off after {took:?}"
    );
    // HTTP/2 (prior knowledge), one connection: between requests for 3
    // header_read_timeouts with only PINGs arriving, then a request on the same
    // connection is served.
    let stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(100))
        .keep_alive_while_idle(true)
        .handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    for pause in [0, 1500] {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let req = Request::get(gw.url("/"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = h2
            .send_request(req)
            .await
            .expect("the HTTP/2 connection is open");
        assert_eq!(resp.status(), 200);
    }
    assert_eq!(upstream.hits(), 3);
}

/// 10,000 host routes and 10,000 prefix routes in one file route as their
/// rules say (each request reaches the limit of its own route, an unknown host falls back
/// to the host-less routes), and a reload to a file with every route changed applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_hosts_and_prefixes_route_by_their_rules_and_reload() {
    use std::fmt::Write;
    let upstream = Upstream::start().await;
    // Routes of `round` send host tN and prefix /pN to limit "l{(N + round) % 3}".
    let toml = |round: usize| {
        let mut t = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\
             [[upstreams]]\nname = \"api\"\ntargets = [\"{}\"]\n",
            upstream.url()
        );
        for name in ["l0", "l1", "l2", "any"] {
            write!(
                t,
                "[[limits]]\nname = \"{name}\"\nwindow = \"1h\"\nquota = {{ anonymous = 1000000 }}\n"
            )
            .unwrap();
        }
        t.push_str("[[routes]]\npath_prefix = \"/\"\nupstream = \"api\"\nlimits = [\"any\"]\n");
        for n in 0..10_000 {
            let l = (n + round) % 3;
            write!(
                t,
                "[[routes]]\nhost = \"t{n}.example.com\"\npath_prefix = \"/\"\nupstream = \"api\"\nlimits = [\"l{l}\"]\n\
                 [[routes]]\npath_prefix = \"/p{n}\"\npath_match = \"segments\"\nupstream = \"api\"\nlimits = [\"l{l}\"]\n"
            )
            .unwrap();
        }
        t
    };
    let gw = TestGateway::start(&toml(0)).await;
    let resource = |host: String, path: String| {
        let url = gw.url(&path);
        async move {
            let r = get_with(&url, &[("host", &host)]).await;
            assert_eq!(r.status, 200, "{host} {path}");
            r.header("x-ratelimit-resource").to_string()
        }
    };
    for round in [0, 1] {
        if round == 1 {
            gw.reload(&toml(1)).expect("the reload applies");
        }
        for n in [0, 1, 4_999, 9_998, 9_999] {
            let want = format!("l{}", (n + round) % 3);
            let host = format!("T{n}.Example.com:8080");
            assert_eq!(resource(host, "/x".into()).await, want, "host t{n}");
            let path = format!("/p{n}/orders");
            assert_eq!(resource("elsewhere".into(), path).await, want, "/p{n}");
        }
        // No route for this host, and /p1x is not a segment of /p1: the catch-all.
        assert_eq!(
            resource("t10000.example.com".into(), "/x".into()).await,
            "any"
        );
        assert_eq!(resource("elsewhere".into(), "/p1x".into()).await, "any");
    }
}
