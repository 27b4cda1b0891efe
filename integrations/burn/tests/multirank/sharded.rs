//! Issue 35: the sharded optimizer (ZeRO 1/2) against the plain one.

use anyhow::{ensure, Result};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Tensor, TensorData};
use kolo::Kolo;
use kolo_burn::{broadcast_parameters, save_checkpoint, GradientReducer, ShardedOptimizer};

use super::{assert_close, grads_for, params, Small};

/// This rank's blocks and every other rank's tile each parameter in rank order and
/// all parameters together hold `total` elements.
fn tiles(k: &Kolo, sharded: &ShardedOptimizer, total: usize, what: &str) -> Result<()> {
    let mine: Vec<(usize, usize)> = sharded
        .shard()
        .unwrap_or_default()
        .iter()
        .map(|r| (r.start, r.end))
        .collect();
    let all: Vec<Vec<(usize, usize)>> = k.allgather_object("sharded.ranges", mine)?;
    let last = &all[all.len() - 1];
    ensure!(
        last.iter().map(|r| r.1).sum::<usize>() == total,
        "{what}: blocks {all:?} of {total} elements"
    );
    for p in 0..last.len() {
        ensure!(all[0][p].0 == 0, "{what}: parameter {p} in {all:?}");
        ensure!(
            all.windows(2).all(|w| w[0][p].1 == w[1][p].0),
            "{what}: parameter {p} in {all:?}"
        );
    }
    Ok(())
}

/// 20 steps of the sharded optimizer equal 20 steps of `GradientReducer` + the same
/// plain optimizer, for Adam and SGD with momentum, on every rank.
pub(crate) fn equivalence(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(29);
    let b = 6;
    let make = |adam: bool| -> ModuleOptimizer {
        if adam {
            AdamConfig::new().init()
        } else {
            SgdConfig::new()
                .with_momentum(Some(MomentumConfig::new()))
                .init()
        }
    };
    for adam in [true, false] {
        let start = broadcast_parameters(k, Small::new(&device), 0)?;
        let mut sharded = ShardedOptimizer::new(k, make(adam));
        let mut plain = make(adam);
        let reducer = GradientReducer::new(k);
        let (mut a, mut b_model) = (start.clone(), start);
        for step in 0..20 {
            let base = step * b * size;
            let ids = base + rank * b..base + (rank + 1) * b;
            let grads = grads_for(&a, ids.clone(), &device);
            a = sharded.step(0.05, a, grads)?;
            let grads = reducer.reduce(&b_model, grads_for(&b_model, ids, &device))?;
            b_model = plain.step(0.05, b_model, grads);
        }
        let what = if adam {
            "sharded Adam"
        } else {
            "sharded SGD+momentum"
        };
        assert_close(what, &params(&a), &params(&b_model), 1e-5)?;
        // Every rank ends with the same parameters.
        let bits: Vec<u32> = params(&a).iter().map(|x| x.to_bits()).collect();
        let all: Vec<Vec<u32>> = k.allgather_object("sharded.bits", bits)?;
        ensure!(all.iter().all(|p| p == &all[0]), "{what}: ranks differ");
        // The blocks tile every parameter.
        tiles(k, &sharded, params(&a).len(), what)?;
    }
    Ok(())
}

/// A model whose first layer holds most of the parameters.
#[derive(Module, Debug)]
struct Wide {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

/// Adam's state per rank shrinks with the ranks: at np N at most 1.1 × the unsharded
/// state / N (the unsharded optimizer stepping the same model on this rank).
pub(crate) fn memory(k: &Kolo) -> Result<()> {
    let size = k.size();
    let device = Device::flex().autodiff();
    let model = Wide {
        fc1: LinearConfig::new(64, 512).init(&device),
        act: Relu::new(),
        fc2: LinearConfig::new(512, 8).init(&device),
    };
    let model = broadcast_parameters(k, model, 0)?;
    let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 4 * 64], [4, 64]), &device);
    let grads = |m: &Wide| {
        let y = m.fc2.forward(m.act.forward(m.fc1.forward(x.clone())));
        GradientsParams::from_grads(y.sum().backward(), m)
    };
    let mut sharded = ShardedOptimizer::new(k, AdamConfig::new().init());
    let g = grads(&model);
    let _ = sharded.step(1e-3, model.clone(), g)?;
    let mut plain = AdamConfig::new().init();
    let g = grads(&model);
    let _ = plain.step(1e-3, model, g);
    let unsharded = plain.to_record().into_bytes().map(|b| b.len()).unwrap_or(0);
    let mine = sharded.local_state_bytes();
    let all: Vec<usize> = k.allgather_object("sharded.bytes", mine)?;
    if k.rank() == 0 {
        eprintln!("np {size}: sharded Adam state per rank {all:?} bytes, unsharded {unsharded}");
    }
    let bound = 1.1 * unsharded as f64 / size as f64;
    ensure!(unsharded > 0, "the plain optimizer holds no state");
    ensure!(
        all.iter().all(|&b| (b as f64) <= bound),
        "state per rank {all:?} above 1.1 x {unsharded} / {size} = {bound:.0}"
    );
    Ok(())
}

