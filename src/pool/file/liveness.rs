//! The liveness oracle of a pool file (design 3.6): whether a recorded
//! process (pid, start time, pid namespace) still runs.
//!
//! In order: a pool made in another boot (its boot id against
//! `/proc/sys/kernel/random/boot_id`) records only gone processes; a
//! process of another pid namespace than ours cannot be judged
//! ([`Liveness::Foreign`]); `kill(pid, 0)` failing with `ESRCH` (rustix's
//! `test_kill_process`) is gone; so is a `/proc/<pid>/stat` that is
//! missing, shows another start time (field 22: the pid was reused) or
//! state `Z` or `X` (a zombie cannot touch memory; the region's
//! `process_gone` counts it alive).
//!
//! A record of start time 0 names a pid alone: the claimer or sweeper an
//! owner word names (design 2.4), whose start time the word has no room
//! for. It is judged without one: a running process of that pid is alive
//! whatever its start time (a reused pid keeps such an entry until that
//! process ends, never frees it under a live one).

use std::io;

use crate::internal::pool::words::{Liveness, Member};
use crate::region::shm::{own_pid_namespace, process_gone};

/// Where the kernel says which boot this is.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// This boot's id (16 bytes of `/proc/sys/kernel/random/boot_id`).
pub fn boot_id() -> io::Result<[u8; 16]> {
    parse_boot_id(&std::fs::read_to_string(BOOT_ID_PATH)?)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "boot_id is not a UUID"))
}

/// The 16 bytes of a UUID's text (`8-4-4-4-12` hex digits).
pub fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.trim().bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

/// A boot id as its UUID text.
pub fn boot_id_text(id: &[u8; 16]) -> String {
    let h: String = id.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
}

/// What `/proc/<pid>/stat` says of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 3: `R`, `S`, `D`, `Z`, `X`, ...
    pub state: char,
    /// Field 22: start time after boot, in clock ticks.
    pub start: u64,
}

/// Parses a `/proc/<pid>/stat` line. The command (field 2) is in
/// parentheses and may hold spaces and parentheses itself, so fields are
/// counted after its last `)`.
pub fn parse_stat(line: &str) -> Option<ProcStat> {
    let rest = &line[line.rfind(')')? + 1..];
    let mut f = rest.split_ascii_whitespace();
    let state = f.next()?.chars().next()?;
    // `rest` starts at field 3; field 22 is 19 further.
    let start = f.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start })
}

/// `/proc/<pid>/stat` of `pid`; `None` when there is no such process.
pub fn proc_stat(pid: u32) -> io::Result<Option<ProcStat>> {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => parse_stat(&s)
            .map(Some)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("/proc/{pid}/stat: {s:?}"))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The record of process `pid` of this pid namespace, as an engine member
/// registers it: its start time and pid namespace (the inode of
/// `/proc/<pid>/ns/pid`, which needs the right to inspect the process;
/// ours for `pid` = this process).
pub fn member_of(pid: u32) -> io::Result<Member> {
    use std::os::unix::fs::MetadataExt;
    let stat = proc_stat(pid)?.ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no process {pid}")))?;
    let pidns = if pid == std::process::id() {
        own_pid_namespace().ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "/proc/self/ns/pid"))?
    } else {
        std::fs::metadata(format!("/proc/{pid}/ns/pid"))?.ino()
    };
    Ok(Member { pid, start: stat.start, pidns })
}

/// This process's record.
pub fn member_of_self() -> io::Result<Member> {
    member_of(std::process::id())
}

/// What the oracle knows besides the record: whether the pool is of this
/// boot, and our pid namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Oracle {
    /// The pool was made in this boot.
    pub same_boot: bool,
    /// Our pid namespace (`None`: unknown, so nobody can be judged).
    pub own_pidns: Option<u64>,
}

impl Oracle {
    /// Judges `record` (design 3.6; the order of the module docs).
    pub fn judge(&self, record: &Member) -> Liveness {
        if !self.same_boot {
            return Liveness::Gone;
        }
        if self.own_pidns != Some(record.pidns) {
            return Liveness::Foreign;
        }
        if process_gone(record.pid) {
            return Liveness::Gone;
        }
        match proc_stat(record.pid) {
            Ok(None) => Liveness::Gone,
            Ok(Some(s)) if matches!(s.state, 'Z' | 'X') => Liveness::Gone,
            // Start time 0: the pid alone is known (see the module docs).
            Ok(Some(s)) if record.start != 0 && s.start != record.start => Liveness::Gone,
            Ok(Some(_)) => Liveness::Alive,
            // Cannot read it: not known to be gone.
            Err(e) => {
                tracing::debug!(pid = record.pid, error = %e, "cannot read /proc/<pid>/stat; counting it alive");
                Liveness::Alive
            }
        }
    }
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_past_odd_commands() {
        let tail = "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 4242 20 21";
        assert_eq!(parse_stat(&format!("77 (a b) c)) {tail}")), Some(ProcStat { state: 'S', start: 4242 }));
        assert_eq!(parse_stat(&format!("77 (z) {}", tail.replacen('S', "Z", 1))).unwrap().state, 'Z');
        assert_eq!(parse_stat("77 (short) S 1 2"), None);
        let me = proc_stat(std::process::id()).unwrap().unwrap();
        assert!(me.start > 0 && me.state != 'Z');
    }

    #[test]
    fn boot_ids_parse_and_print() {
        let text = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n";
        let id = parse_boot_id(text).unwrap();
        assert_eq!(id[0], 0x0f);
        assert_eq!(boot_id_text(&id), text.trim());
        assert_eq!(parse_boot_id("not-a-uuid"), None);
        assert!(boot_id().is_ok(), "this test needs /proc");
    }
}
