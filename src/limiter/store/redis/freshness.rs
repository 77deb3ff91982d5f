//! Reading this gateway's own writes from replicas: which keys of a shard must be
//! checked on the primary because a replica may not have seen this gateway's last
//! write to them yet.
//!
//! Replication is asynchronous: a window this gateway has just charged (or reserved, or
//! refunded) on the primary may read, on a replica, as it was before. The in-flight
//! accounting (`limiter::in_flight::InFlightUnits`) takes a request's units out of its
//! counts when its charge is handed to the primary; a check that then read the window
//! on a lagging replica would miss those units, and a burst of one caller on one
//! gateway would overshoot. So a key written by this gateway is **pinned** to the
//! primary:
//!
//! - **From hand-over.** [`Freshness::wrote`] pins each written key when its call is
//!   handed to the shard's primary queue (under the limiter's in-flight lock, so before
//!   the units leave the in-flight counts), and [`Freshness::written`] records when the
//!   call ended ([`Ticks`], microseconds since the shard started). A call that failed
//!   may still run on the primary later (a timeout is not a refusal): its end is taken
//!   as [`LATE_WRITE_FACTOR`] × `store.timeout` later, past the connection's own bound.
//! - **Until every replica has caught up.** A background task per shard ([`sample`])
//!   reads, every [`SAMPLE_EVERY`] while some key is pinned, the primary's
//!   `master_repl_offset` (`INFO replication`), remembering when it asked, then each
//!   available replica's `slave_repl_offset`. When every replica a check may go to has
//!   processed an offset the primary reported at tick `t`, every write that ended before
//!   `t` is on every replica: keys whose last write ended before `t` are fresh again.
//!   A replica that cannot answer, or lags, keeps the keys pinned (they are read on the
//!   primary, exact but without the replica's offload).
//! - **Checks of pinned keys** go to the primary through the same FIFO queue as the
//!   shard's writes (`Shard::route`), so a charge handed over before a check still runs
//!   before it, which the in-flight accounting relies on.
//!
//! Memory is bounded: at most [`MAX_PINS`] keys are pinned one by one; past that, the
//! whole shard is pinned (every check on the primary) until the samples catch up.
//! Entries are dropped as soon as they are fresh (on lookup, and by the sampler).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How often the sampler asks the primary and the replicas for their offsets while
/// some key is pinned.
pub(super) const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// At most this many keys pinned one by one per shard; past it, the whole shard is.
pub(super) const MAX_PINS: usize = 65_536;

/// A failed write is taken to have ended this many `store.timeout`s after it failed:
/// the connection answers (or gives up on) a command within 4 × `store.timeout`.
pub(super) const LATE_WRITE_FACTOR: u32 = 5;

/// The offsets remembered per shard (one per sample, newest last).
const SAMPLES_KEPT: usize = 256;

/// Microseconds since the shard's [`Freshness`] was made, plus one (0: never).
pub(super) type Ticks = u64;

use super::node::ShardNodes;
use super::scripts::ARGS_PER_KEY;
use crate::limiter::algorithm::OpKind;
use std::sync::Arc;

/// Number of independently locked maps of pins.
const MAPS: usize = 16;

/// One pinned key (or the whole shard).
#[derive(Debug, Default, Clone, Copy)]
struct Pin {
    /// Writes handed over and not ended.
    writing: u32,
    /// When the last of its writes ended.
    ended: Ticks,
}

impl Pin {
    fn holds(&self, fresh_before: Ticks) -> bool {
        self.writing > 0 || self.ended >= fresh_before
    }
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Freshness {
    base: Instant,
    /// Pins by hash of the key's text ([`key_hash`]).
    maps: Box<[Mutex<HashMap<u64, Pin>>]>,
    /// Entries in `maps`.
    len: AtomicUsize,
    /// The whole shard, when `maps` was full.
    shard: Mutex<Pin>,
    shard_pinned: AtomicBool,
    /// Every replica has processed every write that ended before this tick.
    fresh_before: AtomicU64,
    /// Wakes the sampler when a key is pinned.
    wake: Notify,
    /// The margin of a failed write (see [`LATE_WRITE_FACTOR`]).
    late: Duration,
}

/// The hash a key is pinned by (a collision only pins another key too).
fn key_hash(key: &str) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x6672_6573_6821).hash_one(key)
}

/// The keys of a call that write (every op but a peek), given its arguments.
fn writes<'a, K: AsRef<str>>(keys: &'a [K], args: &'a [u64]) -> impl Iterator<Item = &'a str> {
    keys.iter()
        .enumerate()
        .filter(move |(i, _)| {
            args.get(i * ARGS_PER_KEY)
                .is_some_and(|&op| op != OpKind::Peek.code())
        })
        .map(|(_, k)| k.as_ref())
}

