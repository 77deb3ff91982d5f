//! Upstreams beyond plain HTTP/1.1: HTTPS targets with a private CA (and SNI), HTTP/2
//! targets, and several targets with passive health and one retry.
//!
//! The upstreams here are real hyper servers (over tokio-rustls for HTTPS) that echo what
//! they saw: `x-seen-version`, `x-seen-host`, `x-seen-sni`, `x-seen-path`.

use crate::support;
use crate::support::{capture_logs, log_lines, TestGateway};
use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;

// ---- certificates ----

struct Pki {
    _dir: tempfile::TempDir,
    ca_pem: PathBuf,
    /// A client certificate signed by the CA, and its key.
    client_pem: PathBuf,
    client_key: PathBuf,
    server: rustls::ServerConfig,
}

/// A test CA and a certificate for `localhost` signed by it, served with ALPN h2 and
/// http/1.1; with `require_client_cert`, the server asks for a client certificate
/// signed by the same CA.
fn pki_with(require_client_cert: bool) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tollgate test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca_pem = dir.path().join("ca.pem");
    std::fs::write(&ca_pem, ca.pem()).unwrap();
    let client_key_pair = KeyPair::generate().unwrap();
    let mut client_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    client_params
        .distinguished_name
        .push(DnType::CommonName, "tollgate gateway");
    let client = client_params.signed_by(&client_key_pair, &ca).unwrap();
    let client_pem = dir.path().join("client.pem");
    let client_key = dir.path().join("client.key");
    std::fs::write(&client_pem, client.pem()).unwrap();
    std::fs::write(&client_key, client_key_pair.serialize_pem()).unwrap();

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let key = rustls::pki_types::PrivateKeyDer::try_from(leaf_key.serialize_der()).unwrap();
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = if require_client_cert {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.der().clone()).unwrap();
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut server = builder
        .with_single_cert(vec![leaf.der().clone()], key)
        .unwrap();
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Pki {
        _dir: dir,
        ca_pem,
        client_pem,
        client_key,
        server,
    }
}

fn pki() -> Pki {
    pki_with(false)
}

// ---- the echoing upstream ----

struct Echo {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo(req: Request<Incoming>, sni: Option<String>) -> Response<Full<Bytes>> {
    let version = format!("{:?}", req.version());
    let host = req
        .headers()
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default();
    let path = req.uri().path().to_owned();
    let body = req.into_body().collect().await.map(|b| b.to_bytes().len());
    Response::builder()
        .header("x-seen-version", &version)
        .header("x-seen-host", host)
        .header("x-seen-sni", sni.unwrap_or_else(|| "-".into()))
        .header("x-seen-path", path)
        .header("x-seen-body", body.unwrap_or(0).to_string())
        .body(Full::new(Bytes::from(format!("hello over {version}"))))
        .unwrap()
}

/// An echoing upstream on a free port: plain (HTTP/1.1 and h2c) or, with `tls`, over TLS.
async fn start_echo(tls: Option<rustls::ServerConfig>) -> Echo {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let h = h.clone();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let builder = auto::Builder::new(TokioExecutor::new());
                match acceptor {
                    None => {
                        let svc = service_fn(move |req| {
                            h.fetch_add(1, Ordering::SeqCst);
                            async move { Ok::<_, Infallible>(echo(req, None).await) }
                        });
                        let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                    }
                    Some(acceptor) => {
                        let Ok(stream) = acceptor.accept(stream).await else {
                            return;
                        };
                        let sni = stream.get_ref().1.server_name().map(str::to_owned);
                        let svc = service_fn(move |req| {
                            h.fetch_add(1, Ordering::SeqCst);
                            let sni = sni.clone();
                            async move { Ok::<_, Infallible>(echo(req, sni).await) }
                        });
                        let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
                    }
                }
            });
        }
    });
    Echo { addr, hits, task }
}

/// A loopback port with nothing listening on it.
async fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    port
}

fn config(name: &str, targets: &[String], upstream_extra: &str) -> String {
    let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[upstreams]]
name = "{name}"
targets = [{targets}]
connect_timeout = "1s"
response_timeout = "5s"
{upstream_extra}

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 1000 }}

