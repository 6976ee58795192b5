// Where a load and a store at the same time lose bandwidth (issue #15).
//
// A stand-alone CUDA C++ probe (nvcc -O3 -arch=sm_90 -o duplex duplex.cu),
// run on the GPU machine in one go: it times, with CUDA events, a load
// (host -> device) and a store (device -> host) of scattered pages, each
// alone and both at once, for several ways of moving them:
//
//   sm G T U    the gather kernel reading/writing host memory through its
//               device alias (SMs issue the PCIe transactions), grid G,
//               T threads a block, U 16-byte vectors in flight per thread;
//               G=2048 T=256 U=1 is kvoffload's kvo_gather today
//   staged C S  the same kernel packs the pages into a device staging
//               buffer (HBM), then one cudaMemcpyAsync per contiguous host
//               run moves it on a copy engine (a load: the mirror); chunks
//               of C bytes, S streams a direction (1: kernel and copies
//               alternate on one stream; 2: chunks alternate between two
//               streams and two buffers, so a chunk's kernel overlaps the
//               previous chunk's copies)
//   ce          one cudaMemcpyAsync per page (the copy engine, no staging)
//
// Layout: `pages` pages of `page` bytes a direction; host runs of L pages
// (L=1: every page scattered on both sides, as `bench transfer`; L>1: host
// blocks of L pages, as the main job's block-major host layout), device
// pages in a random permutation. Load: host [0, half) -> device [0, half);
// store: device [half, 2 half) -> host [half, 2 half). Both start together
// behind a 5 ms spin kernel (time to enqueue); each direction's GB/s is its bytes over the time
// from the common start to its own last event. Best of `reps`.
//
// Output: one line a (page, L, load mode, store mode, which) with GB/s.
// `duplex ncu` launches one store and one load gather kernel (16 KiB pages)
// for Nsight Compute to profile.

#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>
#include <string>
#include <algorithm>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(2); } } while (0)

struct Entry { uint64_t src, dst, bytes; };

template <int U>
__global__ void gather(const Entry* t, uint32_t n) {
    for (uint32_t f = blockIdx.x; f < n; f += gridDim.x) {
        Entry e = t[f];
        const uint4* s = (const uint4*)e.src;
        uint4* d = (uint4*)e.dst;
        uint64_t nv = e.bytes / 16;
        uint64_t step = (uint64_t)blockDim.x * U;
        uint64_t i = threadIdx.x;
        for (; i + (U - 1) * blockDim.x < nv; i += step) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; u++) v[u] = s[i + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < U; u++) d[i + u * blockDim.x] = v[u];
        }
        for (; i < nv; i += blockDim.x) d[i] = s[i];
    }
}

__global__ void spin(uint64_t ns) {
    uint64_t t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1)); } while (t1 - t0 < ns);
}

