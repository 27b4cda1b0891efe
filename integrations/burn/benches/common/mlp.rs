//! The MLP training loop both sides of the Burn benchmark run: the plain Burn program
//! (`benches/baseline/plain_mlp.rs`, no kolo) and kolo's workers (`benches/burn_mlp.rs`).

use std::time::{Duration, Instant};

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};

#[path = "../../../shared/synthetic.rs"]
mod synthetic;

/// Samples per rank per step (the pipeline model's batch is [`batch_size`]).
pub(crate) const BATCH: usize = 64;

/// Micro-batches of the pipeline path.
#[allow(dead_code)]
pub(crate) const MICRO_BATCHES: usize = 8;

/// Samples per step of `model`: `KOLO_BENCH_BATCH` when set, 4096 for the pipeline
/// model (micro-batches of 512 rows: one rank running the batch as 8 micro-batches
/// ran at 0.82× the whole batch's steps/s with 128-row micro-batches here, 0.88–0.91×
/// with 256 rows — a loss no schedule can hide; at 32 rows 2.7× slower per sample),
/// else [`BATCH`].
pub(crate) fn batch_size(model: &str) -> usize {
    if let Some(b) = std::env::var("KOLO_BENCH_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        b
    } else if model == "pipe" {
        4096
    } else {
        BATCH
    }
}
/// SGD's learning rate.
pub(crate) const LR: f64 = 0.01;

/// An MLP with `dims` = [inputs, hidden…, classes].
#[derive(Module, Debug)]
pub(crate) struct Mlp {
    pub(crate) layers: Vec<Linear>,
    pub(crate) act: Relu,
}

impl Mlp {
    pub(crate) fn new(dims: &[usize], device: &Device) -> Self {
        Mlp {
            layers: dims
                .windows(2)
                .map(|w| LinearConfig::new(w[0], w[1]).init(device))
                .collect(),
            act: Relu::new(),
        }
    }

    pub(crate) fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.forward_part(x, true)
    }

    /// The layers of this (part of an) MLP, with ReLU after each but the model's last
    /// (`ends`: this part holds it).
    pub(crate) fn forward_part(&self, mut x: Tensor<2>, ends: bool) -> Tensor<2> {
        let last = self.layers.len() - 1;
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(x);
            if !(ends && i == last) {
                x = self.act.forward(x);
            }
        }
        x
    }
}

/// The two models of the issue: 0.67 M and 10.0 M parameters.
pub(crate) fn dims(model: &str) -> Option<&'static [usize]> {
    match model {
        "small" => Some(&[784, 512, 512, 10]),
        "big" => Some(&[784, 2048, 2048, 2048, 10]),
        // Four equal layers (4.2 M parameters): two stages of the same cost.
        "pipe" => Some(&[1024, 1024, 1024, 1024, 1024, 10]),
        _ => None,
    }
}

/// A fixed synthetic batch (the same every step), different per `seed`.
pub(crate) fn batch(
    seed: usize,
    dims: &[usize],
    rows: usize,
    device: &Device,
) -> (Tensor<2>, Tensor<1, Int>) {
    let (inputs, classes) = (dims[0], dims[dims.len() - 1]);
    let (x, y) = synthetic::batch(seed, inputs, classes, rows);
    let y: Vec<i64> = y.into_iter().map(|c| c as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [rows, inputs]), device),
        Tensor::from_data(TensorData::new(y, [rows]), device),
    )
}

/// The gradients of one step on `(x, y)`.
pub(crate) fn grads(model: &Mlp, x: Tensor<2>, y: Tensor<1, Int>) -> GradientsParams {
    let device = x.device();
    let loss = CrossEntropyLossConfig::new()
        .init(&device)
        .forward(model.forward(x), y);
    GradientsParams::from_grads(loss.backward(), model)
}

/// Steps per second over `steps` timed steps after `warmup` untimed ones, and the
/// time the steps spent in `comm`-marked work (reported by `step`).
pub(crate) struct Timing {
    pub(crate) steps_per_s: f64,
    pub(crate) comm: Duration,
    pub(crate) total: Duration,
}

/// Runs `warmup + steps` steps of `step`, which returns the model and the time it
/// spent communicating. The device is waited for after the warm-up and before the
/// clock stops: on an asynchronous device (CUDA) the steps' kernels may still be
/// queued when `step` returns, and a plain loop that never waits would otherwise be
/// timed by how fast it queues work, not how fast the device runs it.
pub(crate) fn time_steps<M>(
    mut model: M,
    device: &Device,
    warmup: usize,
    steps: usize,
    mut step: impl FnMut(M) -> (M, Duration),
) -> Timing {
    for _ in 0..warmup {
        model = step(model).0;
    }
    wait_for(device);
    let start = Instant::now();
    let mut comm = Duration::ZERO;
    for _ in 0..steps {
        let (m, c) = step(model);
        model = m;
        comm += c;
    }
    wait_for(device);
    let total = start.elapsed();
    Timing {
        steps_per_s: steps as f64 / total.as_secs_f64(),
        comm,
        total,
    }
}

/// Waits until `device` has run everything queued on it (a no-op on the CPU
/// backends); a device that cannot be waited for ends the benchmark.
pub(crate) fn wait_for(device: &Device) {
    if let Err(e) = device.sync() {
        panic!("waiting for the device failed: {e:?}");
    }
}
