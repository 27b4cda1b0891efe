//! Issue 57 on Burn: `GradientReducer::algorithm` (ByteGrad within its bound of the
//! exact average, Adasum equal to the tree of the ranks' gradients), the ranks'
//! agreement on the algorithm, and `decentralized_average` of model weights.

use anyhow::{ensure, Result};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::Device;
use kolo::algorithms::adasum_tree;
use kolo::{Algorithm, Kolo};
use kolo_burn::{broadcast_parameters, decentralized_average, GradientReducer, WeightAverager};

use super::sharded::g_values;
use super::{assert_close, grads_for, params, Small};

/// This rank's gradients of the shared model (its own batch).
fn local(k: &Kolo, model: &Small, device: &Device) -> GradientsParams {
    let r = k.rank();
    grads_for(model, r * 8..r * 8 + 8, device)
}

/// ByteGrad (compressing on one host too): every rank gets the same gradients, within the quantisation bound of
/// the exact average (each value: at most the largest rank's gradient range / 255)
/// and not equal to it; Adasum: the tree of the ranks' flattened gradients. A
/// reducer set to decentralized and an overlapped step with ByteGrad are refused.
pub(crate) fn reducer_algorithms(k: &Kolo) -> Result<()> {
    let size = k.size();
    let device = Device::flex().autodiff();
    device.seed(57);
    let model = broadcast_parameters(k, Small::new(&device), 0)?;
    let mine = g_values(&model, &local(k, &model, &device));
    let exact = GradientReducer::new(k)
        .prefix("exact")
        .reduce(&model, local(k, &model, &device))?;
    let exact = g_values(&model, &exact);
    // Hierarchical (the default) on one host: full precision, exactly the average.
    let one_host = GradientReducer::new(k)
        .prefix("byte.h")
        .algorithm(Algorithm::ByteGrad)
        .reduce(&model, local(k, &model, &device))?;
    if k.cross_size() == 1 {
        assert_close(
            "hierarchical ByteGrad on one host",
            &g_values(&model, &one_host),
            &exact,
            0.0,
        )?;
    }
    let byte = GradientReducer::new(k)
        .prefix("byte")
        .algorithm(Algorithm::ByteGrad)
        .hierarchical(false)
        .reduce(&model, local(k, &model, &device))?;
    let byte = g_values(&model, &byte);
    let all: Vec<Vec<f32>> = k.allgather_object("algo.mine", mine)?;
    let range = |v: &[f32]| {
        v.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            - v.iter().copied().fold(f32::INFINITY, f32::min)
    };
    let bound = all.iter().map(|v| range(v)).fold(0.0f32, f32::max) / 255.0 + 1e-7;
    assert_close("ByteGrad against the exact average", &byte, &exact, bound)?;
    let seen: Vec<Vec<f32>> = k.allgather_object("algo.byte", byte.clone())?;
    ensure!(
        seen.windows(2).all(|w| w[0] == w[1]),
        "ByteGrad results differ between ranks"
    );
    if size > 1 {
        ensure!(
            byte != exact,
            "ByteGrad equals the exact average: nothing was quantised"
        );
    }
    let ada = GradientReducer::new(k)
        .prefix("ada")
        .algorithm(Algorithm::Adasum)
        .reduce(&model, local(k, &model, &device))?;
    let ada = g_values(&model, &ada);
    // One bucket: Adasum's dot products are over all of it, in any order.
    assert_close("Adasum against the tree", &ada, &adasum_tree(all), 1e-6)?;
    let err = GradientReducer::new(k)
        .prefix("dec")
        .algorithm(Algorithm::Decentralized)
        .reduce(&model, local(k, &model, &device))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.contains("WeightAverager::after_step"),
        "decentralized reduce: {err:?}"
    );
    let err = GradientReducer::new(k)
        .prefix("ov")
        .algorithm(Algorithm::ByteGrad)
        .overlap(&model)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(err.contains("call reduce"), "overlapped ByteGrad: {err:?}");
    Ok(())
}

/// Ranks that chose different algorithms fail at the first reduce, every one of them,
/// naming each rank's choice.
pub(crate) fn disagreement(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let model = broadcast_parameters(k, Small::new(&device), 0)?;
    let algorithm = if k.rank() == 1 {
        Algorithm::ByteGrad
    } else {
        Algorithm::Allreduce
    };
    let err = GradientReducer::new(k)
        .algorithm(algorithm)
        .reduce(&model, local(k, &model, &device))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        err.contains("rank 1: bytegrad") && err.contains("rank 0: allreduce"),
        "rank {}: {err:?}",
        k.rank()
    );
    Ok(())
}

