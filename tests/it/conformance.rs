//! HTTP conformance of the proxy path, each against real processes: trailers
//! and gRPC end to end (a tonic client and a tonic server, over h2c and TLS), large
//! response heads from HTTP/2 and HTTP/1.1 upstreams, `Via` and `Max-Forwards`, ALPN
//! deciding the protocol on TLS, TLS session tickets and OCSP stapling, 1xx (`103 Early
//! Hints`, `102`) to HTTP/1.1 and HTTP/2 clients.

use crate::support;
use crate::support::TestGateway;
use bytes::{Buf, BufMut, Bytes};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type BoxBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

// ---- an upstream that shows what it received and sends what a test asks ----

/// A hyper upstream (HTTP/1.1 and h2c on one port):
/// - `/big/N`: a response header `x-big` of N bytes;
/// - `/trailers`: body `hello`, declared trailer `x-checksum: abc`;
/// - `/echo`: the request's body; `/slow`: `slow ok` after 600 ms;
/// - anything else: 200, echoing the request's `Via`, `Max-Forwards` and `TE` as
///   `x-seen-via` (values joined by `|`), `x-seen-max-forwards`, `x-seen-te`.
struct Origin {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn origin_answer(req: Request<Incoming>) -> Response<BoxBody> {
    let path = req.uri().path().to_string();
    if path == "/echo" {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        return Response::new(Full::new(body).boxed());
    }
    if path == "/slow" {
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
        return Response::new(Full::new(Bytes::from_static(b"slow ok")).boxed());
    }
    if let Some(n) = path.strip_prefix("/big/") {
        let n: usize = n.parse().unwrap();
        return Response::builder()
            .header("x-big", "a".repeat(n))
            .body(Full::new(Bytes::from_static(b"big")).boxed())
            .unwrap();
    }
    let seen = |name: &str| {
        req.headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect::<Vec<_>>()
            .join("|")
    };
    let (via, mf, te) = (seen("via"), seen("max-forwards"), seen("te"));
    if path == "/trailers" {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-checksum", "abc".parse().unwrap());
        let frames = vec![
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"hello"))),
            Ok(Frame::trailers(trailers)),
        ];
        return Response::builder()
            .header("trailer", "x-checksum")
            .header("x-seen-te", te)
            .body(StreamBody::new(futures_util::stream::iter(frames)).boxed())
            .unwrap();
    }
    Response::builder()
        .header("x-seen-via", via)
        .header("x-seen-max-forwards", mf)
        .header("x-seen-te", te)
        .body(Full::new(Bytes::from_static(b"ok")).boxed())
        .unwrap()
}

async fn start_origin() -> Origin {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let h = h.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    h.fetch_add(1, Ordering::SeqCst);
                    async move { Ok::<_, Infallible>(origin_answer(req).await) }
                });
                let mut builder = auto::Builder::new(TokioExecutor::new());
                builder.http2().max_header_list_size(1 << 20);
                let _ = builder.serve_connection(TokioIo::new(stream), svc).await;
            });
        }
    });
    Origin { addr, hits, task }
}

fn config(target: &str, server_extra: &str, upstream_extra: &str, quota: u64) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
{server_extra}

[[upstreams]]
name = "origin"
targets = ["{target}"]
connect_timeout = "1s"
response_timeout = "5s"
{upstream_extra}

[[limits]]
name = "core"
window = "1h"
quota = {{ anonymous = {quota} }}

[[routes]]
path_prefix = "/"
upstream = "origin"
limits = ["core"]
"#
    )
}

/// One request through `client`; the response with its body and trailers read.
async fn send<C>(
    client: &Client<C, Empty<Bytes>>,
    req: Request<Empty<Bytes>>,
) -> (http::response::Parts, Bytes, Option<http::HeaderMap>)
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    let resp = client.request(req).await.expect("request to the gateway");
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.expect("response body");
    let trailers = collected.trailers().cloned();
    (parts, collected.to_bytes(), trailers)
}

fn h1_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

// ---- 3. large response heads ----

#[tokio::test]
async fn large_response_heads_pass_up_to_max_response_header_bytes_on_h1_and_h2() {
    let origin = start_origin().await;
    let target = format!("http://{}", origin.addr);
    let client = h1_client();
    for protocol in ["http1", "http2"] {
        let upstream = format!("protocol = \"{protocol}\"");
        let gw = TestGateway::start(&config(&target, "", &upstream, 1000)).await;
        // 20 KB and 60 KB pass under the default 64 KiB, over either protocol.
        for n in [20_000, 60_000] {
            let req = Request::get(gw.url(&format!("/big/{n}")))
                .body(Empty::new())
                .unwrap();
            let (parts, body, _) = send(&client, req).await;
            assert_eq!(parts.status, StatusCode::OK, "{protocol} {n}");
            assert_eq!(parts.headers["x-big"].len(), n, "{protocol}");
            assert_eq!(&body[..], b"big");
        }
        // Past the limit: 502 over either protocol, the same line for both.
        let req = Request::get(gw.url("/big/70000"))
            .body(Empty::new())
            .unwrap();
        let (parts, _, _) = send(&client, req).await;
        assert_eq!(parts.status, StatusCode::BAD_GATEWAY, "{protocol}");
        drop(gw);

        // A higher limit lets it through.
        let upstream = format!("{upstream}\nmax_response_header_bytes = 131072");
        let gw = TestGateway::start(&config(&target, "", &upstream, 1000)).await;
        let req = Request::get(gw.url("/big/70000"))
            .body(Empty::new())
            .unwrap();
        let (parts, _, _) = send(&client, req).await;
        assert_eq!(
            parts.status,
            StatusCode::OK,
            "{protocol} with a higher limit"
        );
        assert_eq!(parts.headers["x-big"].len(), 70_000);
    }
}

