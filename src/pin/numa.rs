//! NUMA placement of pinning: the pre-fault threads run on the CPUs of the
//! GPU's NUMA node and the region's pages are preferred there, so the pages
//! the GPU copies from sit next to its PCIe root, and faulting them does not
//! cross the interconnect.
//!
//! - [`Topology::read`]: the nodes (`devices/system/node/node*/cpulist`,
//!   `MemFree` of `node*/meminfo`) and the GPU's node
//!   (`bus/pci/devices/<bus id>/numa_node`, `-1`: none) under a sysfs root
//!   (`/sys`, [`SYSFS_ROOT`]; tests pass a fake tree).
//! - [`decide`]: a pure function from a [`NumaPolicy`], a topology and the
//!   bytes to pin to a [`Placement`]: a node and its CPUs, or a typed
//!   [`NumaFallback`] saying why nothing is placed (one node: nothing to
//!   choose; GPU node unknown; the node cannot hold the region ...).
//! - Applying it ([`prefer_node`], [`bind_current_thread`]): one raw
//!   `mbind(MPOL_PREFERRED)` per chunk before any page of it is faulted
//!   (libc has no wrapper and rustix none either), and `sched_setaffinity` in
//!   each pre-fault worker as it starts. `MPOL_PREFERRED` is a preference,
//!   not a binding: when the node runs out the kernel takes pages from other
//!   nodes instead of failing the fault.
//!
//! The H200 machine and the development machine each have one node, so the
//! multi-node decisions are tested on described topologies
//! (`tests/pin_numa.rs`, fake sysfs trees) and the application on the one
//! real node. The H200 machine (a Firecracker VM, kernel 6.18: "No NUMA
//! configuration found") has node 0 with CPUs 0-15 and its GPU at
//! 0000:00:06.0 with `numa_node` -1; its node 0 `meminfo` reports 4.6 GB
//! total and 3.4 GB free while `/proc/meminfo` reports 126 GiB free, so a
//! node's `MemFree` can under-report: the one-node check comes before the
//! size check, and on such a machine [`NumaPolicy::Auto`] is a no-op.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// The sysfs root read by pinning.
pub const SYSFS_ROOT: &str = "/sys";

/// `MPOL_PREFERRED` of `<linux/mempolicy.h>` (libc does not export the
/// mempolicy modes).
pub const MPOL_PREFERRED: i32 = 1;
/// `MPOL_DEFAULT`.
pub const MPOL_DEFAULT: i32 = 0;
/// `MPOL_F_ADDR` of `get_mempolicy`: the policy of the mapping at `addr`.
const MPOL_F_ADDR: libc::c_ulong = 1 << 1;

/// Bits of the node masks passed to the kernel (the kernel's default
/// `CONFIG_NODES_SHIFT` limit of 1024 nodes).
const MASK_BITS: usize = 1024;
const MASK_WORDS: usize = MASK_BITS / 64;

/// Where pinning places its threads and pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum NumaPolicy {
    /// The GPU's node when sysfs names one and its free memory holds the
    /// bytes to pin; otherwise nothing is placed (logged with the reason).
    #[default]
    Auto,
    /// Nothing is placed: the kernel's default policy, threads anywhere.
    Off,
    /// This node, whatever the GPU's (still refused, with a typed reason,
    /// when the node does not exist or cannot hold the bytes).
    Node(u32),
}

/// One NUMA node as sysfs describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaNode {
    /// Its number (`nodeN`).
    pub id: u32,
    /// Its CPUs (`cpulist`); empty for a memory-only node.
    pub cpus: Vec<usize>,
    /// `MemFree` of its `meminfo`, in bytes; `None` when unreadable.
    pub mem_free: Option<u64>,
}

/// The machine's nodes and the GPU's place among them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The online nodes, by number.
    pub nodes: Vec<NumaNode>,
    /// The GPU's PCI bus id (`0000:1b:00.0`), when the runtime knows it.
    pub gpu_bus_id: Option<String>,
    /// The GPU's node: `None` when the bus id is unknown, its `numa_node`
    /// file is missing or says `-1` (no affinity reported).
    pub gpu_node: Option<u32>,
}

/// Why a topology could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading the NUMA topology from {path}: {source}")]
pub struct TopologyError {
    /// The file or directory that failed.
    pub path: PathBuf,
    /// What the system call answered.
    #[source]
    pub source: io::Error,
}

