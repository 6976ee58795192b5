//! The negative models' handles on a coordinator, model builds only
//! (`--cfg loom` or `--cfg shuttle`; this module is not compiled
//! elsewhere): [`Coordinator::set_variant`], which selects the rules a
//! negative breaks (`crate::rules`: the coordinator and its parties call
//! them where they act, and no production code names a variant), and
//! [`Coordinator::forged_gate`], N8's gate that the gate did not make.

use super::{Coordinator, SEAL};
use crate::rules::negatives::Variant;
use crate::runtime::Gate;

impl Coordinator {
    /// A gate of this coordinator that its gate did not make (not in flight
    /// on any thread): model builds only, for negative N8, which shows the
    /// simulated GPU stops a call made with it.
    #[doc(hidden)]
    pub fn forged_gate(&self) -> Gate {
        Gate::unrecorded(&SEAL, self.shared.id)
    }

    /// Selects a known-bad variant (negative models only), before the
    /// model's threads start: the coordinator's rules under its lock, its
    /// knob (read by its parties outside the lock) and its runtime
    /// handle's binding all run it.
    pub fn set_variant(&self, v: Variant) {
        self.lock().rules = v;
        self.shared.knob.set(v);
        // The binding of this coordinator's runtime handle runs the same
        // rules (N27's), as it admits gates without asking the coordinator.
        self.shared.binding.set_rules(v);
    }
}
