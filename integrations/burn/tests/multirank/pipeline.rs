//! Issue 36: pipeline parallelism (`kolo_burn::Pipeline`) against one process training
//! the whole model on the whole batch.

use anyhow::{ensure, Result};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use kolo::Kolo;
use kolo_burn::{broadcast_parameters, Pipeline, Schedule};

use super::{assert_close, params, samples};

/// Layer widths of the 4-layer MLP (8 features in, 4 classes out).
const WIDTHS: [usize; 5] = [8, 16, 16, 16, 4];

/// Consecutive layers of the MLP: a whole model, or one stage of it.
#[derive(Module, Debug)]
pub(crate) struct Layers {
    layers: Vec<Linear>,
}

impl Layers {
    fn new(device: &Device) -> Self {
        Layers {
            layers: WIDTHS
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
        }
    }

    /// Layers `range` of this model.
    fn part(&self, range: std::ops::Range<usize>) -> Layers {
        Layers {
            layers: self.layers[range].to_vec(),
        }
    }

    /// ReLU after every layer but the model's last (`ends` says this part holds it).
    fn forward(&self, mut x: Tensor<2>, ends: bool) -> Tensor<2> {
        let n = self.layers.len();
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(x);
            if !(ends && i + 1 == n) {
                x = relu(x);
            }
        }
        x
    }
}

/// One pipeline step of `part` on samples `ids` with cross-entropy (the batch on the
/// first stage, the targets on the last).
fn step_on(
    pipe: &mut Pipeline,
    part: &Layers,
    ids: std::ops::Range<usize>,
    device: &Device,
) -> kolo_burn::Result<kolo_burn::StepOutput> {
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let (x, y) = samples(ids, device);
    let ends = pipe.is_last();
    let first = pipe.is_first().then_some(x);
    pipe.step(
        part,
        first,
        |m: &Layers, x: Tensor<2>| m.forward(x, ends),
        |out, rows| loss_fn.forward(out, y.clone().slice(rows)),
    )
}

fn optimizer(adam: bool) -> ModuleOptimizer {
    if adam {
        AdamConfig::new().init()
    } else {
        SgdConfig::new().init()
    }
}

/// The layers stage `stage` of `stages` holds.
fn stage_layers(stage: usize, stages: usize) -> std::ops::Range<usize> {
    let n = WIDTHS.len() - 1;
    stage * n / stages..(stage + 1) * n / stages
}

/// 20 steps of `stages` stages × the remaining replicas give every stage the
/// parameters that one process training the whole model on the whole batch gives
/// its layers, for SGD and Adam and both schedules.
fn equivalent(k: &Kolo, stages: usize) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(31);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let (b, micro) = (8, 4);
    for schedule in [Schedule::OneFOneB, Schedule::FillDrain] {
        for adam in [false, true] {
            let whole = broadcast_parameters(k, Layers::new(&device), 0)?;
            let mut pipe = Pipeline::new(k, stages)?
                .micro_batches(micro)
                .schedule(schedule);
            let (stage, replica, replicas) = (pipe.stage(), pipe.replica(), pipe.replicas());
            let range = stage_layers(stage, stages);
            let mut part = pipe.broadcast_parameters(whole.part(range.clone()))?;
            let (mut reference, mut ref_optim) = (whole, optimizer(adam));
            let mut optim = optimizer(adam);
            let mut last_loss = None;
            for step in 0..20 {
                // This replica's batch, and the whole batch of all replicas.
                let base = step * b * replicas;
                let mine = base + replica * b..base + (replica + 1) * b;
                let out = step_on(&mut pipe, &part, mine, &device)?;
                part = optim.step(0.05, part, out.grads);
                last_loss = out.loss;

                let (xa, ya) = samples(base..base + b * replicas, &device);
                let loss = loss_fn.forward(reference.forward(xa, true), ya);
                let grads = GradientsParams::from_grads(loss.backward(), &reference);
                reference = ref_optim.step(0.05, reference, grads);
            }
            let what = format!(
                "{stages} stages × {replicas} replicas, {schedule:?}, {}: stage {stage}",
                if adam { "Adam" } else { "SGD" }
            );
            assert_close(&what, &params(&part), &params(&reference.part(range)), 1e-5)?;
            ensure!(
                last_loss.is_some() == pipe.is_last(),
                "{what}: only the last stage reports the loss"
            );
            // Each rank holds only its stage: the stages of one replica add up to the
            // model.
            let held = params(&part).len();
            let all: Vec<usize> = k.allgather_object("pipeline.held", held)?;
            let per_replica: usize = all[..stages].iter().sum();
            ensure!(
                per_replica == params(&reference).len() && (stages == 1 || held < per_replica),
                "{what}: stages hold {all:?} parameters, the model {}",
                params(&reference).len()
            );
        }
    }
    Ok(())
}