/// Why no node was placed. Each is logged by [`Placement::log`]; pinning
/// goes on unplaced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NumaFallback {
    /// [`NumaPolicy::Off`].
    #[error("NUMA placement is off")]
    Off,
    /// One node: every page and CPU is on it already; placement is a no-op.
    #[error("one NUMA node ({node}): placement is a no-op")]
    SingleNode {
        /// The NUMA node id, as in `/sys/devices/system/node/node<id>`.
        node: u32,
    },
    /// The topology could not be read (a kernel without NUMA in sysfs ...).
    #[error("the NUMA topology is unknown: {msg}")]
    NoTopology {
        /// What failed.
        msg: String,
    },
    /// [`NumaPolicy::Auto`] and the runtime gave no PCI bus id (the
    /// simulated GPU, or the driver did not answer).
    #[error("the GPU's PCI bus id is unknown, so is its NUMA node")]
    GpuBusIdUnknown,
    /// [`NumaPolicy::Auto`] and sysfs gives the GPU no node (`numa_node`
    /// is -1 or missing).
    #[error("sysfs gives the GPU {bus_id} no NUMA node (numa_node -1 or missing)")]
    GpuNodeUnknown {
        /// The GPU's bus id.
        bus_id: String,
    },
    /// The node asked for (or the GPU's) is not among the online nodes.
    #[error("NUMA node {node} is not online (nodes: {online:?})")]
    NoSuchNode {
        /// The NUMA node id, as in `/sys/devices/system/node/node<id>`.
        node: u32,
        /// The node ids the kernel lists as online.
        online: Vec<u32>,
    },
    /// The node's free memory cannot hold the bytes to pin.
    #[error("NUMA node {node} has {free} bytes free, less than the {bytes} bytes to pin")]
    NodeTooSmall {
        /// The NUMA node id, as in `/sys/devices/system/node/node<id>`.
        node: u32,
        /// Its `MemFree`.
        free: u64,
        /// The bytes to pin.
        bytes: u64,
    },
    /// `mbind` refused the policy for a chunk (nothing is placed then:
    /// chunks bound before it are reset to the default policy).
    #[error("mbind(MPOL_PREFERRED, node {node}) of {len} bytes at {addr:#x} failed: {msg}")]
    Mbind {
        /// The NUMA node id, as in `/sys/devices/system/node/node<id>`.
        node: u32,
        /// Start of the range.
        addr: usize,
        /// Bytes of the range.
        len: usize,
        /// The errno's text.
        msg: String,
    },
}

/// What [`decide`] chose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Pages preferred on `node`, pre-fault threads on `cpus` (not pinned
    /// when empty: a memory-only node).
    Node {
        /// The NUMA node id, as in `/sys/devices/system/node/node<id>`.
        node: u32,
        /// Its CPUs.
        cpus: Vec<usize>,
    },
    /// Nothing placed, and why.
    Unplaced(NumaFallback),
}

impl Placement {
    /// The node pages are preferred on, if any.
    pub fn node(&self) -> Option<u32> {
        match self {
            Placement::Node { node, .. } => Some(*node),
            Placement::Unplaced(_) => None,
        }
    }

    /// The CPUs pre-fault threads run on (empty: anywhere).
    pub fn cpus(&self) -> &[usize] {
        match self {
            Placement::Node { cpus, .. } => cpus,
            Placement::Unplaced(_) => &[],
        }
    }

    /// The fallback reason, if nothing is placed.
    pub fn fallback(&self) -> Option<&NumaFallback> {
        match self {
            Placement::Node { .. } => None,
            Placement::Unplaced(r) => Some(r),
        }
    }

    /// Logs the decision: a placement or a no-op at info, a fallback that
    /// loses locality (the node cannot hold the region, mbind refused, a
    /// node that does not exist) at warn, the rest at info.
    pub fn log(&self, bytes: u64) {
        match self {
            Placement::Node { node, cpus } => {
                tracing::info!(
                    node,
                    cpus = cpus.len(),
                    bytes,
                    "NUMA: pre-faulting on the GPU's node, pages preferred there"
                )
            }
            Placement::Unplaced(
                r @ (NumaFallback::NodeTooSmall { .. } | NumaFallback::Mbind { .. } | NumaFallback::NoSuchNode { .. }),
            ) => tracing::warn!(reason = %r, bytes, "NUMA: no placement"),
            Placement::Unplaced(r) => tracing::info!(reason = %r, bytes, "NUMA: no placement"),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Node { node, cpus } => write!(f, "node {node} ({} CPUs)", cpus.len()),
            Placement::Unplaced(r) => write!(f, "unplaced: {r}"),
        }
    }
}

