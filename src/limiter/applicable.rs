//! The limits that apply to a request ([`Limiter::applicable`]: each limit's quota for
//! the caller's tier and the storage key of its subject), a route's limits
//! ([`LimitSet`]), and the limits that apply to one of its requests remembered per
//! thread for a caller that comes back ([`Limiter::applicable_to`]).
//!
//! Working out what applies (each limit's quota for the caller's tier, its subject, the
//! subject's digest, the storage key's text, the list) cost about 940 instructions per
//! request (issue 16); a caller that sends many requests gets the same answer each time,
//! so each thread keeps its last answers and hands out a reference-counted copy.

use super::key::SubjectDigest;
use super::limit::{client_subject, ip_subject, Applied, By, Limit};
use super::Limiter;
use crate::identity::{Caller, Client};
use crate::memo::Memo;
use http::HeaderMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The limits of one route, in order, with an id that no other set built by this process
/// has (ids are never reused, so an id names these very limits for the life of the
/// process).
#[derive(Debug)]
pub struct LimitSet {
    id: u64,
    limits: Vec<Arc<Limit>>,
    /// A limit is keyed by a request header: what applies depends on each request.
    by_header: bool,
    /// A limit counts the client IP (`by = "ip"`).
    by_ip: bool,
    /// A limit counts the caller (the IP of an anonymous one).
    by_caller: bool,
}

impl LimitSet {
    /// A set of `limits`, with a fresh id.
    pub fn new(limits: Vec<Arc<Limit>>) -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let any = |f: fn(&By) -> bool| limits.iter().any(|l| f(&l.by));
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            by_header: any(|b| matches!(b, By::Header(_) | By::TrustedHeader(_))),
            by_ip: any(|b| matches!(b, By::Ip)),
            by_caller: any(|b| matches!(b, By::Caller)),
            limits,
        }
    }
}

impl std::ops::Deref for LimitSet {
    type Target = [Arc<Limit>];

    fn deref(&self) -> &[Arc<Limit>] {
        &self.limits
    }
}

/// Slots of the per-thread memo (direct-mapped by limit set and caller).
const SLOTS: usize = 64;

/// What the limits that apply were worked out from, and the answer.
struct Remembered {
    /// The key scheme's id ([`super::key::KeyScheme`]): a reload that changes the keys
    /// makes every entry of an earlier scheme a miss.
    keys: u64,
    /// The [`LimitSet`]'s id.
    set: u64,
    /// The client, held so that its address is not reused while it is compared.
    client: Option<Arc<Client>>,
    tier: Arc<str>,
    /// Compared only when a limit that applies counts the caller's IP.
    ip_key: Option<IpAddr>,
    applied: Arc<[Applied]>,
}

thread_local! {
    /// This thread's last answers of [`Limiter::applicable_to`], by a hash of the limit
    /// set and the caller.
    static MEMO: Memo<Remembered, SLOTS> = const { Memo::new() };
}

/// Whether limits count `a` and `b` alike: the same client, or two with the same id and
/// tier and neither with quotas of its own (a JWT caller is a new [`Client`] on each
/// request).
fn alike(a: &Option<Arc<Client>>, b: &Option<Arc<Client>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a.limits_alike(b),
        _ => false,
    }
}

impl Limiter {
    /// The limits of `set` that apply to `caller` ([`Limiter::applicable`]), answered
    /// from this thread's memo when the same caller (client, tier, and the IP where a
    /// limit counts it) asked for the same set under the same key scheme before. A set with
    /// a limit keyed by a request header (`by = "header:…"`) depends on each request: it
    /// is never answered from the memo. Same answer as [`Limiter::applicable`], shared.
    pub fn applicable_to(
        &self,
        set: &LimitSet,
        caller: &Caller,
        headers: &HeaderMap,
    ) -> Arc<[Applied]> {
        if set.by_header {
            return self.applicable(set, caller, headers).into();
        }
        let keys = self.keys.id();
        let hash = {
            let hasher = foldhash::fast::FixedState::with_seed(set.id);
            match &caller.client {
                Some(c) => hasher.hash_one(&*c.id),
                None => hasher.hash_one(caller.ip_key),
            }
        };
        let found = MEMO.with(|m| {
            m.get(hash, |r| {
                (r.keys == keys
                    && r.set == set.id
                    && alike(&r.client, &caller.client)
                    && *r.tier == *caller.tier
                    && r.ip_key.is_none_or(|ip| ip == caller.ip_key))
                .then(|| r.applied.clone())
            })
        });
        if let Some(applied) = found {
            return applied;
        }
        let applied: Arc<[Applied]> = self.applicable(set, caller, headers).into();
        let counts_ip = set.by_ip || (set.by_caller && caller.client.is_none());
        let remembered = Remembered {
            keys,
            set: set.id,
            client: caller.client.clone(),
            tier: caller.tier.clone(),
            ip_key: counts_ip.then_some(caller.ip_key),
            applied: applied.clone(),
        };
        // The entry it replaces is dropped after the borrow ends (its drop runs no code
        // of this module, but keep the borrow short).
        let old = MEMO.with(|m| m.put(hash, remembered));
        drop(old);
        applied
    }
}

