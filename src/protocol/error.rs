//! Typed errors and states of the capture-safety protocol.

use crate::runtime::{Code, DriverError};

/// Why a region ended up on pageable memory instead of pinned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PageableReason {
    /// The driver refused registration as unsupported (801), e.g. under
    /// Confidential Computing (vLLM #55428).
    #[error("host registration not supported by the driver (801)")]
    NotSupported,
    /// Registration was refused because a capture was open (900). The
    /// protocol prevents this for its own calls; it can still come from an
    /// engine that captures outside a capture window.
    #[error("host registration refused during a stream capture (900)")]
    CaptureUnsupported,
    /// The driver ran out of memory for the registration (2).
    #[error("host registration ran out of memory (2)")]
    OutOfMemory,
    /// The process's locked-memory limit (RLIMIT_MEMLOCK) is too low.
    #[error("locked-memory limit too low: {limit} bytes allowed, {needed} needed")]
    MemlockLimit {
        /// The soft RLIMIT_MEMLOCK, in bytes.
        limit: u64,
        /// Bytes pinning had to lock: the total size of the region's
        /// chunks.
        needed: u64,
    },
    /// Pinning was cancelled (shutdown or an explicit cancel) between chunks.
    #[error("pinning cancelled")]
    Cancelled,
    /// Pinning was not asked for.
    #[error("pinning disabled")]
    Disabled,
    /// Another rank fell back to pageable memory, so this one did too (P7).
    #[error("another rank fell back to pageable memory")]
    PeerPageable,
    /// The host pages could not be made resident before registration.
    #[error("host memory could not be pre-faulted: {0}")]
    HostMemory(String),
    /// Any other driver failure, with its code.
    #[error("host registration failed: {0}")]
    Driver(DriverError),
}

impl PageableReason {
    /// The reason a failed registration gives.
    pub fn from_driver(e: DriverError) -> Self {
        match e.code {
            Code::NOT_SUPPORTED => PageableReason::NotSupported,
            Code::STREAM_CAPTURE_UNSUPPORTED => PageableReason::CaptureUnsupported,
            Code::OUT_OF_MEMORY => PageableReason::OutOfMemory,
            _ => PageableReason::Driver(e),
        }
    }
}

/// Where pinning stands. Observable and waitable through the coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PinState {
    /// Not started yet.
    Pending,
    /// Registering chunks: `done` of `total` registered.
    Pinning {
        /// Chunks registered so far.
        done: usize,
        /// Chunks in the region.
        total: usize,
    },
    /// Every chunk registered.
    Pinned,
    /// Running on pageable memory; every chunk is unregistered.
    Pageable(PageableReason),
}

impl PinState {
    /// Pinned or Pageable: pinning will not change the state any more.
    pub fn is_final(&self) -> bool {
        matches!(self, PinState::Pinned | PinState::Pageable(_))
    }
}

