//! Every enum's one table of names (`kvoffload::Named`, src/names.rs),
//! through the crate root: each name parses back to its value, names are
//! distinct, an unknown name lists the valid ones.

use kvoffload::{
    Backend, BackendChoice, CapturePolicy, Direction, HugePages, Lane, Lookup, Named, PolicyKind, PrefaultMode,
};

/// Every value's name parses back to it, and the names are distinct.
fn round_trips<T: Named + PartialEq + std::fmt::Debug + std::fmt::Display + std::str::FromStr>() {
    let names = T::names();
    for v in T::all() {
        assert_eq!(T::from_name(v.name()), Ok(*v));
        assert_eq!(v.to_string(), v.name());
        assert_eq!(v.name().parse::<T>().ok(), Some(*v));
        assert_eq!(names.iter().filter(|n| **n == v.name()).count(), 1, "{} named twice", v.name());
    }
}

#[test]
fn every_table_round_trips() {
    round_trips::<Backend>();
    round_trips::<BackendChoice>();
    round_trips::<PolicyKind>();
    round_trips::<CapturePolicy>();
    round_trips::<HugePages>();
    round_trips::<PrefaultMode>();
    round_trips::<Lane>();
    round_trips::<Direction>();
    round_trips::<Lookup>();
}

#[test]
fn an_unknown_name_lists_the_valid_ones() {
    let e = PolicyKind::from_name("fifo").unwrap_err();
    assert_eq!(e.valid, ["lru", "arc"]);
    assert_eq!(e.to_string(), r#"unknown eviction policy "fifo" (expected lru or arc)"#);
    let e = "Auto".parse::<BackendChoice>().unwrap_err();
    assert_eq!(e.to_string(), r#"unknown backend "Auto" (expected auto, per-fragment, batched, gather or staged)"#);
    assert_eq!(BackendChoice::all().len(), 1 + Backend::all().len());
}
