//! `train_digits --fully-sharded [--precision bf16|f16]`: the digits MLP with each
//! layer a `kolo_burn::FullyShard` unit (ZeRO stage 3): every rank holds 1/N of each
//! layer's parameters and of Adam's state, gathers a layer's parameters for its
//! forward and backward, and receives its block of the averaged gradient. The loop is
//! plain Burn: backward, `GradientsParams::from_grads`, the plain optimizer's step.

use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::nn::Linear;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, FloatDType, Tensor};
use kolo_burn::{average_metrics, local_param_bytes, DistributedSampler, FullyShard};

use super::{
    batch, count_correct, fingerprint, learning_rate, progress_at, scalar, start_from, Args,
    Digits, Mlp,
};

/// The float type the layers compute in (`--precision`).
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum Precision {
    F32,
    Bf16,
    F16,
}

/// The MLP of the other paths, each layer a unit.
#[derive(Module, Debug)]
struct Units {
    fc1: FullyShard<Linear>,
    fc2: FullyShard<Linear>,
}

impl Units {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        // The activation inside fc1's unit: fc2 takes its output as it is, which lets
        // their backward overlap (fc1's gather prefetched, fc2's reduce-scatter
        // waited for by fc1's backward).
        let h = self
            .fc1
            .forward(x, |l, x| burn::tensor::activation::relu(l.forward(x)));
        self.fc2.forward(h, |l, x| l.forward(x))
    }
}

