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

impl Faults {
    pub fn inject(&mut self, f: SimFault) {
        let base = match f {
            SimFault::Register { .. } => self.register_calls,
            SimFault::Copy { .. } => self.copy_calls,
        };
        self.pending.push((f, base));
    }

    /// Counts one register call; the code to fail it with, if a fault is due.
    pub fn on_register(&mut self) -> Option<Code> {
        self.register_calls += 1;
        let n = self.register_calls;
        self.take(|f, base| match f {
            SimFault::Register { nth, code } if base + nth == n => Some(code),
            _ => None,
        })
    }

    /// Async copy enqueues so far (single or batched, failed ones too).
    pub fn copy_calls(&self) -> u64 {
        self.copy_calls
    }

    /// Counts one copy enqueue; the code to fail it with, if a fault is due.
    pub fn on_copy(&mut self) -> Option<Code> {
        self.copy_calls += 1;
        let n = self.copy_calls;
        self.take(|f, base| match f {
            SimFault::Copy { nth, code } if base + nth == n => Some(code),
            _ => None,
        })
    }

    fn take(&mut self, due: impl Fn(SimFault, u64) -> Option<Code>) -> Option<Code> {
        let i = self.pending.iter().position(|&(f, b)| due(f, b).is_some())?;
        let (f, b) = self.pending.swap_remove(i);
        due(f, b)
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
