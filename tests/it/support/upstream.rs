//! A real HTTP upstream for the tests.
//!
//! - `/status/NNN`: answers with status NNN (e.g. 304).
//! - `/echo...`: JSON `{method, path, headers}` of what it received.
//! - `/download/N`: streams N bytes in 64 KiB chunks.
//! - `/upload`: reads the body as it streams, answers `{"bytes": N}`.
//! - `/slow/MS`: waits MS milliseconds, then answers 200 (or NNN with `?status=NNN`).
//! - `/cost/N`: answers 200 with `x-tollgate-cost: N` (N as written, valid or not).
//! - `/set-headers?NAME=VALUE&...`: answers with each pair as a response header
//!   (percent-decoded; a repeated name gives several values), and with the status of a
//!   `status=NNN` pair (default 200).
//! - `/login...`: a login endpoint whose outcome the test picks: answers with the
//!   status of a `status=NNN` query (default 200).
//! - `/peer`: the port the request's connection comes from (which connection of the
//!   gateway's carried it).
//! - anything else: 200 "ok".

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;

type Body = BoxBody<Bytes, Infallible>;

pub struct Upstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let connections = Arc::new(AtomicUsize::new(0));
        let c = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, from)) = listener.accept().await else {
                    continue;
                };
                c.fetch_add(1, Ordering::SeqCst);
                let h = h.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        h.fetch_add(1, Ordering::SeqCst);
                        let peer = (req.uri().path() == "/peer").then(|| from.port());
                        async move {
                            match peer {
                                Some(port) => Ok(full(StatusCode::OK, port.to_string())),
                                None => serve(req).await,
                            }
                        }
                    });
                    let _ = auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream {
            addr,
            hits,
            connections,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests received so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// TCP connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    r
}

async fn serve(req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = req.uri().path().to_string();
    if let Some(code) = path.strip_prefix("/status/") {
        let status = code
            .parse::<u16>()
            .ok()
            .and_then(|c| StatusCode::from_u16(c).ok())
            .unwrap_or(StatusCode::BAD_REQUEST);
        let mut r = full(status, "");
        r.headers_mut()
            .insert("x-ratelimit-remaining", "999".parse().unwrap());
        return Ok(r);
    }
    if path.starts_with("/echo") {
        let headers: serde_json::Map<String, serde_json::Value> = req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned().into(),
                )
            })
            .collect();
        let body = serde_json::json!({
            "method": req.method().as_str(),
            "path": req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/"),
            "headers": headers,
        });
        let mut r = full(StatusCode::OK, body.to_string());
        r.headers_mut()
            .insert("connection", "x-upstream-private".parse().unwrap());
        r.headers_mut()
            .insert("x-upstream-private", "1".parse().unwrap());
        r.headers_mut()
            .insert("keep-alive", "timeout=5".parse().unwrap());
        return Ok(r);
    }
    if let Some(n) = path.strip_prefix("/download/") {
        let total: usize = n.parse().unwrap_or(0);
        let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
        let stream = futures_util::stream::unfold(0usize, move |sent| {
            let chunk = chunk.clone();
            async move {
                if sent >= total {
                    return None;
                }
                let n = chunk.len().min(total - sent);
                Some((Ok::<_, Infallible>(Frame::data(chunk.slice(..n))), sent + n))
            }
        });
        return Ok(Response::new(StreamBody::new(stream).boxed()));
    }
    if path == "/upload" {
        let mut body = req.into_body();
        let mut n = 0usize;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => n += f.data_ref().map(|d| d.len()).unwrap_or(0),
                Err(_) => return Ok(full(StatusCode::BAD_REQUEST, "body error")),
            }
        }
        return Ok(full(
            StatusCode::OK,
            serde_json::json!({ "bytes": n }).to_string(),
        ));
    }
    if let Some(ms) = path.strip_prefix("/slow/") {
        let ms: u64 = ms.parse().unwrap_or(0);
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        // `?status=NNN`: answer with that status (e.g. a slow 304).
        let status = req
            .uri()
            .query()
            .and_then(|q| q.strip_prefix("status="))
            .and_then(|c| c.parse::<u16>().ok())
            .and_then(|c| StatusCode::from_u16(c).ok())
            .unwrap_or(StatusCode::OK);
        return Ok(full(status, "slow ok"));
    }
    if path.starts_with("/login") {
        let status = req
            .uri()
            .query()
            .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("status=")))
            .and_then(|c| c.parse::<u16>().ok())
            .and_then(|c| StatusCode::from_u16(c).ok())
            .unwrap_or(StatusCode::OK);
        return Ok(full(status, "login"));
    }
    if let Some(cost) = path.strip_prefix("/cost/") {
        let mut r = full(StatusCode::OK, "ok");
        r.headers_mut().insert(
            "x-tollgate-cost",
            http::HeaderValue::from_str(cost).unwrap(),
        );
        return Ok(r);
    }
    if path == "/set-headers" {
        let mut r = full(StatusCode::OK, "ok");
        for pair in req.uri().query().unwrap_or("").split('&') {
            let Some((name, value)) = pair.split_once('=') else {
                continue;
            };
            let value = percent_decode(value);
            if name == "status" {
                *r.status_mut() = StatusCode::from_u16(value.parse().unwrap()).unwrap();
                continue;
            }
            r.headers_mut().append(
                http::HeaderName::from_bytes(percent_decode(name).as_bytes()).unwrap(),
                http::HeaderValue::from_str(&value).unwrap(),
            );
        }
        return Ok(r);
    }
    Ok(full(StatusCode::OK, "ok"))
}

/// `%22a%20b%22` → `"a b"`.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap()
}
