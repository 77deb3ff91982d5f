//! The limit algorithms as pure functions: the reference model.
//!
//! Each algorithm is one function from (policy, stored state, operation, now) to a new
//! state and a [`Verdict`]. The memory store runs these functions; `lua/apply.lua` is
//! the same rules for Redis, and the store-contract tests replay random timelines
//! against both and require identical verdicts. Times are milliseconds since the Unix
//! epoch; the gateway's clock supplies `now`.
//!
//! - [`Algorithm::FixedWindow`]: GitHub's window (a window starts at the first charge,
//!   or at a calendar boundary with `align = "calendar"`, and ends at a stored
//!   `reset_at`).
//! - [`Algorithm::SlidingWindow`]: the two-counter estimate (Cloudflare's "counting
//!   things" post): windows aligned on multiples of the window length; the previous
//!   window counts in proportion to its overlap with the sliding window.
//! - [`Algorithm::SlidingLog`]: one entry per charge with its time and cost (the
//!   sliding-log seed, on a sorted set); exact.
//! - [`Algorithm::Gcra`]: the generic cell rate algorithm with one stored theoretical
//!   arrival time (TAT), as in Ramp's write-up; emission interval `ceil(window/quota)` ms.
//! - [`Algorithm::Concurrency`]: at most `quota` requests in flight; each holds a slot
//!   (a lease that expires after `window`) until its response ends.
//!
//! A policy with [`Policy::block_ms`] (`[[limits]].block_for`) adds one rule on top of
//! every algorithm ([`block`]): an [`OpKind::Block`] that the window refuses starts a
//! block (its end stored with the state, [`State::Blocked`]), and until that end every
//! peek and reservation is refused, whatever the window says.

mod block;
mod rules;

use rules::{concurrency, fixed_window, gcra, sliding_log, sliding_window};
use std::collections::VecDeque;

pub use crate::config::Algorithm;

impl Algorithm {
    /// The name used in config and docs.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::Gcra => "gcra",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// The number `lua/apply.lua` knows the algorithm by.
    pub fn code(self) -> u64 {
        match self {
            Algorithm::FixedWindow => 0,
            Algorithm::SlidingWindow => 1,
            Algorithm::SlidingLog => 2,
            Algorithm::Gcra => 3,
            Algorithm::Concurrency => 4,
        }
    }
}

/// Where a fixed window starts (`[[limits]].align`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Align {
    /// At the caller's first charge (default, `align = "first_request"`).
    #[default]
    FirstRequest,
    /// At multiples of the window since the Unix epoch: UTC hour / day boundaries for
    /// `"1h"` / `"1d"` (`align = "calendar"`).
    Epoch,
    /// At the first instant of a UTC month (`align = "calendar"` with `window = "1mo"`).
    Month,
}

impl Align {
    /// The number `lua/apply.lua` knows the alignment by.
    pub fn code(self) -> u64 {
        match self {
            Align::FirstRequest => 0,
            Align::Epoch => 1,
            Align::Month => 2,
        }
    }
}

/// What a limit allows: the inputs every algorithm takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Policy {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Units per window (requests in flight for concurrency), >= 1.
    pub quota: u64,
    /// Window length, milliseconds (>= 1000). For concurrency: how long a slot is held
    /// at most before it expires by itself.
    pub window_ms: u64,
    /// GCRA bucket size in units (>= 1); equal to `quota` unless configured.
    pub burst: u64,
    /// Where fixed windows start.
    pub align: Align,
    /// `block_for`, milliseconds: how long a caller stays refused once a
    /// [`OpKind::Block`] found it over the limit; 0 for no block (a stored block is then
    /// not read).
    pub block_ms: u64,
}

impl Policy {
    /// A fixed-window policy starting at the first charge, burst = quota.
    pub fn fixed(quota: u64, window_ms: u64) -> Self {
        Self {
            algorithm: Algorithm::FixedWindow,
            quota,
            window_ms,
            burst: quota,
            align: Align::FirstRequest,
            block_ms: 0,
        }
    }

