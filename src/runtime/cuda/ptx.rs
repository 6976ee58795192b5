//! Kernels the crate launches, as PTX text the driver compiles for the
//! device it finds (no nvcc or nvrtc needed at build or run time).

/// `kvo_spin(u64 nanos)`: one thread busy-waits on `%globaltimer` until
/// `nanos` nanoseconds have passed. Keeps work "running" on the device.
pub(crate) const SPIN: &str = "\
.version 7.8
.target sm_80
.address_size 64

.visible .entry kvo_spin(.param .u64 kvo_spin_param_0)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [kvo_spin_param_0];
    mov.u64 %rd2, %globaltimer;
$L_spin:
    mov.u64 %rd3, %globaltimer;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $L_spin;
    ret;
}
\0";

/// Threads per block of [`GATHER`] (the launch uses this block size).
pub(crate) const GATHER_THREADS: u32 = 256;
/// Most blocks one [`GATHER`] launch uses; blocks stride over fragments.
pub(crate) const GATHER_MAX_BLOCKS: u32 = 2048;

/// `kvo_gather(u64 table, u32 count)`: copies `count` fragments described by
/// the table at `table` (device memory; entry `i` is three u64 words at
/// `table + 24 i`: source address, destination address, byte count).
///
/// Block `b` takes fragments `b, b + gridDim.x, ...`; inside a fragment the
/// block's threads stride over it: 16-byte vectors (`v4.u32`) when source,
/// destination and length are all multiples of 16, single bytes otherwise.
/// Sources and destinations are device addresses: device memory or the
/// device alias of registered host memory (`cuMemHostGetDevicePointer`).
/// The table is read through the non-coherent path (it does not change
/// while the kernel runs); the data is read and written with plain global
/// accesses, never `.nc`, because it may live in host memory.
///
/// Registers: %r1 count, %r2 fragment index, %r3 grid size; %rd1 table,
/// %rd2 thread index, %rd3 block size, %rd6/%rd7/%rd8 source, destination,
/// bytes of the current fragment, %rd11 the running vector/byte index.
pub(crate) const GATHER: &str = "\
.version 7.8
.target sm_80
.address_size 64

.visible .entry kvo_gather(
    .param .u64 kvo_gather_param_0,
    .param .u32 kvo_gather_param_1
)
{
    .reg .pred %p<8>;
    .reg .b16 %rs<4>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<32>;

    ld.param.u64 %rd20, [kvo_gather_param_0];
    cvta.to.global.u64 %rd1, %rd20;
    ld.param.u32 %r1, [kvo_gather_param_1];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %nctaid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ntid.x;
    cvt.u64.u32 %rd2, %r4;
    cvt.u64.u32 %rd3, %r5;
$L_frag:
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra $L_done;
    mul.wide.u32 %rd4, %r2, 24;
    add.s64 %rd5, %rd1, %rd4;
    ld.global.nc.u64 %rd21, [%rd5];
    ld.global.nc.u64 %rd22, [%rd5+8];
    ld.global.nc.u64 %rd8, [%rd5+16];
    cvta.to.global.u64 %rd6, %rd21;
    cvta.to.global.u64 %rd7, %rd22;
    or.b64 %rd9, %rd21, %rd22;
    or.b64 %rd9, %rd9, %rd8;
    and.b64 %rd9, %rd9, 15;
    setp.ne.u64 %p2, %rd9, 0;
    @%p2 bra $L_bytes;
    shr.u64 %rd10, %rd8, 4;
    mov.u64 %rd11, %rd2;
$L_vec:
    setp.ge.u64 %p3, %rd11, %rd10;
    @%p3 bra $L_next;
    shl.b64 %rd12, %rd11, 4;
    add.s64 %rd13, %rd6, %rd12;
    add.s64 %rd14, %rd7, %rd12;
    ld.global.v4.u32 {%r6, %r7, %r8, %r9}, [%rd13];
    st.global.v4.u32 [%rd14], {%r6, %r7, %r8, %r9};
    add.s64 %rd11, %rd11, %rd3;
    bra.uni $L_vec;
$L_bytes:
    mov.u64 %rd11, %rd2;
$L_byte:
    setp.ge.u64 %p4, %rd11, %rd8;
    @%p4 bra $L_next;
    add.s64 %rd13, %rd6, %rd11;
    add.s64 %rd14, %rd7, %rd11;
    ld.global.u8 %rs1, [%rd13];
    st.global.u8 [%rd14], %rs1;
    add.s64 %rd11, %rd11, %rd3;
    bra.uni $L_byte;
$L_next:
    add.u32 %r2, %r2, %r3;
    bra.uni $L_frag;
$L_done:
    ret;
}
\0";
