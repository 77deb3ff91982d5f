//! Logs on stderr through `tracing`: `log.level` (or `RUST_LOG`) and `log.format`.

use crate::config::{LogConfig, LogFormat};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use tracing_subscriber::EnvFilter;

/// Install the global subscriber. `RUST_LOG`, when set and valid, overrides `log.level`.
/// Calling it twice is harmless (the second call does nothing).
pub fn init(cfg: &LogConfig) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match cfg.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Lets a log line through at most once per interval and counts the ones held back, so
/// that a failing dependency or a misbehaving peer cannot flood the log.
#[derive(Debug, Default)]
pub struct Throttle {
    last_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl Throttle {
    /// A throttle that lets the first line through (usable in a `static`).
    pub const fn new() -> Self {
        Self {
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(number of lines held back since the last one)` when a line may be logged
    /// now, at most once per `every_ms` milliseconds of the system clock; else `None`
    /// (and the line is counted as held back).
    pub fn due(&self, every_ms: u64) -> Option<u64> {
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock);
        let last = self.last_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= every_ms)
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}
