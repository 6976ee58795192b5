//! The shared region is this user's alone.
//!
//! Every file of a shared region is reached through one descriptor of its
//! directory ([`RegionDir`], opened once per `create`/`join`) by a bare
//! name (no `/`): opened with `openat(O_NOFOLLOW | O_CLOEXEC)`, looked at
//! with `fstatat(AT_SYMLINK_NOFOLLOW)`, removed with `unlinkat` (which never
//! follows a link). A link planted under a region file's name is never
//! followed, and a directory renamed or replaced after it was opened
//! changes nothing.
//!
//! Creating: `O_CREAT | O_EXCL | O_NOFOLLOW` (an existing name, a symbolic
//! link included, is `EEXIST`, so the creator never writes through a link),
//! then `fchown` to the allowed group if there is one and `fchmod` to the
//! exact mode (the umask cannot change it).
//!
//! Joining: each file (header and every data file) is opened with
//! `O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK` (a FIFO planted
//! under the name cannot block the open), and the descriptor is checked with
//! `fstat` ([`Trust::check`]) before anything is read, mapped or written: a
//! regular file, owned by this process's effective uid, with no group or
//! other permission bits. [`ShmOptions::allow_group`](super::ShmOptions::allow_group)
//! relaxes this for one group, for engines whose ranks run as different
//! users: a file of that group may have group read/write bits and may be
//! owned by another user (a member of the group, or root: nobody else can
//! give a file that group); other bits are never accepted. A file that
//! fails is [`RegionError::UntrustedFile`] naming it and what was wrong, and
//! is left exactly as it was: it was only opened and `fstat`ed.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, CWD};
use rustix::io::Errno;

use super::error::{FileProblem, RegionError};

type Result<T> = std::result::Result<T, RegionError>;

/// What the checks look at, from `fstat` or `fstatat(AT_SYMLINK_NOFOLLOW)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileMeta {
    pub dev: u64,
    pub ino: u64,
    /// `st_mode`: file type and permission bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// Bytes the file system has allocated to it (`st_blocks * 512`).
    pub allocated: u64,
}

impl FileMeta {
    /// `fstat` of an open file (the descriptor, never its path).
    pub(crate) fn of_file(f: &File) -> io::Result<FileMeta> {
        let m = f.metadata()?;
        Ok(FileMeta {
            dev: m.dev(),
            ino: m.ino(),
            mode: m.mode(),
            uid: m.uid(),
            gid: m.gid(),
            size: m.size(),
            allocated: m.blocks().saturating_mul(512),
        })
    }

    // The stat fields' C types differ between targets (c_uint, c_ulong,
    // c_long); the casts are exact on every Linux target.
    #[allow(clippy::unnecessary_cast)]
    fn of_stat(st: &rustix::fs::Stat) -> FileMeta {
        FileMeta {
            dev: st.st_dev as u64,
            ino: st.st_ino as u64,
            mode: st.st_mode as u32,
            uid: st.st_uid as u32,
            gid: st.st_gid as u32,
            size: st.st_size.max(0) as u64,
            allocated: (st.st_blocks.max(0) as u64).saturating_mul(512),
        }
    }
}

/// File type bits of `st_mode`.
const S_IFMT: u32 = 0o170000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

/// What a file type is called in an error.
fn kind_name(mode: u32) -> &'static str {
    match mode & S_IFMT {
        0o040000 => "directory",
        0o010000 => "FIFO",
        0o140000 => "socket",
        0o020000 => "character device",
        0o060000 => "block device",
        S_IFLNK => "symbolic link",
        _ => "file of unknown type",
    }
}

/// Who may own a region file and which permission bits it may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Trust {
    pub euid: u32,
    pub allow_group: Option<u32>,
}

impl Trust {
    /// This process's effective uid, and the allowed group if any.
    pub(crate) fn current(allow_group: Option<u32>) -> Trust {
        Trust { euid: rustix::process::geteuid().as_raw(), allow_group }
    }

