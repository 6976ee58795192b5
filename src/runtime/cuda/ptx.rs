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

/// Threads per block of [`GATHER`] (the launch uses this block size, and
/// the kernel declares it as its maximum, so that ptxas keeps it within 64
/// registers a thread).
pub(crate) const GATHER_THREADS: u32 = 1024;
/// Most blocks one [`GATHER`] launch uses, per multiprocessor of the device
/// (blocks stride over fragments): one block of half a multiprocessor's
/// threads on each, so that a load's and a store's kernels fit side by side
/// on every multiprocessor. Measured on the H200
/// (docs/gpu-runs/2026-11-30-duplex-*): alone as fast as the former 2048
/// blocks of 256 threads (51 - 53 GB/s); both ways at once the two kernels
/// split the link evenly (39 - 40 GB/s each started together, 31 - 33.5 in
/// `bench transfer`'s interleaved jobs) where 2048 x 256 split it unevenly
/// (27.7 - 44; 28.0 - 39.4).
pub(crate) const GATHER_BLOCKS_PER_SM: u32 = 1;

/// Where a thread of a grid-stride loop starts: `%r2` its block index (the
/// first item it takes), `%r3` the grid size (its stride over items), `%r4`
/// and `%rd2` its thread index (its first unit inside an item), `%r5` and
/// `%rd3` the block size (its stride inside an item).
macro_rules! ptx_grid_stride {
    () => {
        "    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %nctaid.x;
    mov.u32 %r4, %tid.x;
    mov.u32 %r5, %ntid.x;
    cvt.u64.u32 %rd2, %r4;
    cvt.u64.u32 %rd3, %r5;
"
    };
}

