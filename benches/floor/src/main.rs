//! `tollgate-floor LISTEN UPSTREAM`: the least a hyper 1.x reverse proxy does per request.
//! `tollgate-floor LISTEN -`: the least a hyper 1.x server does to answer a request itself,
//! with a fixed 429 and a short JSON body, as a gateway's refusal is answered (the floor of
//! the 429 cases: benches/load.sh's `hyper_floor_429`).
//!
//! benches/load.sh runs it as the `hyper_floor` case and reports every tollgate case as a
//! ratio to it: what tollgate costs beyond hyper itself. It is HTTP/1.1 only, plain TCP,
//! and does nothing to the messages (no header rewriting, no limits, no logs, no timers).
//!
//! Switches, for measuring what tollgate's request path needs beyond it:
//! - `FLOOR_HEADERS=1`: the request it forwards and the response it returns carry the header
//!   lines tollgate adds in the load cases (six and seven), with fixed values of the same
//!   lengths: what hyper and the kernel cost to carry them, with none of the work of
//!   computing them (benches/load.sh's `hyper_floor_headers`). The fixed 429 then carries
//!   the six header lines and the body of tollgate's 429 of the load cases, fixed too
//!   (`hyper_floor_429_headers`).
//! - `FLOOR_INLINE=1`: no task per upstream connection. hyper's client connection is polled
//!   by the downstream connection's own task: while the response head is awaited, then by the
//!   response body as it is read (see [`Driven`]). The issue that asked for the floor named
//!   this as something a proxy need not do; BENCHMARKS.md has what it costs.
//! - `FLOOR_CONTRACT=1`: the least work tollgate's contract asks of each request, written
//!   plainly: hop-by-hop headers stripped, the caller by IP, one fixed window of
//!   `FLOOR_QUOTA` units (default 10^12) in a store the workers share, checked before and
//!   charged after, a request id, the forwarded and `X-RateLimit-*` lines computed, a
//!   response timeout, a latency histogram; over the quota, a computed 429 (see
//!   [`contract`]; benches/load.sh's `hyper_floor_contract` and `hyper_floor_contract_429`).
//! - `FLOOR_EXIT_AFTER=N`: the process exits (status 0, through `std::process::exit`) N seconds
//!   after it starts, so that an instrumented build (`-Cprofile-generate`) writes its profile:
//!   BENCHMARKS.md's nineteenth round measured the floor built profile-guided too.
//!
//! Shape: `WORKERS` threads (default: one per core), each with its own `current_thread`
//! tokio runtime and its own `SO_REUSEPORT` listener on LISTEN, so the kernel spreads
//! connections over the threads and a request never leaves the thread that accepted its
//! connection. A downstream connection opens its own upstream connection on its first
//! request and keeps it (a new one when the old one failed); hyper's client dispatcher for
//! it runs as a task on the same thread. A failed upstream exchange answers 502.
#![forbid(unsafe_code)]

mod contract;

use http_body_util::{Either, Empty, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderName, HeaderValue, VIA};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::cell::RefCell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use tokio::net::{TcpListener, TcpStream};

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Reply = Response<Either<Incoming, Empty<Bytes>>>;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (listen, upstream) = match (args.get(1), args.get(2)) {
        (Some(l), Some(u)) if u == "-" => (parse_addr(l), None),
        (Some(l), Some(u)) => (parse_addr(l), Some(parse_addr(u))),
        _ => fail("usage: tollgate-floor LISTEN UPSTREAM|- (e.g. 127.0.0.1:8080 127.0.0.1:9000)"),
    };
    let workers = match std::env::var("WORKERS") {
        Ok(v) => v
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .unwrap_or_else(|| fail(&format!("WORKERS must be a positive integer, not {v:?}"))),
        Err(_) => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // Bind every listener before serving, so that a bad address fails at once.
    let listeners: Vec<std::net::TcpListener> = (0..workers).map(|_| bind(listen)).collect();
    let threads: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, listener)| {
            std::thread::Builder::new()
                .name(format!("floor-{i}"))
                .spawn(move || worker(listener, upstream))
                .unwrap_or_else(|e| fail(&format!("cannot start a worker thread: {e}")))
        })
        .collect();
    if let Ok(v) = std::env::var("FLOOR_EXIT_AFTER") {
        let secs = v.parse::<u64>().unwrap_or_else(|_| {
            fail(&format!(
                "FLOOR_EXIT_AFTER must be whole seconds, not {v:?}"
            ))
        });
        std::thread::sleep(std::time::Duration::from_secs(secs));
        std::process::exit(0);
    }
    for t in threads {
        let _ = t.join();
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tollgate-floor: {msg}");
    std::process::exit(2)
}

