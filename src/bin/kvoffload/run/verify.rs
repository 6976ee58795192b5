//! The verifier thread of a rank: checks every page of every loaded block
//! on the GPU with [`Kernel::PatternCheck`] on its own stream, reads back one
//! counter per page, and names the pages that differ from their pattern.

use std::collections::VecDeque;

use kvoffload::{
    pattern, BlockKey, DevicePtr, DriverError, GpuRuntime, Kernel, Offloader, Stream, GATHER_ENTRY_WORDS,
    PATTERN_ENTRY_WORDS,
};
use std::sync::{Condvar, Mutex, PoisonError};

use super::error::{drv, gated, RankError};
use super::tables::{PinnedWords, Shape};

/// What a failed check names.
const READING: &str = "reading GPU blocks back";
/// What a failed set-up names.
const SETTING_UP: &str = "setting up the verifier";

/// A loaded job to check: its keys and the GPU blocks holding them.
pub(crate) struct Loaded {
    pub keys: Vec<BlockKey>,
    pub gpu: Vec<usize>,
}

/// What a check found: blocks whose every page matched, and blocks with a
/// differing page.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub verified: u64,
    pub corrupted: u64,
}

/// A checked job, handed back.
pub(crate) struct Verdict {
    pub loaded: Loaded,
    pub outcome: Outcome,
}

struct State {
    todo: VecDeque<Loaded>,
    done: VecDeque<Verdict>,
    stop: bool,
}

/// The queue between the workload and the verifier thread.
pub(crate) struct Verifier {
    state: Mutex<State>,
    cv: Condvar,
}

impl Verifier {
    pub fn new() -> Self {
        Verifier {
            state: Mutex::new(State { todo: VecDeque::new(), done: VecDeque::new(), stop: false }),
            cv: Condvar::new(),
        }
    }

    /// Queues a loaded job for checking.
    pub fn push(&self, l: Loaded) {
        super::lock(&self.state).todo.push_back(l);
        self.cv.notify_all();
    }

    /// Verdicts so far, without waiting.
    pub fn drain(&self) -> Vec<Verdict> {
        super::lock(&self.state).done.drain(..).collect()
    }

    /// Waits for a verdict; false when the verifier stopped with none left.
    pub fn wait_done(&self) -> bool {
        let mut g = super::lock(&self.state);
        while g.done.is_empty() && !g.stop {
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
        !g.done.is_empty()
    }

    /// Tells the thread to finish (after the jobs already queued).
    pub fn stop(&self) {
        super::lock(&self.state).stop = true;
        self.cv.notify_all();
    }

    /// The thread's body: checks queued jobs until stopped, its
    /// capture-unsafe calls through the offloader's gate. An error stops it
    /// and is returned.
    pub fn run(&self, off: &Offloader, checker: &mut Checker, shape: &Shape) -> Result<(), RankError> {
        loop {
            let loaded = {
                let mut g = super::lock(&self.state);
                loop {
                    if let Some(j) = g.todo.pop_front() {
                        break j;
                    }
                    if g.stop {
                        return Ok(());
                    }
                    g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
                }
            };
            let r = checker.check(off, shape, &loaded.keys, &loaded.gpu);
            let mut g = super::lock(&self.state);
            let outcome = match r {
                Ok(o) => o,
                Err(e) => {
                    g.stop = true;
                    self.cv.notify_all();
                    return Err(e);
                }
            };
            g.done.push_back(Verdict { loaded, outcome });
            self.cv.notify_all();
        }
    }
}

/// The verifier's stream, tables and counters, made once. Nothing it does
/// per check goes through a copy engine (where it would queue behind the
/// transfers' copies): the check kernel reads its table from pinned host
/// memory in place, and a gather kernel copies the counters out into pinned
/// host memory.
pub(crate) struct Checker {
    stream: Stream,
    /// The check kernel's table (pinned).
    table: PinnedWords,
    /// The counters, in device memory (the kernel adds to them atomically).
    out: DevicePtr,
    /// The counters' copy (pinned), and the one-entry gather table that
    /// makes it.
    counts: PinnedWords,
    copy_out: PinnedWords,
    entries: usize,
}

impl Checker {
    /// A stream, a table of `entries` entries and as many counters (larger
    /// jobs are checked a table at a time), allocated through the
    /// offloader's gate.
    pub fn new(off: &Offloader, entries: usize) -> Result<Self, RankError> {
        let entries = entries.max(1);
        let stream = off.geometry().runtime.stream_create().map_err(drv(SETTING_UP))?;
        let mut made = Vec::new();
        for words in [entries * PATTERN_ENTRY_WORDS, entries.div_ceil(2), GATHER_ENTRY_WORDS] {
            match PinnedWords::new(off, words, SETTING_UP) {
                Ok(p) => made.push(p),
                Err(e) => {
                    Self::release_parts(off, stream, made, DevicePtr::NULL);
                    return Err(e);
                }
            }
        }
        let out = match gated(off, SETTING_UP, |c| c.mem_alloc(entries * 4)) {
            Ok(o) => o,
            Err(e) => {
                Self::release_parts(off, stream, made, DevicePtr::NULL);
                return Err(e);
            }
        };
        let copy_out = made.pop().expect("three buffers");
        let counts = made.pop().expect("three buffers");
        let table = made.pop().expect("three buffers");
        Ok(Checker { stream, table, out, counts, copy_out, entries })
    }