#[tokio::test]
async fn a_response_header_limit_under_1024_and_a_via_that_is_no_token_are_config_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.toml");
    let text = config(
        "http://127.0.0.1:9",
        "",
        "max_response_header_bytes = 100",
        10,
    );
    std::fs::write(&path, text).unwrap();
    let (code, _, err) = support::check(&path);
    assert_eq!(code, 1);
    assert!(
        err.contains("upstreams[0].max_response_header_bytes") && err.contains("1024"),
        "{err}"
    );
    // A Via pseudonym must be a token.
    std::fs::write(
        &path,
        config("http://127.0.0.1:9", "via = \"my gateway\"", "", 10),
    )
    .unwrap();
    let (code, _, err) = support::check(&path);
    assert_eq!(code, 1);
    assert!(
        err.contains("server.via") && err.contains("not a token"),
        "{err}"
    );
}

// ---- 4. Via and Max-Forwards ----

#[tokio::test]
async fn via_names_the_gateway_both_ways_in_the_version_received() {
    let origin = start_origin().await;
    let target = format!("http://{}", origin.addr);
    let gw = TestGateway::start(&config(&target, "", "", 1000)).await;
    let req = Request::get(gw.url("/v"))
        .header("via", "1.0 fred")
        .body(Empty::new())
        .unwrap();
    let (parts, _, _) = send(&h1_client(), req).await;
    assert_eq!(parts.status, StatusCode::OK);
    assert_eq!(parts.headers["x-seen-via"], "1.0 fred|1.1 tollgate");
    assert_eq!(parts.headers["via"], "1.1 tollgate");

    // A client over HTTP/2 is "2" on the way up; an HTTP/2 upstream's answer is "2" on
    // the way back.
    let req = Request::get(gw.url("/v")).body(Empty::new()).unwrap();
    let (parts, _, _) = send(&support::h2_client(), req).await;
    assert_eq!(parts.headers["x-seen-via"], "2 tollgate");
    drop(gw);
    let gw = TestGateway::start(&config(&target, "", "protocol = \"http2\"", 1000)).await;
    let req = Request::get(gw.url("/v")).body(Empty::new()).unwrap();
    let (parts, _, _) = send(&h1_client(), req).await;
    assert_eq!(parts.headers["x-seen-via"], "1.1 tollgate");
    assert_eq!(parts.headers["via"], "2 tollgate");
    drop(gw);

    // A pseudonym, and off.
    let gw = TestGateway::start(&config(&target, "via = \"edge-1\"", "", 1000)).await;
    let req = Request::get(gw.url("/v")).body(Empty::new()).unwrap();
    let (parts, _, _) = send(&h1_client(), req).await;
    assert_eq!(parts.headers["x-seen-via"], "1.1 edge-1");
    assert_eq!(parts.headers["via"], "1.1 edge-1");
    drop(gw);
    let gw = TestGateway::start(&config(&target, "via = false", "", 1000)).await;
    let req = Request::get(gw.url("/v"))
        .header("via", "1.0 fred")
        .body(Empty::new())
        .unwrap();
    let (parts, _, _) = send(&h1_client(), req).await;
    assert_eq!(parts.headers["x-seen-via"], "1.0 fred");
    assert!(parts.headers.get("via").is_none());
}

#[tokio::test]
async fn max_forwards_counts_down_and_zero_is_answered_by_the_gateway() {
    let origin = start_origin().await;
    let target = format!("http://{}", origin.addr);
    let gw = TestGateway::start(&config(&target, "", "", 1000)).await;
    let client = h1_client();
    let req = |method: &str, mf: &str| {
        Request::builder()
            .method(method)
            .uri(gw.url("/mf"))
            .header("max-forwards", mf)
            .header("cookie", "session=secret")
            .header("x-note", "kept")
            .body(Empty::new())
            .unwrap()
    };
    let (parts, _, _) = send(&client, req("OPTIONS", "3")).await;
    assert_eq!(parts.status, StatusCode::OK);
    assert_eq!(parts.headers["x-seen-max-forwards"], "2");
    // Other methods pass it untouched.
    let (parts, _, _) = send(&client, req("GET", "3")).await;
    assert_eq!(parts.headers["x-seen-max-forwards"], "3");
    let hits = origin.hits.load(Ordering::SeqCst);

    let (parts, body, _) = send(&client, req("OPTIONS", "0")).await;
    assert_eq!(parts.status, StatusCode::OK);
    assert!(parts.headers["allow"].to_str().unwrap().contains("GET"));
    assert!(body.is_empty());
    let (parts, body, _) = send(&client, req("TRACE", "0")).await;
    assert_eq!(parts.status, StatusCode::OK);
    assert_eq!(parts.headers["content-type"], "message/http");
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(body.starts_with("TRACE /mf HTTP/1.1\r\n"), "{body}");
    assert!(body.contains("x-note: kept"), "{body}");
    assert!(!body.to_ascii_lowercase().contains("secret"), "{body}");
    assert_eq!(
        origin.hits.load(Ordering::SeqCst),
        hits,
        "answered by the gateway, never forwarded"
    );
}

// ---- 2. trailers ----

#[tokio::test]
async fn trailers_reach_an_http1_client_that_sent_te_trailers() {
    let origin = start_origin().await;
    let target = format!("http://{}", origin.addr);
    for protocol in ["http1", "http2"] {
        let upstream = format!("protocol = \"{protocol}\"");
        let gw = TestGateway::start(&config(&target, "", &upstream, 1000)).await;
        let req = Request::get(gw.url("/trailers"))
            .header("te", "trailers")
            .body(Empty::new())
            .unwrap();
        let (parts, body, trailers) = send(&h1_client(), req).await;
        assert_eq!(parts.status, StatusCode::OK, "{protocol}");
        assert_eq!(&body[..], b"hello");
        assert_eq!(parts.headers["trailer"], "x-checksum", "{protocol}");
        assert_eq!(parts.headers["x-seen-te"], "trailers", "{protocol}");
        let trailers = trailers.unwrap_or_else(|| panic!("{protocol}: no trailers"));
        assert_eq!(trailers["x-checksum"], "abc", "{protocol}");

        // Only `trailers` goes on, and only when asked for.
        let req = Request::get(gw.url("/te"))
            .header("te", "gzip")
            .body(Empty::new())
            .unwrap();
        let (parts, _, _) = send(&h1_client(), req).await;
        assert_eq!(parts.headers["x-seen-te"], "", "{protocol}");
    }
}

