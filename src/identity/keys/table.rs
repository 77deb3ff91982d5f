//! The key table: every known key by SHA-256, in an open-addressing table of `u32`
//! slots over records kept in anonymous memory maps, looked up in constant time.

use crate::identity::records::Records;
use crate::identity::Client;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// A client's own quotas: (limit name, cost units per window).
pub(in crate::identity) type Quotas = Box<[(Arc<str>, u64)]>;

/// Bytes of one key's record: its SHA-256 (32 bytes), then a `u32`: the index of its
/// client in [`KeySet::clients`] or, with [`EXTRA`] set, the index of the key's record
/// in [`KeySet::extras`] (a key with an `expires_at` or a label).
pub(super) const ENTRY: usize = 36;

/// The bit of an entry's last word saying it points into [`KeySet::extras`]. Client and
/// extra indices stay below it: there are fewer of them than lines, which stay below
/// [`CONFIG`].
pub(super) const EXTRA: u32 = 1 << 31;

/// Bytes of the record of a key with an `expires_at` or a label: three `u32`, the index
/// of its client, its `expires_at` (epoch seconds after which it is refused; 0: never)
/// and 1 + the index of its label in [`KeySet::labels`] (0: none).
pub(super) const EXTRAS: usize = 12;

/// The `u32` at byte `at` of `r`.
pub(super) fn word<const W: usize>(r: &[u8; W], at: usize) -> u32 {
    u32::from_ne_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]])
}

