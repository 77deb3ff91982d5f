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
//!
//! Per request and limit, the cost is one hash of (limit, caller), one uncontended
//! mutex, and a probe of a 128-slot table; a caller not in a full sketch also searches
//! the sketch's 64 counts (a flat array of `u64`) for a smallest one, from a cursor,
//! stopping at the first count at the known floor (in a flood of new callers, usually
//! the next entry). Nothing is allocated once a sketch is full, and reference counts
//! change only when a caller enters the sketch in place of one of another limit or
//! tier, or is a client (`cargo bench --bench callers`).

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
        WhoRef::of(caller).to_owned()
    }
}

/// A caller as counted, borrowed from the request ([`Who`] is what the sketch keeps).
#[derive(Debug, Clone, Copy)]
pub enum WhoRef<'a> {
    /// An identified caller (by its id).
    Client(&'a Arc<Client>),
    /// An anonymous caller's address (`Caller::ip_key`).
    Ip(IpAddr),
}

impl<'a> WhoRef<'a> {
    /// `caller`'s client, else its address as per-IP limits count it.
    pub fn of(caller: &'a crate::identity::Caller) -> Self {
        match &caller.client {
            Some(c) => WhoRef::Client(c),
            None => WhoRef::Ip(caller.ip_key),
        }
    }

    /// The caller to keep.
    pub fn to_owned(self) -> Who {
        match self {
            WhoRef::Client(c) => Who::Client(c.clone()),
            WhoRef::Ip(ip) => Who::Ip(ip),
        }
    }

    fn is(self, who: &Who) -> bool {
        match (self, who) {
            (WhoRef::Client(a), Who::Client(b)) => Arc::ptr_eq(a, b) || a.id == b.id,
            (WhoRef::Ip(a), Who::Ip(b)) => a == *b,
            _ => false,
        }
    }

    /// The hash of (`limit`, this caller): one per request and limit, which picks the
    /// shard and the slot.
    fn hash(self, limit: &str) -> u64 {
        use std::hash::Hasher;
        let mut h = foldhash::fast::FixedState::default().build_hasher();
        h.write(limit.as_bytes());
        match self {
            WhoRef::Client(c) => {
                h.write_u8(0);
                h.write(c.id.as_bytes());
            }
            WhoRef::Ip(IpAddr::V4(ip)) => {
                h.write_u8(1);
                h.write_u32(ip.to_bits());
            }
            WhoRef::Ip(IpAddr::V6(ip)) => {
                h.write_u8(2);
                h.write_u128(ip.to_bits());
            }
        }
        h.finish()
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
    /// What the entry inherited when it replaced another (the over-estimate bound).
    error: u64,
}

/// Slots of a sketch's table: twice its entries, so that a probe is short.
const SLOTS: usize = 2 * CAPACITY;

/// One space-saving sketch: [`CAPACITY`] entries, found through an open-addressing
/// table of [`SLOTS`] one-byte slots (linear probing, backward-shift deletion) by the
/// hash each entry keeps; the counts are a flat array, scanned for the smallest.
#[derive(Debug)]
struct Sketch {
    /// 1 + the index of an entry; 0: empty.
    slots: [u8; SLOTS],
    /// Per entry: its hash (`WhoRef::hash`).
    hashes: [u64; CAPACITY],
    /// Per entry: its count.
    counts: [u64; CAPACITY],
    entries: Vec<Counted>,
    /// At most the smallest count once full (counts only grow, and a replaced entry
    /// gets more than the smallest): an entry at `floor` is a smallest one.
    floor: u64,
    /// Where the next search for the smallest count starts (after the last replaced).
    cursor: usize,
}

impl Default for Sketch {
    fn default() -> Self {
        Self {
            slots: [0; SLOTS],
            hashes: [0; CAPACITY],
            counts: [0; CAPACITY],
            entries: Vec::new(),
            floor: 0,
            cursor: 0,
        }
    }
}

impl Sketch {
    /// The slot holding the entry of `limit` and `who` (hash `hash`), or the empty slot
    /// that ends its probe.
    fn probe(&self, hash: u64, limit: &str, who: WhoRef<'_>) -> Result<usize, usize> {
        let mut i = hash as usize % SLOTS;
        loop {
            match self.slots[i] {
                0 => return Err(i),
                s => {
                    let e = usize::from(s - 1);
                    if self.hashes[e] == hash && {
                        let k = &self.entries[e].key;
                        *k.limit == *limit && who.is(&k.who)
                    } {
                        return Ok(i);
                    }
                }
            }
            i = (i + 1) % SLOTS;
        }
    }