[[routes]]
path_prefix = "/"
upstream = "{name}"
limits = ["core"]
"#,
        targets = targets.join(", ")
    )
}

fn toml_path(p: &Path) -> String {
    p.display().to_string().replace('\\', "\\\\")
}

async fn send(
    gw: &TestGateway,
    method: &str,
    path: &str,
    body: &'static str,
) -> (u16, http::HeaderMap, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = Request::builder()
        .method(method)
        .uri(gw.url(path))
        .header("host", "api.example.com")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

fn h<'a>(headers: &'a http::HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn limit_headers(headers: &http::HeaderMap) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = headers
        .iter()
        .filter(|(k, _)| k.as_str().starts_with("x-ratelimit-"))
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn https_upstream_with_a_private_ca_gets_the_request_with_sni() {
    capture_logs();
    let pki = pki();
    let upstream = start_echo(Some(pki.server.clone())).await;
    let target = format!("https://localhost:{}/base", upstream.addr.port());
    let gw = TestGateway::start(&config(
        "tls-ca",
        &[target],
        &format!("ca = \"{}\"", toml_path(&pki.ca_pem)),
    ))
    .await;

    let (status, headers, body) = send(&gw, "GET", "/users?page=2", "").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "hello over HTTP/1.1");
    assert_eq!(h(&headers, "x-seen-sni"), "localhost");
    assert_eq!(h(&headers, "x-seen-host"), "api.example.com");
    assert_eq!(h(&headers, "x-seen-path"), "/base/users");
    assert_eq!(h(&headers, "x-ratelimit-used"), "1");
    // The connection is kept alive and reused.
    let (status, _, _) = send(&gw, "GET", "/again", "").await;
    assert_eq!(status, 200);
    assert_eq!(upstream.hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn https_upstream_over_http2_negotiates_h2_by_alpn() {
    capture_logs();
    let pki = pki();
    let upstream = start_echo(Some(pki.server.clone())).await;
    let target = format!("https://localhost:{}", upstream.addr.port());
    let gw = TestGateway::start(&config(
        "tls-h2",
        &[target],
        &format!("protocol = \"http2\"\nca = \"{}\"", toml_path(&pki.ca_pem)),
    ))
    .await;
    let (status, headers, body) = send(&gw, "GET", "/x", "").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, "hello over HTTP/2.0");
    assert_eq!(h(&headers, "x-seen-sni"), "localhost");
    assert_eq!(h(&headers, "x-seen-host"), "api.example.com");
}

#[tokio::test]
async fn https_upstream_asking_for_a_client_certificate_gets_the_configured_one() {
    capture_logs();
    let pki = pki_with(true);
    let upstream = start_echo(Some(pki.server.clone())).await;
    let target = format!("https://localhost:{}", upstream.addr.port());
    let ca = format!("ca = \"{}\"", toml_path(&pki.ca_pem));
    let with_cert = TestGateway::start(&config(
        "mtls-on",
        std::slice::from_ref(&target),
        &format!(
            "{ca}\nclient_cert = \"{}\"\nclient_key = \"{}\"",
            toml_path(&pki.client_pem),
            toml_path(&pki.client_key)
        ),
    ))
    .await;
    let (status, _, body) = send(&with_cert, "GET", "/x", "").await;
    assert_eq!(status, 200, "{body}");

    let without = TestGateway::start(&config("mtls-off", &[target], &ca)).await;
    let (status, _, body) = send(&without, "GET", "/x", "").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(upstream.hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn https_upstream_not_trusted_is_a_502_with_a_clear_log() {
    capture_logs();
    let pki = pki();
    let upstream = start_echo(Some(pki.server.clone())).await;
    let target = format!("https://localhost:{}", upstream.addr.port());
    // Default roots (webpki): the test CA is not among them.
    let gw = TestGateway::start(&config("tls-untrusted", &[target], "")).await;
    let (status, _, body) = send(&gw, "GET", "/x", "").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(upstream.hits.load(Ordering::SeqCst), 0);
    let lines = log_lines(&["tls-untrusted", "TLS handshake with localhost"]);
    assert!(
        lines.iter().any(|l| l.contains("UnknownIssuer")),
        "expected a log line naming the untrusted certificate, got {lines:#?}"
    );
}

#[tokio::test]
async fn http2_upstream_gets_http2_and_the_client_the_same_headers() {
    capture_logs();
    let upstream = start_echo(None).await;
    let target = format!("http://127.0.0.1:{}", upstream.addr.port());
    let h1 = TestGateway::start(&config("plain-h1", std::slice::from_ref(&target), "")).await;
    let h2 = TestGateway::start(&config("plain-h2", &[target], "protocol = \"http2\"")).await;

    // Each gateway has its own memory store, so each window starts at that
    // gateway's first request: the two reset times may be a second apart
    // when those requests straddle a second. Each stays fixed once stored.
    let mut resets: Option<(u64, u64)> = None;
    for round in 1..=3 {
        let (s1, headers1, body1) = send(&h1, "GET", "/v", "").await;
        let (s2, headers2, body2) = send(&h2, "POST", "/v", "a body").await;
        assert_eq!((s1, s2), (200, 200), "{body1} {body2}");
        assert_eq!(h(&headers1, "x-seen-version"), "HTTP/1.1");
        assert_eq!(h(&headers2, "x-seen-version"), "HTTP/2.0");
        assert_eq!(h(&headers2, "x-seen-host"), "api.example.com");
        assert_eq!(h(&headers2, "x-seen-body"), "6");
        let reset =
            |headers: &http::HeaderMap| -> u64 { h(headers, "x-ratelimit-reset").parse().unwrap() };
        let these = (reset(&headers1), reset(&headers2));
        assert!(these.0.abs_diff(these.1) <= 1, "round {round}: {these:?}");
        assert_eq!(*resets.get_or_insert(these), these, "round {round}");
        let without_reset = |headers: &http::HeaderMap| {
            let mut l = limit_headers(headers);
            l.retain(|(k, _)| k != "x-ratelimit-reset");
            l
        };
        let (l1, l2) = (without_reset(&headers1), without_reset(&headers2));
        assert_eq!(l1.len(), 4, "{l1:?}");
        assert_eq!(l1, l2, "round {round}");
        assert_eq!(h(&headers2, "x-ratelimit-used"), round.to_string());
    }
}

/// An HTTP/2 upstream (the h2 crate's server) that answers one request per
/// connection, then closes it with GOAWAY; the connections it accepted.
async fn start_one_request_h2_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                if let Some(Ok((_req, mut respond))) = conn.accept().await {
                    let ok = Response::builder().status(200).body(()).unwrap();
                    if let Ok(mut body) = respond.send_response(ok, false) {
                        let _ = body.send_data(Bytes::from_static(b"ok"), true);
                    }
                    conn.graceful_shutdown();
                }
                while let Some(Ok(_)) = conn.accept().await {}
            });
        }
    });
    (addr, accepted)
}