// ---- 2. gRPC end to end ----

/// Messages as raw bytes: no protobuf, no codegen.
#[derive(Clone, Copy, Default)]
struct Raw;

impl tonic::codec::Encoder for Raw {
    type Item = Bytes;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Bytes,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for Raw {
    type Item = Bytes;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Bytes>, tonic::Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl tonic::codec::Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

/// `/test.Echo/Unary`: answers `echo: MSG`.
#[derive(Clone)]
struct Unary;

impl tower_service::Service<tonic::Request<Bytes>> for Unary {
    type Response = tonic::Response<Bytes>;
    type Error = tonic::Status;
    type Future = std::future::Ready<Result<tonic::Response<Bytes>, tonic::Status>>;
    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), tonic::Status>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: tonic::Request<Bytes>) -> Self::Future {
        let mut out = b"echo: ".to_vec();
        out.extend_from_slice(req.get_ref());
        let mut response = tonic::Response::new(Bytes::from(out));
        response
            .metadata_mut()
            .insert("x-served-by", "tonic".parse().unwrap());
        std::future::ready(Ok(response))
    }
}

type Messages = futures_util::stream::Iter<std::vec::IntoIter<Result<Bytes, tonic::Status>>>;

/// `/test.Echo/Count`: streams `N` messages (`0`, `1`, ...), then ends with
/// `grpc-status` 11 (OUT_OF_RANGE), message `done at N` and trailer `x-count: N`: a
/// status that can only arrive in trailers, after the data.
#[derive(Clone)]
struct Count;

impl tower_service::Service<tonic::Request<Bytes>> for Count {
    type Response = tonic::Response<Messages>;
    type Error = tonic::Status;
    type Future = std::future::Ready<Result<tonic::Response<Messages>, tonic::Status>>;
    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), tonic::Status>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: tonic::Request<Bytes>) -> Self::Future {
        let n: usize = std::str::from_utf8(req.get_ref()).unwrap().parse().unwrap();
        let mut items: Vec<Result<Bytes, tonic::Status>> =
            (0..n).map(|i| Ok(Bytes::from(i.to_string()))).collect();
        let mut metadata = tonic::metadata::MetadataMap::new();
        metadata.insert("x-count", n.to_string().parse().unwrap());
        items.push(Err(tonic::Status::with_metadata(
            tonic::Code::OutOfRange,
            format!("done at {n}"),
            metadata,
        )));
        std::future::ready(Ok(tonic::Response::new(futures_util::stream::iter(items))))
    }
}

/// A gRPC server: tonic's server side over hyper's HTTP/2 (h2c), on a free port.
async fn start_grpc_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let mut grpc = tonic::server::Grpc::new(Raw);
                    let response = match req.uri().path() {
                        "/test.Echo/Unary" => grpc.unary(Unary, req).await,
                        "/test.Echo/Count" => grpc.server_streaming(Count, req).await,
                        _ => tonic::Status::unimplemented("no such method").into_http(),
                    };
                    Ok::<_, Infallible>(response)
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, task)
}

type GrpcClient = tonic::client::Grpc<tonic::transport::Channel>;

async fn unary(
    client: &mut GrpcClient,
    msg: &'static str,
) -> Result<tonic::Response<Bytes>, tonic::Status> {
    client.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/test.Echo/Unary");
    client
        .unary(
            tonic::Request::new(Bytes::from_static(msg.as_bytes())),
            path,
            Raw,
        )
        .await
}

/// Unary and server-streaming calls through the gateway: replies, response metadata
/// and trailers (`grpc-status`, `grpc-message`, custom) intact, rate limited like any
/// request (`quota` calls, then `RESOURCE_EXHAUSTED` with the `X-RateLimit-*` headers).
async fn grpc_through(channel: tonic::transport::Channel, quota: u64) {
    let mut client = tonic::client::Grpc::new(channel);
    let reply = unary(&mut client, "hi").await.expect("unary call");
    assert_eq!(&reply.get_ref()[..], b"echo: hi");
    assert_eq!(reply.metadata().get("x-served-by").unwrap(), "tonic");
    let remaining: u64 = reply
        .metadata()
        .get("x-ratelimit-remaining")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(remaining, quota - 1);

    client.ready().await.unwrap();
    let path = http::uri::PathAndQuery::from_static("/test.Echo/Count");
    let mut stream = client
        .server_streaming(tonic::Request::new(Bytes::from_static(b"3")), path, Raw)
        .await
        .expect("server-streaming call")
        .into_inner();
    let mut got = Vec::new();
    let status = loop {
        match stream.message().await {
            Ok(Some(m)) => got.push(String::from_utf8(m.to_vec()).unwrap()),
            Ok(None) => panic!("the stream ended without its status"),
            Err(status) => break status,
        }
    };
    assert_eq!(got, ["0", "1", "2"]);
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    assert_eq!(status.message(), "done at 3");
    assert_eq!(status.metadata().get("x-count").unwrap(), "3");

    // Charged like any request: the quota runs out, and the next call is refused as
    // gRPC refuses over quota.
    for _ in 2..quota {
        unary(&mut client, "more").await.expect("within the quota");
    }
    let refused = unary(&mut client, "one too many").await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("429"), "{refused:?}");
    let md = refused.metadata();
    assert_eq!(md.get("x-ratelimit-remaining").unwrap(), "0");
    assert!(md.get("retry-after").is_some());
}

#[tokio::test]
async fn grpc_unary_and_server_streaming_through_the_gateway_over_h2c() {
    let (addr, task) = start_grpc_server().await;
    let gw = TestGateway::start(&config(
        &format!("http://{addr}"),
        "",
        "protocol = \"http2\"",
        5,
    ))
    .await;
    let channel = tonic::transport::Endpoint::from_shared(gw.url(""))
        .unwrap()
        .connect()
        .await
        .expect("connect over h2c");
    grpc_through(channel, 5).await;
    task.abort();
}

