//! The framework-agnostic DistributedOptimizer.

use anyhow::{ensure, Result};
use kolo::{
    Compression, DType, DistributedOptimizer, GradientStep, Gradients, Kolo, ReduceOp, Tensor,
};

use crate::util::expect_err;

/// Records the gradients of every step.
#[derive(Default)]
struct Record(Vec<Gradients>);

impl GradientStep for Record {
    fn step(&mut self, g: &Gradients) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.0.push(g.clone());
        Ok(())
    }
}

fn t(v: Vec<f32>) -> Result<Tensor> {
    let n = v.len();
    Ok(Tensor::from_vec(v, &[n])?)
}

fn close(what: &str, got: &Tensor, want: &[f32], tol: f32) -> Result<()> {
    let g = got.as_slice::<f32>()?;
    ensure!(g.len() == want.len(), "{what}: length");
    for (i, (a, b)) in g.iter().zip(want).enumerate() {
        ensure!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}[{i}] = {a}, want {b}"
        );
    }
    Ok(())
}

pub(crate) fn semantics(k: &Kolo) -> Result<()> {
    let (rank, size) = (k.rank() as f32, k.size() as f32);
    let mean_rank = (size - 1.0) / 2.0;
    let build = |passes: usize, compression: Compression, groups: Vec<Vec<String>>| {
        DistributedOptimizer::builder(k.clone(), Record::default())
            .param("w", &[3], DType::F32)
            .param("b", &[1], DType::F32)
            .backward_passes_per_step(passes)
            .compression(compression)
            .groups(groups)
            .build()
    };

    // Two passes are averaged locally, then averaged across ranks.
    let mut opt = build(2, Compression::None, vec![])?;
    opt.submit_gradient("w", t(vec![rank; 3])?)?;
    opt.submit_gradient("w", t(vec![rank + 2.0; 3])?)?;
    expect_err(
        "third pass",
        opt.submit_gradient("w", t(vec![0.0; 3])?),
        &["produced 3 times", "backward_passes_per_step is 2"],
    )?;
    // Rank 0 never produces "b": it takes part with zeros, nobody hangs.
    if k.rank() != 0 {
        opt.submit_gradient("b", t(vec![4.0])?)?;
        opt.submit_gradient("b", t(vec![4.0])?)?;
    }
    opt.step()?;
    let g = &opt.inner().0[0];
    close("w", &g["w"], &[mean_rank + 1.0; 3], 1e-6)?;
    close("b", &g["b"], &[4.0 * (size - 1.0) / size], 1e-6)?;

    // Groups and compression give the same averages (fp16 to its precision).
    // ByteGrad reduces each member on its own (groups do not apply to it).
    for compression in [
        Compression::None,
        Compression::Fp16,
        Compression::Bf16,
        Compression::ByteGrad,
    ] {
        let mut opt = build(1, compression, vec![vec!["w".into(), "b".into()]])?;
        opt.submit_gradient("b", t(vec![rank * 10.0])?)?;
        opt.submit_gradient("w", t(vec![rank, 1.0, -rank])?)?;
        opt.synchronize()?;
        let tol = if compression == Compression::None {
            1e-6
        } else {
            1e-2
        };
        close(
            "group w",
            &opt.gradients()["w"],
            &[mean_rank, 1.0, -mean_rank],
            tol,
        )?;
        close("group b", &opt.gradients()["b"], &[mean_rank * 10.0], tol)?;
        // Clip after synchronising, then step on the clipped gradients.
        opt.gradients_mut().insert("b".into(), t(vec![0.5])?);
        opt.skip_synchronize().step()?;
        close("clipped", &opt.inner().0[0]["b"], &[0.5], 0.0)?;
    }

    // Predivide keeps the average; Sum sums.
    let mut opt = DistributedOptimizer::builder(k.clone(), Record::default())
        .param("w", &[3], DType::F32)
        .gradient_predivide_factor(4.0)
        .build()?;
    opt.submit_gradient("w", t(vec![rank; 3])?)?;
    opt.step()?;
    close("predivide", &opt.inner().0[0]["w"], &[mean_rank; 3], 1e-6)?;
    let mut opt = DistributedOptimizer::builder(k.clone(), Record::default())
        .param("w", &[3], DType::F32)
        .op(ReduceOp::Sum)
        .build()?;
    opt.submit_gradient("w", t(vec![1.0; 3])?)?;
    opt.step()?;
    close("sum", &opt.inner().0[0]["w"], &[size; 3], 0.0)?;

    // Bad set-ups are refused with the parameter named.
    let dup = DistributedOptimizer::builder(k.clone(), Record::default())
        .param("w", &[3], DType::F32)
        .param("w", &[3], DType::F32)
        .build()
        .map(|_| ());
    expect_err("duplicate", dup, &["\"w\"", "duplicate parameter name"])?;
    let bad_group = DistributedOptimizer::builder(k.clone(), Record::default())
        .param("w", &[3], DType::F32)
        .groups(vec![vec!["nope".into()]])
        .build()
        .map(|_| ());
    expect_err("group", bad_group, &["\"nope\"", "not registered"])?;
    let mut opt = build(1, Compression::None, vec![])?;
    expect_err(
        "shape",
        opt.submit_gradient("w", t(vec![1.0; 4])?),
        &["registered as f32 [3]"],
    )?;
    expect_err(
        "unknown",
        opt.submit_gradient("v", t(vec![1.0])?),
        &["\"v\"", "not a registered parameter"],
    )?;
    opt.step()?;
    Ok(())
}
