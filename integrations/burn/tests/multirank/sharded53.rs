//! Issue 53 items 3 and 27: the sharded optimizer (element ranges) keeps what the
//! wrapped `ModuleOptimizer` decides by parameter id and path, carries state over a
//! change of the model, takes a loaded optimizer's state, and consolidates what a
//! plain optimizer holds (norm clipping, f16 state, parameters without state).

use anyhow::{ensure, Result};
use burn::grad_clipping::GradientClipping;
use burn::module::{Module, ParamGroup};
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer};
use burn::tensor::Device;
use kolo::{Kolo, ReduceOp};
use kolo_burn::{broadcast_parameters, ShardedOptimizer};

use super::{assert_close, grads_for, params, Small};

/// AdamW with weight decay 0.1, and none for the biases (a group by path pattern).
fn grouped() -> ModuleOptimizer {
    AdamWConfig::new().with_weight_decay(0.1).init().with_group(
        ParamGroup::from_predicate(".bias"),
        AdamWConfig::new().with_weight_decay(0.0).build(),
        None,
    )
}

/// `steps` steps of plain Burn on the whole batch (every rank's samples), from
/// `model`, starting at step `from`.
fn plain(
    model: Small,
    optim: &mut ModuleOptimizer,
    from: usize,
    steps: usize,
    size: usize,
    device: &Device,
) -> Small {
    let b = 6;
    (from..from + steps).fold(model, |m, step| {
        let g = grads_for(&m, step * b * size..(step + 1) * b * size, device);
        optim.step(0.05, m, g)
    })
}

/// The same through `sharded`, each rank on its share of the batch.
fn sharded(
    k: &Kolo,
    model: Small,
    optim: &mut ShardedOptimizer,
    from: usize,
    steps: usize,
    device: &Device,
) -> Result<Small> {
    let (b, rank, size) = (6, k.rank(), k.size());
    let mut m = model;
    for step in from..from + steps {
        let base = step * b * size;
        let g = grads_for(&m, base + rank * b..base + (rank + 1) * b, device);
        m = optim.step(0.05, m.clone(), g)?;
    }
    Ok(m)
}

/// Item 3: a `with_group` setting (no weight decay on biases) applies to the sharded
/// blocks as to plain Burn's whole parameters (the blocks went to the fallback group).
pub(crate) fn groups(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(3);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let reference = plain(start.clone(), &mut grouped(), 0, 6, k.size(), &device);
    let ungrouped = plain(
        start.clone(),
        &mut AdamWConfig::new().with_weight_decay(0.1).init(),
        0,
        6,
        k.size(),
        &device,
    );
    ensure!(
        params(&reference) != params(&ungrouped),
        "the group changes nothing in plain Burn: the test proves nothing"
    );
    let mut optim = ShardedOptimizer::new(k, grouped());
    let model = sharded(k, start, &mut optim, 0, 6, &device)?;
    assert_close(
        "sharded with a bias group",
        &params(&model),
        &params(&reference),
        1e-5,
    )
}

