//! Connections to one upstream target, plain TCP or TLS: keep-alive HTTP/1.1
//! connections reused most-recently-used first, or multiplexed HTTP/2 connections: as
//! few as carry the requests in flight, each at most [`h2client::MAX_STREAMS`] of them
//! (or fewer, as the upstream's `SETTINGS_MAX_CONCURRENT_STREAMS` says), so that
//! streams whose clients stopped reading never leave the others waiting for a stream.
//!
//! A lean pool over hyper's `client::conn::http1`: checking a connection out is a lock,
//! a pop and a readiness test; it goes back when the response body has been read to its
//! end and the request body was sent to its end, once the connection is ready for
//! another request. A connection whose response was not read to its end goes with its
//! body; one whose request body is still being sent when the response ends (the
//! upstream answered early, e.g. 401 before reading an upload) is closed, the rest of
//! the upload cut off: it is never handed to another request, which would wait behind
//! that upload. Every socket is counted in the descriptor budget
//! ([`crate::budget::Budget`]); when it is spent, no socket is opened. hyper-util's general-purpose client did
//! the same job with a keyed pool, a connect/checkout race and more boxing per request:
//! about an eighth of the instructions of a proxied request (see BENCHMARKS.md).
//!
//! A downstream connection keeps the HTTP/1.1 upstream connection its last request used
//! ([`Affinity`], as pingora does) and sends its next request on it, without the pool's
//! lock and stack; it falls back to the pool when that connection is gone or busy, and
//! gives it back to the pool when the downstream connection ends.
//!
//! With `server.runtime = "per_core"` a pool holds one part per worker: a request takes
//! and returns connections in its own worker's part, whose connections' tasks run on
//! that worker's runtime, so that no exchange with the upstream wakes another thread.

mod back;
mod connect;
mod error;
#[cfg(test)]
mod tests;

pub use back::{Affinity, PooledBody};
pub use error::{PoolError, SendError};

use super::body::RequestBody;
use crate::budget::Budget;
use crate::clock::Coarse;
use crate::config::UpstreamProtocol;
use crate::wire::h2client;
use back::Back;
use http::uri::Authority;
use http::{Request, Response};
use http_body::Body as _;
use hyper::client::conn::http1;
use rustls::pki_types::ServerName;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_rustls::TlsConnector;

/// How connections to one target are made: TCP, then TLS for `https://` targets.
pub struct Connector {
    /// The name of the upstream the target is one of (for its failures).
    pub upstream: Arc<str>,
    /// `HOST:PORT` of the target.
    pub authority: Authority,
    /// Budget for the TCP connect (the TLS handshake has its own, of the same length).
    pub connect_timeout: Duration,
    /// For `https://` targets: the TLS connector and the name sent as SNI and checked
    /// against the certificate (the target's host).
    pub tls: Option<(TlsConnector, ServerName<'static>)>,
    /// The HTTP version spoken on the connections.
    pub protocol: UpstreamProtocol,
    /// `upstreams.max_response_header_bytes`: the HTTP/2 header-list limit sent to the
    /// target, and the least head an HTTP/1.1 connection's buffer holds, in bytes.
    pub max_response_header_bytes: usize,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("upstream", &self.upstream)
            .field("authority", &self.authority)
            .field("connect_timeout", &self.connect_timeout)
            .field("tls_server_name", &self.tls.as_ref().map(|(_, name)| name))
            .field("protocol", &self.protocol)
            .field("max_response_header_bytes", &self.max_response_header_bytes)
            .finish()
    }
}

/// Connections to one target: a keep-alive stack (HTTP/1.1) or shared multiplexed
/// connections (HTTP/2), per worker (see the module documentation).
#[derive(Debug)]
pub struct Pool {
    connector: Connector,
    /// One per `per_core` worker (one in all with the multi-thread runtime).
    parts: Box<[Part]>,
    /// Idle HTTP/1.1 connections one part keeps.
    max_idle: usize,
    idle_timeout: Duration,
}

