//! Self-test of ci/prove's checker, not a property: a negative model that
//! declares "capture invalidated" but fails for an unrelated reason. Run
//! only by `ci/prove --self-test`, which requires the checker to refuse it
//! ("NOT CAUGHT (failed for another reason: ..)") and, in the same run, to
//! accept a genuine negative (N1).
//!
//! The model mentions the declared reason everywhere except in its failure:
//! on its LOOM-EXPECT line (as every negative does) and on a line of its
//! own output; the panic, raised in a spawned model thread (so the panic
//! hook runs on a loom thread, as a real model's may), says something else.
//! A checker that searched the whole output for the reason, as ci/prove
//! once did, would count it as caught.
//!
//! Threads (2): main, which spawns and joins, and the panicking thread.

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use common::{negative, Bounds};
use kvoffload::internal::sync::thread;

#[test]
#[ignore = "checker self-test: run by ci/prove --self-test, must NOT be counted as caught"]
fn selftest_wrong_reason_must_not_be_caught() {
    let b = Bounds { property: "T1", threads: 2, preemptions: 2, ci: None };
    negative("selftest_wrong_reason", b, "capture invalidated", || {
        println!("self-test: this line says capture invalidated, but it is not a failure");
        let t = thread::spawn(|| panic!("self-test: unrelated panic"));
        let _ = t.join();
    });
}
