//! Abusive requests against the real gateway and a real upstream: request smuggling
//! shapes are refused with 400 before anything reaches the upstream, and the gateway
//! keeps serving other callers.

use crate::support;
use crate::support::{get, h2_client, TestGateway, Upstream};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(upstream: &Upstream) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

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
"#,
        up = upstream.url()
    )
}

/// `[store]` for the memory store (none) or one Redis shard.
fn store_section(redis: Option<&support::RedisServer>) -> String {
    match redis {
        None => String::new(),
        Some(r) => format!(
            "[store]\nbackend = \"redis\"\n[[store.shards]]\nprimary = \"{}\"\n",
            r.url()
        ),
    }
}

/// Send raw bytes on a new connection; the status line's code of the first answer (0
/// when the connection closed without one).
async fn raw(gw: &TestGateway, bytes: &[u8]) -> u16 {
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer or a close")
        .unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]);
    head.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_shapes_are_refused_with_400_and_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream)).await;
    let cases: [(&str, &[u8]); 3] = [
        (
            "two different Content-Lengths",
            b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 4\r\ncontent-length: 5\r\n\r\nabcde",
        ),
        (
            "Transfer-Encoding that does not end in chunked",
            b"POST /upload HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked, identity\r\n\r\n0\r\n\r\n",
        ),
        (
            "a space before the colon",
            b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length : 4\r\n\r\nabcd",
        ),
    ];
    let mut wrong = Vec::new();
    for (what, bytes) in cases {
        let status = raw(&gw, bytes).await;
        if status != 400 {
            wrong.push(format!("{what}: {status}"));
        }
    }
    assert!(wrong.is_empty(), "not refused with 400: {wrong:?}");
    assert_eq!(upstream.hits(), 0, "nothing reached the upstream");
    // The gateway keeps serving.
    assert_eq!(get(&gw.url("/")).await.status, 200);
}

/// Content-Length together with Transfer-Encoding: hyper lets chunked framing win (RFC
/// 9112 section 6.3) and drops the Content-Length, so the gateway and the upstream agree
/// on where the request ends: the upstream gets one chunked request and no
/// Content-Length, and the client's connection is closed after the answer, so nothing
/// smuggled after it can be read as a second request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_with_transfer_encoding_is_forwarded_chunked_and_the_connection_closed() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream)).await;
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    // After the chunked body: a smuggled second request.
    s.write_all(
        b"POST /echo HTTP/1.1\r\nhost: a\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: a\r\n\r\n",
    )
    .await
    .unwrap();
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut all))
        .await
        .expect("the connection is closed after the answer")
        .unwrap();
    let text = String::from_utf8_lossy(&all).to_lowercase();
    assert_eq!(
        text.matches("http/1.1 ").count(),
        1,
        "one answer only: {text}"
    );
    assert!(text.contains("connection: close"), "{text}");
    let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
    let echoed: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(echoed["headers"]["transfer-encoding"], "chunked");
    assert!(echoed["headers"]["content-length"].is_null(), "{echoed}");
    assert_eq!(
        upstream.hits(),
        1,
        "the smuggled request never reached the upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_larger_than_the_route_allows_gets_413_and_is_not_charged() {
    let upstream = Upstream::start().await;
    let text = config(&upstream).replace(
        "limits = [\"core\"]",
        "limits = [\"core\"]\nmax_request_bytes = 1024",
    );
    let gw = TestGateway::start(&text).await;
    let mut big = format!(
        "POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: {}\r\n\r\n",
        4096
    )
    .into_bytes();
    big.extend(std::iter::repeat_n(b'x', 4096));
    assert_eq!(raw(&gw, &big).await, 413);
    assert_eq!(upstream.hits(), 0, "not forwarded");
    // Without a length (chunked), the body is counted while it streams.
    let mut chunked =
        b"POST /upload HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..8 {
        chunked.extend_from_slice(b"200\r\n");
        chunked.extend(std::iter::repeat_n(b'y', 512));
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(raw(&gw, &chunked).await, 413, "4 KiB streamed past 1 KiB");
    let small = b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\n\r\nabc";
    assert_eq!(raw(&gw, small).await, 200);
    // The 413 was not charged: this is the second request counted.
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 2);
}