/// Ranks whose models differ fail on every rank, naming the parameter.
pub(crate) fn bad_model(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    let model = Wide {
        fc1: LinearConfig::new(8, 16 + k.rank()).init(&device),
        act: Relu::new(),
        fc2: LinearConfig::new(16 + k.rank(), 4).init(&device),
    };
    let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 8], [1, 8]), &device);
    let y = model.fc2.forward(model.act.forward(model.fc1.forward(x)));
    let g = GradientsParams::from_grads(y.sum().backward(), &model);
    let mut sharded = ShardedOptimizer::new(k, AdamConfig::new().init());
    match sharded.step(1e-3, model, g) {
        Ok(_) => anyhow::bail!("models that differ were stepped"),
        Err(e) => {
            let m = e.to_string();
            ensure!(m.contains("fc1.weight") && m.contains("rank 1"), "{m}");
        }
    }
    // A model whose largest parameter has fewer elements than ranks: refused on every
    // rank, naming both counts (some rank would hold no block of anything).
    let tiny = LinearConfig::new(1, 1).init(&device);
    let x = Tensor::<2>::from_data(TensorData::new(vec![0.5f32], [1, 1]), &device);
    let g = GradientsParams::from_grads(tiny.forward(x).sum().backward(), &tiny);
    let mut sharded = ShardedOptimizer::new(k, AdamConfig::new().init());
    match sharded.step(1e-3, tiny.clone(), g) {
        Ok(_) => anyhow::bail!("a model of 1-element parameters was sharded over 2 ranks"),
        Err(e) => {
            let m = e.to_string();
            ensure!(
                m.contains("largest parameter has 1 elements") && m.contains("2 ranks"),
                "{m}"
            );
        }
    }
    // A bucket size of 0 for the overlap: refused naming the setting.
    let mut sharded = ShardedOptimizer::new(k, AdamConfig::new().init()).bucket_bytes(0);
    match sharded.overlap(&tiny) {
        Ok(_) => anyhow::bail!("an overlap with buckets of 0 bytes started"),
        Err(e) => {
            let m = e.to_string();
            ensure!(m.contains("ShardedOptimizer::bucket_bytes"), "{m}");
        }
    }
    Ok(())
}

/// The global batch of the resharding test: the same samples at every rank count.
const GLOBAL: usize = 24;

/// This rank's samples of global step `step` (a contiguous share of `GLOBAL`).
fn share(step: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let b = GLOBAL / size;
    let base = step * GLOBAL;
    base + rank * b..base + (rank + 1) * b
}

/// The scratch directory the chained launches share (`KOLO_TEST_DIR`).
fn scratch() -> Result<std::path::PathBuf> {
    std::env::var_os("KOLO_TEST_DIR")
        .map(std::path::PathBuf::from)
        .ok_or_else(|| anyhow::anyhow!("KOLO_TEST_DIR is not set"))
}