// ---- TLS: a CA, a certificate for localhost ----

struct Pki {
    dir: tempfile::TempDir,
    ca_pem: String,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "conformance CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("cert.pem"), leaf.pem()).unwrap();
        std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).unwrap();
        Pki {
            dir,
            ca_pem: ca.pem(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn tls_toml(&self, extra: &str) -> String {
        format!(
            "[server.tls]\ncert = \"{}\"\nkey = \"{}\"\n{extra}\n",
            self.path("cert.pem").display(),
            self.path("key.pem").display()
        )
    }

    fn root_store(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        let der = rustls::pki_types::CertificateDer::from_pem_slice(self.ca_pem.as_bytes());
        roots.add(der.unwrap()).unwrap();
        roots
    }

    /// A client of `version` only, with ALPN `http/1.1` and its own resumption store.
    fn http1_client(
        &self,
        version: &'static rustls::SupportedProtocolVersion,
    ) -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[version])
            .unwrap()
            .with_root_certificates(self.root_store())
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }

    fn client_config(&self, alpn: &[&str]) -> rustls::ClientConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(self.root_store())
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
        config
    }
}

use rustls::pki_types::pem::PemObject;

/// A gateway whose `[server]` has `[server.tls]` (after the other server keys).
fn tls_config(
    target: &str,
    pki: &Pki,
    tls_extra: &str,
    upstream_extra: &str,
    quota: u64,
) -> String {
    config(target, "", upstream_extra, quota).replacen(
        "\n[[upstreams]]",
        &format!("{}\n[[upstreams]]", pki.tls_toml(tls_extra)),
        1,
    )
}

#[tokio::test]
async fn grpc_unary_and_server_streaming_through_the_gateway_over_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = Pki::new();
    let (addr, task) = start_grpc_server().await;
    let gw = TestGateway::start(&tls_config(
        &format!("http://{addr}"),
        &pki,
        "",
        "protocol = \"http2\"",
        4,
    ))
    .await;
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    let channel =
        tonic::transport::Endpoint::from_shared(format!("https://localhost:{}", gw.addr.port()))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
            .expect("connect over TLS");
    grpc_through(channel, 4).await;
    task.abort();
}

/// Write `bytes` on `stream` and read until the peer closes or `limit` passes.
async fn exchange<S>(stream: &mut S, bytes: &[u8]) -> Vec<u8>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Err(_) | Ok(Err(_)) => return out,
            Ok(Ok(n)) => {
                out.extend_from_slice(&buf[..n]);
                if out.windows(4).any(|w| w == b"\r\n\r\n") && out.starts_with(b"HTTP/1.1") {
                    return out;
                }
            }
        }
    }
}

/// The frame types in `bytes` read as a sequence of HTTP/2 frames (9-byte headers).
fn h2_frame_types(bytes: &[u8]) -> Vec<u8> {
    let mut types = Vec::new();
    let mut at = 0;
    while at + 9 <= bytes.len() {
        let len = usize::from(bytes[at]) << 16
            | usize::from(bytes[at + 1]) << 8
            | usize::from(bytes[at + 2]);
        types.push(bytes[at + 3]);
        at += 9 + len;
    }
    types
}

async fn tls_connect(
    addr: SocketAddr,
    config: impl Into<Arc<rustls::ClientConfig>>,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(config.into())
        .connect(name, tcp)
        .await
        .expect("TLS handshake")
}

// ---- 5. ALPN decides the protocol ----

#[tokio::test]
async fn alpn_decides_the_protocol_on_tls() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = Pki::new();
    let origin = start_origin().await;
    let gw = TestGateway::start(&tls_config(
        &format!("http://{}", origin.addr),
        &pki,
        "",
        "",
        1000,
    ))
    .await;
    let request = b"GET /alpn HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

    // Negotiated h2: an HTTP/1.1 request is an invalid preface: SETTINGS, then
    // GOAWAY (h2spec http2/3.5/2), never an HTTP/1.1 answer.
    let mut h2 = tls_connect(gw.addr, pki.client_config(&["h2"])).await;
    assert_eq!(h2.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let out = exchange(&mut h2, request).await;
    assert!(
        !out.starts_with(b"HTTP/1.1"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    let types = h2_frame_types(&out);
    assert!(types.contains(&0x7), "no GOAWAY in frames {types:?}");

    // Negotiated http/1.1: an HTTP/2 preface is not served as HTTP/2.
    let mut h1 = tls_connect(gw.addr, pki.client_config(&["http/1.1"])).await;
    let out = exchange(&mut h1, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    assert!(
        out.is_empty() || out.starts_with(b"HTTP/1.1 4") || out.starts_with(b"HTTP/1.1 505"),
        "{:?}",
        String::from_utf8_lossy(&out)
    );
    assert!(!h2_frame_types(&out).contains(&0x4) || out.starts_with(b"HTTP/1.1"));
    // ... and HTTP/1.1 is.
    let mut h1 = tls_connect(gw.addr, pki.client_config(&["http/1.1"])).await;
    let out = exchange(&mut h1, request).await;
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );

    // No ALPN at all: the first bytes decide, as on cleartext.
    let mut none = tls_connect(gw.addr, pki.client_config(&[])).await;
    let out = exchange(&mut none, request).await;
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
}

// ---- 6. session tickets and OCSP stapling ----

/// One HTTP/1.1 request on a new TLS connection made with `config` (whose resumption
/// store carries sessions from one connection to the next); how the handshake went.
async fn handshake_kind(
    addr: SocketAddr,
    config: &Arc<rustls::ClientConfig>,
) -> rustls::HandshakeKind {
    let mut tls = tls_connect(addr, config.clone()).await;
    let out = exchange(
        &mut tls,
        b"GET /t HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    // Read on to the close: TLS 1.3 tickets come after the handshake.
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        tls.read_to_end(&mut rest),
    )
    .await;
    tls.get_ref().1.handshake_kind().unwrap()
}

#[tokio::test]
async fn sessions_resume_by_stateless_ticket_on_tls12_and_tls13_across_a_reload() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = Pki::new();
    let origin = start_origin().await;
    let target = format!("http://{}", origin.addr);
    let text = tls_config(&target, &pki, "", "", 1000);
    let gw = TestGateway::start(&text).await;
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        let config = pki.http1_client(version);
        assert_eq!(
            handshake_kind(gw.addr, &config).await,
            rustls::HandshakeKind::Full
        );
        assert_eq!(
            handshake_kind(gw.addr, &config).await,
            rustls::HandshakeKind::Resumed,
            "{version:?}"
        );
        // A reload builds a new TLS config with a new, empty session cache: a session
        // id is forgotten, a ticket still resumes.
        let changed = text.replace(
            "quota = { anonymous = 1000 }",
            "quota = { anonymous = 999 }",
        );
        gw.reload(&changed).unwrap();
        assert_eq!(
            handshake_kind(gw.addr, &config).await,
            rustls::HandshakeKind::Resumed,
            "{version:?} after a reload"
        );
        gw.reload(&text).unwrap();
    }
}

