//! What tells an idle client connection: [`Activity`] follows a connection's requests so
//! that it can be closed after `server.idle_timeout` without one, and its responses'
//! bodies ([`SendWatch`]) so that it can be closed when the client stops reading for
//! `server.send_timeout` (see `Connection::serve`). Header size, header-read time and HTTP/2 streams are hyper's
//! settings, applied in `accept_loop`; `server.max_connections` and the descriptor budget
//! are [`crate::budget::Budget`]'s, sized here from the open-file limit.

use crate::budget::FD_RESERVE;
use crate::response::Body;
use bytes::Bytes;
use hyper::body::Frame;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// Requests of one connection: how many are being handled, and when the last one
/// started or ended (milliseconds since the connection opened).
#[derive(Debug)]
pub(crate) struct Activity {
    opened: Instant,
    active: AtomicUsize,
    last_ms: AtomicU64,
    /// Response bodies that handed over data and have not been asked for more since:
    /// they wait for the client to take what was sent.
    waiting: AtomicUsize,
    /// When a response body of this connection was last asked for data.
    sent_ms: AtomicU64,
}

impl Activity {
    /// A connection that opened now.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            opened: Instant::now(),
            active: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            sent_ms: AtomicU64::new(0),
        })
    }

    fn now_ms(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64
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
    /// handler returned the response).
    pub(crate) fn request(self: &Arc<Self>) -> RequestActivity {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.touch();
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
/// It also holds the request's [`RequestActivity`], so the connection counts as busy
/// until the body is dropped (after the body's own guards: fields drop in order).
pub(crate) struct SendWatch {
    body: Body,
    busy: RequestActivity,
    waiting: bool,
}

impl SendWatch {
    /// Watch `body`, the response of the request `busy` marks.
    pub(crate) fn new(body: Body, busy: RequestActivity) -> Self {
        Self {
            body,
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
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
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