/// Parses a sysfs CPU or node list (`0-3,8,10-11`; empty: none).
pub fn parse_list(text: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let num = |s: &str| s.trim().parse::<usize>().map_err(|e| format!("bad list item {part:?}: {e}"));
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if b < a {
                    return Err(format!("bad range {part:?}"));
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    Ok(out)
}

/// `MemFree` of a node's `meminfo` (`Node 0 MemFree:  14886928 kB`), in bytes.
pub fn parse_mem_free(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let rest = &l[l.find("MemFree:")? + "MemFree:".len()..];
        let mut it = rest.split_whitespace();
        let n: u64 = it.next()?.parse().ok()?;
        match it.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// A PCI bus id as sysfs names the device's directory: lower case, a
/// 4-digit domain (`0000:1B:00.0` and `00000000:1b:00.0` both give
/// `0000:1b:00.0`).
pub fn sysfs_bus_id(bus_id: &str) -> String {
    let id = bus_id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((dom, rest)) if rest.contains(':') => match u32::from_str_radix(dom, 16) {
            Ok(d) => format!("{d:04x}:{rest}"),
            Err(_) => id,
        },
        _ => id,
    }
}

impl Topology {
    /// Reads the online nodes and, given the GPU's PCI bus id, its node,
    /// from the sysfs tree at `root` (`/sys`: [`SYSFS_ROOT`]).
    ///
    /// Errors when `devices/system/node` cannot be listed or a node's
    /// `cpulist` cannot be read or parsed; a missing `meminfo` only leaves
    /// `mem_free` unknown, a missing `numa_node` the GPU's node.
    pub fn read(root: &Path, gpu_bus_id: Option<&str>) -> Result<Topology, TopologyError> {
        let dir = root.join("devices/system/node");
        let err = |path: &Path, source| TopologyError { path: path.to_path_buf(), source };
        let mut nodes = Vec::new();
        for entry in std::fs::read_dir(&dir).map_err(|e| err(&dir, e))? {
            let entry = entry.map_err(|e| err(&dir, e))?;
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let cpulist = entry.path().join("cpulist");
            let text = std::fs::read_to_string(&cpulist).map_err(|e| err(&cpulist, e))?;
            let cpus = parse_list(&text).map_err(|m| err(&cpulist, io::Error::new(io::ErrorKind::InvalidData, m)))?;
            let mem_free = std::fs::read_to_string(entry.path().join("meminfo")).ok().and_then(|t| parse_mem_free(&t));
            nodes.push(NumaNode { id, cpus, mem_free });
        }
        if nodes.is_empty() {
            return Err(err(&dir, io::Error::new(io::ErrorKind::NotFound, "no node* directories")));
        }
        nodes.sort_by_key(|n| n.id);
        let gpu_bus_id = gpu_bus_id.map(sysfs_bus_id);
        let gpu_node = gpu_bus_id.as_ref().and_then(|id| {
            let text = std::fs::read_to_string(root.join("bus/pci/devices").join(id).join("numa_node")).ok()?;
            u32::try_from(text.trim().parse::<i64>().ok()?).ok()
        });
        Ok(Topology { nodes, gpu_bus_id, gpu_node })
    }

    /// The node numbered `id`.
    pub fn node(&self, id: u32) -> Option<&NumaNode> {
        self.nodes.iter().find(|n| n.id == id)
    }
}

/// The placement for pinning `bytes` under `policy` on `topo` (pure; see
/// the module documentation and the table in `tests/pin_numa.rs`):
///
/// | policy | topology | placement |
/// |---|---|---|
/// | Off | any | Unplaced(Off) |
/// | Node(n), n not online | any | Unplaced(NoSuchNode) |
/// | any other | one node | Unplaced(SingleNode) |
/// | Auto | no bus id | Unplaced(GpuBusIdUnknown) |
/// | Auto | numa_node -1 or missing | Unplaced(GpuNodeUnknown) |
/// | Auto / Node(n) | node's MemFree < bytes | Unplaced(NodeTooSmall) |
/// | Auto / Node(n) | otherwise | Node (MemFree unknown counts as enough: the policy is only a preference) |
pub fn decide(policy: NumaPolicy, topo: &Topology, bytes: u64) -> Placement {
    let online = || topo.nodes.iter().map(|n| n.id).collect::<Vec<_>>();
    let target = match policy {
        NumaPolicy::Off => return Placement::Unplaced(NumaFallback::Off),
        NumaPolicy::Node(n) => {
            if topo.node(n).is_none() {
                return Placement::Unplaced(NumaFallback::NoSuchNode { node: n, online: online() });
            }
            n
        }
        NumaPolicy::Auto => {
            if topo.nodes.len() > 1 {
                let Some(bus_id) = &topo.gpu_bus_id else {
                    return Placement::Unplaced(NumaFallback::GpuBusIdUnknown);
                };
                match topo.gpu_node {
                    Some(n) => n,
                    None => return Placement::Unplaced(NumaFallback::GpuNodeUnknown { bus_id: bus_id.clone() }),
                }
            } else {
                topo.nodes.first().map_or(0, |n| n.id)
            }
        }
    };
    if topo.nodes.len() == 1 {
        return Placement::Unplaced(NumaFallback::SingleNode { node: topo.nodes[0].id });
    }
    let Some(node) = topo.node(target) else {
        return Placement::Unplaced(NumaFallback::NoSuchNode { node: target, online: online() });
    };
    if let Some(free) = node.mem_free {
        if free < bytes {
            return Placement::Unplaced(NumaFallback::NodeTooSmall { node: target, free, bytes });
        }
    }
    Placement::Node { node: target, cpus: node.cpus.clone() }
}

/// [`Topology::read`] then [`decide`], with a read failure as
/// [`NumaFallback::NoTopology`] (and nothing read under [`NumaPolicy::Off`]).
pub fn place(policy: NumaPolicy, root: &Path, gpu_bus_id: Option<&str>, bytes: u64) -> Placement {
    if policy == NumaPolicy::Off {
        return Placement::Unplaced(NumaFallback::Off);
    }
    let key = format!("numa topology of {} for {gpu_bus_id:?}", root.display());
    match crate::sync::host_fact(&key, || Topology::read(root, gpu_bus_id).map_err(|e| e.to_string())) {
        Ok(t) => decide(policy, &t, bytes),
        Err(msg) => Placement::Unplaced(NumaFallback::NoTopology { msg }),
    }
}

fn node_mask(node: u32) -> io::Result<[libc::c_ulong; MASK_WORDS]> {
    let n = node as usize;
    if n >= MASK_BITS {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("node {node} beyond {MASK_BITS} nodes")));
    }
    let mut mask = [0 as libc::c_ulong; MASK_WORDS];
    mask[n / 64] |= 1 << (n % 64);
    Ok(mask)
}

