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
use {super::SEAL, crate::rules::negatives::Variant, crate::runtime::Gate};

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
        self.shared.knob.set(v);
        // The binding of this coordinator's runtime handle runs the same
        // rules (N27's), as it admits gates without asking the coordinator.
        self.shared.binding.set_rules(v);
    }

    /// The rules this coordinator and its parties run (`crate::rules`):
    /// the shipped ones outside model builds, where this is zero-sized.
    pub(crate) fn rules(&self) -> crate::rules::Active {
        self.shared.knob.rules()
    }

    /// True when this coordinator runs variant `v` (loom builds only: the
    /// other modules ask through `variant_is!`, which is `false` elsewhere).
    #[cfg(any(loom, shuttle))]
    pub(crate) fn is(&self, v: Variant) -> bool {
        // Not the state's lock: a schedule point under loom (see `knob`).
        self.shared.knob.rules() == v
    }
}
