//! The library offloader behind the Python classes: a [`KeyedOffloader`]
//! (`kvoffload.KeyedOffloader`: the block manager places the keys) or the
//! slot-addressed core [`Offloader`] (`kvoffload.Offloader`: the engine's
//! own host slots). Each class is built with one kind and only ever asks
//! for its own (`keyed`, `slots`), as the library decides by type.

use super::*;
use kvoffload::Request;

/// What the common base (`kvoffload._OffloaderBase`) holds. Derefs to the
/// core, which every call but the keyed and the slot jobs goes to.
pub(crate) enum Front {
    /// `kvoffload.KeyedOffloader`.
    Keyed(KeyedOffloader),
    /// `kvoffload.Offloader`.
    Slots(Offloader),
}

impl std::ops::Deref for Front {
    type Target = Offloader;

    fn deref(&self) -> &Offloader {
        match self {
            Front::Keyed(k) => k.core(),
            Front::Slots(o) => o,
        }
    }
}

impl Front {
    /// The keyed offloader of a `kvoffload.KeyedOffloader` (whose
    /// constructor is the only one that builds `Front::Keyed`).
    pub(crate) fn keyed(&self) -> &KeyedOffloader {
        match self {
            Front::Keyed(k) => k,
            Front::Slots(_) => unreachable!("a KeyedOffloader is built with a keyed offloader"),
        }
    }

    /// The slot-addressed core of a `kvoffload.Offloader` (whose
    /// constructor is the only one that builds `Front::Slots`).
    pub(crate) fn slots(&self) -> &Offloader {
        match self {
            Front::Slots(o) => o,
            Front::Keyed(_) => unreachable!("an Offloader is built with the slot-addressed core"),
        }
    }
}

/// What a Python holder of the offloader does as it goes (`_OffloaderBase`,
/// or a `CaptureWindow` holding the last reference): shuts it down unless
/// it is, and once it is shut down closes the agreement's `gate`
/// (agreement.rs: no thread of kvoffload enters Python for it afterwards),
/// with the GIL released (the shutdown waits for what is in flight, a
/// `gated` call among it, whose callable needs the GIL; the close waits for
/// a start of the agreement callable's thread, which needs it too). A
/// refused shutdown (a window or a graph still open) is reported on stderr.
pub(crate) fn shut_down_dropped(off: &Arc<Front>, gate: Option<&Arc<Gate>>) {
    let (off, gate) = (off.clone(), gate.cloned());
    Python::attach(|py| {
        py.detach(move || {
            if !off.is_shut_down() {
                if let Err(e) = off.shutdown(Request::new(), &mut drop) {
                    eprintln!("kvoffload: offloader dropped, shutdown failed: {e}");
                }
            }
            if off.is_shut_down() {
                if let Some(g) = gate {
                    g.close();
                }
            }
        })
    });
}
