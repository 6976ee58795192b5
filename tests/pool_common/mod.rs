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
