//! What an upstream's response head says about its body's length, as HTTP/1.1 and
//! HTTP/2 clients of the gateway see it, and the 502 that
//! says why when a response cannot be passed on. The upstreams are raw TCP
//! servers that answer with exactly the bytes a test gives (hyper's server would refuse
//! to send most of them), or a real hyper HTTP/2 server.

use crate::support::raw::{find, PATIENCE};
use crate::support::TestGateway;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw HTTP/1.1 upstream that answers every request (a bodiless head) with `answer`,
/// byte for byte, on keep-alive connections.
struct Scripted {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Scripted {
    async fn start(answer: Vec<u8>) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(answer_each(stream, answer.clone()));
            }
        });
        Scripted { addr, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer_each(mut s: TcpStream, answer: Vec<u8>) {
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        while let Some(i) = find(&pending, b"\r\n\r\n") {
            pending.drain(..i + 4);
            if s.write_all(&answer).await.is_err() {
                return;
            }
        }
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
    }
}

fn config(target: &str, upstream_extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "origin"
targets = ["{target}"]
connect_timeout = "1s"
response_timeout = "5s"
{upstream_extra}

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "origin"
limits = ["core"]
"#
    )
}

/// What a client of the gateway got: the head, and the body read to its end (or why it
/// could not be).
struct Got {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Result<Bytes, String>,
}

impl Got {
    fn lengths(&self) -> Vec<String> {
        self.headers
            .get_all("content-length")
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect()
    }