/// S = N at np 2 and np 4, and S = 2 × 2 replicas at np 4.
pub(crate) fn equivalence(k: &Kolo) -> Result<()> {
    equivalent(k, k.size())?;
    if k.size() == 4 {
        equivalent(k, 2)?;
    }
    Ok(())
}

/// Bad input fails on every rank with a message naming the stage: a stage count that
/// does not divide the ranks, a stage whose input does not fit what the previous
/// stage sends, a batch the micro-batches do not divide; after a bad batch the
/// pipeline trains on.
pub(crate) fn bad_input(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let size = k.size();
    let e = Pipeline::new(k, size + 1)
        .map(|_| ())
        .map_err(|e| e.to_string());
    ensure!(
        e.as_ref().is_err_and(|m| m.contains(&format!(
            "{} pipeline stages do not divide the {size} ranks",
            size + 1
        ))),
        "a stage count that does not divide the ranks: {e:?}"
    );
    // Stage 1 takes 7 features where stage 0 gives 16.
    let mut pipe = Pipeline::new(k, 2)?.micro_batches(4);
    let model = if pipe.is_first() {
        Layers {
            layers: vec![LinearConfig::new(8, 16).init(&device)],
        }
    } else {
        Layers {
            layers: vec![LinearConfig::new(7, 4).init(&device)],
        }
    };
    let e = step_on(&mut pipe, &model, 0..8, &device)
        .map(|_| ())
        .map_err(|e| e.to_string());
    ensure!(
        e.as_ref()
            .is_err_and(|m| m.contains("pipeline stage 1 (ranks")
                && m.contains("failed on an input of shape [2, 16]")),
        "a stage whose input does not fit: {e:?}"
    );

    // A batch of 10 rows cannot be cut into 4 micro-batches, at the first step and
    // at a later one; a good batch then trains.
    let model = Layers::new(&device).part(stage_layers(pipe.stage(), 2));
    for (rows, good) in [(10, false), (8, true), (10, false), (8, true)] {
        let r = step_on(&mut pipe, &model, 0..rows, &device)
            .map(|_| ())
            .map_err(|e| e.to_string());
        match (good, &r) {
            (true, Ok(())) => {}
            (false, Err(m))
                if m.contains("a batch of 10 rows cannot be cut into 4 equal micro-batches") => {}
            _ => anyhow::bail!("a batch of {rows} rows: {r:?}"),
        }
    }
    Ok(())
}

/// Trains `steps` of `pipe` on `part` from batch `from` on (SGD-free: Adam, so that a
/// resume must restore its state too).
fn train_steps(
    pipe: &mut Pipeline,
    mut part: Layers,
    optim: &mut ModuleOptimizer,
    steps: std::ops::Range<usize>,
    device: &Device,
) -> Result<Layers> {
    let b = 8;
    for step in steps {
        let base = step * b * pipe.replicas();
        let mine = base + pipe.replica() * b..base + (pipe.replica() + 1) * b;
        let out = step_on(pipe, &part, mine, device)?;
        part = optim.step(0.01, part, out.grads);
    }
    Ok(part)
}

