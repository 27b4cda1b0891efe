//! The main job: data-parallel training of an MLP on the handwritten digits embedded
//! in `smartcore` (1797 8×8 images, ten classes), with kolo's fused gradient reducer.
//!
//! ```sh
//! mpirun -np 2 --bind-to none target/release/examples/train_digits [--epochs 30] \
//!     [--scale-lr [--warmup-epochs 2]] [--checkpoint DIR [--resume] [--commit-every K]] \
//!     [--max-steps N] [--bench] \
//!     [--min-accuracy 0.95] [--device flex|cpu|cuda]
//! ```
//!
//! `--device` picks Burn's backend: `flex` (default, Burn's CPU backend), `cuda`
//! (each rank on GPU `local_rank % GPUs`, gradients reduced on the GPU by NCCL) or
//! `cpu` (Burn's CubeCL CPU runtime, the CUDA route's code with MPI in place of
//! NCCL). `cuda` and `cpu` need kolo-burn's features of those names:
//! `scripts/build-cuda.sh` builds this example with both.
//!
//! Rank 0 prints one line per epoch with the loss and test accuracy averaged over all
//! ranks, and the total throughput at the end.
//!
//! Each rank trains on `--batch-size` samples per step, so N ranks take steps on a
//! global batch N times as large at the same learning rate: more ranks need more
//! epochs. `--scale-lr` applies the linear scaling rule that Horovod advises (Goyal et
//! al., "Accurate, Large Minibatch SGD", 2017): the learning rate times the number of
//! ranks, reached by a linear warm-up from `--lr` over `--warmup-epochs`.
//!
//! `--pipeline-stages S` trains the MLP pipeline-parallel instead
//! (`kolo_burn::Pipeline`): each rank holds only its stage's layers (the MLP has
//! `max(S, 2)` layers, cut at layer boundaries), each batch flows through the stages in
//! `--micro-batches M` micro-batches (1F1B schedule, `--pipeline-schedule gpipe` for
//! fill-drain), and with more ranks than stages the pipeline is replicated (ranks
//! `r·S … r·S + S − 1` are replica `r`), each stage's gradients averaged over its
//! replicas. With `--scale-lr` the learning rate scales with the replicas.
//!
//! `--fully-sharded` makes each layer a `kolo_burn::FullyShard` unit (ZeRO stage 3):
//! every rank holds 1/N of each layer's parameters and Adam state, and
//! `--precision bf16|f16` computes the layers in that type over f32 master weights.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kolo_burn::{
    average_metrics, broadcast_optimizer_state, broadcast_parameters, commit, DistributedSampler,
    Progress, ShardedOptimizer,
};

