//! Helpers shared by the region tests: unique names, cleanup guards, child
//! processes re-executing the test binary.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvoffload::internal::region::{fs_available, shm_path};
use kvoffload::{page_size, FileSplit, Layout, ShmOptions, DEFAULT_SHM_DIR};

/// Env var that makes a re-executed test binary play a child role.
pub const ROLE_ENV: &str = "KVOFFLOAD_REGION_TEST_ROLE";
/// Env var carrying the region name to a child.
pub const NAME_ENV: &str = "KVOFFLOAD_REGION_TEST_NAME";

/// A layout of one rank 16 pages larger than what /dev/shm has free now.
pub fn larger_than_dev_shm() -> Layout {
    let free = fs_available(Path::new(DEFAULT_SHM_DIR)).unwrap();
    let rows = (free / page_size() as u64 + 16) as usize;
    Layout::new(1, page_size(), rows).unwrap()
}

/// One-page rows, `n` ranks of `rows` rows.
pub fn small(n: usize, rows: usize) -> Layout {
    Layout::new(n, page_size(), rows).unwrap()
}

/// The page size, and a rank-major layout of `n` ranks of `rows` one-page
/// rows.
pub fn page_rows(n: usize, rows: usize) -> (usize, Layout) {
    let p = page_size();
    (p, Layout::rank_major(n, p, rows).unwrap())
}

/// Region options that time out after `ms` milliseconds.
pub fn opts(ms: u64) -> ShmOptions {
    ShmOptions::new().timeout(Duration::from_millis(ms))
}

/// Both ways of splitting a region into files: one file, and data files.
pub const SPLITS: [FileSplit; 2] = [FileSplit::Single, FileSplit::Multi { max_file_bytes: 256 << 20 }];

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A region name unique to this process and call: `t<pid>-<n>-<tag>`.
pub fn unique_name(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("t{}-{}-{}", std::process::id(), n, tag)
}

/// Removes a region's files (the header file and its data files
/// `<header>.<k>`) on drop, whatever the test did.
pub struct ShmGuard {
    pub name: String,
    pub path: PathBuf,
    pub dir: PathBuf,
}

impl ShmGuard {
    pub fn new(tag: &str) -> Self {
        Self::in_dir(tag, Path::new(DEFAULT_SHM_DIR))
    }

    /// A guard for a region in `dir`.
    pub fn in_dir(tag: &str, dir: &Path) -> Self {
        let name = unique_name(tag);
        let path = shm_path(dir, &name).unwrap();
        ShmGuard { name, path, dir: dir.to_path_buf() }
    }

    /// Data file `k`'s path.
    pub fn data_path(&self, k: usize) -> PathBuf {
        PathBuf::from(format!("{}.{k}", self.path.display()))
    }

    /// Names of the region's files listed in its directory: the header
    /// file and every `<header>.<k>`.
    pub fn files(&self) -> Vec<String> {
        let base = self.path.file_name().unwrap().to_str().unwrap().to_owned();
        let dotted = format!("{base}.");
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| *n == base || n.strip_prefix(&dotted).is_some_and(|k| k.parse::<usize>().is_ok()))
            .collect();
        v.sort();
        v
    }

    /// Whether the header file of this name is listed.
    pub fn listed(&self) -> bool {
        let file_name = self.path.file_name().unwrap().to_owned();
        std::fs::read_dir(&self.dir).unwrap().any(|e| e.unwrap().file_name() == file_name)
    }

    /// Asserts no entry of the directory is a file of this region.
    #[track_caller]
    pub fn assert_gone(&self) {
        let left = self.files();
        assert!(left.is_empty(), "left behind in {}: {left:?}", self.dir.display());
    }
}

impl Drop for ShmGuard {
    fn drop(&mut self) {
        if self.dir.is_dir() {
            for f in self.files() {
                let _ = std::fs::remove_file(self.dir.join(f));
            }
        }
    }
}

/// A child process that is killed and reaped on drop.
pub struct ChildGuard {
    pub child: Option<Child>,
}

impl ChildGuard {
    /// Re-executes this test binary running only `test` (exact name) with
    /// the child role `role`, region `name`, and stdin piped (a child may
    /// block reading it until killed).
    pub fn spawn(test: &str, role: &str, name: &str) -> Self {
        Self::spawn_with(test, role, name, Stdio::null())
    }