    /// Whether a file with this `fstat` may be used: see the module
    /// documentation.
    pub(crate) fn check(&self, m: &FileMeta) -> std::result::Result<(), FileProblem> {
        match m.mode & S_IFMT {
            S_IFREG => {}
            S_IFLNK => return Err(FileProblem::Symlink),
            _ => return Err(FileProblem::NotRegular { kind: kind_name(m.mode) }),
        }
        let of_group = self.allow_group == Some(m.gid);
        if m.uid != self.euid && !of_group {
            return Err(FileProblem::ForeignOwner {
                uid: m.uid,
                euid: self.euid,
                gid: m.gid,
                allowed_group: self.allow_group,
            });
        }
        let perm = m.mode & 0o7777;
        if perm & 0o7000 != 0 {
            // The creator refuses these bits (`check_create_mode`): a file
            // with them is not one a creator of this code made.
            return Err(FileProblem::SpecialBits { mode: perm });
        }
        if perm & 0o007 != 0 || (perm & 0o070 != 0 && self.allow_group.is_none()) {
            return Err(FileProblem::Mode { mode: perm, allowed_group: self.allow_group });
        }
        if let (Some(g), true) = (self.allow_group, perm & 0o070 != 0) {
            if !of_group {
                return Err(FileProblem::WrongGroup { mode: perm, gid: m.gid, allowed_group: g });
            }
        }
        Ok(())
    }
}

/// Why [`RegionDir::open_existing`] gave no file.
#[derive(Debug)]
pub(crate) enum OpenFailure {
    /// No such name (yet).
    Missing,
    /// The name is there but must not be used.
    Untrusted(FileProblem),
    /// Another error of `openat` or `fstat`.
    Io(&'static str, io::Error),
}

/// The directory of a shared region, opened once: every file of the region
/// is reached through this descriptor by a bare name.
#[derive(Debug)]
pub(crate) struct RegionDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl RegionDir {
    /// Opens `path` (`O_RDONLY | O_DIRECTORY | O_CLOEXEC`). The configured
    /// path itself is resolved as given (it is the operator's choice, and
    /// `/dev/shm` is a link on some systems); the names inside it never are.
    pub(crate) fn open(path: &Path) -> io::Result<RegionDir> {
        let fd = rustix::fs::openat(CWD, path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        Ok(RegionDir { fd, path: path.to_path_buf() })
    }

    /// A second descriptor of the same directory (`dup`), for a region
    /// made after a first attempt gave its own away.
    pub(crate) fn try_clone(&self) -> io::Result<RegionDir> {
        Ok(RegionDir { fd: self.fd.try_clone()?, path: self.path.clone() })
    }

    /// The path of `name` in it, for messages and [`crate::region::Region::file_paths`].
    pub(crate) fn path_of(&self, name: &OsStr) -> PathBuf {
        self.path.join(name)
    }

    /// The huge page size of its file system if that is hugetlbfs
    /// (`fstatfs`, [`super::hugetlb`]).
    pub(crate) fn hugetlb_page(&self) -> io::Result<Option<usize>> {
        super::hugetlb::page_of(&self.fd)
    }

    /// Blocks of its file system and blocks free for an unprivileged user
    /// (`fstatvfs`: `f_blocks`, `f_bavail`, in units of `f_frsize`).
    pub(crate) fn blocks(&self) -> io::Result<(u64, u64)> {
        let st = rustix::fs::fstatvfs(&self.fd)?;
        Ok((st.f_blocks, st.f_bavail))
    }

    /// Free bytes for an unprivileged user in its file system (`fstatvfs`).
    pub(crate) fn available(&self) -> io::Result<u64> {
        let st = rustix::fs::fstatvfs(&self.fd)?;
        Ok(st.f_bavail.saturating_mul(st.f_frsize))
    }

    /// Creates `name` with `O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW |
    /// O_CLOEXEC`, then gives it `group` (if any) and exactly `mode`. An
    /// existing name (a link included) is `AlreadyExists`. If the group or
    /// mode cannot be set the new file is removed again.
    pub(crate) fn create_new(&self, name: &OsStr, mode: u32, group: Option<u32>) -> io::Result<File> {
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(&self.fd, name, flags, Mode::from_raw_mode(0o600))?;
        // Group first, then the bits: a joiner never sees group bits on a
        // file of another group.
        let set = (|| -> io::Result<()> {
            if let Some(g) = group {
                rustix::fs::fchown(&fd, None, Some(rustix::fs::Gid::from_raw(g)))?;
            }
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))?;
            Ok(())
        })();
        let file = File::from(fd);
        if let Err(e) = set {
            if let Ok(m) = FileMeta::of_file(&file) {
                let _ = self.unlink_if_inode(name, m.dev, m.ino);
            }
            return Err(e);
        }
        Ok(file)
    }

