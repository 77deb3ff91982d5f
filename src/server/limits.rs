//! What tells an idle client connection: [`Activity`] follows a connection's requests so
//! that it can be closed after `server.idle_timeout` without one, its reads ([`Reads`])
//! so that an HTTP/1 request head still incomplete after `server.header_read_timeout`
//! closes it, and its responses' bodies ([`SendWatch`]) so that it can be closed when the
//! client stops reading for `server.send_timeout`. One deadline per connection serves all
//! three (see `Connection::serve`): no timer is set per request. Header size and header-read time are hyper's
//! settings, HTTP/2's limits the h2 crate's (`crate::wire::h2server::Settings`), applied in
//! `accept::accept_loop`; `server.max_connections` and the descriptor budget
//! are [`crate::budget::Budget`]'s, sized here from the open-file limit.

use crate::budget::FD_RESERVE;
use crate::clock::Coarse;
use crate::response::Body;
use bytes::Bytes;
use hyper::body::Frame;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

/// Requests of one connection: how many are being handled, and when the last one
/// started or ended (milliseconds since the connection opened). Its times come from
/// the coarse clock ([`Coarse`]: a reading lags by up to one kernel tick, 1 to 10 ms),
/// read several times per request, against timeouts of seconds.
#[derive(Debug)]
pub(crate) struct Activity {
    opened: Coarse,
    active: AtomicUsize,
    last_ms: AtomicU64,
    /// Response bodies that handed over data and have not been asked for more since:
    /// they wait for the client to take what was sent.
    waiting: AtomicUsize,
    /// When a response body of this connection was last asked for data.
    sent_ms: AtomicU64,
    /// When the first byte of an HTTP/1 request head arrived (milliseconds since the
    /// connection opened, plus one), while no request is being handled; 0: no head is
    /// being read.
    head_ms: AtomicU64,
}

impl Activity {
    /// A connection that opened now.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            opened: Coarse::now(),
            active: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            sent_ms: AtomicU64::new(0),
            head_ms: AtomicU64::new(0),
        })
    }

    /// Bytes of an HTTP/1 request arrived: with no request being handled, they begin a
    /// request head (unless one is begun already).
    fn head_bytes(&self) {
        if self.active.load(Ordering::Relaxed) == 0 && self.head_ms.load(Ordering::Relaxed) == 0 {
            self.head_ms.store(self.now_ms() + 1, Ordering::Relaxed);
        }
    }

    /// How long the request head being read has taken so far: zero when none is (no
    /// byte of one yet, a request being handled, or an HTTP/2 connection).
    pub(crate) fn head_for(&self) -> Duration {
        let since = self.head_ms.load(Ordering::Relaxed);
        if since == 0 || self.active.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        Duration::from_millis(self.now_ms().saturating_sub(since - 1))
    }

    fn now_ms(&self) -> u64 {
        self.opened.elapsed_ms()
    }

    fn touch(&self) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// How long the connection's responses have waited for the client to read: zero
    /// unless a response body handed over data and no response body has been asked for
    /// more since (hyper asks once the previous data is written, to the socket for
    /// HTTP/1 or within the flow-control window for HTTP/2).
    pub(crate) fn stalled_for(&self) -> Duration {
        if self.waiting.load(Ordering::Relaxed) == 0 {
            return Duration::ZERO;
        }
        let since = self.sent_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.now_ms().saturating_sub(since))
    }

    /// A request started; it counts as activity until the guard is dropped (when its
    /// handler returned the response), which marks the time. (Not marked here: while a
    /// request is handled the connection is not idle whatever the mark says, and the
    /// guard marks it again at the end; a clock reading less per request.)
    pub(crate) fn request(self: &Arc<Self>) -> RequestActivity {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.head_ms.store(0, Ordering::Relaxed);
        RequestActivity(self.clone())
    }

    /// How long the connection has been idle: zero while a request is handled.
    pub(crate) fn idle_for(&self) -> Duration {
        if self.active.load(Ordering::Relaxed) > 0 {
            return Duration::ZERO;
        }
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.opened.elapsed().saturating_sub(last)
    }
}

/// See [`Activity::request`].
#[derive(Debug)]
pub(crate) struct RequestActivity(Arc<Activity>);

