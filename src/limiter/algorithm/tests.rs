//! Unit tests of the reference model.

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
    // A reservation settled to a smaller cost: part of its entry goes back, at its time.
    let mut s = State::Empty;
    let p = Policy { quota: 20, ..p };
    apply(&p, &mut s, op(OpKind::Reserve, 10, 5), 100);
    assert_eq!(apply(&p, &mut s, op(OpKind::Refund, 7, 5), 200).used, 3);
    assert_eq!(apply(&p, &mut s, op(OpKind::Peek, 1, 0), 1_099).used, 3);
    assert_eq!(apply(&p, &mut s, op(OpKind::Peek, 1, 0), 1_100).used, 0);
    assert_eq!(apply(&p, &mut s, op(OpKind::Refund, 7, 5), 300).used, 0);
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

/// `block_for`: a BLOCK the window refuses starts a block; until its end every peek and
/// reservation is refused with the block's end, even in a new window; a charge is still
/// counted; a refusal during the block does not move its end; then the window rules.
#[test]
fn a_block_outlasts_the_window_and_ends_on_time() {
    let p = Policy {
        block_ms: 5_000,
        ..Policy::fixed(2, 1_000)
    };
    let mut s = State::Empty;
    for t in [0, 1] {
        assert!(apply(&p, &mut s, op(OpKind::Reserve, 1, t + 1), t).admitted);
    }
    let peek = apply(&p, &mut s, op(OpKind::Peek, 1, 0), 10);
    assert!(
        !peek.admitted && !peek.blocked,
        "the window refuses, no block yet"
    );
    let b = apply(&p, &mut s, op(OpKind::Block, 1, 0), 10);
    assert!(b.blocked && b.block_started);
    assert_eq!((b.reset_at_ms, b.retry_at_ms, b.used), (5_010, 5_010, 2));
    assert_eq!(
        b.more_at_ms, 5_010,
        "no unit comes back before the block ends"
    );
    let again = apply(&p, &mut s, op(OpKind::Block, 1, 0), 20);
    assert!(again.blocked && !again.block_started);
    assert_eq!(
        again.reset_at_ms, 5_010,
        "a refusal during the block keeps its end"
    );
    // A new window: the window alone admits, the block refuses.
    let r = apply(&p, &mut s, op(OpKind::Reserve, 1, 9), 2_000);
    assert!(!r.admitted && r.blocked);
    assert_eq!(
        (r.retry_at_ms, r.used),
        (5_010, 2),
        "Remaining 0 while blocked"
    );
    let c = apply(&p, &mut s, op(OpKind::Charge, 1, 10), 2_000);
    assert!(
        !c.admitted && c.blocked,
        "a charge is counted and answered blocked"
    );
    assert_eq!(
        s.expires_at(p.window_ms),
        5_010,
        "kept until the block's end"
    );
    let after = apply(&p, &mut s, op(OpKind::Reserve, 1, 11), 5_010);
    assert!(after.admitted && !after.blocked, "the block is over");
    assert!(matches!(s, State::Fixed { .. }), "and no longer stored");
    // A BLOCK the window admits writes nothing.
    let mut fresh = State::Empty;
    assert!(apply(&p, &mut fresh, op(OpKind::Block, 1, 0), 0).admitted);
    assert_eq!(fresh, State::Empty);
}

#[test]
fn more_at_is_when_one_more_unit_is_back() {
    // Fixed window: the window's end; nothing used: now.
    let p = Policy::fixed(10, 60_000);
    let mut s = State::Empty;
    assert_eq!(apply(&p, &mut s, op(OpKind::Peek, 1, 0), 5).more_at_ms, 5);
    let v = apply(&p, &mut s, op(OpKind::Charge, 3, 0), 1_000);
    assert_eq!(v.more_at_ms, 61_000);

    // GCRA, 10 per 10 s (T = 1 s), burst 5: three units at 0 → TAT 3 s; one is back
    // at 1 s (TAT less the two still counted).
    let g = Policy {
        algorithm: Algorithm::Gcra,
        burst: 5,
        ..Policy::fixed(10, 10_000)
    };
    let mut s = State::Empty;
    let v = apply(&g, &mut s, op(OpKind::Charge, 3, 0), 0);
    assert_eq!((v.used, v.reset_at_ms, v.more_at_ms), (3, 3_000, 1_000));
    // At 1.2 s: 1.8 s of TAT, 2 counted, the next back at 2 s.
    let v = apply(&g, &mut s, op(OpKind::Peek, 1, 0), 1_200);
    assert_eq!((v.used, v.more_at_ms), (2, 2_000));
    // Charged past the burst (8 counted): remaining grows once 4 are counted, at 4 s.
    let mut s = State::Empty;
    let v = apply(&g, &mut s, op(OpKind::Charge, 8, 0), 0);
    assert_eq!((v.used, v.reset_at_ms, v.more_at_ms), (8, 8_000, 4_000));
    // A refusal: Retry-After is never earlier than more_at.
    let mut s = State::Empty;
    apply(&g, &mut s, op(OpKind::Charge, 5, 0), 0);
    let v = apply(&g, &mut s, op(OpKind::Reserve, 1, 0), 0);
    assert!(!v.admitted);
    assert_eq!((v.retry_at_ms, v.more_at_ms), (1_000, 1_000));

    // Sliding window, 10 per 1 s: 10 in the window before; at 1 250 the estimate is
    // 7.5 (8 counted); 7 counted once 10 * (2000 - t) / 1000 <= 7, at 1 300.
    let sw = Policy {
        algorithm: Algorithm::SlidingWindow,
        ..Policy::fixed(10, 1_000)
    };
    let mut s = State::Empty;
    apply(&sw, &mut s, op(OpKind::Charge, 10, 0), 500);
    let v = apply(&sw, &mut s, op(OpKind::Peek, 1, 0), 1_250);
    assert_eq!((v.used, v.more_at_ms), (8, 1_300));
    // With 4 in this window too: 11.5 → 12 counted (over); remaining grows when the
    // estimate is 9: 10 * (2000 - t) / 1000 + 4 <= 9 → t >= 1 500.
    let v = apply(&sw, &mut s, op(OpKind::Charge, 4, 0), 1_250);
    assert_eq!((v.used, v.more_at_ms), (12, 1_500));
    // Only this window's units: they fade in the next window.
    let mut s = State::Empty;
    let v = apply(&sw, &mut s, op(OpKind::Charge, 4, 0), 100);
    // 4 * (2000 - t) / 1000 <= 3 → t >= 1 250.
    assert_eq!((v.used, v.more_at_ms), (4, 1_250));

    // Sliding log, 3 per 1 s: entries at 0 (2 units) and 400 (1): one unit back when
    // the oldest leaves, at 1 000.
    let sl = Policy {
        algorithm: Algorithm::SlidingLog,
        ..Policy::fixed(3, 1_000)
    };
    let mut s = State::Empty;
    apply(&sl, &mut s, op(OpKind::Charge, 2, 1), 0);
    let v = apply(&sl, &mut s, op(OpKind::Charge, 1, 2), 400);
    assert_eq!((v.used, v.reset_at_ms, v.more_at_ms), (3, 1_400, 1_000));
    let refused = apply(&sl, &mut s, op(OpKind::Reserve, 1, 3), 500);
    assert!(!refused.admitted);
    assert!(refused.retry_at_ms >= refused.more_at_ms);
    assert_eq!(refused.retry_at_ms, 1_000);
}
