//! NUMA placement of pinning: the decisions on described topologies (fake
//! sysfs trees in a temporary directory: one node, two nodes with the GPU on
//! node 1, a GPU with numa_node -1, a node too small for the region, ...),
//! and the application on this machine's real node 0: pre-fault workers
//! restricted to its CPUs, `mbind(MPOL_PREFERRED)` on an anonymous mapping
//! seen through `get_mempolicy` and `/proc/self/numa_maps`.
//!
//! The development machine and the H200 machine have one NUMA node each,
//! so every multi-node case here runs on a described topology.

#[path = "gpu_common/mod.rs"]
mod gpu_common;
mod pin_common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kvoffload::internal::pin::numa::{
    self, apply_pages, decide, parse_list, parse_mem_free, place, policy_at, prefer_node, reset_policy, sysfs_bus_id,
    NumaFallback, NumaNode, Placement, Topology, MPOL_DEFAULT, MPOL_PREFERRED,
};
use kvoffload::internal::pin::{Prefault, PrefaultConfig, Prefaulter, Prepared};
use kvoffload::{page_size, GpuRuntime, NumaPolicy, PinOptions, PinState, PrefaultMode, SimRuntime};

const GIB: u64 = 1 << 30;

/// A fake sysfs tree, removed on drop.
struct FakeSys(PathBuf);

