//! A model bigger than one rank: an MLP of `--params N` f32 parameters (about equal
//! square layers) trained with Adam on synthetic data, either fully sharded
//! (`kolo_burn::FullyShard`, each layer one unit, built unit by unit so that no rank
//! ever holds the whole model) or, for comparison, replicated on every rank with
//! `GradientReducer`.
//!
//! ```sh
//! mpirun -np 4 --bind-to none target/release/examples/train_big_mlp \
//!     --params 1000000000 --steps 3 --fully-sharded
//! ```
//!
//! Each rank prints `rank R peak_rss_mib=M state_bytes=B` (its peak resident memory,
//! and the parameters and optimizer state it holds between steps), then rank 0 prints
//! `steps K done`. Before building anything every rank compares what the run needs
//! (per rank, times the ranks on its host) with the host's available memory: a run
//! that cannot fit fails on every rank saying so, instead of being killed midway.

use std::time::Instant;

use anyhow::{bail, Context};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor, TensorData};
use clap::Parser;
use kolo_burn::{broadcast_parameters, local_param_bytes, FullyShard, GradientReducer};

#[derive(Parser, Debug)]
#[command(about = "Train an MLP of N parameters with Adam, fully sharded or replicated")]
struct Args {
    /// Parameters of the MLP (weights and biases, f32).
    #[arg(long)]
    params: u64,
    /// Adam steps.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Shard every layer's parameters (kolo_burn::FullyShard); otherwise each rank
    /// holds the whole model and its Adam state.
    #[arg(long)]
    fully_sharded: bool,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// The largest layer, in parameters: the layers are about equal squares of at
    /// most this many (more layers for more parameters).
    #[arg(long, default_value_t = 1 << 26)]
    max_layer_params: u64,
    /// Skip the memory check before building the model.
    #[arg(long)]
    no_memory_check: bool,
}

/// The MLP's layers, fully sharded or whole.
#[derive(Module, Debug)]
struct Sharded {
    layers: Vec<FullyShard<Linear>>,
}

#[derive(Module, Debug)]
struct Whole {
    layers: Vec<Linear>,
}

/// Layers and width: `layers` squares of `width` (weights and biases) holding about
/// `params` parameters, none over `max` parameters.
fn shape(params: u64, max: u64) -> (usize, usize) {
    let layers = params.div_ceil(max.max(1)).max(2);
    // width² + width per layer.
    let per = params as f64 / layers as f64;
    let width = ((-1.0 + (1.0 + 4.0 * per).sqrt()) / 2.0).round().max(1.0) as usize;
    (layers as usize, width)
}

fn main() {
    if let Err(e) = run() {
        let code = e
            .chain()
            .find_map(|c| {
                c.downcast_ref::<kolo::Error>()
                    .map(kolo::Error::exit_code)
                    .or_else(|| c.downcast_ref().map(kolo_burn::Error::exit_code))
            })
            .unwrap_or(1);
        // One write, so that mpirun's tagged output keeps the line whole.
        let line = format!("train_big_mlp: {e:#}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        std::process::exit(code);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let kolo = kolo::init()?;
    let (rank, size) = (kolo.rank(), kolo.size());
    let (layers, width) = shape(args.params, args.max_layer_params);
    let layer_params = (width * width + width) as u64;
    let total = layer_params * layers as u64;
    let need = needed_bytes(&args, total, layer_params, size);
    if rank == 0 {
        println!(
            "train_big_mlp: {layers} layers of {width}×{width} = {total} parameters, Adam, \
             {} on {size} ranks; about {:.2} GiB per rank",
            if args.fully_sharded {
                "fully sharded"
            } else {
                "replicated"
            },
            need as f64 / GIB
        );
    }
    if !args.no_memory_check {
        check_memory(&kolo, need)?;
    }
    let device = Device::flex().autodiff();
    device.seed(7);
    let started = Instant::now();
    let mut optim = AdamConfig::new().init();
    // Peak RSS is read before the optimizer state is measured (serialising it copies
    // it): the training's peak.
    let (rss, state_bytes) = if args.fully_sharded {
        // Unit by unit: each layer is made whole on every rank, then only this rank's
        // block of it is kept.
        let mut units = Vec::with_capacity(layers);
        for _ in 0..layers {
            let layer = LinearConfig::new(width, width).init(&device);
            units.push(FullyShard::new(&kolo, layer)?);
        }
        let mut model = Sharded { layers: units };
        report_built(&kolo, started)?;
        for step in 0..args.steps {
            let loss = loss(&args, width, step, rank, &device, |x| {
                forward_units(&model, x)
            });
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-4, model, grads);
            report_step(&kolo, step, started)?;
        }
        let rss = peak_rss_mib();
        (
            rss,
            local_param_bytes(&model) + optimizer_bytes(&kolo, &optim)?,
        )
    } else {
        let mut whole = Vec::with_capacity(layers);
        for _ in 0..layers {
            whole.push(LinearConfig::new(width, width).init(&device));
        }
        let mut model = broadcast_parameters(&kolo, Whole { layers: whole }, 0)?;
        report_built(&kolo, started)?;
        let reducer = GradientReducer::new(&kolo);
        for step in 0..args.steps {
            let loss = loss(&args, width, step, rank, &device, |x| {
                forward_whole(&model, x)
            });
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = reducer.reduce(&model, grads)?;
            model = optim.step(1e-4, model, grads);
            report_step(&kolo, step, started)?;
        }
        let rss = peak_rss_mib();
        (
            rss,
            local_param_bytes(&model) + optimizer_bytes(&kolo, &optim)?,
        )
    };
    let lines: Vec<String> = kolo.allgather_object(
        "big_mlp.report",
        format!("rank {rank} peak_rss_mib={rss} state_bytes={state_bytes}"),
    )?;
    if rank == 0 {
        for l in lines {
            println!("{l}");
        }
        println!("steps {} done", args.steps);
    }
    kolo.shutdown()?;
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// What one rank needs, about: replicated, the parameters, their gradients, Adam's
/// two moments and the reduction's copy (20 bytes a parameter); fully sharded, 1/N of
/// the first four, plus a layer gathered twice over (its parameters and its
/// gradient) and the broadcast of one layer while building (about three copies).
fn needed_bytes(args: &Args, total: u64, layer: u64, size: usize) -> u64 {
    if args.fully_sharded {
        16 * total / size as u64 + 4 * layer * 4
    } else {
        20 * total
    }
}

/// Fails on every rank, naming the host's numbers, when the ranks on some host need
/// more than it has available.
fn check_memory(kolo: &kolo::Kolo, need: u64) -> anyhow::Result<()> {
    let available = mem_available().unwrap_or(u64::MAX);
    let local = kolo.local_size() as u64;
    let mine = (local.saturating_mul(need) > available).then(|| {
        format!(
            "rank {} needs about {:.2} GiB, {} ranks on its host {:.2} GiB, but the host has \
             {:.2} GiB available: use more ranks or hosts, or --fully-sharded",
            kolo.rank(),
            need as f64 / GIB,
            local,
            (local * need) as f64 / GIB,
            available as f64 / GIB
        )
    });
    let all: Vec<Option<String>> = kolo.allgather_object("big_mlp.memory", mine)?;
    if let Some(why) = all.into_iter().flatten().next() {
        bail!("not enough memory: {why}");
    }
    Ok(())
}

/// The host's available memory (`MemAvailable`), in bytes.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// This process's peak resident memory (`VmHWM`), in MiB.
fn peak_rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib / 1024)
}

