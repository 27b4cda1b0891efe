//! Issue 55: fully sharded parameters (`FullyShard` units) against `GradientReducer`
//! with the same plain optimizer.

use anyhow::{ensure, Result};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use kolo::{Kolo, ReduceOp};
use kolo_burn::{broadcast_parameters, FullyShard, GradientReducer};

use super::{assert_close, params, samples};

/// The plain model: four layers, the second frozen, the third with fewer bias
/// elements (3) than the largest rank count (4).
#[derive(Module, Debug)]
pub(crate) struct Plain {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
    fc4: Linear,
}

impl Plain {
    pub(crate) fn new(device: &Device) -> Self {
        Plain {
            fc1: LinearConfig::new(8, 16).init(device),
            fc2: LinearConfig::new(16, 16).init(device).no_grad(),
            fc3: LinearConfig::new(16, 3).init(device),
            fc4: LinearConfig::new(3, 4).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = Relu::new().forward(self.fc1.forward(x));
        let x = Relu::new().forward(self.fc2.forward(x));
        let x = Relu::new().forward(self.fc3.forward(x));
        self.fc4.forward(x)
    }
}

/// The same model, each layer a unit.
#[derive(Module, Debug)]
pub(crate) struct Sharded {
    fc1: FullyShard<Linear>,
    fc2: FullyShard<Linear>,
    fc3: FullyShard<Linear>,
    fc4: FullyShard<Linear>,
}

impl Sharded {
    /// Each unit from the plain model's layer (rank 0's values).
    pub(crate) fn from_plain(
        k: &Kolo,
        p: &Plain,
        tune: impl Fn(FullyShard<Linear>) -> FullyShard<Linear>,
    ) -> kolo_burn::Result<Self> {
        Ok(Sharded {
            fc1: tune(FullyShard::new(k, p.fc1.clone())?),
            fc2: tune(FullyShard::new(k, p.fc2.clone())?),
            fc3: tune(FullyShard::new(k, p.fc3.clone())?),
            fc4: tune(FullyShard::new(k, p.fc4.clone())?),
        })
    }

    /// The plain model's forward. fc1's and fc3's activations run inside their units,
    /// so that fc2 and fc4 take their outputs as they are (the backward overlaps
    /// them: fc1's all-gather prefetched in fc2's backward, fc2's reduce-scatter
    /// handed to fc1's); fc2's runs outside (no overlap across fc2 → fc3).
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let x = self
            .fc1
            .forward(x, |l, x| Relu::new().forward(l.forward(x)));
        let x = Relu::new().forward(self.fc2.forward(x, |l, x| l.forward(x)));
        let x = self
            .fc3
            .forward(x, |l, x| Relu::new().forward(l.forward(x)));
        self.fc4.forward(x, |l, x| l.forward(x))
    }

    /// The whole model, gathered (collective).
    pub(crate) fn gathered(&self) -> kolo_burn::Result<Plain> {
        Ok(Plain {
            fc1: self.fc1.gathered()?,
            fc2: self.fc2.gathered()?,
            fc3: self.fc3.gathered()?,
            fc4: self.fc4.gathered()?,
        })
    }
}

const MICRO: usize = 2;
const BATCH: usize = 4;

fn loss_of(out: Tensor<2>, y: Tensor<1, burn::tensor::Int>, device: &Device) -> Tensor<1> {
    CrossEntropyLossConfig::new().init(device).forward(out, y)
}

/// This rank's samples of micro-step `m` of step `step`.
fn ids(step: usize, m: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let base = (step * MICRO + m) * BATCH * size + rank * BATCH;
    base..base + BATCH
}