static uint64_t rng = 0x6b766f66666c6f61ull;
static uint64_t next() {
    rng += 0x9e3779b97f4a7c15ull;
    uint64_t z = rng;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static std::vector<size_t> perm(size_t n) {
    std::vector<size_t> v(n);
    for (size_t i = 0; i < n; i++) v[i] = i;
    for (size_t i = n - 1; i > 0; i--) std::swap(v[i], v[next() % (i + 1)]);
    return v;
}

enum Kind { SM, STAGED, CE, NONE };
struct Mode {
    Kind kind;
    int grid, threads, unroll;  // SM (and the staging kernel: grid/threads)
    size_t chunk;               // STAGED
    int streams;                // STAGED
    std::string name() const {
        char b[96];
        switch (kind) {
            case SM: snprintf(b, sizeof b, "sm %d x %d u%d%s", grid, threads, unroll, streams == 2 ? " 2 streams" : ""); break;
            case STAGED: snprintf(b, sizeof b, "staged %zu MiB x%d k%d", chunk >> 20, streams, grid); break;
            case CE: snprintf(b, sizeof b, "ce per page"); break;
            default: snprintf(b, sizeof b, "-");
        }
        return b;
    }
};

// One launch of `gather` with the mode's geometry.
static void launch(const Mode& m, const Entry* t, uint32_t n, cudaStream_t s) {
    if (n == 0) return;
    uint32_t g = std::min<uint32_t>(n, m.grid);
    switch (m.unroll) {
        case 4: gather<4><<<g, m.threads, 0, s>>>(t, n); break;
        case 2: gather<2><<<g, m.threads, 0, s>>>(t, n); break;
        default: gather<1><<<g, m.threads, 0, s>>>(t, n); break;
    }
    CK(cudaGetLastError());
}

struct Bufs {
    char* dev;       // 2 half bytes
    char* host;      // 2 half bytes, pinned, mapped
    char* staging[2][2];  // [dir][buffer]
    size_t half, staging_bytes;
    Entry* dtab[2];  // device tables per direction
    size_t dtab_cap;
};

// A direction's work, prepared before timing.
struct Plan {
    // SM: one table; STAGED: per chunk a table range and copies.
    std::vector<Entry> table;  // uploaded to dtab[dir]
    struct Chunk { size_t first, count; std::vector<Entry> copies; };  // copies: src,dst,bytes (host addr / staging)
    std::vector<Chunk> chunks;
    std::vector<Entry> ce;     // CE: per page copies
    size_t bytes = 0;
};

// dir 0 = load (H2D), 1 = store (D2H)
static Plan plan(Bufs& b, int dir, size_t page, size_t L, const Mode& m) {
    Plan p;
    size_t n = b.half / page;          // pages
    size_t runs = n / L;
    n = runs * L;
    size_t base = dir == 0 ? 0 : b.half;
    std::vector<size_t> hp = perm(runs), dp = perm(n);
    // page i: host run hp[i / L], slot i % L; device page dp[i]
    auto host_of = [&](size_t i) { return (uint64_t)(b.host + base + (hp[i / L] * L + i % L) * page); };
    auto dev_of = [&](size_t i) { return (uint64_t)(b.dev + base + dp[i] * page); };
    p.bytes = n * page;
    if (m.kind == SM) {
        for (size_t i = 0; i < n; i++)
            p.table.push_back(dir == 0 ? Entry{host_of(i), dev_of(i), page} : Entry{dev_of(i), host_of(i), page});
    } else if (m.kind == CE) {
        for (size_t i = 0; i < n; i++)
            p.ce.push_back(dir == 0 ? Entry{host_of(i), dev_of(i), page} : Entry{dev_of(i), host_of(i), page});
    } else if (m.kind == STAGED) {
        size_t per = std::max<size_t>(m.chunk / (L * page), 1) * L;  // pages a chunk, whole host runs
        for (size_t c = 0; c * per < n; c++) {
            Plan::Chunk ch;
            ch.first = p.table.size();
            size_t lo = c * per, hi = std::min(n, lo + per);
            int buf = m.streams == 2 ? (int)(c % 2) : (int)(c % 2);
            uint64_t st = (uint64_t)b.staging[dir][buf];
            for (size_t i = lo; i < hi; i++) {
                uint64_t so = st + (i - lo) * page;
                p.table.push_back(dir == 0 ? Entry{so, dev_of(i), page} : Entry{dev_of(i), so, page});
            }
            ch.count = hi - lo;
            for (size_t i = lo; i < hi; i += L) {
                uint64_t so = st + (i - lo) * page;
                ch.copies.push_back(dir == 0 ? Entry{host_of(i), so, L * page} : Entry{so, host_of(i), L * page});
            }
            p.chunks.push_back(ch);
        }
    }
    return p;
}

struct Dir {
    cudaStream_t s[2];
    cudaEvent_t end, joined[2];
};

// Enqueues a planned direction after `start` (on its streams); records `d.end`.
static void enqueue(Bufs& b, int dir, const Plan& p, const Mode& m, Dir& d, cudaEvent_t start) {
    CK(cudaStreamWaitEvent(d.s[0], start, 0));
    CK(cudaStreamWaitEvent(d.s[1], start, 0));
    Entry* t = b.dtab[dir];
    if (m.kind == SM && m.streams == 2) {
        uint32_t n = (uint32_t)p.table.size(), h = n / 2;
        launch(m, t, h, d.s[0]);
        launch(m, t + h, n - h, d.s[1]);
    } else if (m.kind == SM) {
        launch(m, t, (uint32_t)p.table.size(), d.s[0]);
    } else if (m.kind == CE) {
        for (auto& e : p.ce)
            CK(cudaMemcpyAsync((void*)e.dst, (void*)e.src, e.bytes, cudaMemcpyDefault, d.s[0]));
    } else if (m.kind == STAGED) {
        for (size_t c = 0; c < p.chunks.size(); c++) {
            auto& ch = p.chunks[c];
            cudaStream_t s = d.s[m.streams == 2 ? c % 2 : 0];
            if (dir == 1) {
                launch(m, t + ch.first, (uint32_t)ch.count, s);
                for (auto& e : ch.copies)
                    CK(cudaMemcpyAsync((void*)e.dst, (void*)e.src, e.bytes, cudaMemcpyDeviceToHost, s));
            } else {
                for (auto& e : ch.copies)
                    CK(cudaMemcpyAsync((void*)e.dst, (void*)e.src, e.bytes, cudaMemcpyHostToDevice, s));
                launch(m, t + ch.first, (uint32_t)ch.count, s);
            }
        }
    }
    CK(cudaEventRecord(d.joined[1], d.s[1]));
    CK(cudaStreamWaitEvent(d.s[0], d.joined[1], 0));
    CK(cudaEventRecord(d.end, d.s[0]));
}

static double gbps(size_t bytes, cudaEvent_t a, cudaEvent_t z) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, z));
    return bytes / (ms * 1e-3) / 1e9;
}

