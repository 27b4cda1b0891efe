//! Issue 53 (reliability review 2): trained weights equal plain Burn's where a
//! parameter is frozen or has no gradient anywhere.

use anyhow::{ensure, Result};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::Device;
use kolo::Kolo;
use kolo_burn::{broadcast_parameters, GradientReducer, ShardedOptimizer};

use super::{assert_close, grads_for, params, samples, Small};

/// AdamW with weight decay: the decay moves every parameter it is given, so a
/// parameter handed a zero gradient moves where plain Burn leaves it.
fn adamw() -> ModuleOptimizer {
    AdamWConfig::new().with_weight_decay(0.1).init()
}

/// The bits of `m`'s parameters.
fn bits<M: Module>(m: &M) -> Vec<u32> {
    params(m).iter().map(|x| x.to_bits()).collect()
}

/// Item 1: a first layer frozen with `no_grad()`, trained under AdamW with weight
/// decay through the reducer (after backward and overlapped), the sharded optimizer
/// (element ranges and whole tensors): each equals plain Burn on the whole batch, and
/// the frozen layer is bit-identical to where it started.
pub(crate) fn frozen_layer(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(53);
    let mut start = broadcast_parameters(k, Small::new(&device), 0)?;
    start.fc1 = start.fc1.no_grad();
    let frozen = bits(&start.fc1);
    let b = 6;
    let steps = 8;
    let mut reference = start.clone();
    let mut plain = adamw();
    for step in 0..steps {
        let base = step * b * size;
        let grads = grads_for(&reference, base..base + b * size, &device);
        reference = plain.step(0.05, reference, grads);
    }
    ensure!(
        bits(&reference.fc1) == frozen,
        "plain Burn moved the frozen layer: the test proves nothing"
    );
    for path in ["reducer", "overlap", "sharded", "sharded by tensors"] {
        let reducer = GradientReducer::new(k).prefix(format!("frozen.{path}"));
        let mut optim = adamw();
        let mut sharded = match path {
            "sharded by tensors" => Some(ShardedOptimizer::by_tensors(k, adamw())),
            "sharded" => Some(ShardedOptimizer::new(k, adamw())),
            _ => None,
        };
        let mut model = start.clone();
        for step in 0..steps {
            let base = step * b * size;
            let ids = base + rank * b..base + (rank + 1) * b;
            model = match (&mut sharded, path) {
                (Some(s), _) => s.step(0.05, model.clone(), grads_for(&model, ids, &device))?,
                (None, "overlap") => {
                    let (x, y) = samples(ids, &device);
                    let sync = reducer.overlap(&model)?;
                    let h = model.act.forward(sync.layer(&model.fc1, &x).forward(x));
                    let out = sync.layer(&model.fc2, &h).forward(h);
                    let loss = CrossEntropyLossConfig::new().init(&device).forward(out, y);
                    let grads = GradientsParams::from_grads(loss.backward(), &model);
                    let grads = sync.finish(&model, grads)?;
                    optim.step(0.05, model, grads)
                }
                (None, _) => {
                    let grads = reducer.reduce(&model, grads_for(&model, ids, &device))?;
                    optim.step(0.05, model, grads)
                }
            };
        }
        ensure!(
            bits(&model.fc1) == frozen,
            "{path}: the frozen layer moved (AdamW's decay on a zero gradient?)"
        );
        assert_close(
            &format!("{path} with a frozen layer"),
            &params(&model),
            &params(&reference),
            1e-5,
        )?;
        if let Some(s) = &sharded {
            // Only fc2's weight and bias are sharded: the frozen layer has no state.
            let held = match s.shard() {
                Some(blocks) => blocks.len(),
                None => s
                    .owned_parameters()
                    .map_or(0, |o| o.iter().max().map_or(0, |&i| i + 1).max(o.len())),
            };
            let most: Vec<usize> = k.allgather_object(format!("frozen.held.{path}"), held)?;
            ensure!(
                most.iter().max() == Some(&2),
                "{path}: ranks hold parameters up to {most:?}, not the 2 trainable ones"
            );
        }
    }
    Ok(())
}

