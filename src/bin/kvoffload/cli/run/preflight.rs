//! Before any rank starts: which runtime, where the ranks go, the region
//! file's name, and the lines that say so.

use std::path::PathBuf;

use kvoffload::internal::region::{pages, shm_path};
use kvoffload::internal::runtime::cuda::CudaRuntime;
use kvoffload::units::fmt_bytes;

use crate::cli::backend::BackendArg;
use crate::run::config::Derived;
use crate::run::RunConfig;

use super::{Args, RankGpus};

/// What the parent settled before spawning its ranks.
pub(super) struct Plan {
    /// The sizes derived from the options (validated).
    pub d: Derived,
    /// `Cuda` or `Sim`, never `Auto`, and why (for the banner).
    pub backend: BackendArg,
    pub why: &'static str,
    /// `--rank-backend` for the ranks: "cuda" or "sim".
    pub bname: &'static str,
    /// This executable, started once per rank with `--as-rank`.
    pub exe: PathBuf,
    /// The region's name (unique per run) and its file under --region-dir.
    pub name: String,
    pub path: PathBuf,
    /// Rank r's GPU ordinal.
    pub devices: Vec<usize>,
}

/// Checks the options against this machine and settles the plan; an
/// unusable environment is an error naming the option.
pub(super) fn plan(a: &Args, cfg: &RunConfig) -> Result<Plan, String> {
    let d = cfg.validate().map_err(|e| e.to_string())?;
    let (backend, why) = match a.backend {
        BackendArg::Sim => (BackendArg::Sim, "asked for"),
        BackendArg::Cuda => (BackendArg::Cuda, "asked for"),
        BackendArg::Auto if CudaRuntime::driver_present() => (BackendArg::Cuda, "auto: a CUDA driver is present"),
        BackendArg::Auto => (BackendArg::Sim, "auto: no CUDA driver found"),
    };
    if backend == BackendArg::Cuda && (cfg.fault_copy_every.is_some() || cfg.fault_register_at.is_some()) {
        return Err("--fault-copy-every and --fault-register-at need the simulated GPU (--backend sim)".into());
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable to start ranks: {e}"))?;
    let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let name = format!("run-{}-{nonce}", std::process::id());
    if !cfg.region_dir.is_dir() {
        return Err(format!("--region-dir {}: not a directory", cfg.region_dir.display()));
    }
    // A directory on a kernel file system that holds no files of ours
    // (procfs, sysfs and the like) is a bad argument, not a rank's
    // failure. Told by the file system's type: a tmpfs mounted with size=0
    // (no limit) reports 0 blocks too, and is a good region directory.
    match rustix::fs::statfs(&cfg.region_dir) {
        Ok(st) => {
            if let Some(kind) = pseudo_fs(st.f_type as u64) {
                return Err(format!(
                    "--region-dir {}: a {kind} directory holds no files; give a directory on tmpfs, such as /dev/shm",
                    cfg.region_dir.display()
                ));
            }
        }
        Err(e) => return Err(format!("--region-dir {}: statfs: {e}", cfg.region_dir.display())),
    }
    let path = shm_path(&cfg.region_dir, &name).map_err(|e| e.to_string())?;
    let bname = if backend == BackendArg::Cuda { "cuda" } else { "sim" };
    let devices: Vec<usize> = match (backend, a.rank_gpus) {
        (BackendArg::Cuda, RankGpus::Spread) => {
            let n = CudaRuntime::device_count().map_err(|e| e.to_string())?.max(1);
            (0..cfg.ranks).map(|r| r % n).collect()
        }
        _ => vec![0; cfg.ranks],
    };
    Ok(Plan { d, backend, why, bname, exe, name, path, devices })
}

/// Prints what the run will do (the banner, the region directory's pages,
/// the fault tests asked for).
pub(super) fn announce(cfg: &RunConfig, plan: &Plan) {
    let Plan { d, backend, why, bname, devices, .. } = plan;
    let backend = *backend;
    let gpus_line = if backend != BackendArg::Cuda {
        "the simulated GPU".to_string()
    } else if devices.iter().all(|&d| d == 0) {
        "GPU 0 (shared: the ranks time-slice it and its PCIe link)".to_string()
    } else {
        format!("GPUs {}", devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","))
    };
    println!(
        "kvoffload run: {} ranks on {bname} ({why}); region {} ({} host blocks of {} per rank, {} pages of {} x {} layers); \
         {} requests per rank of {} blocks over {} keys (zipf {}), {} in flight",
        cfg.ranks,
        fmt_bytes(d.layout.data_bytes()),
        d.host_blocks,
        fmt_bytes(d.block_bytes),
        cfg.block_factor,
        fmt_bytes(cfg.page_bytes),
        cfg.layers,
        cfg.jobs,
        cfg.blocks_per_job,
        cfg.keys,
        cfg.zipf,
        cfg.inflight,
    );
    println!("ranks on {gpus_line}");
    match pages::mount_of(&cfg.region_dir) {
        Some(m) => {
            println!("region dir: {} ({})", cfg.region_dir.display(), m.pages());
            if m.small_pages_only() && backend == BackendArg::Cuda {
                println!(
                    "note: 4 KiB pages: the region is data files, each rank faulting and registering only its \
                     share (27 GB/s for 16 GiB on two H200s; one file pinned at 3-4 GB/s); a tmpfs mounted \
                     with huge=always (--region-dir) also gives 2 MiB pages"
                );
            }
        }
        None => println!("region dir: {} (mount unknown)", cfg.region_dir.display()),
    }
    if let Some(r) = cfg.kill_rank {
        println!("fault test: rank {r} is SIGKILLed at {}", cfg.kill_at.name());
    }
    if cfg.fault_copy_every.is_some() || cfg.fault_register_at.is_some() {
        let who = cfg.fault_rank.map_or("every rank".to_string(), |r| format!("rank {r}"));
        println!(
            "fault injection on {who}: copy fault every {} copies, registration fault at call {}",
            cfg.fault_copy_every.map_or("-".into(), |k| k.to_string()),
            cfg.fault_register_at.map_or("-".into(), |k| k.to_string())
        );
    }
}

/// The kernel's pseudo file systems by their magic numbers (statfs(2),
/// linux/magic.h): none can hold a region's files.
fn pseudo_fs(f_type: u64) -> Option<&'static str> {
    Some(match f_type {
        0x9fa0 => "procfs",
        0x6265_6572 => "sysfs",
        0x0027_e0eb => "cgroup",
        0x6367_7270 => "cgroup2",
        0x6462_6720 => "debugfs",
        0x7472_6163 => "tracefs",
        0x7363_6673 => "securityfs",
        0x1cd1 => "devpts",
        0xcafe_4a11 => "bpf",
        _ => return None,
    })
}
