//! `[identity.auth_request]` attacked by a hostile client,
//! against a real auth service started here: what one client sends cannot open the
//! breaker for everyone, nor make the gateway forward unbounded headers; an address past
//! `identity.failed_auth_limit` gets no lookup and no callout; the cache keys on every
//! forwarded header; refusal bodies and the cache are bounded in bytes.

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

/// The auth service. By key (`Authorization: Bearer KEY`):
/// - `good`: caller `acme`;
/// - `tenant-*`: caller `tenant-a-admin` (tier gold) with `X-Tenant: a`, 403 otherwise;
/// - `big-*`: 401 with a 60 KB body; `mid-*`: 401 with a 3 KB body;
/// - anything else: 401 `who are you`.
///
/// Like a stock Node server, it answers 431 to a request whose `X-Original-URI` is
/// longer than 4,000 bytes, whatever the key.
struct AuthService {
    addr: SocketAddr,
    calls: Arc<Mutex<HashMap<String, usize>>>,
}

impl AuthService {
    async fn start() -> AuthService {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls = Arc::new(Mutex::new(HashMap::new()));
        let c = calls.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let c = c.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let c = c.clone();
                        async move { Ok::<_, Infallible>(answer(req, &c)) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        AuthService { addr, calls }
    }

    fn url(&self) -> String {
        format!("http://{}/auth", self.addr)
    }

    fn calls(&self, key: &str) -> usize {
        self.calls.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    /// Calls for keys starting with `prefix`.
    fn calls_of(&self, prefix: &str) -> usize {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, n)| n)
            .sum()
    }
}

fn answer(req: Request<Incoming>, calls: &Mutex<HashMap<String, usize>>) -> Response<Full<Bytes>> {
    let h = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let key = h("authorization").trim_start_matches("Bearer ").to_string();
    *calls.lock().unwrap().entry(key.clone()).or_default() += 1;
    let status = |code: u16, body: Bytes| {
        Response::builder()
            .status(code)
            .body(Full::new(body))
            .unwrap()
    };
    if h("x-original-uri").len() > 4000 {
        return status(431, Bytes::new());
    }
    let ok = |id: &str| {
        Response::builder()
            .header("x-caller-id", id)
            .header("x-caller-tier", "gold")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    match key.as_str() {
        "good" => ok("acme"),
        k if k.starts_with("tenant-") => match h("x-tenant").as_str() {
            "a" => ok("tenant-a-admin"),
            _ => status(403, Bytes::from_static(b"not your tenant")),
        },
        k if k.starts_with("big-") => status(401, Bytes::from(vec![b'x'; 60 * 1024])),
        k if k.starts_with("mid-") => status(401, Bytes::from(vec![b'y'; 3 * 1024])),
        _ => status(401, Bytes::from_static(b"who are you")),
    }
}

fn config(up: &Upstream, auth_url: &str, identity: &str, auth: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
max_connections_per_ip = 5000

[identity]
trusted_proxies = ["127.0.0.1/32"]
{identity}

[[identity.clients]]
id = "local"
key_sha256 = "{local}"
tier = "gold"

[identity.auth_request]
url = "{auth_url}"
timeout = "2s"
{auth}

[[upstreams]]
name = "api"
targets = ["{up}"]

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 1000, gold = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
"#,
        local = sha256_hex("local-key"),
        up = up.url(),
    )
}

/// GET `path` with the key `key` as the client `ip` (behind the trusted proxy 127.0.0.1),
/// with `extra` headers.
async fn call(
    gw: &TestGateway,
    path: &str,
    ip: &str,
    key: &str,
    extra: &[(&str, &str)],
) -> crate::support::client::Reply {
    let auth = format!("Bearer {key}");
    let mut headers = vec![("authorization", auth.as_str()), ("x-forwarded-for", ip)];
    headers.extend_from_slice(extra);
    get_with(&gw.url(path), &headers).await
}