/// The connections of one worker (see [`Pool`]).
#[derive(Debug, Default)]
struct Part {
    idle: Mutex<Vec<Idle>>,
    /// HTTP/2: the shared connections, oldest first, cloned per request.
    shared: Mutex<Vec<h2client::Connection>>,
    /// HTTP/2: held while connecting, so that one connection is made at a time.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct Idle {
    tx: http1::SendRequest<RequestBody>,
    /// When it became idle (the coarse clock: its idle timeout is seconds long).
    since: Coarse,
}

/// How many times [`Pool::send`] sends an HTTP/2 request that the upstream did not
/// process (see [`Pool::send_h2`]), each time on another connection. Ten: one request
/// may meet several connections going away in a row, each leaving it unprocessed
/// twice (refused, then above the `GOAWAY` of the connection it was sent again on);
/// five let one request in about 40 runs of
/// `a_graceful_goaway_and_refused_streams_cost_no_502` (16 clients, `GOAWAY` every 50
/// requests, every 7th stream refused) end in a 502. Each attempt costs the upstream
/// nothing (it did not process the request).
const H2_ATTEMPTS: usize = 10;

/// How long a connection whose exchange has ended may take to be ready for the next
/// request (the end of its request body still being written) before it is given up.
const CLEAN_WAIT: Duration = Duration::from_secs(5);

impl Pool {
    /// A pool of connections made by `connector`, keeping at most `max_idle` idle
    /// HTTP/1.1 connections, each for at most `idle_timeout`, in `parts` parts (one per
    /// `per_core` worker, see [`crate::worker::parts`]; at least 1)
    /// that share `max_idle` (each keeps at least one).
    pub fn new(
        connector: Connector,
        max_idle: usize,
        idle_timeout: Duration,
        parts: usize,
    ) -> Arc<Self> {
        let parts = parts.max(1);
        Arc::new(Self {
            connector,
            parts: (0..parts).map(|_| Part::default()).collect(),
            max_idle: max_idle.div_ceil(parts).max(1),
            idle_timeout,
        })
    }

    /// The part of this thread's worker, and its index.
    fn part(&self) -> (usize, &Part) {
        let index = crate::worker::slot(self.parts.len());
        (index, &self.parts[index])
    }

