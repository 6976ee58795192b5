//! `kvoffload bench pin-project`: pinning time at 256 GiB - 1 TiB per node,
//! projected from measured sizes, checked against each of them.
//!
//! The model. The pipeline's two stages (pre-faulting, registering) run
//! side by side, so the time to pin `S` bytes is a fixed part (mapping,
//! the first chunk's faults and the last chunk's registration, thread
//! start) plus `S` over the rate the pipeline sustains, which is bounded by
//! the slower stage:
//!
//! ```text
//! t(S) = t0 + S / (eff * min(P, R))
//! ```
//!
//! with `P` and `R` the pre-fault and registration rates measured apart
//! (medians over the sizes), `eff` how close the pipeline comes to that
//! bound, and `t0` the fixed part. `t0` and `eff` are fitted by least
//! squares on the measured (size, seconds) points of the defaults; every
//! measured size is then predicted back and its error printed, and the
//! projection fails (exit 1) when one is off by more than the tolerance,
//! so a model that does not describe the measurements is not projected.
//!
//! Thread scaling: `P` grows with pre-fault threads until memory bandwidth
//! (about 4.9 GB/s a thread on the H200: 19.4 GB/s with 4 threads, 5.4 with
//! 1, `docs/driver-rules.md`, row "Pre-fault threads and huge pages") and
//! `R` is one registering thread's rate (the loop registers from one
//! thread): a node with more cores does not register faster, so the
//! projection keeps `R`, and says how many pre-fault threads keep `P` at or
//! above it.
//!
//! Chunk size and the driver's limits: chunks stay at the default bound
//! (256 MiB; 4096 registrations for 1 TiB). One registration of 512 GiB or
//! more fails with out-of-memory (vLLM #51080/#51081), and kvoffload refuses
//! a chunk bound above 64 GiB (`MAX_CHUNK_LIMIT`), so no chunk comes near
//! it; the one-call baseline at those sizes is vLLM's own chunked
//! synchronous registration (64 GiB calls) at the one-call rate.
//!
//! Two bounds are printed beside the projection: the slowest case, 4 KiB
//! pages for the whole region (what the huge-page fallback gives near the
//! memory limit), and the upstream baseline.

use std::fmt;
use std::path::Path;

use kvoffload::units::{fmt_bytes, parse_size};

use super::pin::median;

/// One measured size: GB/s (1e9 bytes/s) of the defaults, of pre-faulting
/// and registering apart, of the one-call baseline and of 4 KiB pages.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Point {
    /// Bytes of the region.
    pub size: usize,
    /// The defaults, end to end.
    pub defaults: f64,
    /// Pre-faulting alone.
    pub prefault: f64,
    /// Registering alone.
    pub register: f64,
    /// One `cuMemHostRegister` over untouched memory.
    pub one_call: f64,
    /// The defaults with 4 KiB pages.
    pub small_pages: f64,
}

/// The committed H200 medians the projection uses when none are given:
/// 16 and 64 GiB from `docs/gpu-runs/2026-12-02-pin-sizes/call3/bench-pin-sizes.log`
/// (median of three warm rounds); 96 GiB from the same day's runs:
/// the defaults after one call in a fresh process
/// (`call3/bench-pin-pressure-after-one-call-defaults.log`, one run), the
/// stages and the baseline from `call2-old-order/bench-pin-sizes.log`
/// (medians of three), 4 KiB pages from
/// `call3/bench-pin-pressure-after-one-call-huge-off.log`.
pub const H200_2026_12_02: [Point; 3] = [
    Point { size: 16 << 30, defaults: 36.27, prefault: 34.82, register: 40.82, one_call: 2.79, small_pages: 21.07 },
    Point { size: 64 << 30, defaults: 36.41, prefault: 36.46, register: 40.53, one_call: 2.84, small_pages: 21.55 },
    Point { size: 96 << 30, defaults: 36.43, prefault: 31.26, register: 36.25, one_call: 2.59, small_pages: 21.90 },
];

/// Pre-fault GB/s a thread adds on the H200 (4 threads: 19.41 GB/s,
/// `docs/driver-rules.md`, row "Pre-fault threads and huge pages").
pub const PREFAULT_GBPS_PER_THREAD: f64 = 19.41 / 4.0;

