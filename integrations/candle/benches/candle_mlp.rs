//! kolo-candle against plain candle: the MLPs of kolo-burn's benchmark (784-512-512-10,
//! 0.67 M parameters; 784-2048-2048-2048-10, 10.0 M), a synthetic batch of 64 per
//! rank, SGD with lr 0.01, one compute thread per rank (`RAYON_NUM_THREADS=1`).
//!
//! Each repetition launches, in turn, the plain candle program
//! (`benches/baseline/plain_mlp.rs`, one process, no kolo) and kolo-candle's ranks
//! (`DistributedOptimizer` around the same SGD) under `mpirun -np 1` and `-np 2`.
//! Alternating the launches lets load drifting on a shared machine hit both sides
//! alike. Printed per model: steps/s (median and range), the share of a step spent
//! reducing, and per-rank steps/s ÷ plain candle's of the same repetition.
//!
//! ```sh
//! ./scripts/run-candle-bench.sh     # KOLO_BENCH_REPS=N (default 5), --model small|big
//! ```
//! Without `--bench` (as `cargo test --all-targets` runs it) it makes one short smoke
//! run of the small model.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_nn::{Optimizer, VarMap, SGD};
use kolo_candle::{broadcast_parameters, DistributedOptimizer};

#[path = "common/mlp.rs"]
mod mlp;

#[path = "../../shared/bench.rs"]
mod bench;
use bench::{result_of, show, PLAIN_MALLOC};

#[path = "../../../tests/collectives/harness.rs"]
#[allow(dead_code)]
mod harness;

/// One rank of kolo's side: prints `RESULT steps_per_s=…` on rank 0.
fn worker(model: &str, warmup: usize, steps: usize) -> Result<()> {
    let dims = mlp::dims(model).ok_or_else(|| anyhow::anyhow!("unknown model {model:?}"))?;
    let kolo = kolo::init()?;
    let varmap = VarMap::new();
    let net = mlp::Mlp::new(dims, &varmap)?;
    broadcast_parameters(&kolo, &varmap, 0)?;
    let mut opt = DistributedOptimizer::new(
        &kolo,
        SGD::new(varmap.all_vars(), mlp::LR)?,
        varmap.all_vars(),
    )?;
    // Each rank its own batch, as in data-parallel training.
    let data = mlp::batch(kolo.rank(), dims, mlp::BATCH)?;
    let rate = mlp::steps_per_s(&net, &mut opt, &data, warmup, steps)?;
    // The share of a step spent reducing: the same steps again, reduction timed apart.
    let mut comm = Duration::ZERO;
    let start = Instant::now();
    for _ in 0..steps {
        let grads = net.loss(&data.0, &data.1)?.backward()?;
        let t = Instant::now();
        let reduced = opt.reduce(&grads)?;
        comm += t.elapsed();
        opt.inner_mut().step(&reduced)?;
    }
    let share = comm.as_secs_f64() / start.elapsed().as_secs_f64();
    if kolo.rank() == 0 {
        println!("RESULT steps_per_s={rate:.4} comm_share={share:.4}");
    }
    kolo.shutdown()?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| bench::arg(&args, k);
    let count = |k: &str, default: usize| arg(k).and_then(|v| v.parse().ok()).unwrap_or(default);
    if let Some(model) = arg("--worker") {
        return worker(&model, count("--warmup", 3), count("--steps", 20));
    }
    let bench::Plan {
        smoke,
        reps,
        models,
    } = bench::plan(&args);
    let exe = std::env::current_exe()?;
    // Cargo builds the package's binaries before its benchmarks and gives their paths.
    let plain = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kolo-candle-plain-mlp"));
    let nps = ["1", "2"];
    for model in &models {
        let (warmup, steps) = match (smoke, model.as_str()) {
            (true, _) => (1, 3),
            (false, "big") => (3, 20),
            (false, _) => (20, 300),
        };
        let counts = [warmup.to_string(), steps.to_string()];
        let mut plain_sps = Vec::new();
        let mut kolo: [Vec<f64>; 2] = Default::default();
        let mut comm: [Vec<f64>; 2] = Default::default();
        let started = Instant::now();
        for rep in 0..reps {
            let mut cmd = Command::new(&plain);
            cmd.env("GLIBC_TUNABLES", PLAIN_MALLOC);
            cmd.arg(model).args(&counts);
            plain_sps.push(result_of(cmd, "plain candle", &["steps_per_s"])?[0]);
            for (n, &np) in nps.iter().enumerate() {
                let mut cmd = Command::new("mpirun");
                cmd.args(["-np", np, "--bind-to", "none"]).arg(&exe);
                cmd.args([
                    "--worker", model, "--warmup", &counts[0], "--steps", &counts[1],
                ]);
                harness::mpi_env(&mut cmd);
                let what = format!("kolo-candle np{np} (rep {rep})");
                let r = result_of(cmd, &what, &["steps_per_s", "comm_share"])?;
                kolo[n].push(r[0]);
                comm[n].push(100.0 * r[1]);
            }
        }
        println!(
            "\n{model} MLP {:?}, batch {} per rank, SGD, {reps} alternating launches ({:.0?})",
            mlp::dims(model).unwrap_or(&[]),
            mlp::BATCH,
            Duration::from_secs(started.elapsed().as_secs())
        );
        println!("  plain candle, 1 process    {} steps/s", show(&plain_sps));
        for (n, np) in nps.iter().enumerate() {
            let ratio: Vec<f64> = kolo[n].iter().zip(&plain_sps).map(|(k, b)| k / b).collect();
            println!(
                "  kolo-candle np{np}            {} steps/s  comm {} %  per rank / plain {}",
                show(&kolo[n]),
                show(&comm[n]),
                show(&ratio)
            );
        }
    }
    Ok(())
}
