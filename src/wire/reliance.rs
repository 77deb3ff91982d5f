//! Tests of what the wire layer relies on in hyper and h2 (see `src/wire/README.md`):
//! real servers and clients over real sockets, asserting what goes on the wire and in
//! which order. A hyper or h2 upgrade that breaks a reliance fails one of these.

use super::alpn::Builders;
use super::handler::BoxError;
use super::h2client::{self, Replay};
use super::h2server::Settings;
use super::incoming::Incoming;
use super::interim::{Informational, Interim};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Empty, Full};
use std::convert::Infallible;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// How long any one step may take before the test fails (instead of hanging).
const STEP: Duration = Duration::from_secs(10);

/// The 1xx every test sends, as an HTTP/1.1 client must see it on the wire.
const HINT_BYTES: &[u8] = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n";

fn hint_headers() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::LINK,
        http::HeaderValue::from_static("</style.css>; rel=preload"),
    );
    headers
}

/// The two moments a test's handler waits for: when to send its 1xx (as an upstream's
/// 1xx would arrive while the request path awaits the upstream), and when to answer.
#[derive(Clone, Default)]
struct Script {
    /// Told by the handler when it has started waiting (as the request path waits for
    /// its upstream: hyper has polled it and got `Pending`).
    waiting: Arc<Notify>,
    hint: Arc<Notify>,
    answer: Arc<Notify>,
    /// How many 1xx [`Informational::send`] took (it returns `false` for one dropped).
    sent: Arc<AtomicUsize>,
}

impl Script {
    /// The handler's part: say it is waiting, wait for `hint`, send a 103 to `to`,
    /// wait for `answer`, then answer 200 `done`.
    async fn run(
        self,
        to: Option<Informational>,
    ) -> Result<Response<impl http_body::Body<Data = Bytes, Error = BoxError>>, Infallible> {
        self.waiting.notify_one();
        self.hint.notified().await;
        if let Some(to) = to {
            if to.send(StatusCode::EARLY_HINTS, &hint_headers()) {
                self.sent.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.answer.notified().await;
        let body =
            Full::new(Bytes::from_static(b"done")).map_err(|e: Infallible| -> BoxError { match e {} });
        Ok(Response::new(body))
    }
}

/// Wait for `what` to be told, at most [`STEP`].
async fn wait(what: &Notify) {
    tokio::time::timeout(STEP, what.notified())
        .await
        .expect("the handler is called in time");
}

fn builders() -> Arc<Builders> {
    let http2 = Settings {
        max_streams: 100,
        max_header_list: 16 * 1024,
        keep_alive: Duration::from_secs(20),
    };
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.header_read_timeout(None);
    Arc::new(Builders::new(http1, http2))
}

/// Read from `client` until `buf` holds the end of a head (`\r\n\r\n`) and then
/// `body_len` bytes more; what was read.
async fn read_message(client: &mut TcpStream, buf: &mut Vec<u8>, body_len: usize) -> Vec<u8> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let whole = end + 4 + body_len;
            if buf.len() >= whole {
                return buf.drain(..whole).collect();
            }
        }
        let n = tokio::time::timeout(STEP, client.read(&mut chunk))
            .await
            .expect("the server answers in time")
            .expect("read");
        assert!(n > 0, "the server closed early; got {:?}", String::from_utf8_lossy(buf));
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// hyper's HTTP/1.1 server owns the client's socket; a 1xx is written into it through
/// [`Interim`] while the handler waits, which is safe only because hyper (1) calls the
/// socket's `poll_flush` once its write buffer is empty, on every poll of the
/// connection, even with nothing to write, and (2) writes its own bytes only through
/// the socket's `poll_write`/`poll_write_vectored`. On two requests of one keep-alive
/// connection, the 103 reaches the client before the handler has answered, whole, and
/// the final response follows it, whole.
#[tokio::test]
async fn http1_a_1xx_goes_out_while_the_handler_waits_then_the_final_response() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let script = Script::default();
    let server_script = script.clone();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let io = Interim::new(stream);
        let informational = io.handle();
        let handler = move |_req: Request<Incoming>| {
            server_script.clone().run(Some(informational.clone()))
        };
        let builders = builders();
        let _ = builders.serve(Some(b"http/1.1".as_slice()), io, handler).await;
    });

    let mut client = TcpStream::connect(addr).await.unwrap();
    let mut buf = Vec::new();
    for round in 1..=2 {
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
            .await
            .unwrap();
        wait(&script.waiting).await;
        script.hint.notify_one();
        let first = read_message(&mut client, &mut buf, 0).await;
        assert_eq!(
            String::from_utf8_lossy(&first),
            String::from_utf8_lossy(HINT_BYTES),
            "round {round}: the 103 comes first, before the handler answers"
        );
        assert_eq!(script.sent.load(Ordering::SeqCst), round);
        script.answer.notify_one();
        let last = read_message(&mut client, &mut buf, 4).await;
        let last = String::from_utf8_lossy(&last);
        assert!(
            last.starts_with("HTTP/1.1 200 OK\r\n") && last.ends_with("\r\n\r\ndone"),
            "round {round}: then the final response, whole: {last:?}"
        );
        assert!(buf.is_empty(), "round {round}: nothing else: {buf:?}");
    }
    drop(client);
    tokio::time::timeout(STEP, server)
        .await
        .expect("the connection ends")
        .unwrap();
}

