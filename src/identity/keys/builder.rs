//! Building a [`KeySet`]: clients created on their first key and shared with the set
//! being replaced when unchanged, their attributes checked for agreement across lines,
//! and the slot table made last (duplicate keys found there).

use super::errors::{KeyErrors, KeyProblem};
use super::source::KeySource;
use super::table::{entry, set_word, slot_of, word, KeySet, Quotas, EXTRA, EXTRAS};
use crate::config::ClientConfig;
use crate::identity::records::Records;
use crate::identity::Client;
use std::collections::BTreeSet;
use std::sync::Arc;

/// Where a key or a client attribute was given: a line of the keys file (1-based), or
/// `CONFIG + i` for `identity.clients[i]`.
pub(super) type Origin = u32;
/// The first [`Origin`] of the inline entries.
pub(super) const CONFIG: Origin = 1 << 31;

/// A client's attributes, as [`Given`] numbers them.
const TIER: usize = 0;
const QUOTAS: usize = 1;
const DISABLED: usize = 2;

/// Given, at a place not kept (a build that does not track origins).
const SOMEWHERE: Origin = u32::MAX;

/// Which of each client's attributes (tier, quotas, disabled) were given, and where.
///
/// A first build keeps one byte a client (a bit for each attribute); the places, three
/// `u32` a client, are kept only by a second build made when an error must name them
/// (a client's lines disagree), so that a good file of a million clients does not pay
/// 12 MB for error messages it never prints.
enum Given {
    /// Bit `a` of a client's byte: attribute `a` was given.
    Flags(Records<1>),
    /// The [`Origin`] of each attribute at bytes `4 * a` of a client's record (0: not
    /// given).
    Origins(Records<12>),
}

impl Given {
    fn new(track: bool) -> Self {
        match track {
            false => Given::Flags(Records::default()),
            true => Given::Origins(Records::default()),
        }
    }

    /// Make room for one more client (nothing given yet).
    fn push(&mut self) {
        match self {
            Given::Flags(r) => r.push([0]),
            Given::Origins(r) => r.push([0; 12]),
        }
    }

    /// Where attribute `a` of client `c` was given ([`SOMEWHERE`] when that is not
    /// kept); `None`: not given.
    fn get(&self, c: usize, a: usize) -> Option<Origin> {
        match self {
            Given::Flags(r) => (r.get(c)[0] & 1 << a != 0).then_some(SOMEWHERE),
            Given::Origins(r) => Some(word(r.get(c), 4 * a)).filter(|o| *o != 0),
        }
    }

    /// Attribute `a` of client `c` was given at `o`.
    fn set(&mut self, c: usize, a: usize, o: Origin) {
        match self {
            Given::Flags(r) => r.get_mut(c)[0] |= 1 << a,
            Given::Origins(r) => set_word(r.get_mut(c), 4 * a, o),
        }
    }
}

/// A key set being built (see the module documentation).
pub(super) struct Builder<'s> {
    pub(super) source: &'s KeySource,
    /// The set so far.
    pub(super) set: KeySet,
    /// Whether this build keeps where each key and attribute was given (for errors that
    /// name an earlier line).
    track: bool,
    /// Where each entry was given (an [`Origin`] each), when tracking.
    pub(super) origins: Records<4>,
    /// Per client (as `set.clients`), which attributes were given (and where, when
    /// tracking).
    given: Given,
    /// Clients by id: an open-addressing table of 1 + indices into `set.clients` (0:
    /// empty).
    ids: Records<4>,
    /// The set this one replaces: clients whose keys and attributes stay are shared
    /// with it, not allocated again.
    pub(super) previous: Option<&'s KeySet>,
    /// Interned tier and limit names.
    names: BTreeSet<Arc<str>>,
    /// `"default"`, the tier of clients given none.
    default_tier: Arc<str>,
    /// The problems found so far.
    pub(super) errors: KeyErrors,
}

/// Where `o` is, as an error names it: `identity.clients[i]` or `line N`.
fn at(o: Origin) -> String {
    if o >= CONFIG {
        format!("identity.clients[{}]", o - CONFIG)
    } else {
        format!("line {o}")
    }
}

impl<'s> Builder<'s> {
    pub(super) fn new(source: &'s KeySource, track: bool) -> Self {
        Self {
            source,
            set: KeySet::default(),
            track,
            origins: Records::default(),
            given: Given::new(track),
            ids: Records::zeroed(1024),
            previous: None,
            names: BTreeSet::from([Arc::from("default")]),
            default_tier: Arc::from("default"),
            errors: KeyErrors::of(source.file.clone()),
        }
    }

    pub(super) fn problem(&mut self, o: Origin, key: &str, message: String) {
        if o >= CONFIG {
            let path = format!("identity.clients[{}].{key}", o - CONFIG);
            self.errors.push(KeyProblem::Config { path, message });
        } else {
            self.errors.file(o as usize, message);
        }
    }