/// Parses `SIZE:DEFAULTS:PREFAULT:REGISTER:ONECALL:SMALLPAGES` (GB/s), e.g.
/// `16GiB:36.27:34.82:40.82:2.79:21.07`.
pub fn parse_point(s: &str) -> Result<Point, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [size, d, p, r, o, h] = parts.as_slice() else {
        return Err(format!(
            "--point {s:?}: expected SIZE:DEFAULTS:PREFAULT:REGISTER:ONECALL:SMALLPAGES (GB/s), e.g. 16GiB:36.3:34.8:40.8:2.8:21.1"
        ));
    };
    let gbps = |what: &str, v: &str| -> Result<f64, String> {
        match v.parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(format!("--point {s:?}: {what} {v:?} is not a positive GB/s figure")),
        }
    };
    Ok(Point {
        size: parse_size(size).map_err(|e| format!("--point {s:?}: {e}"))?,
        defaults: gbps("the defaults", d)?,
        prefault: gbps("pre-fault", p)?,
        register: gbps("register", r)?,
        one_call: gbps("one call", o)?,
        small_pages: gbps("4 KiB pages", h)?,
    })
}

/// The fitted model.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Model {
    /// Fixed seconds.
    pub t0: f64,
    /// Seconds per byte.
    pub per_byte: f64,
    /// Median pre-fault GB/s.
    pub prefault: f64,
    /// Median registration GB/s.
    pub register: f64,
    /// Median one-call GB/s.
    pub one_call: f64,
    /// Median 4 KiB-page GB/s.
    pub small_pages: f64,
}

impl Model {
    /// Fits `t = t0 + per_byte * S` on the defaults' seconds (least squares;
    /// `t0` is kept at or above 0). At least two distinct sizes.
    pub fn fit(points: &[Point]) -> Result<Model, String> {
        let mut sizes: Vec<usize> = points.iter().map(|p| p.size).collect();
        sizes.sort_unstable();
        sizes.dedup();
        if sizes.len() < 2 {
            return Err("the projection needs measurements at two sizes or more".into());
        }
        let xs: Vec<f64> = points.iter().map(|p| p.size as f64).collect();
        let ts: Vec<f64> = points.iter().map(|p| p.size as f64 / (p.defaults * 1e9)).collect();
        let n = xs.len() as f64;
        let (mx, mt) = (xs.iter().sum::<f64>() / n, ts.iter().sum::<f64>() / n);
        let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
        let sxt: f64 = xs.iter().zip(&ts).map(|(x, t)| (x - mx) * (t - mt)).sum();
        let mut per_byte = sxt / sxx;
        let mut t0 = mt - per_byte * mx;
        if t0 < 0.0 || per_byte <= 0.0 {
            // No fixed part: the line through the origin.
            t0 = 0.0;
            per_byte = xs.iter().zip(&ts).map(|(x, t)| x * t).sum::<f64>() / xs.iter().map(|x| x * x).sum::<f64>();
        }
        // `points` is not empty (two sizes or more, checked above).
        let med = |f: fn(&Point) -> f64| median(points.iter().map(f).collect()).unwrap_or(f64::NAN);
        Ok(Model {
            t0,
            per_byte,
            prefault: med(|p| p.prefault),
            register: med(|p| p.register),
            one_call: med(|p| p.one_call),
            small_pages: med(|p| p.small_pages),
        })
    }

    /// Seconds to pin `size` bytes with the defaults.
    pub fn seconds(&self, size: usize) -> f64 {
        self.t0 + self.per_byte * size as f64
    }

    /// The stage bound, GB/s.
    pub fn bound(&self) -> f64 {
        self.prefault.min(self.register)
    }

    /// How close the fitted pipeline comes to the stage bound.
    pub fn efficiency(&self) -> f64 {
        1.0 / (self.per_byte * self.bound() * 1e9)
    }
}

/// The projection's result.
#[derive(Clone, Debug)]
pub struct Projection {
    /// The measurements.
    pub points: Vec<Point>,
    /// The model fitted on them.
    pub model: Model,
    /// The sizes projected to.
    pub sizes: Vec<usize>,
    /// Largest error allowed at a measured size, in percent.
    pub tolerance_pct: f64,
}

