//! The CNN of `train_digits_cnn` and of the plain-Burn baseline
//! (`benches/baseline/plain_cnn.rs`): two 3×3 convolutions (16 and 32 channels), each
//! followed by batch norm and ReLU, a 2×2 max pool and a linear head.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use kolo::Kolo;
use kolo_burn::SyncBatchNorm;

use super::digits::Digits;

/// One of the two kinds of batch norm (a model switches by this type alone).
#[derive(Module, Debug)]
pub(crate) struct Bn {
    sync: Option<SyncBatchNorm>,
    plain: Option<BatchNorm>,
}

impl Bn {
    fn new(sync: Option<&Kolo>, channels: usize, device: &Device) -> Self {
        let config = BatchNormConfig::new(channels);
        match sync {
            Some(kolo) => Bn {
                sync: Some(SyncBatchNorm::new(kolo, &config, device)),
                plain: None,
            },
            None => Bn {
                sync: None,
                plain: Some(config.init(device)),
            },
        }
    }

    fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        match (&self.sync, &self.plain) {
            (Some(s), _) => s.forward(x),
            (None, Some(p)) => p.forward(x),
            (None, None) => x,
        }
    }
}

#[derive(Module, Debug)]
pub(crate) struct Cnn {
    conv1: Conv2d,
    bn1: Bn,
    conv2: Conv2d,
    bn2: Bn,
    pool: MaxPool2d,
    act: Relu,
    head: Linear,
}

impl Cnn {
    /// Batch norms synchronized through `sync`, or plain `BatchNorm` with `None`.
    pub(crate) fn new(sync: Option<&Kolo>, device: &Device) -> Self {
        let conv = |i, o| {
            Conv2dConfig::new([i, o], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
        };
        Cnn {
            conv1: conv(1, 16),
            bn1: Bn::new(sync, 16, device),
            conv2: conv(16, 32),
            bn2: Bn::new(sync, 32, device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            act: Relu::new(),
            head: LinearConfig::new(32 * 4 * 4, 10).init(device),
        }
    }

    pub(crate) fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let x = self.act.forward(self.bn1.forward(self.conv1.forward(x)));
        let x = self.act.forward(self.bn2.forward(self.conv2.forward(x)));
        let x = self.pool.forward(x);
        let [b, c, h, w] = x.dims();
        self.head.forward(x.reshape([b, c * h * w]))
    }
}

/// The images `ids` as `[n, 1, 8, 8]` and their labels.
pub(crate) fn batch(d: &Digits, ids: &[usize], device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let mut x = Vec::with_capacity(ids.len() * 64);
    let mut y = Vec::with_capacity(ids.len());
    for &i in ids {
        x.extend_from_slice(&d.x[i * 64..(i + 1) * 64]);
        y.push(d.y[i]);
    }
    (
        Tensor::from_data(TensorData::new(x, [ids.len(), 1, 8, 8]), device),
        Tensor::from_data(TensorData::new(y, [ids.len()]), device),
    )
}
