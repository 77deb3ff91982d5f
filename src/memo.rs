//! Per-thread memos: the one shape in which the request path remembers, per thread, what
//! it computed last, so that a repeated input costs a comparison instead of a
//! computation, an allocation or a lock (docs/hot-path.md lists each use and what it
//! saves).
//!
//! A [`Memo`] is `N` slots of remembered entries, kept in a `thread_local!` (it is
//! neither `Send` nor `Sync`, and needs no lock):
//!
//! - **direct-mapped** ([`Memo::get`], [`Memo::put`]): an entry lives in the slot its
//!   hash picks (`hash % N`), and replaces whatever was there. `N = 1` is "the last one".
//! - **associative** ([`Memo::find`], [`Memo::push`]): entries fill the slots in order,
//!   then replace the oldest (round robin); a lookup scans the filled slots.
//!
//! Its users: the keyed digest of a caller (`limiter::key`), the limits that apply to a
//! caller (`limiter::applicable`), the rows of the request, rejection and latency
//! metrics (`metrics::rows`), the last 429 rendered (`proxy::refusal`), the last
//! `X-RateLimit-Limit`/`-Reset` values and `X-RateLimit-Resource` (`proxy::headers`),
//! and HTTP/2's `Date` (`wire::h2server`).
//!
//! An entry is only ever used after the caller compared it with the input in full (the
//! hash only picks a slot), so a memo gives exactly what the computation would.
//! Use one memo in one way: mixing the two on one memo is allowed but pointless.

use std::cell::{Cell, RefCell};

/// `N` remembered entries of type `T`, one thread's (see the [module](self)).
#[derive(Debug)]
pub struct Memo<T, const N: usize> {
    slots: RefCell<[Option<T>; N]>,
    /// The slot [`Memo::push`] fills next.
    next: Cell<usize>,
}

impl<T, const N: usize> Default for Memo<T, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, const N: usize> Memo<T, N> {
    /// An empty memo (usable in `thread_local!`'s `const { … }` form).
    pub const fn new() -> Self {
        Self {
            slots: RefCell::new([const { None }; N]),
            next: Cell::new(0),
        }
    }

    /// Direct-mapped lookup: what `hit` makes of the entry in slot `hash % N`, if the
    /// slot holds one and `hit` accepts it (`Some`).
    #[inline]
    pub fn get<R>(&self, hash: u64, hit: impl FnOnce(&T) -> Option<R>) -> Option<R> {
        let slots = self.slots.borrow();
        slots[Self::slot(hash)].as_ref().and_then(hit)
    }

    /// Direct-mapped store: `entry` into slot `hash % N`. The entry it replaces is
    /// returned (dropped by the caller, after the memo's borrow ended).
    #[inline]
    pub fn put(&self, hash: u64, entry: T) -> Option<T> {
        self.slots.borrow_mut()[Self::slot(hash)].replace(entry)
    }

    /// Direct-mapped lookup or store in one borrow: what `read` makes of the entry in
    /// slot `hash % N` when `fits` accepts it, else of a new entry `make` gives, which
    /// replaces the slot's. For memos whose entries drop no state of their caller's.
    #[inline]
    pub fn get_or_put<R>(
        &self,
        hash: u64,
        fits: impl FnOnce(&T) -> bool,
        make: impl FnOnce() -> T,
        read: impl FnOnce(&T) -> R,
    ) -> R {
        let mut slots = self.slots.borrow_mut();
        let slot = &mut slots[Self::slot(hash)];
        match slot {
            Some(entry) if fits(entry) => read(entry),
            _ => read(slot.insert(make())),
        }
    }

    /// The slot `hash % N` itself, for a memo whose entry is updated in place (`None`:
    /// empty).
    #[inline]
    pub fn slot_mut<R>(&self, hash: u64, f: impl FnOnce(&mut Option<T>) -> R) -> R {
        f(&mut self.slots.borrow_mut()[Self::slot(hash)])
    }

    /// Associative lookup: what `hit` makes of the first filled slot it accepts.
    #[inline]
    pub fn find<R>(&self, mut hit: impl FnMut(&T) -> Option<R>) -> Option<R> {
        let slots = self.slots.borrow();
        slots.iter().map_while(Option::as_ref).find_map(&mut hit)
    }

    /// Associative store: `entry` into the next empty slot, or in place of the oldest
    /// once all are filled. The entry it replaces is returned.
    #[inline]
    pub fn push(&self, entry: T) -> Option<T> {
        let i = self.next.get();
        self.next.set(if i + 1 == N { 0 } else { i + 1 });
        self.slots.borrow_mut()[i].replace(entry)
    }

    #[inline]
    fn slot(hash: u64) -> usize {
        // `N` is a small constant: for a power of two this is a mask.
        (hash % N as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::Memo;

    #[test]
    fn direct_mapped_slots_replace_their_own_entry_only() {
        let m: Memo<(u64, &str), 4> = Memo::new();
        assert_eq!(m.get(1, |e| Some(e.1)), None);
        assert_eq!(m.put(1, (1, "one")), None);
        assert_eq!(m.put(2, (2, "two")), None);
        assert_eq!(m.get(1, |e| (e.0 == 1).then_some(e.1)), Some("one"));
        // 5 % 4 == 1: the same slot as 1, which it replaces.
        assert_eq!(m.put(5, (5, "five")), Some((1, "one")));
        assert_eq!(m.get(1, |e| (e.0 == 1).then_some(e.1)), None);
        assert_eq!(m.get(2, |e| (e.0 == 2).then_some(e.1)), Some("two"));
    }

    #[test]
    fn get_or_put_makes_only_on_a_miss() {
        let m: Memo<u64, 1> = Memo::new();
        let mut made = 0;
        for n in [7, 7, 8, 8, 7] {
            let got = m.get_or_put(
                0,
                |e| *e == n,
                || {
                    made += 1;
                    n
                },
                |e| *e,
            );
            assert_eq!(got, n);
        }
        assert_eq!(made, 3);
    }

    #[test]
    fn associative_slots_fill_in_order_then_replace_the_oldest() {
        let m: Memo<u64, 3> = Memo::new();
        for n in 1..=3 {
            assert_eq!(m.push(n), None);
        }
        assert_eq!(m.find(|e| (*e == 2).then_some(*e)), Some(2));
        assert_eq!(m.push(4), Some(1));
        assert_eq!(m.find(|e| (*e == 1).then_some(*e)), None);
        assert_eq!(m.push(5), Some(2));
        let mut seen = Vec::new();
        m.find(|e| {
            seen.push(*e);
            None::<()>
        });
        assert_eq!(seen, [4, 5, 3]);
    }
}
