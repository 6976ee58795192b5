//! A job's GPU pages as pattern-kernel tables ([`Kernel::PatternFill`] to
//! write a stored block's contents, [`Kernel::PatternCheck`] to check a
//! loaded one), and the device buffers the tables live in.
//!
//! Block `key` of rank `r` holds the contents of [`seed`]`(r, key)`
//! ([`kvoffload::pattern`]); its page `j` of layer `t` is bytes
//! `(t * factor + j) * page ..` of the block, so its table entry is
//! `[device address, seed, (t * factor + j) * page / 8, page]` (pages are a
//! multiple of 8 bytes: `RunConfig::validate`).
//!
//! [`Kernel::PatternFill`]: kvoffload::Kernel::PatternFill
//! [`Kernel::PatternCheck`]: kvoffload::Kernel::PatternCheck

use kvoffload::{BlockKey, DevicePtr, KvLayout, Offloader, PATTERN_ENTRY_WORDS};

use super::error::{drv, gated, RankError};

/// The pattern key of `key` on `rank`: ranks never share contents, so a
/// block written into another rank's slot would be caught.
pub(crate) fn seed(rank: usize, key: BlockKey) -> u64 {
    key.hash ^ ((rank as u64 + 1) << 56)
}

/// What it takes to address a job's GPU pages.
#[derive(Clone)]
pub(crate) struct Shape {
    pub rank: usize,
    pub layers: usize,
    /// GPU blocks per host block.
    pub factor: usize,
    /// Bytes of one GPU block of one layer.
    pub page: usize,
    pub layout: KvLayout,
}

/// Where a table entry points: block `block` of the job (its index in the
/// job's keys), layer `layer`, GPU block `page` of that host block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageAt {
    pub block: usize,
    pub layer: usize,
    pub page: usize,
}

impl Shape {
    /// Table entries per host block.
    pub fn pages_per_block(&self) -> usize {
        self.layers * self.factor
    }

    /// The pattern table of a job: one entry per page of every block in
    /// `keys`, whose GPU blocks are `gpu[k * factor ..][..factor]`, in the
    /// order of [`Shape::locate`].
    pub fn table(&self, keys: &[BlockKey], gpu: &[usize]) -> Vec<u64> {
        let f = self.factor;
        let mut t = Vec::with_capacity(keys.len() * self.pages_per_block() * PATTERN_ENTRY_WORDS);
        for (k, key) in keys.iter().enumerate() {
            let s = seed(self.rank, *key);
            for layer in 0..self.layers {
                for j in 0..f {
                    let first_word = ((layer * f + j) * self.page / 8) as u64;
                    let dev = self.layout.device_addr(0, layer, gpu[k * f + j]);
                    t.extend_from_slice(&[dev.raw(), s, first_word, self.page as u64]);
                }
            }
        }
        t
    }

    /// The page entry `i` of a [`Shape::table`] stands for.
    pub fn locate(&self, i: usize) -> PageAt {
        let per = self.pages_per_block();
        PageAt { block: i / per, layer: (i % per) / self.factor, page: i % self.factor }
    }
}

/// A page-locked host buffer of `u64` words that kernels read (or write)
/// in place through its device alias: a table written here reaches the
/// kernel without a copy. A table uploaded with `copy_htod_async` goes
/// through the host-to-device copy engine, where it queues behind the loads'
/// copies: with loads in flight a store's fill kernel, and so the store
/// ordered after it, waited for them (docs/gpu-runs/2026-12-01-duplex-linger/).
pub(crate) struct PinnedWords {
    host: usize,
    words: usize,
    /// The buffer's device alias (`cuMemHostGetDevicePointer`).
    pub device: DevicePtr,
}

impl PinnedWords {
    /// Allocates `words` words (at least one) of page-locked host memory
    /// through the offloader's gate, and looks up their device alias.
    pub fn new(off: &Offloader, words: usize, what: &'static str) -> Result<Self, RankError> {
        let words = words.max(1);
        let host = gated(off, what, |c| c.mem_alloc_host(words * 8))?;
        match off.geometry().runtime.host_device_ptr(host) {
            Ok(device) => Ok(PinnedWords { host, words, device }),
            Err(e) => {
                PinnedWords { host, words, device: DevicePtr::NULL }.release(off);
                Err(drv(what)(e))
            }
        }
    }

    /// Copies `src` to the start of the buffer.
    ///
    /// # Safety
    /// No kernel that may read or write the buffer is enqueued and not yet
    /// finished (the device would race with this write).
    pub unsafe fn write(&mut self, src: &[u64]) {
        assert!(src.len() <= self.words, "{} words into a buffer of {}", src.len(), self.words);
        // SAFETY: `host` is this buffer's live allocation of `words` u64s
        // (page-aligned, so aligned for u64), freed only by `release`, which
        // takes `self`; `src` fits (asserted); the caller guarantees that the
        // device does not access it meanwhile.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.host as *mut u64, src.len()) };
    }

