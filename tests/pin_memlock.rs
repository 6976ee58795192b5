//! A registration failing with out-of-memory (2) while RLIMIT_MEMLOCK is
//! below the region size reports the limit (its own test binary: it lowers
//! the process's soft limit).

mod pin_common;

use kvoffload::internal::pin::{memlock, Prepared};
use kvoffload::{Code, PageableReason, PinState, SimFault};
use pin_common::{assert_usable, region, sim};

#[test]
fn oom_under_a_low_memlock_limit_is_memlock_limit() {
    let mut r0: libc::rlimit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r0) }, 0);
    let low = 64 << 10;
    if r0.rlim_max != libc::RLIM_INFINITY && r0.rlim_max < low {
        return; // cannot even set 64 KiB; nothing to show here
    }
    let new = libc::rlimit { rlim_cur: low, rlim_max: r0.rlim_max };
    // SAFETY: valid pointer; lowering the soft limit is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &new) }, 0);
    assert_eq!(memlock::memlock_limit(), Some(low));

    let (mut r, opts) = region(4, 1 << 20);
    let (s, rt) = sim();
    let p = Prepared::new(rt.as_ref(), &r, &opts).unwrap();
    assert_eq!(p.memlock_limit(), Some(low), "noted at set-up");
    s.inject(SimFault::Register { nth: 3, code: Code::OUT_OF_MEMORY });
    let st = p.pin(rt.as_ref());
    assert_eq!(st, PinState::Pageable(PageableReason::MemlockLimit { limit: low, needed: 4 << 20 }));
    assert_eq!(s.registered_ranges(), 0);

    // Another code is not blamed on the limit (a second coordinator for
    // the runtime once the first is gone).
    drop(p);
    let (r2, opts2) = region(2, 1 << 20);
    let p2 = Prepared::new(rt.as_ref(), &r2, &opts2).unwrap();
    s.inject(SimFault::Register { nth: 1, code: Code::NOT_SUPPORTED });
    assert_eq!(p2.pin(rt.as_ref()), PinState::Pageable(PageableReason::NotSupported));

    // SAFETY: restores the original limits.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &r0) }, 0);
    assert_usable(&mut r, 5);
}
