//! `on_limit = "delay"`: a refused request is held until its limit would admit it
//! ([`Limiter::check_or_delay`]), at most `max_waiting` per subject and limit on this
//! gateway, and at most `server.max_delayed` in all ([`DelayBudget`]).
//!
//! `max_waiting` bounds the requests held per subject, but a client that chooses its
//! subject (a `by = "header:NAME"` limit) can be many subjects: measured at about 33 KB
//! per held request, 3,760 held requests grew the gateway by 126 MB. This budget counts
//! every held request of the gateway, whatever its limit and subject; past it, a request
//! that would be held gets its 429 at once.

use super::key::LimitKey;
use super::{sharded, Applied, Limiter, Refusal, Ticket};
use crate::clock::SharedClock;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::Arc;

/// Why a request that would have been delayed got its 429 at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DelayRefusal {
    /// `server.max_delayed` requests were already held on this gateway.
    MaxDelayed,
    /// The limit's `max_waiting` requests of the same subject were already held.
    MaxWaiting,
}

impl DelayRefusal {
    /// The `reason` label of `tollgate_delays_refused_total`.
    pub fn label(self) -> &'static str {
        match self {
            DelayRefusal::MaxDelayed => "max_delayed",
            DelayRefusal::MaxWaiting => "max_waiting",
        }
    }
}

/// Requests held by `on_limit = "delay"` on one gateway, at most `max` at once. The
/// count is the `tollgate_delayed_requests` gauge itself; refusals are counted in
/// `tollgate_delays_refused_total` by reason.
#[derive(Debug)]
pub struct DelayBudget {
    max: i64,
    held: Gauge,
    refused_max_delayed: Counter,
    refused_max_waiting: Counter,
}

impl DelayBudget {
    /// A budget of `max` held requests (requests; 0 holds none), counting them in `held`
    /// and refusals in `refused`, called once per reason to get its counter.
    pub fn new(max: usize, held: Gauge, refused: impl Fn(DelayRefusal) -> Counter) -> Self {
        Self {
            max: i64::try_from(max).unwrap_or(i64::MAX),
            held,
            refused_max_delayed: refused(DelayRefusal::MaxDelayed),
            refused_max_waiting: refused(DelayRefusal::MaxWaiting),
        }
    }

    /// A budget of `max` held requests whose counts no registry reads.
    pub fn unmetered(max: usize) -> Self {
        Self::new(max, Gauge::default(), |_| Counter::default())
    }

    /// Hold one more request, unless `max` already are (then the refusal is counted):
    /// the slot is given back when the returned guard is dropped.
    pub fn enter(&self) -> Option<DelaySlot<'_>> {
        // `inc` returns the count before this request: exact even under contention (a
        // refused request takes its unit back at once).
        if self.held.inc() >= self.max {
            self.held.dec();
            self.refused(DelayRefusal::MaxDelayed);
            return None;
        }
        Some(DelaySlot { budget: self })
    }

    /// Count a request that would have been delayed and got 429 at once.
    pub fn refused(&self, why: DelayRefusal) {
        match why {
            DelayRefusal::MaxDelayed => self.refused_max_delayed.inc(),
            DelayRefusal::MaxWaiting => self.refused_max_waiting.inc(),
        };
    }

    /// Requests held now.
    pub fn held(&self) -> u64 {
        u64::try_from(self.held.get()).unwrap_or(0)
    }
}

/// One request held by `on_limit = "delay"`, counted in its [`DelayBudget`] until dropped.
#[derive(Debug)]
pub struct DelaySlot<'a> {
    budget: &'a DelayBudget,
}

impl Drop for DelaySlot<'_> {
    fn drop(&mut self) {
        self.budget.held.dec();
    }
}