/// Send one raw request; (status, whole answer) of the first answer.
async fn raw_answer(gw: &TestGateway, bytes: &[u8]) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut all)).await;
    let text = String::from_utf8_lossy(&all).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_spellings_and_host_spellings_cannot_dodge_a_routes_limits() {
    let upstream = Upstream::start().await;
    let text = config(&upstream).replace(
        "[[routes]]\npath_prefix = \"/\"",
        "[[routes]]\npath_prefix = \"/echo\"\nupstream = \"api\"\nlimits = [\"search\"]\n\n[[routes]]\nhost = \"api.example.com\"\npath_prefix = \"/\"\nupstream = \"api\"\nlimits = [\"search\"]\n\n[[routes]]\npath_prefix = \"/\"",
    ) + "\n[[limits]]\nname = \"search\"\nwindow = \"1h\"\nquota = { anonymous = 100 }\n";
    let gw = TestGateway::start(&text).await;
    for spelling in [
        "/echo",
        "//echo",
        "/./echo",
        "/x/../echo",
        "/%65cho",
        "/%2e/echo",
        "/echo/.",
    ] {
        let req = format!("GET {spelling}?q=1 HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n");
        let (status, answer) = raw_answer(&gw, req.as_bytes()).await;
        assert_eq!(status, 200, "{spelling}: {answer}");
        let lower = answer.to_lowercase();
        assert!(
            lower.contains("x-ratelimit-resource: search"),
            "{spelling} is limited by the /echo route: {answer}"
        );
        assert!(
            answer.contains("\"path\":\"/echo?q=1\"") || answer.contains("\"path\":\"/echo/?q=1\""),
            "{spelling}: the upstream gets the normal path: {answer}"
        );
    }
    for bad in ["/%2Fecho", "/echo%5c..", "/ech%o"] {
        let req = format!("GET {bad} HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n");
        let (status, answer) = raw_answer(&gw, req.as_bytes()).await;
        assert_eq!(status, 400, "{bad}: {answer}");
        assert!(answer.contains("\"message\""), "a JSON body: {answer}");
    }
    // A trailing dot is the same host; a bad port is refused, not routed host-less.
    let (status, answer) = raw_answer(
        &gw,
        b"GET /x HTTP/1.1\r\nhost: API.example.com.\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        answer
            .to_lowercase()
            .contains("x-ratelimit-resource: search"),
        "{answer}"
    );
    let (status, _) = raw_answer(
        &gw,
        b"GET /x HTTP/1.1\r\nhost: api.example.com:abc\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_is_charged_counted_and_logged() {
    for redis in [None, Some(support::RedisServer::start())] {
        let upstream = Upstream::start().await;
        let store = store_section(redis.as_ref());
        let text = config(&upstream).replace("[[upstreams]]", &format!("{store}\n[[upstreams]]"));
        let gw = TestGateway::start(&text).await;
        // 20 requests on one HTTP/2 connection, each reset by the client (the task is
        // dropped) while the upstream is still working on it.
        let client = h2_client();
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let fut = client.get(gw.url("/slow/400").parse().unwrap());
            tasks.push(tokio::spawn(fut));
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        for t in &tasks {
            t.abort();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        // Every forwarded request was charged: this one is the 21st.
        let r = get(&gw.url("/")).await;
        assert_eq!(r.num("x-ratelimit-used"), 21, "redis: {}", redis.is_some());
        let metrics = gw.gateway.metrics().render();
        let aborted: u64 = metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(
                    "tollgate_requests_total{route=\"/\",status=\"499\",decision=\"allowed\"}",
                )?
                .trim()
                .parse()
                .ok()
            })
            .unwrap_or(0);
        assert_eq!(aborted, 20, "counted as 499: {metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_burst_cannot_overshoot_the_quota_on_one_gateway() {
    for redis in [None, Some(support::RedisServer::start())] {
        let upstream = Upstream::start().await;
        let store = store_section(redis.as_ref());
        let text = config(&upstream)
            .replace("[[upstreams]]", &format!("{store}\n[[upstreams]]"))
            .replace("anonymous = 1000", "anonymous = 30");
        let gw = TestGateway::start(&text).await;
        // 150 requests at once on HTTP/2, each in flight for 300 ms: checked before any
        // is charged (charge = "after_response").
        let client = h2_client();
        let tasks: Vec<_> = (0..150)
            .map(|_| tokio::spawn(client.get(gw.url("/slow/300").parse().unwrap())))
            .collect();
        let mut ok = 0;
        for t in tasks {
            let r = t.await.unwrap().unwrap();
            ok += u32::from(r.status() == 200);
            if r.status() == 429 {
                // A refusal that requests in flight caused never shows a full Remaining.
                assert_eq!(r.headers()["x-ratelimit-remaining"], "0");
            }
        }
        assert_eq!(
            ok,
            30,
            "redis: {}: exactly the quota admitted",
            redis.is_some()
        );
    }
}

/// The limit `core` of [`config`] replaced by `limit` (its lines after `name`).
fn with_limit(text: &str, limit: &str) -> String {
    let old = "window = \"1h\"\nquota = { anonymous = 1000 }";
    assert!(text.contains(old));
    text.replace(old, limit)
}

/// `on_limit = "delay"` holds at most `server.max_delayed` requests on
/// the gateway, whatever subjects they have (a `by = "header:NAME"` limit lets the client
/// choose a new subject per request, so `max_waiting` alone does not bound them); the
/// others get 429 at once, and the metrics show both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_requests_are_bounded_gateway_wide() {
    let upstream = Upstream::start().await;
    // One unit per tenant per 20 s: a tenant's second request would wait about 20 s.
    let limit = "algorithm = \"gcra\"\nwindow = \"20s\"\nquota = { anonymous = 1 }\nby = \"header:x-tenant\"\non_limit = \"delay\"\nmax_delay = \"1m\"";
    let text = with_limit(&with_server(&upstream, "max_delayed = 3"), limit);
    let gw = TestGateway::start(&text).await;
    let tenants: Vec<String> = (0..6).map(|i| format!("t{i}")).collect();
    for t in &tenants {
        let r = support::get_with(&gw.url("/x"), &[("x-tenant", t)]).await;
        assert_eq!(r.status, 200, "{t}");
    }
    let started = std::time::Instant::now();
    let tasks: Vec<_> = tenants
        .iter()
        .map(|t| {
            let (url, t) = (gw.url("/x"), t.clone());
            tokio::spawn(async move { support::get_with(&url, &[("x-tenant", &t)]).await })
        })
        .collect();
    // Three are held; the other three get 429 at once (not after max_delay).
    while tasks.iter().filter(|t| t.is_finished()).count() < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the requests past max_delayed are answered at once"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (done, held): (Vec<_>, Vec<_>) = tasks.into_iter().partition(|t| t.is_finished());
    assert_eq!(
        (done.len(), held.len()),
        (3, 3),
        "exactly max_delayed are held"
    );
    for t in done {
        let r = t.await.unwrap();
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-resource"), "core");
        assert_eq!(r.json()["resource"], "core");
    }
    let metrics = gw.gateway.metrics().render();
    assert!(
        metrics.contains("\ntollgate_delayed_requests 3\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tollgate_delays_refused_total{reason=\"max_delayed\"} 3\n"),
        "{metrics}"
    );
    for t in held {
        t.abort();
    }
}

/// A `by = "header:NAME"` limit keys by whatever the client sends, so a
/// client picks whose window it spends. With `trusted_only = true` the header counts
/// only from a trusted proxy; from any other peer the limit keys by the client IP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_limit_with_trusted_only_believes_only_trusted_proxies() {
    let upstream = Upstream::start().await;
    let by_header = "window = \"1h\"\nquota = { anonymous = 2 }\nby = \"header:x-tenant\"";
    let used =
        |r: &support::client::Reply| (r.status.as_u16(), r.header("x-ratelimit-used").to_string());
    let send = |gw: &TestGateway, tenant: &'static str| {
        let url = gw.url("/x");
        async move { support::get_with(&url, &[("x-tenant", tenant)]).await }
    };

    // Without trusted_only, every tenant value is a window of its own.
    let gw = TestGateway::start(&with_limit(&config(&upstream), by_header)).await;
    for t in ["a", "b", "c"] {
        assert_eq!(used(&send(&gw, t).await), (200, "1".into()), "{t}");
    }

    // trusted_only from an untrusted peer: one window, the client IP's.
    let trusted_only = format!("{by_header}\ntrusted_only = true");
    let gw = TestGateway::start(&with_limit(&config(&upstream), &trusted_only)).await;
    assert_eq!(used(&send(&gw, "a").await), (200, "1".into()));
    assert_eq!(used(&send(&gw, "b").await), (200, "2".into()));
    let r = send(&gw, "c").await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(
        r.json()["message"],
        "API rate limit exceeded for 127.0.0.1."
    );

    // trusted_only from a trusted proxy: the header is believed.
    let trusted = format!(
        "{}\n[identity]\ntrusted_proxies = [\"127.0.0.1/32\"]\n",
        with_limit(&config(&upstream), &trusted_only)
    );
    let gw = TestGateway::start(&trusted).await;
    assert_eq!(used(&send(&gw, "a").await), (200, "1".into()));
    assert_eq!(used(&send(&gw, "b").await), (200, "1".into()));
    assert_eq!(used(&send(&gw, "a").await), (200, "2".into()));
    assert_eq!(send(&gw, "a").await.status, 429);
    assert_eq!(used(&send(&gw, "b").await), (200, "2".into()));
}