/// The head of a grid-stride loop over a table's entries of `$bytes` bytes
/// (the table at `%rd1`, `%r1` entries): label `$label`, done (to
/// `$L_done`) once the entry index `%r2` reaches the count, else `%rd5` the
/// address of entry `%r2`.
macro_rules! ptx_table_entry {
    ($label:literal, $bytes:literal) => {
        concat!(
            $label,
            ":
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra $L_done;
    mul.wide.u32 %rd4, %r2, ",
            $bytes,
            ";
    add.s64 %rd5, %rd1, %rd4;
"
        )
    };
}

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
pub(crate) const GATHER: &str = concat!(
    "\
.version 7.8
.target sm_80
.address_size 64

.visible .entry kvo_gather(
    .param .u64 kvo_gather_param_0,
    .param .u32 kvo_gather_param_1
)
.maxntid 1024, 1, 1
{
    .reg .pred %p<8>;
    .reg .b16 %rs<4>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<32>;

    ld.param.u64 %rd20, [kvo_gather_param_0];
    cvta.to.global.u64 %rd1, %rd20;
    ld.param.u32 %r1, [kvo_gather_param_1];
",
    ptx_grid_stride!(),
    ptx_table_entry!("$L_frag", 24),
    "    ld.global.nc.u64 %rd21, [%rd5];
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
\0"
);

/// Threads per block of [`PATTERN_FILL`] and [`PATTERN_CHECK`].
pub(crate) const PATTERN_THREADS: u32 = 256;
/// Most blocks one pattern launch uses; blocks stride over entries.
pub(crate) const PATTERN_MAX_BLOCKS: u32 = 2048;

/// splitmix64's finaliser on `%rd30` in place (`crate::runtime::pattern::mix`), with
/// `%rd31` as scratch and the constants in `%rd40`, `%rd41`, `%rd42`.
macro_rules! ptx_mix {
    () => {
        "    add.s64 %rd30, %rd30, %rd40;
    shr.u64 %rd31, %rd30, 30;
    xor.b64 %rd30, %rd30, %rd31;
    mul.lo.u64 %rd30, %rd30, %rd41;
    shr.u64 %rd31, %rd30, 27;
    xor.b64 %rd30, %rd30, %rd31;
    mul.lo.u64 %rd30, %rd30, %rd42;
    shr.u64 %rd31, %rd30, 31;
    xor.b64 %rd30, %rd30, %rd31;
"
    };
}

/// The start of both pattern kernels' bodies, after the parameters of the
/// table and the count were read into `%rd20` and `%r1`: thread and grid
/// geometry, the splitmix64 constants, and the head of the entry loop
/// (label `$L_entry`) which loads entry `%r2` and computes its seed. Falls
/// through into the word loop (label `$L_word`) with `%rd12` = thread index.
macro_rules! ptx_entry_head {
    () => {
        concat!(
            "    cvta.to.global.u64 %rd1, %rd20;
",
            ptx_grid_stride!(),
            "    mov.b64 %rd40, 0x9E3779B97F4A7C15;
    mov.b64 %rd41, 0xBF58476D1CE4E5B9;
    mov.b64 %rd42, 0x94D049BB133111EB;
",
            ptx_table_entry!("$L_entry", 32),
            "    ld.global.nc.u64 %rd21, [%rd5];
    ld.global.nc.u64 %rd30, [%rd5+8];
    ld.global.nc.u64 %rd7, [%rd5+16];
    ld.global.nc.u64 %rd8, [%rd5+24];
    cvta.to.global.u64 %rd6, %rd21;
",
            ptx_mix!(),
            "    mov.b64 %rd9, %rd30;
    add.s64 %rd10, %rd8, 7;
    shr.u64 %rd10, %rd10, 3;
    and.b64 %rd11, %rd21, 7;
    setp.eq.u64 %p2, %rd11, 0;
    mov.u64 %rd12, %rd2;
$L_word:
    setp.ge.u64 %p3, %rd12, %rd10;
    @%p3 bra $L_entry_end;
    add.s64 %rd30, %rd7, %rd12;
    xor.b64 %rd30, %rd30, %rd9;
",
            ptx_mix!(),
            "    shl.b64 %rd13, %rd12, 3;
    add.s64 %rd14, %rd6, %rd13;
    sub.s64 %rd15, %rd8, %rd13;
    setp.ge.u64 %p4, %rd15, 8;
    and.pred %p5, %p4, %p2;
    min.u64 %rd15, %rd15, 8;
    mov.u64 %rd16, 0;
"
        )
    };
}

/// The opening of a pattern kernel `$name` up to its word loop: the module
/// header, the entry with the table and count parameters (`$more_params`
/// declares any after them), the registers both kernels declare, the reads
/// of the table and the count into `%rd20` and `%r1`, then `$more_loads`
/// (reads of the further parameters) and `ptx_entry_head!`.
macro_rules! ptx_pattern_kernel {
    ($name:literal, $more_params:literal, $more_loads:literal) => {
        concat!(
            ".version 7.8
.target sm_80
.address_size 64

.visible .entry ",
            $name,
            "(
    .param .u64 ",
            $name,
            "_param_0,
    .param .u32 ",
            $name,
            "_param_1",
            $more_params,
            "
)
{
    .reg .pred %p<8>;
    .reg .b16 %rs<4>;
    .reg .b32 %r<16>;
    .reg .b64 %rd<48>;

    ld.param.u64 %rd20, [",
            $name,
            "_param_0];
    ld.param.u32 %r1, [",
            $name,
            "_param_1];
",
            $more_loads,
            ptx_entry_head!()
        )
    };
}

/// `kvo_pattern_fill(u64 table, u32 count)`: entry `i` of the table at
/// `table` (device memory; four u64 words at `table + 32 i`: destination,
/// key, first word, byte count) gets words `first, first + 1, ...` of the
/// contents of `key` (`crate::runtime::pattern::fill_from`): word `w` is
/// `mix(mix(key) ^ (first + w))`, stored little-endian at `dst + 8 w`; a
/// last piece shorter than 8 bytes gets the word's low bytes.
///
/// Block `b` takes entries `b, b + gridDim.x, ...`; inside an entry the
/// block's threads stride over its words. A whole word at an 8-byte aligned
/// destination is one `st.global.u64`; otherwise (a misaligned destination,
/// or the last short piece) its bytes are stored one by one, low byte first.
/// The table is read through the non-coherent path; the data is written
/// with plain global stores (it may live in host memory).
///
/// Registers: %r1 count, %r2 entry index, %r3 grid size, %r4/%r5 thread
/// index and block size; %rd1 table, %rd2/%rd3 thread index and block size,
/// %rd5 entry address, %rd6 destination, %rd7 first word, %rd8 bytes, %rd9
/// `mix(key)`, %rd10 words in the entry (rounded up), %rd12 word index,
/// %rd14 its address, %rd15 its bytes (at most 8), %rd16/%rd17 byte index
/// and address in the byte path, %rd30 the word, %rd31 scratch of the mix,
/// %rd40-%rd42 the splitmix64 constants; %p2 destination aligned, %p5 word
/// stored whole.
pub(crate) const PATTERN_FILL: &str = concat!(
    ptx_pattern_kernel!("kvo_pattern_fill", "", ""),
    "    @!%p5 bra $L_byte;
    st.global.u64 [%rd14], %rd30;
    bra.uni $L_step;
$L_byte:
    setp.ge.u64 %p6, %rd16, %rd15;
    @%p6 bra $L_step;
    cvt.u16.u64 %rs1, %rd30;
    add.s64 %rd17, %rd14, %rd16;
    st.global.u8 [%rd17], %rs1;
    shr.u64 %rd30, %rd30, 8;
    add.s64 %rd16, %rd16, 1;
    bra.uni $L_byte;
$L_step:
    add.s64 %rd12, %rd12, %rd3;
    bra.uni $L_word;
$L_entry_end:
    add.u32 %r2, %r2, %r3;
    bra.uni $L_entry;
$L_done:
    ret;
}
\0"
);

/// `kvo_pattern_check(u64 table, u32 count, u64 out)`: the table has the
/// layout of [`PATTERN_FILL`]'s with the source in place of the
/// destination. Each thread counts the words of entry `i` (of those it
/// strides over) that differ from the pattern, a whole word compared with
/// one `ld.global.u64` where the source is aligned and the word whole, byte
/// by byte otherwise (a short last piece compares its bytes only); then a
/// thread with a nonzero count adds it to the u32 at `out + 4 i` with one
/// `atom.global.add.u32`. `out` must be zeroed before the launch.
///
/// Registers: as in [`PATTERN_FILL`] (%rd6 is the source), plus %r10 this
/// thread's mismatch count for the entry, %r11 the increment, %rd18 a loaded
/// word, %rs1/%rs2 loaded and expected byte, %rs3 their differences ORed over
/// the piece, %rd22 `out`, %rd19 the entry's counter.
pub(crate) const PATTERN_CHECK: &str = concat!(
    ptx_pattern_kernel!(
        "kvo_pattern_check",
        ",
    .param .u64 kvo_pattern_check_param_2",
        "    ld.param.u64 %rd23, [kvo_pattern_check_param_2];
    cvta.to.global.u64 %rd22, %rd23;
    mov.u32 %r10, 0;
"
    ),
    "    @!%p5 bra $L_bytes;
    ld.global.u64 %rd18, [%rd14];
    setp.ne.u64 %p6, %rd18, %rd30;
    selp.u32 %r11, 1, 0, %p6;
    add.u32 %r10, %r10, %r11;
    bra.uni $L_step;
$L_bytes:
    mov.u16 %rs3, 0;
$L_byte:
    setp.ge.u64 %p6, %rd16, %rd15;
    @%p6 bra $L_bytes_end;
    add.s64 %rd17, %rd14, %rd16;
    ld.global.u8 %rs1, [%rd17];
    cvt.u16.u64 %rs2, %rd30;
    and.b16 %rs2, %rs2, 255;
    xor.b16 %rs1, %rs1, %rs2;
    or.b16 %rs3, %rs3, %rs1;
    shr.u64 %rd30, %rd30, 8;
    add.s64 %rd16, %rd16, 1;
    bra.uni $L_byte;
$L_bytes_end:
    setp.ne.u16 %p6, %rs3, 0;
    selp.u32 %r11, 1, 0, %p6;
    add.u32 %r10, %r10, %r11;
$L_step:
    add.s64 %rd12, %rd12, %rd3;
    bra.uni $L_word;
$L_entry_end:
    setp.eq.u32 %p7, %r10, 0;
    @%p7 bra $L_next;
    mul.wide.u32 %rd19, %r2, 4;
    add.s64 %rd19, %rd22, %rd19;
    atom.global.add.u32 %r12, [%rd19], %r10;
    mov.u32 %r10, 0;
$L_next:
    add.u32 %r2, %r2, %r3;
    bra.uni $L_entry;
$L_done:
    ret;
}
\0"
);

#[cfg(test)]
mod tests {
    use super::*;

    /// What can be checked without a driver: one NUL at the very end, every
    /// branch target defined exactly once, every register inside the range
    /// its `.reg` line declares. (The JIT itself runs in the GPU tests.)
    #[test]
    fn kernels_are_well_formed_text() {
        for (name, text) in [("spin", SPIN), ("gather", GATHER), ("fill", PATTERN_FILL), ("check", PATTERN_CHECK)] {
            assert_eq!(text.find('\0'), Some(text.len() - 1), "{name}: NUL terminator");
            let labels: Vec<&str> = text.lines().filter_map(|l| l.trim().strip_suffix(':')).collect();
            for l in text.lines().filter_map(|l| l.split("bra").nth(1)) {
                let target = l.trim_start_matches(".uni").trim().trim_end_matches(';');
                assert_eq!(labels.iter().filter(|d| **d == target).count(), 1, "{name}: label {target}");
            }
            for (prefix, decl) in [("%rd", ".b64 %rd<"), ("%rs", ".b16 %rs<"), ("%r", ".b32 %r<"), ("%p", ".pred %p<")]
            {
                let Some(at) = text.find(decl) else { continue };
                let limit: usize = text[at + decl.len()..].split('>').next().unwrap().parse().unwrap();
                for (i, _) in text.match_indices(prefix) {
                    let digits: String = text[i + prefix.len()..].chars().take_while(|c| c.is_ascii_digit()).collect();
                    if let Ok(n) = digits.parse::<usize>() {
                        assert!(n < limit, "{name}: {prefix}{n} outside {decl}{limit}>");
                    }
                }
            }
        }
    }
}