/// First launch (np 4): five steps of sharded Adam, the consolidated state saved with
/// `save_checkpoint`, then the step an uninterrupted run takes next, whose parameters
/// rank 0 writes down for the later launches.
pub(crate) fn reshard_save(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let dir = scratch()?;
    let device = Device::flex().autodiff();
    device.seed(31);
    let mut model = broadcast_parameters(k, Small::new(&device), 0)?;
    let mut optim = ShardedOptimizer::new(k, AdamConfig::new().init());
    for step in 0..5 {
        let grads = grads_for(&model, share(step, rank, size), &device);
        model = optim.step(0.05, model, grads)?;
    }
    let full = optim.consolidate(&model)?;
    save_checkpoint(k, &dir, &model, &full, 5)?;
    let grads = grads_for(&model, share(5, rank, size), &device);
    let model = optim.step(0.05, model, grads)?;
    if rank == 0 {
        let bits: Vec<String> = params(&model)
            .iter()
            .map(|x| x.to_bits().to_string())
            .collect();
        std::fs::write(dir.join("after"), bits.join(" "))?;
    }
    Ok(())
}

/// Later launches (np 2, np 1): the checkpoint of `reshard_save` resumes sharded at
/// this rank count and unsharded (the plain optimizer loading the consolidated state),
/// and both take the uninterrupted run's next step.
pub(crate) fn reshard_load(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let dir = scratch()?;
    let device = Device::flex().autodiff();
    let want: Vec<f32> = std::fs::read_to_string(dir.join("after"))?
        .split_whitespace()
        .map(|b| b.parse::<u32>().map(f32::from_bits))
        .collect::<Result<_, _>>()?;
    let r = kolo_burn::load_checkpoint(k, &dir, Small::new(&device), AdamConfig::new().init())?
        .ok_or_else(|| anyhow::anyhow!("no checkpoint in {}", dir.display()))?;
    ensure!(r.step == 5, "checkpoint of step {}", r.step);
    let mut sharded = ShardedOptimizer::new(k, AdamConfig::new().init());
    sharded.load_consolidated(&r.model, &r.optim)?;
    let grads = grads_for(&r.model, share(5, rank, size), &device);
    let a = sharded.step(0.05, r.model.clone(), grads)?;
    assert_close(
        &format!("sharded Adam saved at np 4, resumed at np {size}"),
        &params(&a),
        &want,
        1e-5,
    )?;
    let mut plain = r.optim;
    let grads = GradientReducer::new(k)
        .reduce(&r.model, grads_for(&r.model, share(5, rank, size), &device))?;
    let b = plain.step(0.05, r.model, grads);
    assert_close(
        &format!("the plain optimizer from the consolidated state, at np {size}"),
        &params(&b),
        &want,
        1e-5,
    )?;
    // A state that is not this model's is refused on every rank, naming the parameter.
    refuses_another_model(
        ShardedOptimizer::new(k, AdamConfig::new().init()),
        &plain,
        &device,
    )
}

/// `fresh` refuses `state` for a model it is not the state of (on every rank), naming
/// the first parameter.
fn refuses_another_model(
    mut fresh: ShardedOptimizer,
    state: &ModuleOptimizer,
    device: &Device,
) -> Result<()> {
    let other = Wide {
        fc1: LinearConfig::new(8, 16).init(device),
        act: Relu::new(),
        fc2: LinearConfig::new(16, 4).init(device),
    };
    match fresh.load_consolidated(&other, state) {
        Ok(()) => anyhow::bail!("another model's optimizer state was taken"),
        Err(e) => ensure!(e.to_string().contains("fc1.weight"), "{e}"),
    }
    Ok(())
}

/// The chained launches: saved at np 4, resumed at np 2 and at np 1.
pub(crate) fn reshard_trial() -> Result<(), String> {
    super::chained(
        "sharded-reshard",
        &[
            ("sharded_reshard_save", 4, "saving at np 4"),
            ("sharded_reshard_load", 2, "resuming at np 2"),
            ("sharded_reshard_load", 1, "resuming at np 1"),
        ],
    )
}

/// 20 steps of `sharded` and of `reference` (given this step's gradients, returns the
/// model after it) from `start`, on this rank's share of the same global batches.
fn run_both(
    k: &Kolo,
    start: &Small,
    sharded: &mut ShardedOptimizer,
    mut reference: impl FnMut(Small, GradientsParams) -> Result<Small>,
    device: &Device,
) -> Result<(Small, Small)> {
    let (rank, size) = (k.rank(), k.size());
    let b = 6;
    let (mut a, mut r) = (start.clone(), start.clone());
    for step in 0..20 {
        let base = step * b * size;
        let ids = base + rank * b..base + (rank + 1) * b;
        let grads = grads_for(&a, ids.clone(), device);
        a = sharded.step(0.05, a, grads)?;
        let grads = grads_for(&r, ids, device);
        r = reference(r, grads)?;
    }
    Ok((a, r))
}

