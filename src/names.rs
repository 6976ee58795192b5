//! The string forms of the library's enums, one table per enum.
//!
//! An enum that options, reports or the Python front name by strings
//! (`"per-fragment"`, `"lru"`, `"after_pinning"`, ...) writes its names once,
//! in a `named!` table next to its definition. The table gives it
//! [`Named`] (its name, every value, parsing with an error that lists the
//! valid names), `Display` and `FromStr`; the CLI, the benchmarks and the
//! Python front read the same table.
//!
//! ```
//! use kvoffload::{Backend, BackendChoice, Named};
//!
//! assert_eq!(Backend::Staged.name(), "staged");
//! assert_eq!("auto".parse::<BackendChoice>(), Ok(BackendChoice::Auto));
//! let e = "fast".parse::<Backend>().unwrap_err();
//! assert_eq!(e.to_string(), r#"unknown backend "fast" (expected per-fragment, batched, gather or staged)"#);
//! ```

/// An enum with one name per value, from its `named!` table.
pub trait Named: Copy + Sized + 'static {
    /// What a value is, for errors (`"backend"`, `"eviction policy"`).
    const WHAT: &'static str;

    /// The value's name.
    fn name(&self) -> &'static str;

    /// Every value, in the table's order.
    fn all() -> &'static [Self];

    /// Every name, in the table's order.
    fn names() -> Vec<&'static str> {
        Self::all().iter().map(Named::name).collect()
    }

    /// The value named `s` (exactly, case included), or an error listing
    /// the valid names.
    fn from_name(s: &str) -> Result<Self, UnknownName> {
        Self::all().iter().copied().find(|v| v.name() == s).ok_or_else(|| UnknownName {
            what: Self::WHAT,
            given: s.to_string(),
            valid: Self::names(),
        })
    }
}

/// A string that names no value of a [`Named`] enum.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {given:?} (expected {})", self.expected())]
pub struct UnknownName {
    /// What was named ([`Named::WHAT`]).
    pub what: &'static str,
    /// The string given.
    pub given: String,
    /// The valid names, in the table's order.
    pub valid: Vec<&'static str>,
}

impl UnknownName {
    /// The valid names in words: `"a, b or c"`.
    pub fn expected(&self) -> String {
        match self.valid.split_last() {
            None => String::new(),
            Some((last, [])) => (*last).to_string(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        }
    }
}

/// Gives `$ty` its one table of names: [`Named`] (its `match` has no
/// catch-all arm, so a variant missing from the table fails to compile),
/// `Display` and `FromStr` (with [`UnknownName`]).
///
/// ```ignore
/// named!(Lane, "lane" {
///     Store => "store",
///     Load => "load",
///     LoadExpedited => "load_expedited",
/// });
/// named!(BackendChoice, "backend" { Auto => "auto", Force(Backend::Staged) => "staged", ... });
/// ```
macro_rules! named {
    ($ty:ident, $what:literal { $($variant:ident $(( $($arg:tt)* ))? => $name:literal),+ $(,)? }) => {
        impl $crate::names::Named for $ty {
            const WHAT: &'static str = $what;

            fn name(&self) -> &'static str {
                match self {
                    $($ty::$variant $(( $($arg)* ))? => $name,)+
                }
            }

            fn all() -> &'static [Self] {
                &[$($ty::$variant $(( $($arg)* ))?),+]
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str($crate::names::Named::name(self))
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = $crate::names::UnknownName;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                <Self as $crate::names::Named>::from_name(s)
            }
        }
    };
}
pub(crate) use named;

// Tests: tests/names.rs (on the crate root's names, so that this bottom
// layer imports nothing from the layers whose enums it names).
