//! kolo-burn against plain Burn: the issue's two MLPs (784-512-512-10, 0.67 M
//! parameters; 784-2048-2048-2048-10, 10.0 M), a synthetic batch of 64 per rank, SGD
//! with lr 0.01, one compute thread per rank (`RAYON_NUM_THREADS=1`).
//!
//! Each repetition launches, in turn: the plain Burn program (`benches/baseline/plain_mlp.rs`,
//! one process, no kolo), then kolo's ranks under `mpirun -np 1` and `-np 2` for each
//! path (`GradientReducer`, `GradientReducer::overlap`, `DistributedOptimizer`). Alternating the launches lets load
//! drifting on a shared machine hit both sides alike. Printed per model and path:
//! steps/s (median and range), the share of the step spent reducing, and np2 per-rank
//! steps/s ÷ plain Burn steps/s of the same repetition.
//!
//! ```sh
//! ./scripts/run-burn-bench.sh            # KOLO_BENCH_REPS=N (default 5), --model small|big|pipe
//! KOLO_BENCH_PATHS=pipeline ./scripts/run-burn-bench.sh --model pipe   # some paths only
//! ./scripts/run-burn-bench.sh --device cuda   # after scripts/build-cuda.sh; also cpu
//! ```
//! `--device cuda` (Burn's CUDA backend, gradients reduced by NCCL) runs kolo at np 1
//! only — NCCL refuses two ranks on one GPU; `KOLO_BENCH_NP2=1` adds np 2 on a machine
//! with two GPUs — and prints kolo's per-step overhead over plain Burn in µs.
//! `--device cpu` is Burn's CubeCL CPU runtime (the same route, MPI in place of NCCL).
//! Every launch waits for the device before its clock starts and before it stops (a
//! CUDA loop that never waits is otherwise timed by how fast it queues kernels); on
//! CUDA the big model runs ten times the steps. Two knobs split the cost on a GPU:
//! `KOLO_BENCH_PRESYNC=1` makes the reducer path wait for the backward pass before
//! its communication clock starts (the share is then kolo's reduction alone), and
//! `KOLO_BENCH_PLAIN_SYNC=1` makes the plain program wait once a step after backward,
//! as a loop that reads its loss each step does. The `fsdp` rows chain their units
//! directly (activations inside the units), so backward prefetch and deferred
//! reduce-scatters apply, and turn forward prefetch on
//! (`KOLO_BENCH_FSDP_FORWARD_PREFETCH=0` turns it off).
//! Without `--bench` (as `cargo test --all-targets` runs it) it makes one short smoke
//! run of the small model.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, ModuleOptimizer, SgdConfig};
use kolo_burn::{
    broadcast_parameters, DistributedOptimizer, GradientReducer, Pipeline, ShardedOptimizer,
};

#[path = "common/mlp.rs"]
mod mlp;

#[path = "../../shared/bench.rs"]
mod bench;
use bench::{show, PLAIN_MALLOC};

#[path = "../../../tests/collectives/harness.rs"]
#[allow(dead_code)]
mod harness;

const PATHS: [&str; 16] = [
    "reducer",
    "overlapped",
    "optimizer",
    "sharded",
    "sharded-ov",
    "fsdp",
    "fsdp-keep",
    "fsdp-serial",
    "bytegrad",
    "adasum",
    "decentralized",
    "onebit-adam",
    "decentralized-8bit",
    "qadam",
    "async",
    "pipeline",
];

/// The MLP with each layer a fully sharded unit (`fsdp`: gathered again and
/// recomputed in backward; `fsdp-keep`: the gathered layer and its graph kept until
/// backward; `fsdp-serial`: as `fsdp-keep` with the activations outside the units
/// and no forward prefetch, so nothing overlaps: each unit waits for its own
/// collectives).
#[derive(burn::module::Module, Debug)]
struct Units {
    layers: Vec<kolo_burn::FullyShard<burn::nn::Linear>>,
}

