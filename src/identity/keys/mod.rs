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

mod builder;
mod cli;
mod errors;
mod parse;
mod source;
mod table;
#[cfg(test)]
mod tests;

pub use cli::{append_line, new_key, NewKey, KEY_PREFIX};
pub use errors::{KeyErrors, KeyProblem};
pub use parse::MAX_LINE;
pub use source::KeySource;
pub use table::{held, Found, KeySet, ALWAYS_REMOVABLE};

pub(super) use table::Quotas;