fn with_server(upstream: &Upstream, server: &str) -> String {
    config(upstream).replace(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"127.0.0.1:0\"\n{server}"),
    )
}

/// A keep-alive connection that has been answered one request (200).
async fn kept_alive(gw: &TestGateway) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 2048];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    s
}

/// Whether the server closes `s` within `within` (reads EOF or a reset).
async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue, // e.g. the HTTP/2 server preface
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_silent_connections_are_closed() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&with_server(&upstream, "idle_timeout = \"1s\"")).await;
    // Silent from the start, only the HTTP/2 preface, and a keep-alive connection
    // after one request.
    let mut silent = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let mut preface = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    preface
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .unwrap();
    let mut kept = kept_alive(&gw).await;
    // Meanwhile the gateway serves others.
    assert_eq!(get(&gw.url("/")).await.status, 200);
    for (what, s) in [
        ("silent", &mut silent),
        ("preface only", &mut preface),
        ("keep-alive", &mut kept),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(4)).await,
            "{what} connection closed"
        );
    }
    assert_eq!(get(&gw.url("/")).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_get_503_and_others_are_served_again() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&with_server(
        &upstream,
        "max_connections = 3\nidle_timeout = \"30s\"",
    ))
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(kept_alive(&gw).await);
    }
    let (status, answer) = raw_answer(&gw, b"GET / HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert_eq!(status, 503, "{answer}");
    assert!(answer.contains("too many connections"));
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, _) = raw_answer(
        &gw,
        b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200, "a freed slot is used again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_headers_get_431() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&with_server(&upstream, "max_header_bytes = 16384")).await;
    let big = format!(
        "GET / HTTP/1.1\r\nhost: a\r\nx-big: {}\r\n\r\n",
        "x".repeat(40_000)
    );
    assert_eq!(raw(&gw, big.as_bytes()).await, 431);
    let fits = format!(
        "GET / HTTP/1.1\r\nhost: a\r\nx-big: {}\r\nconnection: close\r\n\r\n",
        "x".repeat(8_000)
    );
    assert_eq!(raw(&gw, fits.as_bytes()).await, 200);
    assert_eq!(upstream.hits(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_are_bounded_per_connection() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&with_server(&upstream, "http2_max_streams = 7")).await;
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (_client, mut conn) = h2::client::handshake(tcp).await.unwrap();
    // Drive the connection long enough to read the server's SETTINGS.
    let _ = tokio::time::timeout(Duration::from_millis(300), &mut conn).await;
    assert_eq!(conn.max_concurrent_send_streams(), 7);
}

/// Rapid reset (CVE-2023-44487): one connection opens and resets thousands of streams.
/// The limit holds (no more requests reach the upstream than the quota allows) and the
/// gateway keeps answering other connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_cannot_get_past_the_limit_or_stall_the_gateway() {
    let upstream = Upstream::start().await;
    let gw =
        TestGateway::start(&config(&upstream).replace("anonymous = 1000", "anonymous = 50")).await;
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(conn);
    let started = std::time::Instant::now();
    let mut sent = 0;
    for _ in 0..5_000 {
        let Ok(mut c) = client.clone().ready().await else {
            break;
        };
        let req = http::Request::get(format!("http://{}/slow/200", gw.addr))
            .body(())
            .unwrap();
        let Ok((response, _)) = c.send_request(req, true) else {
            break;
        };
        drop(response); // RST_STREAM(CANCEL)
        sent += 1;
        if started.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    assert!(sent > 0);
    // Another connection is answered at once, meanwhile.
    let t = std::time::Instant::now();
    let r = get(&gw.url("/")).await;
    assert!(r.status == 200 || r.status == 429, "{}", r.status);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "answered in {:?}",
        t.elapsed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        upstream.hits() <= 51,
        "{} reset streams, {} reached the upstream (quota 50)",
        sent,
        upstream.hits()
    );
    driver.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_credentials_get_400_and_are_never_forwarded() {
    let upstream = Upstream::start().await;
    let text = config(&upstream).replace("anonymous = 1000", "anonymous = 1000, default = 5")
        + &format!(
            "\n[[identity.clients]]\nid = \"acme\"\nkey_sha256 = \"{}\"\n",
            support::sha256_hex("acme-key")
        );
    let gw = TestGateway::start(&text).await;
    let ask = |auth: &[&str]| {
        let mut req = String::from("GET /echo HTTP/1.1\r\nhost: a\r\nconnection: close\r\n");
        for a in auth {
            req.push_str(&format!("authorization: {a}\r\n"));
        }
        req.push_str("\r\n");
        req
    };
    for (what, auth) in [
        (
            "two Authorization headers",
            vec!["Basic eDp5", "Bearer acme-key"],
        ),
        (
            "two credentials in one value",
            vec!["Basic eDp5, Bearer acme-key"],
        ),
        (
            "a key with something after it",
            vec!["Bearer acme-key other"],
        ),
    ] {
        let (status, answer) = raw_answer(&gw, ask(&auth).as_bytes()).await;
        assert_eq!(status, 400, "{what}: {answer}");
        assert!(answer.contains("malformed credentials"), "{what}: {answer}");
    }
    assert_eq!(upstream.hits(), 0, "none of them was forwarded");
    // A tab after the scheme is still one credential: identified, not anonymous.
    let (status, answer) = raw_answer(&gw, ask(&["Bearer\tacme-key"]).as_bytes()).await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer.to_lowercase().contains("x-ratelimit-limit: 5"),
        "the client's quota: {answer}"
    );
    // Another scheme is not ours: anonymous, passed on as it came.
    let (status, answer) = raw_answer(&gw, ask(&["Basic eDp5"]).as_bytes()).await;
    assert_eq!(status, 200);
    assert!(
        answer.to_lowercase().contains("x-ratelimit-limit: 1000"),
        "{answer}"
    );
    assert!(
        answer.contains("\"authorization\":\"Basic eDp5\""),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_request_body_is_the_clients_fault_400_not_502() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream)).await;
    // Chunked framing with a chunk size that is not hex.
    let bad = b"POST /upload HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\nxx\r\n0\r\n\r\n";
    assert_eq!(raw(&gw, bad).await, 400);
    assert_eq!(get(&gw.url("/")).await.status, 200);
}