/// A server certificate verifier that keeps the stapled OCSP response it was shown.
#[derive(Debug)]
struct Stapled {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    seen: std::sync::Mutex<Vec<u8>>,
}

impl rustls::client::danger::ServerCertVerifier for Stapled {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        *self.seen.lock().unwrap() = ocsp_response.to_vec();
        self.inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The OCSP response stapled to a fresh handshake with the gateway.
async fn stapled(
    addr: SocketAddr,
    pki: &Pki,
    version: &'static rustls::SupportedProtocolVersion,
) -> Vec<u8> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(pki.root_store()),
        provider.clone(),
    )
    .build()
    .unwrap();
    let verifier = Arc::new(Stapled {
        inner,
        seen: Default::default(),
    });
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[version])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(verifier.clone())
        .with_no_client_auth();
    let _tls = tls_connect(addr, config).await;
    let seen = verifier.seen.lock().unwrap().clone();
    seen
}

#[tokio::test]
async fn the_ocsp_response_is_stapled_and_reloads_with_the_certificate() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = Pki::new();
    let origin = start_origin().await;
    let ocsp = pki.path("ocsp.der");
    std::fs::write(&ocsp, b"first OCSP response (DER)").unwrap();
    let extra = format!("ocsp = \"{}\"", ocsp.display());
    let text = tls_config(&format!("http://{}", origin.addr), &pki, &extra, "", 1000);
    let gw = TestGateway::start(&text).await;
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        assert_eq!(
            stapled(gw.addr, &pki, version).await,
            b"first OCSP response (DER)"
        );
    }
    std::fs::write(&ocsp, b"second OCSP response (DER)").unwrap();
    gw.reload(&text).unwrap();
    assert_eq!(
        stapled(gw.addr, &pki, &rustls::version::TLS13).await,
        b"second OCSP response (DER)"
    );
    // Without `ocsp`, nothing is stapled; an unreadable file is a config error.
    drop(gw);
    let plain = tls_config(&format!("http://{}", origin.addr), &pki, "", "", 1000);
    let gw = TestGateway::start(&plain).await;
    assert!(stapled(gw.addr, &pki, &rustls::version::TLS13)
        .await
        .is_empty());
    std::fs::remove_file(&ocsp).unwrap();
    let err = gw.reload(&text).unwrap_err().to_string();
    assert!(err.contains("server.tls.ocsp"), "{err}");
}

/// Server-side CPU of one handshake, full and resumed by ticket, in microseconds: the
/// gateway's own TLS config (`Tls::build`), a rustls client, both in memory; only the
/// server's calls are timed. For BENCHMARKS.md:
/// `cargo test --release --test it conformance::handshake_cpu -- --ignored --nocapture`.
#[test]
#[ignore]
fn handshake_cpu() {
    use rustls::{ClientConnection, ServerConnection};
    let pki = Pki::new();
    let cfg = tollgate::config::TlsConfig {
        cert: "cert.pem".into(),
        key: "key.pem".into(),
        sni: Vec::new(),
        handshake_timeout: tollgate::config::Dur::from_secs(10),
        client_ca: None,
        client_auth: None,
        ocsp: None,
        ticket_keys: None,
    };
    let mut problems = tollgate::config::Problems::default();
    let files =
        tollgate::config::Files::read(tollgate::config::files::server_tls(&cfg, pki.dir.path()));
    let tls = tollgate::tls::Tls::build(&cfg, pki.dir.path(), &files, &mut problems).unwrap();
    let server_config = tls.acceptor().config().clone();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();

    // One handshake (and the tickets after it); the server's time.
    let handshake = |client_config: &Arc<rustls::ClientConfig>| {
        let mut client = ClientConnection::new(client_config.clone(), name.clone()).unwrap();
        let mut server = ServerConnection::new(server_config.clone()).unwrap();
        let mut spent = std::time::Duration::ZERO;
        let mut buf = Vec::new();
        for _ in 0..10 {
            buf.clear();
            client.write_tls(&mut buf).unwrap();
            let t = std::time::Instant::now();
            server.read_tls(&mut &buf[..]).unwrap();
            server.process_new_packets().unwrap();
            buf.clear();
            server.write_tls(&mut buf).unwrap();
            spent += t.elapsed();
            client.read_tls(&mut &buf[..]).unwrap();
            client.process_new_packets().unwrap();
            if !client.is_handshaking() && !server.is_handshaking() && !server.wants_write() {
                break;
            }
        }
        (spent, client.handshake_kind().unwrap())
    };
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        let client = |resume: bool| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut c = rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[version])
                .unwrap()
                .with_root_certificates(pki.root_store())
                .with_no_client_auth();
            if !resume {
                c.resumption = rustls::client::Resumption::disabled();
            }
            Arc::new(c)
        };
        let n = 500u32;
        let full = client(false);
        let mut total = std::time::Duration::ZERO;
        for _ in 0..n {
            let (spent, kind) = handshake(&full);
            assert_eq!(kind, rustls::HandshakeKind::Full);
            total += spent;
        }
        let full_us = total.as_secs_f64() * 1e6 / f64::from(n);
        let resuming = client(true);
        handshake(&resuming);
        let mut total = std::time::Duration::ZERO;
        for _ in 0..n {
            let (spent, kind) = handshake(&resuming);
            assert_eq!(kind, rustls::HandshakeKind::Resumed);
            total += spent;
        }
        let resumed_us = total.as_secs_f64() * 1e6 / f64::from(n);
        println!(
            "{version:?}: server CPU per handshake: full {full_us:.0} µs, resumed {resumed_us:.0} µs ({:.0}% saved)",
            100.0 * (1.0 - resumed_us / full_us)
        );
    }
}

