//! The rules of each algorithm: one function per algorithm from (policy, stored state,
//! operation, now) to a [`Verdict`], the state updated in place (see [`super::apply`],
//! which picks one).

use super::*;

pub(super) fn fixed_window(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
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
        more_at_ms: if used > 0 { reset_at } else { now },
        ..Verdict::default()
    };
    match op.kind {
        OpKind::Peek | OpKind::Block => verdict(admitted, used),
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

pub(super) fn sliding_window(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
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
    // When a cost of `cost` fits: `Retry-After`, and with `remaining + 1`, `more_at`.
    let retry = |prev: u64, cur: u64, cost: u64| -> u64 {
        let c = cost as f64;
        if cost > p.quota {
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
        let used = e.ceil() as u64;
        Verdict {
            admitted,
            used,
            reset_at_ms: reset_of(prev, cur),
            retry_at_ms: if admitted {
                0
            } else {
                retry(prev, cur, op.cost)
            },
            epoch: start,
            more_at_ms: if used == 0 {
                now
            } else {
                retry(prev, cur, p.quota - used.min(p.quota) + 1)
            },
            ..Verdict::default()
        }
    };
    match op.kind {
        OpKind::Peek | OpKind::Block => verdict(admitted, prev, cur),
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

pub(super) fn sliding_log(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
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
    // When the oldest entries have freed one unit (`used` counted from `from` on).
    let more_of = |log: &VecDeque<(u64, u64, u64)>, from: usize, used: u64| {
        if used == 0 {
            return now;
        }
        let below = used.min(p.quota) - 1;
        let mut acc = used;
        log.range(from..)
            .find_map(|e| {
                acc = acc.saturating_sub(e.1);
                (acc <= below).then_some(e.0 + w)
            })
            .unwrap_or_else(|| reset_of(log, from))
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
        let more_at_ms = more_of(&log, live, used);
        if was_log {
            *state = State::Log(log);
        }
        return Verdict {
            admitted,
            used,
            reset_at_ms,
            retry_at_ms,
            epoch: 0,
            more_at_ms,
            ..Verdict::default()
        };
    }
    // A write keeps only the entries that count.
    log.drain(..live);
    match op.kind {
        // Charges and reservations that fit (peeks answered above).
        OpKind::Peek | OpKind::Block | OpKind::Charge | OpKind::Reserve => {
            let at = log.partition_point(|e| e.0 <= now);
            log.insert(at, (now, op.cost, op.id));
            let used = used.saturating_add(op.cost);
            let reset_at_ms = reset_of(&log, 0);
            let more_at_ms = more_of(&log, 0, used);
            *state = State::Log(log);
            Verdict {
                admitted,
                used,
                reset_at_ms,
                retry_at_ms: if admitted { 0 } else { reset_at_ms },
                epoch: op.id,
                more_at_ms,
                ..Verdict::default()
            }
        }
        OpKind::Refund => {
            // The entry the charge or reservation made gives back up to `cost` units
            // (part of them when a reservation is settled to a smaller cost); an
            // entry left with nothing is removed.
            if let Some(i) = log.iter().position(|e| e.2 == op.id) {
                log[i].1 = log[i].1.saturating_sub(op.cost);
                if log[i].1 == 0 {
                    log.remove(i);
                }
            }
            let used: u64 = log.iter().map(|e| e.1).sum();
            let reset_at_ms = reset_of(&log, 0);
            let more_at_ms = more_of(&log, 0, used);
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
                more_at_ms,
                ..Verdict::default()
            }
        }
    }
}

pub(super) fn gcra(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
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
        let used = (tat - now).div_ceil(t);
        Verdict {
            admitted,
            used,
            reset_at_ms: tat,
            retry_at_ms: if admitted {
                0
            } else {
                new_tat.saturating_sub(cap).max(now)
            },
            epoch: 0,
            // The TAT less the units still counted once one is regained (past the
            // burst after a charge: once the burst less one is).
            more_at_ms: if used == 0 {
                now
            } else {
                tat.saturating_sub((used.min(p.burst) - 1) * t).max(now)
            },
            ..Verdict::default()
        }
    };
    match op.kind {
        OpKind::Peek | OpKind::Block => verdict(admitted, base),
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

pub(super) fn concurrency(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
    let mut slots: Vec<(u64, u64)> = match state {
        State::Slots(s) => s.iter().filter(|s| s.1 > now).copied().collect(),
        _ => Vec::new(),
    };
    let used = slots.len() as u64;
    let admitted = used < p.quota;
    let verdict = |admitted: bool, slots: &[(u64, u64)], epoch: u64| {
        let reset_at_ms = slots.iter().map(|s| s.1).max().unwrap_or(now);
        Verdict {
            admitted,
            used: slots.len() as u64,
            reset_at_ms,
            retry_at_ms: if admitted {
                0
            } else {
                now + CONCURRENCY_RETRY_MS
            },
            epoch,
            more_at_ms: reset_at_ms,
            ..Verdict::default()
        }
    };
    match op.kind {
        // A request in flight is counted by its slot; a charge adds nothing.
        OpKind::Peek | OpKind::Block | OpKind::Charge => verdict(admitted, &slots, 0),
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
