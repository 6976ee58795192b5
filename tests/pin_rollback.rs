//! All-or-nothing (P8) on the simulated GPU: a registration failing at the
//! first, a middle or the last chunk, with 801, 900 or 2, leaves no chunk
//! registered, the region pageable with the typed reason, and its memory
//! usable. A pre-fault failure ends the same way with HostMemory.

mod pin_common;

use kvoffload::internal::pin::{memlock, pin_all, PrefaultConfig, Prefaulter, Prepared};
use kvoffload::internal::protocol::Coordinator;
use kvoffload::{page_size, Code, GpuRuntime, PageableReason, PinState, PrefaultMode, Region, Request, SimFault};
use pin_common::{assert_usable, coordinator_over, prepared, region, sim};

const CHUNKS: usize = 5;
const CHUNK: usize = 1 << 20;

fn expected(code: Code, bytes: usize) -> PageableReason {
    match code {
        Code::NOT_SUPPORTED => PageableReason::NotSupported,
        Code::STREAM_CAPTURE_UNSUPPORTED => PageableReason::CaptureUnsupported,
        // 2 names the memlock limit instead where a finite limit is below
        // the region size (this machine's, whatever it is).
        Code::OUT_OF_MEMORY => {
            memlock::refine_with(PageableReason::OutOfMemory, bytes as u64, memlock::memlock_limit())
        }
        _ => unreachable!(),
    }
}

fn fail_at(k: usize, code: Code, background: bool) {
    let (mut r, s, rt, p) = prepared(CHUNKS, CHUNK);
    assert_eq!(p.chunks(), CHUNKS);
    s.inject(SimFault::Register { nth: k as u64 + 1, code });
    let state = if background {
        let h = p.spawn(rt.clone());
        let w = p.coordinator().pinning().wait_final(Request::new()).unwrap();
        assert_eq!(h.join(), w);
        w
    } else {
        p.pin(rt.as_ref())
    };
    let what = format!("failure {code:?} at chunk {k} of {CHUNKS} (background {background})");
    assert_eq!(state, PinState::Pageable(expected(code, r.len())), "{what}");
    assert_eq!(p.coordinator().pinning().state(), state, "{what}");
    assert_eq!(s.registered_ranges(), 0, "{what}: the driver still holds a registration");
    assert_eq!(p.coordinator().pinning().registered_chunks(), 0, "{what}");
    assert_eq!(p.prefaulter().unwrap().workers_running(), 0, "{what}: pre-fault workers outlived pinning");
    assert!(s.poisoned().is_none());
    drop(p);
    assert_usable(&mut r, k as u8);
}

#[test]
fn failure_at_first_middle_last_chunk_rolls_back() {
    for code in [Code::NOT_SUPPORTED, Code::STREAM_CAPTURE_UNSUPPORTED, Code::OUT_OF_MEMORY] {
        for k in [0, CHUNKS / 2, CHUNKS - 1] {
            fail_at(k, code, false);
        }
    }
}

#[test]
fn failure_in_background_mode_rolls_back() {
    for code in [Code::NOT_SUPPORTED, Code::OUT_OF_MEMORY] {
        fail_at(CHUNKS / 2, code, true);
    }
}

#[test]
fn other_driver_codes_are_carried() {
    let (mut r, s, rt, p) = prepared(3, CHUNK);
    s.inject(SimFault::Register { nth: 2, code: Code(999) });
    match p.pin(rt.as_ref()) {
        PinState::Pageable(PageableReason::Driver(e)) => assert_eq!(e.code, Code(999)),
        other => panic!("expected Driver(999), got {other:?}"),
    }
    assert_eq!(s.registered_ranges(), 0);
    drop(p);
    assert_usable(&mut r, 9);
}

#[test]
fn success_registers_every_chunk_and_unregisters_cleanly() {
    let (mut r, s, rt, p) = prepared(CHUNKS, CHUNK);
    assert_eq!(p.pin(rt.as_ref()), PinState::Pinned);
    assert_eq!(s.registered_ranges(), CHUNKS);
    for i in 0..CHUNKS {
        let (a, l) = p.coordinator().pinning().chunk_range(i);
        assert!(s.is_registered(a, l));
    }
    assert_eq!(p.prefaulter().unwrap().workers_running(), 0, "settled after pinning");
    assert_eq!(p.prefaulter().unwrap().stats().bytes, r.len() as u64);
    p.coordinator().pinning().unregister_all(rt.as_ref()).unwrap();
    assert_eq!(s.registered_ranges(), 0);
    drop(p);
    assert_usable(&mut r, 1);
}

