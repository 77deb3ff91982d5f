//! Building a key set from its source: the inline entries, then the keys file read
//! under its size cap, each line under [`MAX_LINE`], parsed as JSON, checked, and
//! handed to the builder as a key of a client.

use super::builder::{parse_sha256, Builder, Origin, CONFIG};
use super::errors::KeyErrors;
use super::source::KeySource;
use super::table::{fingerprint, KeySet};
use crate::identity::records::Records;
use crate::lines::Capped;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::BufRead;

/// The longest line of the keys file, in bytes (a key line is about 100): a longer one
/// is an error, and is never held in memory whole.
pub const MAX_LINE: usize = 64 * 1024;

impl KeySource {
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

impl Builder<'_> {
    /// Read every line of the keys file from `r`, until its end, a read error, or a
    /// problem that makes this build start again tracking origins.
    pub(super) fn read(&mut self, r: &mut impl BufRead) {
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

    /// Check line `n` and add its key.
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
}
