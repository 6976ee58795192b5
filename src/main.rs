//! The `kvoffload` command line. See `kvoffload --help`.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