    /// Empty slot `i`, moving later entries of its probe run back (so that no probe
    /// stops early).
    fn vacate(&mut self, mut i: usize) {
        let mut j = i;
        loop {
            self.slots[i] = 0;
            loop {
                j = (j + 1) % SLOTS;
                let s = self.slots[j];
                if s == 0 {
                    return;
                }
                let home = self.hashes[usize::from(s - 1)] as usize % SLOTS;
                // Entry at j may move to i unless its home lies cyclically in (i, j].
                let stays = if i <= j {
                    i < home && home <= j
                } else {
                    i < home || home <= j
                };
                if !stays {
                    self.slots[i] = s;
                    i = j;
                    break;
                }
            }
        }
    }

    fn add(&mut self, limit: &Arc<str>, who: WhoRef<'_>, hash: u64, tier: &Arc<str>, n: u64) {
        let empty = match self.probe(hash, limit, who) {
            Ok(i) => {
                let e = usize::from(self.slots[i] - 1);
                self.counts[e] += n;
                return;
            }
            Err(empty) => empty,
        };
        let e = self.entries.len();
        if e < CAPACITY {
            self.entries.push(Counted {
                key: Key {
                    limit: limit.clone(),
                    who: who.to_owned(),
                },
                tier: tier.clone(),
                error: 0,
            });
            self.hashes[e] = hash;
            self.counts[e] = n;
            self.slots[empty] = e as u8 + 1;
            return;
        }
        // Full: the new caller takes the place of a smallest count, and inherits it.
        // From the cursor on, the first entry at the floor is one (in a flood of new
        // callers, usually the next entry); else the smallest found, the new floor.
        let (mut e, mut min) = (self.cursor, self.counts[self.cursor]);
        if min != self.floor {
            for k in 1..CAPACITY {
                let i = (self.cursor + k) % CAPACITY;
                let c = self.counts[i];
                if c < min {
                    (e, min) = (i, c);
                    if c == self.floor {
                        break;
                    }
                }
            }
            self.floor = min;
        }
        self.cursor = (e + 1) % CAPACITY;
        let old = self.hashes[e];
        let mut i = old as usize % SLOTS;
        while usize::from(self.slots[i]) != e + 1 {
            i = (i + 1) % SLOTS;
        }
        self.vacate(i);
        // The vacated slot may have moved the end of the new caller's probe.
        let mut i = hash as usize % SLOTS;
        while self.slots[i] != 0 {
            i = (i + 1) % SLOTS;
        }
        self.slots[i] = e as u8 + 1;
        self.hashes[e] = hash;
        self.counts[e] = min + n;
        // Reuse what the entry shares with the new caller (usually its limit and tier):
        // no reference count changes.
        let entry = &mut self.entries[e];
        if !Arc::ptr_eq(&entry.key.limit, limit) {
            entry.key.limit = limit.clone();
        }
        if !Arc::ptr_eq(&entry.tier, tier) {
            entry.tier = tier.clone();
        }
        if !who.is(&entry.key.who) {
            entry.key.who = who.to_owned();
        }
        entry.error = min;
    }

    /// Each entry with its count.
    fn iter(&self) -> impl Iterator<Item = (&Counted, u64)> {
        self.entries.iter().zip(self.counts.iter().copied())
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
    fn shard(&self, hash: u64, now_s: u64) -> std::sync::MutexGuard<'_, Shard> {
        // The slot takes the hash's low bits; the shard, high ones.
        let mut shard = self.shards[(hash >> 32) as usize % SHARDS]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        shard.at(now_s / 60);
        shard
    }

    /// Count `units` admitted for `who` (tier `tier`) in `limit`, at `now_s` (epoch
    /// seconds).
    pub fn used(&self, limit: &Arc<str>, who: WhoRef<'_>, tier: &Arc<str>, units: u64, now_s: u64) {
        let hash = who.hash(limit);
        self.shard(hash, now_s).used[0].add(limit, who, hash, tier, units);
    }

    /// Count one refusal of `who` by `limit`, at `now_s` (epoch seconds).
    pub fn refused(&self, limit: &Arc<str>, who: WhoRef<'_>, tier: &Arc<str>, now_s: u64) {
        let hash = who.hash(limit);
        self.shard(hash, now_s).refused[0].add(limit, who, hash, tier, 1);
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
                for (e, count) in sketches.iter().flat_map(Sketch::iter) {
                    let h = out.entry(e.key.clone()).or_insert_with(|| Hitter {
                        who: e.key.who.clone(),
                        tier: e.tier.clone(),
                        count: 0,
                        error: 0,
                    });
                    h.count += count;
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
mod tests;
