//! Issue 57 on candle: `DistributedOptimizer::algorithm` (ByteGrad compressing on one
//! host within its bound of the exact average, Adasum equal to the tree of the ranks'
//! gradients, decentralized stepping and averaging), and the ranks' agreement.

use anyhow::{ensure, Result};
use candle_core::{Device, Tensor, Var};
use candle_nn::{Optimizer, VarMap, SGD};
use kolo::algorithms::adasum_tree;
use kolo::{Algorithm, Kolo};
use kolo_candle::{broadcast_parameters, decentralized_average, DistributedOptimizer};

use super::{err_text, samples, Small};

/// Every variable's gradient in `g`, flattened, in `vars`' order.
fn flat(vars: &[Var], g: &candle_core::backprop::GradStore) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for v in vars {
        if let Some(t) = g.get(v.as_tensor()) {
            out.extend(t.flatten_all()?.to_vec1::<f32>()?);
        }
    }
    Ok(out)
}

/// Every variable's values, flattened, in `vars`' order.
fn values(vars: &[Var]) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for v in vars {
        out.extend(v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// ByteGrad (compressing on one host too) within the quantisation bound of the exact
/// average and not equal to it; Adasum equal to the tree of the ranks' gradients.
pub(crate) fn reduce(kolo: &Kolo) -> Result<()> {
    let (rank, size) = (kolo.rank(), kolo.size());
    let varmap = VarMap::new();
    let model = Small::new(16, &varmap)?;
    broadcast_parameters(kolo, &varmap, 0)?;
    let vars = varmap.all_vars();
    let opt = |a: Algorithm| -> Result<DistributedOptimizer<SGD>> {
        Ok(
            DistributedOptimizer::new(kolo, SGD::new(vars.clone(), 0.1)?, vars.clone())?
                .algorithm(a)?
                .hierarchical(false),
        )
    };
    let (exact, byte, ada) = (
        opt(Algorithm::Allreduce)?,
        opt(Algorithm::ByteGrad)?,
        opt(Algorithm::Adasum)?,
    );
    let order = exact.vars().to_vec();
    let grads = model.loss(&samples(rank * 8..rank * 8 + 8)?)?.backward()?;
    let mine = flat(&order, &grads)?;
    let want = flat(&order, &exact.reduce(&grads)?)?;
    let got = flat(&order, &byte.reduce(&grads)?)?;
    let all: Vec<Vec<f32>> = kolo.allgather_object("c57.mine", mine)?;
    let range = |v: &[f32]| {
        v.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            - v.iter().copied().fold(f32::INFINITY, f32::min)
    };
    let bound = all.iter().map(|v| range(v)).fold(0.0f32, f32::max) / 255.0 + 1e-7;
    let w = worst(&got, &want);
    ensure!(
        got.len() == want.len() && w <= bound,
        "ByteGrad: {w} beyond {bound}"
    );
    ensure!(
        size == 1 || w > 0.0,
        "ByteGrad equals the exact average: nothing quantised"
    );
    let got = flat(&order, &ada.reduce(&grads)?)?;
    let w = worst(&got, &adasum_tree(all));
    ensure!(w < 1e-6, "Adasum differs from the tree by {w}");
    Ok(())
}

/// Decentralized: ranks that start apart reach the mean of their variables (log2 N
/// exchanges at a power of two); the optimizer set to it steps on local gradients and
/// then averages, so the ranks' variables move towards each other.
pub(crate) fn decentralized(kolo: &Kolo) -> Result<()> {
    let (rank, size) = (kolo.rank(), kolo.size());
    let vars: Vec<Var> = (0..3)
        .map(|i| {
            let v: Vec<f32> = (0..50)
                .map(|j| ((i * 50 + j + rank * 7) as f32 * 0.13).sin())
                .collect();
            Var::from_tensor(&Tensor::from_vec(v, (5, 10), &Device::Cpu)?)
        })
        .collect::<candle_core::Result<_>>()?;
    let start = values(&vars)?;
    let all: Vec<Vec<f32>> = kolo.allgather_object("c57.start", start.clone())?;
    let mean: Vec<f32> = (0..start.len())
        .map(|i| all.iter().map(|v| v[i]).sum::<f32>() / size as f32)
        .collect();
    let rounds = if size.is_power_of_two() {
        u64::from(size.trailing_zeros())
    } else {
        40
    };
    for step in 0..rounds {
        decentralized_average(kolo, &vars, step)?;
    }
    let w = worst(&values(&vars)?, &mean);
    ensure!(
        w < 1e-6,
        "np {size} rank {rank}: {w} from the mean after {rounds} exchanges"
    );
    // Through the optimizer: models that start apart train and come together.
    mixes_ranks(kolo, Algorithm::Decentralized)
}

/// Ranks that choose different algorithms fail on every rank, naming each choice.
pub(crate) fn disagreement(kolo: &Kolo) -> Result<()> {
    let varmap = VarMap::new();
    let _model = Small::new(16, &varmap)?;
    let a = if kolo.rank() == 1 {
        Algorithm::Adasum
    } else {
        Algorithm::Allreduce
    };
    let err = err_text(
        DistributedOptimizer::new(kolo, SGD::new(varmap.all_vars(), 0.1)?, varmap.all_vars())
            .and_then(|o| o.algorithm(a)),
    );
    ensure!(
        err.contains("rank 1: adasum") && err.contains("rank 0: allreduce"),
        "{err}"
    );
    Ok(())
}

/// The other weight exchanges through the optimizer: decentralized-8bit and async
/// (a round every step) bring models that start apart together while training.
pub(crate) fn weight_exchanges(kolo: &Kolo) -> Result<()> {
    for algorithm in [Algorithm::Decentralized8Bit, Algorithm::Async] {
        mixes_ranks(kolo, algorithm)?;
    }
    Ok(())
}

/// A `DistributedOptimizer` with the weight exchange `algorithm` (async: a round
/// every step) over models that start apart: after 8 steps and `finish` the ranks'
/// spread is under a quarter of what it was, and the exchange's state counts the 8
/// steps.
fn mixes_ranks(kolo: &Kolo, algorithm: Algorithm) -> Result<()> {
    let (rank, size) = (kolo.rank(), kolo.size());
    let varmap = VarMap::new();
    let model = Small::new(16, &varmap)?;
    for v in varmap.all_vars() {
        // Apart by construction, whatever candle's initialisation does.
        v.set(&(v.as_tensor() + rank as f64 * 0.05)?)?;
    }
    let mut opt =
        DistributedOptimizer::new(kolo, SGD::new(varmap.all_vars(), 0.05)?, varmap.all_vars())?
            .algorithm(algorithm)?
            .async_period(kolo::algorithms::AsyncPeriod::Steps(1));
    let order = opt.vars().to_vec();
    let tag = format!("c57.{algorithm}");
    let spread = |kolo: &Kolo, tag: &str| -> Result<f32> {
        let all: Vec<Vec<f32>> = kolo.allgather_object(tag, values(&order)?)?;
        Ok(all.iter().map(|v| worst(v, &all[0])).fold(0.0, f32::max))
    };
    let before = spread(kolo, &format!("{tag}.before"))?;
    for step in 0..8 {
        let lo = (step * size + rank) * 8;
        opt.backward_step(&model.loss(&samples(lo..lo + 8)?)?)?;
    }
    opt.finish()?;
    let after = spread(kolo, &format!("{tag}.after"))?;
    ensure!(
        size == 1 || after < before / 4.0,
        "{algorithm}: spread {before} → {after}: the ranks did not mix"
    );
    ensure!(
        size == 1 || opt.averager_state().is_some_and(|s| s.step == 8),
        "{algorithm}: state {:?}",
        opt.averager_state()
    );
    Ok(())
}

/// kolo_candle::OneBitAdam with compression off is AdamW without weight decay on
/// averaged gradients (to 1e-5 after 10 steps); 1-bit Adam and QAdam after a 10-step
/// warm-up (a quarter of the 40 steps, as the paper's warm-ups) keep every rank's
/// variables equal and lower the loss on the rank's batches.
pub(crate) fn onebit_adam(kolo: &Kolo) -> Result<()> {
    use candle_nn::{AdamW, ParamsAdamW};
    use kolo::algorithms::OneBitAdamConfig;
    use kolo_candle::OneBitAdam;
    let (rank, size) = (kolo.rank(), kolo.size());
    let fresh = || -> Result<(VarMap, Small)> {
        let varmap = VarMap::new();
        let model = Small::new(16, &varmap)?;
        broadcast_parameters(kolo, &varmap, 0)?;
        Ok((varmap, model))
    };
    let batch = |step: usize| samples((step * size + rank) * 8..(step * size + rank) * 8 + 8);
    let (va, ma) = fresh()?;
    let params = ParamsAdamW {
        lr: 0.01,
        weight_decay: 0.0,
        eps: 1e-8,
        ..ParamsAdamW::default()
    };
    let mut adam =
        DistributedOptimizer::new(kolo, AdamW::new(va.all_vars(), params)?, va.all_vars())?;
    let (vb, mb) = fresh()?;
    {
        // The same start as AdamW's model, by name.
        let da = va.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let db = vb.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        for (name, v) in da.iter() {
            db[name].set(v.as_tensor())?;
        }
    }
    let config = OneBitAdamConfig {
        epsilon: 1e-8,
        compression: false,
        ..Default::default()
    };
    let mut off = OneBitAdam::new(kolo, vb.all_vars(), config)?;
    for step in 0..10 {
        adam.backward_step(&ma.loss(&batch(step)?)?)?;
        off.backward_step(0.01, &mb.loss(&batch(step)?)?)?;
    }
    let order = adam.vars().to_vec();
    let names: Vec<Var> = {
        let data = vb.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let da = va.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        order
            .iter()
            .map(|v| {
                let name = da
                    .iter()
                    .find(|(_, w)| w.as_tensor().id() == v.as_tensor().id())
                    .map(|(n, _)| n.clone())
                    .unwrap_or_default();
                data[&name].clone()
            })
            .collect()
    };
    let w = worst(&values(&order)?, &values(&names)?);
    ensure!(w < 1e-5, "compression off differs from AdamW by {w}");
    for q in [false, true] {
        let (vc, mc) = fresh()?;
        let config = OneBitAdamConfig {
            warmup: 10,
            ..Default::default()
        };
        let mut opt = if q {
            OneBitAdam::qadam(kolo, vc.all_vars(), config)?
        } else {
            OneBitAdam::new(kolo, vc.all_vars(), config)?
        };
        // The loss over the four batches this rank trains on.
        let loss = || -> Result<f32> {
            let mut sum = 0.0;
            for b in 0..4 {
                sum += mc.loss(&batch(b)?)?.to_scalar::<f32>()?;
            }
            Ok(sum / 4.0)
        };
        let first = loss()?;
        for step in 0..40 {
            opt.backward_step(0.005, &mc.loss(&batch(step % 4)?)?)?;
        }
        let last = loss()?;
        // By name: all_vars' order differs between processes.
        let mine = {
            let data = vc.data().lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
            let mut named: Vec<(&String, &Var)> = data.iter().collect();
            named.sort_by(|a, b| a.0.cmp(b.0));
            values(
                &named
                    .into_iter()
                    .map(|(_, v)| v.clone())
                    .collect::<Vec<_>>(),
            )?
        };
        let all: Vec<Vec<f32>> = kolo.allgather_object(format!("c57.ob.{q}"), mine)?;
        ensure!(
            all.windows(2).all(|w| w[0] == w[1]),
            "qadam {q}: the ranks' variables differ"
        );
        ensure!(last < first, "qadam {q}: loss {first} → {last}");
    }
    Ok(())
}