fn parse_addr(s: &str) -> SocketAddr {
    s.parse()
        .unwrap_or_else(|e| fail(&format!("{s:?} is not an IP:PORT address: {e}")))
}

/// A listening socket on `addr` with SO_REUSEPORT, so every worker can have its own.
fn bind(addr: SocketAddr) -> std::net::TcpListener {
    let try_bind = || -> std::io::Result<std::net::TcpListener> {
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        socket.set_reuse_address(true)?;
        socket.set_reuse_port(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(4096)?;
        Ok(socket.into())
    };
    try_bind().unwrap_or_else(|e| fail(&format!("cannot listen on {addr}: {e}")))
}

/// One thread: a current_thread runtime serving the connections of its own listener.
fn worker(listener: std::net::TcpListener, upstream: Option<SocketAddr>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .unwrap_or_else(|e| fail(&format!("cannot build a runtime: {e}")));
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let listener = TcpListener::from_std(listener)
            .unwrap_or_else(|e| fail(&format!("cannot register the listener: {e}")));
        loop {
            match listener.accept().await {
                Ok((stream, _)) => match upstream {
                    Some(upstream) => {
                        tokio::task::spawn_local(connection(stream, upstream));
                    }
                    None => {
                        tokio::task::spawn_local(refusing(stream));
                    }
                },
                // Out of descriptors and the like: the connection is lost, the proxy is not.
                Err(e) => eprintln!("tollgate-floor: accept: {e}"),
            }
        }
    });
}