    /// Checks every page of `keys` (in GPU blocks `gpu`) against its
    /// pattern, waiting for the device through the offloader's gate. `Err`
    /// for a driver error (the device or the stream is broken) or a refusal
    /// of the offloader. The check makes no copies, so the copy faults a
    /// fault-injected run arms land in the transfers, not here.
    pub fn check(
        &mut self,
        off: &Offloader,
        shape: &Shape,
        keys: &[BlockKey],
        gpu: &[usize],
    ) -> Result<Outcome, RankError> {
        let rt = off.geometry().runtime.as_ref();
        let table = shape.table(keys, gpu);
        let mut bad_blocks = vec![false; keys.len()];
        let mut counts = vec![0u32; self.entries];
        for (p, piece) in table.chunks(self.entries * PATTERN_ENTRY_WORDS).enumerate() {
            let n = piece.len() / PATTERN_ENTRY_WORDS;
            // SAFETY: every kernel of this stream finished (the stream was
            // synchronized after the last piece, or none ran yet), and no
            // other stream is given these buffers.
            unsafe {
                self.table.write(piece);
                self.copy_out.write(&[self.out.raw(), self.counts.device.raw(), (n * 4) as u64]);
            }
            // SAFETY: `self.out` is this checker's device allocation of
            // `entries >= n` counters, used by its stream alone and freed
            // only by `release`, after the thread stopped; the synchronize
            // below waits for this memset.
            unsafe { rt.memset_d8_async(self.out, 0, n * 4, self.stream) }.map_err(drv(READING))?;
            // SAFETY: the check kernel reads the table written just before
            // (pinned, through its alias; untouched until the synchronize
            // below) and the pages its entries name: the job's GPU blocks,
            // in the live KV tensors, which the workload neither writes nor
            // frees until this job's verdict; it adds to `n` of `self.out`'s
            // counters (as for the memset). The gather kernel after it, on
            // the same stream, copies those `4 n` bytes into `self.counts`
            // (pinned, `entries` u32s) as its one-entry table, written above,
            // says. The synchronize below waits for both.
            unsafe {
                rt.launch(
                    Kernel::PatternCheck { table: self.table.device, count: n as u32, out: self.out },
                    self.stream,
                )
                .and_then(|()| rt.launch(Kernel::Gather { table: self.copy_out.device, count: 1 }, self.stream))
            }
            .map_err(drv(READING))?;
            let stream = self.stream;
            gated(off, READING, |c| c.stream_synchronize(stream))?;
            // SAFETY: the stream was synchronized: the gather kernel that
            // wrote the counters has finished.
            unsafe { self.counts.read_u32(&mut counts[..n]) };
            for (i, &c) in counts[..n].iter().enumerate() {
                if c != 0 {
                    let idx = p * self.entries + i;
                    let e = &table[idx * PATTERN_ENTRY_WORDS..][..PATTERN_ENTRY_WORDS];
                    let at = shape.locate(idx);
                    bad_blocks[at.block] = true;
                    let byte = first_bad_byte(rt, e).map_err(drv(READING))?;
                    tracing::error!(
                        rank = shape.rank, key = %keys[at.block], layer = at.layer, page = at.page,
                        words = c, byte, "loaded block differs from its pattern"
                    );
                }
            }
        }
        let corrupted = bad_blocks.iter().filter(|b| **b).count() as u64;
        Ok(Outcome { verified: keys.len() as u64 - corrupted, corrupted })
    }

    /// Frees the tables, the counters (through the offloader's gate) and
    /// the stream.
    pub fn release(self, off: &Offloader) {
        Self::release_parts(off, self.stream, vec![self.table, self.counts, self.copy_out], self.out);
    }

