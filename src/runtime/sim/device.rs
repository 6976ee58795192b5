//! The simulated device: worker threads (one by default, `SimConfig::workers`)
//! that execute stream work asynchronously, in order per stream, the
//! streams independently, the way the GPU does.

use crate::runtime::pattern;
use crate::runtime::{Code, DevicePtr, Kernel, GATHER_ENTRY_WORDS, PATTERN_ENTRY_WORDS};
use crate::sync::{self, Arc};

use super::fault::HoldPoint;
use super::state::{Op, State};
use super::Inner;

/// A memory effect resolved to raw pointers while the state lock was held.
enum Action {
    Copy {
        dst: *mut u8,
        src: *const u8,
        bytes: usize,
    },
    Fill {
        dst: *mut u8,
        value: u8,
        bytes: usize,
    },
    /// Words `first_word..` of the contents of `key` into `bytes` at `dst`.
    Pattern {
        dst: *mut u8,
        key: u64,
        first_word: u64,
        bytes: usize,
    },
    /// Adds the number of words of `bytes` at `src` that differ from words
    /// `first_word..` of `key` to the (unaligned-safe) `u32` at `count`.
    Check {
        src: *const u8,
        key: u64,
        first_word: u64,
        bytes: usize,
        count: *mut u8,
    },
}

/// Bytes the pattern actions generate or compare at a time (a multiple of 8,
/// so every piece but the last starts on a word).
const PATTERN_PIECE: usize = 64 << 10;

/// One device worker, until the runtime stops: takes the first ready
/// operation of any stream no other worker is executing, executes it
/// outside the lock, marks it complete, wakes waiters.
pub(crate) fn run(inner: Arc<Inner>) {
    let mut g = sync::lock(&inner.state);
    loop {
        let mut retired = false;
        let next = next_ready(&mut g, &mut retired);
        if retired {
            // A retired event wait completes its stream up to that point:
            // an event recorded right after it (nothing else enqueued since)
            // is complete now, and its waiters must hear of it.
            g.drop_drained();
            inner.cv.notify_all();
        }
        if let Some((sid, seq, op)) = next {
            g = inner.hold_at(g, HoldPoint::DeviceOp);
            let outcome = {
                // The tables the operation reads and its memory actions,
                // under `touching_memory` (taken after the state lock, as
                // everywhere).
                let _mem = inner.touching_memory();
                let plan = if g.poisoned.is_some() { Ok(Vec::new()) } else { resolve(&mut g, &op) };
                drop(g);
                plan.map(|actions| execute(&actions))
            };
            g = sync::lock(&inner.state);
            if let Err(code) = outcome {
                // A device fault is sticky: every later call reports it
                // (docs/driver-rules.md, row "Replay after unregister").
                tracing::debug!(%code, "sim: device fault, context poisoned");
                g.poisoned.get_or_insert(code);
            }
            g.complete(sid, seq);
            if let Some(s) = g.device_stream_mut(sid) {
                s.executing = false;
            }
            g.drop_drained();
            inner.cv.notify_all();
            continue;
        }
        if g.stop {
            break;
        }
        g = sync::wait(&inner.cv, g);
    }
}

/// Pops the next executable operation. Event waits that are satisfied are
/// retired on the spot; a stream whose head waits on unfinished work, or
/// whose previous operation another worker still executes, is skipped, so
/// streams progress independently and each in order. A wait retired in a
/// pass can satisfy a wait of a stream the pass already visited (a stream
/// that only waits for another, joined back into a third), so the streams
/// are passed over again until a pass retires nothing: the device never
/// sleeps with a satisfied wait (tests/sim_runtime.rs,
/// `a_wait_satisfied_late_in_the_devices_pass_is_retired`).
fn next_ready(st: &mut State, retired: &mut bool) -> Option<(u64, u64, Op)> {
    // Oldest stream first, destroyed ones with work left among them.
    let mut ids: Vec<u64> = st.streams.keys().chain(st.draining.keys()).copied().collect();
    ids.sort_unstable();
    loop {
        let mut progressed = false;
        for &sid in &ids {
            if st.device_stream(sid)?.executing {
                continue;
            }
            while let Some((seq, Op::WaitEvent { stream, seq: want })) = st.device_stream(sid)?.queue.front().cloned() {
                if !st.reached(stream, want) {
                    break;
                }
                st.device_stream_mut(sid)?.queue.pop_front();
                st.complete(sid, seq);
                *retired = true;
                progressed = true;
            }
            let s = st.device_stream_mut(sid)?;
            if matches!(s.queue.front(), Some((_, op)) if !matches!(op, Op::WaitEvent { .. })) {
                let (seq, op) = s.queue.pop_front()?;
                // Taken off the queue, not yet complete: the stream waits
                // for this worker, and the device is not idle.
                s.executing = true;
                return Some((sid, seq, op));
            }
        }
        if !progressed {
            return None;
        }
    }
}

