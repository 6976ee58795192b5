//! Command-line front end: argument parsing, logging set-up, and one module
//! per subcommand. Every failure ends as one line on stderr and a non-zero
//! exit status, never a panic.

mod backend;
mod bench;
mod bench_pin;
mod bench_transfer;
mod conform;
mod incident;
mod pool;
mod run;

use clap::{Parser, Subcommand};

/// Makes the `--svg` directory of a command (and its parents); the error
/// names the option.
fn svg_dir(dir: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("--svg {}: {e}", dir.display()))
}

/// `--svg DIR`: `draw` writes one picture at `DIR/name` (the directory made
/// first, as [`svg_dir`]), then its path is printed.
fn picture(
    dir: &std::path::Path,
    name: &str,
    draw: impl FnOnce(&std::path::Path) -> Result<(), String>,
) -> Result<(), String> {
    svg_dir(dir)?;
    let path = dir.join(name);
    draw(&path)?;
    println!("picture: {}", path.display());
    Ok(())
}

/// Offload LLM KV-cache blocks between GPU memory and a pinned host region.
#[derive(Parser, Debug)]
#[command(name = "kvoffload", version, about)]
struct Cli {
    /// More log output on stderr (-v info, -vv debug: every driver call).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The main job: N rank processes share one region, pin it in the
    /// background, capture graphs through capture windows, agree on the pin
    /// state, then store and load KV blocks through the block manager and
    /// the transfer engine, checking every loaded block byte for byte.
    Run(run::Args),
    /// Re-measure the driver rules of docs/driver-rules.md on a backend and
    /// print expected against observed, one row a scenario.
    Conform(conform::Args),
    /// Benchmarks, each against its baseline in the same run.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Reproduce the seed incident: background pinning racing GLOBAL graph
    /// capture, with upstream's design and with the capture window.
    Incident(incident::Args),
    /// The node pools of a directory: list them, remove one.
    #[command(subcommand)]
    Pool(pool::Pool),
}

/// Exit status: 0 success, 1 a check failed (mismatch), 2 usage or
/// environment error.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => return usage_error(e),
    };
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Run(a) => run::run(a, cli.verbose),
        Command::Conform(a) => conform::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Incident(a) => incident::run(a),
        Command::Pool(p) => pool::run(p),
    };
    match result {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("kvoffload: {msg}");
            2
        }
    }
}

/// Help and version print as clap formats them; every other parse error is
/// folded into one line.
fn usage_error(e: clap::Error) -> i32 {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return 0;
    }
    let text = e.to_string();
    let line: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("For more information") && !l.starts_with("Usage:"))
        .collect();
    eprintln!("kvoffload: {}", line.join(" ").trim_start_matches("error: "));
    2
}

fn init_logging(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "warn",
        1 => "kvoffload=info",
        _ => "kvoffload=debug",
    };
    let filter = EnvFilter::try_from_env("KVOFFLOAD_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}
