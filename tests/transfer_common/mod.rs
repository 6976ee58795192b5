//! Helpers shared by the transfer tests (simulated and real GPU): random
//! layouts and jobs, a rig with host memory, device tensors, a coordinator
//! and an engine, and a byte-exact reference of what a job must do.
#![allow(dead_code)]

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvoffload::internal::pin::{pin_all, NoPrefault};
use kvoffload::internal::protocol::Coordinator;
use kvoffload::internal::runtime::Gate;
use kvoffload::internal::transfer::{GroupBlocks, JobBlocks, JobResult, TransferEngine};
use kvoffload::{
    CapturePolicy, DevicePtr, Direction, GpuRuntime, GroupSpec, HostPlacement, JobId, KvLayout, PageableReason,
    PinState, Request, Stream, TensorSpec, TransferOptions,
};

/// `f` through the gate of a coordinator with no region made for the call:
/// the tests' own capture-unsafe calls on a runtime no rig guards (a rig's
/// runtime is guarded by the rig's coordinator: use [`Rig::gated`]); no
/// window is ever opened through this coordinator, so it never holds a call
/// back.
pub fn gated<T>(rt: &dyn GpuRuntime, f: impl FnOnce(&Gate) -> T) -> T {
    Coordinator::without_region(rt, CapturePolicy::AfterPinning)
        .expect("no other coordinator guards this runtime")
        .unsafe_call("test", Request::new(), f)
        .expect("no window, no refusal")
}

/// Both directions, stores first.
pub const DIRS: [Direction; 2] = [Direction::DeviceToHost, Direction::HostToDevice];

/// Engine options with `backend` and the defaults otherwise.
pub fn opts(backend: kvoffload::BackendChoice) -> TransferOptions {
    TransferOptions { backend, ..TransferOptions::default() }
}

/// A one-group layout: `tensors` tensors of `page`-byte pages, `blocks`
/// GPU and host blocks, factor 1, tensor-major.
pub fn simple(tensors: usize, page: usize, blocks: usize) -> Shape {
    Shape { groups: vec![(vec![page; tensors], blocks, blocks)], factor: 1, placement: HostPlacement::TensorMajor }
}

/// Case `case` of the random-layout check: a random shape, three random
/// jobs each way on registered memory, every byte checked; the backend used
/// must be `expect` when given.
pub fn random_case(
    rt: Arc<dyn GpuRuntime>,
    rng: &mut Rng,
    case: usize,
    choice: kvoffload::BackendChoice,
    expect: Option<kvoffload::Backend>,
    seed: u64,
) {
    let shape = Shape::random(rng);
    let mut rig = Rig::new(rt, shape.clone(), opts(choice), Pin::Registered);
    for k in 0..3 {
        for dir in DIRS {
            let job = shape.random_job(rng);
            let res = rig.run_checked(dir, &job, seed ^ (case * 16 + k) as u64);
            if let Some(b) = expect {
                assert_eq!(res.backend, b, "case {case}: {shape:?}");
            }
        }
    }
}

/// SplitMix64: a tiny deterministic generator (no extra dependency).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// `k` distinct values of `0..n`, in random order.
    pub fn distinct(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k {
            let j = self.range(i, n - 1);
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }
}

/// The shape of a layout, before device memory and host memory exist.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Per group: page bytes of each tensor, GPU blocks, host blocks.
    pub groups: Vec<(Vec<usize>, usize, usize)>,
    pub factor: usize,
    pub placement: HostPlacement,
}

impl Shape {
    /// A random small shape; page sizes mix 16-byte multiples (the gather
    /// kernel's vector path) and odd sizes (its byte path).
    pub fn random(rng: &mut Rng) -> Shape {
        let pages = [16, 32, 48, 64, 96, 256, 24, 100, 7];
        let groups: Vec<(Vec<usize>, usize, usize)> = (0..rng.range(1, 3))
            .map(|_| {
                let t = (0..rng.range(1, 3)).map(|_| pages[rng.range(0, pages.len() - 1)]).collect();
                (t, rng.range(1, 24), rng.range(1, 8))
            })
            .collect();
        let factor = rng.range(1, 4);
        let placement = match rng.next() % 3 {
            0 => HostPlacement::TensorMajor,
            1 => HostPlacement::BlockMajor,
            _ => {
                // At least one block of every group side by side, plus slack
                // (0 slack makes strided blocks of one group contiguous).
                let blocks: usize = groups.iter().map(|(p, _, _)| p.iter().sum::<usize>() * factor).sum();
                HostPlacement::BlockStrided { stride: blocks + [0, 1, 16, 4096][rng.range(0, 3)] }
            }
        };
        Shape { groups, factor, placement }
    }