/// Decentralized averaging of whole models: ranks that start apart reach the mean of
/// their weights (log2 N rounds at a power of two), keep their parameters' ids and
/// train on afterwards.
pub(crate) fn decentralized_weights(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(100 + rank as u64);
    let mut model = Small::new(&device);
    let start = params(&model);
    let all: Vec<Vec<f32>> = k.allgather_object("dec.start", start.clone())?;
    let mean: Vec<f32> = (0..start.len())
        .map(|i| all.iter().map(|v| v[i]).sum::<f32>() / size as f32)
        .collect();
    let rounds = if size.is_power_of_two() {
        size.trailing_zeros()
    } else {
        40
    };
    let id = model.fc1.weight.id;
    for step in 0..u64::from(rounds) {
        model = decentralized_average(k, model, step)?;
    }
    assert_close("decentralized average", &params(&model), &mean, 1e-6)?;
    ensure!(model.fc1.weight.id == id, "the parameter's id changed");
    // Still trains: the averaged weights require their gradients.
    let grads = local(k, &model, &device);
    ensure!(
        !g_values(&model, &grads).is_empty(),
        "no gradients after averaging"
    );
    let mut optim = SgdConfig::new().init();
    let stepped = optim.step(0.1, model, grads);
    ensure!(params(&stepped) != mean, "the step changed nothing");
    // The same start through kolo_burn::WeightAverager in low precision: every rank
    // within 1e-6 of the mean after 80 gossip rounds, ids kept; async averaging (a
    // round every step, finished) lands every rank on the mean too.
    let fresh = || -> Result<Small> {
        device.seed(100 + rank as u64);
        Ok(Small::new(&device))
    };
    ensure!(params(&fresh()?) == start, "the start is not reproducible");
    let mut gossip = WeightAverager::new(k, Algorithm::Decentralized8Bit)?;
    let mut model = fresh()?;
    let id = model.fc1.weight.id;
    for _ in 0..80 {
        model = gossip.after_step(model)?;
    }
    assert_close("decentralized-8bit average", &params(&model), &mean, 1e-6)?;
    ensure!(model.fc1.weight.id == id, "the parameter's id changed");
    let mut avg =
        WeightAverager::new(k, Algorithm::Async)?.period(kolo::algorithms::AsyncPeriod::Steps(1));
    let mut model = fresh()?;
    model = avg.after_step(model)?;
    model = avg.finish(model)?;
    assert_close("async average", &params(&model), &mean, 1e-6)?;
    Ok(())
}

/// 1-bit Adam: with compression off it is Burn's Adam on the averaged gradients (to
/// 1e-6 after 10 steps); with compression after a 3-step warm-up every rank holds the
/// same weights and the loss falls at least half as far as Adam's.
pub(crate) fn onebit_adam(k: &Kolo) -> Result<()> {
    use burn::optim::AdamConfig;
    use kolo::algorithms::OneBitAdamConfig;
    let device = Device::flex().autodiff();
    device.seed(58);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let (mut plain, mut one) = (start.clone(), start.clone());
    let reducer = GradientReducer::new(k).prefix("onebit.ref");
    let mut adam = AdamConfig::new().init();
    let mut off = kolo_burn::OneBitAdam::new(
        k,
        OneBitAdamConfig {
            compression: false,
            ..Default::default()
        },
    );
    for _ in 0..10 {
        let g = reducer.reduce(&plain, local(k, &plain, &device))?;
        plain = adam.step(0.01, plain, g);
        let g = local(k, &one, &device);
        one = off.step(0.01, one, g)?;
    }
    assert_close(
        "1-bit Adam without compression against Adam",
        &params(&one),
        &params(&plain),
        1e-6,
    )?;
    let mut on = kolo_burn::OneBitAdam::new(
        k,
        OneBitAdamConfig {
            warmup: 3,
            ..Default::default()
        },
    );
    let loss = |m: &Small| -> Result<f32> {
        let (x, y) = super::samples(0..64, &device);
        let l = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&device)
            .forward(m.forward(x), y);
        Ok(l.into_data().iter::<f32>().next().unwrap_or(f32::NAN))
    };
    // Against Adam on the averaged gradients, the same batches: at least half its
    // fall in loss.
    let batch = |step: usize| {
        let lo = (step * 4 + k.rank()) * 8 % 56;
        lo..lo + 8
    };
    let (mut m, mut reference) = (start.clone(), start);
    let mut adam = AdamConfig::new().init();
    let before = loss(&m)?;
    for step in 0..40 {
        m = on.step(0.01, m.clone(), grads_for(&m, batch(step), &device))?;
        let g = reducer.reduce(&reference, grads_for(&reference, batch(step), &device))?;
        reference = adam.step(0.01, reference, g);
    }
    let (after, plain_after) = (loss(&m)?, loss(&reference)?);
    ensure!(
        after < before - 0.5 * (before - plain_after),
        "loss {before} → {after} (Adam: {plain_after}): 1-bit Adam did not train"
    );
    let all: Vec<Vec<f32>> = k.allgather_object("onebit.weights", params(&m))?;
    ensure!(
        all.windows(2).all(|w| w[0] == w[1]),
        "the ranks' weights differ"
    );
    ensure!(
        on.state().worker_error.iter().any(|&e| e != 0.0) || k.size() == 1,
        "no error feedback after compressed steps"
    );
    Ok(())
}
