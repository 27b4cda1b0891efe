//! `kolo-sim`: kolo on up to thousands of ranks, by simulation.
//!
//! Runs kolo's own negotiation (`kolo::sim`) for a job of `--ranks` virtual ranks
//! under virtual time and prints where a step's time goes; `--sweep DIR` writes the
//! scaling tables (CSV) and plots (SVG) the README shows.

use anyhow::{bail, Context, Result};
use clap::Parser;
use kolo::sim::{simulate, Algorithm, Network, Options, StepReport};

mod plots;
mod point;
mod presets;
mod sweep;
mod workloads;

/// kolo at scale by simulation: kolo's negotiation code for N virtual ranks under
/// virtual time, data movement charged by an α–β network model.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// Ranks in the simulated job.
    #[arg(long, default_value_t = 64)]
    ranks: usize,
    /// Network: `cluster` (DGX A100 hosts, 8 GPUs on NVLink, 8 × 200 Gbit/s
    /// InfiniBand) or `here` (this machine's emulated hosts).
    #[arg(long, default_value = "cluster")]
    preset: String,
    /// `resnet50`, `bert-large`, or `tensor-64mib` (one 64 MiB tensor; with
    /// `--step-ms 0` every workload is one burst submitted at once, as the benchmark
    /// submits it).
    #[arg(long, default_value = "resnet50")]
    workload: String,
    /// Allreduce algorithm: auto, kolo, kolo-before, ring, hierarchical,
    /// hierarchical-pipelined, recursive-doubling, halving-doubling, hybrid.
    #[arg(long, default_value = "kolo")]
    algorithm: String,
    /// Report the first step (every request new, the full exchange) instead of the
    /// steady state.
    #[arg(long)]
    first_step: bool,
    /// Threads running the negotiation code (default: every rank up to 32, else 16).
    #[arg(long)]
    participants: Option<usize>,
    /// Compute per step in ms (default: the workload's published figure).
    #[arg(long)]
    step_ms: Option<f64>,
    /// Ranks per host (default: the preset's; `here`: 1).
    #[arg(long)]
    ranks_per_host: Option<usize>,
    /// `here`: the emulated link's rate in Gbit/s.
    #[arg(long, default_value_t = 1.0)]
    gbit: f64,
    /// The engine's cycle time in ms (kolo's default 1).
    #[arg(long, default_value_t = 1.0)]
    cycle_ms: f64,
    /// Fusion threshold in MiB (kolo's default 4).
    #[arg(long, default_value_t = 4.0)]
    fusion_mib: f64,
    /// Write the scaling tables and plots into this directory instead of one run.
    #[arg(long)]
    sweep: Option<std::path::PathBuf>,
}

/// The network `preset` names, with `ranks_per_host` and `gbit` applied.
fn network(preset: &str, ranks_per_host: Option<usize>, gbit: f64) -> Result<Network> {
    let mut net = match preset {
        "cluster" => presets::cluster(),
        "here" => presets::here(1, gbit),
        other => bail!("--preset {other:?}: expected `cluster` or `here`"),
    };
    if let Some(l) = ranks_per_host {
        if l == 0 {
            bail!("--ranks-per-host 0: a host holds at least one rank");
        }
        net.ranks_per_host = l;
        if preset == "cluster" {
            net.nics_per_host = l;
        }
    }
    Ok(net)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(dir) = &cli.sweep {
        return sweep::run(dir);
    }
    if cli.ranks == 0 {
        bail!("--ranks 0: a job has at least one rank");
    }
    let algorithm = Algorithm::parse(&cli.algorithm).with_context(|| {
        let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
        format!(
            "--algorithm {:?}: expected one of {}",
            cli.algorithm,
            names.join(", ")
        )
    })?;
    let workload =
        workloads::named(&cli.workload, cli.step_ms.map(|ms| ms * 1e-3)).with_context(|| {
            format!(
                "--workload {:?}: expected resnet50, bert-large or tensor-64mib",
                cli.workload
            )
        })?;
    let net = network(&cli.preset, cli.ranks_per_host, cli.gbit)?;
    let mut options = Options::new(cli.ranks, net.clone(), algorithm);
    if let Some(k) = cli.participants {
        options.participants = k;
    }
    options.cycle_time = cli.cycle_ms * 1e-3;
    options.fusion_threshold = (cli.fusion_mib * (1 << 20) as f64) as usize;
    let steps = simulate(&workload, &options)?;
    let (which, report) = if cli.first_step {
        ("first step (every request new)", &steps[0])
    } else {
        ("steady state (cache hits)", &steps[steps.len() - 1])
    };
    println!(
        "kolo-sim: {} on {} ranks ({} hosts × {}), preset {}, algorithm {}, {which}",
        workload.name,
        cli.ranks,
        net.hosts(cli.ranks),
        net.ranks_per_host.min(cli.ranks),
        cli.preset,
        algorithm.name()
    );
    print_report(report);
    println!(
        "SIM ranks={} negotiation_share={:.4} step_ms={:.3} worst_vs_bound={:.3}",
        cli.ranks,
        report.negotiation / report.time,
        report.time * 1e3,
        report.worst_vs_bound
    );
    Ok(())
}

fn print_report(r: &StepReport) {
    let ms = |s: f64| format!("{:9.3} ms", s * 1e3);
    println!("  compute        {}", ms(r.compute));
    println!(
        "  step           {}   (scaling efficiency {:.1}%)",
        ms(r.time),
        100.0 * r.compute / r.time
    );
    println!(
        "  negotiation    {}   ({:.2}% of the step over {} cycles; control messages {}; after backward {}; full exchange {} in {} cycles)",
        ms(r.negotiation),
        100.0 * r.negotiation / r.time,
        r.cycles,
        ms(r.control_network).trim(),
        ms(r.negotiation_exposed).trim(),
        ms(r.full_exchange).trim(),
        r.full_exchanges
    );
    println!("  fusion copies  {}", ms(r.copies));
    println!(
        "  data movement  {}   ({} collectives, the worst {:.2}× the α–β lower bound)",
        ms(r.data),
        r.collectives.len(),
        r.worst_vs_bound
    );
    println!("  engine idle    {}", ms(r.idle));
}
