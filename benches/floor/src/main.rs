//! `tollgate-floor LISTEN UPSTREAM`: the least a hyper 1.x reverse proxy does per request.
//! `tollgate-floor LISTEN -`: the least a hyper 1.x server does to answer a request itself,
//! with a fixed 429 and a short JSON body, as a gateway's refusal is answered (the floor of
//! the 429 cases: benches/load.sh's `hyper_floor_429`).
//!
//! benches/load.sh runs it as the `hyper_floor` case and reports every tollgate case as a
//! ratio to it: what tollgate costs beyond hyper itself. It is HTTP/1.1 only, plain TCP,
//! and does nothing to the messages (no header rewriting, no limits, no logs, no timers).
//!
//! Shape: `WORKERS` threads (default: one per core), each with its own `current_thread`
//! tokio runtime and its own `SO_REUSEPORT` listener on LISTEN, so the kernel spreads
//! connections over the threads and a request never leaves the thread that accepted its
//! connection. A downstream connection opens its own upstream connection on its first
//! request and keeps it (a new one when the old one failed); hyper's client dispatcher for
//! it runs as a task on the same thread. A failed upstream exchange answers 502.
#![forbid(unsafe_code)]

use http_body_util::{Either, Empty, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
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
    let up: Rc<RefCell<Option<SendRequest<Incoming>>>> = Rc::default();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let up = up.clone();
        async move { Ok::<_, std::convert::Infallible>(exchange(&up, upstream, req).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// Serve one downstream connection by answering every request with a fixed 429.
async fn refusing(stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let service = hyper::service::service_fn(|_req: Request<Incoming>| async {
        let body = Full::new(Bytes::from_static(
            b"{\"message\":\"rate limit exceeded\",\"limit\":1,\"remaining\":0}",
        ));
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
        Ok::<_, std::convert::Infallible>(response)
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
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
    req: Request<Incoming>,
) -> Reply {
    let mut sender = up.borrow_mut().take();
    // A kept connection the upstream closed (or that failed) is replaced.
    if let Some(s) = &mut sender {
        if s.ready().await.is_err() {
            sender = None;
        }
    }
    let mut sender = match sender {
        Some(s) => s,
        None => match open(upstream).await {
            Some(s) => s,
            None => return bad_gateway(),
        },
    };
    match sender.send_request(req).await {
        Ok(response) => {
            *up.borrow_mut() = Some(sender);
            response.map(Either::Left)
        }
        Err(_) => bad_gateway(),
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

fn bad_gateway() -> Reply {
    let mut response = Response::new(Either::Right(Empty::new()));
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
}
