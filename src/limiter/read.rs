//! `GET /callers/{id}`: what every limit holds for one caller, read from the store with
//! peeks (nothing is charged; with Redis, the whole fleet's count).
//!
//! The caller is named as `POST /callers/{id}/reset` names it ([`super::reset`]): a
//! client known to the config or the keys file, else an anonymous caller by its address
//! (counted as requests are, through `identity.ipv6_prefix_len`) or its address's keyed
//! hash. Every `[[limits]]` entry with a quota for the caller (its own, else its
//! tier's) is read, each in the window the caller's own requests count in:
//!
//! - `by = "caller"`: the client's window, or the anonymous caller's address's;
//! - `by = "header:NAME"`: the window of the caller's requests without that header
//!   (those with it count per header value, which an id does not tell);
//! - `by = "ip"`: an anonymous caller's address's window; for a client, unknown (it is
//!   counted per client IP), so it is listed without a window;
//! - `by = "global"`: the one window every caller shares.

use super::key::SubjectDigest;
use super::limit::{client_subject, Applied, By, Limit};
use super::store::StoreError;
use super::{Limiter, Usage};
use crate::identity::Client;
use std::sync::Arc;

/// The caller an id names.
#[derive(Debug, Clone)]
pub enum Named {
    /// A known client.
    Client(Arc<Client>),
    /// An anonymous caller: the digest of its address's subject (`ip:ADDRESS`).
    Anonymous(SubjectDigest),
}

/// One limit as it stands for the caller.
#[derive(Debug, Clone)]
pub struct CallerLimit {
    /// The limit.
    pub limit: Arc<Limit>,
    /// The caller's limit (`X-RateLimit-Limit`): its quota, or the burst for GCRA.
    pub quota: u64,
    /// Its window now, as a request of one unit would see it; `None` when the id does
    /// not tell which window (a limit by IP for a client).
    pub usage: Option<Usage>,
    /// Units this gateway holds leased from that window and has not used yet (lease
    /// mode), 0 otherwise.
    pub leased: u64,
}

impl Limiter {
    /// The anonymous caller `id` names, if any: an address (passed through `ip_key`, as
    /// requests are counted) or the 32 hex digits of an address's keyed hash. The same
    /// reading of an id as [`Limiter::reset_caller`]'s.
    pub fn anonymous_named(
        &self,
        id: &str,
        ip_key: impl Fn(std::net::IpAddr) -> std::net::IpAddr,
    ) -> Option<SubjectDigest> {
        super::reset::anonymous_digest(self, id, ip_key)
    }

    /// The window of `limit` the caller `named` (of tier `tier`) counts in, with its
    /// quota; `None` when no quota applies to it, `Some((quota, None))` when the id does
    /// not tell the window.
    fn window_of(
        &self,
        limit: &Arc<Limit>,
        named: &Named,
        tier: &str,
    ) -> Option<(u64, Option<Applied>)> {
        let own = match named {
            Named::Client(c) => c.quota_for(&limit.name),
            Named::Anonymous(_) => None,
        };
        let quota = own.or_else(|| limit.quota.get(tier).copied())?;
        let policy = limit.policy(quota);
        let digest = match (&limit.by, named) {
            (By::Global, _) => self.keys.digest(b"global"),
            (By::Ip, Named::Client(_)) => return Some((policy.limit(), None)),
            (_, Named::Anonymous(d)) => *d,
            (By::Caller | By::Header(_) | By::TrustedHeader(_), Named::Client(c)) => {
                let mut subject = Vec::with_capacity(7 + c.id.len());
                client_subject(&c.id, &mut subject);
                self.keys.digest(&subject)
            }
        };
        Some((
            policy.limit(),
            Some(Applied {
                limit: limit.clone(),
                key: self.keys.key_for(&limit.key_name, &digest),
                policy,
            }),
        ))
    }

    /// Every limit of `limits` (in config order) with a quota for the caller `named`
    /// of tier `tier`, read at `now_ms` (epoch milliseconds) with one peek per shard:
    /// nothing is charged.
    ///
    /// Errors: the first store error, when the store failed for any of them.
    pub async fn read_caller(
        &self,
        limits: &[Arc<Limit>],
        named: &Named,
        tier: &str,
        now_ms: u64,
    ) -> Result<Vec<CallerLimit>, StoreError> {
        let windows: Vec<(&Arc<Limit>, u64, Option<Applied>)> = limits
            .iter()
            .filter_map(|l| self.window_of(l, named, tier).map(|(q, a)| (l, q, a)))
            .collect();
        let applied: Vec<Applied> = windows.iter().filter_map(|(_, _, a)| a.clone()).collect();
        let mut read = self.peek_each(&applied, now_ms).await.into_iter();
        let mut out = Vec::with_capacity(windows.len());
        for (limit, quota, a) in windows {
            let (usage, leased) = match a {
                Some(a) => match read.next() {
                    Some(Ok(usage)) => (Some(usage), self.leases.held(&a.key, now_ms)),
                    Some(Err(e)) => return Err(e),
                    None => (None, 0),
                },
                None => (None, 0),
            };
            out.push(CallerLimit {
                limit: limit.clone(),
                quota,
                usage,
                leased,
            });
        }
        Ok(out)
    }
}