impl Projection {
    /// Fits and projects.
    pub fn new(points: Vec<Point>, sizes: Vec<usize>, tolerance_pct: f64) -> Result<Projection, String> {
        let model = Model::fit(&points)?;
        Ok(Projection { points, model, sizes, tolerance_pct })
    }

    /// Per measured size: (size, measured s, predicted s, error %).
    pub fn checks(&self) -> Vec<(usize, f64, f64, f64)> {
        self.points
            .iter()
            .map(|p| {
                let measured = p.size as f64 / (p.defaults * 1e9);
                let predicted = self.model.seconds(p.size);
                (p.size, measured, predicted, (predicted - measured) / measured * 100.0)
            })
            .collect()
    }

    /// Whether every measured size is predicted within the tolerance.
    pub fn holds(&self) -> bool {
        self.checks().iter().all(|c| c.3.abs() <= self.tolerance_pct)
    }

    /// Writes seconds against size (GiB, logarithmic): the model from the
    /// smallest measured size to the largest projected one, the measured
    /// points, 4 KiB pages and the one-call baseline.
    pub fn write_svg(&self, path: &Path) -> Result<(), String> {
        use crate::plot::{lines, LineChart, Series};
        let gib = |s: usize| s as f64 / (1u64 << 30) as f64;
        let lo = self.points.iter().map(|p| p.size).min().unwrap_or(16 << 30);
        let hi = self.sizes.iter().chain(self.points.iter().map(|p| &p.size)).copied().max().unwrap_or(lo);
        let steps = 24;
        let grid: Vec<usize> =
            (0..=steps).map(|k| (lo as f64 * (hi as f64 / lo as f64).powf(k as f64 / steps as f64)) as usize).collect();
        let curve = |f: &dyn Fn(usize) -> f64| grid.iter().map(|&s| (gib(s), f(s))).collect::<Vec<_>>();
        let m = self.model;
        let series = vec![
            Series { name: "kvoffload defaults, model".into(), points: curve(&|s| m.seconds(s)) },
            Series {
                name: "kvoffload defaults, measured".into(),
                points: self.points.iter().map(|p| (gib(p.size), p.size as f64 / (p.defaults * 1e9))).collect(),
            },
            Series {
                name: "4 KiB pages throughout (the fallback's floor)".into(),
                points: curve(&|s| s as f64 / (m.small_pages * 1e9)),
            },
            Series {
                name: "upstream: one call (64 GiB calls from 512 GiB)".into(),
                points: curve(&|s| s as f64 / (m.one_call * 1e9)),
            },
        ];
        lines(
            path,
            &LineChart {
                title: "Pinning time per node, projected from the H200 measurements",
                x_label: "region size (GiB, log scale)",
                y_label: "seconds to pinned",
                log_x: true,
                series: &series,
                limits: &[],
                x_fmt: Some(|x| format!("{x:.0}")),
            },
        )
    }
}

