//! The verifier thread of a rank: checks every page of every loaded block
//! on the GPU with [`Kernel::PatternCheck`] on its own stream, reads back one
//! counter per page, and names the pages that differ from their pattern.

use std::collections::VecDeque;

use kvoffload::manager::BlockKey;
use kvoffload::offloader::Offloader;
use kvoffload::runtime::pattern;
use kvoffload::runtime::{DevicePtr, DriverError, GpuRuntime, Kernel, Stream, PATTERN_ENTRY_WORDS};
use kvoffload::sync::{self, Condvar, Mutex};

use super::rank::{drv, gated, RankError};
use super::tables::Shape;

/// What a failed check names.
const READING: &str = "reading GPU blocks back";
/// What a failed set-up names.
const SETTING_UP: &str = "setting up the verifier";

/// A loaded job to check: its keys and the GPU blocks holding them.
pub(crate) struct Loaded<J> {
    pub keys: Vec<BlockKey>,
    pub gpu: Vec<usize>,
    /// Whatever the submitter wants back with the verdict.
    pub job: J,
}

/// What a check found.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Blocks whose every page matched, and blocks with a differing page.
    Checked { verified: u64, corrupted: u64 },
    /// The check could not be enqueued (its table upload failed): nothing
    /// was checked; the load counts as failed.
    NotChecked(DriverError),
}

/// A checked job, handed back.
pub(crate) struct Verdict<J> {
    pub loaded: Loaded<J>,
    pub outcome: Outcome,
}

struct State<J> {
    todo: VecDeque<Loaded<J>>,
    done: VecDeque<Verdict<J>>,
    stop: bool,
}

/// The queue between the workload and the verifier thread.
pub(crate) struct Verifier<J> {
    state: Mutex<State<J>>,
    cv: Condvar,
}

impl<J> Verifier<J> {
    pub fn new() -> Self {
        Verifier {
            state: Mutex::new(State { todo: VecDeque::new(), done: VecDeque::new(), stop: false }),
            cv: Condvar::new(),
        }
    }

    /// Queues a loaded job for checking.
    pub fn push(&self, l: Loaded<J>) {
        sync::lock(&self.state).todo.push_back(l);
        self.cv.notify_all();
    }

    /// Verdicts so far, without waiting.
    pub fn drain(&self) -> Vec<Verdict<J>> {
        sync::lock(&self.state).done.drain(..).collect()
    }

    /// Waits for a verdict; false when the verifier stopped with none left.
    pub fn wait_done(&self) -> bool {
        let mut g = sync::lock(&self.state);
        while g.done.is_empty() && !g.stop {
            g = sync::wait(&self.cv, g);
        }
        !g.done.is_empty()
    }

    /// Tells the thread to finish (after the jobs already queued).
    pub fn stop(&self) {
        sync::lock(&self.state).stop = true;
        self.cv.notify_all();
    }

