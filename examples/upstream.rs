//! A minimal, fast HTTP/1.1 upstream for load tests (see `benches/load.sh`).
//!
//! It answers every request, whatever its method or path, with `200 OK` and the
//! body `ok\n`, and keeps connections alive. It does nothing else, so that a
//! benchmark through the gateway measures the gateway, not the upstream.
//!
//! ```text
//! cargo run --release --example upstream -- 127.0.0.1:9000
//! ```
//!
//! The first argument is the listen address (default `127.0.0.1:9000`).

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// The listen address used when none is given on the command line.
const DEFAULT_ADDR: &str = "127.0.0.1:9000";

/// The body of every response.
const BODY: &[u8] = b"ok\n";

/// Answers any request with `200 OK` and [`BODY`].
async fn handle(_req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let mut resp = Response::new(Full::new(Bytes::from_static(BODY)));
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain"),
    );
    Ok(resp)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| DEFAULT_ADDR.to_owned())
        .parse()?;
    let listener = TcpListener::bind(addr).await?;
    eprintln!("upstream listening on http://{}", listener.local_addr()?);

    loop {
        let (stream, _peer) = match listener.accept().await {
            Ok(conn) => conn,
            Err(err) => {
                // E.g. EMFILE under a flood of connections: keep serving the others.
                eprintln!("accept: {err}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let conn = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service_fn(handle));
            // A client that disconnects mid-request is not an error worth logging here.
            let _ = conn.await;
        });
    }
}