/// HTTP/2 clients get a 1xx as interim HEADERS on their stream, sent with h2's
/// `SendResponse::send_informational` while the handler waits (hyper's HTTP/2 server
/// has no way to send one), and read here with h2's
/// `ResponseFuture::poll_informational`, which the HTTP/2 upstream client
/// ([`h2client`]) also relies on.
#[tokio::test]
async fn http2_a_1xx_goes_out_on_the_stream_while_the_handler_waits() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let script = Script::default();
    let server_script = script.clone();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let handler = move |req: Request<Incoming>| {
            let informational = req.extensions().get::<Informational>().cloned();
            server_script.clone().run(informational)
        };
        let builders = builders();
        // Cleartext with prior knowledge: the first bytes choose HTTP/2.
        let _ = builders.serve(None, stream, handler).await;
    });

    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut tx, conn) = h2::client::handshake(stream).await.unwrap();
    tokio::spawn(conn);
    let req = Request::get("http://test/").body(()).unwrap();
    let (mut response, _) = tx.send_request(req, true).unwrap();
    wait(&script.waiting).await;
    script.hint.notify_one();
    let hint = tokio::time::timeout(STEP, poll_fn(|cx| response.poll_informational(cx)))
        .await
        .expect("the 103 comes before the handler answers")
        .expect("a 1xx")
        .expect("no stream error");
    assert_eq!(hint.status(), StatusCode::EARLY_HINTS);
    assert_eq!(hint.headers(), &hint_headers());
    assert_eq!(script.sent.load(Ordering::SeqCst), 1);
    script.answer.notify_one();
    let response = tokio::time::timeout(STEP, response)
        .await
        .expect("the final response")
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let data = poll_fn(|cx| body.poll_data(cx)).await.unwrap().unwrap();
    assert_eq!(&data[..], b"done");
}

/// A request body that is no body at all, for [`h2client::Connection::send`].
impl Replay for Empty<Bytes> {
    fn replay(_frames: Vec<Frame<Bytes>>) -> Self {
        Empty::new()
    }
}

/// An HTTP/2 upstream's 1xx (h2's `send_informational` on its side) reaches
/// [`h2client`] through h2's `ResponseFuture::poll_informational`, before the final
/// response, and goes on to an HTTP/1.1 client's socket through [`Interim`] as the
/// bytes of a 1xx.
#[tokio::test]
async fn h2client_passes_an_upstreams_1xx_on_before_its_response() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let mut conn = h2::server::handshake(stream).await.unwrap();
        while let Some(Ok((_req, mut respond))) = conn.accept().await {
            let mut hint = Response::new(());
            *hint.status_mut() = StatusCode::EARLY_HINTS;
            *hint.headers_mut() = hint_headers();
            respond.send_informational(hint).unwrap();
            let mut send = respond.send_response(Response::new(()), false).unwrap();
            send.send_data(Bytes::from_static(b"done"), true).unwrap();
        }
    });

    // The client side of the 1xx: an HTTP/1.1 client's socket, flushed (as hyper
    // flushes it while a handler waits).
    let (socket, mut client) = tokio::io::duplex(4096);
    let mut interim = Interim::new(socket);
    poll_fn(|cx| Pin::new(&mut interim).poll_flush(cx))
        .await
        .unwrap();

    let stream = TcpStream::connect(addr).await.unwrap();
    let mut conn = h2client::Connection::handshake(stream, 16 * 1024)
        .await
        .unwrap();
    let claim = conn.claim(true).expect("a new connection has room");
    conn.ready().await.unwrap();
    let req = Request::get("http://test/").body(Empty::<Bytes>::new()).unwrap();
    let response = tokio::time::timeout(STEP, conn.send(req, Some(interim.handle()), claim))
        .await
        .expect("the upstream answers in time")
        .unwrap_or_else(|f| panic!("send failed: {:?}", f.error));
    assert_eq!(response.status(), StatusCode::OK);
    // The 1xx was queued before the response came; the socket's next flush writes it.
    poll_fn(|cx| Pin::new(&mut interim).poll_flush(cx))
        .await
        .unwrap();
    drop(interim);
    let mut got = Vec::new();
    client.read_to_end(&mut got).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&got),
        String::from_utf8_lossy(HINT_BYTES)
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"done");
}
