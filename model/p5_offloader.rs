//! P5 at the engine's edge: through `KeyedOffloader` itself, a key is readable
//! only once its store completed, and a slot being read by a load is never
//! handed to a store.
//!
//! Each scenario builds a `KeyedOffloader` with `with_allocated_tensors` on a
//! simulated GPU with **two device workers** (so the store handler's and
//! the load handler's streams run in either order, as on a GPU: with one
//! worker the older stream goes first and would hide both bugs), one KV
//! tensor of 64-byte GPU blocks, per-fragment copies, no pinning started
//! (the copies run on pageable host memory). 3 threads: main, two device
//! workers; bound 2.
//! - **readable only after its store completed**: the engine stores key 1
//!   (GPU block 0 holds its bytes) and tries to load it into GPU block 1
//!   until the offloader accepts the load (before that it is refused: not
//!   stored yet, the store pending), polling meanwhile; the load must be
//!   accepted only after a poll reported the store, and bring back key 1's
//!   bytes. Paths: `store`, `load` (refused, then accepted),
//!   `poll`, `wait`.
//! - **a slot being read is never reused**: one host block; key 1 stored
//!   and reported; a load of key 1 into GPU block 1 is submitted, then a
//!   store of key 2 (GPU block 2, other bytes) that needs a slot: the only
//!   slot is being read, so it must not be given to key 2 (the store is
//!   refused or skips it) and the load brings back key 1's bytes. Paths:
//!   `store` (with eviction), `load`, `wait_all`, `poll`, `lookup`.
//! - **a refused store changes nothing** (issue 45, item 6; the keyed
//!   layer's contract of issue 43): one host block holding key 1, stored
//!   and reported; pinning cancelled (final, so windows open). Another
//!   thread opens and closes an engine capture window while main stores
//!   key 2, which needs key 1's slot: the store is refused (the window was
//!   open) or accepted. Unless the call reported key 1 in `evicted`, key 1
//!   must still load, with its bytes. Paths: `store` (evicting, refused or
//!   not), `capture_window` on another thread, `load`, `poll`. 5 threads
//!   (main, the window's, two device workers, the pinner, which ends at
//!   once: cancelled before it began).
//!
//! Negatives: N18 (`Variant::ReadableAtSubmit`: keys readable when the
//! store is submitted) -> "a load read key 1 before its store completed"
//! (the load is accepted before `poll` reported the store; the bytes alone
//! would not show it on the sim, whose device workers take the older
//! stream's work first, so the store's copy still lands first);
//! N19 (`Variant::SlotFreedAtLoadSubmit`: a load's slots released when it
//! is submitted) -> "key 1 evicted while its load runs" (the store of key 2
//! takes its slot); N38 (`Variant::RefusedStoreKeepsEvictions`: a store
//! refused at submission keeps the evictions it made, as before issue 43)
//! -> "key 1 is gone although no call reported it evicted".
//!
//! Why it holds: the offloader's block manager marks a stored key
//! write-pending until `poll` applies its completion (refused to loads
//! meanwhile), and a loaded key reading until `poll` applies the load's
//! completion (its slot not evictable meanwhile); `poll` applies only jobs
//! whose completion event the transfer engine saw complete (P5's engine
//! models).

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::offloader::{keyed_on, lean, read_block, write_block, PAGE};
use common::{models, Bounds};
use kvoffload::internal::protocol::Variant;
use kvoffload::internal::sync::{thread, Arc};
use kvoffload::{shared, BlockKey, KeyedOffloader, OffloaderError, OffloaderOptions, Request, SimConfig, SimRuntime};

/// An offloader of one KV tensor of 4 GPU blocks of 64 bytes and
/// `host_blocks` host blocks, on a simulated GPU with two device workers.
fn offloader(host_blocks: usize, variant: Variant) -> KeyedOffloader {
    let rt = shared(SimRuntime::with_config(SimConfig { workers: 2, ..SimConfig::default() }));
    keyed_on(rt, lean(OffloaderOptions::with_host_blocks(host_blocks), None), variant)
}

fn readable_only_after_its_store(variant: Variant) {
    let off = offloader(2, variant);
    write_block(off.core(), 0, 0x11);
    let k = [BlockKey::new(1, 0)];
    let store = off.store(&k, &[0]).unwrap().job.unwrap();
    let mut store_reported = false;
    let job = loop {
        match off.load(&k, &[1]) {
            Ok(job) => break job,
            Err(OffloaderError::Manager(_)) | Err(OffloaderError::NotStored { .. }) => {
                store_reported |= off.poll().iter().any(|c| c.job == store && c.error.is_none());
                thread::yield_now();
            }
            Err(e) => panic!("load refused: {e}"),
        }
    };
    // The contract: readable once `poll` reported the store (the device's
    // order of the two streams alone would not show a load that read too
    // early: the sim's workers take the older stream's work first).
    assert!(store_reported, "a load read key 1 before its store completed (the load was accepted first)");
    off.core().wait(job, Request::new(), &mut drop).unwrap();
    assert_eq!(read_block(off.core(), 1), [0x11; PAGE], "a load read key 1 before its store completed");
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    off.poll();
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}

