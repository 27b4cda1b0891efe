//! The embedded digits data both frameworks' examples train on: smartcore's copy of
//! the UCI handwritten digits (1797 8×8 images, ten classes), pixels scaled to
//! [0, 1], split 80/20 by a fixed shuffle. Included by `#[path]` from each
//! integration's example.

use kolo::DistributedSampler;

/// The digits and the split.
pub(crate) struct Digits {
    /// 64 pixels per image, row after row of images.
    pub(crate) x: Vec<f32>,
    /// The class of each image.
    pub(crate) y: Vec<i64>,
    /// Indices of the training images.
    pub(crate) train: Vec<usize>,
    /// Indices of the held-out images.
    pub(crate) test: Vec<usize>,
}

/// Loads the digits, split by a shuffle drawn from `seed`.
pub(crate) fn load_digits(seed: u64) -> Digits {
    let d = smartcore::dataset::digits::load_dataset();
    let x = d.data.iter().map(|p| p / 16.0).collect();
    let y = d.target.iter().map(|&t| t as i64).collect();
    // The same sampler that shards training data gives a fixed permutation here.
    let order = DistributedSampler::new(d.num_samples, 0, 1, seed ^ 0xD161_7500).indices(0);
    let n_test = d.num_samples / 5;
    Digits {
        x,
        y,
        test: order[..n_test].to_vec(),
        train: order[n_test..].to_vec(),
    }
}
