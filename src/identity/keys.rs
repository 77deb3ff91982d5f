//! The API keys a gateway knows: the inline `[[identity.clients]]` list and the lines
//! of `identity.clients_file`, merged into one [`KeySet`] that is validated as a whole.
//!
//! The keys file has one JSON object a line:
//!
//! ```text
//! {"id": "acme", "key_sha256": "<64 hex>", "tier": "gold", "quotas": {"core": 10000}}
//! {"id": "acme", "key_sha256": "<64 hex>", "label": "ci key", "expires_at": 1800000000}
//! {"id": "old-customer", "key_sha256": "<64 hex>", "disabled": true}
//! ```
//!
//! Blank lines and lines starting with `#` are skipped. Lines (and inline entries) that
//! share an `id` are keys of one client: they share every window. The tier, the quota
//! overrides and the disabled flag belong to the client, so they are given on one line
//! or with the same value on each. A key hash appears once across the file and the
//! inline list.
//!
//! Lookups are one probe sequence in an open-addressing table of `u32` slots indexed by
//! the digest's first 8 bytes (SHA-256 output is uniform, and callers choose keys, not
//! digests), then a constant-time comparison of the 32 bytes. 1,000,000 keys take about
//! 8 MB of slots plus 36 bytes an entry (12 more for a key with an `expires_at` or a
//! label) plus the clients (BENCHMARKS.md). The slots, the entries and the builder's own
//! tables live in anonymous memory maps ([`records`](super::records)), given back to the
//! system as soon as a reload has replaced them.
//!
//! A reload builds the new set while the running one serves, so its peak memory is the
//! two together. The builder keeps little beside the new set: a byte a client for which
//! attributes were given and a table of ids (8 bytes a client). Where each key and
//! attribute was given (line numbers) is kept only by a second build, made when a file
//! has an error that names an earlier line (a client's lines disagree, a key is given
//! twice); labels and clients that did not change are shared with the running set.

use super::records::Records;
use super::Client;
use crate::config::{ClientConfig, Config, IdentityConfig, MAX_REPORTED};
use crate::lines::Capped;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The longest line of the keys file, in bytes (a key line is about 100): a longer one
/// is an error, and is never held in memory whole.
pub const MAX_LINE: usize = 64 * 1024;

/// A client's own quotas: (limit name, cost units per window).
pub(super) type Quotas = Box<[(Arc<str>, u64)]>;

/// Where a key or a client attribute was given: a line of the keys file (1-based), or
/// `CONFIG + i` for `identity.clients[i]`.
type Origin = u32;
const CONFIG: Origin = 1 << 31;

/// Bytes of one key's record: its SHA-256 (32 bytes), then a `u32`: the index of its
/// client in [`KeySet::clients`] or, with [`EXTRA`] set, the index of the key's record
/// in [`KeySet::extras`] (a key with an `expires_at` or a label).
const ENTRY: usize = 36;

/// The bit of an entry's last word saying it points into [`KeySet::extras`]. Client and
/// extra indices stay below it: there are fewer of them than lines, which stay below
/// [`CONFIG`].
const EXTRA: u32 = 1 << 31;

/// Bytes of the record of a key with an `expires_at` or a label: three `u32`, the index
/// of its client, its `expires_at` (epoch seconds after which it is refused; 0: never)
/// and 1 + the index of its label in [`KeySet::labels`] (0: none).
const EXTRAS: usize = 12;

/// The `u32` at byte `at` of `r`.
fn word<const W: usize>(r: &[u8; W], at: usize) -> u32 {
    u32::from_ne_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]])
}

