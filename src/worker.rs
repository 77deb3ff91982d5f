//! Which `per_core` worker thread the current thread is, if any.
//!
//! With `server.runtime = "per_core"` the gateway serves its proxy listener from
//! `server.workers` single-threaded runtimes, one per OS thread (`server::runtime`).
//! What a request needs per thread is kept per worker and found through [`current`]:
//! the upstream connection pools' parts ([`slot`]) and the Redis store's per-worker
//! batchers and connections. This module imports nothing of the crate, so that the
//! store, the pool and the snapshot can read the worker identity without depending on
//! the server.

use std::cell::Cell;

thread_local! {
    /// On a `per_core` worker thread: (its index, how many workers its gateway has).
    static WORKER: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

/// On a `per_core` worker thread, `(index, count)`: which of its gateway's `count`
/// workers this thread is (`index < count`). `None` on any other thread (the
/// `multi_thread` runtime's, the admin runtime's, a test's).
#[inline]
pub fn current() -> Option<(usize, usize)> {
    WORKER.with(Cell::get)
}

/// Make this thread worker `index` of `count`: called once by each worker thread as it
/// starts, before it serves anything.
pub(crate) fn enter(index: usize, count: usize) {
    WORKER.with(|w| w.set(Some((index, count))));
}

/// Make this thread count as worker `index` of `count` (tests of what is kept or done
/// per worker, on threads of their own).
#[cfg(test)]
pub(crate) fn pretend(index: usize, count: usize) {
    enter(index, count);
}

/// The slot of this thread among `len` per-worker parts: its worker index on a
/// `per_core` worker thread (when `len` has room for it), else 0.
#[inline]
pub fn slot(len: usize) -> usize {
    match current() {
        Some((i, _)) if i < len => i,
        _ => 0,
    }
}

/// How many workers a `per_core` gateway runs: `configured` (`server.workers`) when it
/// is set and not 0, else one per CPU the process may use (at least 1).
pub fn count(configured: Option<usize>) -> usize {
    configured.filter(|n| *n > 0).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    })
}

/// How many per-worker parts (upstream sub-pools) a gateway needs: one per worker
/// ([`count`] of `configured`) when it runs `per_core`, else one.
pub fn parts(per_core: bool, configured: Option<usize>) -> usize {
    if per_core {
        count(configured)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_is_no_worker_until_it_enters() {
        std::thread::spawn(|| {
            assert_eq!(current(), None);
            assert_eq!(slot(4), 0);
            enter(2, 3);
            assert_eq!(current(), Some((2, 3)));
            assert_eq!(slot(4), 2);
            // A part count without room for this worker: the first part.
            assert_eq!(slot(2), 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn parts_are_one_per_worker_only_per_core() {
        assert_eq!(parts(false, Some(8)), 1);
        assert_eq!(parts(true, Some(8)), 8);
        assert!(parts(true, None) >= 1);
        assert_eq!(count(Some(0)), count(None));
    }
}
