//! Storage keys and shard choice for a limited subject.
//!
//! A subject (a client id, an IP, a header value, or the whole route for `global`) is
//! hashed with HMAC-SHA256 keyed by `store.hash_key` (or, without one, by
//! `store.key_prefix`), so no raw key, id or IP ever reaches Redis. The Redis key is
//! `{key_prefix}{limit name}:{{first 16 bytes of the digest, hex}}` — the digest in
//! braces is a Redis Cluster hash tag, so every key of one subject maps to one slot — and the shard is
//! `jump_consistent_hash(first 8 bytes of the digest, shard count)`: all limits of one
//! subject live on the same shard, and every gateway of a fleet with the same shard list
//! and hash key picks the same shard.

use crate::memo::Memo;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::hash::BuildHasher;

/// Where one limit's window for one subject is stored.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LimitKey {
    /// The full storage key, e.g. `tollgate:core:{3f1c…}` (32 hex digits in a hash tag).
    /// Shared, not copied, by each Redis call that carries it (a request's CHECK and
    /// CHARGE each hand it to a shard's batch).
    pub key: std::sync::Arc<str>,
    /// The same key in 24 bytes, as the maps held in this process key it ([`StateKey`]).
    pub state: StateKey,
}

impl LimitKey {
    /// 64 bits of the subject's digest; selects the shard.
    pub fn shard_hash(&self) -> u64 {
        self.state.shard_hash()
    }
}

/// A storage key in 24 bytes, with no allocation of its own: how the maps held in this
/// process key their entries ([`ShardedMap`](super::sharded::ShardedMap): the memory
/// store, the over-limit cache, in-flight units, ...), so that a million callers do not
/// each hold a copy of their full key (about 56 bytes on the heap apiece, a quarter of
/// the memory store at 1M callers; see BENCHMARKS.md) and a request copies 24 bytes
/// where it cloned a string. It holds the subject's 128-bit keyed digest (the 32 hex
/// digits of the full key) and a 64-bit hash of the text before them, the key prefix
/// followed by the limit's name (foldhash with a fixed seed: the same in every
/// snapshot, so a reload that keeps the memory store keeps its windows). A full key is that text, `:{`, the 32 hex
/// digits and `}`, so two `StateKey`s are equal exactly when their full keys are, unless
/// two such texts of this process's configs have the same 64-bit hash (they come from
/// config files, never from the network).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateKey {
    /// Digest bytes 0..8 (big-endian), the subject's shard hash.
    head: u64,
    /// Digest bytes 8..16 (big-endian).
    tail: u64,
    /// Hash of the key prefix and the limit's name.
    scope: u64,
}

impl StateKey {
    /// The subject's shard hash: the first 8 bytes of its digest.
    pub fn shard_hash(&self) -> u64 {
        self.head
    }
}

/// The hash in [`StateKey::scope`] of a full key's text before its digest (the key
/// prefix followed by the limit's name): fixed for the process.
fn scope_hash(prefix_and_limit: &str) -> u64 {
    // Any fixed seed will do; the hash only has to be the same for the same text.
    foldhash::fast::FixedState::with_seed(0x746f_6c6c_6761_7465).hash_one(prefix_and_limit)
}

/// Derives [`LimitKey`]s; one per config snapshot.
#[derive(Clone)]
pub struct KeyScheme {
    prefix: String,
    mac: Hmac<Sha256>,
    /// Tells this scheme's digests apart in the per-thread memo ([`MEMO`]): unique per
    /// [`KeyScheme::new`] (a clone has the same secret, so it shares the id).
    id: u64,
}

/// Subjects up to this many bytes are remembered by [`MEMO`] (an IP subject is at most
/// 42: `ip:` and an IPv6 address).
const MEMO_SUBJECT: usize = 64;

/// One remembered digest: the scheme id, the subject (its length, its bytes) and its digest.
type MemoEntry = (u64, u8, [u8; MEMO_SUBJECT], SubjectDigest);

thread_local! {
    /// The digests this thread computed last, by a hash of the subject (64 slots,
    /// direct-mapped): a caller that sends many requests is hashed with HMAC-SHA-256
    /// once per thread, not once per request. An entry is used only when its scheme id
    /// and subject bytes are equal, so it gives exactly what [`KeyScheme::digest`] would.
    static MEMO: Memo<MemoEntry, 64> = const { Memo::new() };
}

