//! The staged backend: the gather kernel packs a job's scattered GPU pages
//! into a contiguous device staging buffer (device to device, at HBM speed),
//! and the copy engine moves the staging buffer to or from host memory in
//! one batched copy of the job's contiguous host runs (a load: the mirror,
//! copies into staging first, then the kernel scatters).
//!
//! Why (docs/gpu-runs/2026-11-30-duplex-probe.txt, issue #15): the gather
//! kernel moving host memory itself has SMs issue the PCIe transactions, in
//! 128-byte requests (Nsight Compute: 4 sectors a request). One way that
//! reaches 51 - 53 GB/s on an H200, but with a load and a store at once the
//! two kernels share about 80 GB/s (28 - 44 GB/s a direction), and a copy
//! engine working against such a kernel in the other direction gets about
//! 25 GB/s. Copy engines in both directions reach the link's duplex limit.
//! Staging makes every byte on the link a copy-engine byte; it pays where
//! a job's host side is contiguous in large runs (a block-major or
//! block-strided host block holds every layer's page of a block), never
//! where host pages are scattered (one DMA a page: docs/driver-rules.md,
//! row "One copy call").
//!
//! A handler's staging memory is one device allocation made at engine
//! creation through the gate ([`Staging::create`]): two buffers of `half`
//! bytes and two descriptor tables, each buffer and table used by one of the
//! handler's two staging streams. A job is cut into chunks of at most `half`
//! bytes (and at most a table of entries), which alternate between the two
//! streams (across jobs too), so one chunk's kernel overlaps the previous
//! chunk's copies. Both streams first wait for the job's compute-stream
//! event, and the handler's stream waits for each stream's last chunk of
//! the job (events `joins`) before the job's completion event is recorded
//! on it: completion stays in order per direction (P5), and no staging
//! stream ever waits for the other, so consecutive jobs run back to back.
//! A stream's own order keeps a chunk from overwriting a buffer or table an
//! earlier chunk still uses. Tables in the handler's page-locked ring are
//! read by the kernel through the ring's device alias (no upload: a
//! store's upload would be a host-to-device copy queued behind the load's
//! copies on the copy engine); tables on the heap are uploaded.
//!
//! The kernel here reads and writes device memory only (KV pages and the
//! staging buffer): no host alias is involved, so P3 (kernels only on
//! registered memory) holds without a guard. The copies are batched copies,
//! so the backend is never used on a capturing stream (docs/driver-rules.md,
//! row "Batched copy inside a capture").

use std::ops::Range;

use crate::protocol::{Coordinator, Request};
use crate::rules::Rules;
use crate::runtime::{
    DevicePtr, Direction, DriverResult, Event, Fragment, GpuRuntime, Kernel, Stream, GATHER_ENTRY_BYTES,
};
use crate::sync::atomic::{AtomicUsize, Ordering};

use super::backend::{self, GatherTable};
use super::error::TransferError;

/// Alignment of the staging offset where a host run starts (the kernel's
/// 16-byte vector path needs source, destination and length aligned).
const RUN_ALIGN: usize = 16;

/// Smallest staging buffer (each of the two) an engine makes.
pub(crate) const MIN_HALF: usize = 4096;

/// One piece of a job: `frag.bytes` at `frag.device` on the GPU, at offset
/// `off` of its chunk's staging buffer, and at `frag.host` on the host.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub frag: Fragment,
    pub off: usize,
}

/// A contiguous host range and its contiguous image in a staging buffer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub host: usize,
    pub off: usize,
    pub bytes: usize,
}

/// Pieces and runs of one chunk (indices into [`Plan`]'s vectors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub pieces: Range<usize>,
    pub runs: Range<usize>,
}

/// A job cut into chunks for the staged backend.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub pieces: Vec<Piece>,
    pub runs: Vec<Run>,
    pub chunks: Vec<Chunk>,
    pub bytes: u64,
}

