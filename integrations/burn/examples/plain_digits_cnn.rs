//! Plain single-process Burn training of `train_digits_cnn`'s CNN with `BatchNorm`,
//! the same data order, optimizer and learning rate: the baseline of
//! `scripts/run-cnn-bench.sh`, which launches it alternately with the example's ranks.
//! It starts neither kolo nor MPI (it links them: the model's type names
//! `SyncBatchNorm`). Prints `RESULT steps_per_s=…` as the example does.
//!
//! ```sh
//! RAYON_NUM_THREADS=1 target/release/examples/plain_digits_cnn 5 8    # epochs, batch
//! ```

// The held-out split is not evaluated here: this program only times training.
#[allow(dead_code)]
#[path = "../../shared/digits.rs"]
mod digits;

#[path = "common/cnn.rs"]
mod cnn;

use std::time::Instant;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::Device;
use kolo::DistributedSampler;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let epochs: u64 = args.get(1).and_then(|v| v.parse().ok()).unwrap_or(5);
    let batch: usize = args.get(2).and_then(|v| v.parse().ok()).unwrap_or(8).max(1);
    let device = Device::flex().autodiff();
    device.seed(42);
    let data = digits::load_digits(42);
    let mut model = cnn::Cnn::new(None, &device);
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let sampler = DistributedSampler::new(data.train.len(), 0, 1, 42);
    let started = Instant::now();
    let mut steps = 0u64;
    for epoch in 0..epochs {
        for idx in sampler.indices(epoch).chunks(batch) {
            let ids: Vec<usize> = idx.iter().map(|&i| data.train[i]).collect();
            let (x, y) = cnn::batch(&data, &ids, &device);
            let loss = loss_fn.forward(model.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(2e-3, model, grads);
            steps += 1;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "RESULT steps_per_s={:.4}",
        steps as f64 / secs.max(f64::MIN_POSITIVE)
    );
}