/// Each stage saves its own model and Adam state; a fresh pipeline resumes from them
/// and trains on exactly as the uninterrupted one; only the last step is kept; a
/// pipeline of another number of stages is refused.
pub(crate) fn checkpoint(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(41);
    let dir: String = k.broadcast_object(
        "pipeline.dir",
        std::env::temp_dir()
            .join(format!("kolo-pipeline-ckpt-{}", std::process::id()))
            .display()
            .to_string(),
        0,
    )?;
    let dir = std::path::PathBuf::from(dir);
    let stages = 2;
    let mut pipe = Pipeline::new(k, stages)?.micro_batches(2);
    let range = stage_layers(pipe.stage(), stages);
    let whole = broadcast_parameters(k, Layers::new(&device), 0)?;
    let part = pipe.broadcast_parameters(whole.part(range.clone()))?;
    let mut optim = optimizer(true);
    let part = train_steps(&mut pipe, part, &mut optim, 0..3, &device)?;
    pipe.save_checkpoint(&dir, &part, &optim, 3)?;
    let straight = train_steps(&mut pipe, part, &mut optim, 3..6, &device)?;

    // A fresh start: other weights, a new optimizer, a new pipeline.
    let mut again = Pipeline::new(k, stages)?.micro_batches(2);
    let fresh = Layers::new(&device).part(range.clone());
    let restored = again
        .load_checkpoint(&dir, fresh, optimizer(true))?
        .ok_or_else(|| anyhow::anyhow!("no checkpoint found in {}", dir.display()))?;
    ensure!(restored.step == 3, "resumed at step {}", restored.step);
    let mut optim = restored.optim;
    let resumed = train_steps(&mut again, restored.model, &mut optim, 3..6, &device)?;
    assert_close(
        "resumed pipeline",
        &params(&resumed),
        &params(&straight),
        1e-6,
    )?;

    again.save_checkpoint(&dir, &resumed, &optim, 6)?;
    k.barrier()?;
    ensure!(
        !dir.join("step-3").exists() && again.checkpoint_dir(&dir, 6).exists(),
        "after saving step 6, step 3 is still there or step 6 is not"
    );
    if k.size() == 4 {
        let four = Pipeline::new(k, 4)?;
        let e = four
            .load_checkpoint(&dir, Layers::new(&device), optimizer(true))
            .map(|_| ())
            .map_err(|e| e.to_string());
        ensure!(
            e.as_ref()
                .is_err_and(|m| m.contains("written by a pipeline of 2 stages")),
            "a 4-stage pipeline loading a 2-stage checkpoint: {e:?}"
        );
    }
    k.barrier()?;
    if k.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

/// Issue 53 item 7: at np 4 with 2 stages × 2 replicas, replica 1's batch cannot be
/// cut into the micro-batches at step 1 (uneven shards): every rank's step 1 fails
/// (replica 1 with the batch error, replica 0 naming a rank of replica 1), nobody
/// hangs, and the steps after it keep the replicas in step: each stage's parameters
/// are bit-identical on both replicas.
pub(crate) fn uneven_shards(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(57);
    let mut pipe = Pipeline::new(k, 2)?.micro_batches(4);
    let whole = broadcast_parameters(k, Layers::new(&device), 0)?;
    let mut part = pipe.broadcast_parameters(whole.part(stage_layers(pipe.stage(), 2)))?;
    let mut optim = SgdConfig::new().init();
    for step in 0..4 {
        let rows = if step == 1 && pipe.replica() == 1 {
            6
        } else {
            8
        };
        let base = step * 100 + pipe.replica() * 10;
        let r = step_on(&mut pipe, &part, base..base + rows, &device);
        match (step, r) {
            (1, Err(e)) => {
                let e = e.to_string();
                let want = if pipe.replica() == 1 {
                    "a batch of 6 rows cannot be cut into 4 equal micro-batches"
                } else {
                    "could not finish this pipeline step: "
                };
                ensure!(e.contains(want), "rank {}: step 1: {e}", k.rank());
            }
            (1, Ok(_)) => anyhow::bail!("rank {}: step 1 went through", k.rank()),
            (_, Ok(out)) => part = optim.step(0.05, part, out.grads),
            (_, Err(e)) => anyhow::bail!("rank {}: step {step}: {e}", k.rank()),
        }
    }
    let bits: Vec<u32> = params(&part).iter().map(|x| x.to_bits()).collect();
    let all: Vec<Vec<u32>> = k.allgather_object("uneven.params", bits)?;
    for stage in 0..2 {
        ensure!(
            all[stage] == all[stage + 2],
            "stage {stage}: its replicas hold different parameters after the failed step"
        );
    }
    Ok(())
}

/// Issue 53 item 19: stages built with different micro-batches fail the first step on
/// every rank, naming each rank's count, instead of waiting for sends that never come.
pub(crate) fn plans_differ(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let micro = if k.rank() == k.size() - 1 { 2 } else { 4 };
    let mut pipe = Pipeline::new(k, k.size())?.micro_batches(micro);
    let model = Layers::new(&device).part(stage_layers(pipe.stage(), k.size()));
    let e = step_on(&mut pipe, &model, 0..8, &device)
        .map(|_| ())
        .map_err(|e| e.to_string());
    ensure!(
        e.as_ref()
            .is_err_and(|m| m.contains("differ in micro-batches or schedule")
                && m.contains(&format!("rank {}: 2 micro-batches", k.size() - 1))),
        "rank {}: {e:?}",
        k.rank()
    );
    Ok(())
}

/// Issue 53 item 20: one stage per rank (3 or 4 stages, both schedules); at step 1
/// stage 1's forward ignores its input, so its first backward pass fails ("its output
/// does not depend on its input"). Every stage's step 1 fails within seconds — the
/// stages before it told through the gradients they wait for, those after it through
/// the activations or the step's agreement — naming that failure, and step 2 trains
/// on every rank. (The stages before it waited for ever; after it, under fill-drain,
/// the stages that had every activation finished the step alone.)
pub(crate) fn mid_step_failure(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(58);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    // One pipeline for both schedules: its step numbers go on (a failed step leaves
    // tensors a new pipeline's same-numbered step would take).
    let mut pipe = Pipeline::new(k, k.size())?.micro_batches(4);
    for schedule in [Schedule::OneFOneB, Schedule::FillDrain] {
        pipe = pipe.schedule(schedule);
        let whole = broadcast_parameters(k, Layers::new(&device), 0)?;
        let mut part = whole.part(stage_layers(pipe.stage(), k.size()));
        let mut optim = SgdConfig::new().init();
        let ends = pipe.is_last();
        for step in 0..3usize {
            let (x, y) = samples(step * 8..step * 8 + 8, &device);
            let breaks = step == 1 && pipe.stage() == 1;
            let start = std::time::Instant::now();
            let r = pipe.step(
                &part,
                pipe.is_first().then_some(x),
                |m: &Layers, x: Tensor<2>| {
                    let x = if breaks { x.detach() } else { x };
                    m.forward(x, ends)
                },
                |out, rows| loss_fn.forward(out, y.clone().slice(rows)),
            );
            let took = start.elapsed();
            match (step, r) {
                (1, Err(e)) => {
                    let e = e.to_string();
                    ensure!(
                        e.contains("its output does not depend on its input"),
                        "rank {} ({schedule:?}): step 1 failed otherwise: {e}",
                        k.rank()
                    );
                    // Rank 1 its own error; the others the one passed on to them, or,
                    // where every tensor they needed had come, the step's agreement's.
                    let told = match pipe.stage() {
                        0 => e.contains("a later stage failed"),
                        1 => e.contains("stage 1"),
                        _ => {
                            e.contains("an earlier stage failed")
                                || e.contains("could not finish this pipeline step")
                        }
                    };
                    ensure!(told, "rank {} ({schedule:?}): {e}", k.rank());
                    ensure!(
                        took < std::time::Duration::from_secs(20),
                        "rank {}: step 1 failed after {took:?}",
                        k.rank()
                    );
                }
                (1, Ok(_)) => {
                    anyhow::bail!("rank {} ({schedule:?}): step 1 went through", k.rank())
                }
                (_, Ok(out)) => part = optim.step(0.05, part, out.grads),
                (_, Err(e)) => anyhow::bail!("rank {} ({schedule:?}): step {step}: {e}", k.rank()),
            }
        }
        k.barrier()?;
    }
    Ok(())
}
