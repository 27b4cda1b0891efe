//! The MLP training loop both sides of the candle benchmark run: the plain candle
//! program (`benches/baseline/plain_mlp.rs`, no kolo) and kolo's ranks
//! (`benches/candle_mlp.rs`).

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{linear, Linear, Module, Optimizer, VarBuilder, VarMap};

#[path = "../../../shared/synthetic.rs"]
mod synthetic;

/// Samples per rank per step.
pub(crate) const BATCH: usize = 64;
/// SGD's learning rate.
pub(crate) const LR: f64 = 0.01;

/// The models: 0.67 M and 10.0 M parameters (kolo-burn's benchmark's).
pub(crate) fn dims(model: &str) -> Option<&'static [usize]> {
    match model {
        "small" => Some(&[784, 512, 512, 10]),
        "big" => Some(&[784, 2048, 2048, 2048, 10]),
        _ => None,
    }
}

/// An MLP of widths `dims` with ReLU between layers.
pub(crate) struct Mlp(Vec<Linear>);

impl Mlp {
    pub(crate) fn new(dims: &[usize], varmap: &VarMap) -> Result<Self> {
        let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| linear(w[0], w[1], vb.pp(format!("fc{i}"))))
            .collect::<Result<_>>()?;
        Ok(Mlp(layers))
    }

    /// The mean cross-entropy of a batch.
    pub(crate) fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.0.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.0.len() {
                h = h.relu()?;
            }
        }
        candle_nn::loss::cross_entropy(&h, y)
    }
}

/// A fixed synthetic batch (the same every step), different per `seed`.
pub(crate) fn batch(seed: usize, dims: &[usize], rows: usize) -> Result<(Tensor, Tensor)> {
    let (inputs, classes) = (dims[0], dims[dims.len() - 1]);
    let (x, y) = synthetic::batch(seed, inputs, classes, rows);
    let y: Vec<u32> = y.into_iter().map(|c| c as u32).collect();
    Ok((
        Tensor::from_vec(x, (rows, inputs), &Device::Cpu)?,
        Tensor::from_vec(y, rows, &Device::Cpu)?,
    ))
}

/// Steps per second of `opt` training `model` on `(x, y)`: `steps` timed steps after
/// `warmup` untimed ones.
pub(crate) fn steps_per_s(
    model: &Mlp,
    opt: &mut impl Optimizer,
    (x, y): &(Tensor, Tensor),
    warmup: usize,
    steps: usize,
) -> Result<f64> {
    for _ in 0..warmup {
        opt.backward_step(&model.loss(x, y)?)?;
    }
    let start = Instant::now();
    for _ in 0..steps {
        opt.backward_step(&model.loss(x, y)?)?;
    }
    Ok(steps as f64 / start.elapsed().as_secs_f64())
}
