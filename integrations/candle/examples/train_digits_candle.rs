//! Data-parallel training of a candle MLP on the handwritten digits embedded in
//! `smartcore` (1797 8×8 images, ten classes): kolo-burn's `train_digits`, written
//! with candle and kolo-candle.
//!
//! ```sh
//! kolorun -np 2 target/release/examples/train_digits_candle [--epochs 20] \
//!     [--batch-size 32] [--lr 3e-3] [--sgd] [--backward-passes-per-step 1] \
//!     [--min-accuracy 0.95]
//! ```
//!
//! Every rank starts from rank 0's weights (`kolo_candle::broadcast_parameters`),
//! trains on its shard of each epoch (`DistributedSampler`) with `--batch-size`
//! samples per step, and steps AdamW (or `--sgd`) with the gradients averaged across
//! ranks (`kolo_candle::DistributedOptimizer`). Rank 0 prints the loss and test
//! accuracy averaged over all ranks after every epoch, and last
//! `final test accuracy …%`.

use std::time::Instant;

use anyhow::bail;
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{linear, AdamW, Linear, Module, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use clap::Parser;
use kolo_candle::{
    average_metrics, broadcast_parameters, DistributedOptimizer, DistributedSampler,
};

#[path = "../../shared/digits.rs"]
mod digits;
use digits::{load_digits, Digits};

#[derive(Parser, Debug)]
#[command(about = "Train a candle MLP on the digits across ranks with kolo-candle")]
struct Args {
    /// Passes over the training set.
    #[arg(long, default_value_t = 20)]
    epochs: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// The learning rate (AdamW's, or SGD's with --sgd).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Plain SGD instead of AdamW.
    #[arg(long)]
    sgd: bool,
    /// Accumulate this many batches' gradients per step (each batch --batch-size).
    #[arg(long, default_value_t = 1)]
    backward_passes_per_step: usize,
    /// Hidden units.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Seed of the data split and the shuffles.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Fail (exit 1) when the final test accuracy is below this fraction.
    #[arg(long)]
    min_accuracy: Option<f64>,
    /// How the ranks synchronise: allreduce, bytegrad, adasum (gradients),
    /// decentralized, decentralized-8bit, async (weights, after local steps),
    /// onebit-adam, qadam (optimizers of their own, in place of AdamW/SGD).
    #[arg(
        long,
        default_value = "allreduce",
        value_parser = |s: &str| s.parse::<kolo::Algorithm>().map_err(|e| e.to_string())
    )]
    algorithm: kolo::Algorithm,
    /// With --algorithm bytegrad: compress on one host too (by default only what
    /// crosses hosts).
    #[arg(long)]
    compress_on_one_host: bool,
}

struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn new(hidden: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Mlp {
            fc1: linear(64, hidden, vb.pp("fc1"))?,
            fc2: linear(hidden, 10, vb.pp("fc2"))?,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

/// The images and labels of `ids`.
fn batch(d: &Digits, ids: &[usize]) -> candle_core::Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(ids.len() * 64);
    let mut y = Vec::with_capacity(ids.len());
    for &i in ids {
        x.extend_from_slice(&d.x[i * 64..(i + 1) * 64]);
        y.push(d.y[i] as u32);
    }
    Ok((
        Tensor::from_vec(x, (ids.len(), 64), &Device::Cpu)?,
        Tensor::from_vec(y, ids.len(), &Device::Cpu)?,
    ))
}

/// Correct predictions on `ids`.
fn correct(model: &Mlp, d: &Digits, ids: &[usize]) -> candle_core::Result<usize> {
    let mut n = 0;
    for chunk in ids.chunks(256) {
        let (x, y) = batch(d, chunk)?;
        let pred = model.forward(&x)?.argmax(D::Minus1)?;
        n += pred
            .eq(&y)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()? as usize;
    }
    Ok(n)
}

/// A training step and the exchange's completion, whatever synchronises the ranks.
trait Stepper {
    fn step(&mut self, loss: &Tensor) -> anyhow::Result<()>;
    /// Before an evaluation: completes a weight exchange (async averaging).
    fn finish(&mut self) -> anyhow::Result<()>;
}

impl<O: Optimizer> Stepper for DistributedOptimizer<O> {
    fn step(&mut self, loss: &Tensor) -> anyhow::Result<()> {
        Ok(self.backward_step(loss)?)
    }
    fn finish(&mut self) -> anyhow::Result<()> {
        Ok(DistributedOptimizer::finish(self)?)
    }
}

/// 1-bit Adam or QAdam at a fixed learning rate.
struct OneBit(kolo_candle::OneBitAdam, f64);

impl Stepper for OneBit {
    fn step(&mut self, loss: &Tensor) -> anyhow::Result<()> {
        Ok(self.0.backward_step(self.1, loss)?)
    }
    fn finish(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
}

fn train(
    args: &Args,
    kolo: &kolo::Kolo,
    model: &Mlp,
    data: &Digits,
    mut opt: impl Stepper,
) -> anyhow::Result<f64> {
    let (rank, size) = (kolo.rank(), kolo.size());
    let sampler = DistributedSampler::new(data.train.len(), rank, size, args.seed);
    let test_shard: Vec<usize> = DistributedSampler::new(data.test.len(), rank, size, 0)
        .without_shuffle()
        .indices(0)
        .into_iter()
        .map(|i| data.test[i])
        .collect();
    let mut accuracy = 0.0;
    for epoch in 0..args.epochs {
        let shard = sampler.indices(epoch as u64);
        let mut loss_sum = 0.0;
        // Whole steps only: every rank makes the same number of passes.
        let per_step = args.batch_size * args.backward_passes_per_step;
        let used = shard.len() / per_step * per_step;
        for idx in shard[..used].chunks(args.batch_size) {
            let ids: Vec<usize> = idx.iter().map(|&i| data.train[i]).collect();
            let (x, y) = batch(data, &ids)?;
            let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
            loss_sum += f64::from(loss.to_scalar::<f32>()?) * ids.len() as f64;
            opt.step(&loss)?;
        }
        opt.finish()?;
        let right = correct(model, data, &test_shard)?;
        let avg = average_metrics(
            kolo,
            "epoch",
            &[
                loss_sum / used.max(1) as f64,
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
    }
    Ok(accuracy)
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
                    .or_else(|| c.downcast_ref().map(kolo_candle::Error::exit_code))
            })
            .unwrap_or(1);
        // One write, so that mpirun's tagged output keeps the line whole.
        let line = format!("train_digits_candle: {e:#}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        std::process::exit(code);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.batch_size == 0 || args.backward_passes_per_step == 0 {
        bail!("--batch-size and --backward-passes-per-step must be at least 1");
    }
    let kolo = kolo::init()?;
    let (rank, size) = (kolo.rank(), kolo.size());
    let data = load_digits(args.seed);
    let varmap = VarMap::new();
    let model = Mlp::new(
        args.hidden,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    // candle draws the weights at random in every process: start from rank 0's.
    broadcast_parameters(&kolo, &varmap, 0)?;
    if rank == 0 {
        println!(
            "kolo-candle: training a 64-{}-10 MLP on {} digits ({} held out) on {size} ranks, batch {}/rank{}, {}",
            args.hidden,
            data.train.len(),
            data.test.len(),
            args.batch_size,
            if args.backward_passes_per_step > 1 {
                format!(" × {} passes", args.backward_passes_per_step)
            } else {
                String::new()
            },
            if args.sgd { "SGD" } else { "AdamW" }
        );
    }
    let started = Instant::now();
    let onebit_config = kolo::algorithms::OneBitAdamConfig {
        warmup: 20,
        ..Default::default()
    };
    let accuracy = if args.algorithm == kolo::Algorithm::OneBitAdam {
        let opt = kolo_candle::OneBitAdam::new(&kolo, varmap.all_vars(), onebit_config)?;
        train(&args, &kolo, &model, &data, OneBit(opt, args.lr))?
    } else if args.algorithm == kolo::Algorithm::QAdam {
        let opt = kolo_candle::OneBitAdam::qadam(&kolo, varmap.all_vars(), onebit_config)?;
        train(&args, &kolo, &model, &data, OneBit(opt, args.lr))?
    } else if args.sgd {
        let opt = DistributedOptimizer::new(
            &kolo,
            SGD::new(varmap.all_vars(), args.lr)?,
            varmap.all_vars(),
        )?
        .backward_passes_per_step(args.backward_passes_per_step)?
        .algorithm(args.algorithm)?
        .hierarchical(!args.compress_on_one_host);
        train(&args, &kolo, &model, &data, opt)?
    } else {
        let params = ParamsAdamW {
            lr: args.lr,
            weight_decay: 0.0,
            ..ParamsAdamW::default()
        };
        let opt = DistributedOptimizer::new(
            &kolo,
            AdamW::new(varmap.all_vars(), params)?,
            varmap.all_vars(),
        )?
        .backward_passes_per_step(args.backward_passes_per_step)?
        .algorithm(args.algorithm)?
        .hierarchical(!args.compress_on_one_host);
        train(&args, &kolo, &model, &data, opt)?
    };
    if rank == 0 {
        println!(
            "trained {} epochs in {:.2} s on {size} ranks; final test accuracy {:.2}%",
            args.epochs,
            started.elapsed().as_secs_f64(),
            100.0 * accuracy
        );
    }
    kolo.shutdown()?;
    if let Some(min) = args.min_accuracy {
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