    /// Send `req` (origin-form URI and `Host` for HTTP/1.1; absolute URI for HTTP/2) on
    /// an idle connection, or a new one, counted in `budget`. A request that an idle
    /// connection could not take (it was closed meanwhile) is sent again on a new
    /// connection; one that was already written is not retried.
    ///
    /// Errors: [`SendError`], with the request when it was not sent at all
    /// ([`PoolError::NoDescriptor`] when `budget` has no descriptor for a new socket).
    ///
    /// On HTTP/1.1, `affinity` (the downstream connection's, `None` on HTTP/2) is tried
    /// first, and the connection the response came on is kept there for the next request
    /// when its exchange ends (see [`Affinity`]).
    ///
    /// A plain function choosing between the two exchanges' futures (an enum of them),
    /// not an `async fn` around them: one state machine less to move the request
    /// through (about 400 instructions per request).
    pub fn send<'a>(
        self: &'a Arc<Self>,
        req: Request<RequestBody>,
        budget: &'a Budget,
        affinity: Option<&'a Affinity>,
    ) -> impl std::future::Future<Output = Result<Response<PooledBody>, SendError>> + Send + 'a
    {
        use futures_util::future::Either;
        match self.connector.protocol {
            UpstreamProtocol::Http1 => Either::Left(self.send_h1(req, budget, affinity)),
            // Boxed: kept out of the size of every request's future (see `proxy::handle`).
            UpstreamProtocol::Http2 => Either::Right(Box::pin(self.send_h2(req, budget))),
        }
    }

    /// [`Pool::send`] on HTTP/1.1.
    ///
    /// Not an `async fn`, for the reason [`super::handle`] gives (arguments kept once).
    #[allow(clippy::manual_async_fn)]
    fn send_h1<'a>(
        self: &'a Arc<Self>,
        mut req: Request<RequestBody>,
        budget: &'a Budget,
        affinity: Option<&'a Affinity>,
    ) -> impl std::future::Future<Output = Result<Response<PooledBody>, SendError>> + Send + 'a
    {
        async move {
            let body = req.body().state();
            let (part, _) = self.part();
            let kept = affinity.and_then(|a| a.take(self));
            let back = |tx| Back {
                part,
                tx,
                body: body.clone(),
                affinity: affinity.cloned(),
            };
            for mut tx in kept
                .into_iter()
                .chain(std::iter::from_fn(|| self.checkout(part)))
            {
                if !tx.is_ready() && tx.ready().await.is_err() {
                    continue;
                }
                match tx.try_send_request(req).await {
                    Ok(response) => return Ok(self.wrap(response, Some(back(tx)))),
                    Err(mut e) => match e.take_message() {
                        // Not sent: the connection was closing. Try the next one.
                        Some(again) => req = again,
                        None => {
                            let error = PoolError::http(e.into_error());
                            return Err(self.exchange_failed(error, body.failure(), None));
                        }
                    },
                }
            }
            // Boxed: connecting (TCP, TLS, handshake) is rare and its future large.
            let (mut tx, req) = self.connected(Box::pin(self.connect_h1(budget)).await, req)?;
            match tx.send_request(req).await {
                Ok(response) => Ok(self.wrap(response, Some(back(tx)))),
                Err(e) => Err(self.exchange_failed(PoolError::http(e), body.failure(), None)),
            }
        }
    }

    /// [`Pool::send`] on HTTP/2: on a shared connection with a stream to spare, else a
    /// new one. A request the upstream did not process (its connection closed or went
    /// away before a stream was opened, a graceful `GOAWAY` whose last stream id is
    /// below its stream, `REFUSED_STREAM`) goes again (after a `GOAWAY`, on another
    /// connection), up to
    /// [`H2_ATTEMPTS`] times in all; then, or when it had a body that was already being
    /// sent, its error is the request's.
    async fn send_h2(
        self: &Arc<Self>,
        mut req: Request<RequestBody>,
        budget: &Budget,
    ) -> Result<Response<PooledBody>, SendError> {
        // 1xx go to the client when the request path left a handle for them.
        let informational = req.extensions_mut().remove::<crate::wire::Informational>();
        // A body that may fail on its way (not an empty one) tells how it failed.
        let body = (!req.body().is_end_stream()).then(|| req.body().state());
        let body_failure = || body.as_ref().and_then(|b| b.failure());
        let mut attempt = 1;
        loop {
            let ((mut conn, claim), back) = self.connected(self.h2_sender(budget).await, req)?;
            req = back;
            let error = match conn.ready().await {
                Err(e) => PoolError::H2(e),
                Ok(()) => match conn.send(req, informational.clone(), claim).await {
                    Ok(response) => return Ok(self.wrap_h2(response)),
                    Err(h2client::SendFailure {
                        error,
                        unprocessed: Some(again),
                    }) => {
                        req = again;
                        error.into()
                    }
                    Err(h2client::SendFailure {
                        error,
                        unprocessed: None,
                    }) => return Err(self.exchange_failed(error.into(), body_failure(), None)),
                },
            };
            // A refused stream leaves its connection as it was; any other failure
            // (closed, going away) leaves it with no stream to open.
            if !matches!(&error, PoolError::H2(e) if e.reason() == Some(h2::Reason::REFUSED_STREAM) && e.is_reset())
            {
                self.forget_h2(&conn);
            }
            if attempt >= H2_ATTEMPTS {
                return Err(self.exchange_failed(error, body_failure(), Some(req)));
            }
            tracing::debug!(
                addr = %self.connector.authority,
                error = %error,
                attempt,
                "HTTP/2 upstream did not process the request; sending it again on another connection"
            );
            attempt += 1;
        }
    }

    /// A shared HTTP/2 connection with a stream to spare and a place on it, or a new
    /// connection when none has one.
    async fn h2_sender(
        &self,
        budget: &Budget,
    ) -> Result<(h2client::Connection, h2client::Claim), PoolError> {
        let (_, part) = self.part();
        if let Some(claimed) = part.claim_h2() {
            return Ok(claimed);
        }
        let _connecting = part.connecting.lock().await;
        if let Some(claimed) = part.claim_h2() {
            return Ok(claimed);
        }
        let conn = self.connect_h2(budget).await?;
        let claim = conn.claim(true).ok_or_else(|| {
            PoolError::Connect(
                self.connector.authority.clone(),
                std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "HTTP/2 connection closed at once",
                ),
            )
        })?;
        part.shared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(conn.clone());
        Ok((conn, claim))
    }

    /// Drop `conn` (which failed, or which the upstream closed or is closing) from this
    /// worker's shared HTTP/2 connections: no new request goes on it. Its requests in
    /// flight finish on it.
    fn forget_h2(&self, conn: &h2client::Connection) {
        let (_, part) = self.part();
        let mut shared = part.shared.lock().unwrap_or_else(|e| e.into_inner());
        shared.retain(|s| !s.same(conn));
    }

    fn checkout(&self, part: usize) -> Option<http1::SendRequest<RequestBody>> {
        let mut idle = self.parts[part]
            .idle
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while let Some(c) = idle.pop() {
            if !c.tx.is_closed() && c.since.elapsed() < self.idle_timeout {
                return Some(c.tx);
            }
        }
        None
    }

    /// Take back a connection whose exchange has ended, once it is ready for another
    /// request (at once, nearly always; else when the end of its request body has been
    /// written, within [`CLEAN_WAIT`], or never).
    /// It goes back to `part`, the part it was taken from.
    fn checkin(self: &Arc<Self>, part: usize, mut tx: http1::SendRequest<RequestBody>) {
        if tx.is_closed() {
            return;
        }
        if !tx.is_ready() {
            let pool = self.clone();
            tokio::spawn(async move {
                if let Ok(Ok(())) = tokio::time::timeout(CLEAN_WAIT, tx.ready()).await {
                    pool.keep(part, tx, Coarse::now());
                }
            });
            return;
        }
        self.keep(part, tx, Coarse::now());
    }

    /// Put a ready connection, idle `since`, on the idle stack of `part` (unless it has
    /// closed or been idle for `keepalive_timeout`).
    fn keep(&self, part: usize, tx: http1::SendRequest<RequestBody>, since: Coarse) {
        if tx.is_closed() || since.elapsed() >= self.idle_timeout {
            return;
        }
        let mut idle = self.parts[part]
            .idle
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if idle.len() >= self.max_idle {
            // Make room by dropping the least recently used (the bottom of the stack).
            idle.remove(0);
        }
        idle.push(Idle { tx, since });
    }
}

impl Part {
    /// The first shared HTTP/2 connection with a stream to spare, and a place on it.
    /// Closed connections are dropped on the way, and so are idle ones (no stream in
    /// flight) but the first: a burst's extra connections close when it is over.
    fn claim_h2(&self) -> Option<(h2client::Connection, h2client::Claim)> {
        let mut shared = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        let mut idle_kept = false;
        shared.retain(|conn| {
            !conn.is_closed() && (conn.in_flight() > 0 || !std::mem::replace(&mut idle_kept, true))
        });
        shared
            .iter()
            .find_map(|conn| conn.claim(false).map(|claim| (conn.clone(), claim)))
    }
}