    /// Offset from the host base of sub-block `j` of host block `b`,
    /// tensor `t`, group `g`, computed from the placement's definition.
    pub fn host_offset(&self, g: usize, t: usize, b: usize, j: usize) -> usize {
        let f = self.factor;
        let (pages, _, nh) = &self.groups[g];
        if let HostPlacement::BlockStrided { stride } = self.placement {
            // Group g's block sits after one block of each earlier group.
            let before_groups: usize = self.groups[..g].iter().map(|(p, _, _)| p.iter().sum::<usize>() * f).sum();
            let before: usize = pages[..t].iter().map(|p| p * f).sum();
            return b * stride + before_groups + before + j * pages[t];
        }
        let mut base = 0;
        for (pages, _, nh) in &self.groups[..g] {
            base += pages.iter().sum::<usize>() * f * nh;
        }
        match self.placement {
            HostPlacement::TensorMajor => {
                let before: usize = pages[..t].iter().map(|p| p * f * nh).sum();
                base + before + (b * f + j) * pages[t]
            }
            HostPlacement::BlockMajor => {
                let block: usize = pages.iter().sum::<usize>() * f;
                let before: usize = pages[..t].iter().map(|p| p * f).sum();
                base + b * block + before + j * pages[t]
            }
            HostPlacement::BlockStrided { .. } => unreachable!("handled above"),
        }
    }

    pub fn host_bytes(&self) -> usize {
        if let HostPlacement::BlockStrided { stride } = self.placement {
            // The end of the furthest block of any group.
            let mut before = 0;
            let mut end = 0;
            for (p, _, nh) in &self.groups {
                let block = p.iter().sum::<usize>() * self.factor;
                end = end.max((nh - 1) * stride + before + block);
                before += block;
            }
            return end;
        }
        self.groups.iter().map(|(p, _, nh)| p.iter().sum::<usize>() * self.factor * nh).sum()
    }

    /// A random valid job: per group some host blocks, the first possibly
    /// partial, and as many distinct GPU blocks (groups may be empty).
    pub fn random_job(&self, rng: &mut Rng) -> JobBlocks {
        let f = self.factor;
        loop {
            let groups: Vec<GroupBlocks> = self
                .groups
                .iter()
                .map(|&(_, ng, nh)| {
                    let max_h = nh.min(ng.div_ceil(f));
                    let h = rng.range(0, max_h);
                    if h == 0 {
                        return GroupBlocks::default();
                    }
                    let lo = (h - 1) * f + 1;
                    let hi = (h * f).min(ng);
                    let n = rng.range(lo, hi);
                    GroupBlocks { gpu: rng.distinct(ng, n), host: rng.distinct(nh, h) }
                })
                .collect();
            if groups.iter().any(|g| !g.gpu.is_empty()) {
                return JobBlocks { groups };
            }
        }
    }

    /// Per page copied by `job`: (group, tensor, gpu block, host offset, bytes),
    /// the plain reference (no merging).
    pub fn pages(&self, job: &JobBlocks) -> Vec<(usize, usize, usize, usize, usize)> {
        let mut out = Vec::new();
        for (g, gb) in job.groups.iter().enumerate() {
            let subs: Vec<(usize, usize)> =
                gb.host.iter().flat_map(|&h| (0..self.factor).map(move |j| (h, j))).collect();
            let skip = subs.len() - gb.gpu.len();
            for (t, &p) in self.groups[g].0.iter().enumerate() {
                for (i, &gpu) in gb.gpu.iter().enumerate() {
                    let (b, j) = subs[skip + i];
                    out.push((g, t, gpu, self.host_offset(g, t, b, j), p));
                }
            }
        }
        out
    }
}

/// How the rig's host memory is registered.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Pin {
    /// Every coordinator chunk registered (pin_all).
    Registered,
    /// Chunks known to the coordinator, none registered (pageable).
    Unregistered,
}