/// With an HTTP/2 upstream, a request body that fails while it is sent is still the
/// client's: past `max_request_bytes` 413, malformed 400 (never 502).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_an_http2_upstream_a_failing_request_body_is_413_or_400_not_502() {
    let upstream = Upstream::start().await;
    let text = config(&upstream)
        .replace(
            "limits = [\"core\"]",
            "limits = [\"core\"]\nmax_request_bytes = 1024",
        )
        .replace("targets = [", "protocol = \"http2\"\ntargets = [");
    let gw = TestGateway::start(&text).await;
    let mut chunked =
        b"POST /upload HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..8 {
        chunked.extend_from_slice(b"200\r\n");
        chunked.extend(std::iter::repeat_n(b'y', 512));
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    assert_eq!(raw(&gw, &chunked).await, 413, "4 KiB streamed past 1 KiB");
    let bad = b"POST /upload HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\nxx\r\n0\r\n\r\n";
    assert_eq!(raw(&gw, bad).await, 400);
    let small = b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\n\r\nabc";
    assert_eq!(raw(&gw, small).await, 200);
    assert_eq!(get(&gw.url("/")).await.status, 200);
}

/// Read `s` to its end (EOF or a reset) within `within`; the bytes read.
async fn read_to_close(s: &mut tokio::net::TcpStream, within: Duration) -> usize {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => {
                panic!("the connection was not closed within {within:?} ({total} bytes read)")
            }
            Ok(Ok(0)) | Ok(Err(_)) => return total,
            Ok(Ok(n)) => total += n,
        }
    }
}

