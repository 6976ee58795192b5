//! Entry locks: which process the owner word names, told by the kernel
//! (design 3.6, "The owner word's process").
//!
//! The owner word carries a pid only: the claimer's in `LIVE`, the
//! sweeper's in `RECLAIMING`. Judged by that pid alone, a process of
//! another pid namespace (a container sharing the tmpfs) is confused with
//! whatever process of ours has its number: one that does not exist here
//! is judged gone while it runs, and a sweeper so judged is taken over and
//! then, resumed, clears the holds of the entry's next engine. So every
//! process that puts its pid in an owner word first takes the entry's lock
//! for that role, an open-file-description (OFD) lock on one byte of the
//! index file past its end:
//!
//! | byte | held by | from | until |
//! |---|---|---|---|
//! | `BASE + 2e` | entry `e`'s owner (the claimer, rank 0's worker) | before its claim CAS | its leave clears its member bit (or it exits) |
//! | `BASE + 2e + 1` | entry `e`'s sweeper (or last leaver) | before its take CAS | the entry is `FREE`, or the take undone (or it exits) |
//! | `BASE + 64 + e` | every member of entry `e` (its scheduler, its ranks' workers), shared (read) locks | before the CAS that sets its member bit | its bit is cleared (or it exits) |
//! | `BASE - 1` | the pool's closer (`pool rm`, a last engine leaving a pool not kept: `pool::closing`) | before its CAS of the pool word | the word is `READY` again or the files are gone (or it exits) |
//!
//! A judge probes the byte (F_OFD_GETLK: asks, never takes): free means the
//! process the word names holds it no more, so it is gone (its word is
//! then stale, which the judge's CAS on the word read checks); held means
//! it lives. The kernel drops a process's OFD locks when its last
//! descriptor of the file closes, at exit or kill -9, in whatever pid
//! namespace, and a reused pid holds nothing. A child that inherits the
//! descriptor by `fork` keeps the lock while it lives: judged alive, the
//! safe side.
//!
//! Locks of one handle (one open file description) do not conflict with
//! each other in the kernel; [`EntryLocks`] keeps a bit per lock it holds,
//! taken before the kernel's, so two threads of one handle never both hold
//! one, and a probe of a lock it holds answers "alive" (it is this
//! process).

// Cross-process words on shared memory: `core::sync::atomic`, never the
// sync facade (loom cannot model another process).
#![allow(clippy::disallowed_types)]

use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use crate::internal::pool::words::{EntryRole, Liveness};

/// The first lock byte, far past any index file's end (locks past the end
/// of a file are allowed and touch no data).
const BASE: i64 = 1 << 40;

/// One handle's entry locks: its own descriptor of the index file (its own
/// open file description), and the locks it holds, two bits per entry.
pub(crate) struct EntryLocks {
    file: File,
    held: AtomicU64,
    /// The closer's lock (byte `BASE - 1`) is held by this handle.
    closer: AtomicBool,
    /// Members of each entry holding this handle's member lock (the lock is
    /// taken at 0 -> 1 and dropped at 1 -> 0, under this mutex, so no
    /// member of the handle counts it held before the kernel has it).
    members: Mutex<[u32; 32]>,
}

/// The closer's lock byte.
const CLOSER: i64 = BASE - 1;

/// Entry `e`'s member byte (past the 32 entries' two bytes each).
fn member_byte(engine: u8) -> i64 {
    BASE + 64 + i64::from(engine)
}

fn byte(engine: u8, role: EntryRole) -> i64 {
    BASE + 2 * i64::from(engine) + role as i64
}

fn bit(engine: u8, role: EntryRole) -> u64 {
    1 << (2 * u32::from(engine) + role as u32)
}

impl EntryLocks {
    /// The locks of `file` (opened by this handle, never shared with another
    /// handle's). Two bits for each of at most 32 entries (`Geometry::check`).
    pub(crate) fn new(file: File) -> EntryLocks {
        EntryLocks { file, held: AtomicU64::new(0), closer: AtomicBool::new(false), members: Mutex::new([0; 32]) }
    }

