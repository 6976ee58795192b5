//! The negative models' switches: [`Variant`], the known-bad variant a
//! coordinator runs, and the two macros that read it, `bad!` (on the
//! coordinator's state, in this module's files) and `variant_is!` (in the
//! other modules). Model builds only (`--cfg loom` or `--cfg shuttle`): in
//! the engine's build `Variant` has `Production` alone and both macros are
//! `false`, so no negative model's knob is compiled into the engine.
//!
//! Rule: a switch changes one rule of the module docs (its negative names
//! the property it breaks, docs/PROOFS.md); `Production` changes none.

/// `bad!(state, Name)`: true when the coordinator's state `state` runs the
/// known-bad variant `Variant::Name` of a negative model. Model builds only
/// (`--cfg loom` or `--cfg shuttle`):
/// elsewhere it is `false` and the variant does not exist, so no negative
/// model's knob is compiled into the engine's build.
#[cfg(any(loom, shuttle))]
macro_rules! bad {
    ($g:expr, $v:ident) => {
        $g.variant == $crate::protocol::Variant::$v
    };
}
#[cfg(not(any(loom, shuttle)))]
macro_rules! bad {
    ($g:expr, $v:ident) => {
        false
    };
}

/// `variant_is!(coord, Name)`: [`Coordinator::is`] of `Variant::Name` in
/// model builds (loom, shuttle), `false` (and not compiled) elsewhere; for the other
/// modules' negative-model knobs.
#[cfg(any(loom, shuttle))]
macro_rules! variant_is {
    ($c:expr, $v:ident) => {
        $c.is($crate::protocol::Variant::$v)
    };
}
#[cfg(not(any(loom, shuttle)))]
macro_rules! variant_is {
    ($c:expr, $v:ident) => {
        false
    };
}
pub(crate) use variant_is;

use super::Coordinator;
#[cfg(any(loom, shuttle))]
use {super::SEAL, crate::runtime::Gate};