impl Plan {
    /// Cuts `frags` (whose device ranges are pairwise disjoint, as are their
    /// host ranges: a job's blocks are distinct) into chunks of at most
    /// `half` staging bytes and `max_entries` pieces. Fragments are taken
    /// in host-address order, so a host block whose pages the expansion
    /// lists far apart (one page a layer) becomes one run; a fragment is cut
    /// where a chunk fills. Inside a chunk, a piece that continues the
    /// previous piece's host range continues its staging range too (one
    /// run); a new run starts at the next 16-byte offset. `chunk_end(a)` is
    /// the end of the host registration holding address `a`
    /// (`usize::MAX` outside every registration): pieces and runs are cut
    /// there, since one copy may not span two registrations
    /// (cuMemcpyBatchAsync answered INVALID_VALUE for runs across 1 MiB
    /// registration chunks on the H200, docs/gpu-runs/2026-11-30-duplex-*).
    pub fn new(frags: &[Fragment], half: usize, max_entries: usize, chunk_end: impl Fn(usize) -> usize) -> Plan {
        assert!(half >= RUN_ALIGN && max_entries >= 1, "staging too small: {half} bytes, {max_entries} entries");
        let mut order: Vec<&Fragment> = frags.iter().filter(|f| f.bytes > 0).collect();
        if !order.windows(2).all(|w| w[0].host <= w[1].host) {
            order.sort_by_key(|f| f.host);
        }
        let mut p = Plan::default();
        // The open chunk: first piece and run, staging bytes used.
        let (mut first_piece, mut first_run, mut used) = (0, 0, 0usize);
        for f in order {
            p.bytes += f.bytes as u64;
            let mut rest = *f;
            while rest.bytes > 0 {
                let open = p.pieces.len() > first_piece;
                let end = chunk_end(rest.host);
                let continues = open
                    && p.runs.last().is_some_and(|r| {
                        p.runs.len() > first_run && r.host + r.bytes == rest.host && chunk_end(r.host) == end
                    });
                let start = if continues { used } else { used.next_multiple_of(RUN_ALIGN) };
                if open && (start >= half || p.pieces.len() - first_piece >= max_entries) {
                    p.chunks.push(Chunk { pieces: first_piece..p.pieces.len(), runs: first_run..p.runs.len() });
                    (first_piece, first_run, used) = (p.pieces.len(), p.runs.len(), 0);
                    continue;
                }
                let take = rest.bytes.min(half - start).min(end.saturating_sub(rest.host).max(1));
                p.pieces.push(Piece { frag: Fragment { bytes: take, ..rest }, off: start });
                match p.runs.last_mut() {
                    Some(r) if continues => r.bytes += take,
                    _ => p.runs.push(Run { host: rest.host, off: start, bytes: take }),
                }
                used = start + take;
                rest = Fragment { host: rest.host + take, device: rest.device.offset(take), bytes: rest.bytes - take };
            }
        }
        if p.pieces.len() > first_piece {
            p.chunks.push(Chunk { pieces: first_piece..p.pieces.len(), runs: first_run..p.runs.len() });
        }
        p
    }

    /// Mean bytes of a contiguous host run (0 for an empty plan).
    pub fn mean_run_bytes(&self) -> u64 {
        self.bytes / self.runs.len().max(1) as u64
    }
}

/// A handler's staging memory, its two streams and events (module docs).
#[derive(Debug)]
pub(crate) struct Staging {
    /// One allocation: buffer 0, buffer 1, table 0, table 1.
    base: DevicePtr,
    /// Bytes of each buffer.
    pub half: usize,
    /// Entries of each table.
    pub entries: usize,
    /// The two streams chunks alternate between: buffer and table `b`
    /// belong to stream `b`.
    streams: [Stream; 2],
    /// Recorded on stream `b` after a job's last chunk there; the handler's
    /// stream waits for it before the job's completion event.
    joins: [Event; 2],
    /// The stream of the next chunk (alternating across jobs too).
    next: AtomicUsize,
    /// The handler's page-locked ring (address, bytes) and its device alias, when
    /// the kernel can read descriptor tables there (no upload: a store's
    /// table upload is a host-to-device copy that would wait behind a load's
    /// copies on the copy engine).
    ring: Option<(usize, usize, DevicePtr)>,
}

