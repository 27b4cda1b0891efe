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
    let varmap = VarMap::new();
    let model = Small::new(16, &varmap)?;
    for v in varmap.all_vars() {
        // Apart by construction, whatever candle's initialisation does.
        v.set(&(v.as_tensor() + rank as f64 * 0.05)?)?;
    }
    let mut opt =
        DistributedOptimizer::new(kolo, SGD::new(varmap.all_vars(), 0.05)?, varmap.all_vars())?
            .algorithm(Algorithm::Decentralized)?;
    let order = opt.vars().to_vec();
    let spread = |kolo: &Kolo, tag: &str| -> Result<f32> {
        let all: Vec<Vec<f32>> = kolo.allgather_object(tag, values(&order)?)?;
        Ok(all.iter().map(|v| worst(v, &all[0])).fold(0.0, f32::max))
    };
    let before = spread(kolo, "c57.before")?;
    for step in 0..8 {
        let lo = (step * size + rank) * 8;
        opt.backward_step(&model.loss(&samples(lo..lo + 8)?)?)?;
    }
    let after = spread(kolo, "c57.after")?;
    ensure!(
        size == 1 || after < before / 4.0,
        "spread {before} → {after}: the ranks did not mix"
    );
    Ok(())
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
