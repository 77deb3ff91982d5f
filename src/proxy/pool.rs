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

use super::body::{BodyError, BodyState, RequestBody};
use crate::wire::h2client;
use crate::budget::{Budget, Counted};
use crate::clock::Coarse;
use crate::config::UpstreamProtocol;
use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Why a request could not be sent or answered.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The TCP connect took longer than the upstream's `connect_timeout`.
    #[error("connect to {0} timed out")]
    ConnectTimeout(Authority),
    /// The TCP connect failed (refused, unreachable, ...).
    #[error("connect to {0}: {1}")]
    Connect(Authority, std::io::Error),
    /// The TLS handshake with the target failed (untrusted certificate, wrong name, ...).
    #[error("TLS handshake with {0}: {1}")]
    Tls(Authority, std::io::Error),
    /// The HTTP exchange failed (reset, closed early, bad response, ...).
    #[error("{0}")]
    Http(#[from] hyper::Error),
    /// The HTTP/2 exchange failed (stream reset, connection error, GOAWAY, a response
    /// head past the header-list limit, ...).
    #[error("{0}")]
    H2(#[from] h2::Error),
    /// The request body failed while it was sent to an HTTP/2 upstream (too large,
    /// stopped arriving, unreadable: see [`super::body`]).
    #[error("request body: {0}")]
    Body(#[source] BodyError),
    /// No socket could be opened: the descriptor budget is spent.
    #[error("no descriptor left for a connection to {0} (the open-file limit is spent)")]
    NoDescriptor(Authority),
}

impl From<h2client::StreamError<BodyError>> for PoolError {
    fn from(e: h2client::StreamError<BodyError>) -> Self {
        match e {
            h2client::StreamError::H2(e) => PoolError::H2(e),
            h2client::StreamError::Body(e) => PoolError::Body(e),
        }
    }
}

/// A request body the HTTP/2 client can send again (see [`h2client::REPLAY_BYTES`]).
impl h2client::Replay for RequestBody {
    fn replay(frames: Vec<Frame<Bytes>>) -> Self {
        RequestBody::replay(frames)
    }
}

impl PoolError {
    /// Whether the target refused the connection (connect error or connect timeout): the
    /// failures that eject a target for a while.
    pub fn is_refusal(&self) -> bool {
        matches!(self, PoolError::ConnectTimeout(_) | PoolError::Connect(..))
    }
}

/// A failed [`Pool::send`]: the error, and the request when not a byte of it was sent
/// (the connection could not be made), so that it may go to another target.
#[derive(Debug)]
pub struct SendError {
    /// What went wrong.
    pub error: PoolError,
    /// The request, back untouched, when the failure came before sending it.
    pub unsent: Option<Request<RequestBody>>,
}

/// A connection (`connected`) to send `req` on, or the failure to get one, with `req`
/// handed back unsent.
#[allow(clippy::result_large_err)] // as large as `send`'s own error; moved at once
fn unsent_on_error<T>(
    connected: Result<T, PoolError>,
    req: Request<RequestBody>,
) -> Result<(T, Request<RequestBody>), SendError> {
    match connected {
        Ok(tx) => Ok((tx, req)),
        Err(error) => Err(SendError {
            error,
            unsent: Some(req),
        }),
    }
}

impl From<PoolError> for SendError {
    fn from(error: PoolError) -> Self {
        SendError {
            error,
            unsent: None,
        }
    }
}

/// How connections to one target are made: TCP, then TLS for `https://` targets.
pub struct Connector {
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
/// process (see [`Pool::send_h2`]), each time on another connection.
const H2_ATTEMPTS: usize = 5;

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
    /// through (about 400 instructions per request, issue 16).
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
                        None => return Err(PoolError::Http(e.into_error()).into()),
                    },
                }
            }
            // Boxed: connecting (TCP, TLS, handshake) is rare and its future large.
            let (mut tx, req) = unsent_on_error(Box::pin(self.connect_h1(budget)).await, req)?;
            let response = tx.send_request(req).await.map_err(PoolError::Http)?;
            Ok(self.wrap(response, Some(back(tx))))
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
        let informational = req
            .extensions_mut()
            .remove::<crate::wire::Informational>();
        let mut attempt = 1;
        loop {
            let ((mut conn, claim), back) = unsent_on_error(self.h2_sender(budget).await, req)?;
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
                    }) => return Err(PoolError::from(error).into()),
                },
            };
            // A refused stream leaves its connection as it was; any other failure
            // (closed, going away) leaves it with no stream to open.
            if !matches!(&error, PoolError::H2(e) if e.reason() == Some(h2::Reason::REFUSED_STREAM) && e.is_reset())
            {
                self.forget_h2(&conn);
            }
            if attempt >= H2_ATTEMPTS {
                return Err(SendError {
                    error,
                    unsent: Some(req),
                });
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

    /// A new TCP connection to the target, counted in `budget`.
    async fn tcp(&self, budget: &Budget) -> Result<Counted<TcpStream>, PoolError> {
        let c = &self.connector;
        let descriptor = budget
            .upstream()
            .ok_or_else(|| PoolError::NoDescriptor(c.authority.clone()))?;
        let default_port = if c.tls.is_some() { 443 } else { 80 };
        let addr = format!(
            "{}:{}",
            c.authority.host(),
            c.authority.port_u16().unwrap_or(default_port)
        );
        let stream = match tokio::time::timeout(c.connect_timeout, TcpStream::connect(&addr)).await
        {
            Err(_) => return Err(PoolError::ConnectTimeout(c.authority.clone())),
            Ok(Err(e)) => return Err(PoolError::Connect(c.authority.clone(), e)),
            Ok(Ok(s)) => s,
        };
        let _ = stream.set_nodelay(true);
        Ok(Counted::new(stream, descriptor))
    }

    async fn tls(
        &self,
        stream: Counted<TcpStream>,
        tls: &(TlsConnector, ServerName<'static>),
    ) -> Result<tokio_rustls::client::TlsStream<Counted<TcpStream>>, PoolError> {
        let c = &self.connector;
        let (connector, name) = tls;
        match tokio::time::timeout(c.connect_timeout, connector.connect(name.clone(), stream)).await
        {
            Err(_) => Err(PoolError::Tls(
                c.authority.clone(),
                std::io::Error::new(std::io::ErrorKind::TimedOut, "handshake timed out"),
            )),
            Ok(Err(e)) => Err(PoolError::Tls(c.authority.clone(), e)),
            Ok(Ok(s)) => Ok(s),
        }
    }

    async fn connect_h1(
        &self,
        budget: &Budget,
    ) -> Result<http1::SendRequest<RequestBody>, PoolError> {
        let stream = self.tcp(budget).await?;
        let max = self.connector.max_response_header_bytes;
        let tx = match &self.connector.tls {
            None => spawn_h1(TokioIo::new(stream), max).await?,
            Some(tls) => spawn_h1(TokioIo::new(self.tls(stream, tls).await?), max).await?,
        };
        Ok(tx)
    }

    async fn connect_h2(&self, budget: &Budget) -> Result<h2client::Connection, PoolError> {
        let stream = self.tcp(budget).await?;
        let max = self.connector.max_response_header_bytes;
        let conn = match &self.connector.tls {
            None => h2client::Connection::handshake(stream, max).await?,
            Some(tls) => h2client::Connection::handshake(self.tls(stream, tls).await?, max).await?,
        };
        Ok(conn)
    }

    fn wrap_h2(&self, response: Response<h2client::ResponseBody>) -> Response<PooledBody> {
        response.map(|body| PooledBody {
            inner: Inner::H2(body),
            slot: None,
        })
    }

    fn wrap(
        self: &Arc<Self>,
        response: Response<Incoming>,
        h1: Option<Back>,
    ) -> Response<PooledBody> {
        response.map(|inner| PooledBody {
            inner: Inner::H1(inner),
            slot: h1.map(|back| Slot {
                pool: self.clone(),
                part: back.part,
                tx: back.tx,
                body: back.body,
                affinity: back.affinity,
            }),
        })
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

/// hyper's default HTTP/1.1 read buffer limit (8 KiB + 100 × 4 KiB), in bytes: the
/// buffer is never made smaller than this, so that large bodies still stream in large
/// reads; `upstreams.max_response_header_bytes` is checked on the parsed head.
const H1_DEFAULT_MAX_BUF: usize = 8192 + 4096 * 100;

/// An HTTP/1.1 connection on `io` whose read buffer holds a head of
/// `max_head_bytes` (and its request line) at least.
async fn spawn_h1<T>(
    io: TokioIo<T>,
    max_head_bytes: usize,
) -> Result<http1::SendRequest<RequestBody>, PoolError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (tx, conn) = http1::Builder::new()
        .max_buf_size(max_head_bytes.saturating_add(8192).max(H1_DEFAULT_MAX_BUF))
        .handshake(io)
        .await?;
    tokio::spawn(async move {
        // With upgrades: a 101 answer hands the connection over to a tunnel (WebSocket).
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    Ok(tx)
}

/// Where an HTTP/1.1 connection goes when its exchange ends: the pool's `part`, or the
/// downstream connection's [`Affinity`]; `body` tells whether its request body was sent.
struct Back {
    part: usize,
    tx: http1::SendRequest<RequestBody>,
    body: Arc<BodyState>,
    affinity: Option<Affinity>,
}

/// The HTTP/1.1 upstream connection that one downstream connection used last, kept for
/// that downstream connection's next request (pingora's connection reuse): checking it
/// out is one uncontended lock, with no pool stack and no clock read. One connection is
/// kept at most (the last one whose exchange ended, ready for another request); the one
/// it replaces, and the one kept when the downstream connection ends, go back to their
/// pool (where the idle bound and `keepalive_timeout` apply). A kept connection older
/// than its pool's `keepalive_timeout` is not used. Cloning shares it (the response body
/// holds a clone to put the connection back).
#[derive(Debug, Clone, Default)]
pub struct Affinity(Arc<KeptCell>);

/// See [`Affinity`].
#[derive(Debug)]
struct Kept {
    pool: Arc<Pool>,
    part: usize,
    tx: http1::SendRequest<RequestBody>,
    /// When it became idle (the coarse clock: its idle timeout is seconds long).
    since: Coarse,
}

impl Affinity {
    /// The kept connection, when it is `pool`'s, still open and young enough.
    fn take(&self, pool: &Arc<Pool>) -> Option<http1::SendRequest<RequestBody>> {
        let mut kept = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        if !kept.as_ref().is_some_and(|k| Arc::ptr_eq(&k.pool, pool)) {
            return None;
        }
        let k = kept.take()?;
        (!k.tx.is_closed() && k.since.elapsed() < pool.idle_timeout).then_some(k.tx)
    }

    /// Keep `tx` (ready for another request); the connection kept before goes back to
    /// its pool.
    fn keep(&self, pool: Arc<Pool>, part: usize, tx: http1::SendRequest<RequestBody>) {
        let new = Kept {
            pool,
            part,
            tx,
            since: Coarse::now(),
        };
        let old = self
            .0
             .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(new);
        if let Some(old) = old {
            old.pool.keep(old.part, old.tx, old.since);
        }
    }
}

/// The cell an [`Affinity`] shares: when the downstream connection and its last response
/// are gone, the connection kept in it goes back to its pool.
#[derive(Debug, Default)]
struct KeptCell(Mutex<Option<Kept>>);

impl Drop for KeptCell {
    fn drop(&mut self) {
        let kept = self.0.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(k) = kept {
            k.pool.keep(k.part, k.tx, k.since);
        }
    }
}

/// A response body from a pooled connection: when it has been read to its end (or had
/// none), an HTTP/1.1 connection goes back to its pool if its request body was sent to
/// its end, and is closed otherwise (an HTTP/2 one is shared anyway).
#[derive(Debug)]
pub struct PooledBody {
    inner: Inner,
    slot: Option<Slot>,
}

/// The body as the connection's protocol reads it.
#[derive(Debug)]
enum Inner {
    H1(Incoming),
    H2(h2client::ResponseBody),
}

impl Inner {
    fn is_end_stream(&self) -> bool {
        match self {
            Inner::H1(body) => body.is_end_stream(),
            Inner::H2(body) => body.is_end_stream(),
        }
    }
}

/// The HTTP/1.1 connection a response came on, and the request body it carries.
#[derive(Debug)]
struct Slot {
    pool: Arc<Pool>,
    /// The pool's part the connection came from (and goes back to).
    part: usize,
    tx: http1::SendRequest<RequestBody>,
    body: Arc<BodyState>,
    /// The downstream connection's, to keep the connection for its next request.
    affinity: Option<Affinity>,
}

impl Slot {
    /// The response was read to its end: the connection goes back to the downstream
    /// connection's [`Affinity`] (or the pool) if the request body was sent to its end
    /// too; otherwise the upload is cut off, which closes the connection.
    fn release(self) {
        if !self.body.is_done() {
            self.body.cut_off();
            return;
        }
        match self.affinity {
            Some(affinity) if self.tx.is_ready() => affinity.keep(self.pool, self.part, self.tx),
            _ => self.pool.checkin(self.part, self.tx),
        }
    }
}

impl PooledBody {
    fn release_if_done(&mut self) {
        if self.inner.is_end_stream() {
            if let Some(slot) = self.slot.take() {
                slot.release();
            }
        }
    }
}

impl HttpBody for PooledBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let polled = match &mut self.inner {
            Inner::H1(body) => Pin::new(body).poll_frame(cx).map_err(BodyError::from),
            Inner::H2(body) => Pin::new(body).poll_frame(cx).map_err(BodyError::from),
        };
        match &polled {
            Poll::Ready(None) => {
                if let Some(slot) = self.slot.take() {
                    slot.release();
                }
            }
            Poll::Ready(Some(Ok(_))) => self.release_if_done(),
            Poll::Ready(Some(Err(_))) => {
                if let Some(slot) = self.slot.take() {
                    slot.body.cut_off();
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::H1(body) => body.size_hint(),
            Inner::H2(body) => body.size_hint(),
        }
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body with nothing left (e.g. Content-Length: 0, or a 304) may never be
        // polled: its connection is reusable all the same.
        self.release_if_done();
        // The rest of the response is still on the wire: the connection is done for,
        // and so is what is left of its upload.
        if let Some(slot) = self.slot.take() {
            slot.body.cut_off();
        }
    }
}