// ---- 1. 1xx responses ----

/// A raw HTTP/1.1 upstream: to every request, `102 Processing`, then `103 Early Hints`
/// with a `Link`, then (after 400 ms) `200` with body `ok`.
async fn start_early_hints_upstream() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut got = Vec::new();
                loop {
                    let n = match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    got.extend_from_slice(&buf[..n]);
                    while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..end + 4);
                        let interim = "HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\nConnection: x-hop\r\nx-hop: 1\r\n\r\n";
                        if stream.write_all(interim.as_bytes()).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
                        let last = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if stream.write_all(last.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, task)
}

/// Read from `stream` until `needle` has arrived (or 3 s pass); all bytes read.
async fn read_until<S: tokio::io::AsyncRead + Unpin>(stream: &mut S, needle: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
    while !out.windows(needle.len()).any(|w| w == needle) {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    out
}

/// On one HTTP/1.1 connection (two requests, to show it stays in step): the 1xx
/// responses arrive before the upstream has sent its final response, then the 200.
async fn early_hints_over<S>(stream: &mut S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    for _ in 0..2 {
        let started = tokio::time::Instant::now();
        stream
            .write_all(b"GET /hints HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let early = read_until(stream, b"rel=preload\r\n\r\n").await;
        let text = String::from_utf8_lossy(&early).to_string();
        assert!(
            started.elapsed() < std::time::Duration::from_millis(350),
            "the 1xx waited for the final response: {text}"
        );
        assert!(
            text.starts_with("HTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"),
            "{text:?}"
        );
        assert!(
            !text.contains("x-hop"),
            "hop-by-hop headers of a 1xx are dropped: {text:?}"
        );
        let rest = read_until(stream, b"\r\n\r\nok").await;
        let text = String::from_utf8_lossy(&rest).to_string();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text:?}");
    }
}

/// On one HTTP/2 connection (`io`, cleartext with prior knowledge or TLS `h2`; two
/// requests, each on its own stream): `102`, then `103` with its `Link` (and nothing
/// else: the upstream's hop-by-hop `x-hop` is dropped) arrive as HEADERS before the
/// upstream has sent its final response, then the `200` with body `ok`.
async fn early_hints_over_h2<S>(io: S, scheme: &str)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (client, conn) = h2::client::handshake(io).await.expect("HTTP/2 handshake");
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client;
    for _ in 0..2 {
        client = client.ready().await.unwrap();
        let started = tokio::time::Instant::now();
        let req = Request::get(format!("{scheme}://localhost/hints"))
            .body(())
            .unwrap();
        let (mut response, _) = client.send_request(req, true).unwrap();
        let mut interim = Vec::new();
        let last = std::future::poll_fn(|cx| {
            while let std::task::Poll::Ready(Some(got)) = response.poll_informational(cx) {
                interim.push((got.expect("a 1xx"), started.elapsed()));
            }
            std::future::Future::poll(std::pin::Pin::new(&mut response), cx)
        })
        .await
        .expect("the final response");
        let statuses: Vec<u16> = interim.iter().map(|(r, _)| r.status().as_u16()).collect();
        assert_eq!(statuses, [102, 103], "{interim:?}");
        for (r, at) in &interim {
            assert!(
                *at < std::time::Duration::from_millis(350),
                "the {} waited for the final response ({at:?})",
                r.status()
            );
        }
        let hints = interim[1].0.headers();
        assert_eq!(hints.get("link").unwrap(), "</style.css>; rel=preload");
        assert_eq!(
            hints.len(),
            1,
            "hop-by-hop headers of a 1xx are dropped: {hints:?}"
        );
        assert!(interim[0].0.headers().is_empty(), "{interim:?}");
        assert_eq!(last.status(), StatusCode::OK);
        let mut body = last.into_body();
        let mut got = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.unwrap();
            let _ = body.flow_control().release_capacity(chunk.len());
            got.extend_from_slice(&chunk);
        }
        assert_eq!(&got[..], b"ok");
    }
    drop(client);
    conn.abort();
}

#[tokio::test]
async fn early_hints_and_other_1xx_reach_http1_and_http2_clients_before_the_final_response() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (addr, task) = start_early_hints_upstream().await;
    let pki = Pki::new();
    let target = format!("http://{addr}");

    // Cleartext HTTP/1.1.
    let gw = TestGateway::start(&config(&target, "", "", 1000)).await;
    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    early_hints_over(&mut tcp).await;

    // HTTP/1.0 clients never get a 1xx (RFC 9110 §15.2).
    let mut old = TcpStream::connect(gw.addr).await.unwrap();
    old.write_all(b"GET /hints HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut all = Vec::new();
    let _ =
        tokio::time::timeout(std::time::Duration::from_secs(3), old.read_to_end(&mut all)).await;
    let text = String::from_utf8_lossy(&all);
    assert!(text.starts_with("HTTP/1.0 200 OK\r\n"), "{text:?}");

    // HTTP/2 with prior knowledge: the 1xx on each stream, before its 200.
    early_hints_over_h2(TcpStream::connect(gw.addr).await.unwrap(), "http").await;
    // A client that does not read 1xx (hyper's) gets the final response intact.
    let req = Request::get(gw.url("/hints")).body(Empty::new()).unwrap();
    let (parts, body, _) = send(&support::h2_client(), req).await;
    assert_eq!(parts.status, StatusCode::OK);
    assert_eq!(&body[..], b"ok");
    drop(gw);

    // HTTP/1.1 and HTTP/2 over TLS.
    let gw = TestGateway::start(&tls_config(&target, &pki, "", "", 1000)).await;
    let mut tls = tls_connect(gw.addr, pki.client_config(&["http/1.1"])).await;
    early_hints_over(&mut tls).await;
    let tls = tls_connect(gw.addr, pki.client_config(&["h2"])).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    early_hints_over_h2(tls, "https").await;
    task.abort();
}

