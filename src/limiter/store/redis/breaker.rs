//! A circuit breaker for one Redis node.
//!
//! Closed: calls go through. After `failures` consecutive failures (errors or timeouts)
//! it opens: calls fail at once (and `store.on_error` applies) for `cooloff`. Then it is
//! half-open: one probe call goes through; its success closes the breaker, its failure
//! opens it again. Every state change is logged once and counted. A Redis Cluster
//! redirection (`MOVED`, `ASK`) is an answer from a live node: it counts as a success.

use super::stats::{bump, NodeStats};
use crate::limiter::store::status::BreakerState;
use crate::limiter::store::StoreError;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    failures: u32,
    /// When Open: until when. When HalfOpen: when the probe started (None: no probe yet).
    at: Option<Instant>,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Breaker {
    label: String,
    threshold: u32,
    cooloff: Duration,
    /// A probe that has not reported within this time is presumed lost (its caller went
    /// away); another probe may start.
    probe_timeout: Duration,
    inner: Mutex<Inner>,
    stats: Arc<NodeStats>,
}

impl Breaker {
    pub(super) fn new(
        label: String,
        threshold: u32,
        cooloff: Duration,
        probe_timeout: Duration,
        stats: Arc<NodeStats>,
    ) -> Self {
        Self {
            label,
            threshold: threshold.max(1),
            cooloff,
            probe_timeout,
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                failures: 0,
                at: None,
            }),
            stats,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `attempt` through this breaker: refused at once (`BreakerOpen`) while open;
    /// bounded by `timeout`; its outcome counted in `stats` and recorded in the breaker.
    pub(super) async fn guard<T>(
        &self,
        stats: &NodeStats,
        timeout: Duration,
        attempt: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        bump(&stats.calls);
        if !self.allow() {
            bump(&stats.rejected_by_breaker);
            return Err(StoreError::BreakerOpen(self.label.clone()));
        }
        let started = Instant::now();
        match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(reply)) => {
                stats.latency.observe(started.elapsed().as_secs_f64());
                self.success();
                Ok(reply)
            }
            // A cluster redirection: the node answered (and applied nothing).
            Ok(Err(e)) if e.is_redirect() => {
                self.success();
                Err(e)
            }
            Ok(Err(e)) => {
                bump(&stats.errors);
                // A node that answers LOADING or MASTERDOWN is alive: not a failure.
                if !e.is_not_serving() {
                    self.failure();
                }
                Err(e)
            }
            Err(_) => {
                bump(&stats.timeouts);
                self.failure();
                Err(StoreError::Timeout(timeout.as_millis() as u64))
            }
        }
    }

    /// The current state.
    pub(super) fn state(&self) -> BreakerState {
        self.lock().state
    }

    /// May a call go through now? (Moves Open → HalfOpen when the cool-off is over.)
    pub(super) fn allow(&self) -> bool {
        let now = Instant::now();
        let mut s = self.lock();
        match s.state {
            BreakerState::Closed => true,
            BreakerState::Open => {
                if s.at.is_some_and(|until| now >= until) {
                    self.change(&mut s, BreakerState::HalfOpen);
                    s.at = Some(now);
                    true
                } else {
                    false
                }
            }
            BreakerState::HalfOpen => {
                if s.at
                    .is_none_or(|started| now.duration_since(started) >= self.probe_timeout)
                {
                    s.at = Some(now);
                    true
                } else {
                    false
                }
            }
        }
    }

    /// Whether a call would go through, without starting a probe.
    pub(super) fn is_available(&self) -> bool {
        let s = self.lock();
        match s.state {
            BreakerState::Closed => true,
            BreakerState::Open => s.at.is_some_and(|until| Instant::now() >= until),
            BreakerState::HalfOpen => false,
        }
    }

    pub(super) fn success(&self) {
        let mut s = self.lock();
        s.failures = 0;
        if s.state != BreakerState::Closed {
            self.change(&mut s, BreakerState::Closed);
            s.at = None;
        }
    }

    pub(super) fn failure(&self) {
        let mut s = self.lock();
        s.failures = s.failures.saturating_add(1);
        let open = match s.state {
            BreakerState::HalfOpen => true,
            BreakerState::Closed => s.failures >= self.threshold,
            BreakerState::Open => false,
        };
        if open {
            self.change(&mut s, BreakerState::Open);
            s.at = Some(Instant::now() + self.cooloff);
        }
    }

    fn change(&self, s: &mut Inner, to: BreakerState) {
        let from = s.state;
        s.state = to;
        self.stats
            .breaker_changes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match to {
            BreakerState::Open => {
                tracing::warn!(node = %self.label, from = from.as_str(), failures = s.failures, cooloff = ?self.cooloff, "circuit breaker open: failing fast")
            }
            BreakerState::HalfOpen => {
                tracing::info!(node = %self.label, "circuit breaker half-open: probing")
            }
            BreakerState::Closed => {
                tracing::info!(node = %self.label, from = from.as_str(), "circuit breaker closed: node healthy")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A breaker of node `n` that opens after `threshold` failures and probes after
    /// `cooloff`, with its stats.
    fn breaker(threshold: u32, cooloff: Duration) -> (Breaker, Arc<NodeStats>) {
        let stats = Arc::new(NodeStats::default());
        let b = Breaker::new(
            "n".into(),
            threshold,
            cooloff,
            Duration::from_secs(1),
            stats.clone(),
        );
        (b, stats)
    }

    /// A cluster redirection is an answer from a live node: it never opens the
    /// breaker nor counts as an error; a `CLUSTERDOWN` reply does count.
    #[tokio::test]
    async fn redirections_count_as_answers_and_clusterdown_as_failures() {
        let reply = |line: &str| -> StoreError {
            let v = redis::parse_redis_value(format!("-{line}\r\n").as_bytes()).unwrap();
            StoreError::Redis(v.extract_error().unwrap_err())
        };
        let (b, stats) = breaker(2, Duration::from_secs(60));
        let t = Duration::from_secs(1);
        for line in ["MOVED 1 127.0.0.1:7001", "ASK 1 127.0.0.1:7001"].repeat(3) {
            let e = reply(line);
            assert!(e.is_redirect());
            assert!(b.guard(&stats, t, async { Err::<(), _>(e) }).await.is_err());
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(stats.counts().errors, 0);
        for _ in 0..2 {
            let e = reply("CLUSTERDOWN The cluster is down");
            assert!(!e.is_redirect());
            let _ = b.guard(&stats, t, async { Err::<(), _>(e) }).await;
        }
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(stats.counts().errors, 2);
    }

    /// A node answering LOADING or MASTERDOWN is alive: its errors are counted, but they
    /// never open the breaker.
    #[tokio::test]
    async fn loading_and_masterdown_answers_do_not_open_the_breaker() {
        let (b, stats) = breaker(2, Duration::from_secs(60));
        let masterdown = || match ::redis::parse_redis_value(b"-MASTERDOWN link down\r\n") {
            Ok(::redis::Value::ServerError(e)) => StoreError::Redis(e.into()),
            other => panic!("{other:?}"),
        };
        for _ in 0..5 {
            let r: Result<(), _> = b
                .guard(&stats, Duration::from_secs(1), async { Err(masterdown()) })
                .await;
            assert!(r.is_err());
        }
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(stats.counts().errors, 5);
        for _ in 0..2 {
            let _: Result<(), _> = b
                .guard(&stats, Duration::from_secs(1), async {
                    Err(StoreError::NotConnected("n".into()))
                })
                .await;
        }
        assert_eq!(b.state(), BreakerState::Open, "other errors still count");
    }

    #[test]
    fn opens_after_threshold_probes_after_cooloff_and_closes() {
        let (b, stats) = breaker(3, Duration::from_millis(50));
        assert!(b.allow());
        b.failure();
        b.failure();
        assert_eq!(b.state(), BreakerState::Closed);
        b.success();
        b.failure();
        b.failure();
        assert_eq!(b.state(), BreakerState::Closed, "success resets the count");
        b.failure();
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow());
        std::thread::sleep(Duration::from_millis(60));
        assert!(b.allow(), "one probe after the cool-off");
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(!b.allow(), "only one probe at a time");
        b.failure();
        assert_eq!(b.state(), BreakerState::Open, "a failed probe reopens");
        std::thread::sleep(Duration::from_millis(60));
        assert!(b.allow());
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(
            stats
                .breaker_changes
                .load(std::sync::atomic::Ordering::Relaxed),
            5
        );
    }
}