int main(int argc, char** argv) {
    bool ncu = argc > 1 && !strcmp(argv[1], "ncu");
    int reps = 3;
    Bufs b{};
    b.half = 512ull << 20;
    b.staging_bytes = 32ull << 20;
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int drv = 0;
    CK(cudaDriverGetVersion(&drv));
    printf("# device %s, %d SMs, async engines %d, driver %d\n", prop.name, prop.multiProcessorCount,
           prop.asyncEngineCount, drv);
    CK(cudaMalloc(&b.dev, 2 * b.half));
    CK(cudaHostAlloc((void**)&b.host, 2 * b.half, cudaHostAllocMapped));
    memset(b.host, 0x5a, 2 * b.half);
    CK(cudaMemset(b.dev, 0xa5, 2 * b.half));
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 2; k++) CK(cudaMalloc(&b.staging[d][k], b.staging_bytes));
    b.dtab_cap = b.half / (4 << 10);
    for (int d = 0; d < 2; d++) CK(cudaMalloc(&b.dtab[d], b.dtab_cap * sizeof(Entry)));
    Dir dirs[2];
    for (auto& d : dirs) {
        for (auto& s : d.s) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        CK(cudaEventCreate(&d.end));
        for (auto& e : d.joined) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    cudaStream_t starter;
    CK(cudaStreamCreateWithFlags(&starter, cudaStreamNonBlocking));
    cudaEvent_t start;
    CK(cudaEventCreate(&start));

    if (ncu) {
        Mode m{SM, 2048, 256, 1, 0, 1};
        for (int dir = 1; dir >= 0; dir--) {
            Plan p = plan(b, dir, 16 << 10, 1, m);
            p.table.resize(8192);
            CK(cudaMemcpy(b.dtab[dir], p.table.data(), p.table.size() * sizeof(Entry), cudaMemcpyHostToDevice));
            launch(m, b.dtab[dir], 8192, dirs[dir].s[0]);
            CK(cudaDeviceSynchronize());
        }
        Mode st{STAGED, 132, 512, 4, 8 << 20, 1};
        Plan p = plan(b, 1, 16 << 10, 64, st);
        CK(cudaMemcpy(b.dtab[1], p.table.data(), p.chunks[0].count * sizeof(Entry), cudaMemcpyHostToDevice));
        launch(st, b.dtab[1], (uint32_t)p.chunks[0].count, dirs[1].s[0]);
        CK(cudaDeviceSynchronize());
        printf("ncu launches done\n");
        return 0;
    }

    struct Case { size_t page, L; Mode load, store; };
    std::vector<Case> cases;
    Mode cur{SM, 2048, 256, 1, 0, 1};
    for (size_t page : {16u << 10, 32u << 10, 64u << 10}) {
        // Host pages scattered, as `bench transfer`.
        cases.push_back({page, 1, cur, cur});
        for (Mode m : {Mode{SM, 132, 1024, 1, 0, 1}, Mode{SM, 66, 1024, 1, 0, 1}, Mode{SM, 66, 1024, 4, 0, 1},
                       Mode{SM, 32, 1024, 4, 0, 1}, Mode{SM, 16, 1024, 4, 0, 1}})
            cases.push_back({page, 1, m, m});
        cases.push_back({page, 1, Mode{SM, 66, 1024, 4, 0, 1}, Mode{SM, 32, 1024, 4, 0, 1}});
        cases.push_back({page, 1, Mode{SM, 2048, 256, 1, 0, 2}, Mode{SM, 2048, 256, 1, 0, 2}});
        cases.push_back({page, 1, Mode{CE, 0, 0, 0, 0, 1}, Mode{CE, 0, 0, 0, 0, 1}});
        cases.push_back({page, 1, cur, Mode{CE, 0, 0, 0, 0, 1}});
        cases.push_back({page, 1, Mode{STAGED, 132, 512, 4, 8 << 20, 2}, Mode{STAGED, 132, 512, 4, 8 << 20, 2}});
        // Host runs of 1 MiB (block-major host blocks), device pages scattered.
        size_t L = (1 << 20) / page;
        cases.push_back({page, L, cur, cur});
        for (size_t chunk : {4u << 20, 16u << 20})
            for (int s : {1, 2}) {
                Mode m{STAGED, 132, 512, 4, chunk, s};
                cases.push_back({page, L, m, m});
            }
        cases.push_back({page, L, Mode{STAGED, 32, 512, 4, 16 << 20, 2}, Mode{STAGED, 32, 512, 4, 16 << 20, 2}});
        cases.push_back({page, L, cur, Mode{STAGED, 132, 512, 4, 16 << 20, 2}});
        cases.push_back({page, L, Mode{STAGED, 132, 512, 4, 16 << 20, 2}, cur});
        cases.push_back({page, L, Mode{SM, 32, 1024, 4, 0, 1}, Mode{STAGED, 132, 512, 4, 16 << 20, 2}});
    }
    // The link's duplex limit: 2 MiB pages, one copy each.
    cases.push_back({2 << 20, 1, Mode{CE, 0, 0, 0, 0, 1}, Mode{CE, 0, 0, 0, 0, 1}});
    cases.push_back({2 << 20, 1, cur, cur});

    printf("| page | host run | load mode | store mode | load alone | store alone | load, both | store, both |\n");
    printf("|---:|---:|---|---|---:|---:|---:|---:|\n");
    for (auto& c : cases) {
        Mode modes[2] = {c.load, c.store};
        Plan plans[2];
        for (int dir = 0; dir < 2; dir++) {
            plans[dir] = plan(b, dir, c.page, c.L, modes[dir]);
            if (!plans[dir].table.empty())
                CK(cudaMemcpy(b.dtab[dir], plans[dir].table.data(), plans[dir].table.size() * sizeof(Entry),
                              cudaMemcpyHostToDevice));
        }
        double best[4] = {0, 0, 0, 0};
        for (int r = 0; r < reps + 1; r++) {
            // alone: load, store; then both
            for (int which = 0; which < 3; which++) {
                spin<<<1, 1, 0, starter>>>(5000000);
                CK(cudaEventRecord(start, starter));
                for (int dir = 0; dir < 2; dir++)
                    if (which == 2 || which == dir) enqueue(b, dir, plans[dir], modes[dir], dirs[dir], start);
                CK(cudaDeviceSynchronize());
                if (r == 0) continue;  // warm-up
                for (int dir = 0; dir < 2; dir++) {
                    if (!(which == 2 || which == dir)) continue;
                    double g = gbps(plans[dir].bytes, start, dirs[dir].end);
                    int k = which == 2 ? 2 + dir : dir;
                    best[k] = std::max(best[k], g);
                }
            }
        }
        char run[32];
        if (c.L == 1) snprintf(run, sizeof run, "page");
        else snprintf(run, sizeof run, "%zu KiB", c.L * c.page >> 10);
        printf("| %zu KiB | %s | %s | %s | %.1f | %.1f | %.1f | %.1f |\n", c.page >> 10, run, c.load.name().c_str(),
               c.store.name().c_str(), best[0], best[1], best[2], best[3]);
        fflush(stdout);
    }
    return 0;
}