/// A client that stops reading a response is cut off after
/// `server.send_timeout`, over HTTP/1.1 and HTTP/2; one that reads slowly is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_is_closed_after_send_timeout() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&with_server(&upstream, "send_timeout = \"1s\"")).await;
    const BIG: usize = 64 << 20;

    // HTTP/1.1: ask for 64 MB, read nothing for 3 s (the socket buffers fill), then read
    // what is left: the response was cut short and the connection closed.
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(format!("GET /download/{BIG} HTTP/1.1\r\nhost: a\r\n\r\n").as_bytes())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let got = read_to_close(&mut s, Duration::from_secs(10)).await;
    assert!(got < BIG / 2, "{got} bytes of {BIG}: not cut off");

    // HTTP/2: a client that never gives back flow-control window (never reads).
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let driver = tokio::spawn(conn);
    let mut c = client.ready().await.unwrap();
    let req = http::Request::get(format!("http://{}/download/{BIG}", gw.addr))
        .body(())
        .unwrap();
    let (response, _) = c.send_request(req, true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let ended = tokio::time::timeout(Duration::from_secs(10), driver)
        .await
        .expect("the HTTP/2 connection was not closed within 10s");
    drop(ended);
    let mut body = response.into_body();
    let mut got = 0;
    let outcome = loop {
        match body.data().await {
            Some(Ok(chunk)) => got += chunk.len(),
            Some(Err(e)) => break Err(e),
            None => break Ok(()),
        }
    };
    assert!(
        outcome.is_err() && got < BIG,
        "the stream should end cut off ({got} bytes, {outcome:?})"
    );

    // A slow but steady reader (1 MB every 100 ms, 3 s in all) gets everything.
    const STEADY: usize = 30 << 20;
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        format!("GET /download/{STEADY} HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut total = 0;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let mut chunk = 0;
        while chunk < (1 << 20) {
            match s.read(&mut buf[chunk..]).await {
                Ok(0) | Err(_) => break,
                Ok(n) => chunk += n,
            }
        }
        total += chunk;
        if chunk < (1 << 20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        total > STEADY,
        "a steady reader got {total} of {STEADY} bytes"
    );

    // The gateway keeps serving.
    assert_eq!(get(&gw.url("/")).await.status, 200);
}

/// A GET (or DELETE, OPTIONS) with a chunked body reaches the upstream
/// with that body, never silently without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_on_get_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream)).await;
    for method in ["GET", "DELETE", "OPTIONS", "POST"] {
        let (status, text) = raw_answer(
            &gw,
            format!(
                "{method} /upload HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        assert_eq!(status, 200, "{method}: {text}");
        assert!(text.contains("{\"bytes\":11}"), "{method}: {text}");
    }
    // Without a body, a GET still goes out without one (no chunked framing added).
    let r = get(&gw.url("/echo")).await;
    assert!(
        r.json()["headers"].get("transfer-encoding").is_none(),
        "{}",
        r.text()
    );
}

/// A config file in `dir` for the binary: listening on a free port, the admin listener
/// on another, no file watcher, then `extra` TOML. (Its path and the two ports.)
fn binary_config(
    upstream: &Upstream,
    dir: &std::path::Path,
    extra: &str,
) -> (std::path::PathBuf, u16, u16) {
    let path = dir.join("tollgate.toml");
    let (port, admin) = (support::redis::free_port(), support::redis::free_port());
    let text = config(upstream).replace(
        "listen = \"127.0.0.1:0\"",
        &format!(
            "listen = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nwatch_config = false\n{extra}"
        ),
    );
    std::fs::write(&path, text).unwrap();
    (path, port, admin)
}

/// Floods an attacker drives cheaply (unknown keys; HTTP/2 rapid
/// resets, one library warning per connection) cannot flood the log: refused requests
/// get at most 100 access lines a second, with a count of those held back, and library
/// warnings at most one a second. Every request is still counted in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_floods_from_bad_keys_and_rapid_resets_are_held_back() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, port, admin) = binary_config(
        &upstream,
        dir.path(),
        "[log]\nformat = \"json\"\n[identity]\nfailed_auth_limit = { quota = 0 }",
    );
    let gw = support::Binary::spawn(&path, port, &[]);
    let url = format!("http://127.0.0.1:{port}/");

    // 1,000 requests with unknown keys, as fast as 8 clients go.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..125 {
                let r = support::get_with(&url, &[("authorization", "Bearer nope")]).await;
                assert_eq!(r.status, 401);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // A second later, one more: its line reports what was held back.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        support::get_with(&url, &[("authorization", "Bearer nope")])
            .await
            .status,
        401
    );

    // 10 HTTP/2 connections that reset streams faster than allowed (GOAWAY each).
    for _ in 0..10 {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        let driver = tokio::spawn(conn);
        for _ in 0..100 {
            let Ok(mut c) = client.clone().ready().await else {
                break;
            };
            let req = http::Request::get(format!("http://127.0.0.1:{port}/slow/200"))
                .body(())
                .unwrap();
            let Ok((response, _)) = c.send_request(req, true) else {
                break;
            };
            drop(response);
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), driver).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let logs = gw.logs();
    let lines: Vec<serde_json::Value> = logs
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let unauthenticated = |l: &&serde_json::Value| {
        l["target"] == "tollgate::access" && l["decision"] == "unauthenticated"
    };
    let written = lines
        .iter()
        .filter(unauthenticated)
        .filter(|l| l["message"] == "request")
        .count();
    let held_back: u64 = lines
        .iter()
        .filter(unauthenticated)
        .filter_map(|l| l["held_back"].as_u64())
        .sum();
    assert!(written < 1_001 && held_back > 0, "{written} lines written");
    assert_eq!(
        written as u64 + held_back,
        1_001,
        "every request is written or counted as held back"
    );
    let h2_warnings = lines
        .iter()
        .filter(|l| l["target"].as_str().is_some_and(|t| t.starts_with("h2")))
        .count();
    assert!(
        (1..=4).contains(&h2_warnings),
        "{h2_warnings} h2 warnings for 10 connections"
    );
    let metrics = get(&format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .text();
    let counted: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("tollgate_requests_total") && l.contains("unauthenticated"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, 1_001.0, "the metrics count every request");
}

