//! The sweep's SVG plots.

use std::path::Path;

use anyhow::{anyhow, Result};
use kolo::sim::{Algorithm, Network};
use plotters::prelude::*;

use crate::point::Point;

const COLOURS: [RGBColor; 7] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0x17, 0xbe, 0xcf),
];

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e}")
}

/// One line per (label, points) on log2-x axes, into `path`.
fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    y_range: std::ops::Range<f64>,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<()> {
    let root = SVGBackend::new(path, (820, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let xs = series.iter().flat_map(|s| s.1.iter().map(|p| p.0));
    let (lo, hi) = xs.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), y_range)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(err)?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), colour.stroke_width(2)))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, colour.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .position(SeriesLabelPosition::LowerLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Steady-state scaling efficiency against ranks, per workload and algorithm.
pub(crate) fn efficiency(path: &Path, points: &[Point]) -> Result<()> {
    let mut series = Vec::new();
    for workload in ["resnet50", "bert-large"] {
        for a in [
            Algorithm::Kolo,
            Algorithm::KoloBefore,
            Algorithm::Ring,
            Algorithm::Hierarchical,
            Algorithm::Auto,
        ] {
            let pts: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.workload == workload && p.algorithm == a)
                .map(|p| (p.ranks as f64, 100.0 * p.steady.compute / p.steady.time))
                .collect();
            if !pts.is_empty() {
                series.push((format!("{workload} {}", a.name()), pts));
            }
        }
    }
    lines(
        path,
        "Simulated scaling efficiency, DGX A100 cluster (steady state)",
        "ranks (GPUs)",
        "efficiency %",
        0.0..105.0,
        &series,
    )
}

/// Negotiation's share of a steady step and the first step's full exchange (ms).
pub(crate) fn negotiation(path: &Path, points: &[Point]) -> Result<()> {
    let mut series = Vec::new();
    for workload in ["resnet50", "bert-large"] {
        let of = |f: &dyn Fn(&Point) -> f64| -> Vec<(f64, f64)> {
            points
                .iter()
                .filter(|p| p.workload == workload && p.algorithm == Algorithm::Auto)
                .map(|p| (p.ranks as f64, f(p)))
                .collect()
        };
        series.push((
            format!("{workload}: negotiation, % of a steady step"),
            of(&|p| 100.0 * p.steady.negotiation / p.steady.time),
        ));
        series.push((
            format!("{workload}: first step's full exchanges, ms"),
            of(&|p| p.first.full_exchange * 1e3),
        ));
    }
    let top = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(1.0f64, f64::max);
    lines(
        path,
        "Negotiation at scale (kolo's own code, simulated)",
        "ranks",
        "% of step / ms",
        0.0..top * 1.1,
        &series,
    )
}

/// Each algorithm's time over the α–β lower bound, per size, at `ranks`.
pub(crate) fn versus_bound(path: &Path, net: &Network, ranks: usize, sizes: &[f64]) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = Algorithm::ALL
        .iter()
        .map(|&a| {
            let pts = sizes
                .iter()
                .map(|&s| (s, net.allreduce(a, ranks, s) / net.lower_bound(ranks, s)))
                .collect();
            (a.name().to_string(), pts)
        })
        .collect();
    lines(
        path,
        &format!("Allreduce time ÷ α–β lower bound, {ranks} ranks, DGX A100 cluster"),
        "bytes",
        "× lower bound",
        0.9..4.0,
        &series,
    )
}
