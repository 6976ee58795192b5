//! `kvoffload incident`: the seed incident (background pinning racing graph
//! capture), with upstream's design and with ours, on the same machine.

use crate::incident::{run as run_design, Design, IncidentConfig, IncidentReport};
use crate::plot::{timeline, Span};
use clap::ValueEnum;

use super::backend::{self, BackendArg};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DesignArg {
    All,
    Upstream,
    Windowed,
    Interleaved,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// Host region size.
    #[arg(long, default_value = "16GiB", value_parser = backend::parse_size)]
    size: usize,
    /// Registration unit of the background pinner.
    #[arg(long, default_value = "256MiB", value_parser = backend::parse_size)]
    chunk: usize,
    /// How long each capture stays open, in milliseconds.
    #[arg(long, default_value_t = 100)]
    capture_ms: u64,
    /// Which design(s) to run.
    #[arg(long, value_enum, default_value_t = DesignArg::All)]
    design: DesignArg,
    /// Also draw each design's interleaving in this directory
    /// (incident-<design>.svg): chunk registrations, capture windows and
    /// captures against time.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
}

/// One design's timeline as a picture.
fn draw(dir: &std::path::Path, d: Design, r: &IncidentReport) -> Result<std::path::PathBuf, String> {
    super::svg_dir(dir)?;
    let tl = &r.timeline;
    let mut spans: Vec<Span> = Vec::new();
    spans.extend(tl.registrations.iter().map(|&(a, b)| Span { lane: 0, start: a, end: b, label: None }));
    spans.extend(tl.windows.iter().map(|&(a, b)| Span { lane: 1, start: a, end: b, label: None }));
    spans.extend(tl.captures.iter().map(|&(a, b, ok)| Span {
        lane: if ok { 2 } else { 3 },
        start: a,
        end: b,
        label: None,
    }));
    let key = match d {
        Design::Upstream => "upstream",
        Design::Windowed => "windowed",
        Design::Interleaved => "interleaved",
    };
    let path = dir.join(format!("incident-{key}.svg"));
    let title = format!(
        "{}: {} of {} captures ok, pin {} in {:.2} s",
        d.name(),
        r.captures_ok,
        r.captures,
        r.pin_state,
        r.pin_seconds
    );
    let lanes = ["chunk registrations", "capture windows", "captures, graph made", "captures invalidated"];
    timeline(&path, &title, &lanes, &spans)?;
    Ok(path)
}

pub fn run(a: Args) -> Result<i32, String> {
    if a.size == 0 || a.chunk == 0 {
        return Err("--size and --chunk must be greater than zero".into());
    }
    let rt = backend::open(a.backend)?;
    println!("incident reproduction on {}: {} GiB region, {} MiB chunks", rt.describe(), a.size >> 30, a.chunk >> 20);
    let designs: &[Design] = match a.design {
        DesignArg::All => &[Design::Upstream, Design::Windowed, Design::Interleaved],
        DesignArg::Upstream => &[Design::Upstream],
        DesignArg::Windowed => &[Design::Windowed],
        DesignArg::Interleaved => &[Design::Interleaved],
    };
    let cfg = IncidentConfig {
        region_bytes: a.size,
        chunk_bytes: a.chunk,
        capture: std::time::Duration::from_millis(a.capture_ms),
        ..IncidentConfig::default()
    };
    let mut ours_clean = true;
    for &d in designs {
        let r = run_design(rt.clone(), d, &cfg)?;
        println!("{r}");
        if let Some(dir) = &a.svg {
            println!("  picture: {}", draw(dir, d, &r)?.display());
        }
        match d {
            Design::Upstream if r.clean() => {
                println!("  note: no registration landed inside a capture this time (the race is timing-dependent)")
            }
            Design::Upstream => {
                println!("  => the seed's failure: captures invalidated by the background registration")
            }
            _ => ours_clean &= r.clean(),
        }
    }
    Ok(if ours_clean { 0 } else { 1 })
}