    /// What `X-RateLimit-Limit` reports: the burst for GCRA, else the quota.
    pub fn limit(&self) -> u64 {
        match self.algorithm {
            Algorithm::Gcra => self.burst,
            _ => self.quota,
        }
    }

    /// GCRA's emission interval: milliseconds per unit, rounded up, at least 1.
    pub fn emission_ms(&self) -> u64 {
        self.window_ms.div_ceil(self.quota.max(1)).max(1)
    }

    /// The end of the fixed window that a charge at `now_ms` would start.
    pub fn new_window_end(&self, now_ms: u64) -> u64 {
        match self.align {
            Align::FirstRequest => now_ms + self.window_ms,
            Align::Epoch => (now_ms / self.window_ms + 1) * self.window_ms,
            Align::Month => next_month_ms(now_ms),
        }
    }
}

/// What is done to a limit's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// Read only: would `cost` be admitted now? (A CHECK; may run on a replica.)
    Peek,
    /// Add `cost` whatever the state (after the response: the request was served).
    Charge,
    /// Add `cost` only if it is admitted (check and add in one step); concurrency:
    /// take a slot.
    Reserve,
    /// Take back `cost` added by a charge or reservation whose [`Verdict::epoch`] was
    /// `id`; concurrency: give the slot `id` back.
    Refund,
    /// After a refusal, on the primary (`block_for` limits only): if `cost` is refused
    /// now, by the window or an existing block, the caller stays refused until a block's
    /// end; a refusal of the window starts a block of [`Policy::block_ms`]. Admitted:
    /// answers as a peek and writes nothing.
    Block,
}

impl OpKind {
    /// The number `lua/apply.lua` knows the operation by.
    pub fn code(self) -> u64 {
        match self {
            OpKind::Peek => 0,
            OpKind::Charge => 1,
            OpKind::Reserve => 2,
            OpKind::Refund => 3,
            OpKind::Block => 4,
        }
    }
}

/// One operation on one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    /// What to do.
    pub kind: OpKind,
    /// Units (ignored by concurrency: a request is one slot).
    pub cost: u64,
    /// Charges and reservations: a process-unique id for the sliding log's entry and
    /// the concurrency slot. Refunds: the epoch the charge reported.
    pub id: u64,
}

/// The algorithm-neutral answer of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Peek / reserve: `cost` is (was) admitted. Charge: it fit within the limit.
    pub admitted: bool,
    /// Units counted against the limit after the operation; may exceed the limit
    /// after unconditional charges (`X-RateLimit-Used`; Remaining is `limit - used`).
    pub used: u64,
    /// When the caller has its whole limit again, ms since the epoch (`X-RateLimit-Reset`).
    pub reset_at_ms: u64,
    /// When `cost` would be admitted, ms since the epoch (`Retry-After`); 0 when admitted.
    pub retry_at_ms: u64,
    /// When the caller next has one unit more than now (`RateLimit`'s `t`), ms since
    /// the epoch: when a cost of `remaining + 1` would be admitted; `now` when nothing
    /// is counted. The fixed window's end; for GCRA the TAT less the units still
    /// counted after one is regained; for the sliding window the instant the estimate
    /// drops by one unit; for the sliding log the expiry of the oldest entries that
    /// free one unit; for concurrency the last slot's expiry (the reset: a slot is
    /// given back when its response ends, which no store knows in advance).
    pub more_at_ms: u64,
    /// What a refund must quote to undo this charge or reservation: the fixed window's
    /// end, the sliding window's start, the log entry's or slot's id (GCRA: 0); 0 when
    /// not admitted (a refusal is never refunded).
    pub epoch: u64,
    /// Refused by a `block_for` block: `reset_at_ms` and `retry_at_ms` are its end.
    pub blocked: bool,
    /// This operation (an [`OpKind::Block`]) started the block.
    pub block_started: bool,
}

/// How long a concurrency refusal asks the caller to wait: one second.
pub const CONCURRENCY_RETRY_MS: u64 = 1_000;