    /// Opens an existing region file for reading and writing, never through
    /// a link, and checks the descriptor against `trust` before returning it.
    /// A name that is there but not a regular file (a link, a directory, a
    /// FIFO, ...) is [`OpenFailure::Untrusted`]; nothing is read or written.
    pub(crate) fn open_existing(&self, name: &OsStr, trust: &Trust) -> std::result::Result<File, OpenFailure> {
        let flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK;
        let fd = match rustix::fs::openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Err(OpenFailure::Missing),
            Err(e) => {
                // ELOOP (a link under O_NOFOLLOW), EISDIR, ENXIO (a socket),
                // ...: say what the name is, without following it.
                return Err(match self.lstat(name) {
                    Ok(Some(m)) if m.mode & S_IFMT != S_IFREG => {
                        OpenFailure::Untrusted(trust.check(&m).expect_err("not a regular file"))
                    }
                    Ok(None) => OpenFailure::Missing,
                    _ => OpenFailure::Io("open", e.into()),
                });
            }
        };
        let file = File::from(fd);
        let m = FileMeta::of_file(&file).map_err(|e| OpenFailure::Io("fstat", e))?;
        trust.check(&m).map_err(OpenFailure::Untrusted)?;
        // A regular file: O_NONBLOCK means nothing for it, but do not leave
        // a surprising flag on the descriptor.
        let fl = rustix::fs::fcntl_getfl(&file).map_err(|e| OpenFailure::Io("fcntl(F_GETFL)", e.into()))?;
        rustix::fs::fcntl_setfl(&file, fl - OFlags::NONBLOCK)
            .map_err(|e| OpenFailure::Io("fcntl(F_SETFL)", e.into()))?;
        Ok(file)
    }

    /// `fstatat(name, AT_SYMLINK_NOFOLLOW)`; `None` if there is no such name.
    pub(crate) fn lstat(&self, name: &OsStr) -> io::Result<Option<FileMeta>> {
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(FileMeta::of_stat(&st))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// `unlinkat(name)` (removes a link itself, never its target); false if
    /// there was no such name.
    pub(crate) fn unlink(&self, name: &OsStr) -> io::Result<bool> {
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes `name` if it still names inode `dev`/`ino`; whether it did.
    pub(crate) fn unlink_if_inode(&self, name: &OsStr, dev: u64, ino: u64) -> io::Result<bool> {
        match self.lstat(name)? {
            Some(m) if m.dev == dev && m.ino == ino => self.unlink(name),
            _ => Ok(false),
        }
    }

    /// The error for a file `open_existing` refused.
    pub(crate) fn untrusted(&self, name: &OsStr, problem: FileProblem) -> RegionError {
        let path = self.path_of(name);
        tracing::warn!(path = %path.display(), %problem, "refusing an untrusted region file");
        RegionError::UntrustedFile { path, problem }
    }
}

impl AsFd for RegionDir {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// `flock(LOCK_EX | LOCK_NB)` on an open region file: true when this
/// descriptor now holds the file's exclusive lock, false when another open
/// file description holds a lock on it. The kernel drops a lock when the
/// last descriptor of its open file description closes, so a process that
/// dies holds none: what the creator of a persistent region uses to show
/// it is alive ([`super::persistent`]). Only a process that can open the
/// file (this user's, by the trust rules) can lock it.
pub(crate) fn try_lock_exclusive(f: &File) -> io::Result<bool> {
    loop {
        match rustix::fs::flock(f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(true),
            Err(Errno::WOULDBLOCK) => return Ok(false),
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Drops this descriptor's `flock` lock (a no-op without one).
pub(crate) fn unlock(f: &File) -> io::Result<()> {
    rustix::fs::flock(f, rustix::fs::FlockOperation::Unlock).map_err(Into::into)
}

/// Checks what [`ShmOptions::mode`](super::ShmOptions::mode) and
/// [`ShmOptions::allow_group`](super::ShmOptions::allow_group) ask of the
/// creator: bits that joiners would accept, the owner's read and write
/// included.
pub(crate) fn check_create_mode(mode: u32, allow_group: Option<u32>) -> Result<()> {
    let bad = |reason| Err(RegionError::BadFileMode { mode, allow_group, reason });
    if allow_group == Some(u32::MAX) {
        return bad("the allowed group is -1, which is no group");
    }
    if mode & !0o777 != 0 {
        return bad("only permission bits (0o777) may be given");
    }
    if mode & 0o600 != 0o600 {
        return bad("the owner must be able to read and write the files");
    }
    if mode & 0o007 != 0 {
        return bad("permission bits for others are never allowed (joiners refuse them)");
    }
    if mode & 0o070 != 0 && allow_group.is_none() {
        return bad(
            "group permission bits need an allowed group (ShmOptions::allow_group); joiners refuse them otherwise",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(mode: u32, uid: u32, gid: u32) -> FileMeta {
        FileMeta { dev: 1, ino: 2, mode, uid, gid, size: 0, allocated: 0 }
    }

    #[test]
    fn only_private_regular_files_of_ours_pass() {
        let t = Trust { euid: 1000, allow_group: None };
        assert_eq!(t.check(&meta(S_IFREG | 0o600, 1000, 50)), Ok(()));
        assert_eq!(t.check(&meta(S_IFREG | 0o400, 1000, 50)), Ok(()));
        assert_eq!(t.check(&meta(S_IFLNK | 0o777, 1000, 50)), Err(FileProblem::Symlink));
        assert_eq!(t.check(&meta(0o010600, 1000, 50)), Err(FileProblem::NotRegular { kind: "FIFO" }));
        assert_eq!(t.check(&meta(0o040700, 1000, 50)), Err(FileProblem::NotRegular { kind: "directory" }));
        assert_eq!(
            t.check(&meta(S_IFREG | 0o600, 65534, 65534)),
            Err(FileProblem::ForeignOwner { uid: 65534, euid: 1000, gid: 65534, allowed_group: None })
        );
        for m in [0o666, 0o640, 0o604, 0o660] {
            assert_eq!(
                t.check(&meta(S_IFREG | m, 1000, 50)),
                Err(FileProblem::Mode { mode: m, allowed_group: None }),
                "{m:o}"
            );
        }
    }

    #[test]
    fn an_allowed_group_may_share_but_others_never() {
        let t = Trust { euid: 1000, allow_group: Some(77) };
        assert_eq!(t.check(&meta(S_IFREG | 0o660, 1000, 77)), Ok(()));
        assert_eq!(t.check(&meta(S_IFREG | 0o660, 1001, 77)), Ok(()), "another member's file");
        assert_eq!(t.check(&meta(S_IFREG | 0o600, 1000, 50)), Ok(()), "our private file");
        assert_eq!(
            t.check(&meta(S_IFREG | 0o666, 1000, 77)),
            Err(FileProblem::Mode { mode: 0o666, allowed_group: Some(77) })
        );
        // Set-user-id, set-group-id and sticky bits, which a creator refuses,
        // with or without an allowed group.
        for m in [0o4600, 0o2600, 0o1600, 0o2660] {
            assert_eq!(t.check(&meta(S_IFREG | m, 1000, 77)), Err(FileProblem::SpecialBits { mode: m }), "{m:o}");
        }
        assert_eq!(
            t.check(&meta(S_IFREG | 0o660, 1000, 50)),
            Err(FileProblem::WrongGroup { mode: 0o660, gid: 50, allowed_group: 77 })
        );
        assert_eq!(
            t.check(&meta(S_IFREG | 0o660, 1001, 50)),
            Err(FileProblem::ForeignOwner { uid: 1001, euid: 1000, gid: 50, allowed_group: Some(77) })
        );
    }

    #[test]
    fn create_modes_are_checked() {
        assert!(check_create_mode(0o600, None).is_ok());
        assert!(check_create_mode(0o660, Some(5)).is_ok());
        assert!(check_create_mode(0o640, Some(5)).is_ok());
        for (m, g) in
            [(0o660, None), (0o606, None), (0o666, Some(5)), (0o400, None), (0o4600, None), (0o600, Some(u32::MAX))]
        {
            assert!(matches!(check_create_mode(m, g), Err(RegionError::BadFileMode { .. })), "{m:o} {g:?}");
        }
    }

    #[test]
    fn problems_say_what_was_wrong() {
        let s = |p: FileProblem| p.to_string();
        assert!(s(FileProblem::ForeignOwner { uid: 65534, euid: 0, gid: 65534, allowed_group: None })
            .contains("owned by uid 65534, not us (uid 0)"));
        assert!(s(FileProblem::Mode { mode: 0o666, allowed_group: None }).contains("mode 0o666 has group/other"));
        assert!(s(FileProblem::Symlink).contains("symbolic link"));
    }
}
