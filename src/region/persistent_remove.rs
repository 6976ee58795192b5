//! Taking a persistent region apart ([`super::persistent`]):
//! [`Region::remove_persistent`], which `kvoffload pool rm` calls, and the
//! removal of a half-made region whose creator is gone, both under the
//! region's lock; the lock itself and the view of a header that is not
//! (or not yet) a whole region's.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};
use tracing::{debug, info, warn};

use super::error::{JoinPhase, RegionError};
use super::files;
use super::header::{Hdr, JoinState, JoinWord, PERSISTENT_MAGIC};
use super::options::{ShmOptions, MAX_FILES};
use super::shm::{interrupted_error, shm_path};
use super::shm_files::{header_name, Linked};
use super::sys::Backoff;
use super::trust::{self, FileMeta, OpenFailure, RegionDir, Trust};
use super::Region;

type Result<T> = std::result::Result<T, RegionError>;

impl Region {
    /// Removes the persistent region `name` in `opts.dir`
    /// ([`Region::open_persistent`]): its data files, then its header
    /// file. Returns the paths removed. Processes that have it mapped keep
    /// their mappings (the memory goes when the last one unmaps).
    ///
    /// Never follows a link and removes nothing unless every file passes:
    /// the header is opened with the trust checks of `join`
    /// ([`RegionError::UntrustedFile`]: a link, not a regular file, another
    /// user's, group or other bits unless [`ShmOptions::allow_group`]) and
    /// must be a persistent region's ([`RegionError::BadHeader`] on
    /// `magic`: a create/join region is not removed here); each data file
    /// is looked at without following links and must pass the same checks
    /// and be the inode the header's table records (or, where the table
    /// has none yet, an empty file). Each is unlinked only if its name
    /// still names the inode checked. Waits (up to [`ShmOptions::timeout`],
    /// interruptible) while another live process creates or removes it
    /// ([`RegionError::PersistentBusy`]); no region of that name is
    /// [`RegionError::NoSuchRegion`].
    pub fn remove_persistent(name: &str, opts: &ShmOptions) -> Result<Vec<PathBuf>> {
        let path = shm_path(&opts.dir, name)?;
        let dir = RegionDir::open(&opts.dir).map_err(|e| RegionError::io("open (directory)", &opts.dir, e))?;
        let trust = Trust::current(opts.allow_group);
        let hname = header_name(&path);
        let mut backoff = Backoff::new(opts.timeout);
        let mut interrupt = opts.interrupt_check();
        loop {
            let file = match dir.open_existing(&hname, &trust) {
                Ok(f) => f,
                Err(OpenFailure::Missing) => return Err(RegionError::NoSuchRegion { path }),
                Err(OpenFailure::Untrusted(problem)) => return Err(dir.untrusted(&hname, problem)),
                Err(OpenFailure::Io(op, e)) => return Err(RegionError::io(op, &path, e)),
            };
            let header = Linked::of(&dir, hname.clone(), &file)?;
            if !lock(&file, &path)? {
                if interrupt.due() {
                    return Err(interrupted_error(&path, JoinPhase::CreatorToInitialise));
                }
                if !backoff.wait() {
                    return Err(RegionError::PersistentBusy { path, timeout: opts.timeout });
                }
                continue;
            }
            if !still_names(&dir, &header)? {
                // Removed (and perhaps made anew) meanwhile: look again.
                continue;
            }
            let view = HeaderView::map(&file, &path)?;
            if let Some(v) = &view {
                let (w, f) = (v.hdr().load(), v.hdr().read_fields());
                let half_made = f.magic == 0 && matches!(w.state, JoinState::Init | JoinState::Abandoned);
                if f.magic != PERSISTENT_MAGIC && !half_made {
                    return Err(RegionError::BadHeader {
                        path,
                        field: "magic",
                        expected: PERSISTENT_MAGIC,
                        found: f.magic,
                    });
                }
            }
            let removed = remove_locked(&dir, &header, &trust, view.as_ref())?;
            info!(path = %path.display(), files = removed.len(), "removed persistent region");
            return Ok(removed);
        }
    }
}

impl RegionError {
    /// Whether this error of [`Region::remove_persistent`] came before it
    /// removed or marked anything: every error but an `unlink`'s does
    /// (the files are all checked, and the header marked `Abandoned`, only
    /// then unlinked), so the region is as it was and still usable.
    pub(crate) fn removed_nothing(&self) -> bool {
        !matches!(self, RegionError::Io { op: "unlink", .. })
    }
}

