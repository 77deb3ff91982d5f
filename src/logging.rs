//! Logs on stderr through `tracing`: `log.level` (or `RUST_LOG`) and `log.format`.

use crate::config::{LogConfig, LogFormat};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use tracing_subscriber::EnvFilter;

/// Install the global subscriber. `RUST_LOG`, when set and valid, overrides `log.level`.
/// Warnings and errors of the HTTP libraries (`h2`, `hyper`), which a client can provoke
/// at will (e.g. one per connection that resets streams too fast), are let through at
/// most once a second ([`library_warning_due`]). Calling it twice is harmless (the
/// second call does nothing).
pub fn init(cfg: &LogConfig) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&cfg.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Dynamic: asked on every event (a plain `filter_fn` caches its answer per callsite).
    let throttle = tracing_subscriber::filter::dynamic_filter_fn(|meta, _| {
        *meta.level() > tracing::Level::WARN || library_warning_due(meta.target())
    });
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let registry = tracing_subscriber::registry().with(filter);
    let _ = match cfg.format {
        LogFormat::Text => registry.with(layer.with_filter(throttle)).try_init(),
        LogFormat::Json => registry
            .with(layer.json().flatten_event(true).with_filter(throttle))
            .try_init(),
    };
}

/// Whether a warning or error from `target` may be written: always for tollgate's own
/// (which throttle themselves where a client can provoke them), at most once a second
/// for the HTTP libraries'.
pub fn library_warning_due(target: &str) -> bool {
    static LIBRARIES: Throttle = Throttle::new();
    let library = ["h2", "hyper", "hyper_util"].iter().any(|lib| {
        target
            .strip_prefix(lib)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    });
    !library || LIBRARIES.due(1_000).is_some()
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

/// Lets at most a number of lines through in each second of the system clock and counts
/// the ones held back, so that a flood of requests an attacker makes cheaply (unknown
/// keys, malformed requests) cannot flood the log, while a normal rate logs every line.
#[derive(Debug, Default)]
pub struct Budget {
    second: AtomicU64,
    used: AtomicU64,
    held: AtomicU64,
}

impl Budget {
    /// A budget with nothing used (usable in a `static`).
    pub const fn new() -> Self {
        Self {
            second: AtomicU64::new(0),
            used: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// `Some(number of lines held back and not reported yet)` when a line may be written
    /// now, at most `per_second` in one second; else `None` (and the line is counted as
    /// held back).
    pub fn take(&self, per_second: u64) -> Option<u64> {
        let now = crate::clock::Clock::now_ms(&crate::clock::SystemClock) / 1_000;
        let second = self.second.load(Ordering::Relaxed);
        if now != second
            && self
                .second
                .compare_exchange(second, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.used.store(0, Ordering::Relaxed);
        }
        if self.used.fetch_add(1, Ordering::Relaxed) < per_second {
            Some(self.held.swap(0, Ordering::Relaxed))
        } else {
            self.held.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_lets_through_its_lines_then_holds_back_and_reports() {
        let b = Budget::new();
        // Lines in the same second (the test runs well within one, or straddles two:
        // then more get through, never fewer than the budget).
        let through: Vec<_> = (0..10).map(|_| b.take(3)).collect();
        let passed = through.iter().filter(|t| t.is_some()).count();
        assert!((3..=6).contains(&passed), "{through:?}");
        assert_eq!(through[0], Some(0));
    }
}