/// The largest difference between two parameter lists.
fn worst(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Clipping: the wrapped optimizer's clipping by norm per parameter and by value, and
/// the sharded optimizer's global norm, give what `GradientReducer` + the plain
/// optimizer (clipping the same way) gives; and each of them changed the result.
pub(crate) fn clipping(k: &Kolo) -> Result<()> {
    use burn::grad_clipping::GradientClippingConfig as Clip;
    let device = Device::flex().autodiff();
    device.seed(37);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    // Unclipped, for "clipping changed something".
    let reducer = GradientReducer::new(k);
    let mut plain: ModuleOptimizer = AdamConfig::new().init();
    let mut unclipped = ShardedOptimizer::new(k, AdamConfig::new().init());
    let (free, _) = run_both(
        k,
        &start,
        &mut unclipped,
        reduced(&reducer, &mut plain),
        &device,
    )?;
    for (what, clip) in [
        ("norm per parameter", Clip::Norm(0.05)),
        ("value", Clip::Value(0.01)),
    ] {
        let make = || {
            AdamConfig::new()
                .with_grad_clipping(Some(clip.clone()))
                .init()
        };
        let mut sharded = ShardedOptimizer::new(k, make());
        let mut plain = make();
        let (a, r) = run_both(
            k,
            &start,
            &mut sharded,
            reduced(&reducer, &mut plain),
            &device,
        )?;
        assert_close(
            &format!("clipped by {what}"),
            &params(&a),
            &params(&r),
            1e-5,
        )?;
        let moved = worst(&params(&a), &params(&free));
        ensure!(
            moved > 1e-3,
            "clipping by {what} changed the parameters by only {moved}"
        );
    }
    // Global norm, with SGD + momentum: the reference clips the reduced gradients by
    // the norm of all of them together before the plain optimizer.
    let max = 0.1f32;
    let make = || -> ModuleOptimizer {
        SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new()))
            .init()
    };
    let mut sharded = ShardedOptimizer::new(k, make()).clip_global_norm(max);
    let mut plain = make();
    let mut clipped_steps = 0;
    let (a, r) = run_both(
        k,
        &start,
        &mut sharded,
        |m, g| {
            let (g, clipped) = clip_global(&m, reducer.reduce(&m, g)?, max);
            clipped_steps += usize::from(clipped);
            Ok(plain.step(0.05, m, g))
        },
        &device,
    )?;
    ensure!(
        clipped_steps > 0,
        "the global norm never exceeded {max}: the test clips nothing"
    );
    assert_close("clipped by the global norm", &params(&a), &params(&r), 1e-5)?;
    Ok(())
}

/// The reference step: `reducer`'s gradients, then `plain`'s step.
fn reduced<'a>(
    reducer: &'a GradientReducer,
    plain: &'a mut ModuleOptimizer,
) -> impl FnMut(Small, GradientsParams) -> Result<Small> + 'a {
    move |m, g| {
        let g = reducer.reduce(&m, g)?;
        Ok(plain.step(0.05, m, g))
    }
}

/// `g` clipped to the global norm `max` as PyTorch's `clip_grad_norm_` does, and
/// whether it was clipped.
fn clip_global(m: &Small, g: GradientsParams, max: f32) -> (GradientsParams, bool) {
    let squares: f64 = g_values(m, &g)
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum();
    let coef = (f64::from(max) / (squares.sqrt() + 1e-6)).min(1.0);
    (scaled(m, g, coef as f32), coef < 1.0)
}

/// Every gradient of `m` in `g`, flattened in module order.
pub(crate) fn g_values(m: &Small, g: &GradientsParams) -> Vec<f32> {
    struct Read<'a>(&'a GradientsParams, Vec<f32>);
    impl burn::module::ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            if let Some(t) = self.0.get::<D>(p.id) {
                self.1.extend(t.into_data().iter::<f32>());
            }
        }
    }
    let mut r = Read(g, Vec::new());
    m.visit(&mut r);
    r.1
}