/// `store.max_callers` bounds the memory store. Callers already held
/// keep counting; new ones past the bound follow `store.on_error`; space comes back as
/// windows end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_holds_at_most_max_callers() {
    let upstream = Upstream::start().await;
    for on_error in ["deny", "allow"] {
        let text = config(&upstream)
            .replace(
                "[[upstreams]]",
                &format!(
                    "[store]\nbackend = \"memory\"\nmax_callers = 640\nsweep_interval = \"200ms\"\non_error = \"{on_error}\"\n\n[identity]\ntrusted_proxies = [\"127.0.0.1/32\"]\n\n[[upstreams]]"
                ),
            )
            .replace("window = \"1h\"", "window = \"1m\"");
        let gw = TestGateway::start(&text).await;
        let from = |ip: String| {
            let url = gw.url("/");
            async move { support::get_with(&url, &[("x-forwarded-for", &ip)]).await }
        };
        // The first caller is held before the flood.
        assert_eq!(
            from("10.0.0.1".into()).await.num("x-ratelimit-remaining"),
            999
        );
        let (mut limited, mut refused, mut unlimited) = (0, 0, 0);
        for i in 0..1_500u32 {
            let r = from(format!("10.1.{}.{}", i / 250, i % 250)).await;
            match (r.status.as_u16(), r.header("x-ratelimit-limit")) {
                (200, "1000") => limited += 1,
                (503, _) => refused += 1,
                (200, "") => unlimited += 1,
                (s, l) => panic!("unexpected answer: {s}, limit {l:?}"),
            }
        }
        eprintln!("{on_error}: {limited} held, {refused} refused, {unlimited} unlimited");
        assert!(
            (400..640).contains(&limited),
            "{on_error}: {limited} new callers held (bound 640, 1 held before)"
        );
        if on_error == "deny" {
            assert_eq!((limited + refused, unlimited), (1_500, 0));
        } else {
            assert_eq!((limited + unlimited, refused), (1_500, 0));
        }
        // The caller held before the flood keeps counting.
        assert_eq!(
            from("10.0.0.1".into()).await.num("x-ratelimit-remaining"),
            998
        );
        // Once the windows end and are swept, new callers are held again.
        gw.clock.advance(std::time::Duration::from_secs(61));
        tokio::time::sleep(Duration::from_millis(600)).await;
        let r = from("10.2.0.1".into()).await;
        assert_eq!(
            (r.status.as_u16(), r.header("x-ratelimit-remaining")),
            (200, "999")
        );
    }
}