impl Staging {
    /// Allocates `bytes` of staging (two buffers of half each, rounded down
    /// to 256 bytes, at least [`MIN_HALF`]) and two tables of `entries`
    /// through the coordinator's gate, two streams and two events.
    /// `Ok(None)` when the device memory cannot be had (the handler then
    /// runs without the staged backend); `Err` when the gate refuses (a
    /// capture window of the calling thread) or a stream or event cannot
    /// be made.
    pub fn create(
        rt: &dyn GpuRuntime,
        coord: &Coordinator,
        bytes: usize,
        entries: usize,
    ) -> Result<Option<Staging>, TransferError> {
        let half = (bytes / 2 / 256 * 256).max(MIN_HALF);
        let entries = entries.clamp(1, 1 << 31);
        let total = 2 * half + 2 * entries * GATHER_ENTRY_BYTES;
        let mut streams: Vec<Stream> = Vec::with_capacity(2);
        let mut events: Vec<Event> = Vec::with_capacity(2);
        let undo = |streams: &[Stream], events: &[Event]| {
            for &e in events {
                if let Err(d) = rt.event_destroy(e) {
                    tracing::warn!(error = %d, "destroying a staging event after a failed set-up failed");
                }
            }
            for &s in streams {
                if let Err(d) = rt.stream_destroy(s) {
                    tracing::warn!(error = %d, "destroying a staging stream after a failed set-up failed");
                }
            }
        };
        for _ in 0..2 {
            let made = rt.stream_create().and_then(|s| {
                streams.push(s);
                rt.event_create()
            });
            match made {
                Ok(e) => events.push(e),
                Err(e) => {
                    undo(&streams, &events);
                    return Err(e.into());
                }
            }
        }
        match coord.unsafe_call("allocating the staging buffers", Request::new(), |gate| rt.mem_alloc(gate, total)) {
            Ok(Ok(base)) => Ok(Some(Staging {
                base,
                half,
                entries,
                streams: [streams[0], streams[1]],
                joins: [events[0], events[1]],
                next: AtomicUsize::new(0),
                ring: None,
            })),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, bytes = total, "no device staging buffers; the staged backend is off");
                undo(&streams, &events);
                Ok(None)
            }
            Err(e) => {
                undo(&streams, &events);
                Err(e.into())
            }
        }
    }

    /// Lets the kernel read descriptor tables straight from the handler's
    /// page-locked ring of `bytes` at `addr` (through its device alias; kept
    /// off when the driver gives none: tables are then uploaded).
    pub fn use_ring(&mut self, rt: &dyn GpuRuntime, addr: usize, bytes: usize) {
        match rt.host_device_ptr(addr) {
            Ok(alias) => self.ring = Some((addr, bytes, alias)),
            Err(e) => tracing::warn!(error = %e, "no device alias of the pinned ring; staged tables will be uploaded"),
        }
    }

    /// Device address of buffer `b` (0 or 1).
    pub fn buffer(&self, b: usize) -> DevicePtr {
        self.base.offset(b * self.half)
    }

    /// Descriptor table `b` (0 or 1).
    pub fn table(&self, b: usize) -> GatherTable {
        let at = 2 * self.half + b * self.entries * GATHER_ENTRY_BYTES;
        GatherTable { ptr: self.base.offset(at), entries: self.entries }
    }

    /// The stream chunk 0 of the next job goes to (chunk `c` goes to
    /// `(first + c) % 2`, and so do its buffer and table).
    pub fn first_stream(&self) -> usize {
        self.next.load(Ordering::Relaxed) % 2
    }

    /// The gather entries of `plan` for `dir`, chunk after chunk, chunk 0 on
    /// stream `first`: each piece between its GPU range and its range of
    /// the chunk's buffer.
    pub fn entries<'a>(&'a self, dir: Direction, plan: &'a Plan, first: usize) -> impl Iterator<Item = [u64; 3]> + 'a {
        plan.chunks.iter().enumerate().flat_map(move |(c, ch)| {
            let buf = self.buffer((first + c) % 2);
            plan.pieces[ch.pieces.clone()].iter().map(move |p| backend::entry(dir, p.frag, buf.offset(p.off)))
        })
    }

    /// Enqueues `plan` (encoded by [`Staging::entries`] with `first` into
    /// `table`) on the two streams, each first waiting for `after_compute`
    /// (the event the handler's stream waits for at submission), and makes
    /// the handler's stream `main` wait for the last chunk of each: no
    /// stream waits for an earlier job's other stream, so chunks of
    /// consecutive jobs follow each other without a gap. Returns the first
    /// error; when a stream cannot be joined back into `main`, waits for it
    /// through the gate before returning the error.
    ///
    /// # Safety
    /// `table` stays alive and unchanged until `main` has executed the
    /// job; every GPU range of the plan is device memory of `rt` and every
    /// host range stays mapped (and untouched, for a store) until then.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn enqueue(
        &self,
        rt: &dyn GpuRuntime,
        coord: &Coordinator,
        dir: Direction,
        plan: &Plan,
        table: &[u64],
        first: usize,
        main: Stream,
        after_compute: Event,
    ) -> DriverResult<()> {
        let used: Vec<usize> = (0..plan.chunks.len().min(2)).map(|c| (first + c) % 2).collect();
        // The alias of `table` when it lies in the ring: the kernel reads it
        // there, without an upload (a heap table is uploaded).
        let alias = self.ring.and_then(|(addr, bytes, alias)| {
            let at = (table.as_ptr() as usize).checked_sub(addr)?;
            (at.checked_add(std::mem::size_of_val(table))? <= bytes).then_some(alias.offset(at))
        });
        let mut r = Ok(());
        for &b in &used {
            r = r.and_then(|()| rt.stream_wait_event(self.streams[b], after_compute));
        }
        if r.is_ok() {
            for (c, ch) in plan.chunks.iter().enumerate() {
                let b = (first + c) % 2;
                let s = self.streams[b];
                let words = &table[ch.pieces.start * 3..ch.pieces.end * 3];
                let buf = self.buffer(b);
                let runs: Vec<Fragment> = plan.runs[ch.runs.clone()]
                    .iter()
                    .map(|r| Fragment { host: r.host, device: buf.offset(r.off), bytes: r.bytes })
                    .collect();
                // SAFETY: the kernel reads `words` (alive until the job is
                // done, this function's contract) and device memory only:
                // the job's GPU pages and buffer `b`, which only stream `s`
                // uses, in order; from the ring, through its alias, when the
                // table lies there (page-locked memory the driver allocated,
                // freed only after the handler's jobs are done); otherwise
                // uploaded into table `b`, which only stream `s` uses. The
                // copies move buffer `b` and the host runs, valid by this
                // function's contract.
                let kernel = |rt: &dyn GpuRuntime| unsafe {
                    match alias {
                        Some(a) => rt.launch(
                            Kernel::Gather {
                                table: a.offset(ch.pieces.start * GATHER_ENTRY_BYTES),
                                count: ch.pieces.len() as u32,
                            },
                            s,
                        ),
                        None => backend::gather(rt, self.table(b), words, s),
                    }
                };
                // SAFETY: as above.
                r = match dir {
                    Direction::DeviceToHost => kernel(rt).and_then(|()| unsafe { backend::batched(rt, dir, &runs, s) }),
                    Direction::HostToDevice => unsafe { backend::batched(rt, dir, &runs, s) }.and_then(|()| kernel(rt)),
                };
                if r.is_err() {
                    break;
                }
            }
        }
        self.next.store((first + plan.chunks.len()) % 2, Ordering::Relaxed);
        coord.rules().join_staging_streams(&used, |&b| {
            let joined = rt
                .event_record(self.joins[b], self.streams[b])
                .and_then(|()| rt.stream_wait_event(main, self.joins[b]));
            if let Err(e) = joined {
                // The job's completion event would not cover this stream:
                // wait for it here, so that nothing of this job runs once it
                // is reported.
                tracing::error!(error = %e, "joining a staging stream failed; waiting for it");
                let s = self.streams[b];
                match coord
                    .unsafe_call("waiting for a staging stream", Request::new(), |gate| rt.stream_synchronize(gate, s))
                {
                    Ok(Ok(())) => {}
                    Ok(Err(x)) => tracing::error!(error = %x, "synchronizing a staging stream failed"),
                    Err(x) => tracing::error!(error = %x, "staging stream not waited for (inside a capture window)"),
                }
                if r.is_ok() {
                    r = Err(e);
                }
            }
        });
        r
    }

    /// Frees everything; `busy` when the handler's stream was not waited
    /// for with jobs in flight (both streams are then synchronized first,
    /// through the gate). Leaks the buffers when that wait is refused
    /// (inside a capture window).
    pub fn release(self, rt: &dyn GpuRuntime, coord: &Coordinator, busy: bool) {
        let mut idle = true;
        if busy {
            for s in self.streams {
                match coord
                    .unsafe_call("dropping a staging stream", Request::new(), |gate| rt.stream_synchronize(gate, s))
                {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(error = %e, "synchronizing a staging stream at drop failed"),
                    Err(e) => {
                        tracing::error!(error = %e, "staging buffers leaked (engine dropped with jobs in flight inside a capture window)");
                        idle = false;
                    }
                }
            }
        }
        for e in self.joins {
            if let Err(err) = rt.event_destroy(e) {
                tracing::warn!(error = %err, "destroying a staging event failed");
            }
        }
        if idle {
            // SAFETY: `idle`: no job was in flight (each job's completion
            // event covers its staging streams, which are joined back), or
            // both staging streams were synchronized above; nothing keeps
            // `base` after this.
            match coord.unsafe_call("freeing the staging buffers", Request::new(), |gate| unsafe {
                rt.mem_free(gate, self.base)
            }) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "freeing the staging buffers failed"),
                Err(e) => tracing::warn!(error = %e, "staging buffers leaked (dropped inside a capture window)"),
            }
        }
        for s in self.streams {
            if let Err(e) = rt.stream_destroy(s) {
                tracing::warn!(error = %e, "destroying a staging stream failed");
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frag(host: usize, device: u64, bytes: usize) -> Fragment {
        Fragment { host, device: DevicePtr(device), bytes }
    }

    #[test]
    fn host_blocks_become_runs_in_host_order() {
        // Two host blocks of two 64-byte pages, listed layer by layer (as
        // the expansion does): pages of one block are far apart in the list.
        let frags =
            [frag(1000, 1 << 20, 64), frag(5000, 2 << 20, 64), frag(1064, 3 << 20, 64), frag(5064, 4 << 20, 64)];
        let p = Plan::new(&frags, 4096, 100, |_| usize::MAX);
        assert_eq!(p.runs, vec![Run { host: 1000, off: 0, bytes: 128 }, Run { host: 5000, off: 128, bytes: 128 }]);
        assert_eq!(p.chunks, vec![Chunk { pieces: 0..4, runs: 0..2 }]);
        assert_eq!(p.mean_run_bytes(), 128);
        assert_eq!(p.pieces[1], Piece { frag: frag(1064, 3 << 20, 64), off: 64 });
    }

    #[test]
    fn chunks_fill_then_cut_fragments() {
        // 100 + 100 bytes into 128-byte chunks: the second fragment is cut;
        // the 16-byte alignment of a new run moves it to offset 112.
        let p = Plan::new(&[frag(0, 0, 100), frag(10_000, 500, 100)], 128, 100, |_| usize::MAX);
        assert_eq!(
            p.pieces,
            vec![
                Piece { frag: frag(0, 0, 100), off: 0 },
                Piece { frag: frag(10_000, 500, 16), off: 112 },
                Piece { frag: frag(10_016, 516, 84), off: 0 },
            ]
        );
        assert_eq!(p.chunks.len(), 2);
        // At most 2 entries a chunk.
        let p = Plan::new(&[frag(0, 0, 16), frag(16, 100, 16), frag(32, 200, 16)], 4096, 2, |_| usize::MAX);
        assert_eq!(p.chunks, vec![Chunk { pieces: 0..2, runs: 0..1 }, Chunk { pieces: 2..3, runs: 1..2 }]);
        // Registrations of 40 bytes: runs and pieces cut at 40 and 80.
        let p = Plan::new(&[frag(0, 0, 16), frag(16, 100, 48), frag(64, 200, 16)], 4096, 100, |a| (a / 40 + 1) * 40);
        assert_eq!(p.runs, vec![Run { host: 0, off: 0, bytes: 40 }, Run { host: 40, off: 48, bytes: 40 }]);
        assert_eq!(p.pieces.len(), 4, "{:?}", p.pieces);
    }

    proptest! {
        /// Any disjoint fragments, any staging size: every byte of every
        /// fragment is in exactly one piece, pieces of a chunk fit its
        /// buffer without overlapping, each chunk holds at most the table's
        /// entries, and every run is contiguous on both sides and covers
        /// exactly its chunk's pieces.
        #[test]
        fn plans_cover_every_byte_once(
            sizes in proptest::collection::vec(1usize..300, 1..40),
            half in 16usize..700,
            entries in 1usize..9,
            seed in any::<u64>(),
            reg in 0usize..3,
        ) {
            // Registrations: none, or back to back every 96 or 1000 bytes.
            let reg_len = [usize::MAX, 96, 1000][reg];
            let chunk_end = move |a: usize| if reg_len == usize::MAX { usize::MAX } else { (a / reg_len + 1) * reg_len };
            // Disjoint host and device ranges in shuffled orders, some
            // host-adjacent.
            let mut host = 4096usize;
            let mut frags = Vec::new();
            let mut s = seed;
            for (i, &b) in sizes.iter().enumerate() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if s >> 62 == 0 { host += 8 + (s as usize % 64); }
                frags.push(frag(host, (i as u64) << 20, b));
                host += b;
            }
            for i in (1..frags.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                frags.swap(i, (s >> 33) as usize % (i + 1));
            }
            let p = Plan::new(&frags, half, entries, chunk_end);
            prop_assert_eq!(p.bytes, sizes.iter().sum::<usize>() as u64);
            // Every byte once: pieces sorted by host tile the fragments.
            let mut covered: Vec<(usize, u64, usize)> = p.pieces.iter().map(|x| (x.frag.host, x.frag.device.raw(), x.frag.bytes)).collect();
            covered.sort_unstable();
            let mut want: Vec<(usize, u64, usize)> = frags.iter().map(|f| (f.host, f.device.raw(), f.bytes)).collect();
            want.sort_unstable();
            let mut wi = want.into_iter();
            let mut cur = wi.next();
            for (h, d, b) in covered {
                let (wh, wd, wb) = cur.unwrap();
                prop_assert_eq!((h, d), (wh, wd));
                prop_assert!(b <= wb);
                cur = if b == wb { wi.next() } else { Some((wh + b, wd + b as u64, wb - b)) };
            }
            prop_assert!(cur.is_none());
            let mut next_piece = 0;
            let mut next_run = 0;
            for ch in &p.chunks {
                prop_assert_eq!(ch.pieces.start, next_piece);
                prop_assert_eq!(ch.runs.start, next_run);
                prop_assert!(!ch.pieces.is_empty() && ch.pieces.len() <= entries);
                let mut spans: Vec<(usize, usize)> = p.pieces[ch.pieces.clone()].iter().map(|x| (x.off, x.frag.bytes)).collect();
                spans.sort_unstable();
                for w in spans.windows(2) {
                    prop_assert!(w[0].0 + w[0].1 <= w[1].0);
                }
                prop_assert!(spans.iter().all(|&(o, b)| o + b <= half));
                // Runs: each piece lies in one run, host and staging alike.
                let runs = &p.runs[ch.runs.clone()];
                let mut run_bytes = 0;
                for r in runs {
                    prop_assert_eq!(r.off % RUN_ALIGN, 0);
                    prop_assert!(r.host + r.bytes <= chunk_end(r.host), "run {:?} spans two registrations", r);
                    run_bytes += r.bytes;
                }
                for x in &p.pieces[ch.pieces.clone()] {
                    let inside = runs.iter().any(|r| {
                        x.frag.host >= r.host
                            && x.frag.host + x.frag.bytes <= r.host + r.bytes
                            && x.frag.host - r.host == x.off - r.off
                    });
                    prop_assert!(inside, "piece {:?} in no run of {:?}", x, runs);
                }
                let piece_bytes: usize = p.pieces[ch.pieces.clone()].iter().map(|x| x.frag.bytes).sum();
                prop_assert_eq!(run_bytes, piece_bytes);
                next_piece = ch.pieces.end;
                next_run = ch.runs.end;
            }
            prop_assert_eq!(next_piece, p.pieces.len());
            prop_assert_eq!(next_run, p.runs.len());
        }
    }
}
