//! The copy backends and how each enqueues a job's fragments on a stream:
//! one async copy per fragment, one batched copy (`cuMemcpyBatchAsync`), the
//! gather kernel reading a descriptor table, or the gather kernel into a
//! device staging buffer and batched copies of it (`super::staged`).

use crate::names::named;
use crate::runtime::{DevicePtr, Direction, DriverResult, Fragment, GpuRuntime, Kernel, Stream, GATHER_ENTRY_WORDS};

/// A way of moving a job's fragments.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    /// One `cuMemcpy{HtoD,DtoH}Async` per fragment (2.5 - 3.7 us each on an
    /// H200: docs/driver-rules.md, row "One copy call"): works everywhere,
    /// pageable memory and captures too.
    PerFragment,
    /// One `cuMemcpyBatchAsync` for the job. Never issued on a capturing
    /// stream (900, and the graph silently copies nothing:
    /// docs/driver-rules.md, row "Batched copy inside a capture").
    Batched,
    /// The gather kernel reading registered host memory through its device
    /// alias; only for host ranges whose registration completed (P3).
    Gather,
    /// The gather kernel packs the job's GPU pages into a device staging
    /// buffer (a load: scatters from it), and batched copies move the
    /// staging buffer to or from the job's contiguous host runs on the copy
    /// engine (`super::staged`). Never on a capturing stream (batched
    /// copies); needs the handler's staging buffers
    /// ([`super::TransferOptions::staging_bytes`]).
    Staged,
}

named!(Backend, "backend" {
    PerFragment => "per-fragment",
    Batched => "batched",
    Gather => "gather",
    Staged => "staged",
});

/// Which backend an engine uses for its jobs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// Chosen per job by fragment size, pin state and capture state
    /// ([`super::select`]).
    #[default]
    Auto,
    /// This backend whenever it is allowed; when it is not (batched or
    /// staged on a capturing stream, gather on memory that is not
    /// registered, staged without staging buffers) the job
    /// falls back to per-fragment copies, and its result says so.
    Force(Backend),
}

named!(BackendChoice, "backend" {
    Auto => "auto",
    Force(Backend::PerFragment) => "per-fragment",
    Force(Backend::Batched) => "batched",
    Force(Backend::Gather) => "gather",
    Force(Backend::Staged) => "staged",
});

/// Fragments per `cuMemcpyBatchAsync` call (4096 in one call were measured:
/// docs/driver-rules.md, row "Batched copy"; larger jobs take several
/// calls).
pub(crate) const BATCH_MAX: usize = 4096;

/// Enqueues one async copy per fragment; stops at the first failure.
///
/// # Safety
/// Every fragment's host range stays mapped (and, for a store, untouched)
/// and its device range allocated until the stream has executed the copies.
pub(crate) unsafe fn per_fragment(
    rt: &dyn GpuRuntime,
    dir: Direction,
    frags: &[Fragment],
    s: Stream,
) -> DriverResult<()> {
    for f in frags {
        match dir {
            // SAFETY: forwarded from this function's contract.
            Direction::HostToDevice => unsafe { rt.copy_htod_async(f.device, f.host, f.bytes, s) }?,
            // SAFETY: forwarded from this function's contract.
            Direction::DeviceToHost => unsafe { rt.copy_dtoh_async(f.host, f.device, f.bytes, s) }?,
        }
    }
    Ok(())
}

/// Enqueues the fragments with `cuMemcpyBatchAsync`, [`BATCH_MAX`] per call.
/// The caller has checked that `s` is not capturing.
///
/// # Safety
/// As for [`per_fragment`].
pub(crate) unsafe fn batched(rt: &dyn GpuRuntime, dir: Direction, frags: &[Fragment], s: Stream) -> DriverResult<()> {
    for piece in frags.chunks(BATCH_MAX) {
        // SAFETY: forwarded from this function's contract.
        unsafe { rt.copy_batch_async(dir, piece, s) }?;
    }
    Ok(())
}

/// A handler's descriptor table in device memory. Reused by every job of
/// the handler: each upload is ordered after the previous kernel by the
/// stream.
#[derive(Copy, Clone, Debug)]
pub(crate) struct GatherTable {
    pub ptr: DevicePtr,
    pub entries: usize,
}

/// The gather descriptor entry `[src, dst, bytes]` of `f`, whose host
/// address has the device alias `host`.
pub(crate) fn entry(dir: Direction, f: Fragment, host: DevicePtr) -> [u64; 3] {
    let (src, dst) = match dir {
        Direction::HostToDevice => (host, f.device),
        Direction::DeviceToHost => (f.device, host),
    };
    [src.raw(), dst.raw(), f.bytes as u64]
}

/// Uploads `staging` (an encoded table) piece by piece into `table` and
/// launches the gather kernel on each piece, all on stream `s`. From
/// page-locked `staging` the uploads are asynchronous; from pageable memory
/// each first synchronizes the stream (CUDA's pageable-copy semantics).
///
/// # Safety
/// `staging` stays alive and unchanged until the stream has executed the
/// uploads; every address in it is a device address or the device alias of
/// host memory that stays registered until the kernels have run, and every
/// host range stays mapped (and untouched, for a store) until then.
pub(crate) unsafe fn gather(rt: &dyn GpuRuntime, table: GatherTable, staging: &[u64], s: Stream) -> DriverResult<()> {
    let per = table.entries.max(1) * GATHER_ENTRY_WORDS;
    for piece in staging.chunks(per) {
        let count = (piece.len() / GATHER_ENTRY_WORDS) as u32;
        // SAFETY: `piece` lives until the job completes (caller's contract),
        // and `table` holds `table.entries` entries, at least this piece.
        unsafe { rt.copy_htod_async(table.ptr, piece.as_ptr() as usize, piece.len() * 8, s) }?;
        // SAFETY: the table was just uploaded on `s` and stays in place
        // until the next upload, which `s` orders after this kernel; every
        // entry names valid device memory or registered host memory (the
        // caller's contract).
        unsafe { rt.launch(Kernel::Gather { table: table.ptr, count }, s) }?;
    }
    Ok(())
}