#[tokio::test]
async fn an_http2_upstream_that_closes_its_connection_gets_a_new_one() {
    let (addr, accepted) = start_one_request_h2_upstream().await;
    let target = format!("http://{addr}");
    let gw = TestGateway::start(&config("h2-goaway", &[target], "protocol = \"http2\"")).await;
    for round in 1..=3 {
        let (status, _, body) = send(&gw, "GET", "/", "").await;
        assert_eq!((status, body.as_str()), (200, "ok"), "round {round}");
        // The GOAWAY arrives after the response: let the gateway read it.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_refusing_target_is_ejected_and_gets_are_retried_on_the_live_one() {
    capture_logs();
    let live = start_echo(None).await;
    let dead = closed_port().await;
    let dead_target = format!("127.0.0.1:{dead}");
    let targets = [
        format!("http://{dead_target}"),
        format!("http://127.0.0.1:{}", live.addr.port()),
    ];
    let gw = TestGateway::start(&config("retry-get", &targets, "eject_for = \"10s\"")).await;

    for i in 0..10 {
        let (status, _, body) = send(&gw, "GET", "/x", "").await;
        assert_eq!(status, 200, "GET {i}: {body}");
    }
    assert_eq!(live.hits.load(Ordering::SeqCst), 10);
    // One connect attempt reached the dead target: the first; then it was skipped.
    let ejections = log_lines(&["upstream target ejected", "retry-get", &dead_target]);
    assert_eq!(ejections.len(), 1, "{ejections:#?}");
    assert!(ejections[0].contains("WARN"), "{}", ejections[0]);
}

#[tokio::test]
async fn an_ejection_ends_after_its_period_and_doubles_on_the_next_refusal() {
    capture_logs();
    let live = start_echo(None).await;
    let dead = closed_port().await;
    let dead_target = format!("127.0.0.1:{dead}");
    let targets = [
        format!("http://{dead_target}"),
        format!("http://127.0.0.1:{}", live.addr.port()),
    ];
    let gw = TestGateway::start(&config("eject-expiry", &targets, "eject_for = \"300ms\"")).await;
    let ejections = || log_lines(&["upstream target ejected", "eject-expiry", &dead_target]);

    for _ in 0..4 {
        assert_eq!(send(&gw, "GET", "/x", "").await.0, 200);
    }
    let first = ejections();
    assert_eq!(first.len(), 1, "{first:#?}");
    assert!(
        first[0].contains("failures=1") && first[0].contains("eject_ms=300"),
        "{}",
        first[0]
    );

    // Past the period, the dead target is tried again, refuses, and is ejected for twice
    // as long; the caller still gets its answer from the live one.
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    for _ in 0..4 {
        assert_eq!(send(&gw, "GET", "/x", "").await.0, 200);
    }
    let both = ejections();
    assert_eq!(both.len(), 2, "{both:#?}");
    assert!(
        both[1].contains("failures=2") && both[1].contains("eject_ms=600"),
        "{}",
        both[1]
    );
    assert_eq!(live.hits.load(Ordering::SeqCst), 8);
}

#[tokio::test]
async fn a_post_with_a_body_is_not_retried() {
    capture_logs();
    let live = start_echo(None).await;
    let dead = closed_port().await;
    let targets = [
        format!("http://127.0.0.1:{dead}"),
        format!("http://127.0.0.1:{}", live.addr.port()),
    ];
    let gw = TestGateway::start(&config("retry-post", &targets, "")).await;
    // Round robin starts at the first target: the dead one.
    let (status, _, body) = send(&gw, "POST", "/orders", "{\"n\":1}").await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(live.hits.load(Ordering::SeqCst), 0);
    // The dead target is now ejected: the next POST goes to the live one.
    let (status, headers, body) = send(&gw, "POST", "/orders", "{\"n\":1}").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(h(&headers, "x-seen-body"), "7");
}

#[tokio::test]
async fn tls_files_that_cannot_be_read_are_config_errors_with_key_paths() {
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let text = config(
        "bad-tls",
        &["https://localhost:9443".to_string()],
        &format!(
            "ca = \"{}\"\nclient_cert = \"missing.pem\"\nclient_key = \"{}\"",
            toml_path(&dir.path().join("missing-ca.pem")),
            toml_path(&not_pem)
        ),
    );
    let path = dir.path().join("tollgate.toml");
    std::fs::write(&path, text).unwrap();
    let (code, _, stderr) = support::check(&path);
    assert_eq!(code, 1, "{stderr}");
    for key in [
        "upstreams[0].ca",
        "upstreams[0].client_cert",
        "upstreams[0].client_key",
    ] {
        assert!(
            stderr.contains(&format!(": {key}: ")),
            "{key} not in:\n{stderr}"
        );
    }

    // ca on an upstream without https targets is an error too.
    let text = config(
        "plain-ca",
        &["http://127.0.0.1:9000".to_string()],
        "ca = \"ca.pem\"",
    );
    std::fs::write(&path, text).unwrap();
    let (code, _, stderr) = support::check(&path);
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("upstreams[0].ca: applies to https:// targets only"),
        "{stderr}"
    );
}

