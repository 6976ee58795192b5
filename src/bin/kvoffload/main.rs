//! The `kvoffload` command line: the main job (`run`), the conformance suite (`conform`), the
//! seed incident (`incident`), the benchmarks (`bench`) and the node pools (`pool ls | rm`). See
//! `kvoffload --help`. The run job's ranks hold one `Offloader` each, as an
//! engine does; the tools below it (conformance, benchmarks) drive the
//! library's layers through `kvoffload::internal`.

#[cfg(not(any(loom, shuttle)))]
mod bench;
#[cfg(not(any(loom, shuttle)))]
mod cli;
#[cfg(not(any(loom, shuttle)))]
mod conform;
#[cfg(not(any(loom, shuttle)))]
mod incident;
#[cfg(not(any(loom, shuttle)))]
mod plot;
#[cfg(not(any(loom, shuttle)))]
mod random;
#[cfg(not(any(loom, shuttle)))]
mod run;

#[cfg(not(any(loom, shuttle)))]
fn main() {
    std::process::exit(cli::main());
}

/// Model builds (`--cfg loom`, `--cfg shuttle`) exist to run the models
/// under model/; the CLI needs the real driver and is not part of them.
#[cfg(any(loom, shuttle))]
fn main() {
    eprintln!("kvoffload: this binary was built for a model checker (--cfg loom or --cfg shuttle); build without it");
    std::process::exit(2);
}