/// 20 Adam steps of two micro-steps each: the plain model through `GradientReducer`,
/// the sharded one through its units (forward prefetch on; an evaluation pass every
/// 7 steps); returns both models' parameters.
fn train(k: &Kolo, reshard: bool, op: ReduceOp) -> Result<(Vec<f32>, Vec<f32>, Sharded)> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(55);
    let mut plain = broadcast_parameters(k, Plain::new(&device), 0)?;
    let mut sharded = Sharded::from_plain(k, &plain, |u| {
        u.reshard_after_forward(reshard)
            .forward_prefetch(true)
            .backward_passes_per_step(MICRO)
            .op(op)
    })?;
    let reducer = GradientReducer::new(k).backward_passes_per_step(MICRO);
    let (mut opt_a, mut opt_b) = (AdamConfig::new().init(), AdamConfig::new().init());
    for step in 0..20 {
        let (mut acc_a, mut acc_b) = (GradientsAccumulator::new(), GradientsAccumulator::new());
        for m in 0..MICRO {
            let (x, y) = samples(ids(step, m, rank, size), &device);
            let loss = loss_of(plain.forward(x.clone()), y.clone(), &device);
            acc_a.accumulate(&plain, GradientsParams::from_grads(loss.backward(), &plain));
            let loss = loss_of(sharded.forward(x), y, &device);
            acc_b.accumulate(
                &sharded,
                GradientsParams::from_grads(loss.backward(), &sharded),
            );
        }
        let grads = reducer.reduce(&plain, acc_a.grads())?;
        plain = opt_a.step(0.02, plain, grads);
        sharded = opt_b.step(0.02, sharded, acc_b.grads());
        if step % 7 == 6 {
            // An evaluation copy is the units' latest blocks now: the next step's
            // forward prefetch gathers its blocks, which the training copy must not
            // take (the results below would still agree; nothing may hang).
            let (x, _) = samples(ids(step, 0, rank, size), &device);
            let eval = sharded.valid().forward(x.inner());
            ensure!(
                eval.dims()[0] == BATCH,
                "evaluation output {:?}",
                eval.dims()
            );
        }
    }
    Ok((params(&plain), params(&sharded.gathered()?), sharded))
}

/// Issue 55's equivalence: the gathered parameters after 20 steps equal the plain
/// path's to 1e-5, with units that regather in backward and units that keep their
/// graph, with accumulation and a frozen unit; and the same check catches Sum in
/// place of Average. Every rank's blocks tile each parameter.
pub(crate) fn equivalence(k: &Kolo) -> Result<()> {
    for reshard in [true, false] {
        let (plain, sharded, model) = train(k, reshard, ReduceOp::Average)?;
        let what = format!("fully sharded (reshard_after_forward {reshard})");
        assert_close(&what, &sharded, &plain, 1e-5)?;
        // Each rank holds 1/N of each parameter: blocks tile it.
        let mine: Vec<(usize, usize)> =
            model.fc1.shard().iter().map(|r| (r.start, r.end)).collect();
        let all: Vec<Vec<(usize, usize)>> = k.allgather_object("fsdp.ranges", mine)?;
        for p in 0..all[0].len() {
            ensure!(
                all.windows(2).all(|w| w[0][p].1 == w[1][p].0),
                "{what}: fc1's blocks {all:?}"
            );
        }
    }
    if k.size() > 1 {
        let (plain, sharded, _) = train(k, true, ReduceOp::Sum)?;
        ensure!(
            assert_close("Sum", &sharded, &plain, 1e-5).is_err(),
            "the check does not tell Sum from Average"
        );
    }
    Ok(())
}

/// Samples per global step in the resharding launches (divisible by 1, 2 and 4).
const GLOBAL: usize = 8;

/// This rank's gradients of global step `step` (a contiguous share of `GLOBAL`).
fn step_grads(model: &Sharded, step: usize, k: &Kolo, device: &Device) -> GradientsParams {
    let b = GLOBAL / k.size();
    let base = step * GLOBAL + k.rank() * b;
    let (x, y) = samples(base..base + b, device);
    let loss = loss_of(model.forward(x), y, device);
    GradientsParams::from_grads(loss.backward(), model)
}

/// The scratch directory the chained launches share (`KOLO_TEST_DIR`).
fn scratch() -> Result<std::path::PathBuf> {
    std::env::var_os("KOLO_TEST_DIR")
        .map(std::path::PathBuf::from)
        .ok_or_else(|| anyhow::anyhow!("KOLO_TEST_DIR is not set"))
}