/// Takes the region file's lock without waiting (false: another holds it).
pub(super) fn lock(file: &File, path: &Path) -> Result<bool> {
    trust::try_lock_exclusive(file).map_err(|e| RegionError::io("flock", path, e))
}

/// Whether the header's name still names the inode `header` opened.
pub(super) fn still_names(dir: &RegionDir, header: &Linked) -> Result<bool> {
    let m = dir.lstat(header.name()).map_err(|e| RegionError::io("stat", dir.path_of(header.name()), e))?;
    Ok(m.is_some_and(|m| (m.dev, m.ino) == header.inode()))
}

/// The start of a header file, mapped to read its words: enough for the
/// fixed header and the largest file table.
pub(super) struct HeaderView {
    map: MmapRaw,
}

impl HeaderView {
    /// None when the file is shorter than one header page (not sized yet).
    pub(super) fn map(file: &File, path: &Path) -> Result<Option<HeaderView>> {
        let len = FileMeta::of_file(file).map_err(|e| RegionError::io("fstat", path, e))?.size;
        let page = files::header_bytes(0);
        if len < page as u64 {
            return Ok(None);
        }
        let most = files::header_bytes(MAX_FILES) as u64;
        let map = MmapOptions::new()
            .len(len.min(most) as usize)
            .map_raw(file)
            .map_err(|e| RegionError::io("mmap (header)", path, e))?;
        Ok(Some(HeaderView { map }))
    }

    pub(super) fn hdr(&self) -> Hdr<'_> {
        let base = std::ptr::NonNull::new(self.map.as_mut_ptr()).expect("mmap never returns null");
        // SAFETY: the mapping is page aligned, at least one header page
        // (>= size_of::<Header>(), checked in `map`) long, and lives as
        // long as `self`, which the handle borrows.
        unsafe { Hdr::from_base(base, self.map.len()) }
    }
}

/// Removes a persistent region's files while holding its lock: checks
/// every file first (nothing removed if one fails), marks the header
/// `Abandoned`, unlinks the data files, then the header, each only if its
/// name still names the inode checked. Returns the paths removed.
pub(super) fn remove_locked(
    dir: &RegionDir,
    header: &Linked,
    trust: &Trust,
    view: Option<&HeaderView>,
) -> Result<Vec<PathBuf>> {
    let (hdev, hino) = header.inode();
    // Data files exist only once the header is sized (a view).
    let (count, table): (usize, Vec<u64>) = match view {
        None => (0, Vec::new()),
        Some(v) => {
            let table: Vec<u64> =
                v.hdr().file_inodes().iter().map(|i| i.load(core::sync::atomic::Ordering::Acquire)).collect();
            let f = v.hdr().read_fields();
            // Without a magic the count is not written: every entry the
            // view holds (a name not there is skipped).
            let count = if f.magic == PERSISTENT_MAGIC { f.num_files as usize } else { table.len().min(MAX_FILES) };
            if count > table.len().min(MAX_FILES) {
                return Err(RegionError::HeaderOutOfRange {
                    path: dir.path_of(header.name()),
                    field: "num_files",
                    found: count as u64,
                    limit: table.len().min(MAX_FILES) as u64 + 1,
                });
            }
            (count, table)
        }
    };
    let mut doomed = Vec::new();
    for (k, &want) in table.iter().enumerate().take(count) {
        let name = files::data_name(header.name(), k);
        let path = dir.path_of(&name);
        let Some(m) = dir.lstat(&name).map_err(|e| RegionError::io("stat", &path, e))? else { continue };
        trust.check(&m).map_err(|problem| dir.untrusted(&name, problem))?;
        let ours = m.dev == hdev && if want != 0 { m.ino == want } else { m.size == 0 };
        if !ours {
            warn!(path = %path.display(), "not this region's data file; removing nothing");
            return Err(RegionError::BadHeader { path, field: "data file inode", expected: want, found: m.ino });
        }
        doomed.push((name, m.dev, m.ino));
    }
    if let Some(v) = view {
        let _ = v.hdr().update(|w| {
            matches!(w.state, JoinState::Init | JoinState::Ready)
                .then_some(JoinWord { state: JoinState::Abandoned, ..w })
        });
    }
    let mut removed = Vec::new();
    for (name, dev, ino) in doomed.iter().chain(std::iter::once(&(header.name().to_owned(), hdev, hino))) {
        let path = dir.path_of(name);
        if dir.unlink_if_inode(name, *dev, *ino).map_err(|e| RegionError::io("unlink", &path, e))? {
            debug!(path = %path.display(), "removed a persistent region file");
            removed.push(path);
        }
    }
    Ok(removed)
}
