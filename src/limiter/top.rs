//! Who is being limited now: per limit, the callers with the most refusals and the most
//! units admitted in the last one to two minutes, for `GET /top` on the admin listener.
//!
//! Each count is a space-saving sketch (Metwally et al.) of [`CAPACITY`] entries per
//! shard: a caller not in a full sketch replaces the entry with the smallest count and
//! inherits it, so a heavy hitter is never missed and its count is over-estimated by at
//! most the count it inherited (reported as `error`). Callers are spread over
//! [`SHARDS`] shards by hash, each behind its own mutex, so the proxy's threads rarely
//! meet; memory is bounded by `SHARDS × 2 × 2 × CAPACITY` entries whatever the number of
//! callers. Counts are kept per minute: the current minute's and the previous one's.
//! Anonymous callers are kept by IP address, and shown as the access log shows them.

use crate::identity::Client;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Entries per sketch.
pub const CAPACITY: usize = 64;
/// Shards (by caller hash).
pub const SHARDS: usize = 16;

/// A caller as counted: a client (one entry per client id), or an anonymous caller's
/// address.
#[derive(Debug, Clone)]
pub enum Who {
    /// An identified caller (compared and hashed by its id; its own quotas tell
    /// `GET /top` what remains of its windows).
    Client(Arc<Client>),
    /// An anonymous caller's address (`Caller::ip_key`).
    Ip(IpAddr),
}

