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

mod h2_upstream;