    /// Takes entry `engine`'s `role` lock without waiting: true when taken,
    /// false when another process, or another thread of this handle,
    /// holds it, or the lock cannot be taken (the caller leaves the entry
    /// alone). The kernel's lock is one per open file description, so the
    /// handle's own bit is taken first: of two threads of one handle, one
    /// holds it.
    pub(crate) fn hold(&self, engine: u8, role: EntryRole) -> bool {
        if self.held.fetch_or(bit(engine, role), Ordering::AcqRel) & bit(engine, role) != 0 {
            return false;
        }
        match self.fcntl(byte(engine, role), libc::F_OFD_SETLK, libc::F_WRLCK) {
            Ok(_) => true,
            Err(e) => {
                self.held.fetch_and(!bit(engine, role), Ordering::AcqRel);
                if !is_contended(&e) {
                    tracing::warn!(engine, ?role, error = %e, "cannot take a pool entry lock; leaving the entry alone");
                }
                false
            }
        }
    }

    /// Drops entry `engine`'s `role` lock if this handle holds it (the
    /// kernel's lock first, then the handle's bit, so no thread of this
    /// handle takes the bit while the lock is still there).
    pub(crate) fn release(&self, engine: u8, role: EntryRole) {
        if self.held.load(Ordering::Acquire) & bit(engine, role) == 0 {
            return;
        }
        if let Err(e) = self.fcntl(byte(engine, role), libc::F_OFD_SETLK, libc::F_UNLCK) {
            // Unlocking a held range cannot fail on Linux; if it did, the
            // lock stays until the handle closes: judged alive, the safe side.
            tracing::warn!(engine, ?role, error = %e, "cannot drop a pool entry lock");
        }
        self.held.fetch_and(!bit(engine, role), Ordering::AcqRel);
    }

    /// Whether the process holding entry `engine`'s `role` lock lives:
    /// `Gone` when nobody holds it, `Alive` when another process holds it,
    /// this handle holds it, or the probe fails. The probe asks the kernel
    /// (F_OFD_GETLK) without taking the lock, so it never stands in a
    /// claimer's way.
    pub(crate) fn probe(&self, engine: u8, role: EntryRole) -> Liveness {
        if self.held.load(Ordering::Acquire) & bit(engine, role) != 0 {
            return Liveness::Alive;
        }
        match self.fcntl(byte(engine, role), libc::F_OFD_GETLK, libc::F_WRLCK) {
            Ok(found) if found == libc::F_UNLCK => Liveness::Gone,
            Ok(_) => Liveness::Alive,
            Err(e) => {
                tracing::warn!(engine, ?role, error = %e, "cannot probe a pool entry lock; counting its holder alive");
                Liveness::Alive
            }
        }
    }

    /// Takes a member hold on entry `engine`: the handle's shared lock on
    /// its member byte, taken by the first member of the handle (shared
    /// locks never conflict with each other: only a failure of the call
    /// refuses it).
    pub(crate) fn hold_member(&self, engine: u8) -> bool {
        let mut held = self.members.lock().unwrap_or_else(|p| p.into_inner());
        let n = &mut held[usize::from(engine) % 32];
        if *n == 0 {
            if let Err(e) = self.fcntl(member_byte(engine), libc::F_OFD_SETLK, libc::F_RDLCK) {
                tracing::warn!(engine, error = %e, "cannot take a pool member lock; not joining");
                return false;
            }
        }
        *n += 1;
        true
    }

    /// Gives back a member hold on entry `engine`; the lock goes with the
    /// handle's last.
    pub(crate) fn release_member(&self, engine: u8) {
        let mut held = self.members.lock().unwrap_or_else(|p| p.into_inner());
        let n = &mut held[usize::from(engine) % 32];
        if *n == 0 {
            return;
        }
        *n -= 1;
        if *n == 0 {
            if let Err(e) = self.fcntl(member_byte(engine), libc::F_OFD_SETLK, libc::F_UNLCK) {
                // As `release`: the lock stays until the handle closes.
                tracing::warn!(engine, error = %e, "cannot drop a pool member lock");
            }
        }
    }