    fn message(&self) -> String {
        let body = self.body.as_ref().expect("a body");
        let v: serde_json::Value =
            serde_json::from_slice(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
        v["message"].as_str().unwrap_or_default().to_string()
    }
}

/// The two kinds of client: HTTP/1.1 and HTTP/2 (prior knowledge).
fn clients() -> [(
    &'static str,
    Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
); 2] {
    [
        (
            "HTTP/1.1",
            Client::builder(TokioExecutor::new()).build_http(),
        ),
        ("HTTP/2", crate::support::h2_client()),
    ]
}

/// GET `url` with `client`; `Err` when no response head came.
async fn fetch(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    url: &str,
) -> Result<Got, String> {
    let exchange = async {
        let resp = client
            .request(Request::get(url).body(Empty::new()).unwrap())
            .await
            .map_err(|e| format!("no response: {e:?}"))?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map(|c| c.to_bytes())
            .map_err(|e| format!("body failed: {e:?}"));
        Ok(Got {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| Err("no answer within the patience bound".into()))
}

// ---- Transfer-Encoding and Content-Length both ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_wins_over_a_content_length_and_both_clients_get_the_body_cleanly() {
    let upstream = Scripted::start(
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nTransfer-Encoding: chunked\r\n\r\n\
              5\r\nhello\r\n0\r\n\r\n"
            .to_vec(),
    )
    .await;
    let gw = TestGateway::start(&config(&upstream.url(), "")).await;
    for (name, client) in clients() {
        // Twice on the same client: the connection stays usable after the first.
        for round in 0..2 {
            let got = fetch(&client, &gw.url("/a")).await;
            let got = got.unwrap_or_else(|e| panic!("{name} round {round}: {e}"));
            assert_eq!(got.status, 200, "{name}");
            assert_eq!(
                got.body.as_deref().map_err(String::as_str),
                Ok(&b"hello"[..]),
                "{name} round {round}"
            );
            assert!(
                got.lengths().iter().all(|v| v == "5"),
                "{name}: no Content-Length but the body's own: {:?}",
                got.lengths()
            );
        }
    }
}

// ---- no Content-Length on 1xx, 204 (and 304 to HTTP/2) ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_204_with_a_content_length_reaches_both_clients_without_it() {
    let upstream = Scripted::start(
        b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\nx-seen: 1\r\n\r\n".to_vec(),
    )
    .await;
    let gw = TestGateway::start(&config(&upstream.url(), "")).await;
    for (name, client) in clients() {
        for round in 0..2 {
            let got = fetch(&client, &gw.url("/a"))
                .await
                .unwrap_or_else(|e| panic!("{name} round {round}: {e}"));
            assert_eq!(got.status, 204, "{name}");
            assert_eq!(got.headers["x-seen"], "1", "{name}");
            assert_eq!(got.lengths(), Vec::<String>::new(), "{name} round {round}");
            assert_eq!(got.body.as_deref().map_err(String::as_str), Ok(&b""[..]));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_with_a_content_length_reaches_both_clients_without_it() {
    let upstream = Scripted::start(
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\netag: \"x\"\r\n\r\n".to_vec(),
    )
    .await;
    let gw = TestGateway::start(&config(&upstream.url(), "")).await;
    for (name, client) in clients() {
        let got = fetch(&client, &gw.url("/a"))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.status, 304, "{name}");
        assert_eq!(got.headers["etag"], "\"x\"", "{name}");
        assert_eq!(got.lengths(), Vec::<String>::new(), "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1xx_with_a_content_length_reaches_an_http1_client_without_it() {
    let upstream = Scripted::start(
        b"HTTP/1.1 103 Early Hints\r\nContent-Length: 0\r\nlink: </a.css>; rel=preload\r\n\r\n\
              HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
            .to_vec(),
    )
    .await;
    let gw = TestGateway::start(&config(&upstream.url(), "")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(PATIENCE, async {
        while find(&got, b"hello").is_none() {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed: {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("the answer");
    let text = String::from_utf8_lossy(&got).to_lowercase();
    let interim_end = text.find("\r\n\r\n").unwrap();
    let interim = &text[..interim_end];
    assert!(interim.starts_with("http/1.1 103"), "{text}");
    assert!(interim.contains("link: </a.css>"), "{text}");
    assert!(!interim.contains("content-length"), "{text}");
}

// ---- several Content-Length values ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equal_content_lengths_go_on_as_one_value_to_both_clients() {
    for answer in [
        &b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello"[..],
        &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"[..],
    ] {
        let upstream = Scripted::start(answer.to_vec()).await;
        let gw = TestGateway::start(&config(&upstream.url(), "")).await;
        let shown = String::from_utf8_lossy(answer).into_owned();
        for (name, client) in clients() {
            for round in 0..2 {
                let got = fetch(&client, &gw.url("/a"))
                    .await
                    .unwrap_or_else(|e| panic!("{name} {shown:?}: {e}"));
                assert_eq!(got.status, 200, "{name} {shown:?}");
                assert_eq!(got.lengths(), ["5"], "{name} {shown:?} round {round}");
                assert_eq!(
                    got.body.as_deref().map_err(String::as_str),
                    Ok(&b"hello"[..]),
                    "{name} {shown:?}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unequal_content_lengths_are_a_502_that_says_invalid_framing() {
    for answer in [
        &b"HTTP/1.1 200 OK\r\nContent-Length: 5, 6\r\n\r\nhello"[..],
        &b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello"[..],
    ] {
        let upstream = Scripted::start(answer.to_vec()).await;
        let gw = TestGateway::start(&config(&upstream.url(), "")).await;
        for (name, client) in clients() {
            let got = fetch(&client, &gw.url("/a"))
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(got.status, 502, "{name}");
            assert_eq!(
                got.message(),
                "invalid response framing from upstream \"origin\"",
                "{name}"
            );
        }
    }
}

// ---- a 502 says its cause ----

/// A real HTTP/2 (h2c) upstream whose every response carries an `x-big` header of
/// `size` bytes.
async fn big_header_h2_upstream(size: usize) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_req| async move {
                    let mut r = http::Response::new(http_body_util::Full::new(Bytes::from("big")));
                    r.headers_mut()
                        .insert("x-big", "b".repeat(size).parse().unwrap());
                    Ok::<_, std::convert::Infallible>(r)
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_send_buf_size(1 << 20)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_head_too_large_is_a_502_that_says_so_over_http1_and_http2_upstreams() {
    let big = "b".repeat(70_000);
    let answer = format!("HTTP/1.1 200 OK\r\nx-big: {big}\r\nContent-Length: 3\r\n\r\nbig");
    let h1 = Scripted::start(answer.into_bytes()).await;
    let (h2_addr, h2_task) = big_header_h2_upstream(70_000).await;
    // The h2 crate resets a stream whose head is past the limit as it resets one with a
    // malformed head: over HTTP/2 the message cannot tell which.
    for (upstream, url, extra, message) in [
        (
            "http1",
            h1.url(),
            "",
            "response headers too large from upstream \"origin\"",
        ),
        (
            "http2",
            format!("http://{h2_addr}"),
            "protocol = \"http2\"",
            "response headers too large or malformed from upstream \"origin\"",
        ),
    ] {
        let gw = TestGateway::start(&config(&url, extra)).await;
        for (name, client) in clients() {
            let got = fetch(&client, &gw.url("/a"))
                .await
                .unwrap_or_else(|e| panic!("{upstream} upstream, {name}: {e}"));
            assert_eq!(got.status, 502, "{upstream} upstream, {name}");
            assert_eq!(got.message(), message, "{upstream} upstream, {name}");
        }
    }
    h2_task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_coding_on_an_http10_response_is_a_502_that_says_invalid_framing() {
    // An HTTP/1.0 response may not be framed by a transfer coding (RFC 9112 §6.1):
    // hyper's client refuses it.
    let upstream = Scripted::start(
        b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".to_vec(),
    )
    .await;
    let gw = TestGateway::start(&config(&upstream.url(), "")).await;
    for (name, client) in clients() {
        let got = fetch(&client, &gw.url("/a"))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.status, 502, "{name}");
        assert_eq!(
            got.message(),
            "invalid response framing from upstream \"origin\"",
            "{name}"
        );
    }
    // A refused connection still says "unreachable".
    drop(upstream);
    let port = crate::support::redis::free_port();
    let gw = TestGateway::start(&config(&format!("http://127.0.0.1:{port}"), "")).await;
    let got = fetch(&clients()[0].1, &gw.url("/a")).await.unwrap();
    assert_eq!(got.status, 502);
    assert_eq!(got.message(), "upstream \"origin\" unreachable");
}

// ---- a later HTTP/1 minor version is served as HTTP/1.1 ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_2_request_line_is_served_as_http_1_1() {
    let upstream = crate::support::raw::Recorder::start().await;
    let gw = TestGateway::start(&config(&upstream.url(), "")).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    // Three on one connection, the second with a body that looks like a request line.
    let a = crate::support::raw::exchange(&mut s, b"GET /a HTTP/1.2\r\nhost: x\r\n\r\n").await;
    assert_eq!(a.status, 200, "{}", a.head);
    assert!(a.head.starts_with("http/1.1 200"), "{}", a.head);
    assert_eq!(a.body, "ok");
    let b = crate::support::raw::exchange(
        &mut s,
        b"POST /b HTTP/1.9\r\nhost: x\r\ncontent-length: 16\r\n\r\nGET / HTTP/1.2\r\n",
    )
    .await;
    assert_eq!(b.status, 200, "{}", b.head);
    let c = crate::support::raw::exchange(&mut s, b"GET /c HTTP/1.2\r\nhost: x\r\n\r\n").await;
    assert_eq!(c.status, 200, "{}", c.head);
    crate::support::raw::requests_reach(&upstream, 3).await;
    let heads = upstream.heads();
    assert_eq!(heads.len(), 3, "{heads:?}");
    assert!(heads[0].starts_with("GET /a HTTP/1.1\r\n"), "{heads:?}");
    assert!(heads[1].starts_with("POST /b HTTP/1.1\r\n"), "{heads:?}");
    assert!(heads[2].starts_with("GET /c HTTP/1.1\r\n"), "{heads:?}");
    // The body went on as it came.
    assert!(
        upstream.text().contains("\r\n\r\nGET / HTTP/1.2\r\n"),
        "{}",
        upstream.text()
    );
    // HTTP/2.0 on a request line is not a minor version: still 400 (hyper's answer).
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET /d HTTP/2.0\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(PATIENCE, s.read_to_end(&mut got)).await;
    assert!(
        String::from_utf8_lossy(&got).starts_with("HTTP/1.1 4"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
}