/// A 4xx of the service other than 401/403 answers that request only, as a
/// 4xx of the gateway's with a JSON body: it never opens the breaker, so another
/// address with a valid new key is still served. A URI or forwarded headers past their
/// bounds get 414 / 431 before any callout.
#[tokio::test]
async fn a_431_from_the_service_answers_that_request_only_and_big_requests_are_not_sent() {
    let up = Upstream::start().await;
    let auth = AuthService::start().await;
    let gw = TestGateway::start(&config(
        &up,
        &auth.url(),
        "failed_auth_limit = { quota = 0, window = \"1m\" }",
        "forward_headers = [\"x-tenant\"]\nbreaker_failures = 2\nbreaker_cooloff = \"30s\"",
    ))
    .await;
    // A path the service finds too long (4,000 to 8,192 bytes: within max_uri_bytes).
    let long = format!("/{}", "a".repeat(5000));
    for i in 0..5 {
        let r = call(&gw, &long, "198.51.100.1", &format!("junk-{i}"), &[]).await;
        assert_eq!(r.status, 431, "{}", r.text());
        assert_eq!(r.header("content-type"), "application/json");
        assert_eq!(
            r.json()["message"],
            "the authentication service could not judge this request (431)"
        );
    }
    assert_eq!(auth.calls_of("junk-"), 5, "each was asked");
    let hits = up.hits();
    let r = call(&gw, "/x", "198.51.100.2", "good", &[]).await;
    assert_eq!(r.status, 200, "the breaker stayed closed: {}", r.text());
    assert_eq!(up.hits(), hits + 1);

    // Past the bounds: refused before any callout.
    let longer = format!("/{}", "b".repeat(17_000));
    let r = call(&gw, &longer, "198.51.100.1", "junk-long", &[]).await;
    assert_eq!(r.status, 414, "{}", r.text());
    assert_eq!(
        r.json()["message"],
        "URI longer than 8192 bytes: too long to authenticate"
    );
    let tenant = "t".repeat(5000);
    let r = call(
        &gw,
        "/x",
        "198.51.100.1",
        "junk-header",
        &[("x-tenant", &tenant)],
    )
    .await;
    assert_eq!(r.status, 431, "{}", r.text());
    assert_eq!(
        r.json()["message"],
        "credential and forwarded headers larger than 4096 bytes: too large to authenticate"
    );
    assert_eq!(auth.calls("junk-long") + auth.calls("junk-header"), 0);
    assert_eq!(up.hits(), hits + 1, "none was forwarded");
    // A valid key with the long path is refused the same way (the answer does not
    // depend on what is cached), and a valid key with a normal one still served.
    assert_eq!(
        call(&gw, &longer, "198.51.100.3", "good", &[]).await.status,
        414
    );
    assert_eq!(
        call(&gw, "/y", "198.51.100.3", "good", &[]).await.status,
        200
    );
}

/// Once an address is past `identity.failed_auth_limit`, every request of it
/// that presents a credential gets 429 without a lookup or a callout, valid keys
/// (the service's and local ones) included, until the window resets. Other clients
/// behind the same trusted proxy are keyed by their own address.
#[tokio::test]
async fn past_the_failed_auth_limit_no_key_is_looked_up_until_the_window_resets() {
    let up = Upstream::start().await;
    let auth = AuthService::start().await;
    let gw = TestGateway::start(&config(
        &up,
        &auth.url(),
        "failed_auth_limit = { quota = 5, window = \"1m\" }",
        "",
    ))
    .await;
    let guesser = "203.0.113.9";
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    for i in 0..60 {
        let r = call(&gw, "/x", guesser, &format!("wrong-{i}"), &[]).await;
        *statuses.entry(r.status.as_u16()).or_default() += 1;
        if r.status == 429 {
            assert_eq!(r.header("x-ratelimit-resource"), "failed_auth");
        }
    }
    assert_eq!(statuses, HashMap::from([(401, 5), (429, 55)]));
    assert_eq!(auth.calls_of("wrong-"), 5, "callouts stop at the limit");

    // The 61st, a valid key of the service, and a valid local key: 429, not asked.
    let r = call(&gw, "/x", guesser, "good", &[]).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("x-ratelimit-resource"), "failed_auth");
    assert!(r.num("retry-after") >= 1);
    assert_eq!(auth.calls("good"), 0);
    assert_eq!(call(&gw, "/x", guesser, "local-key", &[]).await.status, 429);
    // Without a credential it is an anonymous caller as before.
    assert_eq!(as_ip(&gw, "/x", guesser).await.status, 200);
    // Another client behind the same proxy is not affected.
    assert_eq!(
        call(&gw, "/x", "203.0.113.10", "good", &[]).await.status,
        200
    );
    assert_eq!(auth.calls("good"), 1);

    // After the window: served again.
    gw.clock.advance(Duration::from_secs(61));
    let r = call(&gw, "/x", guesser, "good", &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(call(&gw, "/x", guesser, "local-key", &[]).await.status, 200);
}