impl FakeSys {
    /// `nodes`: (id, cpulist, MemFree in kB or None for no meminfo);
    /// `gpu`: (bus id as sysfs names it, numa_node text or None for no file).
    fn new(nodes: &[(u32, &str, Option<u64>)], gpu: Option<(&str, Option<&str>)>) -> FakeSys {
        static N: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "kvo-fake-sysfs-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let nd = root.join("devices/system/node");
        std::fs::create_dir_all(&nd).unwrap();
        // Files sysfs has beside the node directories.
        std::fs::write(nd.join("online"), "0\n").unwrap();
        std::fs::write(nd.join("possible"), "0\n").unwrap();
        std::fs::create_dir_all(nd.join("power")).unwrap();
        for &(id, cpus, free_kb) in nodes {
            let d = nd.join(format!("node{id}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
            if let Some(kb) = free_kb {
                std::fs::write(
                    d.join("meminfo"),
                    format!("Node {id} MemTotal:       {} kB\nNode {id} MemFree:        {kb} kB\nNode {id} MemUsed:  1 kB\n", kb * 2),
                )
                .unwrap();
            }
        }
        if let Some((bus, numa_node)) = gpu {
            let d = root.join("bus/pci/devices").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            if let Some(n) = numa_node {
                std::fs::write(d.join("numa_node"), format!("{n}\n")).unwrap();
            }
        }
        FakeSys(root)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for FakeSys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const BUS: &str = "0000:1b:00.0";
/// The driver's spelling of the same device (cuDeviceGetPCIBusId).
const DRIVER_BUS: &str = "0000:1B:00.0";

fn two_nodes(gpu_node: Option<&str>, node1_free_kb: u64) -> FakeSys {
    FakeSys::new(&[(0, "0-7,16-23", Some(64 << 20)), (1, "8-15,24-31", Some(node1_free_kb))], Some((BUS, gpu_node)))
}

#[test]
fn lists_meminfo_and_bus_ids_parse() {
    assert_eq!(parse_list("0-3,8,10-11\n").unwrap(), vec![0, 1, 2, 3, 8, 10, 11]);
    assert_eq!(parse_list("\n").unwrap(), Vec::<usize>::new());
    assert_eq!(parse_list("5").unwrap(), vec![5]);
    assert_eq!(parse_list("3-3,7").unwrap(), vec![3, 7], "a range of one");
    assert!(parse_list("3-1").is_err());
    assert!(parse_list("a-b").is_err());
    assert_eq!(parse_mem_free("Node 0 MemTotal: 100 kB\nNode 0 MemFree:        14886928 kB\n"), Some(14886928 * 1024));
    assert_eq!(parse_mem_free("Node 0 MemTotal: 100 kB\n"), None);
    assert_eq!(sysfs_bus_id("0000:1B:00.0"), BUS);
    assert_eq!(sysfs_bus_id("00000000:1B:00.0"), BUS);
    assert_eq!(sysfs_bus_id(" 0001:c1:00.0\n"), "0001:c1:00.0");
    assert_eq!(sysfs_bus_id("1B:00.0"), "1b:00.0", "no domain: nothing to widen");
}

#[test]
fn topology_is_read_from_a_fake_sysfs() {
    let fs = two_nodes(Some("1"), 32 << 20);
    let t = Topology::read(fs.path(), Some(DRIVER_BUS)).unwrap();
    assert_eq!(
        t.nodes,
        vec![
            NumaNode { id: 0, cpus: (0..8).chain(16..24).collect(), mem_free: Some(64 * GIB) },
            NumaNode { id: 1, cpus: (8..16).chain(24..32).collect(), mem_free: Some(32 * GIB) },
        ]
    );
    assert_eq!((t.gpu_bus_id.as_deref(), t.gpu_node), (Some(BUS), Some(1)));
    // -1 and a missing file both mean "no node"; so does an unknown bus id.
    for fs in [two_nodes(Some("-1"), 1), two_nodes(None, 1)] {
        assert_eq!(Topology::read(fs.path(), Some(BUS)).unwrap().gpu_node, None);
    }
    assert_eq!(Topology::read(fs.path(), Some("0000:99:00.0")).unwrap().gpu_node, None);
    assert_eq!(Topology::read(fs.path(), None).unwrap().gpu_bus_id, None);
    // No node directory at all: an error naming the path.
    let empty = FakeSys::new(&[], None);
    let e = Topology::read(empty.path(), None).unwrap_err();
    assert!(e.to_string().contains("devices/system/node"), "{e}");
    let bad = FakeSys::new(&[(0, "0-x", Some(1))], None);
    let e = Topology::read(bad.path(), None).unwrap_err();
    assert!(e.to_string().contains("cpulist"), "{e}");
}

/// A row of the decision table: what, topology, the GPU's bus id, policy,
/// bytes to pin, the placement expected.
type Row<'a> = (&'a str, &'a FakeSys, Option<&'a str>, NumaPolicy, u64, Placement);

/// The decision table (what `decide`'s documentation promises), each row on
/// a described topology.
#[test]
fn decisions_on_described_topologies() {
    let node1: Vec<usize> = (8..16).chain(24..32).collect();
    let node0: Vec<usize> = (0..8).chain(16..24).collect();
    let one = FakeSys::new(&[(0, "0-15", Some(100 << 20))], Some((BUS, Some("0"))));
    let gpu1 = two_nodes(Some("1"), 32 << 20);
    let gpu_none = two_nodes(Some("-1"), 32 << 20);
    let memonly = FakeSys::new(
        &[(0, "0-7", Some(8 << 20)), (1, "8-15", Some(8 << 20)), (2, "", Some(64 << 20))],
        Some((BUS, Some("2"))),
    );
    let no_meminfo = FakeSys::new(&[(0, "0-1", None), (1, "2-3", None)], Some((BUS, Some("1"))));
    let cases: Vec<Row> = vec![
        (
            "1 node, Auto",
            &one,
            Some(DRIVER_BUS),
            NumaPolicy::Auto,
            16 * GIB,
            Placement::Unplaced(NumaFallback::SingleNode { node: 0 }),
        ),
        (
            "1 node, Node(0)",
            &one,
            Some(DRIVER_BUS),
            NumaPolicy::Node(0),
            16 * GIB,
            Placement::Unplaced(NumaFallback::SingleNode { node: 0 }),
        ),
        (
            "1 node, Node(1)",
            &one,
            Some(DRIVER_BUS),
            NumaPolicy::Node(1),
            GIB,
            Placement::Unplaced(NumaFallback::NoSuchNode { node: 1, online: vec![0] }),
        ),
        ("1 node, Off", &one, Some(DRIVER_BUS), NumaPolicy::Off, GIB, Placement::Unplaced(NumaFallback::Off)),
        (
            "2 nodes, GPU on 1, Auto",
            &gpu1,
            Some(DRIVER_BUS),
            NumaPolicy::Auto,
            16 * GIB,
            Placement::Node { node: 1, cpus: node1.clone() },
        ),
        (
            "2 nodes, GPU on 1, fits exactly",
            &gpu1,
            Some(DRIVER_BUS),
            NumaPolicy::Auto,
            32 * GIB,
            Placement::Node { node: 1, cpus: node1.clone() },
        ),
        (
            "2 nodes, GPU on 1, Node(0)",
            &gpu1,
            Some(DRIVER_BUS),
            NumaPolicy::Node(0),
            16 * GIB,
            Placement::Node { node: 0, cpus: node0.clone() },
        ),
        (
            "2 nodes, GPU on 1, Off",
            &gpu1,
            Some(DRIVER_BUS),
            NumaPolicy::Off,
            16 * GIB,
            Placement::Unplaced(NumaFallback::Off),
        ),
        (
            "2 nodes, node 1 too small",
            &gpu1,
            Some(DRIVER_BUS),
            NumaPolicy::Auto,
            96 * GIB,
            Placement::Unplaced(NumaFallback::NodeTooSmall { node: 1, free: 32 * GIB, bytes: 96 * GIB }),
        ),
        (
            "2 nodes, Node(0) too small",
            &gpu1,
            Some(DRIVER_BUS),
            NumaPolicy::Node(0),
            65 * GIB,
            Placement::Unplaced(NumaFallback::NodeTooSmall { node: 0, free: 64 * GIB, bytes: 65 * GIB }),
        ),
        (
            "2 nodes, GPU numa_node -1",
            &gpu_none,
            Some(DRIVER_BUS),
            NumaPolicy::Auto,
            GIB,
            Placement::Unplaced(NumaFallback::GpuNodeUnknown { bus_id: BUS.into() }),
        ),
        (
            "2 nodes, no bus id (sim)",
            &gpu1,
            None,
            NumaPolicy::Auto,
            GIB,
            Placement::Unplaced(NumaFallback::GpuBusIdUnknown),
        ),
        (
            "2 nodes, Node(7)",
            &gpu1,
            None,
            NumaPolicy::Node(7),
            GIB,
            Placement::Unplaced(NumaFallback::NoSuchNode { node: 7, online: vec![0, 1] }),
        ),
        (
            "GPU on a memory-only node",
            &memonly,
            Some(BUS),
            NumaPolicy::Auto,
            16 * GIB,
            Placement::Node { node: 2, cpus: vec![] },
        ),
        (
            "MemFree unknown counts as enough",
            &no_meminfo,
            Some(BUS),
            NumaPolicy::Auto,
            1 << 50,
            Placement::Node { node: 1, cpus: vec![2, 3] },
        ),
    ];
    for (what, fs, bus, policy, bytes, want) in cases {
        let t = Topology::read(fs.path(), bus).unwrap();
        assert_eq!(decide(policy, &t, bytes), want, "{what}");
        assert_eq!(place(policy, fs.path(), bus, bytes), want, "{what} (place)");
        // The accessors agree with the variant, and the display names it.
        match &want {
            Placement::Node { node, cpus } => {
                assert_eq!((want.node(), want.cpus(), want.fallback()), (Some(*node), &cpus[..], None), "{what}");
                assert_eq!(want.to_string(), format!("node {node} ({} CPUs)", cpus.len()), "{what}");
            }
            Placement::Unplaced(r) => {
                assert_eq!((want.node(), want.cpus(), want.fallback()), (None, &[][..], Some(r)), "{what}");
                assert_eq!(want.to_string(), format!("unplaced: {r}"), "{what}");
            }
        }
        // Logging never panics, whatever the outcome.
        want.log(bytes);
    }
    // No sysfs: typed, and Off reads nothing.
    let missing = Path::new("/nonexistent-kvo-sysfs");
    match place(NumaPolicy::Auto, missing, Some(BUS), GIB) {
        Placement::Unplaced(NumaFallback::NoTopology { msg }) => {
            assert!(msg.contains("nonexistent-kvo-sysfs"), "{msg}")
        }
        other => panic!("expected NoTopology, got {other:?}"),
    }
    assert_eq!(place(NumaPolicy::Off, missing, None, GIB), Placement::Unplaced(NumaFallback::Off));
    let e = NumaFallback::NodeTooSmall { node: 1, free: 32 * GIB, bytes: 96 * GIB }.to_string();
    assert!(e.contains("node 1") && e.contains(&(96 * GIB).to_string()), "{e}");
}

/// This machine's topology, printed for the record (run with --nocapture).
fn real_topology() -> Topology {
    let t = Topology::read(Path::new(numa::SYSFS_ROOT), None).expect("this machine's /sys/devices/system/node");
    for n in &t.nodes {
        eprintln!("node {}: {} CPUs {:?}, MemFree {:?}", n.id, n.cpus.len(), n.cpus, n.mem_free);
    }
    t
}

struct Map(*mut libc::c_void, usize);

impl Map {
    fn new(pages: usize) -> Map {
        let len = pages * page_size();
        // SAFETY: a fresh private anonymous mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Map(p, len)
    }
    fn addr(&self) -> usize {
        self.0 as usize
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `new` (pages already unmapped
        // by a test are ignored by munmap).
        unsafe { libc::munmap(self.0, self.1) };
    }
}

/// The `/proc/self/numa_maps` line of the mapping at `addr`.
fn numa_maps_line(addr: usize) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/numa_maps").ok()?;
    let key = format!("{addr:x} ");
    text.lines().find(|l| l.starts_with(&key)).map(str::to_string)
}

/// The whole mask reaches the kernel: a preference for its last node
/// (1023), which this machine does not have, is refused. A mask cut short
/// by a wrong `maxnode` would reach the kernel empty, which it takes as
/// "allocate locally" and accepts.
#[test]
fn mbind_sees_the_masks_last_node() {
    let Ok(possible) = std::fs::read_to_string("/sys/devices/system/node/possible") else {
        eprintln!("SKIPPED mbind_sees_the_masks_last_node: no NUMA nodes in sysfs");
        return;
    };
    if parse_list(&possible).unwrap().contains(&1023) {
        eprintln!("SKIPPED mbind_sees_the_masks_last_node: this machine may have node 1023");
        return;
    }
    let m = Map::new(4);
    let e = prefer_node(m.addr(), m.1, 1023).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    assert_eq!(policy_at(m.addr()).unwrap().0, MPOL_DEFAULT, "nothing bound");
}

#[test]
fn mbind_prefers_node_0_on_an_anonymous_mapping() {
    let t = real_topology();
    let node = t.nodes[0].id;
    let m = Map::new(4);
    assert_eq!(policy_at(m.addr()).unwrap().0, MPOL_DEFAULT);
    let placed = apply_pages(Placement::Node { node, cpus: t.nodes[0].cpus.clone() }, &[(m.addr(), m.1)]);
    assert_eq!(placed.node(), Some(node), "{placed}");
    assert_eq!(policy_at(m.addr()).unwrap(), (MPOL_PREFERRED, vec![node]));
    assert_eq!(policy_at(m.addr() + 3 * page_size()).unwrap(), (MPOL_PREFERRED, vec![node]));
    // Fault a page in: it lands on the preferred node, and numa_maps says so.
    // SAFETY: the first byte of our own read-write mapping.
    unsafe { std::ptr::write_volatile(m.0 as *mut u8, 1) };
    if let Some(line) = numa_maps_line(m.addr()) {
        eprintln!("numa_maps: {line}");
        assert!(line.contains(&format!("prefer:{node}")), "{line}");
        assert!(line.contains(&format!("N{node}=1")), "{line}");
    }
    reset_policy(m.addr(), m.1).unwrap();
    assert_eq!(policy_at(m.addr()).unwrap().0, MPOL_DEFAULT);
    // A node that is not online: mbind refuses (EINVAL).
    assert!(prefer_node(m.addr(), m.1, 1000).is_err());
}

#[test]
fn a_refused_mbind_falls_back_typed_and_resets_the_bound_chunks() {
    let t = real_topology();
    let node = t.nodes[0].id;
    let page = page_size();
    let m = Map::new(3);
    // Unmap the middle page: the second chunk's mbind is refused.
    // SAFETY: the middle page of our own mapping, used by nothing.
    assert_eq!(unsafe { libc::munmap((m.addr() + page) as *mut libc::c_void, page) }, 0);
    let chunks = [(m.addr(), page), (m.addr() + page, page), (m.addr() + 2 * page, page)];
    match apply_pages(Placement::Node { node, cpus: vec![] }, &chunks) {
        Placement::Unplaced(NumaFallback::Mbind { node: n, addr, len, msg }) => {
            assert_eq!((n, addr, len), (node, m.addr() + page, page), "{msg}");
        }
        other => panic!("expected an mbind fallback, got {other:?}"),
    }
    // The first chunk was bound, then reset; the third never bound.
    assert_eq!(policy_at(m.addr()).unwrap().0, MPOL_DEFAULT);
    assert_eq!(policy_at(m.addr() + 2 * page).unwrap().0, MPOL_DEFAULT);
    // An unplaced placement applies nothing.
    let off = Placement::Unplaced(NumaFallback::Off);
    assert_eq!(apply_pages(off.clone(), &chunks), off);
}

/// The allowed CPUs of this process's threads named `name`.
fn cpus_of_threads(name: &str) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        out.push(cpus_allowed(&std::fs::read_to_string(e.path().join("status")).unwrap()));
    }
    out
}

#[test]
fn prefault_workers_run_on_the_nodes_cpus() {
    let t = real_topology();
    let all = t.nodes[0].cpus.clone();
    let mine = numa::current_thread_cpus().unwrap();
    // Node 0's CPUs that this process may use; the last of them alone too
    // (visible as a change even where node 0 is every CPU).
    let cpus: Vec<usize> = all.iter().copied().filter(|c| mine.contains(c)).collect();
    assert!(!cpus.is_empty());
    let last = vec![*cpus.last().unwrap()];
    for (k, want) in [cpus.clone(), last].into_iter().enumerate() {
        let m = Map::new(8);
        // One worker: `ensure` returns once it faulted the chunk, which it
        // does only after restricting itself (the first thing it runs), so
        // its CPUs are settled when they are read below. (With two, the
        // chunk may be done by worker 1 before worker 0 ran at all: the
        // test failed 3 of 30 runs on a loaded machine that way.)
        let cfg = PrefaultConfig { threads: 1, mode: PrefaultMode::Populate, huge_pages: false };
        // SAFETY: only `m`'s range is passed, and the pre-faulter is settled
        // (dropped) before `m`.
        let pf = unsafe { Prefaulter::new(cfg) }.on_cpus(want.clone());
        assert_eq!(pf.cpus(), &want[..]);
        pf.ensure(0, m.addr(), m.1).unwrap();
        let seen = cpus_of_threads(&format!("kvo-prefault-{}", 0));
        assert!(!seen.is_empty(), "case {k}: no pre-fault worker found");
        for s in seen {
            assert_eq!(s, want, "case {k}: a pre-fault worker's CPUs");
        }
        pf.settle();
        drop(pf);
    }
    // The calling thread itself, through the same call.
    std::thread::spawn(move || {
        numa::bind_current_thread(&cpus).unwrap();
        assert_eq!(numa::current_thread_cpus().unwrap(), cpus);
    })
    .join()
    .unwrap();
}

/// The allowed CPUs of the calling thread, as the kernel lists them in
/// /proc (not through `sched_getaffinity`, which `current_thread_cpus` reads).
fn cpus_of_this_thread() -> Vec<usize> {
    cpus_allowed(&std::fs::read_to_string("/proc/thread-self/status").unwrap())
}

/// The `Cpus_allowed_list` of a /proc `status` file.
fn cpus_allowed(status: &str) -> Vec<usize> {
    parse_list(status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap()).unwrap()
}

/// `current_thread_cpus` and `bind_current_thread` against the kernel's own
/// list: the CPUs the thread may use, then each alone, then all of them
/// with the set's last CPU where the machine has none (the kernel keeps
/// the CPUs that are; a bound on the set's bits that is too small would
/// refuse it).
#[test]
fn a_threads_cpus_are_the_kernels_list() {
    std::thread::spawn(|| {
        let mine = cpus_of_this_thread();
        assert_eq!(numa::current_thread_cpus().unwrap(), mine);
        for &c in &mine {
            numa::bind_current_thread(&[c]).unwrap();
            assert_eq!((numa::current_thread_cpus().unwrap(), cpus_of_this_thread()), (vec![c], vec![c]));
        }
        // CPU 1023, the set's last bit, where the machine has no such CPU.
        let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
        if !parse_list(&possible).unwrap().contains(&1023) {
            let with_absent: Vec<usize> = mine.iter().copied().chain([1023]).collect();
            numa::bind_current_thread(&with_absent).unwrap();
            assert_eq!(cpus_of_this_thread(), mine);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn prepared_reports_the_placement_on_this_machine() {
    let t = real_topology();
    let (r, opts) = pin_common::region(2, 1 << 20);
    let rt = SimRuntime::new();
    assert_eq!(opts.numa, NumaPolicy::Auto, "Auto is the default");
    let p = Prepared::new(&rt, &r, &opts).unwrap();
    let want = if t.nodes.len() == 1 {
        Placement::Unplaced(NumaFallback::SingleNode { node: t.nodes[0].id })
    } else {
        // The simulated GPU has no PCI bus id.
        Placement::Unplaced(NumaFallback::GpuBusIdUnknown)
    };
    assert_eq!(p.placement(), &want);
    assert!(matches!(p.pin(&rt), PinState::Pinned), "pins as before");
    drop(p);
    let (r, opts) = pin_common::region(2, 1 << 20);
    let p = Prepared::new(&rt, &r, &opts.numa(NumaPolicy::Off)).unwrap();
    assert_eq!(p.placement(), &Placement::Unplaced(NumaFallback::Off));
    assert!(matches!(p.pin(&rt), PinState::Pinned));
    drop(p);
    let (r, opts) = pin_common::region(2, 1 << 20);
    let p = Prepared::new(&rt, &r, &PinOptions { numa: NumaPolicy::Node(999), ..opts }).unwrap();
    assert!(
        matches!(p.placement(), Placement::Unplaced(NumaFallback::NoSuchNode { node: 999, .. })),
        "{:?}",
        p.placement()
    );
    assert!(matches!(p.pin(&rt), PinState::Pinned));
}

/// Prepared end to end on a described two-node topology whose node 0 is
/// this machine's real node 0 (its first usable CPU): the region's pages get
/// the preferred policy before pinning, the pre-faulter runs on the node's
/// CPU only (one worker: as many as the node has CPUs), and a node too
/// small for the region falls back typed with the region's policy untouched.
#[test]
fn prepared_places_a_region_on_a_described_topology() {
    let real = real_topology();
    let mine = numa::current_thread_cpus().unwrap();
    let cpu = *real.nodes[0].cpus.iter().find(|c| mine.contains(c)).unwrap();
    let node0 = real.nodes[0].id;
    let fs = FakeSys::new(&[(node0, &cpu.to_string(), Some(64 << 20)), (node0 + 1, "100-101", Some(64 << 20))], None);
    let rt = SimRuntime::new();
    let (r, opts) = pin_common::region(2, 1 << 20);
    let opts = opts.threads(2).numa(NumaPolicy::Node(node0)).numa_sysfs_root(fs.path());
    let data = r.as_slice().unwrap().as_ptr() as usize;
    let p = Prepared::new(&rt, &r, &opts).unwrap();
    assert_eq!(p.placement(), &Placement::Node { node: node0, cpus: vec![cpu] });
    let pf = p.prefaulter().unwrap();
    assert_eq!((pf.cpus(), pf.config().threads), (&[cpu][..], 1), "workers on the node's one CPU");
    assert_eq!(policy_at(data).unwrap(), (MPOL_PREFERRED, vec![node0]));
    assert_eq!(policy_at(data + (2 << 20) - page_size()).unwrap(), (MPOL_PREFERRED, vec![node0]));
    assert!(matches!(p.pin(&rt), PinState::Pinned));
    drop(p);

    let small = FakeSys::new(&[(node0, &cpu.to_string(), Some(1)), (node0 + 1, "100-101", Some(64 << 20))], None);
    let (r, opts) = pin_common::region(2, 1 << 20);
    let data = r.as_slice().unwrap().as_ptr() as usize;
    let opts = opts.threads(2).numa(NumaPolicy::Node(node0)).numa_sysfs_root(small.path());
    let p = Prepared::new(&rt, &r, &opts).unwrap();
    assert_eq!(
        p.placement(),
        &Placement::Unplaced(NumaFallback::NodeTooSmall { node: node0, free: 1024, bytes: 2 << 20 })
    );
    let pf = p.prefaulter().unwrap();
    assert_eq!((pf.cpus(), pf.config().threads), (&[][..], 2));
    assert_eq!(policy_at(data).unwrap().0, MPOL_DEFAULT);
    assert!(matches!(p.pin(&rt), PinState::Pinned));
}

/// On a GPU machine: the driver's PCI bus id (asked once in
/// `CudaRuntime::open`), the GPU's node in sysfs, the machine's nodes, and
/// the placement `Auto` chooses for a small region, printed for the record.
/// Skips without a GPU (fails under KVO_EXPECT_GPU=1).
#[test]
fn gpu_bus_id_and_topology_on_this_machine() {
    let Some(rt) = gpu_common::gpu("gpu_bus_id_and_topology_on_this_machine") else {
        return;
    };
    let bus = rt.pci_bus_id().expect("cuDeviceGetPCIBusId answered in open").to_string();
    let t = Topology::read(Path::new(numa::SYSFS_ROOT), Some(&bus)).unwrap();
    eprintln!(
        "GPU {} bus id {bus} (sysfs {}), numa_node {:?}, {} node(s)",
        rt.describe(),
        sysfs_bus_id(&bus),
        t.gpu_node,
        t.nodes.len()
    );
    for n in &t.nodes {
        eprintln!("node {}: {} CPUs {:?}, MemFree {:?}", n.id, n.cpus.len(), n.cpus, n.mem_free);
    }
    assert!(
        Path::new("/sys/bus/pci/devices").join(sysfs_bus_id(&bus)).exists(),
        "sysfs has the GPU's device directory"
    );
    let (r, opts) = pin_common::region(2, 1 << 20);
    let p = Prepared::new(&rt, &r, &opts).unwrap();
    eprintln!("placement (Auto): {}", p.placement());
    if t.nodes.len() == 1 {
        assert_eq!(p.placement(), &Placement::Unplaced(NumaFallback::SingleNode { node: t.nodes[0].id }));
    } else if let Some(n) = t.gpu_node {
        assert_eq!(p.placement().node(), Some(n));
    }
    assert!(matches!(p.pin(&rt), PinState::Pinned));
}