mod h2_upstream {
    //! HTTP/2 upstreams (`upstreams.protocol = "http2"`) against
    //! the gateway binary.
    //!
    //! - Clients that do not read their responses cannot stall the others that share the
    //!   upstream connection: a hyper HTTP/2 server (h2c) serves 20 MB and 1 MB bodies; 40
    //!   connections ask for 20 MB each and never read; another client's 1 MB comes at
    //!   once. hyper's server sends a body as fast as the gateway's flow-control windows let
    //!   it, so a gateway whose connection window is held by the unread streams stalls
    //!   everyone (as seen with hypercorn).
    //! - A graceful `GOAWAY` (`NO_ERROR` with a last stream id, as hypercorn sends after
    //!   every `max_requests`) and `REFUSED_STREAM` cost no 502: the requests the upstream
    //!   did not process go again on another connection, and none is processed twice. The
    //!   upstream here is a small HTTP/2 server written on frames (below), because the h2
    //!   crate's server can only shut down in two steps (a first `GOAWAY` with the largest
    //!   stream id, then a PING round) or abruptly (closing with processed streams open),
    //!   neither of which is what hypercorn and others do.

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full};
    use hyper::body::Incoming;
    use hyper::service::service_fn;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// The gateway's config file in `dir`: one HTTP/2 upstream at `target`, a route with a
    /// quota nobody reaches, `server.send_timeout = "8s"`; its proxy port.
    fn gateway_config(dir: &std::path::Path, target: &str) -> (std::path::PathBuf, u16) {
        let port = crate::support::redis::free_port();
        let path = dir.join("tollgate.toml");
        let text = format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
watch_config = false
send_timeout = "8s"

[[upstreams]]
name = "h2"
targets = ["{target}"]
protocol = "http2"
connect_timeout = "1s"
response_timeout = "10s"

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = 1000000 }}