/// An HTTP/2 (h2c) upstream on the h2 crate's server: to every request, `102
/// Processing`, then `103 Early Hints` with a `Link`, then (after 400 ms) `200` with
/// body `ok`.
async fn start_early_hints_h2_upstream() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    tokio::spawn(async move {
                        let interim = |status: u16| {
                            let mut r = Response::builder().status(status);
                            if status == 103 {
                                r = r.header("link", "</style.css>; rel=preload");
                            }
                            r.body(()).unwrap()
                        };
                        respond.send_informational(interim(102)).unwrap();
                        respond.send_informational(interim(103)).unwrap();
                        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
                        let last = Response::builder()
                            .status(200)
                            .header("content-length", "2")
                            .body(())
                            .unwrap();
                        if let Ok(mut body) = respond.send_response(last, false) {
                            let _ = body.send_data(Bytes::from_static(b"ok"), true);
                        }
                    });
                }
            });
        }
    });
    (addr, task)
}

#[tokio::test]
async fn early_hints_from_an_http2_upstream_reach_http1_and_http2_clients_before_the_final_response(
) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (addr, task) = start_early_hints_h2_upstream().await;
    let target = format!("http://{addr}");
    let gw = TestGateway::start(&config(&target, "", "protocol = \"http2\"", 1000)).await;

    // The 1xx arrive as the upstream sends them, ahead of the 200 (twice on one
    // connection, and on a second connection: one shared upstream connection).
    for _ in 0..2 {
        let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
        early_hints_over(&mut tcp).await;
    }

    // HTTP/1.0 clients never get a 1xx (RFC 9110 §15.2).
    let mut old = TcpStream::connect(gw.addr).await.unwrap();
    old.write_all(b"GET /hints HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut all = Vec::new();
    let _ =
        tokio::time::timeout(std::time::Duration::from_secs(3), old.read_to_end(&mut all)).await;
    let text = String::from_utf8_lossy(&all);
    assert!(text.starts_with("HTTP/1.0 200 OK\r\n"), "{text:?}");

    // HTTP/2 clients get them on the request's stream, before its 200: with prior
    // knowledge, and over TLS.
    early_hints_over_h2(TcpStream::connect(gw.addr).await.unwrap(), "http").await;
    drop(gw);
    let pki = Pki::new();
    let gw = TestGateway::start(&tls_config(&target, &pki, "", "protocol = \"http2\"", 1000)).await;
    let tls = tls_connect(gw.addr, pki.client_config(&["h2"])).await;
    early_hints_over_h2(tls, "https").await;
    task.abort();
}

/// Two gateway processes with the same certificate: with `server.tls.ticket_keys`
/// shared, a session made with one resumes with the other; without it, it does not
/// (each process has keys of its own).
#[tokio::test]
async fn a_shared_ticket_key_file_lets_sessions_resume_on_another_gateway() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let pki = Pki::new();
    let origin = start_origin().await;
    let target = format!("http://{}", origin.addr);
    let keys = pki.path("tickets.keys");
    std::fs::write(
        &keys,
        "# newest first\n00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\n",
    )
    .unwrap();
    let gateway = |name: &str, shared: bool| {
        let port = support::redis::free_port();
        let extra = if shared {
            format!("ticket_keys = \"{}\"", keys.display())
        } else {
            String::new()
        };
        let text = tls_config(&target, &pki, &extra, "", 1000).replace(
            "listen = \"127.0.0.1:0\"",
            &format!("listen = \"127.0.0.1:{port}\""),
        );
        let path = pki.path(&format!("{name}.toml"));
        std::fs::write(&path, text).unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        (support::Binary::spawn(&path, port, &[]), addr)
    };
    for shared in [true, false] {
        let (_a, a) = gateway(&format!("a-{shared}"), shared);
        let (_b, b) = gateway(&format!("b-{shared}"), shared);
        for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
            let config = pki.http1_client(version);
            assert_eq!(
                handshake_kind(a, &config).await,
                rustls::HandshakeKind::Full
            );
            let expected = if shared {
                rustls::HandshakeKind::Resumed
            } else {
                rustls::HandshakeKind::Full
            };
            assert_eq!(
                handshake_kind(b, &config).await,
                expected,
                "{version:?}, shared keys: {shared}"
            );
        }
    }
    // A key that is not 64 hex digits is an error that names the key and the line.
    std::fs::write(&keys, "not-a-key\n").unwrap();
    let (code, _, err) = support::check(&pki.path("a-true.toml"));
    assert_eq!(code, 1);
    assert!(
        err.contains("server.tls.ticket_keys") && err.contains("line 1"),
        "{err}"
    );
}

/// An HTTP/2 upstream (h2c) that records each request's method, path and header fields,
/// one `name: value` line each, and answers 200 `ok`.
async fn start_recording_h2_upstream() -> (
    SocketAddr,
    Arc<std::sync::Mutex<Vec<String>>>,
    tokio::task::JoinHandle<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    let mut text = format!("{} {}\n", req.method(), req.uri().path());
                    for (name, value) in req.headers() {
                        text.push_str(&format!("{name}: {}\n", value.to_str().unwrap_or("?")));
                    }
                    log.lock().unwrap().push(text);
                    let ok = Response::builder()
                        .status(200)
                        .header("content-length", "2")
                        .body(())
                        .unwrap();
                    if let Ok(mut body) = respond.send_response(ok, false) {
                        let _ = body.send_data(Bytes::from_static(b"ok"), true);
                    }
                }
            });
        }
    });
    (addr, seen, task)
}