/// Requests that find one of their caller's requests already in flight
/// on this gateway are held by a reservation in the store. Uncharged ones (304) give it
/// back, and an upstream that says a request cost more gets the difference charged: a
/// burst is charged exactly as the same requests one by one would be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_requests_of_a_burst_are_refunded_or_topped_up_like_single_ones() {
    for redis in [None, Some(support::RedisServer::start())] {
        let upstream = Upstream::start().await;
        let store = store_section(redis.as_ref());
        let text = config(&upstream)
            .replace(
                "[[upstreams]]\nname = \"api\"",
                &format!(
                    "{store}\n[[upstreams]]\nname = \"api\"\ncost_header = \"x-tollgate-cost\""
                ),
            )
            .replace(
                "limits = [\"core\"]",
                "limits = [\"core\"]\nuncharged_statuses = [304]",
            )
            .replace(
                "[[routes]]",
                "[rate_limit_endpoint]\npath = \"/rate_limit\"\n\n[[routes]]",
            );
        let gw = TestGateway::start(&text).await;
        let client = h2_client();
        let burst = |path: &'static str, n: usize| {
            let client = client.clone();
            let url = gw.url(path);
            async move {
                let tasks: Vec<_> = (0..n)
                    .map(|_| tokio::spawn(client.get(url.parse().unwrap())))
                    .collect();
                for t in tasks {
                    let r = t.await.unwrap().unwrap();
                    assert!(r.status() == 200 || r.status() == 304, "{}", r.status());
                }
            }
        };
        // 40 concurrent 304s: none is charged.
        burst("/status/304", 40).await;
        // 20 concurrent requests the upstream says cost 3 each: 60 charged.
        burst("/cost/3", 20).await;
        // Refunds go out in the background; GET /rate_limit reads without charging.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        loop {
            let used = get(&gw.url("/rate_limit")).await.json()["resources"]["core"]["used"]
                .as_u64()
                .unwrap();
            if used == 60 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis {}: used {used}, not 60 (304s refunded, cost-3 requests charged 3 each)",
                redis.is_some()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Under a low open-file limit, `server.max_connections` is lowered so
