//! The global allocator: mimalloc, asked for plain blocks whenever a plain block is
//! aligned enough.
//!
//! The `mimalloc` crate's allocator passes every Rust allocation to
//! `mi_malloc_aligned(size, align)`. mimalloc v3 answers that at once only for blocks up
//! to 1 KiB; a larger one, such as a boxed request future or a hyper buffer, takes the
//! over-allocating aligned path (`mi_theap_malloc_zero_aligned_at_generic`), which was
//! about 1,200 instructions of a proxied request (callgrind, BENCHMARKS.md).
//! A plain `mi_malloc` block is aligned to 16 bytes whenever its size is at least 16
//! (mimalloc's `MI_MAX_ALIGN_SIZE`): its size classes above 8 bytes are multiples of 16
//! and its pages start on 16 bytes, as C's `malloc` promises for `max_align_t`. So, like
//! Rust's own `System` allocator over `malloc`, a layout whose alignment is at most 16
//! gets `mi_malloc`, `mi_zalloc` or `mi_realloc`, asked for its size rounded up to a
//! multiple of that alignment (a block whose size is a multiple of 16 is aligned to 16);
//! any other keeps the aligned call. (The same change is proposed upstream:
//! purpleprotocol/mimalloc_rust pull request 170.) Rounding up matters for hashbrown's
//! tables (alignment 16, sizes that are not multiples of it: every `HashMap`, such as a
//! request's extensions): mimalloc's aligned call answers them at once only when the
//! next free block happens to be aligned, else through its over-allocating path, so their
//! cost moved with the allocator's state by about 100 instructions a request.
//!
//! The only unsafe code of tollgate: `GlobalAlloc` is an unsafe trait, and these calls
//! are FFI.
#![allow(unsafe_code)]

use libmimalloc_sys as mi;
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

/// The largest alignment a plain mimalloc block always has (`MI_MAX_ALIGN_SIZE`), bytes.
const PLAIN_ALIGN: usize = 16;

/// mimalloc as the global allocator (see the module documentation).
#[derive(Debug, Clone, Copy, Default)]
pub struct Mimalloc;

/// The size of the plain block that holds `size` bytes aligned to `align`: `size` rounded
/// up to a multiple of `align`; `None` when no plain block is aligned enough (`align`
/// above [`PLAIN_ALIGN`], or a size that would overflow).
#[inline]
fn plain(size: usize, align: usize) -> Option<usize> {
    if align <= PLAIN_ALIGN {
        size.checked_next_multiple_of(align)
    } else {
        None
    }
}

/// A new block for `layout`: from `plain_call` (`mi_malloc` or `mi_zalloc`) when a plain
/// block is aligned enough, else from `aligned_call` (their `_aligned` forms).
///
/// # Safety
/// `layout` has a non-zero size (GlobalAlloc's contract).
#[inline(always)]
unsafe fn fresh(
    layout: Layout,
    plain_call: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned_call: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    // SAFETY: FFI calls without preconditions beyond a valid size and alignment.
    unsafe {
        match plain(layout.size(), layout.align()) {
            Some(size) => plain_call(size).cast(),
            None => aligned_call(layout.size(), layout.align()).cast(),
        }
    }
}

// SAFETY: every block comes from mimalloc, aligned as `layout` asks (plain blocks only
// when `plain` holds, see the module documentation), and is freed or reallocated by
// mimalloc; `mi_free` and `mi_realloc*` take blocks from either kind of call.
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: FFI calls without preconditions beyond a valid size and alignment.
        unsafe { fresh(layout, mi::mi_malloc, mi::mi_malloc_aligned) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as in `alloc`.
        unsafe { fresh(layout, mi::mi_zalloc, mi::mi_zalloc_aligned) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator (GlobalAlloc's contract).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout` (GlobalAlloc's contract);
        // the new block keeps `layout`'s alignment.
        unsafe {
            match plain(new_size, layout.align()) {
                Some(size) => mi::mi_realloc(ptr.cast::<c_void>(), size).cast(),
                None => {
                    mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, layout.align()).cast()
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_is_aligned_as_its_layout_asks_and_keeps_its_bytes() {
        let a = Mimalloc;
        let mut blocks = Vec::new();
        for align in [1usize, 2, 4, 8, 16, 32, 64, 4096] {
            for size in (1..=5000usize)
                // Every size where plain blocks are used (rounded up), some elsewhere.
                .filter(|&s| {
                    align <= PLAIN_ALIGN
                        || s.is_multiple_of(align)
                        || s < align
                        || s.is_multiple_of(7)
                })
            {
                let layout = Layout::from_size_align(size, align).expect("layout");
                // SAFETY: a non-zero size; the block is freed below with its layout.
                let p = unsafe { a.alloc(layout) };
                assert!(!p.is_null(), "size {size} align {align}");
                assert_eq!(p as usize % align, 0, "size {size} align {align}");
                // SAFETY: the block holds `size` bytes.
                unsafe { p.write_bytes(0xA5, size) };
                blocks.push((p, layout));
            }
        }
        for (p, layout) in blocks {
            // SAFETY: as above; the block is still live and was filled.
            unsafe {
                assert_eq!(*p.add(layout.size() - 1), 0xA5);
                let bigger = layout.size() * 3 + 17;
                let q = a.realloc(p, layout, bigger);
                assert!(!q.is_null());
                assert_eq!(q as usize % layout.align(), 0, "realloc {layout:?}");
                assert_eq!(*q, 0xA5, "realloc keeps the bytes");
                assert_eq!(*q.add(layout.size() - 1), 0xA5);
                a.dealloc(q, Layout::from_size_align_unchecked(bigger, layout.align()));
            }
        }
        for (size, align) in [
            (24, 8),
            (48, 16),
            (148, 16),
            (1000, 16),
            (100_000, 16),
            (64, 64),
        ] {
            let layout = Layout::from_size_align(size, align).expect("layout");
            // SAFETY: as above.
            unsafe {
                let p = a.alloc_zeroed(layout);
                assert_eq!(p as usize % align, 0);
                assert!((0..size).all(|i| *p.add(i) == 0), "zeroed {size}");
                a.dealloc(p, layout);
            }
        }
    }
}
