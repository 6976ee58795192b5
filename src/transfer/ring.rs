//! Where a gather job's descriptor table waits for its upload: a ring over
//! one pinned host buffer per handler, or a heap vector when the ring is
//! full or absent.
//!
//! Why pinned: `cuMemcpyHtoDAsync` from pageable memory first synchronizes
//! the stream (CUDA's documented pageable semantics), so with a heap table
//! every gather submission waited for the handler's previous job, and the
//! caller's thread with it. From page-locked memory the upload is a plain
//! DMA ordered by the stream, and submission returns at once.
//!
//! The ring hands out contiguous word ranges in submission order and takes
//! them back in the same order (a handler reports its jobs first in, first
//! out), so its state is the FIFO of live ranges. A range is live from the
//! job's submission until it is reported, after its completion event: the
//! upload that reads it has then executed.

use std::collections::VecDeque;

/// The FIFO allocator over `capacity` words (no memory of its own).
#[derive(Debug, Default)]
pub(crate) struct Ring {
    capacity: usize,
    /// Live ranges `(start, len)`, oldest first.
    live: VecDeque<(usize, usize)>,
    /// Where the next range would start without wrapping.
    tail: usize,
}

impl Ring {
    pub(crate) fn new(capacity: usize) -> Self {
        Ring { capacity, live: VecDeque::new(), tail: 0 }
    }

    /// A range of `len` words that overlaps no live range, or None when the
    /// ring has no such space now (or `len` is zero or above the capacity).
    pub(crate) fn alloc(&mut self, len: usize) -> Option<usize> {
        if len == 0 || len > self.capacity {
            return None;
        }
        let start = match self.live.front() {
            None => 0,
            Some(&(head, _)) if self.tail > head => {
                // Live ranges lie in [head, tail): after the tail, or wrap to 0.
                if self.tail + len <= self.capacity {
                    self.tail
                } else if len <= head {
                    0
                } else {
                    return None;
                }
            }
            Some(&(head, _)) => {
                // Wrapped (or full, tail == head): free space is [tail, head).
                if self.tail + len <= head {
                    self.tail
                } else {
                    return None;
                }
            }
        };
        self.live.push_back((start, len));
        self.tail = start + len;
        Some(start)
    }

    /// Returns the oldest live range, which must be `start` (FIFO order).
    pub(crate) fn release(&mut self, start: usize) {
        let oldest = self.live.pop_front();
        debug_assert_eq!(oldest.map(|r| r.0), Some(start), "ring ranges are released out of order");
        if self.live.is_empty() {
            self.tail = 0;
        }
    }

    /// Live ranges (tests).
    #[cfg(test)]
    fn live(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.live.iter().copied()
    }
}

/// A job's descriptor table while it is built and until the job is reported.
#[derive(Debug, Default)]
pub(crate) enum Table {
    /// No table (the job used no gather kernel).
    #[default]
    None,
    /// Pageable: its upload synchronizes the stream first. The vector never
    /// grows past the capacity it was made with, so it never moves.
    Heap(Vec<u64>),
    /// `len` words written of `cap` at `ptr`, word `start` of the handler's
    /// pinned ring.
    Pinned { ptr: *mut u64, start: usize, cap: usize, len: usize },
}

// SAFETY: `Pinned` points into the handler's page-locked ring, which lives
// until the engine is dropped after every job (and so every Table) is gone;
// the range belongs to this one job, so moving the Table to another thread
// moves the only handle to it.
unsafe impl Send for Table {}

impl Table {
    /// Appends one entry. Panics in debug builds past the capacity.
    pub(crate) fn push(&mut self, entry: [u64; 3]) {
        match self {
            Table::None => unreachable!("push on an absent table"),
            Table::Heap(v) => {
                debug_assert!(v.len() + 3 <= v.capacity(), "a heap table must not move");
                v.extend_from_slice(&entry);
            }
            Table::Pinned { ptr, cap, len, .. } => {
                assert!(*len + 3 <= *cap, "pinned table overflow");
                // SAFETY: `ptr..ptr+cap` is this job's range of the ring
                // (see the type), and `len + 3 <= cap`.
                unsafe { std::ptr::copy_nonoverlapping(entry.as_ptr(), ptr.add(*len), 3) };
                *len += 3;
            }
        }
    }

    /// Words written so far.
    pub(crate) fn len(&self) -> usize {
        match self {
            Table::None => 0,
            Table::Heap(v) => v.len(),
            Table::Pinned { len, .. } => *len,
        }
    }

    /// Words `from..to` (written), for an upload.
    pub(crate) fn words(&self, from: usize, to: usize) -> &[u64] {
        match self {
            Table::None => &[],
            Table::Heap(v) => &v[from..to],
            Table::Pinned { ptr, len, .. } => {
                assert!(from <= to && to <= *len);
                // SAFETY: within the written part of this job's range.
                unsafe { std::slice::from_raw_parts(ptr.add(from), to - from) }
            }
        }
    }

    /// True when uploads from it are asynchronous (page-locked).
    pub(crate) fn pinned(&self) -> bool {
        matches!(self, Table::Pinned { .. })
    }

    /// The ring start to release once the job is reported.
    pub(crate) fn ring_start(&self) -> Option<usize> {
        match self {
            Table::Pinned { start, .. } => Some(*start),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn wraps_and_refuses_what_does_not_fit() {
        let mut r = Ring::new(10);
        assert_eq!(r.alloc(4), Some(0));
        assert_eq!(r.alloc(4), Some(4));
        assert_eq!(r.alloc(4), None, "only 2 words after the tail, none before the head");
        r.release(0);
        assert_eq!(r.alloc(4), Some(0), "wraps to the freed front");
        assert_eq!(r.alloc(1), None, "wrapped: free space is [4, 4)");
        r.release(4);
        assert_eq!(r.alloc(6), Some(4));
        assert_eq!(r.alloc(0), None);
        assert_eq!(r.alloc(11), None);
        r.release(0);
        r.release(4);
        assert_eq!(r.alloc(10), Some(0), "empty again: everything");
    }

    proptest! {
        /// Whatever the sizes and the interleaving of allocations and
        /// (FIFO) releases, live ranges stay inside the ring, never
        /// overlap, and an empty ring grants any size up to its capacity.
        #[test]
        fn live_ranges_never_overlap(cap in 1usize..64, ops in proptest::collection::vec((any::<bool>(), 1usize..70), 1..200)) {
            let mut r = Ring::new(cap);
            for (release, len) in ops {
                if release {
                    let oldest = r.live().next();
                    if let Some((s, _)) = oldest {
                        r.release(s);
                    }
                } else {
                    let empty = r.live().next().is_none();
                    let got = r.alloc(len);
                    if empty {
                        prop_assert_eq!(got.is_some(), len <= cap);
                    }
                }
                let mut v: Vec<(usize, usize)> = r.live().collect();
                for &(s, l) in &v {
                    prop_assert!(s + l <= cap);
                }
                v.sort_unstable();
                for w in v.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {:?}", w);
                }
            }
        }
    }
}
