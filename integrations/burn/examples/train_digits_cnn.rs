//! A small convolutional network on the embedded 8×8 digits, data-parallel with
//! kolo-burn, its batch norms synchronized across ranks (`kolo_burn::SyncBatchNorm`).
//!
//! ```sh
//! kolorun -np 2 target/release/examples/train_digits_cnn [--epochs 10] [--batch-size 8] \
//!     [--norm sync|batch] [--checkpoint DIR [--resume]] [--min-accuracy 0.97]
//! ```
//!
//! Two 3×3 convolutions (16 and 32 channels), each followed by batch norm and ReLU,
//! a 2×2 max pool and a linear head; Adam, the gradients averaged by kolo's
//! `GradientReducer`. With small per-rank batches (`--batch-size 8`) plain
//! `BatchNorm` (`--norm batch`) normalizes each rank's few samples by their own
//! statistics; `SyncBatchNorm` (the default) by the global batch's, as one process
//! training on the combined batch would. Rank 0 prints the loss and test accuracy
//! averaged over the ranks after every epoch and last `final test accuracy …%`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::Device;
use clap::{Parser, ValueEnum};
use kolo_burn::{
    average_metrics, broadcast_optimizer_state, broadcast_parameters, commit, DistributedSampler,
    GradientReducer, Progress,
};

#[path = "../../shared/digits.rs"]
mod digits;
use digits::{load_digits, Digits};

#[path = "common/cnn.rs"]
mod cnn;
#[path = "common/fingerprint.rs"]
mod fingerprint;
use cnn::{batch, Cnn};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Norm {
    /// kolo_burn::SyncBatchNorm: statistics of the global batch.
    Sync,
    /// burn::nn::BatchNorm: statistics of each rank's own samples.
    Batch,
}

#[derive(Parser, Debug)]
#[command(about = "Train a small CNN on the digits across ranks with SyncBatchNorm")]
struct Args {
    /// Epochs to train (in total, counting those restored from a checkpoint).
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// The batch norm layers: synchronized across ranks, or each rank's own.
    #[arg(long, value_enum, default_value_t = Norm::Sync)]
    norm: Norm,
    /// Seed of the data split, the shuffles and the initial weights.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Save a checkpoint to this directory after every epoch (rank 0 writes it).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Resume from the checkpoint in --checkpoint (also when relaunched by kolorun).
    #[arg(long, requires = "checkpoint")]
    resume: bool,
    /// Measure throughput only: no evaluation, no checkpoints.
    #[arg(long)]
    bench: bool,
    /// Fail (exit 1) when the final test accuracy is below this fraction.
    #[arg(long)]
    min_accuracy: Option<f64>,
}