/// First launch (np 4): five Adam steps of units, `save_fully_sharded`, then the step
/// an uninterrupted run takes next, whose gathered parameters rank 0 writes down.
pub(crate) fn reshard_save(k: &Kolo) -> Result<()> {
    let dir = scratch()?;
    let device = Device::flex().autodiff();
    device.seed(56);
    let plain = broadcast_parameters(k, Plain::new(&device), 0)?;
    let mut model = Sharded::from_plain(k, &plain, |u| u)?;
    let mut optim = AdamConfig::new().init();
    for step in 0..5 {
        let grads = step_grads(&model, step, k, &device);
        model = optim.step(0.02, model, grads);
    }
    kolo_burn::save_fully_sharded(k, &dir, &model, &optim, 5)?;
    let grads = step_grads(&model, 5, k, &device);
    let model = optim.step(0.02, model, grads);
    let after = params(&model.gathered()?);
    if k.rank() == 0 {
        let bits: Vec<String> = after.iter().map(|x| x.to_bits().to_string()).collect();
        std::fs::write(dir.join("after"), bits.join(" "))?;
    }
    Ok(())
}

/// Later launches (np 2, np 1): the checkpoint resumes in units at this rank count
/// and (at np 1) in the plain model with the plain optimizer, and both take the
/// uninterrupted run's next step (1e-6).
pub(crate) fn reshard_load(k: &Kolo) -> Result<()> {
    let dir = scratch()?;
    let device = Device::flex().autodiff();
    let want: Vec<f32> = std::fs::read_to_string(dir.join("after"))?
        .split_whitespace()
        .map(|b| b.parse::<u32>().map(f32::from_bits))
        .collect::<Result<_, _>>()?;
    // Fresh units (other values, other ids): the checkpoint replaces both.
    let fresh = Sharded::from_plain(k, &Plain::new(&device), |u| u)?;
    let r = kolo_burn::load_fully_sharded_checkpoint(k, &dir, fresh, AdamConfig::new().init())?
        .ok_or_else(|| anyhow::anyhow!("no checkpoint in {}", dir.display()))?;
    ensure!(r.step == 5, "checkpoint of step {}", r.step);
    let mut optim = r.optim;
    let grads = step_grads(&r.model, 5, k, &device);
    let model = optim.step(0.02, r.model, grads);
    let what = format!("units saved at np 4, resumed at np {}", k.size());
    assert_close(&what, &params(&model.gathered()?), &want, 1e-6)?;
    if k.size() == 1 {
        let r = kolo_burn::load_checkpoint(k, &dir, Plain::new(&device), AdamConfig::new().init())?
            .ok_or_else(|| anyhow::anyhow!("no checkpoint in {}", dir.display()))?;
        let (x, y) = samples(5 * GLOBAL..6 * GLOBAL, &device);
        let loss = loss_of(r.model.forward(x), y, &device);
        let grads = GradientsParams::from_grads(loss.backward(), &r.model);
        let mut optim = r.optim;
        let plain = optim.step(0.02, r.model, grads);
        assert_close(
            "plain Burn from the units' checkpoint",
            &params(&plain),
            &want,
            1e-6,
        )?;
    }
    Ok(())
}

/// The chained launches: saved at np 4, resumed at np 2 and at np 1.
pub(crate) fn reshard_trial() -> Result<(), String> {
    super::chained(
        "fsdp-reshard",
        &[
            ("fsdp_reshard_save", 4, "saving at np 4"),
            ("fsdp_reshard_load", 2, "resuming at np 2"),
            ("fsdp_reshard_load", 1, "resuming at np 1"),
        ],
    )
}

