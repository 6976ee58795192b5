//! [`Request`]: how one waiting operation behaves. Every wait and every
//! window of the coordinator and of the `Offloader` takes one, so each
//! operation exists once; whether it is interruptible, or opens its window
//! under the Interleave rules, is a property of the request, not a second
//! method.

/// How a waiting operation behaves: built with [`Request::new`] (block until
/// what it waits for happens) and the setters below, then passed by value
/// (it is `Copy`) to the coordinator's and the `Offloader`'s waits and
/// windows.
///
/// ```
/// use kvoffload::Request;
/// let ctrl_c = || false;
/// // The capture hook's window from Python: Interleave rules, Ctrl-C withdraws it.
/// let req = Request::new().interleaved().interruptible(&ctrl_c);
/// assert!(req.is_interleaved() && req.is_interruptible());
/// ```
#[derive(Clone, Copy, Default)]
pub struct Request<'a> {
    interleave: bool,
    interrupted: Option<&'a dyn Fn() -> bool>,
    at_request: Option<&'a dyn Fn()>,
}

impl std::fmt::Debug for Request<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("interleave", &self.interleave)
            .field("interruptible", &self.interrupted.is_some())
            .field("noting", &self.at_request.is_some())
            .finish()
    }
}

impl<'a> Request<'a> {
    /// A blocking request: it waits until what it waits for happens (or
    /// shutdown refuses it), and a window opens under the coordinator's
    /// policy.
    pub const fn new() -> Self {
        Request { interleave: false, interrupted: None, at_request: None }
    }

    /// A window asked for with this request opens under the Interleave rules
    /// whatever the coordinator's policy: it waits only for the capture-unsafe
    /// call in flight (a chunk's registration, at most one), never for
    /// pinning to be final (the capture hook's windows). Waits that open no
    /// window ignore it.
    pub const fn interleaved(mut self) -> Self {
        self.interleave = true;
        self
    }

    /// The wait calls `interrupted` at least every 50 ms while it waits, with
    /// the coordinator's lock released (it may take other locks, such as
    /// Python's GIL), and when it returns true withdraws and returns an
    /// `Interrupted` error. A withdrawn request leaves no trace: a window
    /// never opened and is no longer counted as waiting, a library call has
    /// not run, a pin waiter is uncounted.
    pub const fn interruptible(mut self, interrupted: &'a dyn Fn() -> bool) -> Self {
        self.interrupted = Some(interrupted);
        self
    }

    /// Calls `at_request` under the coordinator's lock at the moment a window
    /// request is counted (model builds only: P2's models read the simulated
    /// GPU's registration count there, so the chunks a window waited for are
    /// counted by the driver, not by the coordinator). It must not call back
    /// into the coordinator.
    #[cfg(any(loom, shuttle))]
    pub const fn noting(mut self, at_request: &'a dyn Fn()) -> Self {
        self.at_request = Some(at_request);
        self
    }

    /// True when a window asked for with this request opens under the
    /// Interleave rules.
    pub const fn is_interleaved(&self) -> bool {
        self.interleave
    }

    /// True when the wait can be interrupted.
    pub const fn is_interruptible(&self) -> bool {
        self.interrupted.is_some()
    }

    /// The interrupt check, if any.
    pub(crate) fn interrupt(&self) -> Option<&'a dyn Fn() -> bool> {
        self.interrupted
    }

    /// Runs the at-request hook, if any (under the coordinator's lock).
    pub(crate) fn note(&self) {
        if let Some(f) = self.at_request {
            f();
        }
    }
}