    /// The thread's body: checks queued jobs until stopped, its
    /// capture-unsafe calls through the offloader's gate. An error other
    /// than a failed table upload stops it and is returned.
    pub fn run(&self, off: &Offloader, checker: &Checker, shape: &Shape) -> Result<(), RankError> {
        loop {
            let loaded = {
                let mut g = sync::lock(&self.state);
                loop {
                    if let Some(j) = g.todo.pop_front() {
                        break j;
                    }
                    if g.stop {
                        return Ok(());
                    }
                    g = sync::wait(&self.cv, g);
                }
            };
            let r = checker.check(off, shape, &loaded.keys, &loaded.gpu);
            let mut g = sync::lock(&self.state);
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

/// The verifier's stream, device table and counters, made once.
pub(crate) struct Checker {
    stream: Stream,
    table: DevicePtr,
    out: DevicePtr,
    entries: usize,
}

impl Checker {
    /// A stream, a table of `entries` entries and as many counters (larger
    /// jobs are checked a table at a time), allocated through the
    /// offloader's gate.
    pub fn new(off: &Offloader, entries: usize) -> Result<Self, RankError> {
        let entries = entries.max(1);
        let stream = off.runtime().stream_create().map_err(drv(SETTING_UP))?;
        let mut c = Checker { stream, table: DevicePtr::NULL, out: DevicePtr::NULL, entries };
        let r = gated(off, SETTING_UP, |g, rt| rt.mem_alloc(g, entries * PATTERN_ENTRY_WORDS * 8)).and_then(|t| {
            c.table = t;
            gated(off, SETTING_UP, |g, rt| rt.mem_alloc(g, entries * 4))
        });
        match r {
            Ok(o) => {
                c.out = o;
                Ok(c)
            }
            Err(e) => {
                c.release(off);
                Err(e)
            }
        }
    }

    /// Checks every page of `keys` (in GPU blocks `gpu`) against its
    /// pattern, waiting for the device through the offloader's gate.
    /// `Ok(NotChecked)` when a table upload was refused; `Err` for any
    /// other driver error (the device or the stream is broken) or a refusal
    /// of the offloader.
    pub fn check(
        &self,
        off: &Offloader,
        shape: &Shape,
        keys: &[BlockKey],
        gpu: &[usize],
    ) -> Result<Outcome, RankError> {
        let rt = off.runtime().as_ref();
        let table = shape.table(keys, gpu);
        let mut bad_blocks = vec![false; keys.len()];
        let mut counts = vec![0u32; self.entries];
        for (p, piece) in table.chunks(self.entries * PATTERN_ENTRY_WORDS).enumerate() {
            let n = piece.len() / PATTERN_ENTRY_WORDS;
            // SAFETY: `table` outlives the synchronize below, after which
            // the stream has read it.
            if let Err(e) =
                unsafe { rt.copy_htod_async(self.table, piece.as_ptr() as usize, piece.len() * 8, self.stream) }
            {
                return Ok(Outcome::NotChecked(e));
            }
            // SAFETY: `self.out` is this checker's device allocation of
            // `entries >= n` counters, used by its stream alone and freed
            // only by `release`, after the thread stopped; the synchronize
            // below waits for this memset.
            unsafe { rt.memset_d8_async(self.out, 0, n * 4, self.stream) }.map_err(drv(READING))?;
            // SAFETY: the kernel reads the table uploaded just before on the
            // same stream (`piece` outlives the synchronize below) and the
            // pages its entries name: the job's GPU blocks, in the live KV
            // tensors, which the workload neither writes nor frees until
            // this job's verdict; it writes `n` of `self.out`'s counters
            // (as for the memset). The synchronize below waits for it.
            unsafe {
                rt.launch(Kernel::PatternCheck { table: self.table, count: n as u32, out: self.out }, self.stream)
            }
            .map_err(drv(READING))?;
            let stream = self.stream;
            gated(off, READING, |g, rt| rt.stream_synchronize(g, stream))?;
            // SAFETY: `counts` holds at least `n` u32s, 4 n bytes.
            unsafe { rt.copy_dtoh(counts.as_mut_ptr() as usize, self.out, n * 4) }.map_err(drv(READING))?;
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
        Ok(Outcome::Checked { verified: keys.len() as u64 - corrupted, corrupted })
    }

    /// Frees the table, the counters (through the offloader's gate) and
    /// the stream.
    pub fn release(self, off: &Offloader) {
        for p in [self.table, self.out] {
            if p != DevicePtr::NULL {
                if let Err(e) = gated(off, "freeing a verifier buffer", |g, rt| rt.mem_free(g, p)) {
                    tracing::warn!(error = %e, "freeing a verifier buffer failed");
                }
            }
        }
        if let Err(e) = off.runtime().stream_destroy(self.stream) {
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
    use kvoffload::offloader::{KvAlloc, OffloaderOptions};
    use kvoffload::runtime::shared;
    use kvoffload::runtime::sim::{SimFault, SimRuntime};
    use kvoffload::runtime::Code;

    /// An offloader on the simulated GPU with two layers of 8 GPU blocks of
    /// 256-byte pages, factor 2 (its gate serves the tests' capture-unsafe
    /// calls), and the shape of its blocks.
    fn setup() -> (Offloader, Shape) {
        let (page, factor, layers) = (256, 2, 2);
        let kv = KvAlloc { tensors: layers, page_bytes: page, gpu_blocks: 8, block_factor: factor };
        let off =
            Offloader::with_allocated_tensors(shared(SimRuntime::new()), kv, OffloaderOptions::with_host_blocks(2))
                .unwrap();
        let shape = Shape { rank: 0, layers, factor, page, layout: off.layout().clone() };
        (off, shape)
    }

    /// Writes the blocks' patterns with the fill kernel, as a store does.
    fn fill(off: &Offloader, shape: &Shape, keys: &[BlockKey], gpu: &[usize]) {
        let rt = off.runtime();
        let s = rt.stream_create().unwrap();
        let table = shape.table(keys, gpu);
        let t = gated(off, "test", |g, rt| rt.mem_alloc(g, table.len() * 8)).unwrap();
        // SAFETY: `table` outlives the synchronize below.
        unsafe { rt.copy_htod_async(t, table.as_ptr() as usize, table.len() * 8, s).unwrap() };
        let count = (table.len() / PATTERN_ENTRY_WORDS) as u32;
        // SAFETY: the table was uploaded on `s` just before; its entries name
        // pages of the offloader's live tensors; the synchronize below waits.
        unsafe { rt.launch(Kernel::PatternFill { table: t, count }, s).unwrap() };
        gated(off, "test", |g, rt| rt.stream_synchronize(g, s)).unwrap();
    }

    #[test]
    fn the_check_finds_a_flipped_byte_in_the_block_that_holds_it() {
        let (off, shape) = setup();
        let rt = off.runtime().as_ref();
        let keys = [BlockKey::new(3, 0), BlockKey::new(4, 0)];
        let gpu = [5, 2, 7, 0];
        fill(&off, &shape, &keys, &gpu);
        // Tables of 3 entries: the 8 pages are checked in three pieces.
        let checker = Checker::new(&off, 3).unwrap();
        let clean = checker.check(&off, &shape, &keys, &gpu).unwrap();
        assert!(matches!(clean, Outcome::Checked { verified: 2, corrupted: 0 }), "{clean:?}");
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
        assert!(matches!(bad, Outcome::Checked { verified: 1, corrupted: 1 }), "{bad:?}");
        // The other block alone is still clean.
        let one = checker.check(&off, &shape, &keys[..1], &gpu[..2]).unwrap();
        assert!(matches!(one, Outcome::Checked { verified: 1, corrupted: 0 }), "{one:?}");
        // A block checked against another rank's pattern is caught.
        let other = Shape { rank: 1, ..shape.clone() };
        let wrong = checker.check(&off, &other, &keys[..1], &gpu[..2]).unwrap();
        assert!(matches!(wrong, Outcome::Checked { verified: 0, corrupted: 1 }), "{wrong:?}");
        // The byte within the block the log names: page 3 of 4, byte 100.
        let table = shape.table(&keys[1..], &gpu[2..]);
        assert_eq!(first_bad_byte(rt, &table[3 * PATTERN_ENTRY_WORDS..]).unwrap(), 3 * 256 + 100);
        checker.release(&off);
        off.shutdown().unwrap();
    }

    #[test]
    fn a_refused_table_upload_checks_nothing() {
        let (off, shape) = setup();
        let keys = [BlockKey::new(3, 0)];
        fill(&off, &shape, &keys, &[1, 6]);
        let checker = Checker::new(&off, 16).unwrap();
        off.runtime().as_sim().unwrap().inject(SimFault::Copy { nth: 1, code: Code::INVALID_VALUE });
        let r = checker.check(&off, &shape, &keys, &[1, 6]).unwrap();
        assert!(matches!(r, Outcome::NotChecked(ref e) if e.code == Code::INVALID_VALUE), "{r:?}");
        let r = checker.check(&off, &shape, &keys, &[1, 6]).unwrap();
        assert!(matches!(r, Outcome::Checked { verified: 1, corrupted: 0 }), "{r:?}");
        checker.release(&off);
        off.shutdown().unwrap();
    }
}
