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
async fn start_goaway_upstream(per_connection: usize, refuse_every: usize) -> (String, Arc<Seen>) {
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

async fn serve_frames(s: TcpStream, per_connection: usize, refuse_every: usize, seen: Arc<Seen>) {
    let _ = s.set_nodelay(true);
    let (mut r, w) = s.into_split();
    let w = Arc::new(tokio::sync::Mutex::new(w));
    let mut preface = [0u8; 24];
    if r.read_exact(&mut preface).await.is_err() || &preface != b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
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
        let len = (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
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