#[test]
fn prefault_failure_ends_pageable_host_memory() {
    // A chunk the pre-faulter refuses (not page aligned) fails before any
    // registration of it; the chunks before it are rolled back.
    let (mut r, _) = region(3, CHUNK);
    let base = r.as_ptr() as usize;
    let chunks = [(base, CHUNK), (base + CHUNK + 8, CHUNK - page_size())];
    let (s, rt) = sim();
    let coord = coordinator_over(rt.as_ref(), &r, &chunks);
    // SAFETY: the ranges lie in `r`, alive until after pinning settled.
    let pf = unsafe { Prefaulter::new(PrefaultConfig { threads: 2, mode: PrefaultMode::Populate, huge_pages: false }) };
    match pin_all(rt.as_ref(), &coord, &pf) {
        PinState::Pageable(PageableReason::HostMemory(msg)) => {
            assert!(msg.contains("chunk 1") && msg.contains("page size"), "{msg}")
        }
        other => panic!("expected HostMemory, got {other:?}"),
    }
    assert_eq!(s.registered_ranges(), 0);
    assert_eq!(pf.workers_running(), 0);
    drop(pf);
    drop(coord);
    assert_usable(&mut r, 3);
}

#[test]
fn without_prefault_pinning_still_works() {
    let (r, opts) = region(2, CHUNK);
    let (s, rt) = sim();
    let p = Prepared::new(rt.as_ref(), &r, &opts.prefault(PrefaultMode::Off)).unwrap();
    assert!(p.prefaulter().is_none());
    assert_eq!(p.pin(rt.as_ref()), PinState::Pinned);
    assert_eq!(s.registered_ranges(), 2);
    p.coordinator().pinning().unregister_all(rt.as_ref()).unwrap();
    assert_eq!(s.registered_ranges(), 0);
}

/// Records the registration loop's calls to its pre-faulter (asking for
/// `.1` bytes of lookahead).
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<String>>, usize);

impl kvoffload::internal::pin::Prefault for Recorder {
    fn ensure(&self, i: usize, _addr: usize, _len: usize) -> Result<(), String> {
        self.0.lock().unwrap().push(format!("ensure {i}"));
        Ok(())
    }
    fn hint(&self, i: usize, _addr: usize, _len: usize) {
        self.0.lock().unwrap().push(format!("hint {i}"));
    }
    fn lookahead_bytes(&self) -> usize {
        self.1
    }
    fn settle(&self) {
        self.0.lock().unwrap().push("settle".into());
    }
}

/// Pins `coord`'s chunks with a recorder asking for `lookahead` bytes, then
/// unregisters them: the calls it recorded.
fn pin_recorded(rt: &dyn GpuRuntime, coord: &Coordinator, lookahead: usize) -> Vec<String> {
    let rec = Recorder(Default::default(), lookahead);
    assert_eq!(pin_all(rt, coord, &rec), PinState::Pinned);
    let calls = rec.0.lock().unwrap().clone();
    coord.pinning().unregister_all(rt).unwrap();
    calls
}

/// `n` chunks of `CHUNK` bytes from the start of `r`.
fn chunks_of(r: &Region, n: usize) -> Vec<(usize, usize)> {
    let base = r.as_ptr() as usize;
    (0..n).map(|i| (base + i * CHUNK, CHUNK)).collect()
}

#[test]
fn each_chunk_is_made_resident_before_registration_and_the_next_hinted() {
    let (r, _) = region(3, CHUNK);
    let (s, rt) = sim();
    let coord = coordinator_over(rt.as_ref(), &r, &chunks_of(&r, 3));
    let calls = pin_recorded(rt.as_ref(), &coord, 0);
    assert_eq!(calls, ["ensure 0", "hint 1", "ensure 1", "hint 2", "ensure 2", "settle"]);
    assert_eq!(s.registered_ranges(), 0);
}

#[test]
fn with_lookahead_the_loop_hints_ahead_each_chunk_once_and_in_order() {
    let (r, _) = region(5, CHUNK);
    let chunks = chunks_of(&r, 5);
    let (s, rt) = sim();
    let coord = coordinator_over(rt.as_ref(), &r, &chunks);
    // Two chunks' bytes ahead: while chunk i registers, i+1 and i+2 are
    // queued; the last chunks are hinted once, none past the end.
    assert_eq!(
        pin_recorded(rt.as_ref(), &coord, 2 * CHUNK),
        ["ensure 0", "hint 1", "hint 2", "ensure 1", "hint 3", "ensure 2", "hint 4", "ensure 3", "ensure 4", "settle"]
    );
    drop(coord);
    // A lookahead past the region hints every chunk at once, after the first
    // (a fresh coordinator: pinning is final once per coordinator).
    let coord = coordinator_over(rt.as_ref(), &r, &chunks);
    assert_eq!(
        pin_recorded(rt.as_ref(), &coord, usize::MAX),
        ["ensure 0", "hint 1", "hint 2", "hint 3", "hint 4", "ensure 1", "ensure 2", "ensure 3", "ensure 4", "settle"]
    );
    assert_eq!(s.registered_ranges(), 0);
}