    /// Copies the first `dst.len()` 32-bit halves of the buffer out.
    ///
    /// # Safety
    /// As for [`PinnedWords::write`]: every kernel that wrote the buffer has
    /// finished (its stream was synchronized).
    pub unsafe fn read_u32(&self, dst: &mut [u32]) {
        assert!(dst.len() <= self.words * 2, "{} u32s out of a buffer of {} words", dst.len(), self.words);
        // SAFETY: as in `write`, with `dst.len()` u32s within the buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.host as *const u32, dst.as_mut_ptr(), dst.len()) };
    }

    /// Frees the buffer through the offloader's gate (`cuMemFreeHost` waits
    /// for the device to go idle).
    pub fn release(self, off: &Offloader) {
        let host = self.host;
        // SAFETY: `release` takes the table by value: the jobs that read it
        // are done (its owner releases it after they were reported), and
        // nothing keeps its address.
        if let Err(e) = gated(off, "freeing a pinned table", |c| unsafe { c.mem_free_host(host) }) {
            tracing::warn!(error = %e, "freeing a pinned table failed");
        }
    }
}

/// Pinned buffers for the stores' pattern-fill tables, each of `entries`
/// entries: one per job that may be in flight. A table must stay untouched
/// until the kernel that reads it has run, so a job holds its buffer until
/// it is reported.
pub(crate) struct TablePool {
    bufs: Vec<PinnedWords>,
    free: Vec<usize>,
    entries: usize,
}

impl TablePool {
    /// Allocates `n` buffers of `entries` entries (none if any allocation
    /// fails), through the offloader's gate.
    pub fn new(off: &Offloader, n: usize, entries: usize) -> Result<Self, RankError> {
        let mut pool = TablePool { bufs: Vec::with_capacity(n), free: (0..n).rev().collect(), entries };
        for _ in 0..n {
            match PinnedWords::new(off, entries * PATTERN_ENTRY_WORDS, "allocating the pattern-fill tables") {
                Ok(p) => pool.bufs.push(p),
                Err(e) => {
                    pool.release(off);
                    return Err(e);
                }
            }
        }
        Ok(pool)
    }

    /// Entries each buffer holds.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// A free buffer: its slot (for [`TablePool::give`]) and the buffer.
    pub fn take(&mut self) -> Option<(usize, &mut PinnedWords)> {
        let i = self.free.pop()?;
        Some((i, &mut self.bufs[i]))
    }

    /// Returns buffer `slot` once nothing on the device reads it any more.
    pub fn give(&mut self, slot: usize) {
        debug_assert!(!self.free.contains(&slot), "table {slot} given back twice");
        self.free.push(slot);
    }

    /// Frees every buffer (waits for the device to go idle), through the
    /// offloader's gate.
    pub fn release(self, off: &Offloader) {
        for p in self.bufs {
            p.release(off);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvoffload::{GroupSpec, HostPlacement, TensorSpec};

    #[test]
    fn table_entries_are_the_pages_of_each_block_in_order() {
        let (page, factor, layers) = (64, 2, 3);
        let spec = GroupSpec {
            tensors: (0..layers)
                .map(|t| TensorSpec { device_base: DevicePtr(1 << (20 + t)), page_bytes: page })
                .collect(),
            num_gpu_blocks: 8,
            num_host_blocks: 4,
        };
        let host = vec![0u8; 4 * layers * factor * page];
        let layout = KvLayout::new(
            &[spec],
            factor,
            host.as_ptr() as usize,
            HostPlacement::BlockStrided { stride: layers * factor * page },
        )
        .unwrap();
        let shape = Shape { rank: 1, layers, factor, page, layout };
        let keys = [BlockKey::new(5, 0), BlockKey::new(9, 0)];
        let gpu = [7, 6, 1, 0];
        let t = shape.table(&keys, &gpu);
        assert_eq!(t.len(), 2 * layers * factor * PATTERN_ENTRY_WORDS);
        for (i, e) in t.chunks(PATTERN_ENTRY_WORDS).enumerate() {
            let at = shape.locate(i);
            let g = gpu[at.block * factor + at.page];
            assert_eq!(e[0], (1 << (20 + at.layer)) + (g * page) as u64, "entry {i}");
            assert_eq!(e[1], seed(1, keys[at.block]));
            assert_eq!(e[2] * 8, ((at.layer * factor + at.page) * page) as u64);
            assert_eq!(e[3], page as u64);
        }
        assert_eq!(shape.locate(7), PageAt { block: 1, layer: 0, page: 1 });
    }
}