/// `g` with every gradient of `m` multiplied by `c`.
fn scaled(m: &Small, mut g: GradientsParams, c: f32) -> GradientsParams {
    struct Scale<'a>(&'a mut GradientsParams, f32);
    impl burn::module::ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            if let Some(t) = self.0.remove::<D>(p.id) {
                self.0.register(p.id, t.mul_scalar(self.1));
            }
        }
    }
    m.visit(&mut Scale(&mut g, c));
    g
}

/// Accumulation: two passes summed with Burn's `GradientsAccumulator` and
/// `backward_passes_per_step(2)` equal `GradientReducer` with the same setting + the
/// plain optimizer, and one pass over both batches at once.
pub(crate) fn accumulation(k: &Kolo) -> Result<()> {
    use burn::optim::GradientsAccumulator;
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(41);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let b = 4;
    let mut sharded =
        ShardedOptimizer::new(k, AdamConfig::new().init()).backward_passes_per_step(2);
    let reducer = GradientReducer::new(k).backward_passes_per_step(2);
    let whole = GradientReducer::new(k).prefix("whole");
    let mut plain: ModuleOptimizer = AdamConfig::new().init();
    let mut once: ModuleOptimizer = AdamConfig::new().init();
    let (mut a, mut r, mut w) = (start.clone(), start.clone(), start);
    for step in 0..10 {
        let at = |pass: usize| (step * 2 * size + pass * size + rank) * b;
        let sum = |m: &Small| {
            let mut acc = GradientsAccumulator::new();
            for pass in 0..2 {
                acc.accumulate(m, grads_for(m, at(pass)..at(pass) + b, &device));
            }
            acc.grads()
        };
        a = sharded.step(0.05, a.clone(), sum(&a))?;
        let g = reducer.reduce(&r, sum(&r))?;
        r = plain.step(0.05, r, g);
        // Both of this rank's batches in one pass (rows in another order: the mean is
        // the same).
        let (x0, x1) = (at(0), at(1));
        let mut ids: Vec<usize> = (x0..x0 + b).chain(x1..x1 + b).collect();
        ids.sort_unstable();
        let g = grads_for_ids(&w, &ids, &device);
        let g = whole.reduce(&w, g)?;
        w = once.step(0.05, w, g);
    }
    assert_close(
        "2 accumulated passes, sharded vs reducer",
        &params(&a),
        &params(&r),
        1e-5,
    )?;
    assert_close(
        "2 accumulated passes vs one pass over both",
        &params(&a),
        &params(&w),
        1e-5,
    )?;
    Ok(())
}

/// The gradients of the mean loss over the given samples (not a range).
fn grads_for_ids(m: &Small, ids: &[usize], device: &Device) -> GradientsParams {
    // Contiguous runs, concatenated.
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for &i in ids {
        let (x, y) = super::samples(i..i + 1, device);
        xs.push(x);
        ys.push(y);
    }
    let (x, y) = (Tensor::cat(xs, 0), Tensor::cat(ys, 0));
    let loss = burn::nn::loss::CrossEntropyLossConfig::new()
        .init(device)
        .forward(m.forward(x), y);
    GradientsParams::from_grads(loss.backward(), m)
}