/// Set the `u32` at byte `at` of `r`.
fn set_word<const W: usize>(r: &mut [u8; W], at: usize, v: u32) {
    r[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

/// The record of a key: its digest and `to` (a client index, or `EXTRA` | an index into
/// the extras).
fn entry(digest: &[u8; 32], to: u32) -> [u8; ENTRY] {
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
    slots: Records<4>,
    /// One record of [`ENTRY`] bytes a key.
    entries: Records<ENTRY>,
    /// One record of [`EXTRAS`] bytes for each key with an `expires_at` or a label.
    extras: Records<EXTRAS>,
    /// The keys' labels.
    labels: Vec<Arc<str>>,
    clients: Vec<Arc<Client>>,
    /// Clients by id (only with `identity.client_cert_subject_as_caller`).
    by_id: HashMap<Arc<str>, u32>,
    /// The clients' tiers.
    tiers: BTreeSet<Arc<str>>,
    /// The keys file's size and modification time when it was read.
    fingerprint: Option<(u64, Option<std::time::SystemTime>)>,
    /// How many of the keys the keys file gave (the others are inline).
    file_keys: usize,
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

    /// An empty set that still knows `source`'s inline tiers (stands in for a set that
    /// failed to build, so that its errors are not followed by "unknown tier" ones).
    pub fn failed(source: &KeySource) -> Self {
        Self {
            tiers: source
                .inline
                .iter()
                .map(|c| Arc::from(c.tier.as_str()))
                .collect(),
            ..Self::default()
        }
    }

    /// The client with id `id`, when clients are kept by id (certificate callers).
    pub fn by_id(&self, id: &str) -> Option<&Arc<Client>> {
        self.by_id.get(id).map(|i| &self.clients[*i as usize])
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

fn fingerprint(path: &Path) -> Option<(u64, Option<std::time::SystemTime>)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), m.modified().ok()))
}

fn slot_of(digest: &[u8; 32]) -> usize {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first) as usize
}

/// What a key set is built from; two equal sources build the same set (from the same
/// file content).
#[derive(Debug, Clone, PartialEq)]
pub struct KeySource {
    /// `[[identity.clients]]`.
    pub inline: Vec<ClientConfig>,
    /// `identity.clients_file`, resolved against the config file's directory.
    pub file: Option<PathBuf>,
    /// Limit names quota overrides may name; `None`: not checked.
    pub limits: Option<BTreeSet<String>>,
    /// Tiers the keys file may use (those some limit gives a quota, the inline
    /// clients', `[identity.jwt]`'s and the anonymous tier); `None`: any.
    pub tiers: Option<BTreeSet<String>>,
    /// Keep clients by id (`identity.client_cert_subject_as_caller`).
    pub by_id: bool,
    /// The largest keys file read, in bytes (`identity.clients_file_max_bytes`).
    pub max_bytes: u64,
}

impl KeySource {
    /// The source of `[identity]` alone: names of limits and tiers are not checked.
    pub fn of_identity(cfg: &IdentityConfig, base_dir: &Path) -> Self {
        Self {
            inline: cfg.clients.clone(),
            file: cfg.clients_file.as_ref().map(|f| base_dir.join(f)),
            limits: None,
            tiers: None,
            by_id: cfg.client_cert_subject_as_caller,
            max_bytes: cfg.clients_file_max_bytes,
        }
    }

    /// The source of a whole config: quota overrides must name its limits, and tiers in
    /// the keys file must be ones its limits or clients know.
    pub fn of_config(cfg: &Config, base_dir: &Path) -> Self {
        let mut tiers: BTreeSet<String> = cfg
            .limits
            .iter()
            .flat_map(|l| l.quota.keys().cloned())
            .collect();
        tiers.extend(cfg.identity.clients.iter().map(|c| c.tier.clone()));
        tiers.insert(cfg.identity.anonymous_tier.clone());
        if let Some(jwt) = &cfg.identity.jwt {
            tiers.insert(jwt.default_tier.clone());
            tiers.extend(jwt.tiers.iter().cloned());
        }
        Self {
            limits: Some(cfg.limits.iter().map(|l| l.name.clone()).collect()),
            tiers: Some(tiers),
            ..Self::of_identity(&cfg.identity, base_dir)
        }
    }