/// Set the `u32` at byte `at` of `r`.
pub(super) fn set_word<const W: usize>(r: &mut [u8; W], at: usize, v: u32) {
    r[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

/// The record of a key: its digest and `to` (a client index, or `EXTRA` | an index into
/// the extras).
pub(super) fn entry(digest: &[u8; 32], to: u32) -> [u8; ENTRY] {
    let mut r = [0u8; ENTRY];
    r[..32].copy_from_slice(digest);
    set_word(&mut r, 32, to);
    r
}

/// A key that matched, and whether it may be used now.
#[derive(Debug)]
pub struct Found<'a> {
    /// Its client.
    pub client: &'a Arc<Client>,
    /// Its label (`"label"` in the keys file), if any.
    pub label: Option<&'a Arc<str>>,
    /// Whether the key is usable: its client is not disabled and it has not expired
    /// (`now_s`, epoch seconds, is past `expires_at`).
    pub active: bool,
}

/// Every known key, by SHA-256; immutable once built (a reload builds a new one).
#[derive(Debug, Default)]
pub struct KeySet {
    /// Power-of-two table of 1 + indices into `entries`; 0 (empty) ends a probe.
    pub(super) slots: Records<4>,
    /// One record of [`ENTRY`] bytes a key.
    pub(super) entries: Records<ENTRY>,
    /// One record of [`EXTRAS`] bytes for each key with an `expires_at` or a label.
    pub(super) extras: Records<EXTRAS>,
    /// The keys' labels.
    pub(super) labels: Vec<Arc<str>>,
    /// Every client, one per distinct id.
    pub(super) clients: Vec<Arc<Client>>,
    /// Clients by id (only with `identity.client_cert_subject_as_caller`).
    pub(super) by_id: HashMap<Arc<str>, u32>,
    /// The clients' tiers.
    pub(super) tiers: BTreeSet<Arc<str>>,
    /// The keys file's size and modification time when it was read.
    pub(super) fingerprint: Option<(u64, Option<std::time::SystemTime>)>,
    /// How many of the keys the keys file gave (the others are inline).
    pub(super) file_keys: usize,
}

impl KeySet {
    /// The entry whose digest is `digest`, checked for use at `now_s()` (epoch seconds;
    /// called only for keys with an `expires_at`).
    pub fn find(&self, digest: &[u8; 32], now_s: impl FnOnce() -> u64) -> Option<Found<'_>> {
        if self.slots.len() == 0 {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = slot_of(digest) & mask;
        loop {
            let at = self.slots.u32(i);
            if at == 0 {
                return None;
            }
            let e = self.entries.get(at as usize - 1);
            if bool::from(e[..32].ct_eq(&digest[..])) {
                let to = word(e, 32);
                let (client, expires_at, label) = match to & EXTRA {
                    0 => (to, 0, 0),
                    _ => {
                        let x = self.extras.get((to & !EXTRA) as usize);
                        (word(x, 0), word(x, 4), word(x, 8))
                    }
                };
                let client = &self.clients[client as usize];
                let expired = expires_at != 0 && now_s() >= u64::from(expires_at);
                let label = match label {
                    0 => None,
                    l => self.labels.get(l as usize - 1),
                };
                return Some(Found {
                    client,
                    label,
                    active: !client.disabled && !expired,
                });
            }
            i = (i + 1) & mask;
        }
    }

    /// The client with id `id`, when clients are kept by id (certificate callers).
    pub fn by_id(&self, id: &str) -> Option<&Arc<Client>> {
        self.by_id.get(id).map(|i| &self.clients[*i as usize])
    }

    /// The client with id `id`: through the by-id map when it is kept, else by a scan
    /// of every client (for `GET /callers/{id}`: one admin request, not the request
    /// path; about a millisecond per 100,000 clients).
    pub fn client(&self, id: &str) -> Option<&Arc<Client>> {
        if !self.by_id.is_empty() {
            return self.by_id(id);
        }
        self.clients.iter().find(|c| &*c.id == id)
    }

    /// The tiers of the clients.
    pub fn tiers(&self) -> &BTreeSet<Arc<str>> {
        &self.tiers
    }

    /// How many keys.
    pub fn keys(&self) -> usize {
        self.entries.len()
    }

    /// Every client (one per distinct id), in no particular order: `tollgate replay`
    /// finds a logged caller id's tier and own quotas here.
    pub fn all_clients(&self) -> &[Arc<Client>] {
        &self.clients
    }

    /// How many of the keys the keys file gave.
    pub fn file_keys(&self) -> usize {
        self.file_keys
    }

    /// How many of this set's keys `new` does not have (the keys a swap to `new`
    /// would remove).
    pub fn removed_by(&self, new: &KeySet) -> usize {
        (0..self.entries.len())
            .filter(|&i| {
                let e = self.entries.get(i);
                let mut digest = [0u8; 32];
                digest.copy_from_slice(&e[..32]);
                new.find(&digest, || 0).is_none()
            })
            .count()
    }

    /// How many clients (distinct ids).
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Whether `path`'s size and modification time are those it had when this set read
    /// it (a watcher skips events that changed nothing).
    pub fn same_file(&self, path: &Path) -> bool {
        self.fingerprint.is_some() && self.fingerprint == fingerprint(path)
    }
}

/// Removals of at most this many keys are never held (see [`held`]).
pub const ALWAYS_REMOVABLE: usize = 10;

/// Whether a watched change from `running` to `new` is held until SIGHUP, and how many
/// keys it would remove: it removes more than `max_removed_percent` percent of the keys
/// in use and more than [`ALWAYS_REMOVABLE`], or it leaves the keys file with no key
/// while `running` had some of it (a file being written in place, caught half-way).
pub fn held(running: &KeySet, new: &KeySet, max_removed_percent: u32) -> Option<usize> {
    if running.file_keys() == 0 {
        return None;
    }
    let removed = running.removed_by(new);
    let share = removed as u128 * 100 > u128::from(max_removed_percent) * running.keys() as u128;
    let emptied = removed > 0 && new.file_keys() == 0;
    ((share && removed > ALWAYS_REMOVABLE) || emptied).then_some(removed)
}

/// The size and modification time of `path`, to tell whether it changed.
pub(super) fn fingerprint(path: &Path) -> Option<(u64, Option<std::time::SystemTime>)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.modified().ok()))
}

/// The first slot to probe for `digest`: its first 8 bytes.
pub(super) fn slot_of(digest: &[u8; 32]) -> usize {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first) as usize
}