/// Trains with fully sharded layers; the final test accuracy (None when nothing was
/// evaluated).
pub(crate) fn train(
    args: &Args,
    kolo: &kolo::Kolo,
    device: &Device,
    data: &Digits,
) -> anyhow::Result<Option<f64>> {
    let (rank, size) = (kolo.rank(), kolo.size());
    // The same initial weights as the other paths (rank 0's, drawn from --seed).
    device.seed(args.seed);
    let whole = Mlp::new(args.hidden, device);
    let whole_bytes = local_param_bytes(&whole);
    let tune = |u: FullyShard<Linear>| match args.precision {
        Precision::F32 => u,
        Precision::Bf16 => u.compute_dtype(FloatDType::BF16),
        Precision::F16 => u.compute_dtype(FloatDType::F16),
    };
    let model = Units {
        fc1: tune(FullyShard::new(kolo, whole.fc1)?),
        fc2: tune(FullyShard::new(kolo, whole.fc2)?),
    };
    let optim = AdamConfig::new().init();
    // This run's commit if there is one, any with --resume: whole-model files, so the
    // job resumes at any number of ranks.
    let restored = match &args.checkpoint {
        Some(dir) => {
            kolo_burn::resume_fully_sharded(kolo, dir, model.clone(), optim.clone(), args.resume)?
        }
        None => None,
    };
    let (mut model, mut optim, progress) = start_from(kolo, restored, model, optim);
    let start = progress.epoch;
    // f16 gradients underflow without it: DeepSpeed's dynamic loss scaling, the same
    // steps skipped on every rank.
    let mut scaler =
        matches!(args.precision, Precision::F16).then(|| kolo_burn::LossScaler::dynamic(kolo));
    let held: Vec<usize> = kolo.allgather_object("digits.held", local_param_bytes(&model))?;
    if rank == 0 {
        println!(
            "kolo-burn: training a 64-{}-10 MLP fully sharded on {size} ranks ({:?} compute), \
             batch {}/rank; parameter bytes per rank {held:?} of {whole_bytes}",
            args.hidden, args.precision, args.batch_size
        );
    }
    let loss_fn: CrossEntropyLoss = CrossEntropyLossConfig::new().init(device);
    let sampler = DistributedSampler::new(data.train.len(), rank, size, args.seed);
    let test_shard = DistributedSampler::new(data.test.len(), rank, size, 0).without_shuffle();
    let started = Instant::now();
    let (mut samples, mut step, mut last_acc) = (0usize, progress.step, None);
    let at = |epoch, skip, steps_in, step| {
        progress_at(args, &sampler, size, epoch, skip, steps_in, step)
    };
    let mut stopped = false;
    'epochs: for epoch in start..args.epochs {
        // The epoch's samples, past those consumed before the commit resumed.
        let skip = if epoch == start {
            progress.consumed as usize
        } else {
            0
        };
        let shard = sampler.indices_from(epoch, skip);
        let steps = sampler.num_samples().div_ceil(args.batch_size);
        let done = skip / (args.batch_size * size);
        let mut loss_sum = 0.0;
        for (i, idx) in shard.chunks(args.batch_size).enumerate() {
            let lr = learning_rate(args, size, epoch as f64 + (done + i) as f64 / steps as f64);
            let ids: Vec<usize> = idx.iter().map(|&i| data.train[i]).collect();
            let (x, y) = batch(data, &ids, device);
            let loss = loss_fn.forward(model.forward(x), y);
            loss_sum += scalar(loss.clone())? * ids.len() as f64;
            model = match &mut scaler {
                Some(scaler) => {
                    let scaled = scaler.scale_loss(loss);
                    let grads = GradientsParams::from_grads(scaled.backward(), &model);
                    match scaler.unscale(&model, grads)? {
                        Some(grads) => optim.step(lr, model, grads),
                        None => model,
                    }
                }
                None => {
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    optim.step(lr, model, grads)
                }
            };
            samples += ids.len();
            step += 1;
            let stop = args.max_steps.is_some_and(|m| step >= m);
            if let Some(dir) = &args.checkpoint {
                if stop || args.commit_every.is_some_and(|k| k > 0 && step % k == 0) {
                    let p = at(epoch, skip, i + 1, step);
                    kolo_burn::commit_fully_sharded(kolo, dir, &model, &optim, &p)?;
                }
            }
            if stop {
                if rank == 0 {
                    println!("stopped after step {step} (--max-steps)");
                }
                stopped = true;
                break 'epochs;
            }
        }
        if args.bench {
            continue;
        }
        // Evaluation without autodiff: the units gather and run, nothing is recorded.
        let eval = model.valid();
        let mut correct = 0;
        let test = test_shard.indices(0);
        for idx in test.chunks(256) {
            let ids: Vec<usize> = idx.iter().map(|&i| data.test[i]).collect();
            let (x, _) = batch(data, &ids, &device.clone().inner());
            correct += count_correct(eval.forward(x), &ids, data)?;
        }
        let avg = average_metrics(
            kolo,
            "epoch",
            &[
                loss_sum / shard.len().max(1) as f64,
                correct as f64 / test.len().max(1) as f64,
            ],
            test.len() as f64,
        )?;
        last_acc = Some(avg[1]);
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
            let p = at(epoch + 1, 0, 0, step);
            kolo_burn::commit_fully_sharded(kolo, dir, &model, &optim, &p)?;
        }
    }
    if let (Some(s), 0) = (&scaler, rank) {
        println!(
            "loss scale {} after {} skipped steps",
            s.scale(),
            s.skipped_steps()
        );
    }
    let secs = started.elapsed().as_secs_f64();
    let total: usize = kolo
        .allgather_object("samples", samples)?
        .iter()
        .sum::<usize>();
    // Bit-for-bit the same parameters print the same line (resume tests): the whole
    // model's, gathered.
    let whole = Mlp {
        fc1: model.fc1.gathered()?,
        fc2: model.fc2.gathered()?,
        act: burn::nn::Relu::new(),
    };
    let print = fingerprint(&whole)?;
    let result = if stopped || start >= args.epochs {
        None
    } else {
        last_acc
    };
    if rank == 0 {
        println!(
            "trained {total} samples in {secs:.2} s: {:.0} samples/s on {size} ranks{}",
            total as f64 / secs,
            result.map_or(String::new(), |a| format!(
                "; final test accuracy {:.2}%",
                100.0 * a
            ))
        );
        println!("parameters fingerprint {print:016x} after step {step}");
    }
    Ok(result)
}