impl Drop for RequestActivity {
    fn drop(&mut self) {
        self.0.touch();
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body that tells its connection's [`Activity`] when it waits for the client
/// to read: after it handed over a data frame and until it is asked for the next one.
/// It also holds what ends with the body: the request's [`crate::proxy::Finished`] (its
/// in-flight count and access line) and its [`RequestActivity`], so the connection counts
/// as busy until the body is dropped (after the body's own guards and the access line:
/// fields drop in order).
pub(crate) struct SendWatch {
    body: Body,
    _finished: crate::proxy::Finished,
    busy: RequestActivity,
    waiting: bool,
}

impl SendWatch {
    /// Watch `body`, the response of the request `busy` marks, which `finished` ends.
    pub(crate) fn new(body: Body, finished: crate::proxy::Finished, busy: RequestActivity) -> Self {
        Self {
            body,
            _finished: finished,
            busy,
            waiting: false,
        }
    }

    fn set_waiting(&mut self, waiting: bool) {
        if waiting != self.waiting {
            self.waiting = waiting;
            let count = &self.busy.0.waiting;
            if waiting {
                count.fetch_add(1, Ordering::Relaxed);
            } else {
                count.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

impl hyper::body::Body for SendWatch {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let activity = &this.busy.0;
        activity.sent_ms.store(activity.now_ms(), Ordering::Relaxed);
        this.set_waiting(false);
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if frame.is_data() {
                this.set_waiting(true);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

impl Drop for SendWatch {
    fn drop(&mut self) {
        self.set_waiting(false);
    }
}

/// The client preface of HTTP/2 (RFC 9113 §3.4), as far as it tells HTTP/2 from HTTP/1.
const PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// A client connection's transport (TCP, or TLS above it), telling its [`Activity`] when
/// bytes of an HTTP/1 request head arrive, so that one deadline per connection bounds
/// the time a head may take (`server.header_read_timeout`) instead of a timer per
/// request. A connection that opens with the HTTP/2 preface is not watched: HTTP/2
/// frames arrive between requests, and its limits are HTTP/2's.
pub(crate) struct Reads<T> {
    io: T,
    activity: Arc<Activity>,
    /// Bytes of [`PREFACE`] matched so far; `None` once the protocol is known.
    sniffed: Option<usize>,
    http2: bool,
}

impl<T> Reads<T> {
    /// Watch the reads of `io` for `activity`.
    pub(crate) fn new(io: T, activity: Arc<Activity>) -> Self {
        Self {
            io,
            activity,
            sniffed: Some(0),
            http2: false,
        }
    }

    /// Watch nothing of `io`: it carries HTTP/2 (negotiated by ALPN).
    pub(crate) fn http2(io: T, activity: Arc<Activity>) -> Self {
        Self {
            io,
            activity,
            sniffed: None,
            http2: true,
        }
    }

    fn arrived(&mut self, bytes: &[u8]) {
        if let Some(k) = self.sniffed {
            let n = bytes.len().min(PREFACE.len() - k);
            if bytes[..n] != PREFACE[k..k + n] {
                self.sniffed = None;
            } else if k + n == PREFACE.len() {
                self.sniffed = None;
                self.http2 = true;
                self.activity.head_ms.store(0, Ordering::Relaxed);
                return;
            } else {
                self.sniffed = Some(k + n);
            }
        }
        if !self.http2 {
            self.activity.head_bytes();
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Reads<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            if buf.filled().len() > before {
                self.arrived(&buf.filled()[before..]);
            }
        }
        polled
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Reads<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// This process's soft limit on open files (`Max open files` in `/proc/self/limits`);
/// `None` when unknown (not Linux) or unlimited.
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The descriptors client connections and upstream sockets may hold together: the
/// open-file limit less [`FD_RESERVE`]; `None` when the limit is unknown or unlimited.
pub(crate) fn descriptor_budget() -> Option<usize> {
    let limit = open_files_limit()?;
    usize::try_from(limit.saturating_sub(FD_RESERVE).max(1)).ok()
}

/// `server.max_connections`, lowered when the open-file limit could not hold that many
/// client connections, each with an upstream connection (two descriptors), and
/// [`FD_RESERVE`] more: past the fd limit every accept fails, the admin listener's
/// included, while past `max_connections` clients get 503 and `/healthz` still answers.
/// Logs a warning when it lowers it.
pub(crate) fn effective_max_connections(configured: usize) -> usize {
    let Some(limit) = open_files_limit() else {
        return configured;
    };
    let fits = (limit.saturating_sub(FD_RESERVE) / 2).max(1);
    if (configured as u64) <= fits {
        return configured;
    }
    tracing::warn!(
        configured,
        open_files_limit = limit,
        lowered_to = fits,
        "server.max_connections lowered to fit the open-file limit (two descriptors per connection, {FD_RESERVE} kept for the admin listener, Redis and files); raise LimitNOFILE to allow more"
    );
    fits as usize
}
