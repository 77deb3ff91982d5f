//! What a [`Model`](super::model::Model) counts over the requests it decides: per limit
//! and tier ([`LimitStats`]), over every request ([`Totals`]), and minute by minute for
//! the plot ([`Series`]).

use std::collections::{BTreeMap, HashMap};

/// The hasher of the replay's maps (foldhash, with a fixed seed).
pub(super) type Fast = foldhash::fast::FixedState;

/// For the plot: per (limit index, caller id), per minute since the epoch.
pub type Series = HashMap<(u16, u32), BTreeMap<u64, Minute>, Fast>;

/// The numbers of one limit for one tier.
#[derive(Debug, Default)]
pub struct LimitStats {
    /// Requests this limit applied to.
    pub requests: u64,
    /// Requests it refused (429).
    pub refused: u64,
    /// Requests it would have refused but let through (`mode = "shadow"`,
    /// `enforce_percent`).
    pub shadow_refused: u64,
    /// The most units used in one window (after a charge, or as a refusal found it).
    pub peak_used: u64,
    /// The quota that peak was measured against.
    pub peak_quota: u64,
    /// Requests of a concurrency limit without a logged duration: not replayable.
    pub not_replayable: u64,
    /// Per caller refused: (refusals, first refusal in ms since the epoch).
    pub callers: HashMap<u32, (u64, u64), Fast>,
}

/// Counts over every request, for one config.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Totals {
    /// Requests decided.
    pub requests: u64,
    /// Requests no route matched.
    pub unrouted: u64,
    /// Requests at least one limit applied to.
    pub limited: u64,
    /// Requests refused (429).
    pub refused: u64,
    /// Requests only shadowed limits would have refused.
    pub shadow_refused: u64,
    /// Requests of a caller id this config does not know and whose tier was not
    /// logged: judged under the anonymous tier.
    pub unknown_callers: u64,
    /// Requests counted by their caller under a `by = "header:NAME"` limit (header
    /// values are not in access logs).
    pub header_as_caller: u64,
}

/// Per minute, for the plot: the most units used in the window, its quota, and the
/// refusals.
#[derive(Debug, Default, Clone, Copy)]
pub struct Minute {
    /// The most units used in the window during this minute.
    pub used: u64,
    /// The quota.
    pub quota: u64,
    /// Requests refused in this minute.
    pub refused: u64,
}
