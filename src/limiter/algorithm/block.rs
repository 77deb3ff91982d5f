//! The `block_for` rule, on top of every algorithm ([`super::apply`] picks it for a
//! policy with [`Policy::block_ms`], or a state that holds a block).
//!
//! - While a block is on (`until > now`), a peek, a reservation and a block are refused
//!   with the block's end as `reset_at`, `retry_at` and `more_at`, and `used` at least the limit
//!   (Remaining 0); the window is read, not changed. A charge is still added to the
//!   window (the request was served) and answered the same way. A refund is the
//!   algorithm's alone.
//! - Otherwise an [`OpKind::Block`] is a peek; if the window refuses it, a block of
//!   `block_ms` starts now.
//! - A policy without `block_ms` (a reload removed `block_for`) no longer reads a block:
//!   the state under it is kept, the block dropped.
//!
//! `lua/apply.lua` keeps the same block as a `block` field of the limit's hash, or a
//! `block` member of its sorted set.

use super::*;

pub(super) fn apply_blocking(p: &Policy, state: &mut State, op: Op, now: u64) -> Verdict {
    let (mut until, mut inner) = match std::mem::replace(state, State::Empty) {
        State::Blocked { until, inner } => (until, *inner),
        other => (0, other),
    };
    if p.block_ms == 0 {
        until = 0;
    }
    let blocked = |v: Verdict, until: u64, started: bool| Verdict {
        admitted: false,
        used: v.used.max(p.limit()),
        reset_at_ms: until,
        retry_at_ms: until,
        epoch: 0,
        more_at_ms: until,
        blocked: true,
        block_started: started,
    };
    let verdict = if until > now && op.kind != OpKind::Refund {
        let kind = match op.kind {
            OpKind::Charge => OpKind::Charge,
            _ => OpKind::Peek,
        };
        let v = apply_window(p, &mut inner, Op { kind, ..op }, now);
        blocked(v, until, false)
    } else if op.kind == OpKind::Block {
        let v = apply_window(p, &mut inner, op, now);
        if v.admitted {
            v
        } else {
            until = now + p.block_ms;
            blocked(v, until, true)
        }
    } else {
        apply_window(p, &mut inner, op, now)
    };
    *state = if until > now {
        State::Blocked {
            until,
            inner: Box::new(inner),
        }
    } else {
        inner
    };
    // A refusal took nothing a refund could quote (as in `apply_window`).
    if verdict.admitted {
        verdict
    } else {
        Verdict {
            epoch: 0,
            ..verdict
        }
    }
}
