//! The simulated device: one thread that executes stream work
//! asynchronously, in order per stream, the way the GPU does.

use crate::runtime::{Code, GATHER_ENTRY_WORDS};
use crate::sync::{self, Arc};

use super::fault::HoldPoint;
use super::state::{Op, State};
use super::Inner;

/// A memory effect resolved to raw pointers while the state lock was held.
enum Action {
    Copy { dst: *mut u8, src: *const u8, bytes: usize },
    Fill { dst: *mut u8, value: u8, bytes: usize },
}

/// Runs until the runtime stops: takes the first ready operation of any
/// stream, executes it outside the lock, marks it complete, wakes waiters.
pub(crate) fn run(inner: Arc<Inner>) {
    let mut g = sync::lock(&inner.state);
    loop {
        let mut retired = false;
        let next = next_ready(&mut g, &mut retired);
        if retired {
            // A retired event wait completes its stream up to that point:
            // an event recorded right after it (nothing else enqueued since)
            // is complete now, and its waiters must hear of it.
            inner.cv.notify_all();
        }
        if let Some((sid, seq, op)) = next {
            g.device_busy = true;
            g = inner.hold_at(g, HoldPoint::DeviceOp);
            let plan = if g.poisoned.is_some() { Ok(Vec::new()) } else { resolve(&mut g, &op) };
            drop(g);
            let outcome = plan.map(|actions| execute(&actions));
            g = sync::lock(&inner.state);
            if let Err(code) = outcome {
                // A device fault is sticky: every later call reports it
                // (FACTS 1, "replayed after that memory was unregistered").
                tracing::debug!(%code, "sim: device fault, context poisoned");
                g.poisoned.get_or_insert(code);
            }
            g.device_busy = false;
            if let Some(s) = g.stream_mut(sid) {
                s.completed = seq;
            }
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
/// retired on the spot; a stream whose head waits on unfinished work is
/// skipped, so streams progress independently.
fn next_ready(st: &mut State, retired: &mut bool) -> Option<(u64, u64, Op)> {
    let ids: Vec<u64> = st.streams.keys().copied().collect();
    for sid in ids {
        while let Some((seq, Op::WaitEvent { stream, seq: want })) = st.streams[&sid].queue.front().cloned() {
            let done = st.streams.get(&stream).is_none_or(|o| o.completed >= want);
            if !done {
                break;
            }
            let s = st.streams.get_mut(&sid)?;
            s.queue.pop_front();
            s.completed = seq;
            *retired = true;
        }
        let s = st.streams.get_mut(&sid)?;
        if matches!(s.queue.front(), Some((_, op)) if !matches!(op, Op::WaitEvent { .. })) {
            let (seq, op) = s.queue.pop_front()?;
            return Some((sid, seq, op));
        }
    }
    None
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
        Op::Spin | Op::WaitEvent { .. } => {}
        Op::Gather { table, count } => {
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
                let src = st.device_slice(e[0], bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
                let dst = st.device_slice(e[1], bytes).ok_or(Code::ILLEGAL_ADDRESS)?;
                out.push(Action::Copy { dst, src, bytes });
            }
        }
        Op::Graph(body) => {
            // FACTS 1: a graph whose copies used registered host memory,
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

fn execute(actions: &[Action]) {
    for a in actions {
        match *a {
            // SAFETY: device ranges were bounds-checked against live
            // allocations under the lock, and allocations are freed only when
            // the device is idle (mem_free waits), so they outlive this
            // operation; host ranges are valid until the operation completes
            // by the contract of the unsafe enqueue that created it. `copy`
            // tolerates overlap.
            Action::Copy { dst, src, bytes } => unsafe { std::ptr::copy(src, dst, bytes) },
            // SAFETY: as above, `dst..dst+bytes` is a checked live range.
            Action::Fill { dst, value, bytes } => unsafe { std::ptr::write_bytes(dst, value, bytes) },
        }
    }
}