impl std::fmt::Debug for KeyScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyScheme")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl KeyScheme {
    /// A scheme with the given key prefix and optional hash key.
    pub fn new(prefix: &str, hash_key: Option<&str>) -> Self {
        let secret = hash_key.unwrap_or(prefix).as_bytes();
        // HMAC accepts keys of any length, so this cannot fail.
        let mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            prefix: prefix.to_string(),
            mac,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Unique per [`KeyScheme::new`]: two schemes with the same id derive the same keys.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The key of `limit`'s window for `subject` (e.g. `"client:acme"`, `"ip:1.2.3.4"`).
    pub fn key(&self, limit: &str, subject: &str) -> LimitKey {
        self.key_for(limit, &self.digest(subject.as_bytes()))
    }

    /// The keyed digest of a subject: one HMAC-SHA256, shared by every limit that counts
    /// the same subject (so a route with several limits hashes once).
    pub fn digest(&self, subject: &[u8]) -> SubjectDigest {
        if subject.len() > MEMO_SUBJECT {
            return self.compute(subject);
        }
        let hash = foldhash::fast::FixedState::with_seed(self.id).hash_one(subject);
        let found = MEMO.with(|m| {
            m.get(hash, |(id, len, bytes, d)| {
                (*id == self.id && &bytes[..usize::from(*len)] == subject).then_some(*d)
            })
        });
        if let Some(d) = found {
            return d;
        }
        let d = self.compute(subject);
        let mut bytes = [0u8; MEMO_SUBJECT];
        bytes[..subject.len()].copy_from_slice(subject);
        // `subject.len() <= MEMO_SUBJECT` (64): fits a u8.
        let entry = (self.id, subject.len() as u8, bytes, d);
        MEMO.with(|m| m.put(hash, entry));
        d
    }

    /// [`KeyScheme::digest`] without the memo.
    fn compute(&self, subject: &[u8]) -> SubjectDigest {
        let mut mac = self.mac.clone();
        mac.update(subject);
        let digest = mac.finalize().into_bytes();
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        SubjectDigest::of(&first)
    }

    /// The key of `limit`'s window for the subject with digest `d`.
    pub fn key_for(&self, limit: &str, d: &SubjectDigest) -> LimitKey {
        // Written on the stack, then into its one shared allocation.
        let scoped = self.prefix.len() + limit.len();
        let mut buf = smallvec::SmallVec::<[u8; 128]>::with_capacity(scoped + 35);
        buf.extend_from_slice(self.prefix.as_bytes());
        buf.extend_from_slice(limit.as_bytes());
        buf.extend_from_slice(b":{");
        buf.extend_from_slice(d.hex().as_bytes());
        buf.push(b'}');
        // Made of `str`s only: always UTF-8, and `scoped` is a character boundary.
        let key = std::str::from_utf8(&buf).unwrap_or_default();
        let scope = scope_hash(key.get(..scoped).unwrap_or(key));
        LimitKey {
            key: key.into(),
            state: StateKey {
                head: d.shard_hash,
                tail: d.tail,
                scope,
            },
        }
    }
}

/// A subject's keyed digest ([`KeyScheme::digest`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubjectDigest {
    /// The first 16 bytes of the HMAC, as 32 lowercase hex digits.
    hex: [u8; 32],
    /// The first 8 bytes of the HMAC; selects the shard.
    pub shard_hash: u64,
    /// Bytes 8 to 16 of the HMAC (the rest of what the hex digits show).
    tail: u64,
}

impl SubjectDigest {
    /// The digest of the 16 `bytes` (the first of the HMAC's).
    fn of(bytes: &[u8; 16]) -> Self {
        let mut hex = [0u8; 32];
        // 16 bytes always fit 32 hex digits.
        let _ = hex::encode_to_slice(bytes, &mut hex);
        let n = u128::from_be_bytes(*bytes);
        SubjectDigest {
            hex,
            shard_hash: (n >> 64) as u64,
            tail: n as u64,
        }
    }

    /// The 32 hex digits, as in storage keys (`prefix:limit:{HEX}`).
    pub fn hex(&self) -> &str {
        std::str::from_utf8(&self.hex).unwrap_or_default()
    }

    /// The digest whose [`hex`](Self::hex) is `hex` (32 hex digits, either case), as
    /// `GET /top` and the access log show an anonymous caller; `None` for anything
    /// else.
    pub fn from_hex(hex: &str) -> Option<Self> {
        let mut bytes = [0u8; 16];
        hex::decode_to_slice(hex, &mut bytes).ok()?;
        Some(SubjectDigest::of(&bytes))
    }
}

