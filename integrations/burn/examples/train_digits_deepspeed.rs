//! The digits MLP trained by `kolo_burn::Engine` from a DeepSpeed config, as a
//! DeepSpeed user's loop reads: `engine.forward`, `engine.backward(loss)`,
//! `engine.step()`, everything else in the JSON file.
//!
//! ```sh
//! kolorun -np 2 target/release/examples/train_digits_deepspeed \
//!     --deepspeed_config integrations/burn/examples/configs/ds_digits.json
//! ```
//!
//! The bundled config is the seed style: Adam with betas [0.8, 0.999], a WarmupLR
//! schedule, fp16 with dynamic loss scaling, ZeRO stage 3 with both offloads,
//! activation checkpointing, a per-phase time breakdown. The last line is `final test
//! accuracy X%`, as the other examples'.

use anyhow::bail;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Parser;
use kolo_burn::{average_metrics, DistributedSampler, Engine};

#[path = "../../shared/digits.rs"]
mod digits;
use digits::{load_digits, Digits};

#[derive(Parser, Debug)]
#[command(about = "Train the digits MLP with a DeepSpeed config through kolo_burn::Engine")]
struct Args {
    /// DeepSpeed's JSON config.
    #[arg(long = "deepspeed_config", alias = "deepspeed-config")]
    deepspeed_config: std::path::PathBuf,
    /// Epochs to train.
    #[arg(long, default_value_t = 10)]
    epochs: u64,
    /// Hidden units.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Seed of the weights, the split and the shuffles.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Exit with an error below this test accuracy (a fraction).
    #[arg(long)]
    min_accuracy: Option<f64>,
}

#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(Relu::new().forward(self.fc1.forward(x)))
    }
}

fn batch(d: &Digits, idx: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let mut x = Vec::with_capacity(idx.len() * 64);
    for &i in idx {
        x.extend_from_slice(&d.x[i * 64..(i + 1) * 64]);
    }
    let y: Vec<i64> = idx.iter().map(|&i| d.y[i]).collect();
    (
        Tensor::from_data(TensorData::new(x, [idx.len(), 64]), device),
        Tensor::from_data(TensorData::new(y, [idx.len()]), device),
    )
}

fn main() {
    if let Err(e) = run() {
        let line = format!("train_digits_deepspeed: {e:#}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let kolo = kolo::init()?;
    let (rank, size) = (kolo.rank(), kolo.size());
    let device = Device::flex().autodiff();
    device.seed(args.seed);
    let model = Mlp {
        fc1: LinearConfig::new(64, args.hidden).init(&device),
        fc2: LinearConfig::new(args.hidden, 10).init(&device),
    };
    let mut engine = Engine::from_config(&kolo, model, &args.deepspeed_config)?;
    let c = engine.config().clone();
    let data = load_digits(args.seed);
    if rank == 0 {
        println!(
            "kolo-burn engine: ZeRO stage {}, {} per rank × {} accumulation × {size} ranks = {} \
             per step, fp16 {}, bf16 {}",
            c.zero.stage,
            c.micro_batch_per_rank,
            c.gradient_accumulation_steps,
            c.train_batch_size,
            c.fp16.enabled,
            c.bf16
        );
    }
    let device = engine.device().clone();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let sampler = DistributedSampler::new(data.train.len(), rank, size, args.seed);
    let test = DistributedSampler::new(data.test.len(), rank, size, 0).without_shuffle();
    let mut last = 0.0;
    for epoch in 0..args.epochs {
        let shard = sampler.indices(epoch);
        let mut loss_sum = 0.0;
        for idx in shard.chunks(c.micro_batch_per_rank as usize) {
            let ids: Vec<usize> = idx.iter().map(|&i| data.train[i]).collect();
            let (x, y) = batch(&data, &ids, &device);
            let out = engine.forward(x, |m: &Mlp, x| m.forward(x));
            let loss = loss_fn.forward(out, y);
            let v: f32 = loss.clone().into_scalar();
            loss_sum += f64::from(v) * ids.len() as f64;
            engine.backward(loss)?;
            engine.step()?;
        }
        // Evaluation on the whole model (gathered at stage 3), without autodiff.
        let whole = engine.module()?.valid();
        let test_ids = test.indices(0);
        let mut correct = 0usize;
        for idx in test_ids.chunks(256) {
            let ids: Vec<usize> = idx.iter().map(|&i| data.test[i]).collect();
            let (x, _) = batch(&data, &ids, &device.clone().inner());
            let pred: Vec<i64> = whole
                .forward(x)
                .argmax(1)
                .into_data()
                .convert::<i64>()
                .try_to_vec::<i64>()
                .map_err(|e| anyhow::anyhow!("{e:?}"))?;
            correct += pred
                .iter()
                .zip(&ids)
                .filter(|(p, &i)| **p == data.y[i])
                .count();
        }
        let avg = average_metrics(
            &kolo,
            "epoch",
            &[
                loss_sum / shard.len().max(1) as f64,
                correct as f64 / test_ids.len().max(1) as f64,
            ],
            test_ids.len() as f64,
        )?;
        last = avg[1];
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
    if rank == 0 {
        println!(
            "{} steps, {} skipped for fp16 overflow; final test accuracy {:.2}%",
            engine.global_steps(),
            engine.skipped_steps(),
            100.0 * last
        );
    }
    kolo.shutdown()?;
    if let Some(min) = args.min_accuracy {
        if last < min {
            bail!(
                "test accuracy {:.2}% is below --min-accuracy {:.2}%",
                100.0 * last,
                100.0 * min
            );
        }
    }
    Ok(())
}