[[routes]]
path_prefix = "/"
upstream = "h2"
limits = ["core"]
"#
        );
        std::fs::write(&path, text).unwrap();
        (path, port)
    }

    // ---- clients that do not read ----

    const BIG: usize = 20 * 1024 * 1024;
    const SMALL: usize = 1024 * 1024;

    /// What [`start_bodies_upstream`] has done: `/big` requests had, and body bytes handed
    /// to hyper to send (hyper takes a chunk when the stream has flow-control window for it).
    #[derive(Default)]
    struct Sent {
        bigs: AtomicUsize,
        bytes: AtomicUsize,
        /// Bodies dropped before their end (their stream was reset).
        cut: AtomicUsize,
    }

    /// A body of `len` bytes in 64 KiB chunks, counted into `sent` as hyper takes them.
    fn counted_body(len: usize, sent: Arc<Sent>) -> Counted {
        Counted { left: len, sent }
    }

    struct Counted {
        left: usize,
        sent: Arc<Sent>,
    }

    impl http_body::Body for Counted {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
            static CHUNK: [u8; 64 * 1024] = [b'x'; 64 * 1024];
            if self.left == 0 {
                return std::task::Poll::Ready(None);
            }
            let n = self.left.min(CHUNK.len());
            self.left -= n;
            self.sent.bytes.fetch_add(n, Ordering::SeqCst);
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                &CHUNK[..n],
            )))))
        }

        fn is_end_stream(&self) -> bool {
            self.left == 0
        }

        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.left as u64)
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            if self.left > 0 {
                self.sent.cut.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// A hyper HTTP/2-only (h2c) server: `/big` answers 20 MB, anything else 1 MB; what it
    /// has sent.
    async fn start_bodies_upstream() -> (String, Arc<Sent>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent = Arc::new(Sent::default());
        let seen = sent.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let len = if req.uri().path() == "/big" {
                            seen.bigs.fetch_add(1, Ordering::SeqCst);
                            BIG
                        } else {
                            SMALL
                        };
                        let body = counted_body(len, seen.clone());
                        async move { Ok::<_, Infallible>(Response::new(body)) }
                    });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        (format!("http://{addr}"), sent)
    }

    /// Read one HTTP/1.1 response with a `Content-Length` from `s`: its status and how many
    /// body bytes came.
    async fn read_response(s: &mut TcpStream) -> (u16, usize) {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let head_end = loop {
            if let Some(i) = crate::support::raw::find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            let n = s.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed before the response head");
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let status = head[9..12].parse().unwrap();
        let length: usize = crate::support::raw::header_of(&head, "content-length")
            .expect("content-length")
            .parse()
            .unwrap();
        let mut got = buf.len() - head_end;
        while got < length {
            let n = s.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got += n;
        }
        (status, got)
    }

    /// 40 clients from one address each ask for 20 MB over the shared
    /// HTTP/2 upstream and never read; another client's 1 MB body still comes within 1 s
    /// (2 s allowed for a slow CI). Before the fix (2 MiB stream windows in a 5 MiB
    /// connection window, one connection per target) it got its headers and 0 body bytes
    /// until the readers left. Then the non-readers' upstream streams are reset once their
    /// clients are cut off by `server.send_timeout` (8 s here).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clients_that_do_not_read_do_not_stall_others_on_an_http2_upstream() {
        let (target, sent) = start_bodies_upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let (path, port) = gateway_config(dir.path(), &target);
        let _gw = crate::support::Binary::spawn(&path, port, &[]);

        // A first exchange opens the upstream connection(s).
        let mut warm = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        warm.write_all(b"GET /small HTTP/1.1\r\nHost: h2.test\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(read_response(&mut warm).await, (200, SMALL));

        let mut stalled = Vec::new();
        for _ in 0..40 {
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            s.write_all(b"GET /big HTTP/1.1\r\nHost: h2.test\r\n\r\n")
                .await
                .unwrap();
            stalled.push(s);
        }
        crate::support::wait_until(Duration::from_secs(10), "40 big requests upstream", || {
            sent.bigs.load(Ordering::SeqCst) == 40
        })
        .await;
        // Their responses fill the socket buffers and their streams' windows: wait until
        // the upstream has sent nothing more for 500 ms.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = (sent.bytes.load(Ordering::SeqCst), Instant::now());
        while last.1.elapsed() < Duration::from_millis(500) {
            assert!(Instant::now() < deadline, "the big responses never stopped");
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = sent.bytes.load(Ordering::SeqCst);
            if now != last.0 {
                last = (now, Instant::now());
            }
        }
        eprintln!("the non-readers hold {} MB", last.0 / 1_000_000);

        for round in 0..3 {
            let started = Instant::now();
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            s.write_all(b"GET /small HTTP/1.1\r\nHost: h2.test\r\n\r\n")
                .await
                .unwrap();
            let got = tokio::time::timeout(Duration::from_secs(2), read_response(&mut s)).await;
            assert_eq!(
                got.ok(),
                Some((200, SMALL)),
                "round {round}: the 1 MB body did not come in 2 s while 40 clients did not read"
            );
            eprintln!("round {round}: 1 MB in {:?}", started.elapsed());
        }
        assert_eq!(
            sent.cut.load(Ordering::SeqCst),
            0,
            "no stream reset before send_timeout"
        );
        crate::support::wait_until(
            Duration::from_secs(30),
            "the 40 unread streams reset after send_timeout",
            || sent.cut.load(Ordering::SeqCst) == 40,
        )
        .await;
        drop(stalled);
    }

    // ---- graceful GOAWAY and REFUSED_STREAM ----

    /// What [`start_goaway_upstream`]'s connections did, over all of them.
    #[derive(Default)]
    struct Seen {
        /// Requests answered 200.
        answered: AtomicUsize,
        /// Streams refused with `REFUSED_STREAM`.
        refused: AtomicUsize,
        /// Streams ignored because they came above a `GOAWAY`'s last stream id.
        ignored: AtomicUsize,
        /// Connections accepted.
        connections: AtomicUsize,
    }

    const FRAME_DATA: u8 = 0;
    const FRAME_HEADERS: u8 = 1;
    const FRAME_RST_STREAM: u8 = 3;
    const FRAME_SETTINGS: u8 = 4;
    const FRAME_PING: u8 = 6;
    const FRAME_GOAWAY: u8 = 7;
    const FRAME_WINDOW_UPDATE: u8 = 8;
    const FLAG_END_STREAM: u8 = 0x1;
    const FLAG_ACK: u8 = 0x1;
    const FLAG_END_HEADERS: u8 = 0x4;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// An HTTP/2 (h2c) server on frames, as hypercorn is: it answers each request once its
    /// body has come (`:status 200`, and the body's length in bytes as the body), refuses
    /// every `refuse_every`-th stream with `RST_STREAM(REFUSED_STREAM)` (0: none), and after
    /// `per_connection` accepted streams processes no more: it sends `GOAWAY(NO_ERROR)` with
    /// the last stream id it accepted (when the next stream comes, or 20 ms later), ignores
    /// the streams above it (RFC 9113 §6.8), and closes once the client does (or after
    /// 2 s). Request headers are not decoded: the stream ids are enough.
    async fn start_goaway_upstream(
        per_connection: usize,
        refuse_every: usize,
    ) -> (String, Arc<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Seen::default());
        let all = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                all.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve_frames(
                    stream,
                    per_connection,
                    refuse_every,
                    all.clone(),
                ));
            }
        });
        (format!("http://{addr}"), seen)
    }

    async fn serve_frames(
        s: TcpStream,
        per_connection: usize,
        refuse_every: usize,
        seen: Arc<Seen>,
    ) {
        let _ = s.set_nodelay(true);
        let (mut r, w) = s.into_split();
        let w = Arc::new(tokio::sync::Mutex::new(w));
        let mut preface = [0u8; 24];
        if r.read_exact(&mut preface).await.is_err()
            || &preface != b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        {
            return;
        }
        if w.lock()
            .await
            .write_all(&frame(FRAME_SETTINGS, 0, 0, &[]))
            .await
            .is_err()
        {
            return;
        }
        // Streams accepted (processed), and the last one's id.
        let mut accepted = 0;
        let mut last_accepted = 0u32;
        // Streams refused or accepted.
        let mut streams = 0;
        // Accepted streams whose body is still coming: bytes so far.
        let mut continue_body = std::collections::HashMap::<u32, usize>::new();
        // `:status: 200` (HPACK static index 8), then the request body's length.
        let answer = |stream: u32, got: usize| {
            let mut out = frame(FRAME_HEADERS, FLAG_END_HEADERS, stream, &[0x88]);
            out.extend(frame(
                FRAME_DATA,
                FLAG_END_STREAM,
                stream,
                got.to_string().as_bytes(),
            ));
            out
        };
        // Past `per_connection`: no stream is processed any more; the GOAWAY goes out with
        // the next stream (which it leaves unprocessed, as a server that counts requests
        // as they come does), or 20 ms later.
        let mut going_away = false;
        let goaway_sent = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut give_up = tokio::time::Instant::now() + Duration::from_secs(3600);
        let goaway = |last: u32| {
            let mut payload = last.to_be_bytes().to_vec();
            payload.extend_from_slice(&0u32.to_be_bytes()); // NO_ERROR
            frame(FRAME_GOAWAY, 0, 0, &payload)
        };
        loop {
            let mut head = [0u8; 9];
            match tokio::time::timeout_at(give_up, r.read_exact(&mut head)).await {
                Ok(Ok(_)) => {}
                _ => return,
            }
            let len =
                (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            if r.read_exact(&mut payload).await.is_err() {
                return;
            }
            let mut out = Vec::new();
            match kind {
                FRAME_SETTINGS if flags & FLAG_ACK == 0 => {
                    out.extend(frame(FRAME_SETTINGS, FLAG_ACK, 0, &[]));
                }
                FRAME_PING if flags & FLAG_ACK == 0 => {
                    out.extend(frame(FRAME_PING, FLAG_ACK, 0, &payload));
                }
                FRAME_GOAWAY => return,
                FRAME_HEADERS => {
                    assert!(
                        flags & FLAG_END_HEADERS != 0,
                        "request headers in one frame"
                    );
                    if going_away {
                        // Above the last stream id: never processed.
                        seen.ignored.fetch_add(1, Ordering::SeqCst);
                        if !goaway_sent.swap(true, Ordering::SeqCst) {
                            out.extend(goaway(last_accepted));
                        }
                    } else {
                        streams += 1;
                        if refuse_every > 0 && streams % refuse_every == 0 {
                            seen.refused.fetch_add(1, Ordering::SeqCst);
                            out.extend(frame(FRAME_RST_STREAM, 0, stream, &7u32.to_be_bytes()));
                        } else {
                            accepted += 1;
                            last_accepted = stream;
                            if flags & FLAG_END_STREAM != 0 {
                                out.extend(answer(stream, 0));
                                seen.answered.fetch_add(1, Ordering::SeqCst);
                            } else {
                                continue_body.insert(stream, 0);
                            }
                            if accepted == per_connection {
                                going_away = true;
                                give_up = tokio::time::Instant::now() + Duration::from_secs(2);
                                let (w, sent) = (w.clone(), goaway_sent.clone());
                                let frame = goaway(last_accepted);
                                tokio::spawn(async move {
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                    if !sent.swap(true, Ordering::SeqCst) {
                                        let _ = w.lock().await.write_all(&frame).await;
                                    }
                                });
                            }
                        }
                    }
                }
                FRAME_DATA => {
                    if len > 0 {
                        // The connection's window back at once (streams' windows: a body
                        // here is smaller than the initial 64 KiB).
                        out.extend(frame(
                            FRAME_WINDOW_UPDATE,
                            0,
                            0,
                            &(len as u32).to_be_bytes(),
                        ));
                    }
                    if let Some(got) = continue_body.get_mut(&stream) {
                        *got += len;
                        if flags & FLAG_END_STREAM != 0 {
                            let got = *got;
                            continue_body.remove(&stream);
                            out.extend(answer(stream, got));
                            seen.answered.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                _ => {}
            }
            if !out.is_empty() && w.lock().await.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    /// An HTTP/2 upstream that sends `GOAWAY(NO_ERROR)` with its last
    /// stream id every 50 requests and refuses every 7th stream with `REFUSED_STREAM`,
    /// under 16 concurrent clients (half of them sending `POST`s with a 1,000-byte body,
    /// which is sent again whole): no 502, and the upstream answered exactly as many
    /// requests as the clients got 200s (none processed twice). Before the fix the
    /// requests above the last stream id and the refused ones were answered 502.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_graceful_goaway_and_refused_streams_cost_no_502() {
        let (target, seen) = start_goaway_upstream(50, 7).await;
        let dir = tempfile::tempdir().unwrap();
        let (path, port) = gateway_config(dir.path(), &target);
        let gw = crate::support::Binary::spawn(&path, port, &[]);

        let url = format!("http://127.0.0.1:{port}/x");
        let mut tasks = Vec::new();
        for client in 0..16 {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
                let (method, body) = match client % 2 {
                    0 => ("GET", Bytes::new()),
                    _ => ("POST", Bytes::from(vec![b'p'; 1000])),
                };
                let mut statuses = Vec::new();
                for _ in 0..40 {
                    let req = Request::builder()
                        .method(method)
                        .uri(&url)
                        .body(Full::new(body.clone()))
                        .unwrap();
                    let resp = http.request(req).await.unwrap();
                    let status = resp.status().as_u16();
                    let got = resp.into_body().collect().await.unwrap().to_bytes();
                    let expected = body.len().to_string();
                    statuses.push((status, String::from_utf8_lossy(&got).into_owned(), expected));
                }
                statuses
            }));
        }
        let mut ok = 0;
        let mut other = Vec::new();
        for t in tasks {
            for (status, body, expected) in t.await.unwrap() {
                if status == 200 && body == expected {
                    ok += 1;
                } else {
                    other.push((status, body));
                }
            }
        }
        let (answered, refused, ignored, connections) = (
            seen.answered.load(Ordering::SeqCst),
            seen.refused.load(Ordering::SeqCst),
            seen.ignored.load(Ordering::SeqCst),
            seen.connections.load(Ordering::SeqCst),
        );
        eprintln!(
            "200s {ok}; upstream: answered {answered}, refused {refused}, ignored above GOAWAY \
             {ignored}, connections {connections}"
        );
        assert!(
            other.is_empty(),
            "{} requests not answered 200: {:?}\n{}",
            other.len(),
            &other[..other.len().min(5)],
            gw.logs()
        );
        assert_eq!(ok, 640);
        assert_eq!(answered, ok, "the upstream answered each request once");
        assert!(
            connections >= 640 / 50,
            "GOAWAY every 50 requests: {connections} connections"
        );
        assert!(refused > 0, "some streams were refused");
    }
}
