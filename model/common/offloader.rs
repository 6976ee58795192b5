//! The small offloader the models of the engine's edge drive
//! (`p4_offloader.rs`, `p5_offloader.rs`, `p1_hook.rs`): one KV tensor of 4
//! GPU blocks of [`PAGE`] bytes on a simulated GPU, with the fewest driver
//! calls (no pre-faulting, no huge pages, one pinning thread, per-fragment
//! copies, no page-locked ring, no staging buffers: the backends are
//! checked by P1, P3 and P5 on their own), and the block reads and writes
//! those models check with.

use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::{
    Backend, BackendChoice, Completion, GpuRuntime, HugePages, KeyedOffloader, KvAlloc, Offloader, OffloaderOptions,
    PinOptions, PrefaultMode, Request, SimRuntime, TransferOptions,
};

/// Bytes of one GPU block (and of one host block: one tensor).
pub const PAGE: usize = 64;

/// `opts` with the models' lean pinning and transfer settings; with
/// `chunk_bytes`, registration chunks of that many bytes (one page: a
/// chunk per host block, so pinning has several steps to interleave).
pub fn lean(mut opts: OffloaderOptions, chunk_bytes: Option<usize>) -> OffloaderOptions {
    let pin = PinOptions::default().prefault(PrefaultMode::Off).huge_pages(HugePages::Off).threads(1);
    opts.pin = match chunk_bytes {
        Some(c) => pin.max_chunk_bytes(c),
        None => pin,
    };
    opts.transfer = TransferOptions {
        backend: BackendChoice::Force(Backend::PerFragment),
        staging_ring_entries: 0,
        staging_bytes: 0,
        ..TransferOptions::default()
    };
    opts
}

/// The KV tensors of the models' offloaders: one tensor of 4 GPU blocks.
const KV: KvAlloc = KvAlloc { tensors: 1, page_bytes: PAGE, gpu_blocks: 4, block_factor: 1 };

/// The (slot-addressed) offloader over one tensor of 4 GPU blocks on `rt`,
/// with `variant` (a negative model's knob, or `Variant::Correct`).
pub fn offloader_on(rt: Arc<dyn GpuRuntime>, opts: OffloaderOptions, variant: Variant) -> Offloader {
    let off = Offloader::with_allocated_tensors(rt, KV, opts).expect("offloader on the simulated GPU");
    kvoffload::internal::offloader::set_variant(&off, variant);
    off
}

/// The keyed offloader over one tensor of 4 GPU blocks on `rt`, with
/// `variant`.
pub fn keyed_on(rt: Arc<dyn GpuRuntime>, opts: OffloaderOptions, variant: Variant) -> KeyedOffloader {
    let off = KeyedOffloader::with_allocated_tensors(rt, KV, opts).expect("offloader on the simulated GPU");
    kvoffload::internal::offloader::set_variant(off.core(), variant);
    off
}

/// Fills GPU block `block` with `fill` (a synchronous copy).
pub fn write_block(off: &Offloader, block: usize, fill: u8) {
    let buf = [fill; PAGE];
    let dst = off.geometry().tensors()[0].offset(block * PAGE);
    // SAFETY: `buf` is readable; `dst` is GPU block `block` of the
    // offloader's tensor, which no job touches now.
    unsafe { off.geometry().runtime.copy_htod(dst, buf.as_ptr() as usize, PAGE) }.unwrap();
}

/// GPU block `block`'s bytes (a synchronous copy).
pub fn read_block(off: &Offloader, block: usize) -> [u8; PAGE] {
    let mut buf = [0u8; PAGE];
    let src = off.geometry().tensors()[0].offset(block * PAGE);
    // SAFETY: `buf` is writable; the job that wrote `src` was waited for.
    unsafe { off.geometry().runtime.copy_dtoh(buf.as_mut_ptr() as usize, src, PAGE) }.unwrap();
    buf
}

/// Polls until `n` jobs were reported; returns them.
pub fn poll_n(off: &Offloader, n: usize) -> Vec<Completion> {
    let mut done = Vec::new();
    while done.len() < n {
        off.poll_each(&mut |c| done.push(c));
        thread::yield_now();
    }
    done
}

/// The simulated GPU behind `rt`.
pub fn sim(rt: &Arc<dyn GpuRuntime>) -> &SimRuntime {
    rt.as_sim().unwrap()
}

/// A slot-addressed offloader of one KV tensor of 4 GPU blocks and `slots`
/// host slots on a fresh simulated GPU, with `variant`, pinned (its pinner
/// joined) before it returns: the models of the capture hook's close and
/// of the interruptible waits, whose threads start after pinning.
pub fn pinned(slots: usize, variant: Variant) -> (Arc<dyn GpuRuntime>, Arc<Offloader>) {
    use kvoffload::PinState;
    let rt = kvoffload::shared(SimRuntime::new());
    let opts = lean(OffloaderOptions::with_host_blocks(slots), None);
    let off = Arc::new(offloader_on(rt.clone(), opts, variant));
    assert_eq!(off.wait_pinned(Request::new()).unwrap().state, PinState::Pinned);
    (rt, off)
}

/// Host slot `slot`'s page, read from the region (mapped until the
/// offloader is dropped, also after shutdown).
pub fn slot_bytes(off: &Offloader, slot: usize) -> [u8; PAGE] {
    let addr = off.geometry().layout.host_addr(0, 0, slot, 0);
    let mut out = [0u8; PAGE];
    // SAFETY: a page of this rank's slot of the mapped region; the job
    // that wrote it was reported or drained.
    out.copy_from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, PAGE) });
    out
}

/// Every job reported from now until `wait_all` returned, then one more
/// poll: the jobs still to be reported, each once (a job submitted twice
/// would be reported twice, or refused and reported failed).
pub fn drain_reports(off: &Offloader) -> Vec<Completion> {
    off.wait_all(Request::new(), &mut drop).expect("wait_all from a thread without a window");
    let mut done = Vec::new();
    off.poll_each(&mut |c| done.push(c));
    done
}

/// The end of a model whose `n` slot stores of `fill`'s GPU block went to
/// slots `0..n`: each reported (polled) once and succeeded, its bytes in
/// its slot; then the offloader shuts down.
pub fn stores_landed_then_shutdown(off: &Offloader, n: usize, fill: u8) {
    let done = poll_n(off, n);
    assert!(done.iter().all(|d| d.error.is_none()), "a store failed: {done:?}");
    assert!(drain_reports(off).is_empty(), "a job reported twice");
    for i in 0..n {
        assert_eq!(slot_bytes(off, i), [fill; PAGE], "a store's bytes are not in its slot");
    }
    off.shutdown(Request::new(), &mut drop).unwrap();
}