/// A limit's state as the memory store keeps it (Redis keeps the same fields).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Nothing stored.
    Empty,
    /// Fixed window: units used and the window's end.
    Fixed {
        /// Units charged in the window.
        used: u64,
        /// End of the window, ms since the epoch.
        reset_at: u64,
    },
    /// Sliding window: the current aligned window's start and the two counters.
    Sliding {
        /// Start of the current window, ms since the epoch (a multiple of the window).
        start: u64,
        /// Units charged in the window before it.
        prev: u64,
        /// Units charged in this window.
        cur: u64,
    },
    /// Sliding log: (time ms, cost, id) per charge, oldest first.
    Log(VecDeque<(u64, u64, u64)>),
    /// GCRA: the theoretical arrival time, ms since the epoch.
    Gcra {
        /// TAT.
        tat: u64,
    },
    /// Concurrency: (slot id, expiry ms) per request in flight.
    Slots(Vec<(u64, u64)>),
    /// A `block_for` block over the algorithm's state: the caller is refused until
    /// `until` (ms since the epoch). Kept only while the block is on.
    Blocked {
        /// The block's end, ms since the epoch.
        until: u64,
        /// The algorithm's state under the block.
        inner: Box<State>,
    },
}

impl State {
    /// When this state can be dropped because it no longer counts, ms since the epoch.
    pub fn expires_at(&self, window_ms: u64) -> u64 {
        match self {
            State::Empty => 0,
            State::Fixed { reset_at, .. } => *reset_at,
            State::Sliding { start, .. } => start + 2 * window_ms,
            // Oldest first: the newest entry is the last.
            State::Log(log) => log.back().map_or(0, |e| e.0) + window_ms,
            State::Gcra { tat } => *tat,
            State::Slots(slots) => slots.iter().map(|s| s.1).max().unwrap_or(0),
            State::Blocked { until, inner } => inner.expires_at(window_ms).max(*until),
        }
    }
}

/// Apply `op` to `state` under `policy` at `now_ms`: the reference rules. Returns the
/// verdict; `state` is updated in place (never for [`OpKind::Peek`]).
pub fn apply(policy: &Policy, state: &mut State, op: Op, now_ms: u64) -> Verdict {
    if policy.block_ms > 0 || matches!(state, State::Blocked { .. }) {
        return block::apply_blocking(policy, state, op, now_ms);
    }
    apply_window(policy, state, op, now_ms)
}

/// [`apply`] without the `block_for` rule: the algorithm alone. [`OpKind::Block`] is a
/// peek here.
fn apply_window(policy: &Policy, state: &mut State, op: Op, now_ms: u64) -> Verdict {
    let op = match op.kind {
        OpKind::Block => Op {
            kind: OpKind::Peek,
            ..op
        },
        _ => op,
    };
    let v = match policy.algorithm {
        Algorithm::FixedWindow => fixed_window(policy, state, op, now_ms),
        Algorithm::SlidingWindow => sliding_window(policy, state, op, now_ms),
        Algorithm::SlidingLog => sliding_log(policy, state, op, now_ms),
        Algorithm::Gcra => gcra(policy, state, op, now_ms),
        Algorithm::Concurrency => concurrency(policy, state, op, now_ms),
    };
    // A refusal took nothing a refund could quote (`lua/apply.lua` answers the same).
    if v.admitted {
        v
    } else {
        Verdict { epoch: 0, ..v }
    }
}

/// The first instant of the UTC month after the one holding `now_ms`, ms since the epoch.
pub fn next_month_ms(now_ms: u64) -> u64 {
    let days = (now_ms / 86_400_000) as i64;
    let (y, m, _) = civil_from_days(days);
    let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    days_from_civil(y, m, 1) as u64 * 86_400_000
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian.
/// Howard Hinnant, "chrono-Compatible Low-Level Date Algorithms".
pub(crate) fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month, day) → days since 1970-01-01 (inverse of [`civil_from_days`]).
pub(crate) fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests;