/// Correct predictions of the evaluation copy `model` (running statistics, no
/// communication) on `ids`.
fn correct(model: &Cnn, d: &Digits, ids: &[usize], device: &Device) -> anyhow::Result<usize> {
    let mut n = 0;
    for chunk in ids.chunks(256) {
        let (x, _) = batch(d, chunk, device);
        let pred = model
            .forward(x)
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        n += pred
            .iter()
            .zip(chunk)
            .filter(|(p, &i)| **p == d.y[i])
            .count();
    }
    Ok(n)
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
        let line = format!("train_digits_cnn: {e:#}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        std::process::exit(code);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    // Before any thread starts: Burn loads optimizer state on its default device,
    // CUDA in a build with the `cuda` feature, even when training on the CPU.
    if std::env::var_os("BURN_DEVICE").is_none() {
        std::env::set_var("BURN_DEVICE", kolo_burn::Backend::Flex.burn_device_name());
    }
    let kolo = kolo::init()?;
    let (rank, size) = (kolo.rank(), kolo.size());
    let plain_device = Device::flex();
    let device = plain_device.clone().autodiff();
    let data = load_digits(args.seed);
    device.seed(args.seed);
    let model = broadcast_parameters(
        &kolo,
        Cnn::new((args.norm == Norm::Sync).then_some(&kolo), &device),
        0,
    )?;
    let optim = AdamConfig::new().init();
    // This run's commit if there is one (a relaunch, a requeued Slurm job), any with
    // --resume; another run's is an error, never loaded or overwritten.
    let restored = match &args.checkpoint {
        Some(dir) => kolo_burn::resume(&kolo, dir, model.clone(), optim.clone(), args.resume)?,
        None => None,
    };
    let (mut model, optim, start) = match restored {
        Some(r) => (r.model, r.optim, r.progress.map_or(r.step, |p| p.epoch)),
        None => (model, optim, 0),
    };
    let mut optim = broadcast_optimizer_state(&kolo, optim, 0)?;
    if rank == 0 {
        println!(
            "kolo-burn: training a CNN with {} on {} digits ({} held out) on {size} ranks, batch {}/rank, from epoch {start}",
            match args.norm {
                Norm::Sync => "SyncBatchNorm",
                Norm::Batch => "BatchNorm",
            },
            data.train.len(),
            data.test.len(),
            args.batch_size
        );
    }
    let reducer = GradientReducer::new(&kolo);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let sampler = DistributedSampler::new(data.train.len(), rank, size, args.seed);
    let test_shard: Vec<usize> = DistributedSampler::new(data.test.len(), rank, size, 0)
        .without_shuffle()
        .indices(0)
        .into_iter()
        .map(|i| data.test[i])
        .collect();
    let started = Instant::now();
    let (mut steps, mut accuracy) = (0u64, 0.0);
    for epoch in start..args.epochs as u64 {
        let shard = sampler.indices(epoch);
        let mut loss_sum = 0.0;
        for idx in shard.chunks(args.batch_size) {
            let ids: Vec<usize> = idx.iter().map(|&i| data.train[i]).collect();
            let (x, y) = batch(&data, &ids, &device);
            let loss = loss_fn.forward(model.forward(x), y);
            if !args.bench {
                let v = loss
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?;
                loss_sum += f64::from(v[0]) * ids.len() as f64;
            }
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = reducer.reduce(&model, grads)?;
            model = optim.step(args.lr, model, grads);
            steps += 1;
        }
        if args.bench {
            continue;
        }
        let right = correct(&model.valid(), &data, &test_shard, &plain_device)?;
        let avg = average_metrics(
            &kolo,
            "epoch",
            &[
                loss_sum / shard.len().max(1) as f64,
                right as f64 / test_shard.len().max(1) as f64,
            ],
            test_shard.len() as f64,
        )?;
        accuracy = avg[1];
        if rank == 0 {
            println!(
                "epoch {:3}/{}: loss {:.4}  test accuracy {:.2}%",
                epoch + 1,
                args.epochs,
                avg[0],
                100.0 * avg[1]
            );
        }
        if let Some(dir) = &args.checkpoint {
            let progress = Progress {
                epoch: epoch + 1,
                consumed: 0,
                step: steps,
                seed: args.seed,
                ranks: size as u64,
            };
            commit(&kolo, dir, &model, &optim, &progress).context("saving the checkpoint")?;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    if rank == 0 {
        println!(
            "RESULT steps_per_s={:.4}",
            steps as f64 / secs.max(f64::MIN_POSITIVE)
        );
        if !args.bench {
            // Compared by the tests and scripts/chaos-soak.sh: a run resumed from its
            // commits trains the same parameters as one that never stopped.
            println!(
                "parameters fingerprint {:016x} after epoch {}",
                fingerprint::fingerprint(&model)?,
                args.epochs
            );
        }
        println!(
            "trained {steps} steps per rank in {secs:.2} s on {size} ranks{}",
            if args.bench {
                String::new()
            } else {
                format!("; final test accuracy {:.2}%", 100.0 * accuracy)
            }
        );
    }
    kolo.shutdown()?;
    if let (Some(min), false) = (args.min_accuracy, args.bench || start >= args.epochs as u64) {
        if accuracy < min {
            bail!(
                "test accuracy {:.2}% is below --min-accuracy {:.2}%",
                100.0 * accuracy,
                100.0 * min
            );
        }
    }
    Ok(())
}
