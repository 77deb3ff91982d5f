//! Keep-alive HTTP/1.1 connections to one upstream target, reused most-recently-used
//! first.
//!
//! A lean pool over hyper's `client::conn::http1`: checking a connection out is a lock,
//! a pop and a readiness test; it goes back when the response body has been read to its
//! end (a body that is dropped early takes its connection with it, since the rest of
//! that response would still be on the wire). hyper-util's general-purpose client did
//! the same job with a keyed pool, a connect/checkout race and more boxing per request:
//! about an eighth of the instructions of a proxied request (see BENCHMARKS.md).

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Why a request could not be sent or answered.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The TCP connect took longer than the upstream's `connect_timeout`.
    #[error("connect to {0} timed out")]
    ConnectTimeout(Authority),
    /// The TCP connect failed (refused, unreachable, ...).
    #[error("connect to {0}: {1}")]
    Connect(Authority, std::io::Error),
    /// The HTTP exchange failed (reset, closed early, bad response, ...).
    #[error("{0}")]
    Http(#[from] hyper::Error),
}

/// Idle connections to one target.
#[derive(Debug)]
pub struct Pool {
    authority: Authority,
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

#[derive(Debug)]
struct Idle {
    tx: SendRequest<Incoming>,
    since: Instant,
}

impl Pool {
    /// A pool for `authority` (`HOST:PORT`) keeping at most `max_idle` idle connections,
    /// each for at most `idle_timeout`.
    pub fn new(
        authority: Authority,
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            authority,
            idle: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
            connect_timeout,
        })
    }

    /// Send `req` (origin-form URI, `Host` set) on an idle connection, or a new one. A
    /// request that an idle connection could not take (it was closed meanwhile) is sent
    /// again on a new connection; one that was already written is not retried.
    ///
    /// Errors: [`PoolError`].
    pub async fn send(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
    ) -> Result<Response<PooledBody>, PoolError> {
        while let Some(mut tx) = self.checkout() {
            if !tx.is_ready() && tx.ready().await.is_err() {
                continue;
            }
            match tx.try_send_request(req).await {
                Ok(response) => return Ok(self.wrap(response, tx)),
                Err(mut e) => match e.take_message() {
                    // Not sent: the connection was closing. Try the next one.
                    Some(back) => req = back,
                    None => return Err(PoolError::Http(e.into_error())),
                },
            }
        }
        let mut tx = self.connect().await?;
        let response = tx.send_request(req).await?;
        Ok(self.wrap(response, tx))
    }

    fn checkout(&self) -> Option<SendRequest<Incoming>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(c) = idle.pop() {
            if !c.tx.is_closed() && c.since.elapsed() < self.idle_timeout {
                return Some(c.tx);
            }
        }
        None
    }

    fn checkin(&self, tx: SendRequest<Incoming>) {
        if tx.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() >= self.max_idle {
            // Make room by dropping the least recently used (the bottom of the stack).
            idle.remove(0);
        }
        idle.push(Idle {
            tx,
            since: Instant::now(),
        });
    }

    async fn connect(&self) -> Result<SendRequest<Incoming>, PoolError> {
        let addr = format!(
            "{}:{}",
            self.authority.host(),
            self.authority.port_u16().unwrap_or(80)
        );
        let stream =
            match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&addr)).await {
                Err(_) => return Err(PoolError::ConnectTimeout(self.authority.clone())),
                Ok(Err(e)) => return Err(PoolError::Connect(self.authority.clone(), e)),
                Ok(Ok(s)) => s,
            };
        let _ = stream.set_nodelay(true);
        let (tx, conn) = http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(tx)
    }

    fn wrap(
        self: &Arc<Self>,
        response: Response<Incoming>,
        tx: SendRequest<Incoming>,
    ) -> Response<PooledBody> {
        response.map(|inner| PooledBody {
            inner,
            slot: Some((self.clone(), tx)),
        })
    }
}

/// A response body from a pooled connection: when it has been read to its end (or had
/// none), the connection goes back to its pool.
#[derive(Debug)]
pub struct PooledBody {
    inner: Incoming,
    slot: Option<(Arc<Pool>, SendRequest<Incoming>)>,
}

impl PooledBody {
    fn release_if_done(&mut self) {
        if self.inner.is_end_stream() {
            if let Some((pool, tx)) = self.slot.take() {
                pool.checkin(tx);
            }
        }
    }
}

impl HttpBody for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some((pool, tx)) = self.slot.take() {
                    pool.checkin(tx);
                }
            }
            Poll::Ready(Some(Ok(_))) => self.release_if_done(),
            Poll::Ready(Some(Err(_))) => self.slot = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body with nothing left (e.g. Content-Length: 0, or a 304) may never be
        // polled: its connection is reusable all the same.
        self.release_if_done();
    }
}
