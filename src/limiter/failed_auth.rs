//! The built-in limit on failed authentications (`identity.failed_auth_limit`): a fixed
//! window per client IP, counted on each API key that matches no client, and the
//! addresses past it, refused without a key lookup until the window's reset.

use super::algorithm::{Algorithm, Align};
use super::limit::ip_subject;
use super::{blocked, Applied, By, Limit, Limiter, Refusal, Usage, FAILED_AUTH};
use crate::clock::SharedClock;
use std::sync::Arc;

impl Limiter {
    /// Limit failed authentications to `quota` per client IP and `window_ms` (0: off).
    pub fn with_failed_auth_limit(mut self, quota: u64, window_ms: u64) -> Self {
        self.failed_auth = (quota > 0).then(|| {
            Arc::new(Limit {
                name: FAILED_AUTH.into(),
                window_ms,
                // Every caller of a failed authentication is judged under this one tier.
                quota: [(Arc::from(FAILED_AUTH), quota)].into_iter().collect(),
                by: By::Ip,
                lease: 0,
                lease_ttl_ms: 0,
                algorithm: Algorithm::FixedWindow,
                burst: None,
                align: Align::FirstRequest,
                key_name: FAILED_AUTH.into(),
                enforce_percent: 100,
                max_delay_ms: 0,
                max_waiting: 1,
                block_ms: 0,
            })
        });
        self
    }

    /// Keep the addresses past `identity.failed_auth_limit` in `blocked` (the previous
    /// snapshot's, across a reload).
    pub fn with_blocked(mut self, blocked: Arc<blocked::BlockedAddresses>) -> Self {
        self.blocked = blocked;
        self
    }

    /// The addresses past `identity.failed_auth_limit` until their window's reset.
    pub fn blocked(&self) -> &Arc<blocked::BlockedAddresses> {
        &self.blocked
    }

    /// Whether any address may be blocked now ([`Limiter::failed_auth_blocked`]): a
    /// cheap test before the client IP is worked out.
    pub fn blocks_any(&self) -> bool {
        self.failed_auth.is_some() && !self.blocked.is_empty()
    }

    /// The usage to refuse a request presenting a credential from `ip` (an address key)
    /// with (429), without looking its key up, when this gateway has seen `ip` reach
    /// `identity.failed_auth_limit` in the window that holds `now_ms` (epoch
    /// milliseconds); else `None`. No store call.
    pub fn failed_auth_blocked(&self, ip: std::net::IpAddr, now_ms: u64) -> Option<Usage> {
        self.failed_auth.as_ref()?;
        self.blocked.get(ip, now_ms)
    }

    /// Count one failed authentication from `ip` (an API key that matched no client),
    /// at the time `clock` tells. Returns the usage to refuse with (429) when `ip` is
    /// past `identity.failed_auth_limit`, else `None` (answer 401). A failing store
    /// follows `store.on_error` like any limit (`deny`: refused as over the limit would
    /// be). The failure that uses up the quota, or a refusal, blocks `ip` until the
    /// window's reset ([`Limiter::failed_auth_blocked`]).
    pub async fn failed_auth(&self, ip: std::net::IpAddr, clock: &SharedClock) -> Option<Usage> {
        let limit = self.failed_auth.as_ref()?;
        let quota = *limit.quota.values().next()?;
        let now_ms = clock.now_ms();
        let mut subject = Vec::with_capacity(48);
        ip_subject(ip, &mut subject);
        let applied: Arc<[Applied]> = Arc::new([Applied {
            limit: limit.clone(),
            key: self
                .keys
                .key_for(&limit.key_name, &self.keys.digest(&subject)),
            policy: limit.policy(quota),
        }]);
        match self.check(&applied, 1, false, clock, now_ms, None).await {
            Ok(mut ticket) => {
                let charged = ticket.charge(1, now_ms).await;
                if let Some(usage) = charged.into_iter().flatten().next() {
                    if usage.used >= quota {
                        self.blocked.insert(ip, usage, now_ms);
                    }
                }
                None
            }
            Err(Refusal::OverLimit(usage)) => {
                self.blocked.insert(ip, usage.clone(), now_ms);
                Some(usage)
            }
            Err(Refusal::StoreDenied(_)) => {
                Some(applied[0].usage_at(quota, now_ms + limit.window_ms))
            }
        }
    }

    /// The built-in limit on failed authentications (`identity.failed_auth_limit`), when on.
    pub fn failed_auth_limit(&self) -> Option<&Arc<Limit>> {
        self.failed_auth.as_ref()
    }
}