/// Serve one downstream connection; its upstream connection lives in `up`.
async fn connection(stream: TcpStream, upstream: SocketAddr) {
    let _ = stream.set_nodelay(true);
    if contract_work() {
        return connection_contract(stream, upstream).await;
    }
    if inline() {
        let up: Rc<RefCell<Option<Upstream>>> = Rc::default();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let up = up.clone();
            async move { Ok::<_, std::convert::Infallible>(exchange_inline(up, upstream, req).await) }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
        return;
    }
    let up: Rc<RefCell<Option<SendRequest<Incoming>>>> = Rc::default();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let up = up.clone();
        async move { Ok::<_, std::convert::Infallible>(exchange(&up, upstream, req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

type UpConn = hyper::client::conn::http1::Connection<TokioIo<TcpStream>, Incoming>;

/// `FLOOR_INLINE=1`: an upstream connection with no task of its own, polled by the
/// downstream connection's task.
struct Upstream {
    tx: SendRequest<Incoming>,
    conn: Pin<Box<UpConn>>,
    done: bool,
}

impl Upstream {
    fn drive(&mut self, cx: &mut Context<'_>) {
        if !self.done {
            self.done = self.conn.as_mut().poll(cx).is_ready();
        }
    }
}

/// `FLOOR_INLINE=1`: the upstream's response body, which polls its connection while it is
/// read and puts the connection back in the downstream connection's cell at its end (one
/// that ended, or a body dropped before its end, is not kept).
struct Driven {
    body: Incoming,
    up: Option<Upstream>,
    cell: Rc<RefCell<Option<Upstream>>>,
}

impl hyper::body::Body for Driven {
    type Data = Bytes;
    type Error = hyper::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(up) = &mut this.up {
            up.drive(cx);
        }
        let r = Pin::new(&mut this.body).poll_frame(cx);
        if matches!(r, Poll::Ready(None)) || this.body.is_end_stream() {
            if let Some(mut up) = this.up.take() {
                up.drive(cx);
                if !up.done {
                    *this.cell.borrow_mut() = Some(up);
                }
            }
        }
        r
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        // A body dropped before its end: its connection is not reused.
        let _ = self.up.take();
    }
}

type InlineReply = Response<Either<Driven, Empty<Bytes>>>;

/// [`exchange`] with `FLOOR_INLINE=1`: the upstream connection is polled here (its
/// readiness, then alongside the response head) and by the response body ([`Driven`]).
async fn exchange_inline(
    cell: Rc<RefCell<Option<Upstream>>>,
    upstream: SocketAddr,
    mut req: Request<Incoming>,
) -> InlineReply {
    if with_headers() {
        add_request_headers(req.headers_mut());
    }
    let mut up = cell.borrow_mut().take();
    if let Some(u) = &mut up {
        let ok = std::future::poll_fn(|cx| {
            u.drive(cx);
            if u.done {
                return Poll::Ready(false);
            }
            u.tx.poll_ready(cx).map(|r| r.is_ok())
        })
        .await;
        if !ok {
            up = None;
        }
    }
    let mut up = match up {
        Some(u) => u,
        None => match open_inline(upstream).await {
            Some(u) => u,
            None => return bad_gateway(),
        },
    };
    let fut = up.tx.send_request(req);
    let mut fut = std::pin::pin!(fut);
    let result = std::future::poll_fn(|cx| {
        let r = fut.as_mut().poll(cx);
        if r.is_pending() {
            up.drive(cx);
        }
        r
    })
    .await;
    match result {
        Ok(mut response) => {
            if with_headers() {
                add_response_headers(response.headers_mut());
            }
            response.map(|body| {
                Either::Left(Driven {
                    body,
                    up: Some(up),
                    cell,
                })
            })
        }
        Err(_) => bad_gateway(),
    }
}

/// A new upstream connection for `FLOOR_INLINE=1`: no task is spawned for it.
async fn open_inline(upstream: SocketAddr) -> Option<Upstream> {
    let stream = TcpStream::connect(upstream).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    Some(Upstream {
        tx,
        conn: Box::pin(conn),
        done: false,
    })
}

/// Serve one downstream connection by answering every request with a fixed 429.
async fn refusing(stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(|_req: Request<Incoming>| async {
        let body = Full::new(Bytes::from_static(if with_headers() {
            REFUSAL_BODY
        } else {
            b"{\"message\":\"rate limit exceeded\",\"limit\":1,\"remaining\":0}"
        }));
        let mut response = Response::new(body);
        *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        let h = response.headers_mut();
        h.insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        h.insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("3600"),
        );
        if with_headers() {
            add_refusal_headers(h);
        }
        Ok::<_, std::convert::Infallible>(response)
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// With `FLOOR_HEADERS=1`: the header lines tollgate adds to a proxied request of the
/// load cases (six on the request it forwards, seven on the response), with fixed values
/// of the same lengths. What hyper and the kernel cost to carry them, with none of the work
/// of computing them (benches/load.sh's `hyper_floor_headers`).
static HEADERS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn with_headers() -> bool {
    *HEADERS.get_or_init(|| switch("FLOOR_HEADERS"))
}

/// `FLOOR_INLINE=1`, read once (not from the environment for every connection).
fn inline() -> bool {
    static INLINE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INLINE.get_or_init(|| switch("FLOOR_INLINE"))
}

/// `FLOOR_CONTRACT=1`, read once.
fn contract_work() -> bool {
    static CONTRACT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CONTRACT.get_or_init(|| switch("FLOOR_CONTRACT"))
}

/// Whether the environment variable `name` is `1`.
fn switch(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

const REQUEST_ID: HeaderValue = HeaderValue::from_static("916bb9d0-daa7-49d3-0000-000000000000");
const VIA_VALUE: HeaderValue = HeaderValue::from_static("1.1 tollgate");

/// A name and a value made at compile time (`const`), so that adding them is only the map's
/// insert, as it is for tollgate's own names.
macro_rules! header {
    ($name:literal, $value:literal) => {{
        const NAME: HeaderName = HeaderName::from_static($name);
        const VALUE: HeaderValue = HeaderValue::from_static($value);
        (NAME, VALUE)
    }};
}

fn add_request_headers(h: &mut hyper::HeaderMap) {
    h.insert(header!("x-request-id", "-").0, REQUEST_ID);
    h.insert(VIA, VIA_VALUE);
    for (name, value) in [
        header!("x-forwarded-for", "127.0.0.1"),
        header!("x-forwarded-proto", "http"),
        header!("x-forwarded-host", "127.0.0.1:18081"),
        header!("x-real-ip", "127.0.0.1"),
    ] {
        h.insert(name, value);
    }
}

fn add_response_headers(h: &mut hyper::HeaderMap) {
    h.insert(VIA, VIA_VALUE);
    for (name, value) in [
        header!("x-ratelimit-limit", "1000000000000"),
        header!("x-ratelimit-remaining", "999999999999"),
        header!("x-ratelimit-used", "1"),
        header!("x-ratelimit-reset", "1795582870"),
        header!("x-ratelimit-resource", "core"),
    ] {
        h.insert(name, value);
    }
    h.insert(header!("x-request-id", "-").0, REQUEST_ID);
}

/// With `FLOOR_HEADERS=1`, a 429's body as long as tollgate's (the load cases' caller and
/// limit, a quota of one) and its header lines beyond the two every 429 has (below).
const REFUSAL_BODY: &[u8] = b"{\"message\":\"API rate limit exceeded for 127.0.0.1.\",\"limit\":1,\"remaining\":0,\"reset\":1795802428,\"resource\":\"core\",\"retry_after\":3598}";

/// The header lines tollgate's 429 carries besides `Content-Type` and `Retry-After`, with
/// fixed values of the same lengths (benches/load.sh's `hyper_floor_429_headers`).
fn add_refusal_headers(h: &mut hyper::HeaderMap) {
    for (name, value) in [
        header!("x-ratelimit-limit", "1"),
        header!("x-ratelimit-remaining", "0"),
        header!("x-ratelimit-used", "1"),
        header!("x-ratelimit-reset", "1795802428"),
        header!("x-ratelimit-resource", "core"),
    ] {
        h.insert(name, value);
    }
    h.insert(header!("x-request-id", "-").0, REQUEST_ID);
}

/// Send `req` on this connection's upstream connection (opened now when there is none or
/// the old one is gone) and return the upstream's response as it is; 502 on failure.
///
/// HTTP/1 serves one request at a time per connection, so the sender is taken out of the
/// cell for the exchange and put back once the response head is in: nothing else can
/// want it meanwhile, and no lock is needed.
async fn exchange(
    up: &RefCell<Option<SendRequest<Incoming>>>,
    upstream: SocketAddr,
    mut req: Request<Incoming>,
) -> Reply {
    let headers = with_headers();
    if headers {
        add_request_headers(req.headers_mut());
    }
    let Some(mut sender) = sender(up, upstream).await else {
        return bad_gateway();
    };
    match sender.send_request(req).await {
        Ok(mut response) => {
            *up.borrow_mut() = Some(sender);
            if headers {
                add_response_headers(response.headers_mut());
            }
            response.map(Either::Left)
        }
        Err(_) => bad_gateway(),
    }
}

/// This connection's upstream sender, taken out of `up` for the exchange: the kept one, or
/// a new one when there is none or the upstream closed (or failed) the kept one; `None`
/// when no connection can be opened.
async fn sender(
    up: &RefCell<Option<SendRequest<Incoming>>>,
    upstream: SocketAddr,
) -> Option<SendRequest<Incoming>> {
    let mut sender = up.borrow_mut().take();
    if let Some(s) = &mut sender {
        if s.ready().await.is_err() {
            sender = None;
        }
    }
    match sender {
        Some(s) => Some(s),
        None => open(upstream).await,
    }
}

/// A new upstream connection, its dispatcher running as a task on this thread.
async fn open(upstream: SocketAddr) -> Option<SendRequest<Incoming>> {
    let stream = TcpStream::connect(upstream).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::task::spawn_local(async move {
        let _ = conn.await;
    });
    Some(sender)
}

fn bad_gateway<B>() -> Response<Either<B, Empty<Bytes>>> {
    let mut response = Response::new(Either::Right(Empty::new()));
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
}

type ContractReply = Response<Either<Incoming, Full<Bytes>>>;

/// `FLOOR_CONTRACT=1`: serve one downstream connection doing the contract's least work per
/// request (see [`contract`]).
async fn connection_contract(stream: TcpStream, upstream: SocketAddr) {
    let peer = match stream.peer_addr() {
        Ok(p) => p,
        Err(_) => return,
    };
    // The peer's address as a header value, rendered once per connection (as tollgate does).
    let peer_text =
        HeaderValue::from_str(&peer.ip().to_string()).unwrap_or(HeaderValue::from_static("-"));
    let up: Rc<RefCell<Option<SendRequest<Incoming>>>> = Rc::default();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let up = up.clone();
        let peer_text = peer_text.clone();
        async move {
            Ok::<_, std::convert::Infallible>(
                exchange_contract(&up, upstream, req, peer, &peer_text).await,
            )
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// [`exchange`] with the contract's work before and after (see [`contract`]).
async fn exchange_contract(
    up: &RefCell<Option<SendRequest<Incoming>>>,
    upstream: SocketAddr,
    mut req: Request<Incoming>,
    peer: SocketAddr,
    peer_text: &HeaderValue,
) -> ContractReply {
    let admitted = match contract::admit(&mut req, peer, peer_text) {
        Ok(a) => a,
        Err(answer) => return answer,
    };
    let Some(mut sender) = sender(up, upstream).await else {
        return gateway_error(StatusCode::BAD_GATEWAY);
    };
    match contract::within(sender.send_request(req)).await {
        Some(Ok(mut response)) => {
            *up.borrow_mut() = Some(sender);
            contract::answered(admitted, response.headers_mut());
            response.map(Either::Left)
        }
        Some(Err(_)) => gateway_error(StatusCode::BAD_GATEWAY),
        None => gateway_error(StatusCode::GATEWAY_TIMEOUT),
    }
}

fn gateway_error(status: StatusCode) -> ContractReply {
    let mut response = Response::new(Either::Right(Full::new(Bytes::new())));
    *response.status_mut() = status;
    response
}