/// What crosses to an HTTP/2 upstream (the h2-crate client): hop-by-hop fields in any
/// spelling, the fields `Connection` names, an `h2c` upgrade and its settings, `TE` other
/// than `trailers`, and spoofed identity headers never do; `TE: trailers` does; each
/// request reaches the upstream once and is charged once.
#[tokio::test]
async fn nothing_unchecked_crosses_to_an_http2_upstream() {
    let (addr, seen, task) = start_recording_h2_upstream().await;
    let toml = config(&format!("http://{addr}"), "", "protocol = \"http2\"", 1000)
        + "\n[identity]\nforward_caller_header = \"x-consumer-id\"\n";
    let gw = TestGateway::start(&toml).await;
    let mut tcp = TcpStream::connect(gw.addr).await.unwrap();
    let hostile =
        "GET /edge HTTP/1.1\r\nHost: localhost\r\nConnection: X-Hop, keep-alive, Upgrade\r\n\
        X-Hop: 1\r\nKeep-Alive: timeout=5\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\
        TE: gzip\r\nProxy-Authorization: Basic eDp4\r\nProxy-Connection: keep-alive\r\n\
        X_Consumer_Id: alice\r\nx-consumer-id: mallory\r\nX-Ratelimit-Remaining: 999\r\n\r\n";
    tcp.write_all(hostile.as_bytes()).await.unwrap();
    let first = String::from_utf8_lossy(&read_until(&mut tcp, b"\r\n\r\nok").await).to_lowercase();
    assert!(first.starts_with("http/1.1 200"), "{first}");
    assert!(first.contains("\r\nx-ratelimit-used: 1\r\n"), "{first}");
    tcp.write_all(b"GET /edge HTTP/1.1\r\nHost: localhost\r\nTE: trailers\r\n\r\n")
        .await
        .unwrap();
    let second = String::from_utf8_lossy(&read_until(&mut tcp, b"\r\n\r\nok").await).to_lowercase();
    assert!(second.contains("\r\nx-ratelimit-used: 2\r\n"), "{second}");

    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen.len(),
        2,
        "each request reaches the upstream once: {seen:?}"
    );
    let hostile_seen = seen[0].to_lowercase();
    for never in [
        "x-hop",
        "keep-alive",
        "upgrade",
        "http2-settings",
        "connection",
        "\nte:",
        "proxy-",
        "alice",
        "mallory",
        "999",
    ] {
        assert!(
            !hostile_seen.contains(never),
            "{never} crossed:\n{hostile_seen}"
        );
    }
    assert!(
        seen[1].to_lowercase().contains("\nte: trailers\n"),
        "{}",
        seen[1]
    );
    task.abort();
}

// ---- HTTP/2 clients, served by the h2 crate ----

/// Send `data` on `send` within the peer's flow-control window, then end the stream.
async fn send_all(send: &mut h2::SendStream<Bytes>, mut data: Bytes) {
    while !data.is_empty() {
        send.reserve_capacity(data.len());
        let n = std::future::poll_fn(|cx| send.poll_capacity(cx))
            .await
            .expect("capacity")
            .expect("capacity");
        let n = n.min(data.len());
        if n > 0 {
            send.send_data(data.split_to(n), false).unwrap();
        }
    }
    send.send_data(Bytes::new(), true).unwrap();
}

/// Read a response body, giving the window back as it is read.
async fn read_all(mut body: h2::RecvStream) -> Vec<u8> {
    let mut got = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("body");
        let _ = body.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_get_bodies_past_the_windows_both_ways_a_date_and_a_graceful_close() {
    let origin = start_origin().await;
    let gw = TestGateway::start(&config(&format!("http://{}", origin.addr), "", "", 1000)).await;
    let tcp = TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);

    // 3 MiB up and back: three times the gateway's stream and connection windows.
    let data: Bytes = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let mut client = client.ready().await.unwrap();
    let req = Request::post("http://localhost/echo")
        .header("content-length", data.len())
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(req, false).unwrap();
    let upload = data.clone();
    let sending = tokio::spawn(async move { send_all(&mut send, upload).await });
    let response = response.await.expect("the echo's response");
    sending.await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().contains_key("date"), "{response:?}");
    assert_eq!(
        response.headers()["content-length"],
        data.len().to_string().as_str()
    );
    assert!(!response.headers().contains_key("connection"));
    let got = read_all(response.into_body()).await;
    assert!(
        got == data,
        "the body came back changed ({} bytes)",
        got.len()
    );

    // A graceful shutdown lets the stream under way finish, then closes the
    // connection (GOAWAY): a later request on it is refused, and the gateway stops.
    let mut client = client.ready().await.unwrap();
    let req = Request::get("http://localhost/slow").body(()).unwrap();
    let (slow, _) = client.send_request(req, true).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    gw.gateway.shutdown();
    let slow = slow.await.expect("the in-flight request's response");
    assert_eq!(slow.status(), StatusCode::OK);
    assert_eq!(read_all(slow.into_body()).await, b"slow ok");
    let refused = async {
        let mut client = client.ready().await?;
        let req = Request::get("http://localhost/echo").body(()).unwrap();
        let (r, _) = client.send_request(req, true)?;
        r.await
    };
    assert!(
        tokio::time::timeout(std::time::Duration::from_secs(3), refused)
            .await
            .expect("an answer")
            .is_err(),
        "a request after the GOAWAY was served"
    );
    tokio::time::timeout(std::time::Duration::from_secs(3), conn)
        .await
        .expect("the connection closed")
        .unwrap()
        .expect("closed cleanly");
    tokio::time::timeout(std::time::Duration::from_secs(3), gw.gateway.wait())
        .await
        .expect("gateway stopped after draining");
}
