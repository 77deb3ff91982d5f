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
use std::time::Duration;

/// A reading of a coarse monotonic clock, for deadlines of seconds that many readings
/// per request check: a connection's idle, header-read and send timeouts, and how long
/// an upstream connection has been idle. Not for the limiter (which reads [`Clock`]) nor
/// for latencies (which read [`std::time::Instant`]).
///
/// On Linux it is `CLOCK_MONOTONIC_COARSE`, read through the vDSO: the time of the
/// kernel's last tick, so a reading lags the true time by up to one tick (1 to 10 ms,
/// `CONFIG_HZ`; 4 ms on the benchmark VM), and costs about 8 ns where
/// `Instant::now` costs 40 to 50 ns on that VM. Elsewhere it is
/// `Instant::now`. Resolution: milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Coarse {
    /// Milliseconds since an unspecified start (the boot, on Linux).
    ms: u64,
}

impl Coarse {
    /// Now, as of the kernel's last tick.
    #[inline]
    pub fn now() -> Self {
        Self { ms: coarse_ms() }
    }

    /// Time since this reading (zero if none has passed, as far as the clock tells).
    #[inline]
    pub fn elapsed(self) -> Duration {
        Duration::from_millis(self.elapsed_ms())
    }

    /// [`Coarse::elapsed`] in milliseconds.
    #[inline]
    pub fn elapsed_ms(self) -> u64 {
        coarse_ms().saturating_sub(self.ms)
    }
}

#[cfg(target_os = "linux")]
#[inline]
fn coarse_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    t.tv_sec as u64 * 1_000 + t.tv_nsec as u64 / 1_000_000
}

#[cfg(not(target_os = "linux"))]
fn coarse_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

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

/// Milliseconds since the Unix epoch from `CLOCK_REALTIME` (0 before 1970). On Linux read
/// straight from the vDSO's answer in seconds and nanoseconds: `SystemTime`'s
/// subtraction of the epoch and its 128-bit milliseconds cost more than the reading here
/// (two readings per request).
#[cfg(target_os = "linux")]
fn system_now_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Realtime);
    match u64::try_from(t.tv_sec) {
        Ok(s) => s * 1_000 + t.tv_nsec as u64 / 1_000_000,
        Err(_) => 0,
    }
}

#[cfg(not(target_os = "linux"))]
fn system_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
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

#[cfg(test)]
mod tests {
    use super::Coarse;
    use std::time::Duration;

    /// The limiter's clock reads what `SystemTime` reads, to the millisecond.
    #[test]
    fn system_clock_reads_the_unix_epoch_in_milliseconds() {
        let epoch_ms = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        };
        for _ in 0..1_000 {
            let before = epoch_ms();
            let ms = super::system_now_ms();
            let after = epoch_ms();
            assert!(before <= ms && ms <= after, "{before} <= {ms} <= {after}");
        }
    }

    /// The coarse clock follows real time, lagging by at most one kernel tick (10 ms at
    /// the lowest `CONFIG_HZ`), and never goes back. Each coarse reading is bracketed by
    /// two precise ones, so a thread descheduled between them widens the bounds instead
    /// of failing the test.
    #[test]
    fn coarse_clock_follows_real_time() {
        let tick = Duration::from_millis(11);
        let real = std::time::Instant::now();
        let start = Coarse::now();
        let started_by = real.elapsed();
        let mut last = start;
        while real.elapsed() < Duration::from_millis(60) {
            let now = Coarse::now();
            assert!(now >= last, "went back from {last:?} to {now:?}");
            last = now;
        }
        let from = real.elapsed();
        let told = start.elapsed();
        let to = real.elapsed();
        // The true time between the two coarse readings lies in [from - started_by, to].
        assert!(
            told + tick >= from.saturating_sub(started_by) && told <= to + tick,
            "coarse {told:?} against between {:?} and {to:?}",
            from.saturating_sub(started_by)
        );
    }
}