impl PartialEq for Who {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Who::Client(a), Who::Client(b)) => a.id == b.id,
            (Who::Ip(a), Who::Ip(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Who {}

impl Hash for Who {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        match self {
            Who::Client(c) => {
                state.write_u8(0);
                c.id.hash(state);
            }
            Who::Ip(ip) => {
                state.write_u8(1);
                ip.hash(state);
            }
        }
    }
}

impl Who {
    /// `caller`'s client, else its address as per-IP limits count it.
    pub fn of(caller: &crate::identity::Caller) -> Who {
        match &caller.client {
            Some(c) => Who::Client(c.clone()),
            None => Who::Ip(caller.ip_key),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    limit: Arc<str>,
    who: Who,
}

#[derive(Debug, Clone)]
struct Counted {
    key: Key,
    tier: Arc<str>,
    count: u64,
    /// What the entry inherited when it replaced another (the over-estimate bound).
    error: u64,
}

#[derive(Debug, Default)]
struct Sketch {
    entries: Vec<Counted>,
    index: HashMap<Key, u32, foldhash::fast::FixedState>,
}

impl Sketch {
    fn add(&mut self, key: Key, tier: &Arc<str>, n: u64) {
        if let Some(i) = self.index.get(&key) {
            self.entries[*i as usize].count += n;
            return;
        }
        if self.entries.len() < CAPACITY {
            self.index.insert(key.clone(), self.entries.len() as u32);
            self.entries.push(Counted {
                key,
                tier: tier.clone(),
                count: n,
                error: 0,
            });
            return;
        }
        let Some((i, min)) = self
            .entries
            .iter()
            .enumerate()
            .min_by_key(|(_, e)| e.count)
            .map(|(i, e)| (i, e.count))
        else {
            return;
        };
        let old = std::mem::replace(
            &mut self.entries[i],
            Counted {
                key: key.clone(),
                tier: tier.clone(),
                count: min + n,
                error: min,
            },
        );
        self.index.remove(&old.key);
        self.index.insert(key, i as u32);
    }
}

/// One shard: the current minute's sketches and the previous minute's.
#[derive(Debug, Default)]
struct Shard {
    minute: u64,
    used: [Sketch; 2],
    refused: [Sketch; 2],
}

impl Shard {
    /// Move to `minute`: the current sketches become the previous ones (or are dropped
    /// when more than a minute passed).
    fn at(&mut self, minute: u64) {
        if self.minute == minute {
            return;
        }
        for s in [&mut self.used, &mut self.refused] {
            s[1] = if minute == self.minute + 1 {
                std::mem::take(&mut s[0])
            } else {
                Sketch::default()
            };
            s[0] = Sketch::default();
        }
        self.minute = minute;
    }
}

/// The heavy hitters of one gateway; kept across reloads.
#[derive(Debug)]
pub struct Top {
    shards: Box<[Mutex<Shard>]>,
}

impl Default for Top {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

/// One caller's line in `/top`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hitter {
    /// Who.
    pub who: Who,
    /// Its tier.
    pub tier: Arc<str>,
    /// Refusals, or units admitted, in the current and the previous minute.
    pub count: u64,
    /// How much of `count` may be inherited from callers the sketch forgot.
    pub error: u64,
}

/// One limit's heavy hitters, most first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitTop {
    /// Callers by refusals.
    pub refused: Vec<Hitter>,
    /// Callers by units admitted.
    pub used: Vec<Hitter>,
}

impl Top {
    fn shard(&self, who: &Who, now_s: u64) -> std::sync::MutexGuard<'_, Shard> {
        let h = foldhash::fast::FixedState::default().hash_one(who) as usize;
        let mut shard = self.shards[h % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        shard.at(now_s / 60);
        shard
    }

    /// Count `units` admitted for `who` (tier `tier`) in `limit`, at `now_s` (epoch
    /// seconds).
    pub fn used(&self, limit: &Arc<str>, who: Who, tier: &Arc<str>, units: u64, now_s: u64) {
        let mut shard = self.shard(&who, now_s);
        let key = Key {
            limit: limit.clone(),
            who,
        };
        shard.used[0].add(key, tier, units);
    }

    /// Count one refusal of `who` by `limit`, at `now_s` (epoch seconds).
    pub fn refused(&self, limit: &Arc<str>, who: Who, tier: &Arc<str>, now_s: u64) {
        let mut shard = self.shard(&who, now_s);
        let key = Key {
            limit: limit.clone(),
            who,
        };
        shard.refused[0].add(key, tier, 1);
    }

    /// Per limit name, the `n` callers with the most refusals and the most units, in
    /// the current and the previous minute at `now_s` (epoch seconds).
    pub fn top(&self, n: usize, now_s: u64) -> HashMap<Arc<str>, LimitTop> {
        let mut refused: HashMap<Key, Hitter> = HashMap::new();
        let mut used: HashMap<Key, Hitter> = HashMap::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            shard.at(now_s / 60);
            for (sketches, out) in [(&shard.refused, &mut refused), (&shard.used, &mut used)] {
                for e in sketches.iter().flat_map(|s| &s.entries) {
                    let h = out.entry(e.key.clone()).or_insert_with(|| Hitter {
                        who: e.key.who.clone(),
                        tier: e.tier.clone(),
                        count: 0,
                        error: 0,
                    });
                    h.count += e.count;
                    h.error += e.error;
                }
            }
        }
        let mut by_limit: HashMap<Arc<str>, LimitTop> = HashMap::new();
        for (key, h) in refused {
            by_limit.entry(key.limit).or_default().refused.push(h);
        }
        for (key, h) in used {
            by_limit.entry(key.limit).or_default().used.push(h);
        }
        for t in by_limit.values_mut() {
            for list in [&mut t.refused, &mut t.used] {
                list.sort_by_key(|h| std::cmp::Reverse(h.count));
                list.truncate(n);
            }
        }
        by_limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(id: &str) -> Who {
        Who::Client(Arc::new(Client::new(id.into(), "gold".into())))
    }

    #[test]
    fn heavy_hitters_are_found_among_many_callers_and_memory_stays_bounded() {
        let top = Top::default();
        let (core, tier): (Arc<str>, Arc<str>) = ("core".into(), "gold".into());
        // 100,000 callers once each, and three heavy callers often.
        for i in 0..100_000u32 {
            let ip = IpAddr::from(i.to_be_bytes());
            top.used(&core, Who::Ip(ip), &tier, 1, 600);
            if i % 100 == 0 {
                for (who, n) in [("a", 30), ("b", 20), ("c", 10)] {
                    top.used(&core, client(who), &tier, n, 600);
                }
            }
        }
        let t = top.top(3, 610);
        let names: Vec<_> = t[&core].used.iter().map(|h| h.who.clone()).collect();
        assert_eq!(names, [client("a"), client("b"), client("c")]);
        assert!(t[&core].used[0].count >= 30_000);
        let entries: usize = top
            .shards
            .iter()
            .map(|s| s.lock().unwrap().used[0].entries.len())
            .sum();
        assert!(entries <= SHARDS * CAPACITY);
        // Two minutes later, forgotten.
        assert!(top.top(3, 740).is_empty());
    }
}