    fn spawn_with(test: &str, role: &str, name: &str, stdout: Stdio) -> Self {
        let exe = std::env::current_exe().unwrap();
        let child = Command::new(exe)
            .args([test, "--exact", "--nocapture", "--test-threads=1", "-q"])
            .env(ROLE_ENV, role)
            .env(NAME_ENV, name)
            .stdin(Stdio::piped())
            .stdout(stdout)
            .spawn()
            .expect("spawn child");
        ChildGuard { child: Some(child) }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// SIGKILL, then reap; returns the exit status.
    pub fn kill9(&mut self) -> ExitStatus {
        let mut c = self.child.take().unwrap();
        // SAFETY: kill(2) on the pid of our own unreaped child (it cannot
        // have been recycled: we have not waited for it yet).
        let rc = unsafe { libc::kill(c.id() as i32, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
        c.wait().unwrap()
    }

    /// Like [`ChildGuard::spawn`] with the child's stdout piped, for
    /// [`ChildGuard::read_line`].
    pub fn spawn_piped(test: &str, role: &str, name: &str) -> Self {
        Self::spawn_with(test, role, name, Stdio::piped())
    }

    /// Reads the child's stdout until a line starting with `prefix`
    /// (blocking: the child prints it and then blocks). Panics if the
    /// child's stdout ends first.
    pub fn read_line(&mut self, prefix: &str) -> String {
        use std::io::BufRead;
        let out = self.child.as_mut().unwrap().stdout.as_mut().expect("spawn_piped");
        let mut r = std::io::BufReader::new(out);
        loop {
            let mut line = String::new();
            let n = r.read_line(&mut line).unwrap();
            assert!(n > 0, "the child's stdout ended before a line starting with {prefix:?}");
            if line.starts_with(prefix) {
                return line.trim_end().to_string();
            }
        }
    }

    /// Waits for the child's exit status.
    pub fn wait(&mut self) -> ExitStatus {
        let mut c = self.child.take().unwrap();
        drop(c.stdin.take());
        c.wait().unwrap()
    }

    /// Polls whether the child has exited, without blocking.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().unwrap().try_wait().unwrap()
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The child role this process plays, if it was spawned as a child.
pub fn child_role() -> Option<(String, String)> {
    let role = std::env::var(ROLE_ENV).ok()?;
    let name = std::env::var(NAME_ENV).expect("child without a region name");
    Some((role, name))
}

/// Blocks until stdin closes (the parent kills us or drops the pipe).
pub fn block_on_stdin() {
    use std::io::Read;
    let mut buf = [0u8; 1];
    let _ = std::io::stdin().read(&mut buf);
}

/// Polls `cond` until it holds or `timeout` passes; returns whether it held.
pub fn poll_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
        std::thread::sleep(Duration::from_micros(200)); // poll interval, not synchronisation
    }
}

/// Writes `bytes` to a new file at `path` with mode 0600 exactly (what a
/// creator makes: the region's files are this user's alone), whatever the
/// umask.
pub fn write_private(path: &Path, bytes: &[u8]) {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).unwrap();
    f.write_all(bytes).unwrap();
    f.set_permissions(std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// Everything a refused joiner must leave as it was: contents, type and
/// mode, owner, inode, modification and change times (`lstat`: a link is
/// described itself, not its target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The contents of a regular file.
    pub bytes: Option<Contents>,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub ino: u64,
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
}

impl Snapshot {
    /// The file at `path` now (its bytes if it is a regular file).
    pub fn of(path: &Path) -> Snapshot {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(path).unwrap();
        let bytes = m.file_type().is_file().then(|| Contents(std::fs::read(path).unwrap()));
        Snapshot {
            bytes,
            mode: m.mode(),
            uid: m.uid(),
            gid: m.gid(),
            ino: m.ino(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// A file's bytes, compared in full, shown as their length, a digest and
/// the first non-zero bytes (a page of zeros would flood the test output).
#[derive(Clone, PartialEq, Eq)]
pub struct Contents(pub Vec<u8>);

impl std::fmt::Debug for Contents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fnv = self.0.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3));
        let nonzero: Vec<(usize, u8)> = self.0.iter().copied().enumerate().filter(|(_, b)| *b != 0).take(8).collect();
        write!(f, "{} bytes, fnv1a {fnv:016x}, first non-zero (offset, byte): {nonzero:?}", self.0.len())
    }
}

/// Re-runs the test `test` of this binary in a private mount namespace of
/// its own (`unshare -m`), with `child_env` set so that it runs its cases
/// (`what`) there: whether it succeeded and its stdout and stderr. `None`
/// (the skip printed) where no such namespace can be made here.
pub fn in_a_private_mount_namespace(test: &str, child_env: &str, what: &str) -> Option<(bool, String)> {
    let ok = Command::new("unshare").args(["-m", "true"]).status().is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: cannot make a private mount namespace here (unshare -m); {what} did not run");
        return None;
    }
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private"])
        .arg(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture"])
        .env(child_env, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Some((out.status.success(), text))
}