impl Limiter {
    /// [`Limiter::check`], and when the refusing limit has `on_limit = "delay"` and would
    /// admit within its `max_delay` (with fewer than `max_waiting` requests of the same
    /// subject already held, and a slot of the gateway-wide `delayed` budget), wait
    /// until it would and check again, until admitted or past `max_delay` from the first
    /// check. Waits by `clock` (milliseconds since the epoch) and real time; `started` is
    /// the time of the first check (epoch milliseconds).
    ///
    /// Errors: as [`Limiter::check`]; a request that cannot wait gets the refusal of
    /// its latest check. `note` (a sampled request's trace) is told of the first
    /// check's store calls.
    #[allow(clippy::too_many_arguments)]
    pub async fn check_or_delay<'a>(
        &'a self,
        applied: &Arc<[Applied]>,
        cost: u64,
        on_request: bool,
        clock: &'a SharedClock,
        delayed: &DelayBudget,
        started: u64,
        note: Option<&mut super::store::CallNote>,
    ) -> Result<Ticket<'a>, Refusal> {
        match self
            .check(applied, cost, on_request, clock, started, note)
            .await
        {
            Err(Refusal::OverLimit(refusal))
                if applied
                    .iter()
                    .any(|a| a.limit.name == refusal.resource && a.limit.max_delay_ms > 0) =>
            {
                // Boxed: waiting is rare, and its future (a timer, a second check) would
                // otherwise add to the size of every request's future.
                let wait = Wait {
                    applied,
                    cost,
                    on_request,
                    clock,
                    delayed,
                    started,
                };
                Box::pin(self.delay(wait, refusal)).await
            }
            other => other,
        }
    }

    /// The rest of [`Limiter::check_or_delay`] after a check refused with `refusal`:
    /// wait while the refusing limit allows, and check again.
    async fn delay<'a>(
        &'a self,
        w: Wait<'_, 'a>,
        mut refusal: super::Usage,
    ) -> Result<Ticket<'a>, Refusal> {
        let mut held: Option<(Waiting<'_>, DelaySlot<'_>)> = None;
        loop {
            let now_ms = w.clock.now_ms();
            let Some(a) = w.applied.iter().find(|a| a.limit.name == refusal.resource) else {
                return Err(Refusal::OverLimit(refusal));
            };
            let deadline = w.started + a.limit.max_delay_ms;
            let at = refusal.retry_at_ms.max(now_ms + 1);
            if a.limit.max_delay_ms == 0 || at > deadline {
                return Err(Refusal::OverLimit(refusal));
            }
            if held.is_none() {
                let Some(waiting) = Waiting::enter(&self.waiting, &a.key, a.limit.max_waiting)
                else {
                    w.delayed.refused(DelayRefusal::MaxWaiting);
                    return Err(Refusal::OverLimit(refusal));
                };
                let Some(slot) = w.delayed.enter() else {
                    return Err(Refusal::OverLimit(refusal));
                };
                held = Some((waiting, slot));
            }
            tokio::time::sleep(std::time::Duration::from_millis(at - now_ms)).await;
            let now_ms = w.clock.now_ms();
            refusal = match self
                .check(w.applied, w.cost, w.on_request, w.clock, now_ms, None)
                .await
            {
                Err(Refusal::OverLimit(u)) => u,
                other => return other,
            };
        }
    }
}

/// What [`Limiter::delay`] needs of the request it holds (`'a`: what the ticket it
/// returns borrows).
struct Wait<'w, 'a> {
    applied: &'w Arc<[Applied]>,
    cost: u64,
    on_request: bool,
    clock: &'a SharedClock,
    delayed: &'w DelayBudget,
    /// When the first check ran (milliseconds since the epoch).
    started: u64,
}

/// One request held by `on_limit = "delay"`, counted against `max_waiting` until dropped.
struct Waiting<'a> {
    map: &'a sharded::ShardedMap<u32>,
    key: &'a LimitKey,
}

impl<'a> Waiting<'a> {
    /// Count one more request waiting on `key`, unless `max` already are.
    fn enter(map: &'a sharded::ShardedMap<u32>, key: &'a LimitKey, max: u32) -> Option<Self> {
        let mut shard = map.shard(key);
        let n = shard.entry(key.state).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Self { map, key })
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut shard = self.map.shard(self.key);
        if let Some(n) = shard.get_mut(&self.key.state) {
            *n -= 1;
            if *n == 0 {
                shard.remove(&self.key.state);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_at_most_max_and_counts_refusals() {
        let refused = Counter::default();
        let budget = DelayBudget::new(2, Gauge::default(), |why| match why {
            DelayRefusal::MaxDelayed => refused.clone(),
            DelayRefusal::MaxWaiting => Counter::default(),
        });
        let a = budget.enter().expect("first");
        let b = budget.enter().expect("second");
        assert!(budget.enter().is_none());
        assert_eq!((budget.held(), refused.get()), (2, 1));
        drop(a);
        let c = budget.enter().expect("a slot was given back");
        drop((b, c));
        assert_eq!(budget.held(), 0);
        assert!(DelayBudget::unmetered(0).enter().is_none());
    }
}
