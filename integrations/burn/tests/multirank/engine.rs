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
    // A model made of its own units: taken as it is at stage 3, refused at stage 1.
    let units = || -> kolo_burn::Result<SmallUnits> {
        Ok(SmallUnits {
            fc1: kolo_burn::FullyShard::new(k, start.fc1.clone())?,
            fc2: kolo_burn::FullyShard::new(k, start.fc2.clone())?,
        })
    };
    match Engine::new(k, units()?, config(1, "", size)?) {
        Ok(_) => anyhow::bail!("units at stage 1 were accepted"),
        Err(e) => ensure!(
            e.to_string().contains("set zero_optimization.stage to 3"),
            "{e}"
        ),
    }
    let mut engine = Engine::new(k, units()?, config(3, "", size)?)?;
    for s in 0..STEPS {
        for m in 0..ACC {
            let (x, y) = samples(ids(s, m, rank, size), &device);
            let out = engine.forward(x, |m: &SmallUnits, x| m.forward(x));
            engine.backward(loss(out, y, &device))?;
            engine.step()?;
        }
    }
    let model = engine.module()?;
    let mut got = params(&model.fc1.gathered()?);
    got.extend(params(&model.fc2.gathered()?));
    assert_close("engine with the model's own units", &got, &want, 1e-5)
}

/// `Small` with each layer a unit.
#[derive(burn::module::Module, Debug)]
struct SmallUnits {
    fc1: kolo_burn::FullyShard<burn::nn::Linear>,
    fc2: kolo_burn::FullyShard<burn::nn::Linear>,
}

impl SmallUnits {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = burn::tensor::activation::relu(self.fc1.forward(x, |l, x| l.forward(x)));
        self.fc2.forward(h, |l, x| l.forward(x))
    }
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

/// Samples per optimizer step in the resume launches (the accumulation follows the
/// ranks: 16 = 2 per micro-step × accumulation × ranks).
const GLOBAL: usize = 16;

fn resume_config(stage: u8, world: usize) -> Result<DeepSpeedConfig> {
    let text = format!(
        r#"{{"train_batch_size": {GLOBAL}, "train_micro_batch_size_per_gpu": {MICRO},
            "optimizer": {{"type": "Adam", "params": {{"lr": 0.01}}}},
            "scheduler": {{"type": "WarmupLR", "params": {{"warmup_max_lr": 0.01,
              "warmup_num_steps": 4, "warmup_type": "linear"}}}},
            "gradient_clipping": 0.5,
            "zero_optimization": {{"stage": {stage}}}}}"#
    );
    Ok(DeepSpeedConfig::from_json(&text, world as u64)?)
}

/// One optimizer step of global step `s`: this rank's micro-batches of the step's
/// `GLOBAL` samples.
fn engine_step(engine: &mut Engine<Small>, s: usize, k: &Kolo, device: &Device) -> Result<()> {
    let acc = engine.config().gradient_accumulation_steps as usize;
    for m in 0..acc {
        let base = s * GLOBAL + (m * k.size() + k.rank()) * MICRO;
        let (x, y) = samples(base..base + MICRO, device);
        let out = engine.forward(x, |m: &Small, x| m.forward(x));
        engine.backward(loss(out, y, device))?;
        engine.step()?;
    }
    Ok(())
}

fn scratch() -> Result<std::path::PathBuf> {
    std::env::var_os("KOLO_TEST_DIR")
        .map(std::path::PathBuf::from)
        .ok_or_else(|| anyhow::anyhow!("KOLO_TEST_DIR is not set"))
}

/// First launch (np 4): for stages 0, 2 and 3, three steps, `save_checkpoint`, two
/// more; rank 0 writes the parameters down.
pub(crate) fn resume_save(k: &Kolo) -> Result<()> {
    let dir = scratch()?;
    let device = Device::flex().autodiff();
    for stage in [0u8, 2, 3] {
        device.seed(63);
        let start = broadcast_parameters(k, Small::new(&device), 0)?;
        let mut engine = Engine::new(k, start, resume_config(stage, k.size())?)?;
        for s in 0..3 {
            engine_step(&mut engine, s, k, &device)?;
        }
        let progress = kolo::Progress {
            epoch: 1,
            ..kolo::Progress::default()
        };
        engine.save_checkpoint(&dir.join(format!("stage{stage}")), "step3", &progress)?;
        for s in 3..5 {
            engine_step(&mut engine, s, k, &device)?;
        }
        let after = params(&engine.module()?);
        if k.rank() == 0 {
            let bits: Vec<String> = after.iter().map(|x| x.to_bits().to_string()).collect();
            std::fs::write(dir.join(format!("after{stage}")), bits.join(" "))?;
        }
    }
    Ok(())
}

/// Second launch (np 2): each stage's engine loads `latest` (step 3) and takes the
/// same two steps: the parameters equal the uninterrupted run's (1e-6).
pub(crate) fn resume_load(k: &Kolo) -> Result<()> {
    let dir = scratch()?;
    let device = Device::flex().autodiff();
    for stage in [0u8, 2, 3] {
        let want: Vec<f32> = std::fs::read_to_string(dir.join(format!("after{stage}")))?
            .split_whitespace()
            .map(|b| b.parse::<u32>().map(f32::from_bits))
            .collect::<Result<_, _>>()?;
        let mut engine = Engine::new(k, Small::new(&device), resume_config(stage, k.size())?)?;
        let p = engine
            .load_checkpoint(&dir.join(format!("stage{stage}")), None)?
            .ok_or_else(|| anyhow::anyhow!("stage {stage}: no checkpoint"))?;
        ensure!(
            p.epoch == 1 && engine.global_steps() == 3,
            "stage {stage}: resumed at {p:?}, step {}",
            engine.global_steps()
        );
        for s in 3..5 {
            engine_step(&mut engine, s, k, &device)?;
        }
        let got = params(&engine.module()?);
        assert_close(
            &format!("stage {stage} saved at np 4, resumed at np {}", k.size()),
            &got,
            &want,
            1e-6,
        )?;
    }
    Ok(())
}

/// The chained launches: saved at np 4, resumed at np 2.
pub(crate) fn resume_trial() -> Result<(), String> {
    super::chained(
        "engine-resume",
        &[
            ("engine_resume_save", 4, "saving at np 4"),
            ("engine_resume_load", 2, "resuming at np 2"),
        ],
    )
}
