//! The numbers a response reports: the state of one limit for one caller ([`Usage`],
//! the `X-RateLimit-*` headers), made from a store's verdict or a lease, after a
//! refund, or read for the rate-limit endpoint ([`Limiter::peek`]); and which of
//! several limits a response reports ([`most_constrained`]).

use super::algorithm::{Algorithm, Op, OpKind, Verdict};
use super::store::{Item, Store, StoreError};
use super::{Applied, Limiter};
use std::sync::Arc;

/// The state of one limit for one caller, as reported in `X-RateLimit-*` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// The limit's name (`X-RateLimit-Resource`).
    pub resource: Arc<str>,
    /// The limit for the caller's tier (`X-RateLimit-Limit`): the quota, or the burst
    /// for GCRA.
    pub quota: u64,
    /// Units counted against the limit (`X-RateLimit-Used`); may exceed `quota`.
    pub used: u64,
    /// When the caller has its whole limit again, milliseconds since the Unix epoch
    /// (the end of a fixed window).
    pub reset_at_ms: u64,
    /// When the refused cost would be admitted, milliseconds since the Unix epoch; 0
    /// when admitted (then `Retry-After` falls back to the reset).
    pub retry_at_ms: u64,
    /// The end of the `block_for` block that refuses the caller, milliseconds since the
    /// Unix epoch (then also `reset_at_ms` and `retry_at_ms`); 0 when not blocked.
    pub blocked_until_ms: u64,
    /// When the caller next has one unit more than now, milliseconds since the Unix
    /// epoch (`RateLimit`'s `t`, see [`Verdict::more_at_ms`]); 0 when unknown (then
    /// `t` falls back to the reset).
    pub more_at_ms: u64,
}

impl Usage {
    /// `quota − used`, never below 0 (`X-RateLimit-Remaining`).
    pub fn remaining(&self) -> u64 {
        self.quota.saturating_sub(self.used)
    }

    /// `reset_at` in UTC epoch seconds, rounded up (`X-RateLimit-Reset`).
    pub fn reset_epoch_s(&self) -> u64 {
        self.reset_at_ms.div_ceil(1000)
    }

    /// Whole seconds from `now_ms` until the refused cost would be admitted (or, when
    /// unknown, until the reset), at least 1 (`Retry-After`).
    pub fn retry_after_s(&self, now_ms: u64) -> u64 {
        let at = if self.retry_at_ms > 0 {
            self.retry_at_ms
        } else {
            self.reset_at_ms
        };
        at.saturating_sub(now_ms).div_ceil(1000).max(1)
    }

    /// Whole seconds from `now_ms` until the caller has one unit more (`RateLimit`'s
    /// `t`, rounded up, at least 0): from `more_at_ms`, or the reset when it is
    /// unknown; on a refusal never more than [`Usage::retry_after_s`].
    pub fn more_at_s(&self, now_ms: u64) -> u64 {
        let at = if self.more_at_ms > 0 {
            self.more_at_ms
        } else {
            self.reset_at_ms
        };
        let t = at.saturating_sub(now_ms).div_ceil(1000);
        if self.retry_at_ms > 0 {
            t.min(self.retry_after_s(now_ms))
        } else {
            t
        }
    }
}

impl Applied {
    pub(super) fn usage(&self, v: &Verdict) -> Usage {
        Usage {
            resource: self.limit.name.clone(),
            quota: self.policy.limit(),
            used: v.used,
            reset_at_ms: v.reset_at_ms,
            retry_at_ms: v.retry_at_ms,
            blocked_until_ms: if v.blocked { v.reset_at_ms } else { 0 },
            more_at_ms: v.more_at_ms,
        }
    }

    /// `u` after `cost` units taken by this request were given back at `now_ms`: as
    /// many fewer used, and for GCRA a bucket full that much sooner (the refund moves
    /// the theoretical arrival time back by `cost` emission intervals).
    pub(super) fn refunded(&self, u: &mut Usage, cost: u64, now_ms: u64) {
        u.used = u.used.saturating_sub(cost);
        if self.policy.algorithm == Algorithm::Gcra {
            let e = self.policy.emission_ms();
            let back = cost.saturating_mul(e);
            u.reset_at_ms = u.reset_at_ms.saturating_sub(back).max(now_ms);
            if u.used > 0 && u.more_at_ms > 0 {
                let counted = u.used.min(self.policy.burst) - 1;
                u.more_at_ms = u.reset_at_ms.saturating_sub(counted * e).max(now_ms);
            }
        }
        if u.used == 0 && u.more_at_ms > 0 {
            u.more_at_ms = now_ms;
        }
    }

    pub(super) fn usage_at(&self, used: u64, reset_at_ms: u64) -> Usage {
        Usage {
            resource: self.limit.name.clone(),
            quota: self.policy.limit(),
            used,
            reset_at_ms,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        }
    }
}

impl Limiter {
    /// Read the state of every applied limit (one peek per shard; changes nothing): the
    /// usage a request of one unit would see, `None` where the store failed. For the
    /// rate-limit endpoint.
    pub async fn peek(&self, applied: &[Applied], now_ms: u64) -> Vec<Option<Usage>> {
        self.peek_each(applied, now_ms)
            .await
            .into_iter()
            .map(|r| match r {
                Ok(u) => Some(u),
                Err(e) => {
                    self.warn_gate.warn(&e, "rate-limit endpoint: read failed");
                    None
                }
            })
            .collect()
    }

    /// [`Limiter::peek`] with each limit's store error.
    pub async fn peek_each(
        &self,
        applied: &[Applied],
        now_ms: u64,
    ) -> Vec<Result<Usage, StoreError>> {
        let items: Vec<Item<'_>> = applied
            .iter()
            .map(|a| Item {
                key: &a.key,
                policy: &a.policy,
                op: Op {
                    kind: OpKind::Peek,
                    cost: 1,
                    id: 0,
                },
            })
            .collect();
        if items.is_empty() {
            return Vec::new();
        }
        let results = self.store.apply(&items, now_ms).await;
        applied
            .iter()
            .zip(results)
            .map(|(a, r)| {
                r.map(|v| {
                    let mut u = a.usage(&v);
                    self.local_share(a, &mut u);
                    u
                })
            })
            .collect()
    }
}

/// The usage to report when several limits apply: the fewest remaining units
/// (ties: the later reset).
pub fn most_constrained(usages: &[Option<Usage>]) -> Option<&Usage> {
    usages.iter().flatten().min_by(|a, b| {
        a.remaining()
            .cmp(&b.remaining())
            .then(b.reset_at_ms.cmp(&a.reset_at_ms))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_headers_arithmetic() {
        let u = Usage {
            resource: "core".into(),
            quota: 10,
            used: 12,
            reset_at_ms: 5_001,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        };
        assert_eq!(u.remaining(), 0);
        assert_eq!(u.reset_epoch_s(), 6);
        assert_eq!(u.retry_after_s(5_000), 1);
        assert_eq!(u.retry_after_s(9_000), 1);
        assert_eq!(u.retry_after_s(1_000), 5);
    }

    #[test]
    fn most_constrained_picks_fewest_remaining() {
        let a = Usage {
            resource: "a".into(),
            quota: 10,
            used: 2,
            reset_at_ms: 1,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        };
        let b = Usage {
            resource: "b".into(),
            quota: 5,
            used: 2,
            reset_at_ms: 1,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        };
        let all = vec![Some(a), None, Some(b.clone())];
        assert_eq!(most_constrained(&all), Some(&b));
        assert_eq!(most_constrained(&[None]), None);
    }
}
