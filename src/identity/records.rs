//! Vectors of fixed-width records outside the global allocator, in anonymous memory maps.
//!
//! A keys file of a million keys makes tables of tens of MB, and each reload builds new
//! ones while the running set still serves. Memory given back to the global allocator
//! (mimalloc) stays with the process, often for good: the old set is freed by whichever
//! thread drops it last, into pages another thread owns. A map is returned to the
//! system when it is dropped, so after a reload the gateway holds one set of tables,
//! not the high-water mark of two. A map is zeroed when made and its pages never
//! written are not resident, so a table of zeros (empty slots) costs nothing until
//! used. Where no map can be made, the records live on the heap instead.

use memmap2::MmapMut;

/// The bytes of a vector.
enum Buf {
    Map(MmapMut),
    Heap(Box<[u8]>),
}

impl Buf {
    /// `bytes` zero bytes.
    fn zeroed(bytes: usize) -> Self {
        if bytes == 0 {
            return Buf::Heap(Box::default());
        }
        match MmapMut::map_anon(bytes) {
            Ok(m) => Buf::Map(m),
            Err(_) => Buf::Heap(vec![0; bytes].into_boxed_slice()),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Buf::Map(m) => m,
            Buf::Heap(h) => h,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Buf::Map(m) => m,
            Buf::Heap(h) => h,
        }
    }
}

/// A vector of records of `W` bytes each.
pub(super) struct Records<const W: usize> {
    buf: Buf,
    len: usize,
}

impl<const W: usize> std::fmt::Debug for Records<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("width", &W)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl<const W: usize> Default for Records<W> {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl<const W: usize> Records<W> {
    /// An empty vector with room for `n` records (memory is taken as they are written).
    pub(super) fn with_capacity(n: usize) -> Self {
        Self {
            buf: Buf::zeroed(n.saturating_mul(W)),
            len: 0,
        }
    }

    /// `n` records of zeros (a table).
    pub(super) fn zeroed(n: usize) -> Self {
        Self {
            buf: Buf::zeroed(n.saturating_mul(W)),
            len: n,
        }
    }

    /// How many records.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Record `i` (`i < len()`).
    pub(super) fn get(&self, i: usize) -> &[u8; W] {
        match self.buf.bytes()[i * W..(i + 1) * W].first_chunk::<W>() {
            Some(r) => r,
            None => unreachable!("a slice of W bytes is W bytes"),
        }
    }

    /// Record `i`, to change (`i < len()`).
    pub(super) fn get_mut(&mut self, i: usize) -> &mut [u8; W] {
        match self.buf.bytes_mut()[i * W..(i + 1) * W].first_chunk_mut::<W>() {
            Some(r) => r,
            None => unreachable!("a slice of W bytes is W bytes"),
        }
    }

    /// Append `record`; past the room made, the records move to a map twice as big.
    pub(super) fn push(&mut self, record: [u8; W]) {
        if (self.len + 1) * W > self.buf.bytes().len() {
            let mut bigger = Buf::zeroed((self.len + 1).max(64).saturating_mul(2 * W));
            bigger.bytes_mut()[..self.len * W].copy_from_slice(&self.buf.bytes()[..self.len * W]);
            self.buf = bigger;
        }
        self.len += 1;
        *self.get_mut(self.len - 1) = record;
    }

    /// Record `i` as a number, for records of 4 bytes (`W == 4`).
    pub(super) fn u32(&self, i: usize) -> u32 {
        let r = self.get(i);
        u32::from_ne_bytes([r[0], r[1], r[2], r[3]])
    }

    /// Set record `i` to the number `v`, for records of 4 bytes (`W == 4`).
    pub(super) fn set_u32(&mut self, i: usize, v: u32) {
        self.get_mut(i)[..4].copy_from_slice(&v.to_ne_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_grow_past_their_room_and_tables_start_zeroed() {
        let mut r = Records::<12>::with_capacity(3);
        for i in 0..1000u32 {
            let mut rec = [0u8; 12];
            rec[..4].copy_from_slice(&i.to_ne_bytes());
            rec[8] = 7;
            r.push(rec);
        }
        assert_eq!(r.len(), 1000);
        for i in 0..1000usize {
            assert_eq!(r.get(i)[..4], (i as u32).to_ne_bytes());
            assert_eq!(r.get(i)[8], 7);
        }
        let mut t = Records::<4>::zeroed(1 << 16);
        assert!((0..1 << 16).all(|i| t.u32(i) == 0));
        t.set_u32(5, 9);
        assert_eq!(t.u32(5), 9);
        assert_eq!(Records::<4>::default().len(), 0);
    }
}
