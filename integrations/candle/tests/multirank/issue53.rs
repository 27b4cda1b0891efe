//! Issue 53 (reliability review 2) for kolo-candle: variables nobody differentiated
//! stay put, variables pair by name, and a rank-local error fails the step everywhere.

use anyhow::{ensure, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap, SGD};
use kolo::{Kolo, ReduceOp};
use kolo_candle::{broadcast_parameters, DistributedOptimizer};

use super::{err_text, values};

/// Item 2: an unused head under AdamW with weight decay: no rank has its gradient, so
/// it gets none and stays bit-identical, as in one process; the used weight moves as
/// in one process.
pub(crate) fn unused_head(kolo: &Kolo) -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let w = vb.get_with_hints(4, "w", candle_nn::Init::Const(1.0))?;
    let _head = vb.get_with_hints(3, "head", candle_nn::Init::Const(0.5))?;
    broadcast_parameters(kolo, &varmap, 0)?;
    let params = ParamsAdamW {
        lr: 0.1,
        weight_decay: 0.5,
        ..Default::default()
    };
    let mut opt = DistributedOptimizer::new(
        kolo,
        AdamW::new(varmap.all_vars(), params.clone())?,
        varmap.all_vars(),
    )?;
    // One process: the same loss, the same optimizer.
    let alone = VarMap::new();
    let vb1 = VarBuilder::from_varmap(&alone, DType::F32, &Device::Cpu);
    let w1 = vb1.get_with_hints(4, "w", candle_nn::Init::Const(1.0))?;
    let _head1 = vb1.get_with_hints(3, "head", candle_nn::Init::Const(0.5))?;
    let mut plain = AdamW::new(alone.all_vars(), params)?;
    for _ in 0..3 {
        opt.backward_step(&w.sqr()?.sum_all()?)?;
        plain.backward_step(&w1.sqr()?.sum_all()?)?;
    }
    let (got, want) = (values(&varmap)?, values(&alone)?);
    ensure!(
        got["head"].iter().all(|&x| x.to_bits() == 0.5f32.to_bits()),
        "rank {}: the unused head moved to {:?} (plain candle leaves it at 0.5)",
        kolo.rank(),
        got["head"]
    );
    ensure!(
        got["w"] == want["w"],
        "rank {}: w {:?}, one process {:?}",
        kolo.rank(),
        got["w"],
        want["w"]
    );
    Ok(())
}

/// Item 6: rank 1 creates the same two same-shaped variables in the other order.
/// After `broadcast_parameters` (or with `from_varmap`) they pair by name, so each
/// gets its own gradient; a rank whose names differ fails on every rank, naming it.
pub(crate) fn pairs_by_name(kolo: &Kolo) -> Result<()> {
    let rank = kolo.rank();
    for via_varmap in [false, true] {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let order = if rank % 2 == 1 {
            ["b", "a"]
        } else {
            ["a", "b"]
        };
        let mut made = std::collections::HashMap::new();
        for name in order {
            made.insert(
                name,
                vb.get_with_hints(2, name, candle_nn::Init::Const(0.0))?,
            );
        }
        let mut opt = if via_varmap {
            DistributedOptimizer::from_varmap(kolo, SGD::new(varmap.all_vars(), 1.0)?, &varmap)?
        } else {
            broadcast_parameters(kolo, &varmap, 0)?;
            DistributedOptimizer::new(kolo, SGD::new(varmap.all_vars(), 1.0)?, varmap.all_vars())?
        };
        // d/da = 1, d/db = 10 on every rank: a wrong pairing averages them.
        let loss = (made["a"].sum_all()? + (made["b"].sum_all()? * 10.0)?)?;
        opt.backward_step(&loss)?;
        let v = values(&varmap)?;
        ensure!(
            v["a"] == vec![-1.0; 2] && v["b"] == vec![-10.0; 2],
            "rank {rank} (from_varmap {via_varmap}): a {:?} b {:?}, want -1 and -10",
            v["a"],
            v["b"]
        );
    }
    // Names that differ: named in the error, on every rank.
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let _a = vb.get(2, "a")?;
    let _b = vb.get(2, if rank == 1 { "c" } else { "b" })?;
    let got = err_text(DistributedOptimizer::from_varmap(
        kolo,
        SGD::new(varmap.all_vars(), 1.0)?,
        &varmap,
    ));
    ensure!(
        got.contains("variable \"b\"") && got.contains("rank 1 holds \"c\" [2] f32"),
        "rank {rank}: got {got:?}"
    );
    Ok(())
}

/// Item 28: rank 1 hands `reduce` a gradient of the wrong shape for the first of
/// three variables: it fails naming the variable, every other rank fails naming rank
/// 1, nobody hangs, and the next step pairs the right gradients.
pub(crate) fn local_error_mid_submission(kolo: &Kolo) -> Result<()> {
    let rank = kolo.rank();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let vars: Vec<Tensor> = ["x", "y", "z"]
        .iter()
        .map(|n| vb.get_with_hints(3, n, candle_nn::Init::Const(0.0)))
        .collect::<candle_core::Result<_>>()?;
    let opt = DistributedOptimizer::from_varmap(kolo, SGD::new(varmap.all_vars(), 1.0)?, &varmap)?;
    let store = |bad: bool| -> Result<GradStore> {
        let mut g = GradStore::default();
        for (i, v) in vars.iter().enumerate() {
            let n = if bad && i == 0 { 5 } else { 3 };
            g.insert(v, Tensor::full((rank + 1) as f32, n, &Device::Cpu)?);
        }
        Ok(g)
    };
    let got = err_text(opt.reduce(&store(rank == 1)?));
    let want = if rank == 1 {
        "the gradient of variable \"x\" has shape [5], the variable [3]".to_string()
    } else {
        "rank 1 could not hand its gradients to the reduction".to_string()
    };
    ensure!(
        got.contains(&want),
        "rank {rank}: got {got:?}, want {want:?}"
    );
    let reduced = opt.reduce(&store(false)?)?;
    let mean = (1..=kolo.size()).sum::<usize>() as f32 / kolo.size() as f32;
    for v in &vars {
        let g = reduced
            .get(v)
            .map(|g| g.to_vec1::<f32>())
            .transpose()?
            .unwrap_or_default();
        ensure!(
            g == vec![mean; 3],
            "rank {rank}: next step {g:?}, want {mean}"
        );
    }
    let sum = kolo
        .allreduce("after", kolo::Tensor::from_vec(vec![1.0f32], &[1])?)
        .op(ReduceOp::Sum)
        .wait()?
        .into_vec::<f32>()?;
    ensure!(sum == vec![kolo.size() as f32], "rank {rank}: sum {sum:?}");
    Ok(())
}
