//! Reconnect back-off with jitter, shared by nodes and the cluster client: waits double
//! from 50 ms up to 2 s, and each wait is drawn between half and all of its nominal
//! length, so that a fleet of gateways that lost Redis together does not reconnect in
//! lockstep.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// The first nominal wait.
pub(super) const FIRST: Duration = Duration::from_millis(50);
/// The longest nominal wait.
pub(super) const MAX: Duration = Duration::from_secs(2);

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Backoff {
    nominal: Duration,
}

impl Backoff {
    /// A back-off at its first wait.
    pub(super) fn new() -> Self {
        Self { nominal: FIRST }
    }

    /// Back to the first wait (after a success).
    pub(super) fn reset(&mut self) {
        self.nominal = FIRST;
    }

    /// The next wait: between half and all of the nominal one, which then doubles (up
    /// to [`MAX`]).
    pub(super) fn next_wait(&mut self) -> Duration {
        let nominal = self.nominal;
        self.nominal = (nominal * 2).min(MAX);
        // A random fraction in [0, 1): std's RandomState is seeded randomly per instance.
        let r = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let fraction = (r >> 11) as f64 / (1u64 << 53) as f64;
        nominal.mul_f64(0.5 + 0.5 * fraction)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_with_jitter() {
        let mut b = Backoff::new();
        let mut nominal = FIRST;
        let mut seen = std::collections::HashSet::new();
        for _ in 0..12 {
            let w = b.next_wait();
            assert!(w >= nominal / 2 && w <= nominal, "{w:?} vs {nominal:?}");
            seen.insert(w);
            nominal = (nominal * 2).min(MAX);
        }
        assert!(seen.len() > 6, "jittered: {seen:?}");
        b.reset();
        assert!(b.next_wait() <= FIRST);
    }
}