/// The cache keys on each forwarded header: a cached allow for `X-Tenant: a`
/// does not serve `b`, and a cached 403 for `b` does not refuse `a`.
#[tokio::test]
async fn the_cache_keys_on_every_forwarded_header_both_ways() {
    let up = Upstream::start().await;
    let auth = AuthService::start().await;
    let gw = TestGateway::start(&config(
        &up,
        &auth.url(),
        "failed_auth_limit = { quota = 0, window = \"1m\" }",
        "forward_headers = [\"x-tenant\"]",
    ))
    .await;
    let ip = "192.0.2.50";
    let tenant = |t: &'static str| [("x-tenant", t)];

    // A cached allow for a does not serve b (nor a request without the header).
    assert_eq!(
        call(&gw, "/x", ip, "tenant-k1", &tenant("a")).await.status,
        200
    );
    let r = call(&gw, "/x", ip, "tenant-k1", &tenant("b")).await;
    assert_eq!(
        (r.status.as_u16(), r.text().as_str()),
        (403, "not your tenant")
    );
    assert_eq!(call(&gw, "/x", ip, "tenant-k1", &[]).await.status, 403);
    assert_eq!(
        call(&gw, "/x", ip, "tenant-k1", &tenant("a")).await.status,
        200
    );
    assert_eq!(auth.calls("tenant-k1"), 3, "each tenant's answer is cached");

    // A cached 403 for b does not refuse a.
    assert_eq!(
        call(&gw, "/x", ip, "tenant-k2", &tenant("b")).await.status,
        403
    );
    assert_eq!(
        call(&gw, "/x", ip, "tenant-k2", &tenant("a")).await.status,
        200
    );
    assert_eq!(
        call(&gw, "/x", ip, "tenant-k2", &tenant("b")).await.status,
        403
    );
    assert_eq!(auth.calls("tenant-k2"), 2);
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// `tollgate_auth_cache_bytes` from the admin listener.
async fn cache_bytes(admin: u16) -> Option<u64> {
    let text = get(&format!("http://127.0.0.1:{admin}/metrics"))
        .await
        .text();
    text.lines()
        .find(|l| l.starts_with("tollgate_auth_cache_bytes "))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
}

/// Send `n` requests with keys `PREFIX-0` … concurrently (64 at a time); their statuses
/// and bodies.
async fn flood(url: &str, prefix: &str, n: usize) -> Vec<(u16, Bytes)> {
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = Vec::new();
    for i in 0..n {
        let (client, url, sem) = (client.clone(), url.to_string(), sem.clone());
        let key = format!("Bearer {prefix}-{i}");
        tasks.push(tokio::spawn(async move {
            let _permit = sem.acquire().await.unwrap();
            let req = Request::get(&url)
                .header("authorization", key)
                .body(Full::new(Bytes::new()))
                .unwrap();
            let resp = client.request(req).await.unwrap();
            let status = resp.status().as_u16();
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap()
                .to_bytes();
            (status, body)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// A 401 body longer than 4 KB is replaced (the client sees the gateway's JSON
/// refusal) and not kept, so thousands of unknown keys with 60 KB refusals leave the
/// process's memory where it was; the cache stays within `cache_max_bytes`, and its
/// bytes go back to 0 once `negative_ttl` has passed.
#[tokio::test]
async fn refusal_bodies_and_the_cache_are_bounded_in_bytes_and_freed_on_expiry() {
    let up = Upstream::start().await;
    let auth = AuthService::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (
        crate::support::redis::free_port(),
        crate::support::redis::free_port(),
    );
    let text = config(
            &up,
            &auth.url(),
            "failed_auth_limit = { quota = 0, window = \"1m\" }",
            // 64 callouts at once from one address: above the default max_concurrent_per_ip.
            "negative_ttl = \"2s\"\ncache_max_bytes = 1048576\nmax_concurrent_per_ip = 64",
        )
        .replace(
            "listen = \"127.0.0.1:0\"",
            &format!("listen = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nwatch_config = false"),
        );
    let path = dir.path().join("tollgate.toml");
    std::fs::write(&path, text).unwrap();
    let gw = Binary::spawn(&path, port, &[]);
    let pid = gw.child.id();
    let url = format!("http://127.0.0.1:{port}/x");

    // Warm up (connections, pools), then measure.
    flood(&url, "warm", 200).await;
    let before = rss_bytes(pid);
    let answers = flood(&url, "big", 3000).await;
    let grown = rss_bytes(pid).saturating_sub(before);
    assert_eq!(auth.calls_of("big-"), 3000);
    assert!(
        grown < 40 * 1024 * 1024,
        "3,000 refusals of 60 KB grew RSS by {} MB",
        grown / (1024 * 1024)
    );
    for (status, body) in &answers {
        assert_eq!(*status, 401);
        assert!(
            &body[..] == b"{\"message\":\"Bad credentials\"}",
            "a body of {} bytes",
            body.len()
        );
    }

    // A body within 4 KB is passed on as it is; the cache stays within its bytes.
    let answers = flood(&url, "mid", 1000).await;
    assert!(answers
        .iter()
        .all(|(s, b)| *s == 401 && b.len() == 3 * 1024 && b[0] == b'y'));
    let bytes = cache_bytes(admin).await.expect("tollgate_auth_cache_bytes");
    assert!(
        bytes > 512 * 1024 && bytes <= 1024 * 1024,
        "cache bytes {bytes}"
    );

    // Past negative_ttl, expired answers are dropped (not only skipped).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let bytes = cache_bytes(admin).await.unwrap_or(u64::MAX);
        if bytes == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "cache bytes stayed at {bytes}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
