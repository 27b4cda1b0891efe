//! Issue 56: `kolo_burn::Engine` from a DeepSpeed config against the same pieces
//! assembled by hand.

use anyhow::{ensure, Result};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor};
use kolo::deepspeed::DeepSpeedConfig;
use kolo::Kolo;
use kolo_burn::{broadcast_parameters, Engine, GradientReducer};

use super::{assert_close, params, samples, Small};

const MICRO: usize = 2;
const ACC: usize = 4;
const STEPS: usize = 5;

fn config(stage: u8, extra: &str, world: usize) -> Result<DeepSpeedConfig> {
    let text = format!(
        r#"{{"train_micro_batch_size_per_gpu": {MICRO}, "gradient_accumulation_steps": {ACC},
            "optimizer": {{"type": "Adam", "params": {{"lr": 0.01}}}},
            "zero_optimization": {{"stage": {stage}}}{extra}}}"#
    );
    Ok(DeepSpeedConfig::from_json(&text, world as u64)?)
}

/// This rank's samples of micro-step `m` of step `s`.
fn ids(s: usize, m: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let base = ((s * ACC + m) * size + rank) * MICRO;
    base..base + MICRO
}

fn loss(out: Tensor<2>, y: Tensor<1, burn::tensor::Int>, device: &Device) -> Tensor<1> {
    CrossEntropyLossConfig::new().init(device).forward(out, y)
}

/// Stages 0–3 with 4 accumulation steps and Adam from the config: equal (1e-5) to
/// `GradientReducer` + AdamW (DeepSpeed's Adam, decoupled decay of 0) over the sum of
/// the micro-steps' gradients of the loss / 4.
pub(crate) fn stages(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(61);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    // By hand.
    let mut plain = start.clone();
    let mut optim = AdamWConfig::new()
        .with_weight_decay(0.0)
        .with_epsilon(1e-8)
        .init();
    let reducer = GradientReducer::new(k);
    for s in 0..STEPS {
        let mut acc = burn::optim::GradientsAccumulator::new();
        for m in 0..ACC {
            let (x, y) = samples(ids(s, m, rank, size), &device);
            let l = loss(plain.forward(x), y, &device) / ACC as f64;
            acc.accumulate(&plain, GradientsParams::from_grads(l.backward(), &plain));
        }
        let g = reducer.reduce(&plain, acc.grads())?;
        plain = optim.step(0.01, plain, g);
    }
    let want = params(&plain);
    for stage in 0..=3u8 {
        let mut engine = Engine::new(k, start.clone(), config(stage, "", size)?)?;
        let mut stepped = 0;
        for s in 0..STEPS {
            for m in 0..ACC {
                let (x, y) = samples(ids(s, m, rank, size), &device);
                let out = engine.forward(x, |m: &Small, x| m.forward(x));
                engine.backward(loss(out, y, &device))?;
                stepped += usize::from(engine.step()?);
            }
        }
        ensure!(
            stepped == STEPS && engine.global_steps() == STEPS as u64,
            "stage {stage}: {stepped} steps"
        );
        let got = params(&engine.module()?);
        assert_close(&format!("engine at stage {stage}"), &got, &want, 1e-5)?;
    }
    Ok(())
}

/// fp16 with dynamic loss scaling: an inf loss on rank 1 in step 2 skips that step on
/// every rank (the parameters do not move), the scale halves (hysteresis 1), and the
/// next steps train.
pub(crate) fn fp16_skip(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(62);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let fp16 = r#", "fp16": {"enabled": true, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 100}"#;
    let mut engine = Engine::new(k, start, config(0, fp16, size)?)?;
    let mut scales = Vec::new();
    for s in 0..4 {
        let before = params(&engine.module()?);
        let mut applied = false;
        for m in 0..ACC {
            let (x, y) = samples(ids(s, m, rank, size), &device);
            let out = engine.forward(x, |m: &Small, x| m.forward(x));
            let mut l = loss(out, y, &device);
            if s == 2 && m == 1 && rank == 1 {
                l = l * f32::INFINITY;
            }
            engine.backward(l)?;
            applied |= engine.step()?;
        }
        let moved = params(&engine.module()?) != before;
        ensure!(
            applied == (s != 2) && moved == applied,
            "step {s} on rank {rank}: applied {applied}, moved {moved}"
        );
        scales.push(engine.loss_scale().unwrap_or(0.0));
    }
    ensure!(
        scales == [256.0, 256.0, 128.0, 128.0] && engine.skipped_steps() == 1,
        "scales {scales:?}, {} skipped",
        engine.skipped_steps()
    );
    Ok(())
}
