//! Plain single-process Burn training of the benchmark's MLP: no kolo, no MPI (the
//! binary does not link either). The baseline of `benches/burn_mlp.rs`, which launches
//! it alternately with kolo's ranks. It is a `[[bin]]` target rather than an example so
//! that Cargo builds it whenever the benchmark is built, on a clean checkout too, and
//! hands the benchmark its path (`CARGO_BIN_EXE_kolo-burn-plain-mlp`).
//!
//! ```sh
//! RAYON_NUM_THREADS=1 target/release/kolo-burn-plain-mlp big 3 20 [flex|cpu|cuda]
//! ```
//! `cpu` and `cuda` need the features of those names (`scripts/build-cuda.sh`).
//!
//! With `KOLO_BENCH_PLAIN_MICRO=M` each step runs the batch as `M` micro-batches one
//! after another, accumulating their gradients, and steps once: what one rank running
//! the whole model does with the pipeline's micro-batches (the baseline of the
//! pipeline's schedule efficiency).

#[path = "../common/mlp.rs"]
mod mlp;

use std::time::Duration;

use burn::optim::{GradientsAccumulator, SgdConfig};
use burn::tensor::Device;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let model = args.get(1).map_or("small", String::as_str);
    let dims =
        mlp::dims(model).ok_or_else(|| format!("unknown model {model:?}: small, big or pipe"))?;
    let warmup = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(3);
    let steps = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(20);
    let device = match args.get(4).map_or("flex", String::as_str) {
        "flex" => Device::flex(),
        #[cfg(feature = "cpu")]
        "cpu" => Device::cpu(),
        #[cfg(feature = "cuda")]
        "cuda" => Device::cuda(0),
        other => return Err(format!("device {other:?} is not built in (see the docs)")),
    }
    .autodiff();
    let (x, y) = mlp::batch(0, dims, mlp::batch_size(model), &device);
    let micro = std::env::var("KOLO_BENCH_PLAIN_MICRO")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1usize)
        .max(1);
    let (xs, ys) = (x.clone().chunk(micro, 0), y.clone().chunk(micro, 0));
    // KOLO_BENCH_PLAIN_SYNC=1: wait for the device after each backward pass, as a
    // loop that reads its loss every step does (kolo-burn's reducer waits there).
    let sync = std::env::var_os("KOLO_BENCH_PLAIN_SYNC").is_some_and(|v| v == "1");
    let mut optim = SgdConfig::new().init();
    let t = mlp::time_steps(mlp::Mlp::new(dims, &device), &device, warmup, steps, |m| {
        let g = if micro == 1 {
            mlp::grads(&m, x.clone(), y.clone())
        } else {
            let mut acc = GradientsAccumulator::new();
            for (x, y) in xs.iter().zip(&ys) {
                acc.accumulate(&m, mlp::grads(&m, x.clone(), y.clone()));
            }
            acc.grads()
        };
        if sync {
            mlp::wait_for(&device);
        }
        (optim.step(mlp::LR, m, g), Duration::ZERO)
    });
    // The line the benchmark reads (kolo's workers print the same).
    println!(
        "RESULT steps_per_s={:.4} comm_share={:.4}",
        t.steps_per_s,
        t.comm.as_secs_f64() / t.total.as_secs_f64()
    );
    Ok(())
}