impl Freshness {
    /// Pins for a shard whose calls are bounded by `timeout` (`store.timeout`).
    pub(super) fn new(timeout: Duration) -> Self {
        Self {
            base: Instant::now(),
            maps: (0..MAPS).map(|_| Mutex::default()).collect(),
            len: AtomicUsize::new(0),
            shard: Mutex::default(),
            shard_pinned: AtomicBool::new(false),
            fresh_before: AtomicU64::new(0),
            wake: Notify::new(),
            late: timeout * LATE_WRITE_FACTOR,
        }
    }

    /// Now, in [`Ticks`].
    pub(super) fn now(&self) -> Ticks {
        self.base.elapsed().as_micros() as u64 + 1
    }

    fn map(&self, hash: u64) -> MutexGuard<'_, HashMap<u64, Pin>> {
        self.maps[(hash >> 60) as usize % MAPS]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn whole(&self) -> MutexGuard<'_, Pin> {
        self.shard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call with `keys` and their `lua/apply.lua` arguments is being handed to the
    /// primary's queue: pin the keys it writes until it has ended and every replica has
    /// caught up.
    pub(super) fn wrote<K: AsRef<str>>(&self, keys: &[K], args: &[u64]) {
        let mut any = false;
        for key in writes(keys, args) {
            any = true;
            let h = key_hash(key);
            let mut map = self.map(h);
            let full = self.len.load(Ordering::Relaxed) >= MAX_PINS;
            match map.get_mut(&h) {
                Some(pin) => pin.writing += 1,
                None if !full => {
                    map.insert(
                        h,
                        Pin {
                            writing: 1,
                            ended: 0,
                        },
                    );
                    self.len.fetch_add(1, Ordering::Relaxed);
                }
                None => {
                    drop(map);
                    self.whole().writing += 1;
                    self.shard_pinned.store(true, Ordering::Release);
                }
            }
        }
        if any {
            self.wake.notify_one();
        }
    }

    /// The call [`Freshness::wrote`] was told of has ended (`ok`: answered; else it
    /// failed and may still run later).
    pub(super) fn written<K: AsRef<str>>(&self, keys: &[K], args: &[u64], ok: bool) {
        let mut ended = self.now();
        if !ok {
            ended += self.late.as_micros() as u64;
        }
        for key in writes(keys, args) {
            let h = key_hash(key);
            let mut map = self.map(h);
            match map.get_mut(&h) {
                Some(pin) if pin.writing > 0 => {
                    pin.writing -= 1;
                    pin.ended = pin.ended.max(ended);
                }
                _ => {
                    // Counted on the whole shard (the map was full at hand-over).
                    drop(map);
                    let mut whole = self.whole();
                    whole.writing = whole.writing.saturating_sub(1);
                    whole.ended = whole.ended.max(ended);
                }
            }
        }
    }

    /// Whether any of `keys` must be read on the primary now.
    pub(super) fn pinned<K: AsRef<str>>(&self, keys: &[K]) -> bool {
        let fresh_before = self.fresh_before.load(Ordering::Acquire);
        if self.shard_pinned.load(Ordering::Acquire) && self.whole().holds(fresh_before) {
            return true;
        }
        if self.len.load(Ordering::Relaxed) == 0 {
            return false;
        }
        keys.iter().any(|k| {
            let h = key_hash(k.as_ref());
            let mut map = self.map(h);
            match map.get(&h) {
                Some(pin) if pin.holds(fresh_before) => true,
                Some(_) => {
                    map.remove(&h);
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    false
                }
                None => false,
            }
        })
    }

    /// Every write that ended before `tick` is on every replica a check may go to.
    pub(super) fn caught_up(&self, tick: Ticks) {
        self.fresh_before.fetch_max(tick, Ordering::AcqRel);
    }

    /// Drop the pins that no longer hold; whether any key (or the shard) is still
    /// pinned.
    pub(super) fn sweep(&self) -> bool {
        let fresh_before = self.fresh_before.load(Ordering::Acquire);
        let mut left = 0;
        for m in self.maps.iter() {
            let mut map = m.lock().unwrap_or_else(|e| e.into_inner());
            let before = map.len();
            map.retain(|_, pin| pin.holds(fresh_before));
            self.len.fetch_sub(before - map.len(), Ordering::Relaxed);
            left += map.len();
        }
        let whole = self.whole().holds(fresh_before);
        if !whole {
            self.shard_pinned.store(false, Ordering::Release);
        }
        left > 0 || whole
    }

    /// Wait until a key is pinned, or `at_most`.
    pub(super) async fn idle(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, self.wake.notified()).await;
    }
}

/// The primary's offsets sampled so far: `(tick asked, master_repl_offset)`, oldest
/// first.
#[derive(Debug, Default)]
pub(super) struct Samples(std::collections::VecDeque<(Ticks, u64)>);