/// Host memory, device tensors, a coordinator and an engine.
pub struct Rig {
    pub rt: Arc<dyn GpuRuntime>,
    pub coord: Arc<Coordinator>,
    pub engine: Option<TransferEngine>,
    pub compute: Stream,
    pub shape: Shape,
    /// Registered through `coord`: unmapped by `Drop` only once every chunk
    /// is unregistered again (leaked when a test panicked).
    pub host: ManuallyDrop<memmap2::MmapMut>,
    /// Per group, per tensor: device base.
    pub tensors: Vec<Vec<DevicePtr>>,
    next_id: JobId,
}

pub const CHUNK: usize = 1 << 20;

impl Rig {
    pub fn new(rt: Arc<dyn GpuRuntime>, shape: Shape, opts: TransferOptions, pin: Pin) -> Rig {
        Self::chunked(rt, shape, opts, pin, CHUNK)
    }

    /// Like [`Rig::new`] with registration chunks of `chunk` bytes.
    pub fn chunked(rt: Arc<dyn GpuRuntime>, shape: Shape, opts: TransferOptions, pin: Pin, chunk: usize) -> Rig {
        let bytes = shape.host_bytes().div_ceil(chunk).max(1) * chunk;
        let host = memmap2::MmapMut::map_anon(bytes).expect("mmap");
        let base = host.as_ptr() as usize;
        let chunks: Vec<(usize, usize)> = (0..bytes / chunk).map(|i| (base + i * chunk, chunk)).collect();
        // SAFETY: the chunks are pieces of `host` (read-write), which the
        // rig keeps mapped until every chunk is unregistered (see `Drop`).
        let coord = unsafe { Coordinator::new(rt.as_ref(), CapturePolicy::AfterPinning, &chunks, None) }.unwrap();
        let host = ManuallyDrop::new(host);
        match pin {
            Pin::Registered => assert_eq!(pin_all(&*rt, &coord, &NoPrefault), PinState::Pinned),
            Pin::Unregistered => coord.pinning().finish(PinState::Pageable(PageableReason::Disabled)),
        }
        let compute = rt.stream_create().unwrap();
        let mut tensors = Vec::new();
        let mut specs = Vec::new();
        for (pages, ng, nh) in &shape.groups {
            let mut ts = Vec::new();
            let mut tspecs = Vec::new();
            for &p in pages {
                let d = coord.unsafe_call("test", Request::new(), |gt| rt.mem_alloc(gt, p * ng)).unwrap().unwrap();
                ts.push(d);
                tspecs.push(TensorSpec { device_base: d, page_bytes: p });
            }
            tensors.push(ts);
            specs.push(GroupSpec { tensors: tspecs, num_gpu_blocks: *ng, num_host_blocks: *nh });
        }
        let layout = KvLayout::new(&specs, shape.factor, base, shape.placement).unwrap();
        assert_eq!(layout.host_bytes(), shape.host_bytes());
        // SAFETY: `host` and the tensors outlive the engine (Drop below
        // drops the engine first); tests touch host memory only between jobs.
        let engine = unsafe { TransferEngine::new(rt.clone(), coord.clone(), layout, compute, opts) }.unwrap();
        Rig { rt, coord, engine: Some(engine), compute, shape, host, tensors, next_id: JobId(1 << 32) }
    }

    pub fn engine(&self) -> &TransferEngine {
        self.engine.as_ref().unwrap()
    }

    /// `f` through the gate of the rig's coordinator (which guards the rig's
    /// runtime); the tests' own capture-unsafe calls, including calls made
    /// deliberately during a capture the rig opened no window for.
    pub fn gated<T>(&self, f: impl FnOnce(&Gate) -> T) -> T {
        self.coord.unsafe_call("test", Request::new(), f).expect("no window of the rig's coordinator is open")
    }

    pub fn fresh_id(&mut self) -> JobId {
        self.next_id = JobId(self.next_id.0 + 1);
        self.next_id
    }