fn page_bounds(addr: usize, len: usize) -> (usize, usize) {
    let page = crate::region::page_size();
    let start = addr - addr % page;
    let end = (addr + len).div_ceil(page) * page;
    (start, end - start)
}

fn mbind(addr: usize, len: usize, mode: i32, mask: Option<&[libc::c_ulong; MASK_WORDS]>) -> io::Result<()> {
    let (start, len) = page_bounds(addr, len);
    let (ptr, maxnode) = match mask {
        Some(m) => (m.as_ptr(), MASK_BITS as libc::c_ulong + 1),
        None => (std::ptr::null(), 0),
    };
    // SAFETY: mbind(2) reads `maxnode - 1` bits from `ptr` (a live array of
    // MASK_BITS bits, or null with maxnode 0) and sets the memory policy of
    // the mappings in [start, start+len). Without MPOL_MF_MOVE/STRICT it
    // neither moves, writes nor frees any page, and it never creates or
    // removes a mapping: it changes only where pages not yet allocated will
    // come from, so no memory this process holds changes value or validity,
    // whatever the range (an unmapped one is refused with EFAULT/ENOMEM).
    // The callers pass ranges of the region they are pinning (our own
    // mapping), rounded out to whole pages of it.
    let r =
        unsafe { libc::syscall(libc::SYS_mbind, start, len, mode as libc::c_ulong, ptr, maxnode, 0 as libc::c_ulong) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets `MPOL_PREFERRED` for `node` on the pages of `[addr, addr+len)`
/// (rounded out to whole pages): pages faulted from now on come from that
/// node while it has free memory. Pages already resident stay where they
/// are. Meant for the caller's own mapping (the region being pinned); it
/// changes no memory contents.
pub fn prefer_node(addr: usize, len: usize, node: u32) -> io::Result<()> {
    mbind(addr, len, MPOL_PREFERRED, Some(&node_mask(node)?))
}

/// Resets `[addr, addr+len)` to the default policy (undoes [`prefer_node`]).
pub fn reset_policy(addr: usize, len: usize) -> io::Result<()> {
    mbind(addr, len, MPOL_DEFAULT, None)
}

/// The memory policy of the mapping at `addr` (`get_mempolicy` with
/// `MPOL_F_ADDR`): the mode ([`MPOL_PREFERRED`], [`MPOL_DEFAULT`] ...) and
/// the nodes of its mask.
pub fn policy_at(addr: usize) -> io::Result<(i32, Vec<u32>)> {
    let mut mode: libc::c_int = -1;
    let mut mask = [0 as libc::c_ulong; MASK_WORDS];
    // SAFETY: get_mempolicy(2) writes one int to `mode` and at most
    // `maxnode` (MASK_BITS) bits to `mask`, both live locals; `addr` is only
    // looked up, never accessed.
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            MASK_BITS as libc::c_ulong,
            addr,
            MPOL_F_ADDR,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((mode, nodes_in(&mask)))
}

/// The node ids whose bits are set in `mask` ([`node_mask`]'s inverse).
fn nodes_in(mask: &[libc::c_ulong; MASK_WORDS]) -> Vec<u32> {
    (0..MASK_BITS).filter(|&b| mask[b / 64] & (1 << (b % 64)) != 0).map(|b| b as u32).collect()
}

/// Applies the page half of a placement to `ranges` before they are
/// faulted: `mbind(MPOL_PREFERRED)` on each. On the first refusal the
/// ranges already bound are reset and the placement becomes
/// [`NumaFallback::Mbind`]; the result is what is now in effect.
pub fn apply_pages(placement: Placement, ranges: &[(usize, usize)]) -> Placement {
    let Placement::Node { node, .. } = placement else {
        return placement;
    };
    for (k, &(addr, len)) in ranges.iter().enumerate() {
        if len == 0 {
            continue;
        }
        if let Err(e) = prefer_node(addr, len, node) {
            for &(a, l) in ranges[..k].iter().filter(|r| r.1 > 0) {
                if let Err(e) = reset_policy(a, l) {
                    tracing::warn!(error = %e, addr = a, len = l, "NUMA: resetting the memory policy failed");
                }
            }
            return Placement::Unplaced(NumaFallback::Mbind { node, addr, len, msg: e.to_string() });
        }
    }
    placement
}

/// CPUs a `cpu_set_t` holds (its bits).
const CPU_SET_BITS: usize = 8 * std::mem::size_of::<libc::cpu_set_t>();

/// Restricts the calling thread to `cpus` (`sched_setaffinity`). Empty:
/// nothing done.
pub fn bind_current_thread(cpus: &[usize]) -> io::Result<()> {
    if cpus.is_empty() {
        return Ok(());
    }
    let limit = CPU_SET_BITS;
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= limit {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("CPU {c} beyond the {limit} of cpu_set_t"),
            ));
        }
        // SAFETY: c < the set's bit count (checked above); `set` is a live local.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a live cpu_set_t of the
    // size passed; the call only changes where this thread is scheduled.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The CPUs the calling thread may run on (`sched_getaffinity`).
pub fn current_thread_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: as in `bind_current_thread`.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; the kernel writes at most the
    // size passed into the live local `set`.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: c < the set's bit count.
    Ok((0..CPU_SET_BITS).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The machines the tests run on have node 0 only, where a mask's bit
    /// arithmetic cannot be wrong; these cover the other nodes.
    #[test]
    fn a_node_mask_holds_exactly_its_node() {
        for n in [0u32, 1, 63, 64, 65, 511, MASK_BITS as u32 - 1] {
            let m = node_mask(n).unwrap();
            assert_eq!(nodes_in(&m), vec![n], "node {n}");
            assert_eq!(m.iter().map(|w| w.count_ones()).sum::<u32>(), 1, "node {n}");
        }
        assert_eq!(node_mask(MASK_BITS as u32).unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn a_cpu_set_holds_cpu_setsize_cpus() {
        assert_eq!(CPU_SET_BITS, libc::CPU_SETSIZE as usize);
    }

    #[test]
    fn page_bounds_round_out_to_whole_pages() {
        let p = crate::region::page_size();
        assert_eq!(page_bounds(3 * p, p), (3 * p, p));
        assert_eq!(page_bounds(3 * p + 5, 10), (3 * p, p));
        assert_eq!(page_bounds(3 * p + 5, p), (3 * p, 2 * p));
        assert_eq!(page_bounds(3 * p - 1, 2), (2 * p, 2 * p));
    }
}
