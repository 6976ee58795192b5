//! [`PinObserver`]: watching the background pinner from its own thread.

use crate::pin::Prefault;
use crate::sync::{self, Arc};

/// Watches the background pinner of an [`super::Offloader`]; set it in
/// [`super::OffloaderOptions::pin_observer`].
///
/// Its methods run on the pinning thread, and pinning waits while one runs:
/// keep them short (a progress display, a timestamp). A test may block in
/// [`PinObserver::before_chunk`] to hold pinning at a chunk boundary (a
/// capture window that waits for pinning then waits as long).
pub trait PinObserver: Send + Sync {
    /// Chunk `index` (of `total`, counted from 0) is about to be made
    /// resident and registered.
    fn before_chunk(&self, _index: usize, _total: usize) {}
    /// This rank's own pinning ended: every chunk registered, or pinning
    /// failed or was cancelled and is about to roll back. Called once,
    /// after pre-faulting stopped, before any rollback and, with a shared
    /// region, before the agreement with the other ranks; not called when
    /// pinning was cancelled before it began.
    fn settled(&self) {}
}

impl std::fmt::Debug for dyn PinObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinObserver")
    }
}

/// The pre-faulter with the observer's calls around it (the registration
/// loop calls `ensure` before each chunk and `settle` once it is over).
struct Observed {
    inner: Arc<dyn Prefault>,
    observer: Arc<dyn PinObserver>,
    total: usize,
}

impl Prefault for Observed {
    fn ensure(&self, i: usize, addr: usize, len: usize) -> Result<(), String> {
        self.observer.before_chunk(i, self.total);
        self.inner.ensure(i, addr, len)
    }

    fn hint(&self, i: usize, addr: usize, len: usize) {
        self.inner.hint(i, addr, len)
    }

    fn lookahead_bytes(&self) -> usize {
        self.inner.lookahead_bytes()
    }
    fn settle(&self) {
        self.inner.settle();
        self.observer.settled();
    }
}

/// `inner` reporting to `observer`; `total` is the number of chunks.
pub(super) fn observed(inner: Arc<dyn Prefault>, observer: Arc<dyn PinObserver>, total: usize) -> Arc<dyn Prefault> {
    sync::arc_dyn(Observed { inner, observer, total }, |a| a)
}