/// Issue 55's memory bound: per rank, the parameters and Adam state held between
/// steps are at most 1.1 × the unsharded model's / N + the largest unit's gathered
/// parameters (the unsharded model and plain Adam measured on this rank after the same
/// steps).
pub(crate) fn memory(k: &Kolo) -> Result<()> {
    let size = k.size();
    let device = Device::flex().autodiff();
    device.seed(57);
    let layers = [(64, 256), (256, 256), (256, 8)];
    let mut plain: Vec<Linear> = layers
        .iter()
        .map(|&(i, o)| LinearConfig::new(i, o).init(&device))
        .collect();
    plain = broadcast_parameters(k, plain, 0)?;
    let mut units = plain
        .iter()
        .map(|l| FullyShard::new(k, l.clone()))
        .collect::<kolo_burn::Result<Vec<_>>>()?;
    let (mut opt_plain, mut opt_units) = (AdamConfig::new().init(), AdamConfig::new().init());
    let reducer = GradientReducer::new(k);
    for step in 0..2 {
        let x = Tensor::<2>::ones([4, 64], &device) * (step as f32 + 1.0);
        let y = plain.iter().fold(x.clone(), |x, l| l.forward(x));
        let grads = reducer.reduce(
            &plain,
            GradientsParams::from_grads(y.sum().backward(), &plain),
        )?;
        plain = opt_plain.step(0.01, plain, grads);
        let y = units
            .iter()
            .fold(x, |x, u| u.forward(x, |l, x| l.forward(x)));
        let grads = GradientsParams::from_grads(y.sum().backward(), &units);
        units = opt_units.step(0.01, units, grads);
    }
    let bytes = |o: &burn::optim::ModuleOptimizer| -> Result<usize> {
        Ok(o.to_record()
            .into_bytes()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .len())
    };
    let whole = kolo_burn::local_param_bytes(&plain) + bytes(&opt_plain)?;
    let mine = kolo_burn::local_param_bytes(&units) + bytes(&opt_units)?;
    let largest = 4 * (256 * 256 + 256);
    let bound = 1.1 * whole as f64 / size as f64 + largest as f64;
    ensure!(
        mine as f64 <= bound,
        "np {size}: this rank holds {mine} bytes of parameters and Adam state, over \
         1.1 × {whole} / {size} + {largest} = {bound:.0}"
    );
    // And it is a share: at np N, under half the whole for N > 2.
    if size > 2 {
        ensure!(2 * mine < whole, "np {size}: {mine} of {whole} bytes");
    }
    Ok(())
}

/// Bad input: a unit whose parameters differ across ranks fails on every rank naming
/// the parameter; a unit with fewer elements than ranks (some ranks hold nothing of
/// it) trains as the plain layer does.
pub(crate) fn bad_input(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let out = if k.rank() == 1 { 17 } else { 16 };
    match FullyShard::new(k, LinearConfig::new(8, out).init(&device)) {
        Ok(_) => anyhow::bail!("units of different shapes on the ranks were accepted"),
        Err(e) => {
            let msg = e.to_string();
            ensure!(msg.contains("weight") && msg.contains("rank 1"), "{msg}");
        }
    }
    // One weight and one bias element: at np 2 and 4, rank 1 and up hold nothing.
    let tiny = broadcast_parameters(k, LinearConfig::new(1, 1).init(&device), 0)?;
    let mut unit = FullyShard::new(k, tiny.clone())?;
    let mut plain = tiny;
    let (mut oa, mut ob) = (AdamConfig::new().init(), AdamConfig::new().init());
    let reducer = GradientReducer::new(k);
    for step in 0..5 {
        let x = Tensor::<2>::ones([2, 1], &device) * (k.rank() + step) as f32;
        let g = GradientsParams::from_grads(plain.forward(x.clone()).sum().backward(), &plain);
        let g = reducer.reduce(&plain, g)?;
        plain = oa.step(0.1, plain, g);
        let y = unit.forward(x, |l, x| l.forward(x));
        let g = GradientsParams::from_grads(y.sum().backward(), &unit);
        unit = ob.step(0.1, unit, g);
    }
    assert_close(
        "a unit smaller than the ranks",
        &params(&unit.gathered()?),
        &params(&plain),
        1e-5,
    )
}

