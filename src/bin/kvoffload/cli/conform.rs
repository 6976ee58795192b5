//! `kvoffload conform`: the conformance table.

use crate::conform::{self, Backend};
use clap::ValueEnum;

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// The simulated GPU (no driver needed).
    Sim,
    /// The real GPU through the CUDA driver.
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Which runtime to check.
    #[arg(long, value_enum, default_value_t = BackendArg::Sim)]
    backend: BackendArg,
    /// Only scenarios whose name contains this text.
    #[arg(long)]
    only: Option<String>,
    /// Also write the table as markdown to this file.
    #[arg(long)]
    markdown: Option<std::path::PathBuf>,
}

pub fn run(a: Args) -> Result<i32, String> {
    let backend = match a.backend {
        BackendArg::Sim => Backend::Sim,
        BackendArg::Cuda => Backend::Real(super::backend::open(super::backend::BackendArg::Cuda)?),
    };
    let bar = indicatif::ProgressBar::new(conform::scenarios().len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let report = conform::run(&backend, a.only.as_deref(), |id| {
        bar.set_message(id.to_string());
        bar.inc(1);
    });
    bar.finish_and_clear();
    if report.rows.is_empty() {
        return Err(format!("no scenario matches --only {:?}", a.only.unwrap_or_default()));
    }
    println!("{report}");
    if let Some(path) = &a.markdown {
        std::fs::write(path, report.markdown()).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(if report.mismatches() == 0 { 0 } else { 1 })
}
