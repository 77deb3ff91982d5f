//! What tells an idle client connection: [`Activity`] follows a connection's requests so
//! that it can be closed after `server.idle_timeout` without one (see
//! `Connection::serve`). Header size, header-read time and HTTP/2 streams are hyper's
//! settings, applied in `accept_loop`; `server.max_connections` is a semaphore there.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests of one connection: how many are being handled, and when the last one
/// started or ended (milliseconds since the connection opened).
#[derive(Debug)]
pub(crate) struct Activity {
    opened: Instant,
    active: AtomicUsize,
    last_ms: AtomicU64,
}

impl Activity {
    /// A connection that opened now.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self {
            opened: Instant::now(),
            active: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
        })
    }

    fn touch(&self) {
        let ms = self.opened.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
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