    pub(super) fn intern(&mut self, name: &str) -> Arc<str> {
        if *self.default_tier == *name {
            return self.default_tier.clone();
        }
        if let Some(n) = self.names.get(name) {
            return n.clone();
        }
        let n: Arc<str> = name.into();
        self.names.insert(n.clone());
        n
    }

    pub(super) fn inline(&mut self, i: usize, c: &ClientConfig) {
        let o = CONFIG + i as u32;
        if c.id.trim().is_empty() {
            self.problem(o, "id", "must not be empty".into());
            return;
        }
        if c.tier.trim().is_empty() {
            self.problem(o, "tier", "must not be empty".into());
            return;
        }
        let tier = self.intern(&c.tier);
        let hashes = c.key_sha256.as_slice();
        if hashes.is_empty() {
            self.problem(o, "key_sha256", "give at least one key hash".into());
        }
        for (j, h) in hashes.iter().enumerate() {
            let key = match &c.key_sha256 {
                crate::config::KeyHashes::One(_) => "key_sha256".to_string(),
                crate::config::KeyHashes::Many(_) => format!("key_sha256[{j}]"),
            };
            match parse_sha256(h) {
                Some(d) => {
                    if let Some(client) = self.client(o, &c.id, &d, Some(tier.clone()), None, None)
                    {
                        self.key(o, d, client, 0, None);
                    }
                }
                None => self.problem(
                    o,
                    &key,
                    "must be 64 hex characters (the SHA-256 of the API key)".into(),
                ),
            }
        }
    }
}

