//! Shared by every loom model: runs a model with an explicit preemption
//! bound and reports what was explored in one machine-readable line that
//! `ci/prove` turns into the proof table.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// What a model explores, stated next to the model and printed in the table.
pub struct Bounds {
    /// Property name as in DESIGN.md ("P1", "N3", or a sim rule).
    pub property: &'static str,
    /// Threads in the model, the simulated GPU's device thread included.
    pub threads: usize,
    /// Loom's preemption bound.
    pub preemptions: usize,
}

/// Runs `f` in every interleaving loom explores under `b`, then prints
/// `LOOM-REPORT property=.. threads=.. preemptions=.. iterations=.. seconds=..`.
pub fn check<F>(name: &str, b: Bounds, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    static ITER: AtomicUsize = AtomicUsize::new(0);
    ITER.store(0, Ordering::SeqCst);
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(b.preemptions);
    builder.max_threads = b.threads.max(2);
    let t = Instant::now();
    builder.check(move || {
        ITER.fetch_add(1, Ordering::Relaxed);
        f()
    });
    println!(
        "LOOM-REPORT model={name} property={} threads={} preemptions={} iterations={} seconds={:.2}",
        b.property,
        b.threads,
        b.preemptions,
        ITER.load(Ordering::SeqCst),
        t.elapsed().as_secs_f64()
    );
}
