//! The library offloader behind `kvoffload.Offloader`: a
//! [`KeyedOffloader`] (`addressing="keys"`: the block manager places the
//! keys) or a core [`Offloader`] (`addressing="slots"`: the engine's own
//! host slots). The library decides by type what each can do; the one
//! Python class keeps its `addressing=` and refuses a call of the other
//! kind itself (OptionsError, kind `"wrong_addressing"`).

use super::*;

/// What a `kvoffload.Offloader` holds. Derefs to the core, which every
/// call but the keyed and the slot jobs goes to.
pub(crate) enum Front {
    /// `addressing="keys"`.
    Keyed(KeyedOffloader),
    /// `addressing="slots"`.
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
    /// `"keys"` or `"slots"`.
    pub(crate) fn addressing(&self) -> &'static str {
        match self {
            Front::Keyed(_) => "keys",
            Front::Slots(_) => "slots",
        }
    }

    /// The keyed offloader, or the refusal of keyed call `call`.
    pub(crate) fn keyed(&self, py: Python<'_>, call: &str) -> PyResult<&KeyedOffloader> {
        match self {
            Front::Keyed(k) => Ok(k),
            Front::Slots(_) => Err(errors::wrong_addressing(py, call, "Slots")),
        }
    }

    /// The slot-addressed core, or the refusal of slot call `call`.
    pub(crate) fn slots(&self, py: Python<'_>, call: &str) -> PyResult<&Offloader> {
        match self {
            Front::Slots(o) => Ok(o),
            Front::Keyed(_) => Err(errors::wrong_addressing(py, call, "Keys")),
        }
    }
}