/// The gradients of one step of `m` on `(x, y)` (each unit's averaged block); with
/// `chained`, each unit's activation runs inside it.
fn unit_grads(
    m: &Units,
    chained: bool,
    x: &burn::tensor::Tensor<2>,
    y: &burn::tensor::Tensor<1, burn::tensor::Int>,
    device: &burn::tensor::Device,
) -> GradientsParams {
    // The activation inside each unit (but the last), so that units feed each other
    // directly and their backward overlaps (a unit's gather prefetched, its
    // reduce-scatter waited for by the next unit to run).
    let last = m.layers.len() - 1;
    let mut h = x.clone();
    for (i, unit) in m.layers.iter().enumerate() {
        h = if i < last && chained {
            unit.forward(h, |l, x| burn::tensor::activation::relu(l.forward(x)))
        } else if i < last {
            burn::tensor::activation::relu(unit.forward(h, |l, x| l.forward(x)))
        } else {
            unit.forward(h, |l, x| l.forward(x))
        };
    }
    let loss = CrossEntropyLossConfig::new()
        .init(device)
        .forward(h, y.clone());
    GradientsParams::from_grads(loss.backward(), m)
}

/// The gradients of one step on `(x, y)` with every layer of `m` passed through
/// `sync`'s hook (reduced during backward).
fn hooked_grads(
    m: &mlp::Mlp,
    sync: &kolo_burn::Overlap,
    x: &burn::tensor::Tensor<2>,
    y: &burn::tensor::Tensor<1, burn::tensor::Int>,
    device: &burn::tensor::Device,
) -> GradientsParams {
    let last = m.layers.len() - 1;
    let mut h = x.clone();
    for (i, layer) in m.layers.iter().enumerate() {
        h = sync.layer(layer, &h).forward(h);
        if i < last {
            h = m.act.forward(h);
        }
    }
    let loss = CrossEntropyLossConfig::new()
        .init(device)
        .forward(h, y.clone());
    GradientsParams::from_grads(loss.backward(), m)
}

/// The layers of stage `stage` of `stages` of an MLP of widths `dims`: consecutive,
/// cut where the stages' parameter counts are most even.
fn stage_layers(dims: &[usize], stages: usize, stage: usize) -> std::ops::Range<usize> {
    let sizes: Vec<usize> = dims.windows(2).map(|w| w[0] * w[1] + w[1]).collect();
    let n = sizes.len();
    // prefix[i]: the parameters of layers 0..i.
    let prefix: Vec<usize> = std::iter::once(0)
        .chain(sizes.iter().scan(0, |acc, s| {
            *acc += s;
            Some(*acc)
        }))
        .collect();
    let mut cuts = vec![0];
    for k in 1..stages {
        let want = k * prefix[n] / stages;
        // At least one layer per stage on either side of the cut.
        let lo = cuts[k - 1] + 1;
        let hi = n.saturating_sub(stages - k).max(lo);
        let at = (lo..=hi)
            .min_by_key(|&i| prefix[i.min(n)].abs_diff(want))
            .unwrap_or(lo);
        cuts.push(at.min(n));
    }
    cuts.push(n);
    cuts[stage]..cuts[stage + 1]
}