/// Misuse or refusal at the protocol level.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Shutdown has begun: no new windows, jobs or graphs.
    #[error("the offloader is shutting down or shut down")]
    ShutDown,
    /// `shutdown` was called again after it completed or while it runs.
    #[error("shutdown was already requested")]
    AlreadyShutDown,
    /// Shutdown refused: a capture window is open.
    #[error("shutdown refused: {open} capture window(s) open")]
    WindowOpen {
        /// Capture windows open when shutdown was asked for (at least 1).
        open: usize,
    },
    /// Shutdown refused: graphs registered as referencing the region exist.
    #[error("shutdown refused: {live} graph(s) registered as referencing the region still exist")]
    GraphsAlive {
        /// Graphs recorded by [`Coordinator::register_graph`](super::Coordinator::register_graph)
        /// whose [`GraphToken`](super::GraphToken) is still alive.
        live: usize,
    },
    /// This thread already holds a capture window.
    #[error("this thread already holds a capture window")]
    NestedWindow,
    /// The call would wait for something the caller itself holds back: its
    /// own capture window (e.g. waiting for pinning inside a window with
    /// the Interleave policy, or a blocking driver call inside a window),
    /// a job deferred behind its own capture hook window, or the
    /// `Offloader::gated` call it runs inside (a window, a wait or a
    /// shutdown there). The message names the cause.
    #[error("{}", would_deadlock_message(what))]
    WouldDeadlock {
        /// What the caller asked for, e.g. `"waiting for pinning"`,
        /// `"waiting for a transfer"` or the name of the capture-unsafe
        /// call (such as `"registering a chunk"`): a call refused inside
        /// the caller's own capture window. A refusal for another cause
        /// says where the caller is: `"... inside gated()"` inside
        /// `Offloader::gated`, `"... behind this thread's capture hook
        /// window"` for a deferred job, `"... while this thread holds it
        /// back"` for a wait for pinning by a thread holding a pin hold.
        what: &'static str,
    },
    /// A capture-unsafe call was skipped because a window is open.
    #[error("skipped: a capture window is open")]
    WindowBusy,
    /// A wait asked for with an interruptible [`Request`](super::Request)
    /// ([`Coordinator::open_window`](super::Coordinator::open_window),
    /// [`Coordinator::unsafe_call`](super::Coordinator::unsafe_call),
    /// [`Pinning::wait_final`](super::Pinning::wait_final),
    /// [`Coordinator::wait_no_window`](super::Coordinator::wait_no_window))
    /// stopped because its `interrupted` check said so (e.g. Ctrl-C in the
    /// Python front). It left no trace: a window request was withdrawn
    /// before it opened, a waiting library call withdrawn before it ran, a
    /// pin waiter uncounted.
    #[error("interrupted while waiting for {what}")]
    Interrupted {
        /// What the caller was waiting for, e.g. `"a capture window"`.
        what: &'static str,
    },
    /// A coordinator for a runtime handle that another coordinator guards
    /// (an `Offloader` on a handle another offloader uses, say): refused,
    /// because the second coordinator's gates would let capture-unsafe
    /// calls overlap the first one's capture windows. Use one runtime handle
    /// per coordinator (open another, or drop the first offloader).
    #[error(
        "this {backend} runtime handle is already guarded by another coordinator (one coordinator per runtime handle)"
    )]
    RuntimeGuarded {
        /// The runtime's backend (`"sim"` or `"cuda"`).
        backend: &'static str,
    },
}

/// [`ProtocolError::WouldDeadlock`]'s message: its cause as `what` says
/// it (a refusal inside `gated()` or behind a hook window says so), or
/// else the caller's own open capture window, the other refusals' cause.
fn would_deadlock_message(what: &str) -> String {
    if what.ends_with(" inside gated()") {
        format!(
            "{what} would deadlock: gated() holds capture windows back until it returns, and this would wait for \
             one, or for work one holds back"
        )
    } else if what.contains("this thread's capture hook window") {
        format!("{what} would deadlock: that window stays open until this thread closes it")
    } else if what.ends_with(" while this thread holds it back") {
        format!("{what} would deadlock: pinning waits for this thread's pin hold to be dropped")
    } else {
        format!("{what} inside this thread's own open capture window would deadlock")
    }
}

#[cfg(test)]
mod tests {
    use super::ProtocolError;

    /// Issue 43: a refusal inside `gated()` named an open capture window
    /// although none was open; each cause is named as it is.
    #[test]
    fn would_deadlock_names_its_true_cause() {
        let m = |what| ProtocolError::WouldDeadlock { what }.to_string();
        let gated = m("waiting for pinning inside gated()");
        assert!(gated.starts_with("waiting for pinning inside gated() would deadlock: gated() holds"), "{gated}");
        assert!(!gated.contains("open capture window"), "{gated}");
        let hook = m("waiting for a job deferred behind this thread's capture hook window");
        assert!(hook.ends_with("would deadlock: that window stays open until this thread closes it"), "{hook}");
        let held = m("waiting for pinning while this thread holds it back");
        assert!(held.ends_with("would deadlock: pinning waits for this thread's pin hold to be dropped"), "{held}");
        assert!(!held.contains("capture window"), "{held}");
        assert_eq!(
            m("waiting for pinning"),
            "waiting for pinning inside this thread's own open capture window would deadlock"
        );
    }
}
