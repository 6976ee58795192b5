//! Helpers of the pool tests: private directories on /dev/shm, a pool's
//! spec, and the config every mismatch test varies one field of.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvoffload::internal::pool::file::{PoolOptions, PoolSpec};
use kvoffload::internal::pool::fingerprint::{ConfigRecord, FixedStr, GroupRecord};
use kvoffload::internal::pool::words::Geometry;

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A directory of its own on /dev/shm (mode 0700), removed on drop, so a
/// test sees only its own pools.
pub struct ShmDir(pub PathBuf);

impl ShmDir {
    pub fn new(tag: &str) -> ShmDir {
        use std::os::unix::fs::PermissionsExt;
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let d = PathBuf::from(format!("/dev/shm/kvo-pool-test-{}-{n}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        ShmDir(d)
    }

    pub fn opts(&self) -> PoolOptions {
        PoolOptions::in_dir(&self.0)
    }

    /// Names in the directory, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    pub fn index(&self, name: &str) -> PathBuf {
        self.0.join(format!("kvoffload-pool-{name}.index"))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn s<const N: usize>(field: &'static str, v: &str) -> FixedStr<N> {
    FixedStr::new(field, v).unwrap()
}

/// The config the tests' engines have.
pub fn config() -> ConfigRecord {
    ConfigRecord {
        model: s("model", "meta-llama/Llama-3.1-8B-Instruct"),
        kv_dtype: s("dtype", "bfloat16"),
        tag: s("kvo_pool_tag", "rev-a"),
        groups: vec![
            GroupRecord { tokens_per_block: 16, layer_names_sha256: [0x11; 32] },
            GroupRecord { tokens_per_block: 32, layer_names_sha256: [0x22; 32] },
        ],
        tokens_per_hash: 16,
        blocks_per_chunk: 4,
        bytes_per_block: 65536,
        world_size: 2,
        tp_size: 2,
        pp_size: 1,
        pcp_size: 1,
        dcp_size: 1,
        kv_cache_layout: s("kv_cache_layout", "NHD"),
        replicated_layout: false,
    }
}

/// 64 slots in sets of 16, 2 ranks, 4 engine entries, rows of 256 KiB a rank.
pub fn spec() -> PoolSpec {
    PoolSpec {
        geometry: Geometry { slots: 64, ways: 16, ranks: 2, engines: 4 },
        row_bytes: 4 * 65536,
        config: config(),
    }
}

/// A child's stdout read line by line on a thread of its own, so that the
/// parent waits for a line with a deadline (a child that hangs or dies is
/// reported, never waited for without bound).
pub struct ChildLines {
    rx: std::sync::mpsc::Receiver<String>,
}

impl ChildLines {
    /// Reads `out` until it ends.
    pub fn new(out: std::process::ChildStdout) -> ChildLines {
        use std::io::BufRead;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        ChildLines { rx }
    }

    /// The next line starting with `prefix` (earlier lines are skipped),
    /// waiting at most `timeout`; panics if the child's stdout ends first
    /// (it died: its stderr is above) or the time runs out.
    pub fn expect(&self, prefix: &str, timeout: std::time::Duration) -> String {
        use std::sync::mpsc::RecvTimeoutError;
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match self.rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now())) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!("no line starting with {prefix:?} within {timeout:?}"),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the child's stdout ended before a line starting with {prefix:?}")
                }
            }
        }
    }
}