/// One rank's side: trains `model` along `path` and prints rank 0's result line (the
/// slowest rank's steps/s).
fn worker(
    model: &str,
    path: &str,
    backend: kolo_burn::Backend,
    warmup: usize,
    steps: usize,
) -> Result<()> {
    let dims = mlp::dims(model).context("unknown model")?;
    let kolo = kolo::init()?;
    let device = backend.device(&kolo)?.autodiff();
    let (x, y) = mlp::batch(kolo.rank(), dims, mlp::batch_size(model), &device);
    let start = broadcast_parameters(&kolo, mlp::Mlp::new(dims, &device), 0)?;
    let t = match path {
        "reducer" => {
            let reducer = GradientReducer::new(&kolo);
            let mut optim = SgdConfig::new().init();
            let mut failed = None;
            // KOLO_BENCH_PRESYNC=1: wait for the backward pass before the clock
            // starts, so that the communication share is kolo's reduction alone.
            let presync = std::env::var_os("KOLO_BENCH_PRESYNC").is_some_and(|v| v == "1");
            let t = mlp::time_steps(start, &device, warmup, steps, |m| {
                let g = mlp::grads(&m, x.clone(), y.clone());
                if presync {
                    mlp::wait_for(&device);
                }
                let at = Instant::now();
                let g = reducer.reduce(&m, g).unwrap_or_else(|e| {
                    failed.get_or_insert(e.to_string());
                    GradientsParams::new()
                });
                let comm = at.elapsed();
                (optim.step(mlp::LR, m, g), comm)
            });
            if let Some(e) = failed {
                bail!("reduce failed: {e}");
            }
            ensure!(
                reducer.copied_bytes() == 0,
                "the reducer copied {} bytes",
                reducer.copied_bytes()
            );
            t
        }
        "bytegrad" | "adasum" => {
            // Issue 57's gradient algorithms through the reducer; the share is the
            // reduction.
            let algorithm: kolo::Algorithm = path.parse()?;
            // KOLO_BENCH_FLAT=1: ByteGrad compresses on one host too.
            let flat = std::env::var_os("KOLO_BENCH_FLAT").is_some_and(|v| v == "1");
            let reducer = GradientReducer::new(&kolo)
                .algorithm(algorithm)
                .hierarchical(!flat);
            let mut optim = SgdConfig::new().init();
            let mut failed = None;
            let t = mlp::time_steps(start, &device, warmup, steps, |m| {
                let g = mlp::grads(&m, x.clone(), y.clone());
                let at = Instant::now();
                let g = reducer.reduce(&m, g).unwrap_or_else(|e| {
                    failed.get_or_insert(e.to_string());
                    GradientsParams::new()
                });
                let comm = at.elapsed();
                (optim.step(mlp::LR, m, g), comm)
            });
            if let Some(e) = failed {
                bail!("{path} failed: {e}");
            }
            t
        }
        "decentralized" | "decentralized-8bit" | "async" => {
            // The weight exchanges: this rank's own gradients, then the exchange
            // (async: a round every 4 steps, in the background); the share is the
            // exchange. The last timed step also finishes (async: waits for the round
            // in flight), so that no exchange is left outside the clock.
            let mut avg = kolo_burn::WeightAverager::new(&kolo, path.parse()?)?;
            let mut optim = SgdConfig::new().init();
            let mut failed = None;
            let mut count = 0;
            let t = mlp::time_steps(start, &device, warmup, steps, |m| {
                let g = mlp::grads(&m, x.clone(), y.clone());
                let m = optim.step(mlp::LR, m, g);
                let at = Instant::now();
                count += 1;
                let last = count == warmup + steps;
                let exchanged =
                    avg.after_step(m.clone())
                        .and_then(|m| if last { avg.finish(m) } else { Ok(m) });
                let m = exchanged.unwrap_or_else(|e| {
                    failed.get_or_insert(e.to_string());
                    m
                });
                (m, at.elapsed())
            });
            if let Some(e) = failed {
                bail!("{path} failed: {e}");
            }
            t
        }
        "onebit-adam" | "qadam" => {
            // 1-bit Adam or QAdam, compressing from its second step (the untimed
            // warm-up steps cover its full-precision one); the share is its whole step.
            let config = kolo::algorithms::OneBitAdamConfig {
                warmup: 1,
                ..Default::default()
            };
            let mut optim = if path == "qadam" {
                kolo_burn::OneBitAdam::qadam(&kolo, config)
            } else {
                kolo_burn::OneBitAdam::new(&kolo, config)
            };
            let mut failed = None;
            let t = mlp::time_steps(start, &device, warmup, steps, |m| {
                let g = mlp::grads(&m, x.clone(), y.clone());
                let at = Instant::now();
                let m = optim.step(mlp::LR, m.clone(), g).unwrap_or_else(|e| {
                    failed.get_or_insert(e.to_string());
                    m
                });
                (m, at.elapsed())
            });
            if let Some(e) = failed {
                bail!("{path} failed: {e}");
            }
            t
        }
        "overlapped" => {
            let reducer = GradientReducer::new(&kolo);
            let mut optim = SgdConfig::new().init();
            let mut failed = None;
            // The share is the wait in `finish` after backward: what overlap left exposed.
            let t = mlp::time_steps(start, &device, warmup, steps, |m| {
                let step = || -> kolo_burn::Result<(GradientsParams, Duration)> {
                    let sync = reducer.overlap(&m)?;
                    let g = hooked_grads(&m, &sync, &x, &y, &device);
                    let at = Instant::now();
                    let g = sync.finish(&m, g)?;
                    Ok((g, at.elapsed()))
                };
                let (g, comm) = step().unwrap_or_else(|e| {
                    failed.get_or_insert(e.to_string());
                    (GradientsParams::new(), Duration::ZERO)
                });
                (optim.step(mlp::LR, m, g), comm)
            });
            if let Some(e) = failed {
                bail!("overlapped step failed: {e}");
            }
            t
        }
        "optimizer" => {
            let mut optim: ModuleOptimizer =
                DistributedOptimizer::new(&kolo, SgdConfig::new().build()).into();
            // The reduction happens inside the optimizer's step: its share includes
            // SGD's update.
            mlp::time_steps(start, &device, warmup, steps, |m| {
                let g = mlp::grads(&m, x.clone(), y.clone());
                let at = Instant::now();
                let m = optim.step(mlp::LR, m, g);
                (m, at.elapsed())
            })
        }
        "sharded" => {
            let mut optim = ShardedOptimizer::new(&kolo, SgdConfig::new().init());
            let mut failed = None;
            // Reduce-scatter, the shard's step and the all-gather: the share includes
            // SGD's update, as for the optimizer path.
            let t = mlp::time_steps(start, &device, warmup, steps, |m| {
                let g = mlp::grads(&m, x.clone(), y.clone());
                let at = Instant::now();
                let fallback = m.clone();
                let m = optim.step(mlp::LR, m, g).unwrap_or_else(|e| {
                    failed.get_or_insert(e.to_string());
                    fallback
                });
                (m, at.elapsed())
            });
            if let Some(e) = failed {
                bail!("sharded step failed: {e}");
            }
            t
        }
        "sharded-ov" => {
            let mut optim = ShardedOptimizer::new(&kolo, SgdConfig::new().init());
            let mut failed = None;
            // Reduce-scatters from backward's hooks; the share is from the end of
            // backward to the gathered parameters (SGD's update included).
            let t = mlp::time_steps(start, &device, warmup, steps, |m| {
                let fallback = m.clone();
                let mut step = || -> kolo_burn::Result<(mlp::Mlp, Duration)> {
                    let sync = optim.overlap(&m)?;
                    let g = hooked_grads(&m, &sync, &x, &y, &device);
                    let at = Instant::now();
                    let m = optim.step_overlapped(mlp::LR, m.clone(), sync, g)?;
                    Ok((m, at.elapsed()))
                };
                step().unwrap_or_else(|e| {
                    failed.get_or_insert(e.to_string());
                    (fallback, Duration::ZERO)
                })
            });
            if let Some(e) = failed {
                bail!("overlapped sharded step failed: {e}");
            }
            t
        }
        "fsdp" | "fsdp-keep" | "fsdp-serial" => {
            let keep = path != "fsdp";
            let chained = path != "fsdp-serial";
            // Forward prefetch on unless KOLO_BENCH_FSDP_FORWARD_PREFETCH=0.
            let forward_prefetch = chained
                && std::env::var("KOLO_BENCH_FSDP_FORWARD_PREFETCH").map_or(true, |v| v != "0");
            let layers = start
                .layers
                .iter()
                .map(|l| {
                    kolo_burn::FullyShard::new(&kolo, l.clone()).map(|u| {
                        u.reshard_after_forward(!keep)
                            .forward_prefetch(forward_prefetch)
                    })
                })
                .collect::<kolo_burn::Result<Vec<_>>>()?;
            let mut optim = SgdConfig::new().init();
            // The gathers and reduce-scatters run inside forward and backward: no
            // separate communication share.
            mlp::time_steps(Units { layers }, &device, warmup, steps, |m| {
                let g = unit_grads(&m, chained, &x, &y, &device);
                (optim.step(mlp::LR, m, g), Duration::ZERO)
            })
        }
        "pipeline" => {
            // S = the ranks, one replica; M = 8 micro-batches.
            let stages = kolo.size();
            let micro = std::env::var("KOLO_BENCH_MICRO")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(mlp::MICRO_BATCHES);
            let mut pipe = Pipeline::new(&kolo, stages)?.micro_batches(micro);
            let range = stage_layers(dims, stages, pipe.stage());
            let part = mlp::Mlp {
                layers: start.layers[range].to_vec(),
                act: start.act.clone(),
            };
            let ends = pipe.is_last();
            let first = pipe.is_first().then(|| x.clone());
            let loss = CrossEntropyLossConfig::new().init(&device);
            let mut optim = SgdConfig::new().init();
            let mut failed = None;
            let t = mlp::time_steps(part, &device, warmup, steps, |m| {
                let out = pipe.step(
                    &m,
                    first.clone(),
                    |m: &mlp::Mlp, x| m.forward_part(x, ends),
                    |out, rows| loss.forward(out, y.clone().slice(rows)),
                );
                match out {
                    Ok(out) => (optim.step(mlp::LR, m, out.grads), Duration::ZERO),
                    Err(e) => {
                        failed.get_or_insert(e.to_string());
                        (m, Duration::ZERO)
                    }
                }
            });
            if let Some(e) = failed {
                bail!("pipeline step failed: {e}");
            }
            t
        }
        other => bail!("unknown path {other:?}"),
    };
    let all: Vec<(f64, f64)> = kolo.allgather_object(
        "bench.result",
        (t.steps_per_s, t.comm.as_secs_f64() / t.total.as_secs_f64()),
    )?;
    if kolo.rank() == 0 {
        let slowest = all
            .iter()
            .copied()
            .fold((f64::INFINITY, 0.0), |a, b| if b.0 < a.0 { b } else { a });
        println!(
            "RESULT steps_per_s={:.4} comm_share={:.4}",
            slowest.0, slowest.1
        );
    }
    kolo.shutdown()?;
    Ok(())
}