impl Limiter {
    /// The window of `limit` in which `who` (of tier `tier`) is counted, with its quota
    /// (the client's own, else its tier's), as [`Limiter::applicable`] would find it for
    /// a request: for `GET /top`. `None` when no quota applies, or when `who` alone does
    /// not say which window (a limit by header, whose value is unknown here, or by IP
    /// for an identified caller).
    pub fn applied_for(
        &self,
        limit: &Arc<Limit>,
        who: &super::top::Who,
        tier: &str,
    ) -> Option<Applied> {
        use super::top::Who;
        let own = match who {
            Who::Client(c) => c.quota_for(&limit.name),
            Who::Ip(_) => None,
        };
        let quota = own.or_else(|| limit.quota.get(tier).copied())?;
        let mut subject = Vec::with_capacity(48);
        match (&limit.by, who) {
            (By::Caller, Who::Client(c)) => client_subject(&c.id, &mut subject),
            (By::Caller | By::Ip, Who::Ip(ip)) => ip_subject(*ip, &mut subject),
            (By::Global, _) => subject.extend_from_slice(b"global"),
            _ => return None,
        }
        Some(Applied {
            limit: limit.clone(),
            key: self
                .keys
                .key_for(&limit.key_name, &self.keys.digest(&subject)),
            policy: limit.policy(quota),
        })
    }

    /// The 32 hex digits that stand for a client IP in storage keys (its by-IP windows).
    pub fn ip_hash(&self, ip: std::net::IpAddr) -> String {
        let mut subject = Vec::with_capacity(48);
        ip_subject(ip, &mut subject);
        self.keys.digest(&subject).hex().to_string()
    }

    /// The 32 hex digits that stand for `caller` in storage keys: its client id's keyed
    /// digest, or (anonymous) its IP key's, as in its by-caller windows; never the id
    /// or the address itself (for traces, issue 49).
    pub fn caller_hash(&self, client: Option<&str>, ip_key: std::net::IpAddr) -> String {
        let mut subject = Vec::with_capacity(48);
        match client {
            Some(id) => client_subject(id, &mut subject),
            None => ip_subject(ip_key, &mut subject),
        }
        self.keys.digest(&subject).hex().to_string()
    }

    /// The limits among `limits` that apply to `caller` (those with a quota for its tier,
    /// or its client's own quota).
    pub fn applicable(
        &self,
        limits: &[Arc<Limit>],
        caller: &Caller,
        headers: &HeaderMap,
    ) -> Vec<Applied> {
        // Limits of one route usually count the same subject: hash it once. The buffers
        // swap roles, so the common case allocates one.
        let mut subject = Vec::with_capacity(64);
        let mut last = Vec::new();
        let mut last_digest: Option<SubjectDigest> = None;
        limits
            .iter()
            .filter_map(|limit| {
                // A client's own quota for this limit wins over its tier's.
                let own = caller
                    .client
                    .as_ref()
                    .and_then(|c| c.quota_for(&limit.name));
                let quota = own.or_else(|| limit.quota.get(&caller.tier).copied())?;
                limit.subject_into(caller, headers, &mut subject);
                let digest = match last_digest {
                    Some(d) if last == subject => d,
                    _ => {
                        let d = self.keys.digest(&subject);
                        std::mem::swap(&mut last, &mut subject);
                        last_digest = Some(d);
                        d
                    }
                };
                Some(Applied {
                    limit: limit.clone(),
                    key: self.keys.key_for(&limit.key_name, &digest),
                    policy: limit.policy(quota),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
