//! Fault injection and hold points of the simulated GPU.

use crate::names::named;
use crate::runtime::Code;

/// A fault to inject into the simulated GPU.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SimFault {
    /// The `nth` call (1-based, counted from now) of `host_register` fails
    /// with `code` and registers nothing.
    Register {
        /// Which call fails: 1 is the next `host_register` after injection.
        nth: u64,
        /// The result code the call fails with, e.g.
        /// [`Code::OUT_OF_MEMORY`] or [`Code::NOT_SUPPORTED`] to drive
        /// pinning's rollback (P8).
        code: Code,
    },
    /// The `nth` async copy enqueue (single or batched; 1-based, counted
    /// from now) fails with `code` and enqueues nothing.
    Copy {
        /// Which enqueue fails: 1 is the next async copy enqueue after
        /// injection.
        nth: u64,
        /// The result code the enqueue fails with (the transfer engine then
        /// reports the job failed, P5).
        code: Code,
    },
}

/// Where a [`super::Hold`] stops a call until released.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HoldPoint {
    /// Inside `host_register`, after the capture rules were applied and the
    /// registration is counted as running (the window in which the ordering
    /// effects of docs/driver-rules.md, section 3, happen).
    Register,
    /// On the device, while an operation executes.
    DeviceOp,
}

named!(HoldPoint, "hold point" {
    Register => "register",
    DeviceOp => "device_op",
});

#[derive(Default)]
pub(crate) struct Faults {
    register_calls: u64,
    copy_calls: u64,
    pending: Vec<(SimFault, u64)>,
    pub holds: Vec<HoldSlot>,
}

pub(crate) struct HoldSlot {
    pub id: u64,
    pub point: HoldPoint,
    pub entered: bool,
    pub released: bool,
}

/// The calls a [`SimFault`] fails, each kind counted.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Counted {
    Register,
    Copy,
}

impl SimFault {
    /// The kind of call it fails, which one (counted from its injection)
    /// and the code it fails it with.
    fn target(self) -> (Counted, u64, Code) {
        match self {
            SimFault::Register { nth, code } => (Counted::Register, nth, code),
            SimFault::Copy { nth, code } => (Counted::Copy, nth, code),
        }
    }
}

impl Faults {
    fn calls(&mut self, kind: Counted) -> &mut u64 {
        match kind {
            Counted::Register => &mut self.register_calls,
            Counted::Copy => &mut self.copy_calls,
        }
    }

    pub fn inject(&mut self, f: SimFault) {
        let base = *self.calls(f.target().0);
        self.pending.push((f, base));
    }

    /// Counts one register call; the code to fail it with, if a fault is due.
    pub fn on_register(&mut self) -> Option<Code> {
        self.count(Counted::Register)
    }

    /// Async copy enqueues so far (single or batched, failed ones too).
    pub fn copy_calls(&self) -> u64 {
        self.copy_calls
    }

    /// Counts one copy enqueue; the code to fail it with, if a fault is due.
    pub fn on_copy(&mut self) -> Option<Code> {
        self.count(Counted::Copy)
    }

    /// Counts one call of `kind`; the code of the fault due at this count,
    /// if one is (taken: a fault fails one call).
    fn count(&mut self, kind: Counted) -> Option<Code> {
        let calls = self.calls(kind);
        *calls += 1;
        let n = *calls;
        let i = self.pending.iter().position(|&(f, base)| {
            let (k, nth, _) = f.target();
            k == kind && base + nth == n
        })?;
        Some(self.pending.swap_remove(i).0.target().2)
    }

    /// The first armed, not yet entered hold at `point`, marked entered.
    pub fn enter_hold(&mut self, point: HoldPoint) -> Option<u64> {
        let h = self.holds.iter_mut().find(|h| h.point == point && !h.entered)?;
        h.entered = true;
        Some(h.id)
    }

    pub fn hold(&self, id: u64) -> Option<&HoldSlot> {
        self.holds.iter().find(|h| h.id == id)
    }
}