/// A 2-stage pipeline's steps/s over 2 × `plain`'s, launch by launch, and each as a
/// share of GPipe's ideal M/(M+S−1) for the benchmark's M.
fn efficiency(pipeline: &[f64], plain: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let m = mlp::MICRO_BATCHES as f64;
    let eff: Vec<f64> = pipeline
        .iter()
        .zip(plain)
        .map(|(k, b)| k / (2.0 * b))
        .collect();
    let share = eff.iter().map(|e| e / (m / (m + 1.0))).collect();
    (eff, share)
}

/// Whether `path` runs: all of them, or those `KOLO_BENCH_PATHS` lists (comma-separated,
/// e.g. `pipeline` for the pipeline rows alone).
fn wanted(path: &str) -> bool {
    match std::env::var("KOLO_BENCH_PATHS") {
        Ok(list) if !list.trim().is_empty() => list.split(',').any(|p| p.trim() == path),
        _ => true,
    }
}

/// Runs `cmd` and reads its result line: (steps/s, communication share).
fn result_of(cmd: Command, what: &str) -> Result<(f64, f64)> {
    let v = bench::result_of(cmd, what, &["steps_per_s", "comm_share"])?;
    Ok((v[0], v[1]))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |k: &str| bench::arg(&args, k);
    let device_arg = arg("--device").unwrap_or_else(|| "flex".into());
    if let Some(model) = arg("--worker") {
        let path = arg("--path").unwrap_or_else(|| "reducer".into());
        let warmup = arg("--warmup").and_then(|v| v.parse().ok()).unwrap_or(3);
        let steps = arg("--steps").and_then(|v| v.parse().ok()).unwrap_or(20);
        let backend = device_arg.parse().map_err(anyhow::Error::msg)?;
        return worker(&model, &path, backend, warmup, steps);
    }
    let bench::Plan {
        smoke,
        reps,
        models,
    } = bench::plan(&args);
    let backend: kolo_burn::Backend = device_arg.parse().map_err(anyhow::Error::msg)?;
    // NCCL refuses two ranks on one GPU.
    let nps: &[&str] =
        if backend == kolo_burn::Backend::Cuda && std::env::var_os("KOLO_BENCH_NP2").is_none() {
            &["1"]
        } else {
            &["1", "2"]
        };
    let exe = std::env::current_exe()?;
    // Cargo builds the package's binaries before its benchmarks and gives their paths;
    // a copy of the release directory carried to another machine (scripts/gpu-pack.sh)
    // has the plain program beside `deps/`, where this benchmark is.
    let mut plain = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kolo-burn-plain-mlp"));
    if !plain.exists() {
        if let Some(release) = exe.parent().and_then(|deps| deps.parent()) {
            plain = release.join("kolo-burn-plain-mlp");
        }
    }
    for model in &models {
        // A few seconds per launch (0.1 s per big step, 5 ms per small one here).
        let (warmup, steps) = match (smoke, model.as_str()) {
            (true, _) => (1, 3),
            (false, "big") => (3, 20),
            (false, "pipe") => (2, 8),
            (false, _) => (50, 1000),
        };
        // A GPU runs a big step in about a millisecond: ten times the steps there
        // (the small model's thousand are enough).
        let (warmup, steps) = match backend {
            kolo_burn::Backend::Cuda if !smoke && steps < 100 => (warmup * 10, steps * 10),
            _ => (warmup, steps),
        };
        let counts = [warmup.to_string(), steps.to_string()];
        let mut plain_sps = Vec::new();
        // The pipeline model only: one rank running the same micro-batches.
        let mut plain_micro_sps = Vec::new();
        let mut kolo: Vec<[Vec<(f64, f64)>; 2]> = vec![Default::default(); PATHS.len()];
        let started = Instant::now();
        // The plain program on `model`, the batch as `micro` micro-batches.
        let plain_cmd = |micro: usize| {
            let mut cmd = Command::new(&plain);
            // The same malloc settings kolo's `init` makes (KOLO_MALLOC_TUNING, on by
            // default; see `PLAIN_MALLOC`).
            cmd.env("GLIBC_TUNABLES", PLAIN_MALLOC);
            cmd.env("KOLO_BENCH_PLAIN_MICRO", micro.to_string());
            cmd.arg(model).args(&counts).arg(&device_arg);
            cmd
        };
        for rep in 0..reps {
            plain_sps.push(result_of(plain_cmd(1), "plain Burn")?.0);
            if model == "pipe" {
                let cmd = plain_cmd(mlp::MICRO_BATCHES);
                plain_micro_sps.push(result_of(cmd, "plain Burn, micro-batches")?.0);
            }
            for (p, path) in PATHS.iter().enumerate() {
                if !wanted(path) {
                    continue;
                }
                for (n, &np) in nps.iter().enumerate() {
                    let mut cmd = Command::new("mpirun");
                    cmd.args(["-np", np, "--bind-to", "none"]).arg(&exe);
                    cmd.args(["--worker", model, "--path", path, "--device", &device_arg]);
                    cmd.args(["--warmup", &counts[0], "--steps", &counts[1]]);
                    harness::mpi_env(&mut cmd);
                    let r = result_of(cmd, &format!("kolo {path} np{np} (rep {rep})"))?;
                    kolo[p][n].push(r);
                }
            }
        }
        println!(
            "\n{model} MLP {:?} on {device_arg}, batch {} per rank, {reps} alternating launches ({:.0?})",
            mlp::dims(model).unwrap_or(&[]),
            mlp::batch_size(model),
            Duration::from_secs(started.elapsed().as_secs())
        );
        println!(
            "  plain Burn, 1 process         {} steps/s",
            show(&plain_sps)
        );
        for (p, path) in PATHS.iter().enumerate() {
            if !wanted(path) {
                continue;
            }
            for (n, np) in nps.iter().enumerate() {
                let np = format!("np{np}");
                let sps: Vec<f64> = kolo[p][n].iter().map(|r| r.0).collect();
                let comm: Vec<f64> = kolo[p][n].iter().map(|r| 100.0 * r.1).collect();
                let ratio: Vec<f64> = sps.iter().zip(&plain_sps).map(|(k, b)| k / b).collect();
                println!(
                    "  {path:<10} {np}  {} steps/s  comm {} %  per rank / plain {}",
                    show(&sps),
                    show(&comm),
                    show(&ratio)
                );
                if n == 0 {
                    // What kolo adds to a step at np 1, from the same repetitions.
                    let over: Vec<f64> = sps
                        .iter()
                        .zip(&plain_sps)
                        .map(|(k, b)| 1e6 * (1.0 / k - 1.0 / b))
                        .collect();
                    println!("  {path:<10} np1  overhead per step {} µs", show(&over));
                }
                if *path == "pipeline" && n == 1 {
                    // Pipeline efficiency: steps/s of S = 2 stages over 2 × plain Burn's
                    // (one rank running the whole model), against GPipe's ideal M/(M+S−1).
                    let (eff, share) = efficiency(&sps, &plain_sps);
                    let m = mlp::MICRO_BATCHES as f64;
                    println!(
                        "  pipeline   np2  efficiency {} (ideal M/(M+S-1) = {:.3}; share of ideal {})",
                        show(&eff),
                        m / (m + 1.0),
                        show(&share)
                    );
                    // The same against one rank running the batch as the same M
                    // micro-batches (the pipe model only): the schedule's own cost,
                    // without Burn's lower throughput on smaller matrices.
                    if !plain_micro_sps.is_empty() {
                        let (sched, share) = efficiency(&sps, &plain_micro_sps);
                        println!(
                            "  pipeline   np2  schedule efficiency {} (against plain Burn on {} micro-batches, {} steps/s; share of ideal {})",
                            show(&sched),
                            mlp::MICRO_BATCHES,
                            show(&plain_micro_sps),
                            show(&share)
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