    /// Whether some member of entry `engine` lives: `Alive` when this
    /// handle or another holds a member lock of it (or the probe fails),
    /// `Gone` when none does.
    pub(crate) fn probe_members(&self, engine: u8) -> Liveness {
        if self.members.lock().unwrap_or_else(|p| p.into_inner())[usize::from(engine) % 32] > 0 {
            return Liveness::Alive;
        }
        match self.fcntl(member_byte(engine), libc::F_OFD_GETLK, libc::F_WRLCK) {
            Ok(found) if found == libc::F_UNLCK => Liveness::Gone,
            Ok(_) => Liveness::Alive,
            Err(e) => {
                tracing::warn!(engine, error = %e, "cannot probe a pool member lock; counting its members alive");
                Liveness::Alive
            }
        }
    }

    /// Takes the closer's lock without waiting, as [`EntryLocks::hold`].
    pub(crate) fn hold_closer(&self) -> bool {
        if self.closer.swap(true, Ordering::AcqRel) {
            return false;
        }
        match self.fcntl(CLOSER, libc::F_OFD_SETLK, libc::F_WRLCK) {
            Ok(_) => true,
            Err(e) => {
                self.closer.store(false, Ordering::Release);
                if !is_contended(&e) {
                    tracing::warn!(error = %e, "cannot take the pool's closer lock; not closing");
                }
                false
            }
        }
    }

    /// Drops the closer's lock if this handle holds it, as
    /// [`EntryLocks::release`].
    pub(crate) fn release_closer(&self) {
        if !self.closer.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.fcntl(CLOSER, libc::F_OFD_SETLK, libc::F_UNLCK) {
            tracing::warn!(error = %e, "cannot drop the pool's closer lock");
        }
        self.closer.store(false, Ordering::Release);
    }

    /// Whether the closer lives, as [`EntryLocks::probe`].
    pub(crate) fn probe_closer(&self) -> Liveness {
        if self.closer.load(Ordering::Acquire) {
            return Liveness::Alive;
        }
        match self.fcntl(CLOSER, libc::F_OFD_GETLK, libc::F_WRLCK) {
            Ok(found) if found == libc::F_UNLCK => Liveness::Gone,
            Ok(_) => Liveness::Alive,
            Err(e) => {
                tracing::warn!(error = %e, "cannot probe the pool's closer lock; counting its holder alive");
                Liveness::Alive
            }
        }
    }

    /// `fcntl(cmd)` on lock byte `start`, asking for a lock of `kind`; the
    /// `l_type` the kernel leaves (F_OFD_GETLK: the conflicting lock's kind,
    /// or F_UNLCK when none).
    fn fcntl(&self, start: i64, cmd: libc::c_int, kind: libc::c_int) -> io::Result<libc::c_int> {
        // SAFETY: `flock` is a plain C struct of integers, for which all
        // zero bytes are a valid value (on every Linux ABI it may have
        // padding or extra fields, which stay zero).
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = kind as _;
        fl.l_whence = libc::SEEK_SET as _;
        fl.l_start = start;
        fl.l_len = 1;
        // SAFETY: the descriptor is this handle's open index file, alive for
        // the call (`self.file`); `fl` is an initialised `flock` that
        // outlives the call, which the kernel reads (F_OFD_SETLK,
        // F_OFD_GETLK) and writes (F_OFD_GETLK). Neither command blocks or
        // touches memory but `fl`.
        let r = unsafe { libc::fcntl(self.file.as_raw_fd(), cmd, &mut fl as *mut libc::flock) };
        if r == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(libc::c_int::from(fl.l_type))
    }
}

