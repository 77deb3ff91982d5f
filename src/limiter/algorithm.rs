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
}

impl OpKind {
    /// The number `lua/apply.lua` knows the operation by.
    pub fn code(self) -> u64 {
        match self {
            OpKind::Peek => 0,
            OpKind::Charge => 1,
            OpKind::Reserve => 2,
            OpKind::Refund => 3,
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
    /// What a refund must quote to undo this charge or reservation: the fixed window's
    /// end, the sliding window's start, the log entry's or slot's id (GCRA: 0); 0 when
    /// not admitted (a refusal is never refunded).
    pub epoch: u64,
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
        }
    }
}

/// Apply `op` to `state` under `policy` at `now_ms`: the reference rules. Returns the
/// verdict; `state` is updated in place (never for [`OpKind::Peek`]).
pub fn apply(policy: &Policy, state: &mut State, op: Op, now_ms: u64) -> Verdict {
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

fn fixed_window(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
    let (used, reset_at) = match *state {
        State::Fixed { used, reset_at } if reset_at > now => (used, reset_at),
        _ => (0, p.new_window_end(now)),
    };
    let admitted = used.saturating_add(op.cost) <= p.quota;
    let verdict = |admitted: bool, used: u64| Verdict {
        admitted,
        used,
        reset_at_ms: reset_at,
        retry_at_ms: if admitted { 0 } else { reset_at },
        epoch: reset_at,
    };
    match op.kind {
        OpKind::Peek => verdict(admitted, used),
        OpKind::Reserve if !admitted => verdict(false, used),
        OpKind::Charge | OpKind::Reserve => {
            let used = used.saturating_add(op.cost);
            *state = State::Fixed { used, reset_at };
            verdict(admitted, used)
        }
        OpKind::Refund => match state {
            State::Fixed {
                used: stored,
                reset_at: stored_reset,
            } if *stored_reset > now && *stored_reset == op.id => {
                *stored = stored.saturating_sub(op.cost);
                verdict(true, *stored)
            }
            _ => verdict(true, used),
        },
    }
}

/// The sliding window's counters rolled forward to `now`: (aligned start, prev, cur).
fn sliding_roll(p: &Policy, state: &State, now: u64) -> (u64, u64, u64) {
    let w = p.window_ms;
    let start = now / w * w;
    match *state {
        State::Sliding {
            start: s,
            prev,
            cur,
        } if s == start => (start, prev, cur),
        State::Sliding { start: s, cur, .. } if s + w == start => (start, cur, 0),
        _ => (start, 0, 0),
    }
}

/// The sliding window's estimate of units used at `now`: the previous window weighted
/// by its overlap with the sliding window, plus the current one. Computed in f64 in
/// exactly this order in `lua/apply.lua` too, so both stores round alike.
fn sliding_estimate(w: u64, start: u64, prev: u64, cur: u64, now: u64) -> f64 {
    let elapsed = now - start;
    (prev as f64) * ((w - elapsed) as f64) / (w as f64) + (cur as f64)
}

fn sliding_window(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
    let w = p.window_ms;
    let (start, prev, cur) = sliding_roll(p, state, now);
    let estimate = sliding_estimate(w, start, prev, cur, now);
    let q = p.quota as f64;
    let admitted = estimate + (op.cost as f64) <= q;
    let reset_of = |prev: u64, cur: u64| {
        if cur > 0 {
            start + 2 * w
        } else if prev > 0 {
            start + w
        } else {
            now
        }
    };
    let retry = |prev: u64, cur: u64| -> u64 {
        let c = op.cost as f64;
        if op.cost > p.quota {
            return reset_of(prev, cur);
        }
        let room = q - c - (cur as f64);
        if room >= 0.0 && prev > 0 {
            // Within this window: prev * (start + w - t) / w <= room.
            let t = ((start + w) as f64 - room * (w as f64) / (prev as f64)).ceil();
            return (t as u64).max(now);
        }
        if cur == 0 {
            return now;
        }
        // In the next window: cur * (start + 2w - t) / w <= q - c.
        let t = ((start + 2 * w) as f64 - (q - c) * (w as f64) / (cur as f64)).ceil();
        (t as u64).max(now)
    };
    let verdict = |admitted: bool, prev: u64, cur: u64| {
        let e = sliding_estimate(w, start, prev, cur, now);
        Verdict {
            admitted,
            used: e.ceil() as u64,
            reset_at_ms: reset_of(prev, cur),
            retry_at_ms: if admitted { 0 } else { retry(prev, cur) },
            epoch: start,
        }
    };
    match op.kind {
        OpKind::Peek => verdict(admitted, prev, cur),
        OpKind::Reserve if !admitted => verdict(false, prev, cur),
        OpKind::Charge | OpKind::Reserve => {
            let cur = cur.saturating_add(op.cost);
            *state = State::Sliding { start, prev, cur };
            // Charged past the limit: the whole limit is back at the reset.
            let reset_at_ms = reset_of(prev, cur);
            Verdict {
                admitted,
                retry_at_ms: if admitted { 0 } else { reset_at_ms },
                ..verdict(true, prev, cur)
            }
        }
        OpKind::Refund => {
            let (prev, cur) = if op.id == start {
                (prev, cur.saturating_sub(op.cost))
            } else if op.id + w == start {
                (prev.saturating_sub(op.cost), cur)
            } else {
                return verdict(true, prev, cur);
            };
            if matches!(state, State::Sliding { .. }) {
                *state = State::Sliding { start, prev, cur };
            }
            verdict(true, prev, cur)
        }
    }
}

fn sliding_log(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
    let w = p.window_ms;
    // Entries count while their time is within (now - w, now]. The log is kept oldest
    // first, so the entries that count are the ones from `live` on, and the newest is
    // the last.
    let was_log = matches!(state, State::Log(_));
    let mut log = match state {
        State::Log(log) => std::mem::take(log),
        _ => VecDeque::new(),
    };
    let live = log.partition_point(|e| e.0 + w <= now);
    let used: u64 = log.range(live..).map(|e| e.1).sum();
    let admitted = used.saturating_add(op.cost) <= p.quota;
    let reset_of = |log: &VecDeque<(u64, u64, u64)>, from: usize| {
        log.range(from..).next_back().map_or(now, |e| e.0 + w)
    };
    // Read only, or a reservation that does not fit: nothing changes.
    if op.kind == OpKind::Peek || (op.kind == OpKind::Reserve && !admitted) {
        let reset_at_ms = reset_of(&log, live);
        let retry_at_ms = if admitted {
            0
        } else if op.cost > p.quota {
            reset_at_ms
        } else {
            let mut acc = used;
            log.range(live..)
                .find_map(|e| {
                    acc -= e.1;
                    (acc + op.cost <= p.quota).then_some(e.0 + w)
                })
                .unwrap_or(reset_at_ms)
        };
        if was_log {
            *state = State::Log(log);
        }
        return Verdict {
            admitted,
            used,
            reset_at_ms,
            retry_at_ms,
            epoch: 0,
        };
    }
    // A write keeps only the entries that count.
    log.drain(..live);
    match op.kind {
        // Charges and reservations that fit (peeks answered above).
        OpKind::Peek | OpKind::Charge | OpKind::Reserve => {
            let at = log.partition_point(|e| e.0 <= now);
            log.insert(at, (now, op.cost, op.id));
            let used = used.saturating_add(op.cost);
            let reset_at_ms = reset_of(&log, 0);
            *state = State::Log(log);
            Verdict {
                admitted,
                used,
                reset_at_ms,
                retry_at_ms: if admitted { 0 } else { reset_at_ms },
                epoch: op.id,
            }
        }
        OpKind::Refund => {
            if let Some(i) = log.iter().position(|e| e.2 == op.id && e.1 == op.cost) {
                log.remove(i);
            }
            let used: u64 = log.iter().map(|e| e.1).sum();
            let reset_at_ms = reset_of(&log, 0);
            *state = if log.is_empty() {
                State::Empty
            } else {
                State::Log(log)
            };
            Verdict {
                admitted: true,
                used,
                reset_at_ms,
                retry_at_ms: 0,
                epoch: 0,
            }
        }
    }
}

fn gcra(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
    let t = p.emission_ms();
    let cap = p.burst * t;
    let stored = match *state {
        State::Gcra { tat } => tat,
        _ => 0,
    };
    let base = stored.max(now);
    let new_tat = base + op.cost * t;
    let admitted = new_tat - now <= cap;
    let verdict = |admitted: bool, tat: u64| {
        let tat = tat.max(now);
        Verdict {
            admitted,
            used: (tat - now).div_ceil(t),
            reset_at_ms: tat,
            retry_at_ms: if admitted {
                0
            } else {
                new_tat.saturating_sub(cap).max(now)
            },
            epoch: 0,
        }
    };
    match op.kind {
        OpKind::Peek => verdict(admitted, base),
        OpKind::Reserve if !admitted => verdict(false, base),
        OpKind::Charge | OpKind::Reserve => {
            *state = State::Gcra { tat: new_tat };
            verdict(admitted, new_tat)
        }
        OpKind::Refund => {
            if stored <= now {
                return verdict(true, now);
            }
            let tat = stored.saturating_sub(op.cost * t).max(now);
            *state = State::Gcra { tat };
            verdict(true, tat)
        }
    }
}

fn concurrency(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
    let mut slots: Vec<(u64, u64)> = match state {
        State::Slots(s) => s.iter().filter(|s| s.1 > now).copied().collect(),
        _ => Vec::new(),
    };
    let used = slots.len() as u64;
    let admitted = used < p.quota;
    let verdict = |admitted: bool, slots: &[(u64, u64)], epoch: u64| Verdict {
        admitted,
        used: slots.len() as u64,
        reset_at_ms: slots.iter().map(|s| s.1).max().unwrap_or(now),
        retry_at_ms: if admitted {
            0
        } else {
            now + CONCURRENCY_RETRY_MS
        },
        epoch,
    };
    match op.kind {
        // A request in flight is counted by its slot; a charge adds nothing.
        OpKind::Peek | OpKind::Charge => verdict(admitted, &slots, 0),
        OpKind::Reserve if !admitted => verdict(false, &slots, 0),
        OpKind::Reserve => {
            slots.push((op.id, now + p.window_ms));
            let v = verdict(true, &slots, op.id);
            *state = State::Slots(slots);
            v
        }
        OpKind::Refund => {
            slots.retain(|s| s.0 != op.id);
            let v = verdict(true, &slots, 0);
            *state = if slots.is_empty() {
                State::Empty
            } else {
                State::Slots(slots)
            };
            v
        }
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
mod tests {
    use super::*;

    fn op(kind: OpKind, cost: u64, id: u64) -> Op {
        Op { kind, cost, id }
    }

    #[test]
    fn months() {
        // 2026-01-31T12:00Z → 2026-02-01T00:00Z
        assert_eq!(next_month_ms(1_769_860_800_000), 1_769_904_000_000);
        // 2026-12-15 → 2027-01-01
        assert_eq!(next_month_ms(1_797_292_800_000), 1_798_761_600_000);
        // 2024-02-29 → 2024-03-01
        assert_eq!(next_month_ms(1_709_164_800_000), 1_709_251_200_000);
    }

    #[test]
    fn fixed_window_calendar_day() {
        let p = Policy {
            align: Align::Epoch,
            ..Policy::fixed(2, 86_400_000)
        };
        let mut s = State::Empty;
        let v = apply(&p, &mut s, op(OpKind::Charge, 1, 0), 86_400_000 * 3 + 5);
        assert_eq!(v.reset_at_ms, 86_400_000 * 4);
    }

    #[test]
    fn gcra_spaces_requests() {
        let p = Policy {
            algorithm: Algorithm::Gcra,
            burst: 2,
            ..Policy::fixed(10, 10_000)
        };
        let mut s = State::Empty;
        assert!(apply(&p, &mut s, op(OpKind::Reserve, 1, 0), 0).admitted);
        assert!(apply(&p, &mut s, op(OpKind::Reserve, 1, 0), 0).admitted);
        let refused = apply(&p, &mut s, op(OpKind::Reserve, 1, 0), 0);
        assert!(!refused.admitted);
        assert_eq!(refused.retry_at_ms, 1_000);
        assert_eq!(refused.used, 2);
        assert_eq!(refused.reset_at_ms, 2_000);
        assert!(apply(&p, &mut s, op(OpKind::Reserve, 1, 0), 1_000).admitted);
    }

    #[test]
    fn sliding_window_weighs_the_previous_window() {
        let p = Policy {
            algorithm: Algorithm::SlidingWindow,
            ..Policy::fixed(10, 1_000)
        };
        let mut s = State::Empty;
        apply(&p, &mut s, op(OpKind::Charge, 10, 0), 500);
        // At 1250 the previous window (10) weighs 0.75: 7.5 used.
        let v = apply(&p, &mut s, op(OpKind::Peek, 3, 0), 1_250);
        assert!(!v.admitted);
        assert_eq!(v.used, 8);
        // 10 * (2000 - t) / 1000 <= 7  → t >= 1300
        assert_eq!(v.retry_at_ms, 1_300);
        assert!(apply(&p, &mut s, op(OpKind::Peek, 3, 0), 1_300).admitted);
    }

    #[test]
    fn sliding_log_is_exact() {
        let p = Policy {
            algorithm: Algorithm::SlidingLog,
            ..Policy::fixed(2, 1_000)
        };
        let mut s = State::Empty;
        apply(&p, &mut s, op(OpKind::Charge, 1, 1), 100);
        apply(&p, &mut s, op(OpKind::Charge, 1, 2), 600);
        let v = apply(&p, &mut s, op(OpKind::Reserve, 1, 3), 900);
        assert!(!v.admitted);
        assert_eq!(v.retry_at_ms, 1_100);
        assert!(apply(&p, &mut s, op(OpKind::Reserve, 1, 3), 1_100).admitted);
        let r = apply(&p, &mut s, op(OpKind::Refund, 1, 3), 1_200);
        assert_eq!(r.used, 1);
    }

    #[test]
    fn concurrency_slots_expire() {
        let p = Policy {
            algorithm: Algorithm::Concurrency,
            ..Policy::fixed(1, 5_000)
        };
        let mut s = State::Empty;
        assert!(apply(&p, &mut s, op(OpKind::Reserve, 1, 7), 0).admitted);
        assert!(!apply(&p, &mut s, op(OpKind::Reserve, 1, 8), 10).admitted);
        // A crashed gateway's slot frees itself after the window.
        assert!(apply(&p, &mut s, op(OpKind::Reserve, 1, 8), 5_000).admitted);
        apply(&p, &mut s, op(OpKind::Refund, 1, 8), 5_001);
        assert!(apply(&p, &mut s, op(OpKind::Peek, 1, 0), 5_002).admitted);
    }
}