#[derive(Module, Debug)]
struct Heads {
    body: Linear,
    act: Relu,
    head: Linear,
    /// Never used in forward: no rank ever has a gradient for it.
    unused: Linear,
}

impl Heads {
    fn grads(&self, ids: std::ops::Range<usize>, device: &Device) -> GradientsParams {
        let (x, y) = samples(ids, device);
        let out = self.head.forward(self.act.forward(self.body.forward(x)));
        let loss = CrossEntropyLossConfig::new().init(device).forward(out, y);
        GradientsParams::from_grads(loss.backward(), self)
    }
}

/// Item 1: a layer no rank has a gradient for (an unused head) gets none, so AdamW
/// leaves it bit-identical, through the reducer and the sharded optimizer, which
/// equal plain Burn on the whole batch.
pub(crate) fn unused_layer(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(54);
    let start = Heads {
        body: LinearConfig::new(8, 16).init(&device),
        act: Relu::new(),
        head: LinearConfig::new(16, 4).init(&device),
        unused: LinearConfig::new(4, 4).init(&device),
    };
    let start = broadcast_parameters(k, start, 0)?;
    let unused = bits(&start.unused);
    let b = 6;
    let steps = 6;
    let mut reference = start.clone();
    let mut plain = adamw();
    for step in 0..steps {
        let base = step * b * size;
        let grads = reference.grads(base..base + b * size, &device);
        reference = plain.step(0.05, reference, grads);
    }
    for path in ["reducer", "sharded"] {
        let reducer = GradientReducer::new(k).prefix(format!("unused.{path}"));
        let mut optim = adamw();
        let mut sharded = ShardedOptimizer::new(k, adamw());
        let mut model = start.clone();
        for step in 0..steps {
            let base = step * b * size;
            let ids = base + rank * b..base + (rank + 1) * b;
            let grads = model.grads(ids, &device);
            model = if path == "sharded" {
                sharded.step(0.05, model, grads)?
            } else {
                optim.step(0.05, model.clone(), reducer.reduce(&model, grads)?)
            };
        }
        ensure!(
            bits(&model.unused) == unused,
            "{path}: a layer without a gradient on any rank moved"
        );
        assert_close(
            &format!("{path} with an unused layer"),
            &params(&model),
            &params(&reference),
            1e-5,
        )?;
    }
    Ok(())
}

/// Item 5: f16 gradients whose norm is far above 256, clipped to a global norm of 1
/// by the sharded optimizer (whole tensors and element ranges): one SGD step of lr 1
/// moves the parameters by a vector of norm 1 (an f16 sum of squares overflows to inf
/// and scaled every gradient by 0).
pub(crate) fn half_clip_global_norm(k: &Kolo) -> Result<()> {
    use burn::optim::SgdConfig;
    use burn::tensor::FloatDType;
    let mut device = Device::flex();
    device
        .configure(FloatDType::F16)
        .map_err(|e| anyhow::anyhow!("configuring the flex device for f16: {e:?}"))?;
    let device = device.autodiff();
    device.seed(55);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let rank = k.rank();
    for whole in [true, false] {
        let sgd = SgdConfig::new().init();
        let mut sharded = if whole {
            ShardedOptimizer::by_tensors(k, sgd)
        } else {
            ShardedOptimizer::new(k, sgd)
        }
        .clip_global_norm(1.0);
        let (x, y) = samples(rank * 8..rank * 8 + 8, &device);
        let loss = CrossEntropyLossConfig::new()
            .init(&device)
            .forward(start.forward(x), y);
        let grads = GradientsParams::from_grads((loss * 4000.0).backward(), &start);
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        let g: Vec<f32> = [&start.fc1.weight, &start.fc2.weight]
            .iter()
            .filter_map(|p| grads.get::<2>(p.id))
            .flat_map(|t| {
                let d = t.into_data().convert::<f32>();
                d.try_to_vec::<f32>().unwrap_or_default()
            })
            .collect();
        ensure!(
            norm(&g) > 256.0,
            "the local gradients' norm is {}: the test needs one above 256",
            norm(&g)
        );
        let after = sharded.step(1.0, start.clone(), grads)?;
        let moved: Vec<f32> = params(&after)
            .iter()
            .zip(params(&start))
            .map(|(a, b)| a - b)
            .collect();
        let n = norm(&moved);
        ensure!(
            (0.9..1.1).contains(&n),
            "by {}: the clipped step moved the parameters by a norm of {n}, not 1",
            if whole { "tensors" } else { "elements" }
        );
    }
    Ok(())
}