/// Another open file description holds the lock (what F_OFD_SETLK says).
fn is_contended(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES))
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;

    fn open(path: &std::path::Path) -> EntryLocks {
        EntryLocks::new(std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap())
    }

    /// Two handles (two open file descriptions, as two processes have): a
    /// lock one holds is refused to the other and probed alive; given back,
    /// or its descriptor closed (what exit and kill -9 do), it is probed
    /// gone. One handle's threads never both hold one lock.
    #[test]
    fn a_lock_is_one_handles_until_given_back_or_closed() {
        let dir = tempfile_dir();
        let path = dir.join("index");
        std::fs::write(&path, b"x").unwrap();
        let (a, b) = (open(&path), open(&path));
        assert_eq!(b.probe(3, EntryRole::Sweeper), Liveness::Gone, "nobody holds it");
        assert!(a.hold(3, EntryRole::Sweeper));
        assert!(!a.hold(3, EntryRole::Sweeper), "a second holder in the same handle");
        assert!(!b.hold(3, EntryRole::Sweeper), "a second holder in another handle");
        assert_eq!(b.probe(3, EntryRole::Sweeper), Liveness::Alive);
        assert_eq!(a.probe(3, EntryRole::Sweeper), Liveness::Alive, "its own holder is alive");
        assert_eq!(b.probe(3, EntryRole::Owner), Liveness::Gone, "the other role's lock is another byte");
        assert_eq!(b.probe(4, EntryRole::Sweeper), Liveness::Gone, "another entry's lock is another byte");
        a.release(3, EntryRole::Sweeper);
        assert_eq!(b.probe(3, EntryRole::Sweeper), Liveness::Gone, "given back");
        assert!(b.hold(3, EntryRole::Sweeper));
        drop(b);
        assert_eq!(a.probe(3, EntryRole::Sweeper), Liveness::Gone, "its descriptor closed");
        let c = open(&path);
        assert_eq!(c.probe_closer(), Liveness::Gone);
        assert!(a.hold_closer());
        assert!(!a.hold_closer() && !c.hold_closer(), "one closer");
        assert_eq!(c.probe_closer(), Liveness::Alive);
        assert_eq!(c.probe(0, EntryRole::Owner), Liveness::Gone, "the closer's byte is no entry's");
        drop(a);
        assert_eq!(c.probe_closer(), Liveness::Gone, "its descriptor closed");
        // Member locks are shared: two handles' members at once, counted in
        // a handle, gone with the last of them.
        let d = open(&path);
        assert_eq!(d.probe_members(5), Liveness::Gone);
        assert!(c.hold_member(5) && c.hold_member(5) && d.hold_member(5));
        c.release_member(5);
        assert_eq!(d.probe_members(2), Liveness::Gone, "another entry's byte");
        d.release_member(5);
        assert_eq!(d.probe_members(5), Liveness::Alive, "c's second member holds it");
        c.release_member(5);
        assert_eq!(d.probe_members(5), Liveness::Gone, "the last member left");
        assert!(c.hold_member(5));
        drop(c);
        assert_eq!(d.probe_members(5), Liveness::Gone, "its descriptor closed");
        assert_eq!(d.probe(5, EntryRole::Owner), Liveness::Gone, "the member byte is no entry's");
        // One member of a handle is enough for another handle to see it;
        // a handle's own member is alive to itself (the kernel would not
        // say: its own lock never conflicts with its own probe).
        let e = open(&path);
        assert!(e.hold_member(6));
        assert_eq!(d.probe_members(6), Liveness::Alive, "one member of another handle");
        assert_eq!(e.probe_members(6), Liveness::Alive, "its own member");
        e.release_member(6);
        assert_eq!(d.probe_members(6), Liveness::Gone);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The lock bytes are the module table's, exactly: they are part of the
    /// file's protocol (an engine of another build judges this one by
    /// them), and no two roles share one.
    #[test]
    fn the_lock_bytes_are_the_documented_ones_and_distinct() {
        let base = 1i64 << 40;
        assert_eq!(CLOSER, base - 1);
        let mut all = vec![CLOSER];
        for e in 0..32u8 {
            let i = i64::from(e);
            assert_eq!(byte(e, EntryRole::Owner), base + 2 * i);
            assert_eq!(byte(e, EntryRole::Sweeper), base + 2 * i + 1);
            assert_eq!(member_byte(e), base + 64 + i);
            all.extend([byte(e, EntryRole::Owner), byte(e, EntryRole::Sweeper), member_byte(e)]);
        }
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 1 + 32 * 3);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("kvo-locks-{}-{:?}", std::process::id(), std::thread::current().id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