    /// Read the keys file (if any) and build the set. Clients that `previous` (the set
    /// this one replaces) has with the same id, key and attributes are shared with it
    /// rather than allocated again, so that a reload of a big file needs little more
    /// memory than the new table.
    ///
    /// Errors: every problem found, each tied to an inline entry's key path or to a line
    /// of the file (see [`KeyErrors`]).
    pub fn build(&self, previous: Option<&KeySet>) -> Result<KeySet, KeyErrors> {
        match self.build_once(previous, false) {
            // Lines disagree, or a key is given twice: the error names the earlier
            // line, which only a tracking build keeps.
            Err(e) if e.untracked => self.build_once(previous, true),
            built => built,
        }
    }

    /// One build; with `track`, it keeps where each key and attribute was given, which
    /// some errors name (without, such an error is one marked `untracked`).
    fn build_once(&self, previous: Option<&KeySet>, track: bool) -> Result<KeySet, KeyErrors> {
        let mut b = Builder::new(self, track);
        b.previous = previous;
        for (i, c) in self.inline.iter().enumerate() {
            b.inline(i, c);
        }
        let inline_keys = b.set.entries.len();
        if let Some(path) = &self.file {
            b.set.fingerprint = fingerprint(path);
            let len = b.set.fingerprint.map_or(0, |(len, _)| len);
            if len > self.max_bytes {
                b.errors.file(
                    0,
                    format!(
                        "the keys file is {len} bytes, more than identity.clients_file_max_bytes = {} bytes: not read (raise the cap, or check the file)",
                        self.max_bytes
                    ),
                );
                return b.finish();
            }
            // A line is at least 84 bytes: make room for the most lines the file can
            // have (within the cap), so that the vectors never grow by copying. Pages
            // never written are not resident.
            let most = (len.min(self.max_bytes) / 84) as usize + b.set.entries.len();
            let mut entries = Records::with_capacity(most);
            let mut origins = Records::with_capacity(if track { most } else { 0 });
            for i in 0..b.set.entries.len() {
                entries.push(*b.set.entries.get(i));
            }
            for i in 0..b.origins.len() {
                origins.push(*b.origins.get(i));
            }
            let mut extras = Records::with_capacity(most + b.set.extras.len());
            for i in 0..b.set.extras.len() {
                extras.push(*b.set.extras.get(i));
            }
            (b.set.entries, b.origins, b.set.extras) = (entries, origins, extras);
            b.set.clients.reserve(most);
            match std::fs::File::open(path) {
                // A file that grew past the cap since its size was looked at is read
                // up to the cap and one byte more: the error below.
                Ok(f) => {
                    let capped = std::io::Read::take(f, self.max_bytes.saturating_add(1));
                    let mut r = std::io::BufReader::with_capacity(1 << 20, capped);
                    b.read(&mut r);
                    if r.into_inner().limit() == 0 {
                        b.errors.file(
                            0,
                            format!(
                                "the keys file grew past identity.clients_file_max_bytes = {} bytes while it was read",
                                self.max_bytes
                            ),
                        );
                    }
                }
                Err(e) => b.errors.file(0, format!("cannot read the keys file: {e}")),
            }
        }
        b.set.file_keys = b.set.entries.len() - inline_keys;
        b.finish()
    }
}

/// One line of the keys file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(borrow)]
    key_sha256: Cow<'a, str>,
    #[serde(default, borrow)]
    tier: Option<Cow<'a, str>>,
    #[serde(default)]
    quotas: Option<BTreeMap<String, u64>>,
    #[serde(default)]
    disabled: Option<bool>,
    #[serde(default)]
    expires_at: Option<u64>,
    #[serde(default, borrow)]
    label: Option<Cow<'a, str>>,
}