/// Item 27: state over a change of the model (a frozen layer unfrozen), a loaded
/// optimizer passed as `inner`, settings changed after the first step, a process set
/// chosen late, and what `consolidate` / `load_consolidated` take and give.
pub(crate) fn changes(k: &Kolo) -> Result<()> {
    let device = Device::flex().autodiff();
    device.seed(27);
    let size = k.size();
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let adam = || AdamConfig::new().init();

    // Unfreezing: 3 steps with fc1 frozen, then 3 with it trained. Adam's state of
    // fc2 carries over in plain Burn; it was reset here.
    let mut frozen = start.clone();
    frozen.fc1 = frozen.fc1.no_grad();
    let mut p = adam();
    let mut reference = plain(frozen.clone(), &mut p, 0, 3, size, &device);
    reference.fc1 = reference.fc1.set_require_grad(true);
    let reference = plain(reference, &mut p, 3, 3, size, &device);
    let mut s = ShardedOptimizer::new(k, adam());
    let mut model = sharded(k, frozen, &mut s, 0, 3, &device)?;
    model.fc1 = model.fc1.set_require_grad(true);
    let model = sharded(k, model, &mut s, 3, 3, &device)?;
    assert_close(
        "a layer unfrozen after 3 steps",
        &params(&model),
        &params(&reference),
        1e-5,
    )?;

    // A plain optimizer with state (as loaded from a checkpoint) passed as `inner`:
    // its state is used, not ignored.
    let mut p = adam();
    let half = plain(start.clone(), &mut p, 0, 3, size, &device);
    let mut s = ShardedOptimizer::new(k, p.clone());
    let model = sharded(k, half.clone(), &mut s, 3, 3, &device)?;
    let reference = plain(half, &mut p, 3, 3, size, &device);
    assert_close(
        "a loaded optimizer passed in",
        &params(&model),
        &params(&reference),
        1e-5,
    )?;

    // `op` changed after the first step applies: Sum is N × Average under SGD.
    let sgd = || burn::optim::SgdConfig::new().init();
    let mut s = ShardedOptimizer::new(k, sgd());
    let one = sharded(k, start.clone(), &mut s, 0, 1, &device)?;
    let mut s = s.op(ReduceOp::Sum);
    let two = sharded(k, one.clone(), &mut s, 1, 1, &device)?;
    let g = grads_for(&one, 6 * size..12 * size, &device);
    let summed = sgd().step(0.05 * size as f64, one, g);
    assert_close(
        "op(Sum) after the first step",
        &params(&two),
        &params(&summed),
        1e-5,
    )?;

    // A process set chosen after the first step: refused on every rank alike.
    let set = k.add_process_set(&(0..size).collect::<Vec<_>>())?;
    let mut s = s.process_set(&set);
    let e = sharded(k, two, &mut s, 2, 1, &device)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    ensure!(
        e.contains("before the first step"),
        "late process set: {e:?}"
    );
    k.remove_process_set(set)?;

    // consolidate keeps the optimizer's norm clipping (it gave `Value(inf)`).
    let clipped = AdamConfig::new()
        .with_grad_clipping(Some(burn::grad_clipping::GradientClippingConfig::Norm(0.5)))
        .init();
    let mut s = ShardedOptimizer::new(k, clipped);
    let model = sharded(k, start.clone(), &mut s, 0, 2, &device)?;
    let whole = s.consolidate(&model)?;
    ensure!(
        matches!(whole.grad_clipping(), Some(GradientClipping::Norm(n)) if *n == 0.5),
        "consolidate returned another clipping than Norm(0.5) (Value(inf)?)"
    );

    // A plain optimizer without state for a parameter (fc2 never had a gradient:
    // only fc1 trained) loads; the sharded one with such a parameter consolidates.
    let mut only_fc1 = start.clone();
    only_fc1.fc2 = only_fc1.fc2.no_grad();
    let mut p = adam();
    let trained = plain(only_fc1, &mut p, 0, 2, size, &device);
    let mut trained = trained;
    trained.fc2 = trained.fc2.set_require_grad(true);
    let mut s = ShardedOptimizer::new(k, adam());
    s.load_consolidated(&trained, &p)?;
    let whole = s.consolidate(&trained)?;
    let mut continued = trained.clone();
    let mut from_whole = whole;
    continued = plain(continued, &mut from_whole, 2, 2, size, &device);
    let reference = plain(trained, &mut p, 2, 2, size, &device);
    assert_close(
        "a state without fc2's, loaded and consolidated",
        &params(&continued),
        &params(&reference),
        1e-6,
    )?;
    Ok(())
}

/// Item 27: f16 parameters keep f16 Adam state; `consolidate` takes it (it failed
/// with "not element-wise") and `load_consolidated` gives it back: training goes on
/// exactly as without the round trip.
pub(crate) fn half_state(k: &Kolo) -> Result<()> {
    let mut device = Device::flex();
    device
        .configure(burn::tensor::FloatDType::F16)
        .map_err(|e| anyhow::anyhow!("configuring the flex device for f16: {e:?}"))?;
    let device = device.autodiff();
    device.seed(16);
    let start = broadcast_parameters(k, Small::new(&device), 0)?;
    let mut s = ShardedOptimizer::new(k, AdamConfig::new().init());
    let model = sharded(k, start, &mut s, 0, 2, &device)?;
    let whole = s.consolidate(&model)?;
    let mut again = ShardedOptimizer::new(k, AdamConfig::new().init());
    again.load_consolidated(&model, &whole)?;
    let a = sharded(k, model.clone(), &mut s, 2, 2, &device)?;
    let b = sharded(k, model, &mut again, 2, 2, &device)?;
    ensure!(
        params(&a) == params(&b),
        "f16 state: training after consolidate and load differs"
    );
    Ok(())
}
