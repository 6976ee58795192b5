//! The pictures the benches and the incident write beside their tables: SVG
//! files drawn with plotters (no font or bitmap stack: SVG text is laid out
//! by the viewer).
//!
//! Two shapes cover every figure: [`lines`] (measured series against a
//! size or a count, with horizontal limits such as a link's bandwidth or a
//! baseline) and [`timeline`] (spans on lanes against time: chunks being
//! registered, capture windows, captures).

use std::path::Path;

use plotters::prelude::*;

/// One measured series: its name in the legend and its points.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A horizontal line across the chart: a limit or a baseline, named in the
/// legend.
pub struct Limit {
    pub name: String,
    pub y: f64,
}

/// What [`lines`] draws: axes' labels, whether the x axis is logarithmic
/// (sizes spanning decades), the series and the limits.
pub struct LineChart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub log_x: bool,
    pub series: &'a [Series],
    pub limits: &'a [Limit],
    /// How x values are written on the axis (e.g. sizes as KiB and MiB);
    /// `None`: as numbers.
    pub x_fmt: Option<fn(f64) -> String>,
}

const PALETTE: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(255, 187, 120),
];

fn err(path: &Path, e: impl std::fmt::Display) -> String {
    format!("drawing {}: {e}", path.display())
}

/// Where the legend covers the fewest points: the lower right (the usual
/// place, below curves that rise or stay high) unless more points lie
/// there than in the upper left (curves that start low and end high).
fn legend_corner(pts: &[(f64, f64)], x0: f64, x1: f64, y1: f64, log_x: bool) -> SeriesLabelPosition {
    let pos = |x: f64| if log_x && x0 > 0.0 && x > 0.0 { (x / x0).ln() / (x1 / x0).ln() } else { (x - x0) / (x1 - x0) };
    let (mut lower_right, mut upper_left) = (0, 0);
    for &(x, y) in pts.iter().filter(|(x, y)| x.is_finite() && y.is_finite()) {
        let (u, v) = (pos(x), if y1 > 0.0 { y / y1 } else { 0.0 });
        if u > 0.5 && v < 0.4 {
            lower_right += 1;
        } else if u < 0.5 && v > 0.6 {
            upper_left += 1;
        }
    }
    if lower_right > upper_left {
        SeriesLabelPosition::UpperLeft
    } else {
        SeriesLabelPosition::LowerRight
    }
}

/// Writes `chart` as an SVG file at `path`. An empty chart (no point at
/// all) is an error rather than an empty picture.
pub fn lines(path: &Path, chart: &LineChart<'_>) -> Result<(), String> {
    let pts: Vec<(f64, f64)> = chart.series.iter().flat_map(|s| s.points.iter().copied()).collect();
    if pts.is_empty() {
        return Err(format!("drawing {}: no points", path.display()));
    }
    let finite = |v: f64| v.is_finite();
    let (mut x0, mut x1) = (f64::MAX, f64::MIN);
    let mut y1 = f64::MIN;
    for &(x, y) in pts.iter().filter(|(x, y)| finite(*x) && finite(*y)) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    for l in chart.limits {
        y1 = y1.max(l.y);
    }
    if x0 > x1 {
        return Err(format!("drawing {}: no finite point", path.display()));
    }
    if x0 == x1 {
        x1 = x0 + 1.0;
    }
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(path, e))?;
    let mut b = ChartBuilder::on(&root);
    b.caption(chart.title, ("sans-serif", 20)).margin(16).x_label_area_size(44).y_label_area_size(60);
    // Two chart types (log or linear x): one drawing routine over both.
    let legend_at = legend_corner(&pts, x0, x1, y1, chart.log_x);
    macro_rules! draw {
        ($cc:expr) => {{
            let mut cc = $cc;
            let xf = |v: &f64| chart.x_fmt.map_or_else(|| format!("{v}"), |f| f(*v));
            cc.configure_mesh()
                .x_desc(chart.x_label)
                .y_desc(chart.y_label)
                .x_label_formatter(&xf)
                .draw()
                .map_err(|e| err(path, e))?;
            for (i, s) in chart.series.iter().enumerate() {
                let c = PALETTE[i % PALETTE.len()];
                cc.draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                    .map_err(|e| err(path, e))?
                    .label(s.name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
                cc.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled()))).map_err(|e| err(path, e))?;
            }
            for (i, l) in chart.limits.iter().enumerate() {
                let c = PALETTE[(chart.series.len() + i) % PALETTE.len()];
                let style = ShapeStyle { color: c.to_rgba(), filled: false, stroke_width: 1 };
                cc.draw_series(DashedLineSeries::new(vec![(x0, l.y), (x1, l.y)], 6, 4, style))
                    .map_err(|e| err(path, e))?
                    .label(l.name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(1)));
            }
            cc.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(legend_at)
                .draw()
                .map_err(|e| err(path, e))?;
        }};
    }
    if chart.log_x {
        draw!(b.build_cartesian_2d((x0..x1).log_scale(), 0.0..y1).map_err(|e| err(path, e))?);
    } else {
        draw!(b.build_cartesian_2d(x0..x1, 0.0..y1).map_err(|e| err(path, e))?);
    }
    root.present().map_err(|e| err(path, e))?;
    Ok(())
}

/// One span of a [`timeline`]: on lane `lane`, from `start` to `end`
/// seconds, with an optional label (drawn when the span is wide enough).
pub struct Span {
    pub lane: usize,
    pub start: f64,
    pub end: f64,
    pub label: Option<String>,
}

