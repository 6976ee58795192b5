//! The `kvoffload` command line. See `kvoffload --help`.

#[cfg(not(loom))]
mod cli;

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