#[derive(Parser, Debug)]
#[command(about = "Train an MLP on the digits dataset across mpirun ranks with kolo")]
struct Args {
    /// Epochs to train (in total, counting those restored from a checkpoint).
    #[arg(long, default_value_t = 30)]
    epochs: u64,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Adam's learning rate (per rank's batch; see --scale-lr).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Multiply the learning rate by the number of ranks (the linear scaling rule:
    /// N ranks step on an N times larger global batch), after a linear warm-up.
    #[arg(long)]
    scale_lr: bool,
    /// Epochs over which --scale-lr raises the learning rate linearly from --lr to
    /// --lr × ranks.
    #[arg(long, default_value_t = 2.0)]
    warmup_epochs: f64,
    /// Exit with an error unless the final test accuracy reaches this fraction (the
    /// tests pass 0.95); without it the accuracy is only printed.
    #[arg(long)]
    min_accuracy: Option<f64>,
    /// Hidden units.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Seed of the data split and the per-epoch shuffles.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Save a checkpoint to this directory after every epoch (rank 0 writes it).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Resume from the checkpoint in --checkpoint. A job relaunched by `kolorun
    /// --max-restarts` (KOLO_RESTART_COUNT above 0) resumes without it.
    #[arg(long, requires = "checkpoint")]
    resume: bool,
    /// Also commit every this many steps (model, optimizer, epoch and samples of it
    /// consumed, step), so that a relaunched job goes on from there, on as many ranks
    /// as it then has.
    #[arg(long, requires = "checkpoint", value_name = "STEPS")]
    commit_every: Option<u64>,
    /// Stop after this many steps in total (counting restored ones), committing first
    /// when --checkpoint is given: for a time-limited allocation.
    #[arg(long, value_name = "STEPS")]
    max_steps: Option<u64>,
    /// Burn's backend: flex (Burn's CPU backend), cuda (one GPU per rank, reduced by
    /// NCCL) or cpu (Burn's CubeCL CPU runtime); cuda and cpu need
    /// scripts/build-cuda.sh.
    #[arg(long, default_value = "flex")]
    device: kolo_burn::Backend,
    /// Measure throughput only: no test evaluation, no checkpoints, one summary line.
    #[arg(long)]
    bench: bool,
    /// Shard Adam's state across the ranks (ZeRO: kolo_burn::ShardedOptimizer), each
    /// rank keeping 1/N of it; the same training otherwise. Commits hold the whole
    /// state (consolidated), so a job resumes at any number of ranks.
    #[arg(long)]
    sharded_optimizer: bool,
    /// Pipeline parallelism: cut the MLP into this many stages, one per rank
    /// (kolo_burn::Pipeline); the number of ranks must be a multiple.
    #[arg(long, conflicts_with = "sharded_optimizer")]
    pipeline_stages: Option<usize>,
    /// Micro-batches per batch with --pipeline-stages (--batch-size must be a
    /// multiple; the last partial batch of an epoch is dropped).
    #[arg(long, default_value_t = 4)]
    micro_batches: usize,
    /// The pipeline's schedule: 1f1b (the default: activations of at most S
    /// micro-batches kept per stage) or gpipe (fill-drain).
    #[arg(long, default_value = "1f1b")]
    pipeline_schedule: kolo_burn::Schedule,
    /// Shard each layer's parameters, gradients and Adam state across the ranks
    /// (ZeRO stage 3: kolo_burn::FullyShard), each rank holding 1/N of them.
    #[arg(long, conflicts_with_all = ["sharded_optimizer", "pipeline_stages"])]
    fully_sharded: bool,
    /// With --fully-sharded: the float type the layers compute in (f32, bf16, f16);
    /// the sharded weights and Adam's state stay f32.
    #[arg(long, value_enum, default_value = "f32", requires = "fully_sharded")]
    precision: fully_sharded_digits::Precision,
    /// How the ranks synchronise: allreduce (gradients, full precision), bytegrad
    /// (gradients, 8-bit), adasum (gradients, adaptive summation), decentralized
    /// (weights, with one peer after each step), decentralized-8bit (weights, 8-bit
    /// differences with both ring neighbours), async (weights averaged in the
    /// background every --async-period steps), onebit-adam (DeepSpeed's 1-bit Adam in
    /// place of Adam), qadam (the same with 8-bit momenta).
    #[arg(
        long,
        default_value = "allreduce",
        value_parser = |s: &str| s.parse::<kolo::Algorithm>().map_err(|e| e.to_string()),
        conflicts_with_all = ["sharded_optimizer", "pipeline_stages", "fully_sharded"]
    )]
    algorithm: kolo::Algorithm,
    /// With --algorithm bytegrad: compress on one host too (by default ByteGrad, as
    /// Bagua's hierarchical mode, compresses only what crosses hosts).
    #[arg(long)]
    compress_on_one_host: bool,
    /// With --algorithm onebit-adam: steps of plain Adam before the variance is frozen
    /// and momenta are compressed to 1 bit.
    #[arg(long, default_value_t = 20)]
    onebit_warmup: u64,
    /// With --algorithm async: steps between the background averaging rounds.
    #[arg(long, default_value_t = 4)]
    async_period: u64,
}

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    act: Relu,
}