/// Writes spans on named lanes against time (seconds) as an SVG file:
/// lane `i` is `lanes[i]`, drawn top down; a point event is a span whose
/// `end` equals its `start` (drawn as a thin mark).
pub fn timeline(path: &Path, title: &str, lanes: &[&str], spans: &[Span]) -> Result<(), String> {
    if spans.is_empty() {
        return Err(format!("drawing {}: no spans", path.display()));
    }
    if let Some(s) = spans.iter().find(|s| s.lane >= lanes.len()) {
        return Err(format!("drawing {}: span on lane {} of {}", path.display(), s.lane, lanes.len()));
    }
    let t1 = spans.iter().map(|s| s.end).fold(0.0f64, f64::max).max(1e-3) * 1.02;
    let n = lanes.len();
    let root = SVGBackend::new(path, (1000, 120 + 50 * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(path, e))?;
    let mut cc = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(170)
        .build_cartesian_2d(0.0..t1, 0.0..n as f64)
        .map_err(|e| err(path, e))?;
    let lane_of = |y: f64| {
        let i = y.floor() as usize;
        // Lane 0 at the top.
        n.checked_sub(1 + i).and_then(|l| lanes.get(l)).map_or(String::new(), |s| s.to_string())
    };
    cc.configure_mesh()
        .x_desc("seconds")
        .y_labels(n * 2 + 1)
        .y_label_formatter(&|y| if (y.fract() - 0.5).abs() < 0.01 { lane_of(*y) } else { String::new() })
        .disable_y_mesh()
        .draw()
        .map_err(|e| err(path, e))?;
    for s in spans {
        let c = PALETTE[s.lane % PALETTE.len()];
        let top = (n - s.lane) as f64 - 0.15;
        let bottom = (n - 1 - s.lane) as f64 + 0.15;
        let end = if s.end > s.start { s.end } else { s.start + t1 / 1000.0 };
        cc.draw_series(std::iter::once(Rectangle::new([(s.start, bottom), (end, top)], c.mix(0.7).filled())))
            .map_err(|e| err(path, e))?;
        if let Some(l) = &s.label {
            if (s.end - s.start) > t1 / 25.0 {
                cc.draw_series(std::iter::once(Text::new(
                    l.clone(),
                    (s.start + (s.end - s.start) * 0.02, (top + bottom) / 2.0),
                    ("sans-serif", 12),
                )))
                .map_err(|e| err(path, e))?;
            }
        }
    }
    root.present().map_err(|e| err(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_legend_goes_where_the_points_are_not() {
        // Curves low on the right (a projection under a steep baseline):
        // the legend moves to the upper left.
        let low_right: Vec<(f64, f64)> = (1..=10).map(|k| (k as f64 * 100.0, 5.0)).chain([(1000.0, 400.0)]).collect();
        assert!(matches!(legend_corner(&low_right, 100.0, 1000.0, 400.0, true), SeriesLabelPosition::UpperLeft));
        // Curves high on the right: the usual lower right.
        let high_right: Vec<(f64, f64)> = (1..=10).map(|k| (k as f64, 10.0 * k as f64)).collect();
        assert!(matches!(legend_corner(&high_right, 1.0, 10.0, 100.0, false), SeriesLabelPosition::LowerRight));
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("kvoffload-plot-{}-{name}.svg", std::process::id()))
    }

    #[test]
    fn a_line_chart_has_every_series_and_limit_in_its_legend() {
        let p = tmp("lines");
        let series = [
            Series { name: "gather".into(), points: vec![(4096.0, 10.0), (65536.0, 40.0), (1048576.0, 52.0)] },
            Series { name: "batched".into(), points: vec![(4096.0, 5.0), (1048576.0, 50.0)] },
        ];
        let limits = [Limit { name: "link 55 GB/s".into(), y: 55.0 }];
        let c = LineChart {
            title: "copies",
            x_label: "fragment bytes",
            y_label: "GB/s",
            log_x: true,
            series: &series,
            limits: &limits,
            x_fmt: Some(|v| format!("{} KiB", v / 1024.0)),
        };
        lines(&p, &c).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        let _ = std::fs::remove_file(&p);
        for want in ["<svg", "gather", "batched", "link 55 GB/s", "fragment bytes", "copies", " KiB\n"] {
            assert!(svg.contains(want), "{want} missing from the picture");
        }
        // Two polylines for the series, one for the limit.
        assert!(svg.matches("<polyline").count() >= 3, "{svg}");
    }

    #[test]
    fn an_empty_chart_is_an_error_not_an_empty_picture() {
        let p = tmp("empty");
        let c =
            LineChart { title: "t", x_label: "x", y_label: "y", log_x: false, series: &[], limits: &[], x_fmt: None };
        assert!(lines(&p, &c).unwrap_err().contains("no points"));
        assert!(timeline(&p, "t", &["a"], &[]).unwrap_err().contains("no spans"));
        let bad = [Span { lane: 3, start: 0.0, end: 1.0, label: None }];
        assert!(timeline(&p, "t", &["a"], &bad).unwrap_err().contains("lane 3 of 1"));
        assert!(!p.exists());
    }

    #[test]
    fn a_timeline_draws_a_rectangle_per_span_and_names_its_lanes() {
        let p = tmp("timeline");
        let spans = [
            Span { lane: 0, start: 0.0, end: 0.5, label: Some("chunk 0".into()) },
            Span { lane: 0, start: 0.6, end: 1.0, label: None },
            Span { lane: 1, start: 0.5, end: 0.6, label: None },
            Span { lane: 2, start: 0.55, end: 0.55, label: None },
        ];
        timeline(&p, "incident", &["registrations", "windows", "captures"], &spans).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        let _ = std::fs::remove_file(&p);
        for want in ["registrations", "windows", "captures", "chunk 0", "incident"] {
            assert!(svg.contains(want), "{want} missing from the picture");
        }
        // The background, then one rectangle per span.
        assert!(svg.matches("<rect").count() > spans.len(), "{svg}");
    }
}