/// A process set ({0, 2} at np 3): its ranks shard among themselves and equal
/// `GradientReducer` in the same set + the plain optimizer, holding half the state
/// each; rank 1 is refused by name.
pub(crate) fn process_set(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(43);
    let set = k.add_process_set(&[0, 2])?;
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let mut sharded = ShardedOptimizer::new(k, AdamConfig::new().init()).process_set(&set);
    let Some(me) = set.rank() else {
        let g = grads_for(&start, 0..4, &device);
        let err = match sharded.step(0.05, start, g) {
            Ok(_) => anyhow::bail!("a rank outside the set stepped in it"),
            Err(e) => e.to_string(),
        };
        ensure!(err.contains("rank 1 is not in process set 1"), "{err}");
        k.remove_process_set(set)?;
        return Ok(());
    };
    let (b, n) = (4, set.size());
    let reducer = GradientReducer::new(k).process_set(&set).prefix("in_set");
    let mut plain: ModuleOptimizer = AdamConfig::new().init();
    let (mut a, mut r) = (start.clone(), start);
    for step in 0..10 {
        let base = step * b * n;
        let ids = base + me * b..base + (me + 1) * b;
        a = sharded.step(0.05, a.clone(), grads_for(&a, ids.clone(), &device))?;
        let g = reducer.reduce(&r, grads_for(&r, ids, &device))?;
        r = plain.step(0.05, r, g);
    }
    assert_close("sharded in a set of 2", &params(&a), &params(&r), 1e-5)?;
    let total = params(&a).len();
    let held: usize = sharded
        .shard()
        .unwrap_or_default()
        .iter()
        .map(ExactSizeIterator::len)
        .sum();
    ensure!(
        held.abs_diff(total / 2) <= 4,
        "rank {me} of the set holds {held} of {total} elements"
    );
    k.remove_process_set(set)?;
    Ok(())
}

/// Whole-tensor sharding: LAMB (whose trust ratio reads a whole parameter) and Adam
/// with per-parameter norm clipping and a global norm give what `GradientReducer` +
/// the plain optimizer gives; LAMB sharded by element ranges does not (why the mode
/// exists); each rank steps whole parameters and holds less state than one process;
/// the consolidated state resumes sharded and unsharded.
pub(crate) fn by_tensors(k: &Kolo) -> Result<()> {
    use burn::grad_clipping::GradientClippingConfig as Clip;
    use burn::optim::LambConfig;
    let size = k.size();
    let device = Device::flex().autodiff();
    device.seed(53);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let reducer = GradientReducer::new(k);
    let lamb = || LambConfig::new().init();
    let mut plain = lamb();
    let mut sharded = ShardedOptimizer::by_tensors(k, lamb());
    let (a, r) = run_both(
        k,
        &start,
        &mut sharded,
        reduced(&reducer, &mut plain),
        &device,
    )?;
    assert_close("LAMB by whole tensors", &params(&a), &params(&r), 1e-5)?;
    // The consolidated state: a fresh whole-tensor sharding and the plain optimizer
    // loading it take the step the trained one takes next.
    let full = sharded.consolidate(&a)?;
    let (rank, b) = (k.rank(), 6);
    let ids = 20 * b * size + rank * b..20 * b * size + (rank + 1) * b;
    let next = sharded.step(0.05, a.clone(), grads_for(&a, ids.clone(), &device))?;
    let mut fresh = ShardedOptimizer::by_tensors(k, lamb());
    fresh.load_consolidated(&a, &full)?;
    let resumed = fresh.step(0.05, a.clone(), grads_for(&a, ids.clone(), &device))?;
    assert_close(
        "LAMB by whole tensors, resumed",
        &params(&resumed),
        &params(&next),
        1e-6,
    )?;
    let mut unsharded = full;
    let g = reducer.reduce(&a, grads_for(&a, ids, &device))?;
    let plain_next = unsharded.step(0.05, a.clone(), g);
    assert_close(
        "the plain LAMB from the consolidated state",
        &params(&plain_next),
        &params(&next),
        1e-5,
    )?;
    refuses_another_model(ShardedOptimizer::by_tensors(k, lamb()), &unsharded, &device)?;
    let mut ranges = ShardedOptimizer::new(k, lamb());
    let mut plain2 = lamb();
    let (e, _) = run_both(
        k,
        &start,
        &mut ranges,
        reduced(&reducer, &mut plain2),
        &device,
    )?;
    let off = worst(&params(&e), &params(&r));
    ensure!(
        off > 1e-4,
        "LAMB by element ranges matched the plain optimizer ({off})"
    );
    // Every parameter is stepped by exactly one rank.
    let owned = sharded.owned_parameters().unwrap_or_default();
    let all: Vec<Vec<usize>> = k.allgather_object("by_tensors.owned", owned)?;
    let mut every: Vec<usize> = all.concat();
    every.sort_unstable();
    ensure!(
        every == (0..4).collect::<Vec<_>>(),
        "owned parameters {all:?}"
    );
    ensure!(
        sharded.shard().is_none(),
        "a whole-tensor sharding reports an element range"
    );
    let unsharded = plain.to_record().into_bytes().map(|b| b.len()).unwrap_or(0);
    let mine = sharded.local_state_bytes();
    ensure!(
        mine < unsharded,
        "np {size}: {mine} bytes of state on this rank, {unsharded} unsharded"
    );
    // Norm clipping per parameter inside the wrapped optimizer, and a global norm.
    let make = || {
        AdamConfig::new()
            .with_grad_clipping(Some(Clip::Norm(0.05)))
            .init()
    };
    let mut plain = make();
    let mut sharded = ShardedOptimizer::by_tensors(k, make()).clip_global_norm(0.1);
    let (a, r) = run_both(
        k,
        &start,
        &mut sharded,
        |m, g| {
            let (g, _) = clip_global(&m, reducer.reduce(&m, g)?, 0.1);
            Ok(plain.step(0.05, m, g))
        },
        &device,
    )?;
    assert_close(
        "Adam clipped, by whole tensors",
        &params(&a),
        &params(&r),
        1e-5,
    )?;
    Ok(())
}