    fn release_parts(off: &Offloader, stream: Stream, pinned: Vec<PinnedWords>, out: DevicePtr) {
        for p in pinned {
            p.release(off);
        }
        if out != DevicePtr::NULL {
            // SAFETY: the verifier's kernels that wrote `out` were
            // synchronized before it was read back; nothing keeps it.
            if let Err(e) = gated(off, "freeing a verifier buffer", |c| unsafe { c.mem_free(out) }) {
                tracing::warn!(error = %e, "freeing a verifier buffer failed");
            }
        }
        if let Err(e) = off.geometry().runtime.stream_destroy(stream) {
            tracing::warn!(error = %e, "destroying the verifier stream failed");
        }
    }
}

/// The offset within its block of the first wrong byte of the page of table
/// entry `e` (read back only for a page the kernel found wrong).
fn first_bad_byte(rt: &dyn GpuRuntime, e: &[u64]) -> Result<u64, DriverError> {
    let mut got = vec![0u8; e[3] as usize];
    // SAFETY: `got` is a writable buffer of the page's size.
    unsafe { rt.copy_dtoh(got.as_mut_ptr() as usize, DevicePtr(e[0]), got.len())? };
    Ok(e[2] * 8 + pattern::first_mismatch_from(e[1], e[2], &got).unwrap_or(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvoffload::Request;
    use kvoffload::{shared, KvAlloc, OffloaderOptions, SimRuntime};

    /// An offloader on the simulated GPU with two layers of 8 GPU blocks of
    /// 256-byte pages, factor 2 (its gate serves the tests' capture-unsafe
    /// calls), and the shape of its blocks.
    fn setup() -> (Offloader, Shape) {
        let (page, factor, layers) = (256, 2, 2);
        let kv = KvAlloc { tensors: layers, page_bytes: page, gpu_blocks: 8, block_factor: factor };
        let off =
            Offloader::with_allocated_tensors(shared(SimRuntime::new()), kv, OffloaderOptions::with_host_blocks(2))
                .unwrap();
        let shape = Shape { rank: 0, layers, factor, page, layout: off.geometry().layout.clone() };
        (off, shape)
    }

    /// Writes the blocks' patterns with the fill kernel, as a store does.
    fn fill(off: &Offloader, shape: &Shape, keys: &[BlockKey], gpu: &[usize]) {
        let rt = &off.geometry().runtime;
        let s = rt.stream_create().unwrap();
        let table = shape.table(keys, gpu);
        let t = gated(off, "test", |c| c.mem_alloc(table.len() * 8)).unwrap();
        // SAFETY: `table` outlives the synchronize below.
        unsafe { rt.copy_htod_async(t, table.as_ptr() as usize, table.len() * 8, s).unwrap() };
        let count = (table.len() / PATTERN_ENTRY_WORDS) as u32;
        // SAFETY: the table was uploaded on `s` just before; its entries name
        // pages of the offloader's live tensors; the synchronize below waits.
        unsafe { rt.launch(Kernel::PatternFill { table: t, count }, s).unwrap() };
        gated(off, "test", |c| c.stream_synchronize(s)).unwrap();
    }

    #[test]
    fn the_check_finds_a_flipped_byte_in_the_block_that_holds_it() {
        let (off, shape) = setup();
        let rt = off.geometry().runtime.as_ref();
        let keys = [BlockKey::new(3, 0), BlockKey::new(4, 0)];
        let gpu = [5, 2, 7, 0];
        fill(&off, &shape, &keys, &gpu);
        // Tables of 3 entries: the 8 pages are checked in three pieces.
        let mut checker = Checker::new(&off, 3).unwrap();
        let clean = checker.check(&off, &shape, &keys, &gpu).unwrap();
        assert_eq!(clean, Outcome { verified: 2, corrupted: 0 });
        // Flip one byte of block 1 (key 4), layer 1, its second GPU block.
        let at = shape.layout.device_addr(0, 1, gpu[3]).offset(100);
        let mut b = [0u8];
        // SAFETY: `b` is one writable, then readable, byte.
        unsafe {
            rt.copy_dtoh(b.as_mut_ptr() as usize, at, 1).unwrap();
            b[0] ^= 1;
            rt.copy_htod(at, b.as_ptr() as usize, 1).unwrap();
        }
        let bad = checker.check(&off, &shape, &keys, &gpu).unwrap();
        assert_eq!(bad, Outcome { verified: 1, corrupted: 1 });
        // The other block alone is still clean.
        let one = checker.check(&off, &shape, &keys[..1], &gpu[..2]).unwrap();
        assert_eq!(one, Outcome { verified: 1, corrupted: 0 });
        // A block checked against another rank's pattern is caught.
        let other = Shape { rank: 1, ..shape.clone() };
        let wrong = checker.check(&off, &other, &keys[..1], &gpu[..2]).unwrap();
        assert_eq!(wrong, Outcome { verified: 0, corrupted: 1 });
        // The byte within the block the log names: page 3 of 4, byte 100.
        let table = shape.table(&keys[1..], &gpu[2..]);
        assert_eq!(first_bad_byte(rt, &table[3 * PATTERN_ENTRY_WORDS..]).unwrap(), 3 * 256 + 100);
        checker.release(&off);
        off.shutdown(Request::new(), &mut drop).unwrap();
    }
}