/// Jump consistent hash: the bucket in `0..buckets` for `key`.
///
/// Source: John Lamping and Eric Veach, "A Fast, Minimal Memory, Consistent Hash
/// Algorithm" (2014), arXiv:1406.2294. Going from N to N+1 buckets moves about 1/(N+1)
/// of keys, all of them into the new bucket. `buckets == 0` returns 0.
pub fn jump_consistent_hash(mut key: u64, buckets: u32) -> u32 {
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    while j < i64::from(buckets) {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    b.max(0) as u32
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_digest_memo_gives_what_the_hmac_gives() {
        let a = KeyScheme::new("a:", None);
        let b = KeyScheme::new("b:", Some("secret"));
        let a2 = a.clone();
        let subjects: Vec<Vec<u8>> = (0..300u32)
            .map(|i| format!("ip:10.0.{}.{}", i / 256, i % 256).into_bytes())
            .chain([vec![b'x'; 64], vec![b'y'; 65], Vec::new()])
            .collect();
        // Twice over, through two schemes and a clone: hits, misses and collisions.
        for _ in 0..2 {
            for s in &subjects {
                assert_eq!(a.digest(s), a.compute(s));
                assert_eq!(a2.digest(s), a.compute(s));
                assert_eq!(b.digest(s), b.compute(s));
                assert_ne!(a.digest(s), b.digest(s));
            }
        }
    }

    use super::*;

    fn hashes(n: usize) -> Vec<u64> {
        let s = KeyScheme::new("tollgate:", None);
        (0..n)
            .map(|i| {
                s.key("core", &format!("ip:10.0.{}.{}", i / 256, i % 256))
                    .shard_hash()
            })
            .collect()
    }

    #[test]
    fn keys_hide_the_subject_and_are_stable() {
        let s = KeyScheme::new("tollgate:", None);
        let k = s.key("core", "ip:192.168.1.20");
        assert!(k.key.starts_with("tollgate:core:"));
        assert!(!k.key.contains("192.168"));
        assert_eq!(k.key.len(), "tollgate:core:{}".len() + 32);
        assert!(k.key.ends_with('}') && k.key.contains(":{"));
        assert_eq!(k, s.key("core", "ip:192.168.1.20"));
        let other = KeyScheme::new("tollgate:", Some("fleet-secret"));
        assert_ne!(other.key("core", "ip:192.168.1.20").key, k.key);
    }

    #[test]
    fn compact_keys_are_equal_exactly_when_full_keys_are() {
        // With one hash key: prefixes and names whose texts run into each other ("t:" +
        // "core" and "t:c" + "ore" are one key), a second scheme with the same prefix (a
        // reload); and a scheme with another hash key. Many subjects each.
        let schemes = [
            KeyScheme::new("t:", Some("k")),
            KeyScheme::new("t:", Some("k")),
            KeyScheme::new("t:c", Some("k")),
            KeyScheme::new("u:", Some("k")),
            KeyScheme::new("t:", Some("other")),
        ];
        let core = schemes[0].key("core", "ip:10.0.0.1");
        let run_in = schemes[2].key("ore", "ip:10.0.0.1");
        assert_eq!((&core.key, core.state), (&run_in.key, run_in.state));
        let mut keys = Vec::new();
        for s in &schemes {
            for limit in ["core", "ore", "search", "core:"] {
                for i in 0..40 {
                    keys.push(s.key(limit, &format!("ip:10.0.0.{i}")));
                }
            }
        }
        for a in &keys {
            for b in &keys {
                assert_eq!(a.key == b.key, a.state == b.state, "{} / {}", a.key, b.key);
            }
        }
        // The digest comes back whole from the hex in the full key.
        let hex = &core.key[core.key.len() - 33..core.key.len() - 1];
        let d = SubjectDigest::from_hex(hex).expect("hex");
        assert_eq!(schemes[0].key_for("core", &d), core);
    }

    #[test]
    fn a_digest_comes_back_from_its_hex() {
        let s = KeyScheme::new("tollgate:", None);
        let d = s.digest(b"ip:192.168.1.20");
        assert_eq!(SubjectDigest::from_hex(d.hex()), Some(d));
        assert_eq!(
            SubjectDigest::from_hex(&d.hex().to_ascii_uppercase()),
            Some(d)
        );
        assert_eq!(SubjectDigest::from_hex(&d.hex()[1..]), None);
        assert_eq!(SubjectDigest::from_hex("acme"), None);
    }

    #[test]
    fn spread_over_shards_is_even() {
        let n = 20_000;
        for shards in [2u32, 3, 5, 8] {
            let mut counts = vec![0usize; shards as usize];
            for h in hashes(n) {
                counts[jump_consistent_hash(h, shards) as usize] += 1;
            }
            let expected = n / shards as usize;
            for c in counts {
                assert!(
                    (c as f64 - expected as f64).abs() < expected as f64 * 0.1,
                    "{shards} shards: {c} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn adding_a_shard_moves_about_one_in_n() {
        let n = 20_000;
        for shards in [2u32, 3, 4, 9] {
            let hs = hashes(n);
            let moved = hs
                .iter()
                .filter(|h| {
                    jump_consistent_hash(**h, shards) != jump_consistent_hash(**h, shards + 1)
                })
                .count();
            let expected = n as f64 / (shards + 1) as f64;
            assert!(
                (moved as f64 - expected).abs() < expected * 0.1,
                "{shards}->{}: moved {moved}, expected {expected}",
                shards + 1
            );
            // Every key that moves, moves to the new shard.
            assert!(hs.iter().all(|h| {
                let (a, b) = (
                    jump_consistent_hash(*h, shards),
                    jump_consistent_hash(*h, shards + 1),
                );
                a == b || b == shards
            }));
        }
    }
}