fn a_slot_being_read_is_not_reused(variant: Variant) {
    let off = offloader(1, variant);
    write_block(off.core(), 0, 0x11);
    write_block(off.core(), 2, 0x22);
    let (k1, k2) = ([BlockKey::new(1, 0)], [BlockKey::new(2, 0)]);
    off.store(&k1, &[0]).unwrap();
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    while off.core().in_flight() > 0 {
        off.poll();
        thread::yield_now();
    }
    let load = off.load(&k1, &[1]).unwrap();
    match off.store(&k2, &[2]) {
        Ok(s) => assert!(s.stored.is_empty() || s.evicted.is_empty(), "key 1 evicted while its load runs: {s:?}"),
        Err(OffloaderError::Manager(_)) => {}
        Err(e) => panic!("store failed: {e}"),
    }
    off.core().wait(load, Request::new(), &mut drop).unwrap();
    assert_eq!(read_block(off.core(), 1), [0x11; PAGE], "the load brought back another key's bytes");
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    while off.core().in_flight() > 0 {
        off.poll();
        thread::yield_now();
    }
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}

fn a_refused_store_changes_nothing(variant: Variant) {
    let off = Arc::new(offloader(1, variant));
    // Pinning final (cancelled before it began), so engine windows open.
    off.core().cancel_pinning();
    off.core().wait_pinned(Request::new()).unwrap();
    write_block(off.core(), 0, 0x11);
    write_block(off.core(), 2, 0x22);
    let (k1, k2) = ([BlockKey::new(1, 0)], [BlockKey::new(2, 0)]);
    off.store(&k1, &[0]).unwrap();
    settle(&off);
    let o2 = off.clone();
    let window = thread::spawn(move || drop(o2.core().capture_window(Request::new()).unwrap()));
    let reported = match off.store(&k2, &[2]) {
        Ok(s) => s.evicted.contains(&k1[0]),
        Err(_) => false,
    };
    window.join().unwrap();
    settle(&off);
    if !reported {
        let load = off.load(&k1, &[1]).expect("key 1 is gone although no call reported it evicted");
        off.core().wait(load, Request::new(), &mut drop).unwrap();
        assert_eq!(read_block(off.core(), 1), [0x11; PAGE], "key 1 came back with other bytes");
        settle(&off);
    }
    off.core().shutdown(Request::new(), &mut drop).unwrap();
}

/// Waits for every job in flight and applies them (`poll`).
fn settle(off: &KeyedOffloader) {
    off.core().wait_all(Request::new(), &mut drop).unwrap();
    while off.core().in_flight() > 0 {
        off.poll();
        thread::yield_now();
    }
}

/// Bound 2: at bound 3 each scenario ran over 5 minutes (the engine's poll
/// loop and two device workers); at 2 each takes about 11 s.
const B: Bounds = Bounds { property: "P5", threads: 3, preemptions: 2, ci: None };
const NEG: Bounds = B;

models! {
    p5_offloader_key_readable_only_after_its_store_completed:
        check("p5_offloader_readable_after_store", B, || readable_only_after_its_store(Variant::Production));
    p5_offloader_slot_being_read_is_not_reused:
        check("p5_offloader_slot_not_reused", B, || a_slot_being_read_is_not_reused(Variant::Production));
    p5_offloader_refused_store_changes_nothing:
        check("p5_offloader_refused_store", Bounds { threads: 5, ..B }.ci_at(1),
            || a_refused_store_changes_nothing(Variant::Production));
    negative_n38_refused_store_keeps_evictions:
        negative("n38_refused_store_keeps_evictions", Bounds { property: "N38", threads: 5, ..NEG },
            "key 1 is gone although no call reported it evicted",
            || a_refused_store_changes_nothing(Variant::RefusedStoreKeepsEvictions));
    negative_n18_keys_readable_at_submit:
        negative("n18_readable_at_submit", Bounds { property: "N18", ..NEG },
            "a load read key 1 before its store completed",
            || readable_only_after_its_store(Variant::ReadableAtSubmit));
    negative_n19_slot_freed_at_load_submit:
        negative("n19_slot_freed_at_load_submit", Bounds { property: "N19", ..NEG },
            "key 1 evicted while its load runs", || a_slot_being_read_is_not_reused(Variant::SlotFreedAtLoadSubmit));
}