/// Half-precision parameters (the device's float type f16 or bf16): sharded by element
/// ranges and by whole tensors, 20 steps of SGD with momentum stay in that type and equal
/// `GradientReducer` + the plain optimizer to within one unit of the precision
/// (relative, over all weights).
fn half(k: &Kolo, dtype: burn::tensor::FloatDType, mantissa_bits: i32) -> Result<()> {
    use burn::tensor::DType;
    let mut device = Device::flex();
    device
        .configure(dtype)
        .map_err(|e| anyhow::anyhow!("configuring the flex device for {dtype:?}: {e:?}"))?;
    let device = device.autodiff();
    device.seed(59);
    let want = DType::from(dtype);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let reducer = GradientReducer::new(k);
    // SGD with momentum: Burn's Adam on f16 parameters blows up on its first step
    // (weights of at most 0.34 become ~15, plain or sharded; likely ε = 1e-8 rounding
    // to 0 in f16, so that it divides by √v ≈ 0), and two such runs differ wherever a
    // sum rounds differently (11 % by element ranges at np 4).
    let make = || -> ModuleOptimizer {
        SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new()))
            .init()
    };
    for whole in [false, true] {
        let mut plain = make();
        let mut sharded = if whole {
            ShardedOptimizer::by_tensors(k, make())
        } else {
            ShardedOptimizer::new(k, make())
        };
        let (a, r) = run_both(
            k,
            &start,
            &mut sharded,
            reduced(&reducer, &mut plain),
            &device,
        )?;
        let what = format!(
            "{dtype:?}, by {}",
            if whole { "tensors" } else { "elements" }
        );
        ensure!(
            a.fc1.weight.val().dtype() == want && a.fc2.weight.val().dtype() == want,
            "{what}: the trained model is {:?}",
            a.fc1.weight.val().dtype()
        );
        let (got, reference, before) = (params(&a), params(&r), params(&start));
        ensure!(got != before, "{what}: training changed nothing");
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        let diff: Vec<f32> = got.iter().zip(&reference).map(|(x, y)| x - y).collect();
        let relative = norm(&diff) / norm(&reference);
        ensure!(
            relative < 2f32.powi(-mantissa_bits),
            "{what}: {relative:e} relative difference from the plain optimizer"
        );
    }
    Ok(())
}

pub(crate) fn half_f16(k: &Kolo) -> Result<()> {
    half(k, burn::tensor::FloatDType::F16, 10)
}

pub(crate) fn half_bf16(k: &Kolo) -> Result<()> {
    half(k, burn::tensor::FloatDType::BF16, 7)
}

/// A model with a layer that only every other step uses.
#[derive(Module, Debug)]
struct Branchy {
    a: Linear,
    act: Relu,
    b: Linear,
    extra: Linear,
}

impl Branchy {
    fn grads(&self, ids: std::ops::Range<usize>, extra: bool, device: &Device) -> GradientsParams {
        let (x, y) = super::samples(ids, device);
        let mut out = self.b.forward(self.act.forward(self.a.forward(x)));
        if extra {
            out = self.extra.forward(out);
        }
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(device)
            .forward(out, y);
        GradientsParams::from_grads(loss.backward(), self)
    }
}