impl fmt::Display for Projection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.model;
        writeln!(f, "kvoffload bench pin-project: t(S) = t0 + S / (eff * min(pre-fault, register))")?;
        writeln!(
            f,
            "fitted on {} sizes: t0 {:.3} s, {:.2} GB/s sustained; stage medians pre-fault {:.2}, register {:.2} GB/s: \
             eff {:.0}% of the bound {:.2}",
            self.points.len(),
            m.t0,
            1.0 / (m.per_byte * 1e9),
            m.prefault,
            m.register,
            m.efficiency() * 100.0,
            m.bound()
        )?;
        writeln!(f)?;
        writeln!(f, "checked against every measured size (tolerance {:.0}%):", self.tolerance_pct)?;
        for (size, measured, predicted, err) in self.checks() {
            let ok = if err.abs() <= self.tolerance_pct { "ok" } else { "OFF" };
            writeln!(
                f,
                "  {:>8}: measured {measured:.2} s, model {predicted:.2} s ({err:+.1}%) {ok}",
                fmt_bytes(size).replace(' ', "")
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "{:>8} {:>9} {:>9} {:>8} {:>19} {:>17} {:>9}",
            "size", "model s", "GB/s", "chunks", "4 KiB pages s", "one call s", "speed-up"
        )?;
        for &s in &self.sizes {
            let t = m.seconds(s);
            let small = s as f64 / (m.small_pages * 1e9);
            let one = s as f64 / (m.one_call * 1e9);
            writeln!(
                f,
                "{:>8} {t:>9.1} {:>9.2} {:>8} {small:>19.1} {one:>17.1} {:>8.1}x",
                fmt_bytes(s).replace(' ', ""),
                s as f64 / t / 1e9,
                s.div_ceil(kvoffload::internal::pin::DEFAULT_MAX_CHUNK_BYTES),
                one / t
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "limits: one registration thread ({:.1} GB/s) bounds the pipeline whatever the cores; pre-fault threads \
             to keep up with it: {} at {:.2} GB/s a thread; chunks of {} (every registration far below the 64 GiB cap \
             and the 512 GiB single-call failure of vLLM #51080); the region must fit in the node's memory (near its \
             limit huge pages stall and the fallback runs at the 4 KiB column)",
            m.register,
            (m.register / PREFAULT_GBPS_PER_THREAD).ceil(),
            PREFAULT_GBPS_PER_THREAD,
            fmt_bytes(kvoffload::internal::pin::DEFAULT_MAX_CHUNK_BYTES)
        )?;
        if !self.holds() {
            write!(f, "THE MODEL DOES NOT HOLD: a measured size is off by more than {:.0}%", self.tolerance_pct)?;
        } else {
            write!(f, "the model holds at every measured size")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_points_fit_and_project_a_tebibyte_in_about_half_a_minute() {
        let p = Projection::new(H200_2026_12_02.to_vec(), vec![256 << 30, 512 << 30, 1 << 40], 10.0).unwrap();
        assert!(p.holds(), "{p}");
        let t = p.model.seconds(1 << 40);
        assert!(t > 20.0 && t < 45.0, "{t}");
        let text = p.to_string();
        assert!(text.contains("the model holds"), "{text}");
        assert!(text.contains("1TiB") || text.contains("1024GiB"), "{text}");
    }

    #[test]
    fn a_size_the_model_cannot_describe_fails_the_check() {
        // 64 GiB four times slower than the others: no line fits all three.
        let mut pts = H200_2026_12_02.to_vec();
        pts[1].defaults /= 4.0;
        let p = Projection::new(pts, vec![1 << 40], 10.0).unwrap();
        assert!(!p.holds());
        assert!(p.to_string().contains("THE MODEL DOES NOT HOLD"), "{p}");
        assert!(p.to_string().contains("OFF"), "{p}");
    }

    #[test]
    fn points_parse_and_bad_ones_are_named() {
        let p = parse_point("16GiB:36.27:34.82:40.82:2.79:21.07").unwrap();
        assert_eq!(p, H200_2026_12_02[0]);
        assert!(parse_point("16GiB:36").unwrap_err().contains("expected SIZE"));
        assert!(parse_point("16GiB:x:1:1:1:1").unwrap_err().contains("the defaults"));
        assert!(parse_point("16GiB:1:1:1:0:1").unwrap_err().contains("one call"));
        assert!(Model::fit(&[H200_2026_12_02[0]]).unwrap_err().contains("two sizes"));
    }

    #[test]
    fn a_fixed_part_shows_as_slower_small_sizes() {
        // 1 s fixed + 40 GB/s: 16 GiB at 11.9 GB/s, 64 GiB at 25.3.
        let pt = |size: usize| {
            let t = 1.0 + size as f64 / 40e9;
            Point {
                size,
                defaults: size as f64 / t / 1e9,
                prefault: 40.0,
                register: 50.0,
                one_call: 3.0,
                small_pages: 20.0,
            }
        };
        let m = Model::fit(&[pt(16 << 30), pt(64 << 30)]).unwrap();
        assert!((m.t0 - 1.0).abs() < 1e-6, "{m:?}");
        assert!((1.0 / (m.per_byte * 1e9) - 40.0).abs() < 1e-6, "{m:?}");
        assert!((m.efficiency() - 1.0).abs() < 1e-6);
    }
}