/// The production protocol, or one of the known-bad variants that the
/// negative models run (of N1-N38, docs/PROOFS.md). The known-bad variants,
/// the state that holds one and every branch that reads it exist only in
/// model builds, loom's and shuttle's (`bad!`, `variant_is!`): the engine's build has `Production`
/// alone and none of the negative models' knobs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum Variant {
    /// The protocol as shipped: every rule of the module docs enforced.
    /// The only variant outside model builds, and the one the positive
    /// models P1-P8 check.
    #[default]
    Production,
    /// N1: upstream's design: no capture window (windows open at once,
    /// library calls are not held back).
    #[cfg(any(loom, shuttle))]
    NoCaptureWindow,
    /// N2: shutdown unregisters without draining transfers.
    #[cfg(any(loom, shuttle))]
    NoDrainBeforeUnregister,
    /// N3: the completion poller queries events even while a window is open.
    #[cfg(any(loom, shuttle))]
    UngatedPoller,
    /// N4: the gather kernel gets an alias without checking registration.
    #[cfg(any(loom, shuttle))]
    UncheckedGather,
    /// N5: shutdown ignores graphs that still reference the region.
    #[cfg(any(loom, shuttle))]
    IgnoreLiveGraphs,
    /// N6: waiting for pinning inside a window is allowed (and hangs).
    #[cfg(any(loom, shuttle))]
    WaitInsideWindow,
    /// N7: rollback unregisters only the chunk that failed last.
    #[cfg(any(loom, shuttle))]
    ForgetfulRollback,
    /// N13: a rank publishes its own pin outcome (offload on) before the
    /// ranks exchanged theirs (P7).
    #[cfg(any(loom, shuttle))]
    PublishBeforeAgreement,
    /// N9: `TransferEngine::submit` as it was before it moved inside the gate: it checks
    /// the compute stream's capture status, then records the ordering
    /// event on it and waits for it on the handler's stream, all outside
    /// the gate (check-then-act: a capture may begin in between).
    #[cfg(any(loom, shuttle))]
    RacySubmit,
    /// N10: shutdown does not wait for pinning to settle before it
    /// unregisters (a registration in flight completes afterwards).
    #[cfg(any(loom, shuttle))]
    ShutdownSkipsPinWait,
    /// N14: the staged backend does not join its two staging streams back
    /// into the handler's stream, so a job's completion event does not
    /// cover its chunks (P5).
    #[cfg(any(loom, shuttle))]
    UnjoinedStaging,
    /// N16: a closing window does not hand the turn to a waiting library
    /// call, so windows opening back to back starve pinning (P6, liveness).
    #[cfg(any(loom, shuttle))]
    WindowKeepsTurn,
    /// N17: a guard's release (a window, a job ticket, a graph token, an
    /// alias, the end of a gated call) changes the state but wakes nobody
    /// (P6, liveness: a lost wake-up).
    #[cfg(any(loom, shuttle))]
    SilentRelease,
    /// N18: `KeyedOffloader::store` makes its keys readable when the store is
    /// submitted, not when it completed (P5).
    #[cfg(any(loom, shuttle))]
    ReadableAtSubmit,
    /// N19: `KeyedOffloader::load` releases its keys' slots when the load is
    /// submitted, so eviction may hand a slot to a store while the load
    /// still reads it (P5).
    #[cfg(any(loom, shuttle))]
    SlotFreedAtLoadSubmit,
    /// N20: `Offloader::shutdown` skips its own drain (polling its jobs to
    /// completion) and drops the transfer engine with jobs unreported: their
    /// completions never reach the block manager (P4, P5).
    #[cfg(any(loom, shuttle))]
    OffloaderSkipsDrain,
    /// N21: the capture hook's `capture_end` submits the jobs it deferred
    /// before it closes its window, not after (on the closing thread, still
    /// inside the window the capture runs in).
    #[cfg(any(loom, shuttle))]
    HookFlushesInsideWindow,
    /// N22: the capture hook's `capture_abort` (a capture whose begin
    /// failed) forgets to close the window its `capture_begin` opened.
    #[cfg(any(loom, shuttle))]
    HookAbortKeepsWindow,
    /// N23: a rank's wait in the P7 agreement ignores the cancel of its
    /// pinning (a shutdown during the agreement), as before issue 28: it
    /// waits for a peer that never settles.
    #[cfg(any(loom, shuttle))]
    AgreementIgnoresCancel,
    /// N25: a refused shutdown has already asked pinning to stop (the
    /// cancel set before the refusal's checks): pinning rolls back to
    /// pageable although nothing was shut down.
    #[cfg(any(loom, shuttle))]
    RefusalCancelsPinning,
    /// N24: shutdown unregisters the chunks first and drains after: a job
    /// admitted before the shutdown copies the region once it is no longer
    /// registered (its memory stays mapped until the drain).
    #[cfg(any(loom, shuttle))]
    UnregisterBeforeDrain,
    /// N15: `Offloader::shutdown` in its earlier order: it closes
    /// the offloader, drains and drops the transfer engine and frees its
    /// tensors, and only then asks the coordinator, which may refuse (a
    /// window open, a graph alive): the refusal comes after the teardown.
    #[cfg(any(loom, shuttle))]
    TeardownBeforeRefusal,
    /// N26: `Offloader::submit` skips its busy-slot check: a slot job is
    /// accepted while a job in flight on one of its slots conflicts with it
    /// (a store beside any job on the slot, a load beside a store).
    #[cfg(any(loom, shuttle))]
    SlotBusyUnchecked,
    /// N27: the runtime handle bound to this coordinator admits a gate of
    /// any coordinator (`GateBinding::admits` says yes to every gate).
    #[cfg(any(loom, shuttle))]
    BindingAdmitsAnyGate,
    /// N28: a pre-faulter's `ensure` of a chunk returns once every slice of
    /// the chunk was taken by a worker, not once each was faulted: the
    /// registration of the chunk may run while a worker still faults it
    /// (`Prefaulter::set_variant`).
    #[cfg(any(loom, shuttle))]
    PrefaultEnsureBeforeFaulted,
    /// N29: a pre-faulter's `ensure` does not look for its chunk among the
    /// chunks hinted before and queues it again: a hinted chunk's slices are
    /// faulted twice (`Prefaulter::set_variant`).
    #[cfg(any(loom, shuttle))]
    PrefaultHintForgotten,
    /// N30: the capture hook's flush, refused by an engine's window, waits
    /// until no window at all is open (`Coordinator::wait_no_window`), not
    /// only until a window is requested after it began waiting: a hook
    /// window that begins meanwhile on another thread holds up the close
    /// that flushes until that window closes too.
    #[cfg(any(loom, shuttle))]
    HookFlushWaitsForEveryWindow,
    /// N31: a chunk's registration ignores the pin holds
    /// ([`Coordinator::hold_pinning`]): pinning goes on during an engine's
    /// capture phase.
    #[cfg(any(loom, shuttle))]
    PinIgnoresHold,
    /// N33: a capture hook begin refused or interrupted before its window
    /// opened does not submit the jobs deferred behind its request: they
    /// stay queued with no hook window open (until someone else flushes).
    #[cfg(any(loom, shuttle))]
    HookRefusedBeginKeepsQueue,
    /// N34: an interruptible wait does not start a new slice after its
    /// check said to go on: from then on it calls the check on every turn
    /// of its loop without waiting (a spin that, from Python, takes the GIL
    /// each time).
    #[cfg(any(loom, shuttle))]
    CheckWithoutNewSlice,
    /// N35: the capture hook's `capture_abort` closes its window but does
    /// not submit the deferred jobs when it was the last one open
    /// (`capture_end` still does).
    #[cfg(any(loom, shuttle))]
    HookAbortSkipsFlush,
    /// N36: a wait for a deferred job does not refuse the thread that holds
    /// the hook window the job waits behind: that thread waits for its own
    /// close.
    #[cfg(any(loom, shuttle))]
    WaitForOwnDeferredJob,
    /// N37: a callable run under the gate (`Coordinator::unsafe_call`,
    /// `Offloader::gated`) that panics leaves its call counted in flight:
    /// no window opens again.
    #[cfg(any(loom, shuttle))]
    PanicUnderGateLeaks,
    /// N38: `KeyedOffloader::store` refused at submission (a capture
    /// window open) drops its placed keys but keeps the evictions the
    /// block manager made for them, as before issue 43: a key the engine
    /// was never told of as evicted is gone (P5).
    #[cfg(any(loom, shuttle))]
    RefusedStoreKeepsEvictions,
}