/// Turns an operation into raw memory actions, checking every range.
fn resolve(st: &mut State, op: &Op) -> Result<Vec<Action>, Code> {
    let mut out = Vec::new();
    resolve_into(st, op, &mut out)?;
    Ok(out)
}

fn resolve_into(st: &mut State, op: &Op, out: &mut Vec<Action>) -> Result<(), Code> {
    match op {
        Op::HtoD { dst, src, bytes } => {
            let d = st.device_slice(*dst, *bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
            out.push(Action::Copy { dst: d, src: *src as *const u8, bytes: *bytes });
        }
        Op::DtoH { dst, src, bytes } => {
            let s = st.device_slice(*src, *bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
            out.push(Action::Copy { dst: *dst as *mut u8, src: s, bytes: *bytes });
        }
        Op::Memset { dst, value, bytes } => {
            let d = st.device_slice(*dst, *bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
            out.push(Action::Fill { dst: d, value: *value, bytes: *bytes });
        }
        Op::Kernel(Kernel::Spin { .. }) | Op::WaitEvent { .. } => {}
        Op::Kernel(Kernel::Gather { table, count }) => {
            // The kernel reads its descriptor table from device memory, then
            // every source and destination through the device's view: device
            // memory, or host memory through its alias, valid only while that
            // host range is registered. Anything else is a device fault, as on
            // the real GPU (ILLEGAL_ADDRESS, sticky).
            let words = (*count as usize).checked_mul(GATHER_ENTRY_WORDS).ok_or(Code::ILLEGAL_ADDRESS)?;
            let table = st.read_device_words(*table, words).ok_or(Code::ILLEGAL_ADDRESS)?;
            for e in table.chunks_exact(GATHER_ENTRY_WORDS) {
                let bytes = usize::try_from(e[2]).map_err(|_| Code::ILLEGAL_ADDRESS)?;
                if bytes == 0 {
                    continue;
                }
                let src = st.device_slice(DevicePtr(e[0]), bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
                let dst = st.device_slice(DevicePtr(e[1]), bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
                out.push(Action::Copy { dst, src, bytes });
            }
        }
        Op::Kernel(Kernel::PatternFill { table, count }) => {
            // Like Gather: the table, then every range through the device's
            // view (host memory only through the alias of a registered range).
            for e in pattern_table(st, *table, *count)? {
                let (dst, key, first_word, bytes) = e;
                if bytes == 0 {
                    continue;
                }
                let dst = st.device_slice(DevicePtr(dst), bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
                out.push(Action::Pattern { dst, key, first_word, bytes });
            }
        }
        Op::Kernel(Kernel::PatternCheck { table, count, out: counts }) => {
            let entries = pattern_table(st, *table, *count)?;
            if entries.is_empty() {
                return Ok(());
            }
            // The kernel adds with 4-byte atomics: a misaligned `out` faults
            // on the GPU. The sim wants all `4 count` bytes valid up front
            // (the GPU faults only when an entry has mismatches to add).
            if counts.raw() % 4 != 0 {
                return Err(Code::MISALIGNED_ADDRESS);
            }
            let cbytes = entries.len().checked_mul(4).ok_or(Code::ILLEGAL_ADDRESS)?;
            let base = st.device_slice(*counts, cbytes).ok_or(Code::ILLEGAL_ADDRESS)?;
            for (i, (src, key, first_word, bytes)) in entries.into_iter().enumerate() {
                if bytes == 0 {
                    continue;
                }
                let src = st.device_slice(DevicePtr(src), bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
                out.push(Action::Check { src, key, first_word, bytes, count: base.wrapping_add(4 * i) });
            }
        }
        Op::Graph(body) => {
            // docs/driver-rules.md, row "Replay after unregister": a graph
            // whose copies used registered host memory,
            // replayed after that memory was unregistered, faults on the
            // device: launch said OK, the next synchronize says 719.
            if body.registered_refs.iter().any(|&(a, n)| st.registered_range(a, n).is_none()) {
                return Err(Code::LAUNCH_FAILED);
            }
            for inner in &body.ops {
                resolve_into(st, inner, out)?;
            }
        }
    }
    Ok(())
}

/// The entries `(address, key, first_word, bytes)` of a pattern table, read
/// from device memory when the kernel runs. The kernel loads the table with
/// 8-byte loads: a misaligned table is a device fault.
fn pattern_table(st: &mut State, table: DevicePtr, count: u32) -> Result<Vec<(u64, u64, u64, usize)>, Code> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if table.raw() % 8 != 0 {
        return Err(Code::MISALIGNED_ADDRESS);
    }
    let words = (count as usize).checked_mul(PATTERN_ENTRY_WORDS).ok_or(Code::ILLEGAL_ADDRESS)?;
    let words = st.read_device_words(table, words).ok_or(Code::ILLEGAL_ADDRESS)?;
    words
        .chunks_exact(PATTERN_ENTRY_WORDS)
        .map(|e| Ok((e[0], e[1], e[2], usize::try_from(e[3]).map_err(|_| Code::ILLEGAL_ADDRESS)?)))
        .collect()
}

/// Writes the pattern words of an [`Action::Pattern`], a piece at a time.
///
/// # Safety
/// `dst..dst+bytes` is a live range nothing else accesses meanwhile.
unsafe fn write_pattern(dst: *mut u8, key: u64, first_word: u64, bytes: usize) {
    let mut piece = vec![0u8; bytes.min(PATTERN_PIECE)];
    let mut off = 0;
    while off < bytes {
        let n = (bytes - off).min(PATTERN_PIECE);
        pattern::fill_from(key, first_word.wrapping_add((off / 8) as u64), &mut piece[..n]);
        // SAFETY: `off + n <= bytes`, inside the caller's range; `piece` is
        // a separate allocation of at least `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), dst.add(off), n) };
        off += n;
    }
}

/// Counts the mismatching words of an [`Action::Check`] and adds them to
/// its counter (wrapping, like the kernel's 32-bit atomic add).
///
/// # Safety
/// `src..src+bytes` is a live readable range, `count..count+4` a live
/// writable one, and nothing writes them meanwhile.
unsafe fn check_pattern(src: *const u8, key: u64, first_word: u64, bytes: usize, count: *mut u8) {
    let mut piece = vec![0u8; bytes.min(PATTERN_PIECE)];
    let (mut off, mut bad) = (0, 0u64);
    while off < bytes {
        let n = (bytes - off).min(PATTERN_PIECE);
        // SAFETY: `off + n <= bytes`, inside the caller's range; `piece` is
        // a separate allocation of at least `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.add(off), piece.as_mut_ptr(), n) };
        bad += pattern::mismatched_words(key, first_word.wrapping_add((off / 8) as u64), &piece[..n]);
        off += n;
    }
    if bad != 0 {
        let c = count as *mut u32;
        // SAFETY: `count..count+4` is live and writable (caller); unaligned
        // accesses need no alignment.
        unsafe { c.write_unaligned(c.read_unaligned().wrapping_add(bad as u32)) };
    }
}

fn execute(actions: &[Action]) {
    for a in actions {
        match *a {
            // SAFETY: device ranges were bounds-checked against live
            // allocations (or adopted host ranges) under the lock, and both
            // are freed only when the device is idle (mem_free and
            // release_adopted wait; adopted memory stays valid until then by
            // the contract of adopt_host_memory), so they outlive this
            // operation; host ranges are valid until the operation completes
            // by the contract of the unsafe enqueue that created it. `copy`
            // tolerates overlap.
            Action::Copy { dst, src, bytes } => unsafe { std::ptr::copy(src, dst, bytes) },
            // SAFETY: as above, `dst..dst+bytes` is a checked live range.
            Action::Fill { dst, value, bytes } => unsafe { std::ptr::write_bytes(dst, value, bytes) },
            // SAFETY: as for Copy: a checked live range, valid until this
            // operation completes.
            Action::Pattern { dst, key, first_word, bytes } => unsafe { write_pattern(dst, key, first_word, bytes) },
            // SAFETY: as for Copy: `src` and the 4-byte counter were checked
            // against live ranges under the lock.
            Action::Check { src, key, first_word, bytes, count } => unsafe {
                check_pattern(src, key, first_word, bytes, count)
            },
        }
    }
}
