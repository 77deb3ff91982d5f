//! Client addresses this gateway has seen reach `identity.failed_auth_limit`: until the
//! window resets, every request of theirs that presents a credential is refused (429)
//! before its key is looked up or an auth callout is made, so that a guesser learns
//! nothing from the answers and costs the auth service nothing.
//!
//! Each gateway keeps its own table (an address over the limit in a shared Redis count
//! is added when this gateway next counts one of its failures). At most
//! [`MAX_BLOCKED_ADDRESSES`] entries: when full, expired ones are dropped; if none are,
//! the new address is not kept (its failures are then still refused by the count, with
//! the lookups).

use super::Usage;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Most addresses kept at once (about 100 bytes each).
pub const MAX_BLOCKED_ADDRESSES: usize = 100_000;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct BlockedAddresses {
    entries: Mutex<HashMap<IpAddr, Usage>>,
    /// `entries.len()`, read without the lock (almost always 0).
    count: AtomicUsize,
}

impl BlockedAddresses {
    /// Whether no address is blocked (read without the lock).
    pub fn is_empty(&self) -> bool {
        self.count.load(Ordering::Relaxed) == 0
    }

    /// The usage of the `failed_auth` window that blocks `ip` (an address key, see
    /// `Identities::ip_key`) at `now_ms` (epoch milliseconds), if any.
    pub fn get(&self, ip: IpAddr, now_ms: u64) -> Option<Usage> {
        if self.is_empty() {
            return None;
        }
        let mut entries = lock(&self.entries);
        let usage = entries.get(&ip)?;
        if usage.reset_at_ms > now_ms {
            return Some(usage.clone());
        }
        entries.remove(&ip);
        self.count.store(entries.len(), Ordering::Relaxed);
        None
    }

    /// Block `ip` until `usage.reset_at_ms` (its window's reset).
    pub fn insert(&self, ip: IpAddr, usage: Usage, now_ms: u64) {
        if usage.reset_at_ms <= now_ms {
            return;
        }
        let mut entries = lock(&self.entries);
        if entries.len() >= MAX_BLOCKED_ADDRESSES && !entries.contains_key(&ip) {
            entries.retain(|_, u| u.reset_at_ms > now_ms);
            if entries.len() >= MAX_BLOCKED_ADDRESSES {
                return;
            }
        }
        entries.insert(ip, usage);
        self.count.store(entries.len(), Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_blocked_until_its_reset() {
        let b = BlockedAddresses::default();
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        let usage = Usage {
            resource: "failed_auth".into(),
            quota: 5,
            used: 5,
            reset_at_ms: 2_000,
            retry_at_ms: 0,
            blocked_until_ms: 0,
            more_at_ms: 0,
        };
        assert!(b.get(ip, 1_000).is_none());
        b.insert(ip, usage, 1_000);
        assert_eq!(b.get(ip, 1_999).map(|u| u.used), Some(5));
        assert!(b.get("192.0.2.8".parse().unwrap(), 1_999).is_none());
        assert!(b.get(ip, 2_000).is_none());
        assert_eq!(b.count.load(Ordering::Relaxed), 0, "dropped once expired");
    }
}