/// Item 4: `SyncBatchNorm` on f16 and bf16 inputs whose per-channel sums of squares
/// pass f16's 65504 equals Burn's f32 `BatchNorm` on the combined batch (the same
/// rounded inputs) to within the type's precision, output and running statistics.
/// (Inputs around 10: around 100, the one-pass variance E[x²] − E[x]² loses ~13 of
/// f32's bits to cancellation, as for f32 inputs.)
fn sync_bn_half(k: &Kolo, dtype: burn::tensor::FloatDType, tol: f32) -> Result<()> {
    use burn::nn::BatchNormConfig;
    use burn::tensor::{Tensor, TensorData};
    let (rank, size) = (k.rank(), k.size());
    let (b, c, hw) = (64usize, 3usize, 16usize);
    let per_row = c * hw;
    let total = b * size;
    // Around 10 (a channel's squares sum to ~1.2e5 per rank), spread over a few units.
    let whole: Vec<f32> = (0..total * per_row)
        .map(|i| 10.0 + ((i * 37 + 11) % 101) as f32 / 25.0 + (i % 3) as f32)
        .collect();
    let mut half = Device::flex();
    half.configure(dtype)
        .map_err(|e| anyhow::anyhow!("configuring the flex device for {dtype:?}: {e:?}"))?;
    let half = half.autodiff();
    let read = |t: Tensor<4>| -> Result<Vec<f32>> {
        t.into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))
    };
    let config = BatchNormConfig::new(c).with_momentum(0.5);
    let sync = kolo_burn::SyncBatchNorm::new(k, &config, &half);
    let mine = whole[rank * b * per_row..(rank + 1) * b * per_row].to_vec();
    let x = Tensor::<4>::from_data(TensorData::new(mine, [b, c, 4, 4]), &half);
    ensure!(x.dtype() == dtype.into(), "the input is {:?}", x.dtype());
    let out = sync.forward(x.clone());
    ensure!(
        out.dtype() == dtype.into(),
        "the output is {:?}",
        out.dtype()
    );
    let got = read(out)?;
    // The reference: f32, one process, the whole batch rounded as the ranks saw it.
    let f32_device = Device::flex().autodiff();
    let rounded = Tensor::<4>::from_data(TensorData::new(whole, [total, c, 4, 4]), &half);
    let rounded = rounded.into_data().convert::<f32>();
    let plain = config.init(&f32_device);
    let want = read(plain.forward(Tensor::<4>::from_data(rounded, &f32_device)))?;
    let want = &want[rank * b * per_row..(rank + 1) * b * per_row];
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| {
            if g.is_finite() {
                (g - w).abs()
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0f32, f32::max);
    ensure!(
        worst <= tol,
        "{dtype:?}: outputs differ from f32 BatchNorm by up to {worst} (tolerance {tol})"
    );
    let stats = |bn_mean: Tensor<1>, bn_var: Tensor<1>| -> Result<Vec<f32>> {
        let mut v = read(bn_mean.reshape([1, 1, 1, c]))?;
        v.extend(read(bn_var.reshape([1, 1, 1, c]))?);
        Ok(v)
    };
    let got = stats(sync.running_mean.value(), sync.running_var.value())?;
    let want = stats(plain.running_mean.value(), plain.running_var.value())?;
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| {
            if g.is_finite() {
                (g - w).abs() / w.abs().max(1.0)
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0f32, f32::max);
    ensure!(
        worst <= 4.0 * tol,
        "{dtype:?}: running statistics {got:?}, f32 BatchNorm {want:?}"
    );
    Ok(())
}

pub(crate) fn sync_bn_f16(k: &Kolo) -> Result<()> {
    sync_bn_half(k, burn::tensor::FloatDType::F16, 5e-3)
}

pub(crate) fn sync_bn_bf16(k: &Kolo) -> Result<()> {
    sync_bn_half(k, burn::tensor::FloatDType::BF16, 3e-2)
}
