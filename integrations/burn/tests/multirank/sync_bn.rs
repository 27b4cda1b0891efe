//! Issue 39: `SyncBatchNorm` on N ranks equals Burn's `BatchNorm` in one process on
//! the combined batch (forward output, input gradient, parameter gradients, running
//! statistics), for rank-3 and rank-4 inputs and uneven batches.

use anyhow::{ensure, Result};
use burn::module::Module;
use burn::nn::BatchNormConfig;
use burn::tensor::{Device, Tensor, TensorData};
use kolo::{Kolo, ReduceOp};
use kolo_burn::SyncBatchNorm;

/// `n` rows of `per_row` values, deterministic, not centred (mean about 0.7, so a
/// wrong mean shows).
fn rows(first: usize, n: usize, per_row: usize) -> Vec<f32> {
    (first * per_row..(first + n) * per_row)
        .map(|i| ((i * 37 + 11) % 101) as f32 / 40.0 - 0.55 + (i % 3) as f32 * 0.3)
        .collect()
}

fn values<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("{e:?}"))
}

/// The largest difference, relative where the reference exceeds 1 in magnitude: the
/// parameter gradients are sums over every sample and position, where f32 rounding in
/// a different order alone moves the result by more than 1e-5 absolute.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f32::max)
}

/// Sums `v` over the ranks.
fn sum_ranks(kolo: &Kolo, name: &str, v: Vec<f32>) -> Result<Vec<f32>> {
    let n = v.len();
    Ok(kolo
        .allreduce(name, kolo::Tensor::from_vec(v, &[n])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f32>()?)
}

/// The comparison for inputs of rank `D` (`[B] ++ rest`).
fn check<const D: usize>(kolo: &Kolo, rest: &[usize], sizes: &[usize]) -> Result<()> {
    let (rank, n) = (kolo.rank(), kolo.size());
    ensure!(sizes.len() == n, "{} sizes for {n} ranks", sizes.len());
    ensure!(rest.len() + 1 == D, "shape rest {rest:?} for rank {D}");
    let c = rest[0];
    let per_row: usize = rest.iter().product();
    let device = Device::flex().autodiff();
    let config = BatchNormConfig::new(c).with_momentum(0.3);
    let sync = SyncBatchNorm::new(kolo, &config, &device);
    let plain = config.init(&device);
    // Gamma and beta away from 1 and 0, the same in both.
    let gamma: Vec<f32> = (0..c).map(|i| 0.5 + i as f32 * 0.25).collect();
    let beta: Vec<f32> = (0..c).map(|i| i as f32 * 0.1 - 0.2).collect();
    let set = |t: &burn::module::Param<Tensor<1>>, v: &[f32]| {
        t.clone().map(|_| {
            Tensor::<1>::from_data(TensorData::new(v.to_vec(), [c]), &device).require_grad()
        })
    };
    let mut sync = sync;
    sync.gamma = set(&sync.gamma, &gamma);
    sync.beta = set(&sync.beta, &beta);
    let mut plain = plain;
    plain.gamma = set(&plain.gamma, &gamma);
    plain.beta = set(&plain.beta, &beta);

    let total: usize = sizes.iter().sum();
    let start: usize = sizes[..rank].iter().sum();
    let mine = sizes[rank];
    let shape = |b: usize| {
        let mut s = [0usize; D];
        s[0] = b;
        s[1..].copy_from_slice(rest);
        s
    };
    for step in 0..2 {
        let base = step * total;
        // This rank's samples through SyncBatchNorm; a fixed weighting makes the loss.
        let x = Tensor::<D>::from_data(
            TensorData::new(rows(base + start, mine, per_row), shape(mine)),
            &device,
        )
        .require_grad();
        let w = Tensor::<D>::from_data(
            TensorData::new(rows(base + start + 7, mine, per_row), shape(mine)),
            &device,
        );
        let y = sync.forward(x.clone());
        let grads = (y.clone() * w).sum().backward();
        // The combined batch through BatchNorm, in this process.
        let gx = Tensor::<D>::from_data(
            TensorData::new(rows(base, total, per_row), shape(total)),
            &device,
        )
        .require_grad();
        let mut gw_rows = Vec::new();
        for (r, &s) in sizes.iter().enumerate() {
            let first: usize = sizes[..r].iter().sum();
            gw_rows.extend(rows(base + first + 7, s, per_row));
        }
        let gw = Tensor::<D>::from_data(TensorData::new(gw_rows, shape(total)), &device);
        let gy = plain.forward(gx.clone());
        let ggrads = (gy.clone() * gw).sum().backward();

        let lo = start * per_row;
        let hi = lo + mine * per_row;
        let out = values(y)?;
        let want = values(gy)?;
        let d = max_diff(&out, &want[lo..hi]);
        ensure!(d <= 1e-5, "rank {rank} step {step}: outputs differ by {d}");
        let dx = values(
            x.grad(&grads)
                .ok_or_else(|| anyhow::anyhow!("no input gradient"))?,
        )?;
        let want_dx = values(
            gx.grad(&ggrads)
                .ok_or_else(|| anyhow::anyhow!("no reference gradient"))?,
        )?;
        let d = max_diff(&dx, &want_dx[lo..hi]);
        ensure!(
            d <= 1e-5,
            "rank {rank} step {step}: input gradients differ by {d}"
        );
        for (what, mine, theirs) in [
            ("gamma", sync.gamma.val(), plain.gamma.val()),
            ("beta", sync.beta.val(), plain.beta.val()),
        ] {
            let g = values(
                mine.grad(&grads)
                    .ok_or_else(|| anyhow::anyhow!("no {what} grad"))?,
            )?;
            // Each rank's parameter gradient covers its samples: summed over ranks
            // they are the combined batch's.
            let g = sum_ranks(kolo, &format!("{what}.{step}"), g)?;
            let want = values(
                theirs
                    .grad(&ggrads)
                    .ok_or_else(|| anyhow::anyhow!("no {what} reference"))?,
            )?;
            let d = max_diff(&g, &want);
            ensure!(
                d <= 1e-5,
                "rank {rank} step {step}: {what} gradients differ by {d}"
            );
        }
        for (what, a, b) in [
            (
                "running mean",
                sync.running_mean.value(),
                plain.running_mean.value(),
            ),
            (
                "running var",
                sync.running_var.value(),
                plain.running_var.value(),
            ),
        ] {
            let d = max_diff(&values(a)?, &values(b)?);
            ensure!(d <= 1e-5, "rank {rank} step {step}: {what} differs by {d}");
        }
    }
    // Evaluation: the running statistics, no communication (a collective here would
    // hang: only rank 0 evaluates).
    if rank == 0 {
        let x = Tensor::<D>::from_data(TensorData::new(rows(0, 2, per_row), shape(2)), &device);
        let a = values(sync.valid().forward(x.clone().inner()))?;
        let b = values(plain.valid().forward(x.inner()))?;
        let d = max_diff(&a, &b);
        ensure!(d <= 1e-6, "evaluation outputs differ by {d}");
    }
    kolo.barrier()?;
    // The record loads into a plain BatchNorm.
    let back = config.init(&device).load_record(sync.into_record());
    let d = max_diff(
        &values(back.running_var.value())?,
        &values(plain.running_var.value())?,
    );
    ensure!(
        d <= 1e-5,
        "a SyncBatchNorm record loaded into BatchNorm differs by {d}"
    );
    Ok(())
}

/// `[B, C, L]` inputs, 3 samples per rank.
pub(crate) fn sync_bn_rank3(kolo: &Kolo) -> Result<()> {
    check::<3>(kolo, &[4, 5], &vec![3; kolo.size()])
}

/// `[B, C, H, W]` inputs, 2 samples per rank.
pub(crate) fn sync_bn_rank4(kolo: &Kolo) -> Result<()> {
    check::<4>(kolo, &[3, 4, 4], &vec![2; kolo.size()])
}

/// An uneven last batch: rank r holds r + 1 samples (rank-4 inputs).
pub(crate) fn sync_bn_uneven(kolo: &Kolo) -> Result<()> {
    let sizes: Vec<usize> = (1..=kolo.size()).collect();
    check::<4>(kolo, &[3, 2, 3], &sizes)
}

/// Issue 53 item 28: rank 1 makes one more `SyncBatchNorm` (never used) before the
/// model's, so the process-wide numbers of the model's layer differ between the
/// ranks; the layer still equals `BatchNorm` on the combined batch (its allreduces
/// went under different names, and the job hung).
pub(crate) fn sync_bn_extra_layer_on_one_rank(kolo: &Kolo) -> Result<()> {
    let _extra = (kolo.rank() == 1)
        .then(|| SyncBatchNorm::new(kolo, &BatchNormConfig::new(3), &Device::flex().autodiff()));
    check::<3>(kolo, &[4, 5], &vec![3; kolo.size()])
}