impl Samples {
    /// The primary reported `offset` when asked at `tick`.
    pub(super) fn push(&mut self, tick: Ticks, offset: u64) {
        if self.0.len() == SAMPLES_KEPT {
            self.0.pop_front();
        }
        self.0.push_back((tick, offset));
    }

    /// Every replica has processed `offset` (the least of theirs): the tick of the
    /// newest sample it covers, and the samples up to it forgotten.
    pub(super) fn covered(&mut self, offset: u64) -> Option<Ticks> {
        let mut newest = None;
        while let Some(&(tick, o)) = self.0.front() {
            if o > offset {
                break;
            }
            newest = Some(tick);
            self.0.pop_front();
        }
        newest
    }
}

/// One `field:value` of an `INFO` text, as an integer.
pub(super) fn info_integer(info: &str, field: &str) -> Option<u64> {
    info.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == field).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The sampler of one shard (see the module documentation): while some key is pinned,
/// every [`SAMPLE_EVERY`], the primary's `master_repl_offset`, then each available
/// replica's `slave_repl_offset`; marks fresh what every replica has caught up with.
/// Ends when the shard is dropped.
pub(super) async fn sample<S: ShardNodes>(shard: std::sync::Weak<S>, fresh: Arc<Freshness>) {
    let mut samples = Samples::default();
    loop {
        let Some(s) = shard.upgrade() else { return };
        if !fresh.sweep() {
            drop(s);
            samples = Samples::default();
            fresh.idle(Duration::from_secs(1)).await;
            continue;
        }
        let asked = fresh.now();
        if let Some(offset) = s
            .primary()
            .info_replication()
            .await
            .ok()
            .and_then(|i| info_integer(&i, "master_repl_offset"))
        {
            samples.push(asked, offset);
            let replicas = s.replicas().load();
            let mut least = Some(u64::MAX);
            for r in replicas.iter().filter(|r| r.is_available()) {
                let processed = r.info_replication().await.ok().and_then(|i| {
                    info_integer(&i, "slave_repl_offset")
                        .or_else(|| info_integer(&i, "master_repl_offset"))
                });
                least = least.zip(processed).map(|(a, b)| a.min(b));
            }
            if let Some(tick) = least.and_then(|o| samples.covered(o)) {
                fresh.caught_up(tick);
            }
        }
        drop(s);
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(ops: &[u64]) -> Vec<u64> {
        ops.iter()
            .flat_map(|&op| {
                let mut a = [0; ARGS_PER_KEY];
                a[0] = op;
                a
            })
            .collect()
    }

    #[test]
    fn a_written_key_stays_pinned_until_the_replicas_caught_up_past_its_write() {
        let f = Freshness::new(Duration::from_millis(50));
        let keys = ["a", "b"];
        // "a" charged, "b" only peeked.
        f.wrote(&keys, &args(&[1, 0]));
        assert!(f.pinned(&["a"]));
        assert!(!f.pinned(&["b"]));
        // Caught up past now, but the write has not ended: still pinned.
        f.caught_up(f.now());
        assert!(f.pinned(&["a"]));
        let before_the_end = f.now();
        f.written(&keys, &args(&[1, 0]), true);
        // Caught up to before the write ended: still pinned.
        f.caught_up(before_the_end - 1);
        assert!(f.pinned(&["a"]));
        std::thread::sleep(Duration::from_millis(1));
        f.caught_up(f.now());
        assert!(!f.pinned(&["a"]));
        assert!(!f.sweep(), "nothing left pinned");
    }

    #[test]
    fn a_failed_write_stays_pinned_past_the_time_it_may_still_land() {
        let f = Freshness::new(Duration::from_millis(50));
        f.wrote(&["a"], &args(&[2]));
        f.written(&["a"], &args(&[2]), false);
        f.caught_up(f.now());
        assert!(f.pinned(&["a"]), "may still run on the primary");
        assert!(f.sweep());
    }

    #[test]
    fn samples_are_covered_up_to_the_least_replica_offset() {
        let mut s = Samples::default();
        s.push(10, 100);
        s.push(20, 150);
        s.push(30, 200);
        assert_eq!(s.covered(99), None);
        assert_eq!(s.covered(160), Some(20));
        assert_eq!(s.covered(160), None);
        assert_eq!(s.covered(500), Some(30));
    }

    #[test]
    fn info_fields_are_read_as_integers() {
        let info =
            "# Replication\r\nrole:slave\r\nslave_repl_offset:1234\r\nmaster_repl_offset:1250\r\n";
        assert_eq!(info_integer(info, "slave_repl_offset"), Some(1234));
        assert_eq!(info_integer(info, "master_repl_offset"), Some(1250));
        assert_eq!(info_integer(info, "role"), None);
    }
}
