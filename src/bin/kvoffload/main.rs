//! The `kvoffload` command line: the main job (`run`), the conformance suite (`conform`), the
//! seed incident (`incident`) and the benchmarks (`bench`). See
//! `kvoffload --help`. The run job's ranks hold one `Offloader` each, as an
//! engine does; the tools below it (conformance, benchmarks) drive the
//! library's layers through `kvoffload::internal`.

#[cfg(not(loom))]
mod bench;
#[cfg(not(loom))]
mod cli;
#[cfg(not(loom))]
mod conform;
#[cfg(not(loom))]
mod incident;
#[cfg(not(loom))]
mod plot;
#[cfg(not(loom))]
mod random;
#[cfg(not(loom))]
mod run;

#[cfg(not(loom))]
fn main() {
    std::process::exit(cli::main());
}

/// Loom builds (`--cfg loom`) exist to run the models under model/; the CLI
/// needs the real driver and is not part of them.
#[cfg(loom)]
fn main() {
    eprintln!("kvoffload: this binary was built with --cfg loom for the model checker; build without it");
    std::process::exit(2);
}
