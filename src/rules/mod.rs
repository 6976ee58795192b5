//! The seam between the shipped protocol and its negative models: the
//! [`Rules`] a party runs at each place a negative model changes.
//!
//! Each negative model (N1-N38, docs/PROOFS.md) runs the library with one
//! rule broken, to show that its model catches the break. The breaks do not
//! live in the production paths: at each place a negative changes, the
//! production code calls a method of [`Rules`], named after the rule it
//! keeps, whose *provided* body is the shipped behaviour. The production code
//! hands the method the operations the rule is about (as closures: the steps
//! it orders, the fact it decides on) and the method runs them the shipped
//! way: every step, in the shipped order. A negative overrides the one method
//! it breaks and runs the same operations the bad way (steps reordered or
//! skipped, a decision taken otherwise); every other method keeps the shipped
//! body. Where a negative needs an operation the shipped rule never runs
//! (N13's early publish, N28's "every slice taken", N9's admission outside
//! the gate), the call site hands it over too, named for what it does, never
//! for the negative; the shipped body does not call it.
//!
//! Which rules run:
//!
//! - Outside model builds, [`Active`] is [`Shipped`], a zero-sized type that
//!   overrides nothing: every call is the provided body, inlined, and no
//!   negative's code is compiled.
//! - In the model builds (`--cfg loom`, `--cfg shuttle`), [`Active`] is
//!   [`negatives::Variant`], the model-build-only enum of the negatives,
//!   whose `impl Rules` overrides, per variant, the method it breaks;
//!   `Variant::Production` overrides nothing. A model selects one with
//!   `Coordinator::set_variant` (or `Prefaulter::set_variant`).
//!
//! A party finds the rules it runs through a [`Knob`] (the coordinator's,
//! shared with nothing; a runtime handle's, in its `GateBinding`) or a field
//! of type [`Active`] (the pre-fault pool's, under its lock): a `Knob` holds
//! nothing outside model builds, and the variant in them. The seam depends on
//! nothing in the crate, so every layer may call it, the runtime's included.
//!
//! The methods are grouped by the layer that calls them; each says the
//! property it keeps and the negative that breaks it.

#[cfg(any(loom, shuttle))]
pub mod negatives;

/// The rules a party runs at each place a negative model changes; the
/// provided bodies are the shipped behaviour (see the module docs). Only
/// [`Shipped`] and, in the model builds, [`negatives::Variant`] implement
/// it.
pub(crate) trait Rules {
    // ---- the runtime: which gates a handle admits (P1) ----

    /// A runtime handle admits a gate only of the coordinator bound to it:
    /// the answer is `bound` (whether `gate` is one of the bound
    /// coordinator's). N27 admits every gate.
    fn admits_gate(&self, bound: impl FnOnce() -> bool) -> bool {
        bound()
    }

    // ---- protocol: the shutdown order (P4) ----

    /// Shutdown drains the admitted jobs and lets pinning settle before it
    /// unregisters any chunk: `drain`, `settle_pinning`, then `unregister`
    /// (whose result is returned). N24 unregisters first.
    fn drain_then_unregister<R>(
        &self,
        drain: impl FnOnce(),
        settle_pinning: impl FnOnce(),
        unregister: impl FnOnce() -> R,
    ) -> R {
        drain();
        settle_pinning();
        unregister()
    }

    // ---- pin: rollback (P8), the ranks' agreement (P7) ----

    /// A rollback unregisters every chunk registered so far, the last
    /// first: `unregister(j)` for `j` in `registered - 1 ..= 0`. N7 undoes
    /// only the last one.
    fn roll_back_all(&self, registered: usize, unregister: impl FnMut(usize)) {
        (0..registered).rev().for_each(unregister);
    }

    /// Nothing of a rank's own pinning is published before the ranks
    /// agreed: `agree` gets this rank's outcome (`pinned`) and its result is
    /// returned; `publish_pinned` (this rank's "pinned", published on its
    /// own) is not run. N13 runs it first when `pinned`.
    fn agree_before_publishing<M>(
        &self,
        pinned: bool,
        _publish_pinned: impl FnOnce(),
        agree: impl FnOnce(bool) -> M,
    ) -> M {
        agree(pinned)
    }

