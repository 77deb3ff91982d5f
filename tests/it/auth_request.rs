//! `[identity.auth_request]` against a real auth service (a small hyper server started
//! here): callers named by its answers, its refusals passed on, the cache, one callout
//! for many concurrent requests with one new key, a slow and a dead service, the breaker.

use crate::support;
use crate::support::*;
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The auth service: answers by the key in `Authorization`, and counts calls per key.
struct AuthService {
    addr: SocketAddr,
    calls: Arc<Mutex<HashMap<String, usize>>>,
    /// The `X-Original-URI` of the last call.
    last_uri: Arc<Mutex<String>>,
}

impl AuthService {
    async fn start() -> AuthService {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls = Arc::new(Mutex::new(HashMap::new()));
        let last_uri = Arc::new(Mutex::new(String::new()));
        let (c, u) = (calls.clone(), last_uri.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (c, u) = (c.clone(), u.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (c, u) = (c.clone(), u.clone());
                        async move { Ok::<_, Infallible>(answer(req, &c, &u).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        AuthService {
            addr,
            calls,
            last_uri,
        }
    }

    fn url(&self) -> String {
        format!("http://{}/auth", self.addr)
    }

    fn calls(&self, key: &str) -> usize {
        self.calls.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

async fn answer(
    req: Request<Incoming>,
    calls: &Mutex<HashMap<String, usize>>,
    last_uri: &Mutex<String>,
) -> Response<Full<Bytes>> {
    let key = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim_start_matches("Bearer ")
        .to_string();
    *calls.lock().unwrap().entry(key.clone()).or_default() += 1;
    if let Some(u) = req.headers().get("x-original-uri") {
        *last_uri.lock().unwrap() = u.to_str().unwrap_or("").to_string();
    }
    let ok = |id: &str| {
        Response::builder()
            .header("x-caller-id", id)
            .header("x-caller-tier", "gold")
            .header("x-caller-quota-core", "7")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    match key.as_str() {
        "good" => ok("acme"),
        "coalesce" => {
            tokio::time::sleep(Duration::from_millis(300)).await;
            ok("many")
        }
        "slow" => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            ok("late")
        }
        "revoked" => Response::builder()
            .status(403)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                b"{\"error\":\"key revoked\"}",
            )))
            .unwrap(),
        _ => Response::builder()
            .status(401)
            .body(Full::new(Bytes::from_static(b"who are you")))
            .unwrap(),
    }
}

fn config(up: &Upstream, auth_url: &str, extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
max_connections_per_ip = 5000

[identity]
failed_auth_limit = {{ quota = 0, window = "1m" }}

[[identity.clients]]
id = "local"
key_sha256 = "{local}"
tier = "gold"

[identity.auth_request]
url = "{auth_url}"
{extra}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 3, gold = 20 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        local = sha256_hex("local-key"),
        up = up.url(),
        extra = if extra.contains("timeout") {
            extra.to_string()
        } else {
            format!("timeout = \"300ms\"\n{extra}")
        },
    )
}

async fn call(gw: &TestGateway, path: &str, key: &str) -> support::client::Reply {
    get_with(
        &gw.url(path),
        &[("authorization", &format!("Bearer {key}"))],
    )
    .await
}

#[tokio::test]
async fn the_service_names_callers_and_its_refusals_reach_the_client() {
    let up = Upstream::start().await;
    let auth = AuthService::start().await;
    let gw = TestGateway::start(&config(&up, &auth.url(), "")).await;

    // A local key never reaches the service.
    assert_eq!(call(&gw, "/x", "local-key").await.status, 200);
    assert_eq!(auth.calls("local-key"), 0);

    // Named by the service: its tier and its own quota (7, not gold's 20); cached.
    for used in 1..=3 {
        let r = call(&gw, "/v1/things?a=1", "good").await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-ratelimit-limit"), "7");
        assert_eq!(r.num("x-ratelimit-used"), used);
    }
    assert_eq!(auth.calls("good"), 1, "answers are cached");
    assert_eq!(*auth.last_uri.lock().unwrap(), "/v1/things?a=1");

    // 403 and 401 are passed on with their bodies, not forwarded; refusals are cached.
    let hits = up.hits();
    let r = call(&gw, "/x", "revoked").await;
    assert_eq!(r.status, 403);
    assert_eq!(r.header("content-type"), "application/json");
    assert_eq!(r.text(), "{\"error\":\"key revoked\"}");
    let r = call(&gw, "/x", "nobody").await;
    assert_eq!((r.status.as_u16(), r.text().as_str()), (401, "who are you"));
    assert_eq!(call(&gw, "/x", "revoked").await.status, 403);
    assert_eq!(
        auth.calls("revoked"),
        1,
        "refusals are cached (negative_ttl)"
    );
    assert_eq!(up.hits(), hits, "refused requests are not forwarded");
}

#[tokio::test]
async fn a_thousand_concurrent_requests_with_one_new_key_make_one_callout() {
    let up = Upstream::start().await;
    let auth = AuthService::start().await;
    let gw = TestGateway::start(&config(&up, &auth.url(), "timeout = \"5s\"")).await;
    let url = gw.url("/x");
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut tasks = Vec::new();
    for _ in 0..1000 {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let req = Request::get(&url)
                .header("authorization", "Bearer coalesce")
                .body(Full::new(Bytes::new()))
                .unwrap();
            client.request(req).await.map(|r| r.status().as_u16())
        }));
    }
    let mut statuses = HashMap::new();
    for t in tasks {
        *statuses.entry(t.await.unwrap().unwrap()).or_insert(0) += 1;
    }
    // Every one identified as the service's caller: admitted, or over its quota of 7.
    assert_eq!(
        statuses.len(),
        statuses
            .keys()
            .filter(|s| [200u16, 429].contains(s))
            .count(),
        "{statuses:?}"
    );
    assert_eq!(statuses.values().sum::<usize>(), 1000);
    assert!(
        statuses.get(&200).copied().unwrap_or(0) >= 7,
        "{statuses:?}"
    );
    assert_eq!(auth.calls("coalesce"), 1, "one callout for all");
}

#[tokio::test]
async fn a_slow_or_dead_service_follows_on_error_and_the_breaker_opens() {
    let up = Upstream::start().await;
    let auth = AuthService::start().await;
    // deny: 503 after the timeout.
    let gw = TestGateway::start(&config(&up, &auth.url(), "breaker_failures = 2")).await;
    let hits = up.hits();
    for _ in 0..2 {
        let t = Instant::now();
        let r = call(&gw, "/x", "slow").await;
        assert_eq!(r.status, 503, "{}", r.text());
        assert!(
            t.elapsed() >= Duration::from_millis(290),
            "{:?}",
            t.elapsed()
        );
    }
    // Two failures opened the breaker: the next is refused without a callout.
    let t = Instant::now();
    assert_eq!(call(&gw, "/x", "slow").await.status, 503);
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(auth.calls("slow"), 2);
    assert_eq!(up.hits(), hits);

    // A dead service with on_error = "anonymous": served as an anonymous caller.
    let dead = format!("http://127.0.0.1:{}/auth", support::redis::free_port());
    let gw = TestGateway::start(&config(&up, &dead, "on_error = \"anonymous\"")).await;
    let r = call(&gw, "/x", "whoever").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-ratelimit-limit"),
        "3",
        "the anonymous tier's quota"
    );
    // And with "deny": 503.
    let gw = TestGateway::start(&config(&up, &dead, "")).await;
    let r = call(&gw, "/x", "whoever").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["message"], "authentication service unavailable");
}

mod auth_hostile;