impl Builder<'_> {
    /// The label `text` of the key `digest`: the previous set's when that key had the
    /// same label there (a reload allocates only the labels that changed).
    pub(super) fn label(&self, digest: &[u8; 32], text: &str) -> Arc<str> {
        match self.previous.and_then(|p| p.find(digest, || 0)?.label) {
            Some(l) if **l == *text => l.clone(),
            _ => Arc::from(text),
        }
    }

    /// The slot of `id` in the id table: where it is, or the empty slot where it goes.
    fn id_slot(&self, id: &str) -> usize {
        use std::hash::BuildHasher;
        let mask = self.ids.len() - 1;
        let mut i = foldhash::fast::FixedState::default().hash_one(id) as usize & mask;
        loop {
            let at = self.ids.u32(i);
            if at == 0 || &*self.set.clients[at as usize - 1].id == id {
                return i;
            }
            i = (i + 1) & mask;
        }
    }

    /// Double the id table (kept at most half full).
    fn grow_ids(&mut self) {
        let old = std::mem::replace(&mut self.ids, Records::zeroed(0));
        self.ids = Records::zeroed(old.len() * 2);
        for j in 0..old.len() {
            let at = old.u32(j);
            if at != 0 {
                let id = self.set.clients[at as usize - 1].id.clone();
                let slot = self.id_slot(&id);
                self.ids.set_u32(slot, at);
            }
        }
    }

    /// The client `id`, created on its first key (shared with the previous set when
    /// that key was already its); `tier`, `quotas` and `disabled`, when given, must
    /// agree with what earlier keys of the client gave.
    pub(super) fn client(
        &mut self,
        o: Origin,
        id: &str,
        digest: &[u8; 32],
        tier: Option<Arc<str>>,
        quotas: Option<Quotas>,
        disabled: Option<bool>,
    ) -> Option<u32> {
        let slot = self.id_slot(id);
        let index = match self.ids.u32(slot) {
            0 => {
                let index = self.set.clients.len() as u32;
                let kept = self
                    .previous
                    .and_then(|p| p.find(digest, || 0))
                    .filter(|f| &*f.client.id == id)
                    .map(|f| f.client.clone());
                let client = kept
                    .unwrap_or_else(|| Arc::new(Client::new(id.into(), self.default_tier.clone())));
                self.set.clients.push(client);
                self.given.push();
                self.ids.set_u32(slot, index + 1);
                if self.set.clients.len() * 2 > self.ids.len() {
                    self.grow_ids();
                }
                index
            }
            at => at - 1,
        };
        let (c, given, client) = (
            index as usize,
            &mut self.given,
            &mut self.set.clients[index as usize],
        );
        let mut conflict = None;
        if let Some(t) = tier {
            match given.get(c, TIER) {
                None => {
                    if client.tier != t {
                        Arc::make_mut(client).tier = t;
                    }
                    given.set(c, TIER, o);
                }
                Some(g) if client.tier != t => {
                    conflict = Some(("tier", g, format!("tier {t:?} differs from {:?} given at {} for client {id:?} (a client has one tier: give it on one line, or the same on each)", client.tier, at(g))));
                }
                _ => {}
            }
        }
        if let Some(q) = quotas {
            match given.get(c, QUOTAS) {
                None => {
                    if client.quotas.as_deref() != Some(&q) {
                        Arc::make_mut(client).quotas = Some(Box::new(q));
                    }
                    given.set(c, QUOTAS, o);
                }
                Some(g) if client.quotas.as_deref() != Some(&q) => {
                    conflict = Some(("quotas", g, format!("quotas differ from those given at {} for client {id:?} (give them on one line, or the same on each)", at(g))));
                }
                _ => {}
            }
        }
        if let Some(x) = disabled {
            match given.get(c, DISABLED) {
                None => {
                    if client.disabled != x {
                        Arc::make_mut(client).disabled = x;
                    }
                    given.set(c, DISABLED, o);
                }
                Some(g) if client.disabled != x => {
                    conflict = Some(("disabled", g, format!("disabled {x} differs from {} given at {} for client {id:?} (disabling a client disables all its keys; to retire one key, remove it or give it an expires_at)", client.disabled, at(g))));
                }
                _ => {}
            }
        }
        match conflict {
            Some((_, SOMEWHERE, _)) if !self.track => {
                self.errors.untracked = true;
                None
            }
            Some((key, _, message)) => {
                self.problem(o, key, message);
                None
            }
            None => Some(index),
        }
    }

    /// Add a key; duplicates are found when the table is built.
    pub(super) fn key(
        &mut self,
        o: Origin,
        digest: [u8; 32],
        client: u32,
        expires_at: u32,
        label: Option<Arc<str>>,
    ) {
        let label = match label {
            None => 0,
            Some(l) => {
                self.set.labels.push(l);
                self.set.labels.len() as u32
            }
        };
        let to = match (expires_at, label) {
            (0, 0) => client,
            _ => {
                let mut x = [0u8; EXTRAS];
                set_word(&mut x, 0, client);
                set_word(&mut x, 4, expires_at);
                set_word(&mut x, 8, label);
                self.set.extras.push(x);
                EXTRA | (self.set.extras.len() as u32 - 1)
            }
        };
        self.set.entries.push(entry(&digest, to));
        if self.track {
            self.origins.push(o.to_ne_bytes());
        }
    }

    /// The set, or every problem found (marked `untracked` when one must name a place
    /// this build did not keep).
    pub(super) fn finish(mut self) -> Result<KeySet, KeyErrors> {
        if self.errors.untracked {
            return Err(self.errors);
        }
        // The builder's per-client tables go first, so that the slot table is made
        // without them (the peak of a reload is the running set plus this one's).
        // What no line gave takes its default (a client shared with the previous set
        // may have had it).
        let given = std::mem::replace(&mut self.given, Given::new(false));
        for (c, client) in self.set.clients.iter_mut().enumerate() {
            if given.get(c, TIER).is_none() && client.tier != self.default_tier {
                Arc::make_mut(client).tier = self.default_tier.clone();
            }
            if given.get(c, QUOTAS).is_none() && client.quotas.is_some() {
                Arc::make_mut(client).quotas = None;
            }
            if given.get(c, DISABLED).is_none() && client.disabled {
                Arc::make_mut(client).disabled = false;
            }
            self.set.tiers.insert(client.tier.clone());
        }
        drop(given);
        let ids = std::mem::take(&mut self.ids);
        if self.source.by_id {
            self.set.by_id = (0..ids.len())
                .map(|j| ids.u32(j))
                .filter(|at| *at != 0)
                .map(|at| (self.set.clients[at as usize - 1].id.clone(), at - 1))
                .collect();
        }
        drop(ids);
        // The table: at most half full, so a miss probes about two slots.
        let n = self.set.entries.len();
        let size = (n * 2).max(8).next_power_of_two();
        let mut slots = Records::<4>::zeroed(size);
        let mask = size - 1;
        for k in 0..n {
            let mut digest = [0u8; 32];
            digest.copy_from_slice(&self.set.entries.get(k)[..32]);
            let mut i = slot_of(&digest) & mask;
            loop {
                let at_slot = slots.u32(i);
                if at_slot == 0 {
                    slots.set_u32(i, k as u32 + 1);
                    break;
                }
                let other = at_slot as usize - 1;
                if self.set.entries.get(other)[..32] == digest[..] {
                    if !self.track {
                        self.errors.untracked = true;
                        return Err(self.errors);
                    }
                    let (o, first) = (self.origins.u32(k), self.origins.u32(other));
                    let message = format!(
                        "the same key is already given at {} (a key hash must be unique across identity.clients and identity.clients_file)",
                        at(first)
                    );
                    if o >= CONFIG {
                        self.errors.push(KeyProblem::Config {
                            path: format!("identity.clients[{}].key_sha256", o - CONFIG),
                            message,
                        });
                    } else {
                        self.errors.file(o as usize, message);
                    }
                    break;
                }
                i = (i + 1) & mask;
            }
        }
        if !self.errors.is_empty() {
            return Err(self.errors);
        }
        drop(std::mem::take(&mut self.origins));
        self.set.slots = slots;
        Ok(self.set)
    }
}

/// Parse 64 hex characters.
pub(in crate::identity) fn parse_sha256(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(s.trim(), &mut out).ok()?;
    Some(out)
}