impl Mlp {
    fn new(hidden: usize, device: &Device) -> Self {
        Mlp {
            fc1: LinearConfig::new(64, hidden).init(device),
            fc2: LinearConfig::new(hidden, 10).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

#[path = "../../shared/digits.rs"]
mod digits;
#[path = "common/fingerprint.rs"]
mod fingerprint;
#[path = "common/fully_sharded_digits.rs"]
mod fully_sharded_digits;
#[path = "common/sync_algorithm.rs"]
mod sync_algorithm;
use digits::{load_digits, Digits};
use fingerprint::fingerprint;

fn batch(d: &Digits, idx: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let mut x = Vec::with_capacity(idx.len() * 64);
    let mut y = Vec::with_capacity(idx.len());
    for &i in idx {
        x.extend_from_slice(&d.x[i * 64..(i + 1) * 64]);
        y.push(d.y[i]);
    }
    (
        Tensor::from_data(TensorData::new(x, [idx.len(), 64]), device),
        Tensor::from_data(TensorData::new(y, [idx.len()]), device),
    )
}

fn scalar(t: Tensor<1>) -> anyhow::Result<f64> {
    let v = t
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(f64::from(v[0]))
}

/// Correct predictions on this rank's shard of the test set.
fn evaluate(
    model: &Mlp,
    d: &Digits,
    shard: &[usize],
    device: &Device,
) -> anyhow::Result<(usize, usize)> {
    let mut correct = 0;
    for idx in shard.chunks(256) {
        let ids: Vec<usize> = idx.iter().map(|&i| d.test[i]).collect();
        let (x, _) = batch(d, &ids, device);
        correct += count_correct(model.forward(x), &ids, d)?;
    }
    Ok((correct, shard.len()))
}

/// How many of the samples `ids` the model's outputs `out` classify right.
fn count_correct(out: Tensor<2>, ids: &[usize], d: &Digits) -> anyhow::Result<usize> {
    let pred = out
        .argmax(1)
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>();
    let pred = pred.map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(pred.iter().zip(ids).filter(|(p, &i)| **p == d.y[i]).count())
}

/// The learning rate at `progress` epochs into training: `lr`, or with `--scale-lr`
/// rising linearly from `lr` to `lr × ranks` over the warm-up, then staying there.
fn learning_rate(args: &Args, ranks: usize, progress: f64) -> f64 {
    if !args.scale_lr {
        return args.lr;
    }
    let warm = if args.warmup_epochs > 0.0 {
        (progress / args.warmup_epochs).min(1.0)
    } else {
        1.0
    };
    args.lr * (1.0 + (ranks as f64 - 1.0) * warm)
}

/// Runs the training; a failure of the job (another rank left, a stall) exits with
/// `kolo::RESTARTABLE_EXIT_CODE`, so that `kolorun --max-restarts` relaunches it, the
/// program's own errors with 1.
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
        let line = format!("train_digits: {e:#}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        std::process::exit(code);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    // Before any thread starts: Burn loads optimizer state on its default device,
    // CUDA in a build with the `cuda` feature, even when training on the CPU.
    if std::env::var_os("BURN_DEVICE").is_none() {
        std::env::set_var("BURN_DEVICE", args.device.burn_device_name());
    }
    let kolo = kolo::init()?;
    let (rank, size) = (kolo.rank(), kolo.size());
    // Checked before Burn touches the device: a missing CUDA driver is one line
    // naming the rank, not a panic on Burn's device thread.
    // One line and a failure exit, without anyhow's backtrace.
    let device = match args.device.device(&kolo) {
        Ok(d) => d.autodiff(),
        Err(e) => {
            // One write, so that mpirun's tagged output keeps the line whole.
            let line = format!("train_digits: {e}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            drop(kolo);
            std::process::exit(1);
        }
    };
    let data = load_digits(args.seed);
    if args.fully_sharded {
        let acc = fully_sharded_digits::train(&args, &kolo, &device, &data)?;
        kolo.shutdown()?;
        return check_accuracy(&args, acc);
    }
    if let Some(stages) = args.pipeline_stages {
        let acc = train_pipeline(&args, &kolo, &device, &data, stages)?;
        kolo.shutdown()?;
        return check_accuracy(&args, acc);
    }

    // Every rank starts from rank 0's weights (Burn draws them at random per process),
    // drawn from --seed: the same run twice trains the same parameters.
    device.seed(args.seed);
    let model = broadcast_parameters(&kolo, Mlp::new(args.hidden, &device), 0)?;
    let optim = AdamConfig::new().init();
    // This run's commit if there is one (a relaunch, a requeued Slurm job), any with
    // --resume; another run's is an error, never loaded or overwritten.
    let restored = match &args.checkpoint {
        Some(dir) => kolo_burn::resume(&kolo, dir, model.clone(), optim.clone(), args.resume)?,
        None => None,
    };
    let (mut model, optim, progress) = start_from(&kolo, restored, model, optim);
    let start = progress.epoch;
    let mut optim = broadcast_optimizer_state(&kolo, optim, 0)?;
    if rank == 0 {
        println!(
            "kolo-burn: training a 64-{}-10 MLP on {} digits ({} held out) on {size} ranks, batch {}/rank, from epoch {start}",
            args.hidden,
            data.train.len(),
            data.test.len(),
            args.batch_size
        );
        if args.scale_lr {
            println!(
                "learning rate {} × {size} ranks = {} after a {}-epoch warm-up (--scale-lr)",
                args.lr,
                learning_rate(&args, size, f64::INFINITY),
                args.warmup_epochs
            );
        } else if size > 1 {
            println!(
                "learning rate {} on a global batch of {} (--scale-lr scales it with the ranks)",
                args.lr,
                args.batch_size * size
            );
        }
    }
    // Every rank must synchronise alike: checked before the first step.
    args.algorithm.agree(&kolo, "train_digits.algorithm")?;
    if rank == 0 && args.algorithm != kolo::Algorithm::Allreduce {
        println!("synchronising with {} (--algorithm)", args.algorithm);
    }
    let mut sync = sync_algorithm::Synchroniser::new(
        &kolo,
        args.algorithm,
        args.compress_on_one_host,
        args.onebit_warmup,
        args.async_period,
    )?;
    if let Some(dir) = &args.checkpoint {
        (model, optim) = sync.restore(dir, &kolo, progress.step, model, optim)?;
    }
    let mut sharded = args
        .sharded_optimizer
        .then(|| ShardedOptimizer::new(&kolo, AdamConfig::new().init()));
    if let Some(s) = &mut sharded {
        // The restored state (consolidated when it was committed), re-sharded for this
        // job's ranks; nothing before the first commit.
        s.load_consolidated(&model, &optim)?;
    }
    let loss_fn: CrossEntropyLoss = CrossEntropyLossConfig::new().init(&device);
    let sampler = DistributedSampler::new(data.train.len(), rank, size, args.seed);
    let test_shard = DistributedSampler::new(data.test.len(), rank, size, 0).without_shuffle();
    let started = Instant::now();
    let mut samples = 0usize;
    let mut last_acc = 0.0;
    let mut step = progress.step;
    let mut stopped = false;
    let at = |epoch, skip, steps_in, step| {
        progress_at(&args, &sampler, size, epoch, skip, steps_in, step)
    };
    'epochs: for epoch in start..args.epochs {
        // The epoch's samples, past those consumed before a commit this run resumed.
        let skip = if epoch == start {
            progress.consumed as usize
        } else {
            0
        };
        let shard = sampler.indices_from(epoch, skip);
        let steps = sampler.num_samples().div_ceil(args.batch_size);
        let done = skip / (args.batch_size * size);
        let bar = if rank == 0 && !args.bench {
            let bar = ProgressBar::new(steps as u64);
            bar.set_style(
                ProgressStyle::with_template("epoch {msg} [{bar:30}] {pos}/{len} steps")?
                    .progress_chars("=> "),
            );
            bar.set_message(format!("{:3}", epoch + 1));
            bar
        } else {
            ProgressBar::hidden()
        };
        let mut loss_sum = 0.0;
        bar.set_position(done as u64);
        for (i, idx) in shard.chunks(args.batch_size).enumerate() {
            let lr = learning_rate(&args, size, epoch as f64 + (done + i) as f64 / steps as f64);
            let ids: Vec<usize> = idx.iter().map(|&i| data.train[i]).collect();
            let (x, y) = batch(&data, &ids, &device);
            let loss = loss_fn.forward(model.forward(x), y);
            loss_sum += scalar(loss.clone())? * ids.len() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = match &mut sharded {
                Some(sharded) => sharded.step(lr, model, grads)?,
                None => sync.step(lr, model, grads, |m, g| optim.step(lr, m, g))?,
            };
            samples += ids.len();
            bar.inc(1);
            step += 1;
            let stop = args.max_steps.is_some_and(|m| step >= m);
            if let Some(dir) = &args.checkpoint {
                if stop || args.commit_every.is_some_and(|k| k > 0 && step % k == 0) {
                    model = sync.finish(model)?;
                    sync.save(dir, &kolo, step, &model, &optim)?;
                    let state = saved_state(&mut sharded, &model, &optim)?;
                    commit(&kolo, dir, &model, &state, &at(epoch, skip, i + 1, step))
                        .context("committing")?;
                }
            }
            if stop {
                bar.finish_and_clear();
                if rank == 0 {
                    println!("stopped after step {step} (--max-steps)");
                }
                stopped = true;
                break 'epochs;
            }
        }
        bar.finish_and_clear();
        model = sync.finish(model)?;
        if args.bench {
            continue;
        }
        let (correct, n) = evaluate(&model, &data, &test_shard.indices(0), &device)?;
        let avg = average_metrics(
            &kolo,
            "epoch",
            &[
                loss_sum / shard.len().max(1) as f64,
                correct as f64 / n.max(1) as f64,
            ],
            n as f64,
        )?;
        last_acc = avg[1];
        if rank == 0 {
            // A run resumed from a commit at an epoch's end takes no step in it.
            let loss = if shard.is_empty() {
                "-".to_string()
            } else {
                format!("{:.4}", avg[0])
            };
            println!(
                "epoch {:3}/{}: loss {loss}  test accuracy {:.2}%",
                epoch + 1,
                args.epochs,
                100.0 * avg[1]
            );
        }
        if let Some(dir) = &args.checkpoint {
            sync.save(dir, &kolo, step, &model, &optim)?;
            let state = saved_state(&mut sharded, &model, &optim)?;
            commit(&kolo, dir, &model, &state, &at(epoch + 1, 0, 0, step))
                .context("saving the checkpoint")?;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let total: Vec<usize> = kolo.allgather_object("samples", samples)?;
    let total: usize = total.iter().sum();
    if rank == 0 {
        println!(
            "trained {total} samples in {secs:.2} s: {:.0} samples/s on {size} ranks{}",
            total as f64 / secs,
            if args.bench || stopped {
                String::new()
            } else {
                format!("; final test accuracy {:.2}%", 100.0 * last_acc)
            }
        );
        // Bit-for-bit the same parameters print the same line (resume tests).
        println!(
            "parameters fingerprint {:016x} after step {step}",
            fingerprint(&model)?
        );
    }
    kolo.shutdown()?;
    if start >= args.epochs || stopped {
        return Ok(());
    }
    check_accuracy(&args, Some(last_acc))
}

/// What training starts from: `restored`'s model, optimizer and progress (a checkpoint
/// without progress, from `save_checkpoint`, counts epochs), saying so on rank 0; else
/// `model` and `optim` from the start.
fn start_from<M>(
    kolo: &kolo::Kolo,
    restored: Option<kolo_burn::Restored<M>>,
    model: M,
    optim: ModuleOptimizer,
) -> (M, ModuleOptimizer, Progress) {
    let Some(r) = restored else {
        return (model, optim, Progress::default());
    };
    let p = r.progress.unwrap_or(Progress {
        epoch: r.step,
        ..Progress::default()
    });
    if kolo.rank() == 0 {
        println!(
            "resumed from the commit at step {} (epoch {}, {} of its samples done, committed on {} ranks)",
            p.step,
            p.epoch + 1,
            p.consumed,
            p.ranks
        );
    }
    (r.model, r.optim, p)
}

/// Where training stands on a job of `ranks` after `steps_in` steps of `epoch` past
/// `skip` samples of it (the samples `sampler` deals out in those steps, over all its
/// ranks).
fn progress_at(
    args: &Args,
    sampler: &DistributedSampler,
    ranks: usize,
    epoch: u64,
    skip: usize,
    steps_in: usize,
    step: u64,
) -> Progress {
    Progress {
        epoch,
        consumed: (skip + sampler.consumed(steps_in, args.batch_size)) as u64,
        step,
        seed: args.seed,
        ranks: ranks as u64,
    }
}

/// The optimizer state a commit saves: the sharded optimizer's, consolidated (every
/// rank's share gathered, so that the job can resume at another rank count), or the
/// plain optimizer's.
fn saved_state<M: Module>(
    sharded: &mut Option<ShardedOptimizer>,
    model: &M,
    optim: &ModuleOptimizer,
) -> kolo_burn::Result<ModuleOptimizer> {
    match sharded {
        Some(s) => s.consolidate(model),
        None => Ok(optim.clone()),
    }
}

/// The check is for the tests (--min-accuracy 0.95); a short run's lower accuracy is a
/// result, not an error. `None`: nothing was trained or evaluated.
fn check_accuracy(args: &Args, acc: Option<f64>) -> anyhow::Result<()> {
    if let (Some(min), Some(acc)) = (args.min_accuracy.filter(|_| !args.bench), acc) {
        if acc < min {
            bail!(
                "test accuracy {:.2}% is below --min-accuracy {:.2}%",
                100.0 * acc,
                100.0 * min
            );
        }
    }
    Ok(())
}

/// Consecutive layers of the pipeline's MLP: one rank's stage.
#[derive(Module, Debug)]
struct Stage {
    layers: Vec<Linear>,
}

impl Stage {
    /// Layers `range` of an MLP of widths `widths`, made on this rank only.
    fn new(widths: &[usize], range: std::ops::Range<usize>, device: &Device) -> Self {
        Stage {
            layers: range
                .map(|i| LinearConfig::new(widths[i], widths[i + 1]).init(device))
                .collect(),
        }
    }

    /// ReLU after every layer but the MLP's last (`ends`: this stage holds it).
    fn forward(&self, mut x: Tensor<2>, ends: bool) -> Tensor<2> {
        let n = self.layers.len();
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(x);
            if !(ends && i + 1 == n) {
                x = burn::tensor::activation::relu(x);
            }
        }
        x
    }
}

/// `--pipeline-stages`: the MLP cut into stages across ranks (see the module docs);
/// the final test accuracy (None when nothing was evaluated).
fn train_pipeline(
    args: &Args,
    kolo: &kolo::Kolo,
    device: &Device,
    data: &Digits,
    stages: usize,
) -> anyhow::Result<Option<f64>> {
    let mut pipe = kolo_burn::Pipeline::new(kolo, stages)?
        .micro_batches(args.micro_batches)
        .schedule(args.pipeline_schedule);
    let (stage, replica, replicas) = (pipe.stage(), pipe.replica(), pipe.replicas());
    let layers = stages.max(2);
    let mut widths = vec![64];
    widths.extend(std::iter::repeat_n(args.hidden, layers - 1));
    widths.push(10);
    let range = stage * layers / stages..(stage + 1) * layers / stages;
    // Each stage's first replica draws its weights from --seed (the same run twice
    // trains the same parameters) and gives them to the stage's other replicas.
    device.seed(args.seed);
    let part = pipe.broadcast_parameters(Stage::new(&widths, range.clone(), device))?;
    let optim = AdamConfig::new().init();
    let restored = match &args.checkpoint {
        Some(dir) => pipe.resume(dir, part.clone(), optim.clone(), args.resume)?,
        None => None,
    };
    let (mut part, mut optim, progress) = start_from(kolo, restored, part, optim);
    let start = progress.epoch;
    let held: usize = part.num_params();
    let all_held: Vec<usize> = kolo.allgather_object("digits.held", held)?;
    if kolo.rank() == 0 {
        let whole: usize = all_held[..stages].iter().sum();
        println!(
            "kolo-burn: training a {widths:?} MLP as {stages} pipeline stages × {replicas} replicas \
             ({} micro-batches of {}, {:?}), batch {}/replica, from epoch {start}; \
             parameters per stage {:?} of {whole}",
            args.micro_batches,
            args.batch_size / args.micro_batches.max(1),
            args.pipeline_schedule,
            args.batch_size,
            &all_held[..stages],
        );
    }
    let ends = pipe.is_last();
    let loss_fn: CrossEntropyLoss = CrossEntropyLossConfig::new().init(device);
    let sampler = DistributedSampler::new(data.train.len(), replica, replicas, args.seed);
    let test_shard =
        DistributedSampler::new(data.test.len(), replica, replicas, 0).without_shuffle();
    let started = Instant::now();
    let mut samples = 0usize;
    let mut last_acc = None;
    let mut step = progress.step;
    let mut stopped = false;
    let at = |epoch, skip, steps_in, step| {
        progress_at(args, &sampler, kolo.size(), epoch, skip, steps_in, step)
    };
    'epochs: for epoch in start..args.epochs {
        // The epoch's samples, past those consumed before a commit this run resumed.
        let skip = if epoch == start {
            progress.consumed as usize
        } else {
            0
        };
        let shard = sampler.indices_from(epoch, skip);
        let steps = sampler.num_samples() / args.batch_size;
        let done = skip / (args.batch_size * replicas);
        let mut loss_sum = 0.0;
        for (i, idx) in shard.chunks_exact(args.batch_size).enumerate() {
            let lr = learning_rate(
                args,
                replicas,
                epoch as f64 + (done + i) as f64 / steps as f64,
            );
            let ids: Vec<usize> = idx.iter().map(|&i| data.train[i]).collect();
            let (x, y) = batch(data, &ids, device);
            let out = pipe.step(
                &part,
                pipe.is_first().then_some(x),
                |m: &Stage, x: Tensor<2>| m.forward(x, ends),
                |out, rows| loss_fn.forward(out, y.clone().slice(rows)),
            )?;
            loss_sum += out.loss.unwrap_or(0.0) * ids.len() as f64;
            part = optim.step(lr, part, out.grads);
            samples += ids.len();
            step += 1;
            let stop = args.max_steps.is_some_and(|m| step >= m);
            if let Some(dir) = &args.checkpoint {
                if stop || args.commit_every.is_some_and(|k| k > 0 && step % k == 0) {
                    pipe.commit(dir, &part, &optim, &at(epoch, skip, i + 1, step))
                        .context("committing the pipeline")?;
                }
            }
            if stop {
                if kolo.rank() == 0 {
                    println!("stopped after step {step} (--max-steps)");
                }
                stopped = true;
                break 'epochs;
            }
        }
        if args.bench {
            continue;
        }
        // The test set through the pipeline; the last stages count what is right.
        let mut correct = 0usize;
        let test = test_shard.indices(0);
        for idx in test.chunks(256) {
            let ids: Vec<usize> = idx.iter().map(|&i| data.test[i]).collect();
            let (x, _) = batch(data, &ids, device);
            let out = pipe.infer(&part, pipe.is_first().then_some(x), |m: &Stage, x| {
                m.forward(x, ends)
            })?;
            if let Some(out) = out {
                correct += count_correct(out, &ids, data)?;
            }
        }
        // (loss × samples, samples, correct, tested) from the last stages only.
        let mine = if ends {
            (
                loss_sum,
                (steps * args.batch_size) as f64,
                correct as f64,
                test.len() as f64,
            )
        } else {
            (0.0, 0.0, 0.0, 0.0)
        };
        let all: Vec<(f64, f64, f64, f64)> = kolo.allgather_object("digits.metrics", mine)?;
        let sum = all.iter().fold((0.0, 0.0, 0.0, 0.0), |a, b| {
            (a.0 + b.0, a.1 + b.1, a.2 + b.2, a.3 + b.3)
        });
        let acc = sum.2 / sum.3.max(1.0);
        last_acc = Some(acc);
        if kolo.rank() == 0 {
            println!(
                "epoch {:3}/{}: loss {:.4}  test accuracy {:.2}%",
                epoch + 1,
                args.epochs,
                sum.0 / sum.1.max(1.0),
                100.0 * acc
            );
        }
        if let Some(dir) = &args.checkpoint {
            pipe.commit(dir, &part, &optim, &at(epoch + 1, 0, 0, step))
                .context("saving the pipeline checkpoint")?;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    // Every stage of a replica saw the same samples: count the first stages'.
    let first = if pipe.is_first() { samples } else { 0 };
    let total: usize = kolo.allgather_object("samples", first)?.iter().sum();
    if kolo.rank() == 0 {
        println!(
            "trained {total} samples in {secs:.2} s: {:.0} samples/s on {} ranks ({stages} stages × {replicas} replicas){}",
            total as f64 / secs,
            kolo.size(),
            match last_acc {
                Some(a) if !args.bench && !stopped => {
                    format!("; final test accuracy {:.2}%", 100.0 * a)
                }
                _ => String::new(),
            }
        );
    }
    // Bit-for-bit the same parameters print the same line (resume tests): every
    // stage's fingerprint, in stage order.
    let prints: Vec<u64> = kolo.allgather_object("digits.fingerprints", fingerprint(&part)?)?;
    if kolo.rank() == 0 {
        let stage_prints: Vec<String> = prints[..stages]
            .iter()
            .map(|p| format!("{p:016x}"))
            .collect();
        println!(
            "parameters fingerprint {} after step {step}",
            stage_prints.join("-")
        );
    }
    if stopped {
        return Ok(None);
    }
    Ok(last_acc)
}