    /// A rank's wait in the agreement ends when its own pinning is
    /// cancelled (a shutdown during the agreement): the answer is
    /// `cancelled`. N23 ignores it.
    fn agreement_heeds_cancel(&self, cancelled: bool) -> bool {
        cancelled
    }

    // ---- pin: the pre-fault pool (F1) ----

    /// An `ensure` of a chunk hinted before takes the hint's job: the
    /// job is `find`'s (`None`: not hinted, a new one is queued). N29
    /// forgets the hint.
    fn ensure_takes_hint<J>(&self, find: impl FnOnce() -> Option<J>) -> Option<J> {
        find()
    }

    /// An `ensure` waits until every slice of its chunk was faulted: the
    /// chunk is unfinished while `unfaulted` says so; `untaken` (some slice
    /// still queued, not yet taken by a worker) is not asked. N28 waits only
    /// while `untaken`.
    fn ensure_waits_for_faulting(&self, unfaulted: impl FnOnce() -> bool, _untaken: impl FnOnce() -> bool) -> bool {
        unfaulted()
    }

    // ---- transfer: submission (P1), the staged backend (P5) ----

    /// A job's submission checks the compute stream and records its
    /// ordering event inside the coordinator's gate: `admit_in_gate` runs
    /// `accept` (the check, the record, the enqueue) on the ticket inside
    /// the gate and its result is returned; `admit` (a ticket with no gate)
    /// is not run. N9 admits with `admit` and accepts outside the gate
    /// (check-then-act), a refusal of `admit` being the result.
    fn accept_inside_gate<T, R, A: Fn(T) -> R>(
        &self,
        accept: A,
        _admit: impl FnOnce() -> Result<T, R>,
        admit_in_gate: impl FnOnce(&A) -> R,
    ) -> R {
        admit_in_gate(&accept)
    }

    /// A staged job's completion event covers its staging streams: each
    /// stream `b` the job used is joined back (`join(b)`) before the event
    /// is recorded. N14 joins none.
    fn join_staging_streams(&self, used: &[usize], join: impl FnMut(&usize)) {
        used.iter().for_each(join);
    }
}

/// The shipped rules: every method's provided body (see the module docs).
/// Zero-sized; outside model builds the only [`Rules`] there are.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Shipped;

impl Rules for Shipped {}

/// The rules the parties run in this build: [`Shipped`] outside model
/// builds.
#[cfg(not(any(loom, shuttle)))]
pub(crate) type Active = Shipped;

/// The rules the parties run in this build: in the model builds the
/// negative a model selected ([`negatives::Variant`], `Production` unless
/// set).
#[cfg(any(loom, shuttle))]
pub(crate) type Active = negatives::Variant;

/// Where a party keeps the rules it runs, readable without its lock:
/// nothing outside model builds ([`Knob::rules`] is [`Shipped`]); in them,
/// the variant a model selected, behind std's mutex (loom and shuttle do
/// not schedule it, so reading the knob adds no interleaving to a model:
/// a model explores the library's schedule points, not the knob's). A clone
/// shares the knob (a runtime handle's clones share its binding's).
#[derive(Clone, Debug, Default)]
pub(crate) struct Knob {
    #[cfg(any(loom, shuttle))]
    #[allow(clippy::disallowed_types)]
    variant: std::sync::Arc<std::sync::Mutex<negatives::Variant>>,
}

impl Knob {
    /// The rules to run now.
    #[cfg(not(any(loom, shuttle)))]
    #[inline(always)]
    pub(crate) fn rules(&self) -> Active {
        Shipped
    }

    /// The rules to run now: the variant last set.
    #[cfg(any(loom, shuttle))]
    pub(crate) fn rules(&self) -> Active {
        *self.variant.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Selects variant `v` (a model, before its threads start).
    #[cfg(any(loom, shuttle))]
    pub(crate) fn set(&self, v: negatives::Variant) {
        *self.variant.lock().unwrap_or_else(|p| p.into_inner()) = v;
    }
}