/// A problem in the keys: at an inline entry, or at a line of the keys file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyProblem {
    /// At a key path of the config file, e.g. `identity.clients[2].key_sha256`.
    Config {
        /// The key path.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// At a line of the keys file (0: the file as a whole).
    File {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
}

/// The problems of a key set that could not be built: those of inline entries (the
/// config report caps them), at most [`MAX_REPORTED`] of the keys file, and how many
/// more the file had.
#[derive(Debug, Clone, Default)]
pub struct KeyErrors {
    /// The keys file, for rendering.
    pub file: Option<PathBuf>,
    /// The problems kept.
    pub problems: Vec<KeyProblem>,
    /// Problems of the keys file kept.
    file_problems: usize,
    /// Problems of the keys file found past [`MAX_REPORTED`].
    pub more: usize,
    /// A problem must name where something was given earlier, and this build did not
    /// keep it: the set is built again keeping it (the problems are not reported).
    untracked: bool,
}

impl KeyErrors {
    fn push(&mut self, p: KeyProblem) {
        if matches!(p, KeyProblem::Config { .. }) {
            self.problems.push(p);
        } else if self.file_problems < MAX_REPORTED {
            self.file_problems += 1;
            self.problems.push(p);
        } else {
            self.more += 1;
        }
    }

    fn file(&mut self, line: usize, message: String) {
        self.push(KeyProblem::File { line, message });
    }

    fn is_empty(&self) -> bool {
        self.problems.is_empty()
    }

    /// A problem of the keys file as `PATH:LINE: what is wrong` (`PATH: …` for the
    /// file as a whole, line 0).
    pub fn file_line(&self, line: usize, message: &str) -> String {
        let path = self.file.as_deref().unwrap_or(Path::new("")).display();
        match line {
            0 => format!("{path}: {message}"),
            n => format!("{path}:{n}: {message}"),
        }
    }

    /// The count of problems not shown, as a line (`None` when all are shown).
    pub fn more_line(&self) -> Option<String> {
        (self.more > 0).then(|| self.file_line(0, &format!("{} more errors not shown", self.more)))
    }

    /// Each problem as one line: `PATH:LINE: what is wrong` for the keys file,
    /// `key.path: what is wrong` for inline entries, then a count of those not shown.
    pub fn lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .problems
            .iter()
            .map(|p| match p {
                KeyProblem::Config { path, message } => format!("{path}: {message}"),
                KeyProblem::File { line, message } => self.file_line(*line, message),
            })
            .collect();
        out.extend(self.more_line());
        out
    }
}

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

struct Builder<'s> {
    source: &'s KeySource,
    set: KeySet,
    /// Whether this build keeps where each key and attribute was given (for errors that
    /// name an earlier line).
    track: bool,
    /// Where each entry was given (an [`Origin`] each), when tracking.
    origins: Records<4>,
    /// Per client (as `set.clients`), which attributes were given (and where, when
    /// tracking).
    given: Given,
    /// Clients by id: an open-addressing table of 1 + indices into `set.clients` (0:
    /// empty).
    ids: Records<4>,
    /// The set this one replaces: clients whose keys and attributes stay are shared
    /// with it, not allocated again.
    previous: Option<&'s KeySet>,
    /// Interned tier and limit names.
    names: BTreeSet<Arc<str>>,
    /// `"default"`, the tier of clients given none.
    default_tier: Arc<str>,
    errors: KeyErrors,
}

fn at(o: Origin) -> String {
    if o >= CONFIG {
        format!("identity.clients[{}]", o - CONFIG)
    } else {
        format!("line {o}")
    }
}

