//! The lines a rank writes for its parent (stdout, one line each, the
//! prefixes of `report.rs`), and the fault tests' pause points.

use std::io::{BufRead, Write};

use super::config::KillAt;
use super::report::{PAUSE, PHASE, PROGRESS};

/// Writes one line on stdout for the parent, flushed at once (a parent
/// that is gone makes it fail, which is ignored).
pub fn emit(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}");
    let _ = o.flush();
}

pub fn phase(rank: usize, p: &str) {
    emit(&format!("{PHASE} rank={rank} phase={p}"));
}

pub fn progress(rank: usize, p: &str, done: usize, total: usize) {
    emit(&format!("{PROGRESS} rank={rank} phase={p} done={done} total={total}"));
}

/// Announces a pause point and blocks until the parent writes a line or
/// closes stdin (the parent SIGKILLs the rank here in the fault tests; if
/// the parent is gone, stdin reaches EOF and the rank goes on).
pub fn pause(rank: usize, at: KillAt) {
    emit(&format!("{PAUSE} rank={rank} at={}", at.name()));
    let mut s = String::new();
    let _ = std::io::stdin().lock().read_line(&mut s);
}
