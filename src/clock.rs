//! Where "now" comes from.
//!
//! By default (`store.clock = "gateway"`) every limiter decision takes the time from the
//! gateway, never from Redis: window expiry is judged by comparing the stored `reset_at`
//! with [`Clock::now_ms`]. With `store.clock = "redis"`, the Redis scripts read `TIME`
//! instead, and this clock is left with the gateway's own arithmetic: `Retry-After`, the
//! IETF `t`, the over-limit cache and lease expiry. Either way, expiry is never derived
//! from a TTL, which keeps the `X-RateLimit-Reset` header stable (GitHub's "wobble" came
//! from TTL arithmetic), and tests move time with [`ManualClock`].

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// Milliseconds since 1970-01-01T00:00:00Z.
    fn now_ms(&self) -> u64;
}

/// A shared clock, as held by the gateway and the stores.
pub type SharedClock = Arc<dyn Clock>;

/// The system's real-time clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        system_now_ms()
    }
}

fn system_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The system clock shifted by an offset that tests can move forward (or back).
///
/// Time still passes for real; [`ManualClock::advance`] adds to the offset.
#[derive(Debug, Default)]
pub struct ManualClock {
    offset_ms: AtomicI64,
}

impl ManualClock {
    /// A clock that starts equal to the system clock.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Move this clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.offset_ms
            .fetch_add(by.as_millis() as i64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        (system_now_ms() as i64 + self.offset_ms.load(Ordering::SeqCst)).max(0) as u64
    }
}