impl Coordinator {
    /// A gate of this coordinator that its gate did not make (not in flight
    /// on any thread): loom builds only, for negative N8, which shows the
    /// simulated GPU stops a call made with it.
    #[cfg(any(loom, shuttle))]
    #[doc(hidden)]
    pub fn forged_gate(&self) -> Gate {
        Gate::unrecorded(&SEAL, self.shared.id)
    }

    /// Selects a known-bad variant (negative models only).
    #[cfg(any(loom, shuttle))]
    pub fn set_variant(&self, v: Variant) {
        self.lock().variant = v;
        *self.shared.knob.lock().unwrap_or_else(|p| p.into_inner()) = v;
        // N27's knob lives in the binding of this coordinator's runtime
        // handle, which admits gates without asking the coordinator.
        self.shared.binding.set_admit_any(v == Variant::BindingAdmitsAnyGate);
    }

    /// True when this coordinator runs variant `v` (loom builds only: the
    /// other modules ask through `variant_is!`, which is `false` elsewhere).
    #[cfg(any(loom, shuttle))]
    pub(crate) fn is(&self, v: Variant) -> bool {
        // Not the state's lock: a schedule point under loom (see `knob`).
        *self.shared.knob.lock().unwrap_or_else(|p| p.into_inner()) == v
    }
}