/// Issue 55's loss scaler: an inf gradient on one rank (injected at step 2, unscaled
/// before the reduction, so only that rank sees it) skips that step on every rank, the
/// scale halves (hysteresis 1) and doubles after two clean steps, and training goes
/// on.
pub(crate) fn loss_scaler(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(58);
    let mut model = broadcast_parameters(k, LinearConfig::new(4, 2).init(&device), 0)?;
    let mut scaler = kolo_burn::LossScaler::dynamic(k)
        .initial_scale_power(4)
        .loss_scale_window(2)
        .hysteresis(1);
    let reducer = GradientReducer::new(k);
    let mut optim = AdamConfig::new().init();
    let mut scales = Vec::new();
    for step in 0..5 {
        let before = params(&model);
        let x = Tensor::<2>::ones([3, 4], &device) * (1.0 + k.rank() as f32);
        let mut loss = model.forward(x).sum();
        if step == 2 && k.rank() == 1 {
            loss = loss * f32::INFINITY;
        }
        let grads = GradientsParams::from_grads(scaler.scale_loss(loss).backward(), &model);
        let applied = match scaler.unscale(&model, grads)? {
            Some(g) => {
                let g = reducer.reduce(&model, g)?;
                model = optim.step(0.01, model, g);
                true
            }
            None => false,
        };
        scales.push(scaler.scale());
        let moved = params(&model) != before;
        ensure!(
            moved == (step != 2) && applied == moved,
            "step {step} on rank {}: applied {applied}, parameters moved {moved}",
            k.rank()
        );
    }
    ensure!(
        scales == [16.0, 32.0, 16.0, 16.0, 32.0] && scaler.skipped_steps() == 1,
        "scales {scales:?}, {} skipped",
        scaler.skipped_steps()
    );
    Ok(())
}

/// Casts every float parameter to `dtype` inside the graph (gradients flow back to the
/// f32 parameters), as a unit's compute dtype does.
struct CastParams(burn::tensor::FloatDType);

impl burn::module::ModuleMapper for CastParams {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|t| t.cast(dtype))
    }
}

/// Issue 55's mixed precision: units computing in bf16 over f32 blocks, 10 Adam steps
/// at np N, stay within bf16 rounding of the same computation in one process on the
/// whole global batch (each layer's parameters and input cast to bf16, the output
/// back), and differ from the f32 run by more than that.
pub(crate) fn bf16(k: &Kolo) -> Result<()> {
    use burn::tensor::FloatDType;
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(60);
    let start = broadcast_parameters(k, Plain::new(&device), 0)?;
    let run = |dtype: Option<FloatDType>| -> Result<Vec<f32>> {
        let mut units = Sharded::from_plain(k, &start, |u| match dtype {
            Some(d) => u.compute_dtype(d),
            None => u,
        })?;
        let mut optim = AdamConfig::new().init();
        for step in 0..10 {
            let (x, y) = samples(ids(step, 0, rank, size), &device);
            let loss = loss_of(units.forward(x), y, &device);
            let g = GradientsParams::from_grads(loss.backward(), &units);
            units = optim.step(0.02, units, g);
        }
        Ok(params(&units.gathered()?))
    };
    let sharded = run(Some(FloatDType::BF16))?;
    let f32_run = run(None)?;
    // One process, the global batch of every step.
    let mut plain = start.clone();
    let mut optim = AdamConfig::new().init();
    for step in 0..10 {
        let first = ids(step, 0, 0, size).start;
        let (x, y) = samples(first..first + BATCH * size, &device);
        let cast = plain.clone().map(&mut CastParams(FloatDType::BF16));
        let h =
            |l: &Linear, x: Tensor<2>| l.forward(x.cast(FloatDType::BF16)).cast(FloatDType::F32);
        let x = Relu::new().forward(h(&cast.fc1, x));
        let x = Relu::new().forward(h(&cast.fc2, x));
        let x = Relu::new().forward(h(&cast.fc3, x));
        let out = h(&cast.fc4, x);
        let loss = loss_of(out, y, &device);
        let g = GradientsParams::from_grads(loss.backward(), &plain);
        plain = optim.step(0.02, plain, g);
    }
    assert_close(
        "bf16 units against one bf16 process",
        &sharded,
        &params(&plain),
        3e-3,
    )?;
    if std::env::var_os("KOLO_TEST_SHOW").is_some() {
        let _ = assert_close("bf16 vs one process", &sharded, &params(&plain), 0.0)
            .map_err(|e| eprintln!("{e}"));
        let _ = assert_close("bf16 vs f32", &sharded, &f32_run, 0.0).map_err(|e| eprintln!("{e}"));
    }
    ensure!(
        assert_close("bf16 against f32", &sharded, &f32_run, 3e-3).is_err(),
        "bf16 compute trained within 3e-3 of f32: the check cannot tell them apart"
    );
    Ok(())
}