/// A parameter with a gradient on one step and none on the next counts as zeros then
/// (the flat gradients' memory is reused from step to step: nothing of the last step
/// may stay): 20 Adam steps equal `GradientReducer` + the plain optimizer.
pub(crate) fn missing_gradients(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(61);
    let start = Branchy {
        a: LinearConfig::new(8, 16).init(&device),
        act: Relu::new(),
        b: LinearConfig::new(16, 4).init(&device),
        extra: LinearConfig::new(4, 4).init(&device),
    };
    let start = broadcast_parameters(k, start, 0)?;
    let reducer = GradientReducer::new(k);
    let mut plain: ModuleOptimizer = AdamConfig::new().init();
    let mut sharded = ShardedOptimizer::new(k, AdamConfig::new().init());
    let (mut a, mut r) = (start.clone(), start);
    let b = 6;
    for step in 0..20 {
        let base = step * b * size;
        let ids = base + rank * b..base + (rank + 1) * b;
        let extra = step % 2 == 0;
        a = sharded.step(0.05, a.clone(), a.grads(ids.clone(), extra, &device))?;
        let g = reducer.reduce(&r, r.grads(ids, extra, &device))?;
        r = plain.step(0.05, r, g);
    }
    assert_close(
        "a layer with gradients every other step",
        &params(&a),
        &params(&r),
        1e-5,
    )
}

/// The overlapped step (gradients reduce-scattered from backward's hooks) equals the
/// plain sharded step and `GradientReducer` + the plain optimizer: Adam by element
/// ranges, LAMB by whole tensors (its gradients all-reduced from the hooks).
pub(crate) fn overlap(k: &Kolo) -> Result<()> {
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::optim::LambConfig;
    let (rank, size) = (k.rank(), k.size());
    let device = Device::flex().autodiff();
    device.seed(47);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let b = 6;
    for whole in [false, true] {
        let make = || -> ModuleOptimizer {
            if whole {
                LambConfig::new().init()
            } else {
                AdamConfig::new().init()
            }
        };
        let shard = |inner| {
            if whole {
                ShardedOptimizer::by_tensors(k, inner)
            } else {
                ShardedOptimizer::new(k, inner)
            }
        };
        // By element ranges one bucket per parameter (4), so that several buckets are
        // reduce-scattered while backward runs; by tensors the default (one bucket).
        let buckets = if whole { 1 } else { 4 };
        let over = shard(make());
        let mut over = if whole { over } else { over.bucket_bytes(1) };
        let mut direct = shard(make());
        let mut plain = make();
        let reducer = GradientReducer::new(k).prefix(format!("overlap_ref.{whole}"));
        let (mut a, mut d, mut r) = (start.clone(), start.clone(), start.clone());
        for step in 0..10 {
            let base = step * b * size;
            let ids = base + rank * b..base + (rank + 1) * b;
            let (x, y) = super::samples(ids.clone(), &device);
            let sync = over.overlap(&a)?;
            let h = a.act.forward(sync.layer(&a.fc1, &x).forward(x));
            let out = sync.layer(&a.fc2, &h).forward(h);
            let loss = CrossEntropyLossConfig::new().init(&device).forward(out, y);
            let grads = GradientsParams::from_grads(loss.backward(), &a);
            ensure!(
                sync.early_buckets() == buckets,
                "by tensors {whole}: {} buckets submitted during backward, not {buckets}",
                sync.early_buckets()
            );
            a = over.step_overlapped(0.05, a, sync, grads)?;
            d = direct.step(0.05, d.clone(), grads_for(&d, ids.clone(), &device))?;
            let g = reducer.reduce(&r, grads_for(&r, ids, &device))?;
            r = plain.step(0.05, r, g);
        }
        let what = if whole {
            "overlapped LAMB by tensors"
        } else {
            "overlapped Adam"
        };
        assert_close(what, &params(&a), &params(&d), 1e-6)?;
        assert_close(what, &params(&a), &params(&r), 1e-5)?;
        let moved = params(&a)
            .iter()
            .zip(params(&start))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        ensure!(moved > 1e-3, "{what}: the parameters moved {moved} at most");
    }
    Ok(())
}
