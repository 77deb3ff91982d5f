//! What a client sees of `[headers] style` (GitHub's `X-RateLimit-*`, the IETF draft's
//! `RateLimit-Policy` and `RateLimit`) and of `upstreams.cost_header` (the upstream says
//! what a request cost), end to end through the gateway.

use crate::support;
use crate::support::client::Reply;
use crate::support::{get, get_with, sha256_hex, TestGateway, Upstream};
use std::time::Duration;

const GITHUB: [&str; 5] = [
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-used",
    "x-ratelimit-reset",
    "x-ratelimit-resource",
];
const IETF: [&str; 2] = ["ratelimit-policy", "ratelimit"];

/// Anonymous callers get `burst` (5 a minute) and `daily` (1000 a day); `gold_only`
/// applies to gold clients only, so it never shows up for them.
fn config(upstream: &Upstream, style: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[headers]
style = {style}

[identity]
failed_auth_limit = {{ quota = 2, window = "1m" }}

[[identity.clients]]
id = "g"
key_sha256 = "{gold}"
tier = "gold"

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "burst"
window = "1m"
quota = {{ anonymous = 5, gold = 50 }}

[[limits]]
name = "daily"
window = "1d"
quota = {{ anonymous = 1000, gold = 10000 }}

[[limits]]
name = "gold_only"
window = "1h"
quota = {{ gold = 7 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["burst", "daily", "gold_only"]
"#,
        up = upstream.url(),
        gold = sha256_hex("gold-key"),
    )
}

fn assert_none(r: &Reply, names: &[&str]) {
    for name in names {
        assert_eq!(
            r.header(name),
            "",
            "{name} should be absent: {:?}",
            r.headers
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn github_and_ietf_headers_describe_the_same_limits() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, r#"["github", "ietf"]"#)).await;

    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=5;w=60, "daily";q=1000;w=86400"#,
        "every limit that applied, with the caller's quota and the window in seconds"
    );
    assert_eq!(r.header("ratelimit"), r#""burst";r=4;t=60"#);
    assert_eq!(r.header("x-ratelimit-limit"), "5");
    assert_eq!(r.header("x-ratelimit-remaining"), "4");
    assert_eq!(r.header("x-ratelimit-used"), "1");
    assert_eq!(r.header("x-ratelimit-resource"), "burst");
    let reset = r.num("x-ratelimit-reset");

    // Ten seconds later: the same window, ten seconds closer to its end.
    gw.clock.advance(Duration::from_secs(10));
    let r = get(&gw.url("/")).await;
    assert_eq!(r.header("ratelimit"), r#""burst";r=3;t=50"#);
    assert_eq!(r.num("x-ratelimit-reset"), reset);
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=5;w=60, "daily";q=1000;w=86400"#
    );

    // A gold client: its own quotas, and gold_only applies to it too.
    let gold = [("authorization", "Bearer gold-key")];
    let r = get_with(&gw.url("/"), &gold).await;
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=50;w=60, "daily";q=10000;w=86400, "gold_only";q=7;w=3600"#
    );
    assert_eq!(r.header("ratelimit"), r#""gold_only";r=6;t=3600"#);
    assert_eq!(r.header("x-ratelimit-resource"), "gold_only");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ietf_alone_replaces_the_upstreams_fields_and_adds_no_github_headers() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, r#"["ietf"]"#)).await;

    let r = get(&gw.url(
        "/set-headers?ratelimit=%22upstream%22;r=999;t=1&ratelimit-policy=%22upstream%22;q=999;w=1",
    ))
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit-policy"),
        r#""burst";q=5;w=60, "daily";q=1000;w=86400"#
    );
    assert_eq!(r.header("ratelimit"), r#""burst";r=4;t=60"#);
    assert_eq!(r.headers.get_all("ratelimit").iter().count(), 1);
    assert_eq!(r.headers.get_all("ratelimit-policy").iter().count(), 1);
    assert_none(&r, &GITHUB);

    // GitHub's headers are not the gateway's in this style: the upstream's pass through.
    let r = get(&gw.url("/status/200")).await;
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        "999",
        "the upstream's own"
    );
    assert_eq!(r.header("ratelimit"), r#""burst";r=3;t=60"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_style_sends_no_rate_limit_headers_but_still_limits() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, "[]")).await;
    for _ in 0..5 {
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 200);
        assert_none(&r, &GITHUB);
        assert_none(&r, &IETF);
    }
    let r = get(&gw.url("/")).await;
    assert_eq!(r.status, 429);
    assert_none(&r, &GITHUB);
    assert_none(&r, &IETF);
    assert!(r.num("retry-after") >= 59, "Retry-After stays");
    assert_eq!(r.json()["resource"], "burst", "the body still says why");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_carries_the_ratelimit_fields_of_the_limit_that_refused() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&config(&upstream, r#"["github", "ietf"]"#)).await;
    for _ in 0..5 {
        assert_eq!(get(&gw.url("/")).await.status, 200);
    }
    gw.clock.advance(Duration::from_secs(20));
    // The first refusal comes from the store's answer, the next from the over-limit cache.
    for _ in 0..2 {
        let r = get(&gw.url("/")).await;
        assert_eq!(r.status, 429);
        assert_eq!(r.header("ratelimit"), r#""burst";r=0;t=40"#);
        assert_eq!(
            r.header("ratelimit-policy"),
            r#""burst";q=5;w=60, "daily";q=1000;w=86400"#
        );
        assert_eq!(r.header("x-ratelimit-remaining"), "0");
        assert_eq!(r.header("x-ratelimit-resource"), "burst");
        assert_eq!(r.header("retry-after"), "40");
    }
    assert_eq!(upstream.hits(), 5);

    // The 429 for too many unknown API keys describes the failed-auth limit.
    let bad = [("authorization", "Bearer nope")];
    for _ in 0..2 {
        assert_eq!(get_with(&gw.url("/"), &bad).await.status, 401);
    }
    let r = get_with(&gw.url("/"), &bad).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("ratelimit-policy"), r#""failed_auth";q=2;w=60"#);
    assert_eq!(r.header("ratelimit"), r#""failed_auth";r=0;t=60"#);
    assert_eq!(r.header("x-ratelimit-resource"), "failed_auth");
}

/// Route `/` costs 1, `/cost/` costs 2; the upstream `api` names its cost header in
/// capitals (it is matched in lowercase).
fn cost_config(upstream: &Upstream, limit: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "api"
targets = ["{up}"]
cost_header = "X-Tollgate-Cost"

[[limits]]
name = "points"
window = "1h"
quota = {{ anonymous = 20 }}
{limit}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["points"]

[[routes]]
path_prefix = "/cost/"
upstream = "api"
limits = ["points"]
cost = 2
"#,
        up = upstream.url(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_cost_header_is_charged_and_stripped() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&cost_config(&upstream, "")).await;

    let r = get(&gw.url("/cost/7")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-used"), 7, "7 charged, not the route's 2");
    assert_eq!(r.header("x-tollgate-cost"), "", "stripped");

    let r = get(&gw.url("/cost/0")).await;
    assert_eq!(r.num("x-ratelimit-used"), 7, "0: nothing charged");
    assert_eq!(r.header("x-tollgate-cost"), "");

    let r = get(&gw.url("/")).await;
    assert_eq!(r.num("x-ratelimit-used"), 8, "no header: the route's cost");

    // An uncharged status stays uncharged whatever the header says.
    let r = get(&gw.url("/set-headers?status=304&x-tollgate-cost=5")).await;
    assert_eq!(r.status, 304);
    assert_eq!(r.header("x-tollgate-cost"), "");
    assert_eq!(r.num("x-ratelimit-used"), 8);

    // The check before forwarding uses the route's cost (2 of the 12 left fit), and the
    // upstream's 15 is charged in full afterwards.
    let r = get(&gw.url("/cost/15")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.num("x-ratelimit-used"), 23);
    assert_eq!(r.num("x-ratelimit-remaining"), 0);
    let r = get(&gw.url("/cost/1")).await;
    assert_eq!(r.status, 429);
    assert_eq!(upstream.hits(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_cost_header_is_stripped_and_the_route_cost_charged() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&cost_config(&upstream, "")).await;
    let mut used = 0;
    for bad in ["abc", "-1", "1.5", "+3"] {
        let r = get(&gw.url(&format!("/cost/{bad}"))).await;
        assert_eq!(r.status, 200, "{bad}");
        used += 2;
        assert_eq!(r.num("x-ratelimit-used"), used, "{bad}: the route's cost");
        assert_eq!(r.header("x-tollgate-cost"), "", "{bad}: stripped");
    }
    // Two values: which one? Neither; the route's cost (1 on `/`).
    let r = get(&gw.url("/set-headers?x-tollgate-cost=1&x-tollgate-cost=2")).await;
    assert_eq!(r.num("x-ratelimit-used"), used + 1);
    assert_eq!(r.header("x-tollgate-cost"), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_mode_limits_keep_the_route_cost_taken_before_forwarding() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::start(&cost_config(&upstream, "lease = 10")).await;
    // Lease-mode (like on_request) limits take the route's 2 before forwarding; the
    // upstream's number does not change what they took.
    let r = get(&gw.url("/cost/5")).await;
    assert_eq!(r.num("x-ratelimit-used"), 2);
    assert_eq!(r.header("x-tollgate-cost"), "", "never reaches the client");
    assert_eq!(get(&gw.url("/cost/1")).await.num("x-ratelimit-used"), 4);
    // The "/" route costs 1.
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 5);
    // 0: nothing is charged, the 2 units go back to the lease.
    assert_eq!(get(&gw.url("/cost/0")).await.status, 200);
    assert_eq!(get(&gw.url("/")).await.num("x-ratelimit-used"), 6);
}

/// `tollgate check` on `text`: exit code and stderr.
fn check(text: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    std::fs::write(&path, text).unwrap();
    let (code, _, stderr) = support::check(&path);
    (code, stderr)
}

#[test]
fn check_reports_bad_styles_and_cost_headers_by_key_path() {
    let base = r#"
[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9000"]
COST

[[limits]]
name = "café"
window = "1m"
quota = { anonymous = 1 }

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["café"]
"#;
    // An unknown style stops parsing, like any bad enumerated value.
    let (code, stderr) = check(&format!(
        "[headers]\nstyle = [\"github\", \"ietf2\"]\n{}",
        base.replace("COST", "")
    ));
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains(
            "t.toml:2:20: headers.style[1]: unknown variant `ietf2`, expected `github` or `ietf`"
        ),
        "{stderr}"
    );

    // Everything else is reported together.
    let (code, stderr) = check(&format!(
        "[headers]\nstyle = [\"ietf\", \"github\", \"ietf\"]\n{}",
        base.replace("COST", "cost_header = \"x cost\"")
    ));
    assert_eq!(code, 1, "{stderr}");
    for expected in [
        "t.toml:2:28: headers.style[2]: \"ietf\" is listed twice",
        "upstreams[0].cost_header: \"x cost\" is not a valid header name",
        "limits[0].name: must be printable ASCII with headers.style \"ietf\"",
    ] {
        assert!(stderr.contains(expected), "{expected:?} not in:\n{stderr}");
    }
    assert_eq!(stderr.lines().count(), 3, "{stderr}");

    let (code, stderr) = check(&base.replace("COST", "cost_header = \"Connection\""));
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("upstreams[0].cost_header: \"Connection\" is a hop-by-hop header"),
        "{stderr}"
    );

    // The default style is GitHub's only, so a non-ASCII limit name is fine there.
    let (code, stderr) = check(&base.replace("COST", "cost_header = \"X-Tollgate-Cost\""));
    assert_eq!(code, 0, "{stderr}");
}

mod upstream_framing {
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
                        let mut r =
                            http::Response::new(http_body_util::Full::new(Bytes::from("big")));
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
            b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
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
}