/// The optimizer state's bytes as Burn serialises it, measured one rank at a time
/// (serialising copies the state).
fn optimizer_bytes(kolo: &kolo::Kolo, optim: &ModuleOptimizer) -> anyhow::Result<usize> {
    let mut bytes = 0;
    for r in 0..kolo.size() {
        if r == kolo.rank() {
            bytes = optim
                .to_record()
                .into_bytes()
                .map(|b| b.len())
                .context("serialising the optimizer state")?;
        }
        kolo.barrier()?;
    }
    Ok(bytes)
}

fn report_built(kolo: &kolo::Kolo, started: Instant) -> anyhow::Result<()> {
    kolo.barrier()?;
    if kolo.rank() == 0 {
        println!(
            "built in {:.1} s, peak RSS of rank 0 {} MiB",
            started.elapsed().as_secs_f64(),
            peak_rss_mib()
        );
    }
    Ok(())
}

fn report_step(kolo: &kolo::Kolo, step: u64, started: Instant) -> anyhow::Result<()> {
    kolo.barrier()?;
    if kolo.rank() == 0 {
        println!(
            "step {} at {:.1} s, peak RSS of rank 0 {} MiB",
            step + 1,
            started.elapsed().as_secs_f64(),
            peak_rss_mib()
        );
    }
    Ok(())
}

/// The mean squared error of the model on this rank's synthetic batch of `step`:
/// inputs and targets drawn from the step and rank.
fn loss(
    args: &Args,
    width: usize,
    step: u64,
    rank: usize,
    device: &Device,
    forward: impl Fn(Tensor<2>) -> Tensor<2>,
) -> Tensor<1> {
    let n = args.batch_size * width;
    let seed = step * 1000 + rank as u64;
    let value =
        |i: usize, k: u64| (((i as u64 * 2654435761 + seed * 97 + k) % 1000) as f32 / 500.0) - 1.0;
    let x: Vec<f32> = (0..n).map(|i| value(i, 1)).collect();
    let t: Vec<f32> = (0..n).map(|i| value(i, 2)).collect();
    let x = Tensor::from_data(TensorData::new(x, [args.batch_size, width]), device);
    let t = Tensor::<2>::from_data(TensorData::new(t, [args.batch_size, width]), device);
    let d = forward(x) - t;
    (d.clone() * d).mean()
}

fn forward_units(model: &Sharded, mut x: Tensor<2>) -> Tensor<2> {
    let n = model.layers.len();
    for (i, l) in model.layers.iter().enumerate() {
        x = l.forward(x, |l, x| l.forward(x));
        if i + 1 < n {
            x = Relu::new().forward(x);
        }
    }
    x
}

fn forward_whole(model: &Whole, mut x: Tensor<2>) -> Tensor<2> {
    let n = model.layers.len();
    for (i, l) in model.layers.iter().enumerate() {
        x = l.forward(x);
        if i + 1 < n {
            x = Relu::new().forward(x);
        }
    }
    x
}