/// that clients past it get 503 while the admin listener still answers (instead of
/// every accept failing with "Too many open files", /healthz included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_low_open_file_limit_lowers_max_connections_and_keeps_admin_answering() {
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (path, port, admin) = binary_config(&upstream, dir.path(), "");
    // (200 - 64 kept) / 2 descriptors per connection = 68 connections.
    let gw = support::Binary::spawn_with_open_files(&path, port, 200);
    // The warning is written at start; on a loaded machine the log file may lag a little.
    let lowered = |logs: &str| {
        logs.contains("server.max_connections lowered") && logs.contains("lowered_to=68")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !lowered(&gw.logs()) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let logs = gw.logs();
    assert!(lowered(&logs), "{logs}");
    // The start-up probe's connection is closed first (it would hold a slot).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !get(&format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .text()
        .contains("tollgate_open_connections 0")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "connections still open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // 150 silent connections: 68 are held, the rest answered 503. With one listener per
    // core (SO_REUSEPORT) the kernel spreads connections over several accept queues, so
    // which 68 are held is not the connect order: every connection is read at once and the
    // held ones simply never answer.
    let mut held = Vec::new();
    for _ in 0..150 {
        held.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    // Read them all until the 82 refusals have arrived (a loaded machine may take a
    // while to accept and answer them all: up to 20 s), then a little longer to see that
    // no more come.
    use futures_util::stream::StreamExt;
    let mut reads: futures_util::stream::FuturesUnordered<_> = held
        .iter_mut()
        .map(|s| async move {
            let mut buf = [0u8; 256];
            match s.read(&mut buf).await {
                Ok(n) => String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 503"),
                Err(_) => false,
            }
        })
        .collect();
    let mut refused = 0;
    let mut deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut settling = false;
    loop {
        match tokio::time::timeout_at(deadline, reads.next()).await {
            Ok(Some(true)) => refused += 1,
            Ok(Some(false)) => {}
            Ok(None) | Err(_) => break,
        }
        if refused == 150 - 68 && !settling {
            settling = true;
            deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        }
    }
    drop(reads);
    assert_eq!(
        refused,
        150 - 68,
        "connections past the lowered bound get 503"
    );
    let health = get(&format!("http://127.0.0.1:{admin}/healthz")).await;
    assert_eq!(health.status, 200, "the admin listener still answers");
    assert!(!gw.logs().contains("Too many open files"), "{}", gw.logs());
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(get(&format!("http://127.0.0.1:{port}/")).await.status, 200);
}