impl<'s> Builder<'s> {
    fn new(source: &'s KeySource, track: bool) -> Self {
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
            errors: KeyErrors {
                file: source.file.clone(),
                ..Default::default()
            },
        }
    }

    fn problem(&mut self, o: Origin, key: &str, message: String) {
        if o >= CONFIG {
            let path = format!("identity.clients[{}].{key}", o - CONFIG);
            self.errors.push(KeyProblem::Config { path, message });
        } else {
            self.errors.file(o as usize, message);
        }
    }

    fn intern(&mut self, name: &str) -> Arc<str> {
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

    fn inline(&mut self, i: usize, c: &ClientConfig) {
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

    fn read(&mut self, r: &mut impl BufRead) {
        let mut buf = Vec::with_capacity(256);
        let mut n = 0u32;
        while !self.errors.untracked {
            let too_long = match crate::lines::read_capped(r, &mut buf, MAX_LINE) {
                Ok(Capped::End) => return,
                Ok(Capped::Line) => None,
                Ok(Capped::TooLong(len)) => Some(len),
                Err(e) => {
                    self.errors
                        .file(n as usize + 1, format!("cannot read the keys file: {e}"));
                    return;
                }
            };
            n += 1;
            if n >= CONFIG {
                self.errors.file(n as usize, "too many lines".into());
                return;
            }
            if let Some(len) = too_long {
                self.errors.file(
                    n as usize,
                    format!(
                        "the line is {len} bytes, more than the {MAX_LINE} a key line may have"
                    ),
                );
                continue;
            }
            let text = buf.trim_ascii();
            if text.is_empty() || text[0] == b'#' {
                continue;
            }
            match serde_json::from_slice::<Line<'_>>(text) {
                Ok(line) => self.line(n, line),
                Err(e) => self.errors.file(
                    n as usize,
                    format!("not a key line ({e}); expected {{\"id\": …, \"key_sha256\": …}}"),
                ),
            }
        }
    }

    fn line(&mut self, n: Origin, line: Line<'_>) {
        let Some(digest) = parse_sha256(&line.key_sha256) else {
            self.problem(
                n,
                "key_sha256",
                "key_sha256 must be 64 hex characters (the SHA-256 of the API key)".into(),
            );
            return;
        };
        if line.id.trim().is_empty() {
            self.problem(n, "id", "id must not be empty".into());
            return;
        }
        let tier = match line.tier.as_deref() {
            Some(t) if t.trim().is_empty() => {
                self.problem(n, "tier", "tier must not be empty".into());
                return;
            }
            Some(t) => {
                if let Some(known) = &self.source.tiers {
                    if !known.contains(t) {
                        let list: Vec<&str> = known.iter().map(String::as_str).collect();
                        self.problem(n, "tier", format!("unknown tier {t:?}: no limit gives it a quota and no client in the config has it; known tiers: {}", list.join(", ")));
                        return;
                    }
                }
                Some(self.intern(t))
            }
            None => None,
        };
        let quotas = match line.quotas {
            Some(q) => {
                let mut out = Vec::with_capacity(q.len());
                for (name, n_units) in q {
                    if let Some(limits) = &self.source.limits {
                        if !limits.contains(&name) {
                            self.problem(
                                n,
                                "quotas",
                                format!("quotas: no limit is named {name:?}"),
                            );
                            return;
                        }
                    }
                    if n_units == 0 {
                        self.problem(n, "quotas", format!("quotas.{name}: must be at least 1 (disable the client with \"disabled\": true)"));
                        return;
                    }
                    out.push((self.intern(&name), n_units));
                }
                Some(out.into_boxed_slice())
            }
            None => None,
        };
        let expires_at = match line.expires_at {
            None => 0,
            Some(0) => {
                self.problem(n, "expires_at", "expires_at must be epoch seconds after 1970 (leave it out for a key that never expires)".into());
                return;
            }
            Some(t) => match u32::try_from(t) {
                Ok(t) => t,
                Err(_) => {
                    self.problem(
                        n,
                        "expires_at",
                        format!("expires_at {t} is not epoch seconds (milliseconds?)"),
                    );
                    return;
                }
            },
        };
        let label = line.label.as_deref().map(|l| self.label(&digest, l));
        let Some(client) = self.client(n, &line.id, &digest, tier, quotas, line.disabled) else {
            return;
        };
        self.key(n, digest, client, expires_at, label);
    }

    /// The label `text` of the key `digest`: the previous set's when that key had the
    /// same label there (a reload allocates only the labels that changed).
    fn label(&self, digest: &[u8; 32], text: &str) -> Arc<str> {
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
    fn client(
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
    fn key(
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
    fn finish(mut self) -> Result<KeySet, KeyErrors> {
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
pub(super) fn parse_sha256(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(s.trim(), &mut out).ok()?;
    Some(out)
}

/// What `tollgate key new` makes: a new random key and its keys-file line.
#[derive(Debug, Clone)]
pub struct NewKey {
    /// The key: `tg_` and 256 random bits in URL-safe base64 without padding (46
    /// characters). Shown once; only its hash is stored.
    pub key: String,
    /// The JSON line of the keys file for it (no newline).
    pub line: String,
}

/// Prefix of keys made by [`new_key`], so that a leaked one is recognisable.
pub const KEY_PREFIX: &str = "tg_";

/// A new random key (256 bits from the operating system's generator) for client `id`
/// in `tier`, with its keys-file line; `label` goes into the line when given.
///
/// Errors: the random generator (`/dev/urandom`) could not be read.
pub fn new_key(id: &str, tier: &str, label: Option<&str>) -> std::io::Result<NewKey> {
    use base64::Engine;
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut random = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut random)?;
    let key = format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(random)
    );
    let mut line = serde_json::Map::new();
    line.insert("id".into(), id.into());
    line.insert(
        "key_sha256".into(),
        hex::encode(Sha256::digest(key.as_bytes())).into(),
    );
    line.insert("tier".into(), tier.into());
    if let Some(label) = label {
        line.insert("label".into(), label.into());
    }
    Ok(NewKey {
        key,
        line: serde_json::Value::Object(line).to_string(),
    })
}

/// Append `line` to the keys file at `path` (created if missing), on a line of its own.
///
/// Errors: the file could not be opened, read or written.
pub fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    let len = f.metadata()?.len();
    let mut text = String::with_capacity(line.len() + 2);
    if len > 0 {
        let mut last = [0u8; 1];
        f.seek(SeekFrom::End(-1))?;
        std::io::Read::read_exact(&mut f, &mut last)?;
        if last[0] != b'\n' {
            text.push('\n');
        }
    }
    text.push_str(line);
    text.push('\n');
    f.write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn digest(i: usize) -> [u8; 32] {
        Sha256::digest(format!("key-{i}").as_bytes()).into()
    }

    /// A source of the keys file `text` (in `dir`) and the inline `clients`.
    fn source_of(dir: &tempfile::TempDir, text: &str, inline: Vec<ClientConfig>) -> KeySource {
        let path = dir.path().join("keys.jsonl");
        std::fs::write(&path, text).unwrap();
        KeySource {
            inline,
            file: Some(path),
            limits: None,
            tiers: None,
            by_id: false,
            max_bytes: u64::MAX,
        }
    }

    #[test]
    fn labels_and_expiry_belong_to_their_key_and_a_reload_shares_the_labels() {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::new();
        for i in 0..3000usize {
            let mut line = serde_json::json!({"id": format!("c{}", i / 3), "key_sha256": hex::encode(digest(i))});
            if i % 3 == 0 {
                line["label"] = format!("key {i}").into();
            }
            if i % 5 == 0 {
                line["expires_at"] = (1_000_000 + i).into();
            }
            text.push_str(&format!("{line}\n"));
        }
        let source = source_of(&dir, &text, Vec::new());
        let set = source.build(None).unwrap();
        assert_eq!((set.keys(), set.clients()), (3000, 1000));
        for i in 0..3000usize {
            let expires = 1_000_000 + i as u64;
            let found = set.find(&digest(i), || expires - 1).unwrap();
            assert_eq!(&*found.client.id, format!("c{}", i / 3));
            assert!(found.active);
            assert_eq!(
                found.label.map(|l| &**l),
                (i % 3 == 0).then(|| format!("key {i}")).as_deref()
            );
            let later = set.find(&digest(i), || expires).unwrap();
            assert_eq!(later.active, i % 5 != 0, "key {i}");
        }
        let again = source.build(Some(&set)).unwrap();
        assert_eq!(again.labels.len(), 1000);
        assert!(set
            .labels
            .iter()
            .zip(&again.labels)
            .all(|(a, b)| Arc::ptr_eq(a, b)));
    }

    #[test]
    fn errors_that_name_an_earlier_line_name_it() {
        let dir = tempfile::tempdir().unwrap();
        let line = |id: &str, k: usize, extra: &str| {
            format!(
                "{{\"id\": \"{id}\", \"key_sha256\": \"{}\"{extra}}}\n",
                hex::encode(digest(k))
            )
        };
        let text = [
            line("acme", 1, r#", "tier": "gold", "quotas": {"core": 5}"#),
            line("acme", 2, r#", "quotas": {"core": 6}"#),
            line("acme", 3, r#", "disabled": true"#),
            line("acme", 4, r#", "disabled": false"#),
            line("bob", 1, ""),
            line("bob", 5, r#", "tier": "silver""#),
        ]
        .concat();
        let inline = vec![ClientConfig {
            id: "bob".into(),
            tier: "gold".into(),
            key_sha256: crate::config::KeyHashes::One(hex::encode(digest(6))),
        }];
        let source = source_of(&dir, &text, inline);
        let p = source.file.as_deref().unwrap().display().to_string();
        let lines = source.build(None).unwrap_err().lines();
        assert_eq!(
            lines,
            [
                format!("{p}:2: quotas differ from those given at line 1 for client \"acme\" (give them on one line, or the same on each)"),
                format!("{p}:4: disabled false differs from true given at line 3 for client \"acme\" (disabling a client disables all its keys; to retire one key, remove it or give it an expires_at)"),
                format!("{p}:6: tier \"silver\" differs from \"gold\" given at identity.clients[0] for client \"bob\" (a client has one tier: give it on one line, or the same on each)"),
                format!("{p}:5: the same key is already given at line 1 (a key hash must be unique across identity.clients and identity.clients_file)"),
            ]
        );

        // A repeated key alone (found when the table is made, after the whole file).
        let text = [
            line("acme", 1, ""),
            line("bob", 2, ""),
            line("carol", 1, ""),
        ]
        .concat();
        let lines = source_of(&dir, &text, Vec::new())
            .build(None)
            .unwrap_err()
            .lines();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].ends_with(":3: the same key is already given at line 1 (a key hash must be unique across identity.clients and identity.clients_file)"),
            "{lines:?}"
        );
    }

    #[test]
    fn every_key_is_found_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.jsonl");
        let mut text = String::new();
        for i in 0..5000 {
            text.push_str(&format!(
                "{{\"id\": \"c{}\", \"key_sha256\": \"{}\"}}\n",
                i / 2,
                hex::encode(digest(i))
            ));
        }
        std::fs::write(&path, text).unwrap();
        let source = KeySource {
            inline: Vec::new(),
            file: Some(path),
            limits: None,
            tiers: None,
            by_id: false,
            max_bytes: u64::MAX,
        };
        let set = source.build(None).unwrap();
        // Built again over itself: every client is shared.
        let again = source.build(Some(&set)).unwrap();
        assert!(set
            .clients
            .iter()
            .zip(&again.clients)
            .all(|(a, b)| Arc::ptr_eq(a, b)));
        assert_eq!((set.keys(), set.clients()), (5000, 2500));
        for i in 0..5000 {
            let found = set.find(&digest(i), || 0).unwrap();
            assert_eq!(&*found.client.id, format!("c{}", i / 2));
            assert!(found.active);
        }
        for i in 5000..10000 {
            assert!(set.find(&digest(i), || 0).is_none());
        }
    }
}