    /// Fills every device tensor and the host area with distinct patterns.
    pub fn fill(&mut self, seed: u64) {
        let mut rng = Rng(seed);
        for b in self.host.iter_mut() {
            *b = rng.next() as u8;
        }
        for (g, ts) in self.tensors.iter().enumerate() {
            let (pages, ng, _) = &self.shape.groups[g];
            for (t, &d) in ts.iter().enumerate() {
                let data: Vec<u8> = (0..pages[t] * ng).map(|_| rng.next() as u8).collect();
                // SAFETY: `data` is readable for its length.
                unsafe { self.rt.copy_htod(d, data.as_ptr() as usize, data.len()) }.unwrap();
            }
        }
        // A synchronous copy from pageable memory may return before its DMA
        // lands, and the engine's non-blocking streams do not wait for it.
        self.gated(|gt| self.rt.ctx_synchronize(gt)).unwrap();
    }

    /// Copies of every device tensor.
    pub fn device_snapshot(&self) -> Vec<Vec<Vec<u8>>> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(g, ts)| {
                let (pages, ng, _) = &self.shape.groups[g];
                ts.iter()
                    .enumerate()
                    .map(|(t, &d)| {
                        let mut v = vec![0u8; pages[t] * ng];
                        // SAFETY: `v` is writable for its length.
                        unsafe { self.rt.copy_dtoh(v.as_mut_ptr() as usize, d, v.len()) }.unwrap();
                        v
                    })
                    .collect()
            })
            .collect()
    }

    /// Polls until job `id` is reported (other results are returned too).
    pub fn poll_until(&self, id: JobId) -> Vec<JobResult> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut all = Vec::new();
        loop {
            all.extend(self.engine().poll_finished());
            if all.iter().any(|r| r.id == id) {
                return all;
            }
            assert!(Instant::now() < deadline, "job {id} not reported within 60 s");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Runs `job` in `dir` to completion and checks every byte of host and
    /// device memory against the reference; returns the result.
    pub fn run_checked(&mut self, dir: Direction, job: &JobBlocks, seed: u64) -> JobResult {
        self.fill(seed);
        let host_before = self.host.to_vec();
        let dev_before = self.device_snapshot();
        let id = self.fresh_id();
        self.engine().submit(id, dir, job).unwrap();
        self.engine().wait(id).unwrap();
        let res = self.poll_until(id).into_iter().find(|r| r.id == id).unwrap();
        assert!(res.succeeded(), "job failed: {res:?}");
        let mut host_want = host_before.clone();
        let mut dev_want = dev_before.clone();
        let mut total = 0u64;
        for (g, t, gpu, off, p) in self.shape.pages(job) {
            total += p as u64;
            match dir {
                Direction::DeviceToHost => {
                    host_want[off..off + p].copy_from_slice(&dev_before[g][t][gpu * p..(gpu + 1) * p])
                }
                Direction::HostToDevice => {
                    dev_want[g][t][gpu * p..(gpu + 1) * p].copy_from_slice(&host_before[off..off + p])
                }
            }
        }
        assert_eq!(res.bytes, total);
        let dev_after = self.device_snapshot();
        for (g, ts) in dev_want.iter().enumerate() {
            for (t, want) in ts.iter().enumerate() {
                if let Some(i) = (0..want.len()).find(|&i| want[i] != dev_after[g][t][i]) {
                    panic!("{dir:?} {:?}: device group {g} tensor {t} byte {i} differs", res.backend);
                }
            }
        }
        if let Some(i) = (0..host_want.len()).find(|&i| host_want[i] != self.host[i]) {
            panic!("{dir:?} {:?}: host byte {i} differs", res.backend);
        }
        res
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        drop(self.engine.take());
        if !std::thread::panicking() {
            let _ = self.coord.shutdown_steps().begin();
            self.coord.pinning().unregister_all(&*self.rt).unwrap();
            for ts in &self.tensors {
                for &d in ts {
                    // SAFETY: the engine is gone and the tests' jobs are
                    // done; nothing uses the tensor after this.
                    self.gated(|gt| unsafe { self.rt.mem_free(gt, d) }).unwrap();
                }
            }
            self.rt.stream_destroy(self.compute).unwrap();
            // SAFETY: every chunk of `host` is unregistered (above), the
            // coordinator is shut down (it registers nothing again), and
            // `host` is not used after this.
            unsafe { ManuallyDrop::drop(&mut self.host) };
        }
    }
}
