//! `kvoffload bench pin`: the pinning benchmark (library part in
//! [`crate::bench::pin`]).

use crate::bench::pin::{self, BenchConfig, Progress};
use kvoffload::units::parse_size;

use super::backend::{open, BackendArg};

/// Options of `kvoffload bench pin`.
#[derive(clap::Args, Debug)]
pub struct PinArgs {
    /// Bytes pinned per run, e.g. 16GiB, 512MiB, 1G (K/M/G/T = KiB/MiB/GiB/TiB; KB/MB/GB/TB are decimal).
    #[arg(long, default_value = "16GiB", value_parser = parse_size)]
    size: usize,
    /// Which runtime registers the memory.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Pre-fault thread counts of the sweep, comma separated [default: 1,4,<available cores>].
    #[arg(long, value_delimiter = ',')]
    threads_sweep: Option<Vec<usize>>,
    /// Pre-fault threads of the default pipeline (b) [default: available cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Bound of one registration call for (b) and the thread sweep [default: the library default, 256MiB].
    #[arg(long, value_parser = parse_size)]
    chunk: Option<usize>,
    /// Chunk bounds of the sweep, comma separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "256MiB,1GiB,4GiB")]
    chunk_sweep: Vec<usize>,
    /// Skip the sweep: only (a) and (b).
    #[arg(long)]
    quick: bool,
    /// Runs of (a) and (b) each; the ratio uses their medians.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Do not map, pre-fault and unmap the size once before measuring.
    #[arg(long)]
    no_warmup: bool,
}

/// Runs the bench and prints its report on stdout (progress on stderr).
pub fn run(a: PinArgs) -> Result<i32, String> {
    let mut cfg = BenchConfig::new(a.size);
    if let Some(t) = a.threads_sweep {
        let mut t = t;
        t.sort_unstable();
        t.dedup();
        cfg.threads_sweep = t;
    }
    if let Some(t) = a.threads {
        cfg.threads = t;
    }
    if let Some(c) = a.chunk {
        cfg.chunk = c;
    }
    cfg.chunk_sweep = a.chunk_sweep;
    cfg.quick = a.quick;
    cfg.repeat = a.repeat;
    cfg.warmup = !a.no_warmup;
    cfg.validate()?;
    let rt = open(a.backend)?;

    let style = indicatif::ProgressStyle::with_template(
        "{prefix:<62} [{bar:30}] {bytes:>10}/{total_bytes:<10} {elapsed_precise}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
    .progress_chars("=> ");
    let current: kvoffload::sync::Mutex<Option<indicatif::ProgressBar>> = kvoffload::sync::Mutex::new(None);
    let progress = |p: Progress| {
        let mut cur = current.lock().unwrap_or_else(|e| e.into_inner());
        match p {
            Progress::Start { label, bytes } => {
                let bar =
                    indicatif::ProgressBar::with_draw_target(Some(bytes), indicatif::ProgressDrawTarget::stderr());
                bar.set_style(style.clone());
                bar.set_prefix(label);
                bar.enable_steady_tick(std::time::Duration::from_millis(200));
                *cur = Some(bar);
            }
            Progress::Advance { bytes } => {
                if let Some(b) = cur.as_ref() {
                    b.set_position(bytes);
                }
            }
            Progress::Finish => {
                if let Some(b) = cur.take() {
                    b.finish_and_clear();
                }
            }
        }
    };
    let report = pin::run(rt.as_ref(), &cfg, &progress)?;
    println!("{report}");
    Ok(0)
}
