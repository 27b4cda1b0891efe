//! `--sweep DIR`: every point of the scaling study, as CSV and SVG.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use kolo::sim::{simulate, Algorithm, Options};

use crate::point::Point;
use crate::{plots, presets, workloads};

/// Job sizes simulated.
const RANKS: [usize; 10] = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096];
/// Algorithms simulated through whole steps.
const STEP_ALGORITHMS: [Algorithm; 5] = [
    Algorithm::Kolo,
    Algorithm::KoloBefore,
    Algorithm::Ring,
    Algorithm::Hierarchical,
    Algorithm::Auto,
];

/// Runs the study on the cluster preset and writes `scaling.csv`, `allreduce.csv`
/// and the plots into `dir`.
pub(crate) fn run(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let net = presets::cluster();
    let mut points = Vec::new();
    for workload in ["resnet50", "bert-large"] {
        let w = workloads::named(workload, None).context("a known workload")?;
        for algorithm in STEP_ALGORITHMS {
            for ranks in RANKS {
                let steps = simulate(&w, &Options::new(ranks, net.clone(), algorithm))?;
                let p = Point {
                    workload,
                    algorithm,
                    ranks,
                    first: steps[0].clone(),
                    steady: steps[steps.len() - 1].clone(),
                };
                eprintln!(
                    "{workload} {} {ranks}: steady {:.2} ms ({:.1}%), negotiation {:.2}%, first-step full exchange {:.1} ms",
                    algorithm.name(),
                    p.steady.time * 1e3,
                    100.0 * p.steady.compute / p.steady.time,
                    100.0 * p.steady.negotiation / p.steady.time,
                    p.first.full_exchange * 1e3
                );
                points.push(p);
            }
        }
    }
    std::fs::write(dir.join("scaling.csv"), scaling_csv(&points))?;
    let sizes: Vec<f64> = (2..=28).map(|k| f64::from(1u32 << k)).collect();
    let mut csv = String::from("ranks,bytes,algorithm,time_us,bound_us,ratio,auto_picks\n");
    for ranks in [64, 512, 4096] {
        for &s in &sizes {
            let bound = net.lower_bound(ranks, s);
            let pick = net.choose(ranks, s).0.name();
            for a in Algorithm::ALL {
                let t = net.allreduce(a, ranks, s);
                let _ = writeln!(
                    csv,
                    "{ranks},{s},{},{:.3},{:.3},{:.4},{pick}",
                    a.name(),
                    t * 1e6,
                    bound * 1e6,
                    t / bound
                );
            }
        }
    }
    std::fs::write(dir.join("allreduce.csv"), csv)?;
    plots::efficiency(&dir.join("efficiency.svg"), &points)?;
    plots::negotiation(&dir.join("negotiation.svg"), &points)?;
    plots::versus_bound(&dir.join("allreduce-vs-bound.svg"), &net, 4096, &sizes)?;
    eprintln!("wrote {}", dir.display());
    Ok(())
}

fn scaling_csv(points: &[Point]) -> String {
    let mut csv = String::from(
        "workload,algorithm,ranks,step,step_ms,compute_ms,efficiency,negotiation_ms,negotiation_share,\
         negotiation_after_backward_ms,control_messages_ms,full_exchange_ms,copies_ms,data_ms,idle_ms,\
         cycles,collectives,worst_vs_bound\n",
    );
    for p in points {
        for (step, r) in [("first", &p.first), ("steady", &p.steady)] {
            let _ = writeln!(
                csv,
                "{},{},{},{step},{:.4},{:.4},{:.4},{:.4},{:.5},{:.4},{:.4},{:.4},{:.4},{:.4},{:.4},{},{},{:.4}",
                p.workload,
                p.algorithm.name(),
                p.ranks,
                r.time * 1e3,
                r.compute * 1e3,
                r.compute / r.time,
                r.negotiation * 1e3,
                r.negotiation / r.time,
                r.negotiation_exposed * 1e3,
                r.control_network * 1e3,
                r.full_exchange * 1e3,
                r.copies * 1e3,
                r.data * 1e3,
                r.idle * 1e3,
                r.cycles,
                r.collectives.len(),
                r.worst_vs_bound
            );
        }
    }
    csv
}
