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
