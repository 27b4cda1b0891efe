//! Batch normalization over the global batch: Horovod's and PyTorch's `SyncBatchNorm`
//! for Burn.
//!
//! In training each rank sums its input per channel (values, squares, count); one
//! allreduce (Sum) of the three gives the global mean and variance, so every rank
//! normalizes with the statistics of all ranks' samples, weighted by how many each
//! has (an uneven last batch counts right). The statistics depend on every rank's
//! input, so the backward pass must also sum across ranks: the allreduce is an
//! autodiff op whose backward allreduces the gradient of the statistics (the
//! `Σ dy` and `Σ dy·x` terms of batch norm's backward). Everything else is Burn's own
//! differentiable arithmetic.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param, RunningState};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{DType, Device, FloatDType, Tensor, TensorCreationOptions, TensorData};
use kolo::{Kolo, ProcessSet, ReduceOp};

/// Numbers the layers of a process in the order they are made. The ranks agree on
/// each layer's name at its first training forward pass (rank 0's), so a layer made
/// on one rank only (an extra copy of a model) does not shift the others' names.
static LAYERS: AtomicU64 = AtomicU64::new(0);

/// `burn::nn::BatchNorm` with its batch statistics computed over every rank's samples.
///
/// Same configuration, parameters, running statistics and record as `BatchNorm`
/// (a checkpoint of one loads into the other), for inputs `[B, C, ...]` of rank 3
/// and 4 (and any other of at least 2). Swap the type in a model and build the layer
/// with [`SyncBatchNorm::new`] (or convert one with
/// [`from_batch_norm`](Self::from_batch_norm)):
///
/// ```no_run
/// # use burn::nn::BatchNormConfig;
/// # fn demo(kolo: &kolo::Kolo, device: &burn::tensor::Device) {
/// // was: let bn = BatchNormConfig::new(16).init(device);
/// let bn = kolo_burn::SyncBatchNorm::new(kolo, &BatchNormConfig::new(16), device);
/// # }
/// ```
///
/// In training (an autodiff device, the layer not frozen), each forward makes one
/// allreduce of `2C + 1` values and the backward one more; the running statistics are
/// updated from the global values and stay the same on every rank. In evaluation
/// there is no communication. f16 and bf16 inputs are normalized in f32 (statistics
/// summed and reduced in f32, only the output cast back), f64 in f64. Every rank (of the process set, see
/// [`process_set`](Self::process_set)) must run the layer's forward and backward
/// passes alike. Layers are matched across ranks by the order of their first
/// training forward pass (one small allgather then, per layer): a layer with another
/// number of channels there fails on every rank, naming each rank's layer.
///
/// Like `BatchNorm::forward`, `forward` returns a tensor, not a `Result`: when the
/// allreduce fails (a rank left) it panics naming the layer, and kolo's panic hook
/// ends the job with that message. The backward allreduce needs Burn's CPU backend
/// (`Flex`) under autodiff, or with the `cuda`/`cpu` feature its CubeCL backend; on
/// other backends the forward pass is synchronized but the backward pass keeps each
/// rank's part only (warned once).
#[derive(Module, Debug)]
pub struct SyncBatchNorm {
    /// The learnable weight gamma.
    pub gamma: Param<Tensor<1>>,
    /// The learnable weight beta.
    pub beta: Param<Tensor<1>>,
    /// Whether training behavior is enabled for this layer.
    pub training: Param<burn::module::Flag>,
    /// The running mean (of the global batches).
    pub running_mean: RunningState<Tensor<1>>,
    /// The running variance (of the global batches, biased, as `BatchNorm`'s).
    pub running_var: RunningState<Tensor<1>>,
    /// Momentum of the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
    #[module(skip)]
    sync: Option<Sync>,
}

/// Who a layer synchronizes with, and the name of its allreduces.
#[derive(Debug, Clone)]
struct Sync {
    /// The job's handle, or a process set's.
    kolo: Kolo,
    name: String,
    /// Why this rank cannot synchronize (it is outside the layer's process set).
    refused: Option<String>,
    /// The name the ranks agreed on at the layer's first training forward pass
    /// (shared by the layer's clones).
    agreed: std::sync::Arc<std::sync::OnceLock<String>>,
}

impl Sync {
    /// This layer as its ranks agreed at its first training forward pass, with `c`
    /// channels: under rank 0's name (issue 53 item 28: a process-wide counter made
    /// the names differ when one rank made one more layer, and the job hung).
    ///
    /// # Panics
    /// On every rank, when the ranks' layers at this pass have different channels,
    /// or the allgather fails.
    fn agreed(&self, c: usize) -> Sync {
        if self.refused.is_some() {
            return self.clone();
        }
        let name = self.agreed.get_or_init(|| {
            let all: Vec<(String, usize)> = self
                .kolo
                .allgather_object("kolo_burn.sync_batch_norm.layers", (self.name.clone(), c))
                .unwrap_or_else(|e| {
                    panic!(
                        "kolo_burn::SyncBatchNorm {}: agreeing on the layer with the other \
                         ranks failed: {e}",
                        self.name
                    )
                });
            if all.iter().any(|(_, ch)| *ch != c) {
                let each: Vec<String> = all
                    .iter()
                    .enumerate()
                    .map(|(r, (n, ch))| format!("rank {r}: {n} with {ch} channels"))
                    .collect();
                panic!(
                    "kolo_burn::SyncBatchNorm {}: the ranks run different layers at this \
                     forward pass ({}); every rank must run the same SyncBatchNorm layers in \
                     the same order",
                    self.name,
                    each.join(", ")
                );
            }
            all.first()
                .map_or_else(|| self.name.clone(), |(n, _)| n.clone())
        });
        Sync {
            name: name.clone(),
            ..self.clone()
        }
    }
}

impl SyncBatchNorm {
    /// A new layer, as `config.init(device)` makes a `BatchNorm`.
    ///
    /// # Panics
    /// As `BatchNormConfig::init`: no features, an epsilon that is not finite and
    /// positive, a momentum outside `[0, 1]`.
    pub fn new(kolo: &Kolo, config: &BatchNormConfig, device: &Device) -> Self {
        Self::from_batch_norm(kolo, config.init(device))
    }

    /// `bn`'s parameters and running statistics in a layer that synchronizes.
    pub fn from_batch_norm(kolo: &Kolo, bn: BatchNorm) -> Self {
        let n = LAYERS.fetch_add(1, Ordering::Relaxed);
        SyncBatchNorm {
            gamma: bn.gamma,
            beta: bn.beta,
            training: bn.training,
            running_mean: bn.running_mean,
            running_var: bn.running_var,
            momentum: bn.momentum,
            epsilon: bn.epsilon,
            sync: Some(Sync {
                kolo: kolo.clone(),
                name: format!("kolo_burn.sync_batch_norm.{n}"),
                refused: None,
                agreed: Default::default(),
            }),
        }
    }

    /// Synchronizes among the ranks of `set` only (e.g. the replicas of one
    /// pipeline stage) instead of the whole job. On a rank outside the set, a
    /// training forward pass panics naming the rank and the set.
    pub fn process_set(mut self, set: &ProcessSet) -> Self {
        if let Some(s) = &mut self.sync {
            match crate::grads::in_set(&s.kolo, set, "use a layer synchronized in it") {
                Ok(k) => s.kolo = k,
                Err(why) => s.refused = Some(why),
            }
            // Agreed among the set's ranks, at the next training forward pass.
            s.agreed = Default::default();
        }
        self
    }

    /// The same parameters and running statistics in a plain `BatchNorm`.
    pub fn into_batch_norm(self) -> BatchNorm {
        BatchNorm {
            gamma: self.gamma,
            beta: self.beta,
            training: self.training,
            running_mean: self.running_mean,
            running_var: self.running_var,
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }

    /// Normalizes `input` (`[B, C, ...]`): with the global batch statistics in
    /// training, with the running statistics otherwise.
    ///
    /// # Panics
    /// The input's rank is below 2 or its second axis is not the layer's features;
    /// the statistics' allreduce fails (a rank left: the message names the layer).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [c] = self.gamma.shape().dims();
        let dims = input.dims();
        assert!(
            D >= 2 && dims[1] == c,
            "SyncBatchNorm: input of shape {dims:?}, expected [batch, {c}, ...]"
        );
        match (
            &self.sync,
            input.device().is_autodiff() && self.training.is_enabled(),
        ) {
            (Some(sync), true) => self.forward_train(&sync.agreed(c), input, c),
            _ => self.forward_inference(input),
        }
    }

    fn forward_inference<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let device = input.device();
        burn::tensor::module::batch_norm(
            input,
            self.gamma.val(),
            self.beta.val(),
            self.running_mean.value().to_device(&device),
            self.running_var.value().to_device(&device),
            self.epsilon,
        )
    }

    fn forward_train<const D: usize>(&self, sync: &Sync, input: Tensor<D>, c: usize) -> Tensor<D> {
        let device = input.device();
        let dtype = input.dtype();
        // f16 and bf16 are normalized in f32 and only the output is cast back: in f16
        // a channel's sum (or the count) passes 65504 and becomes inf, and bf16's
        // 8-bit mantissa puts the variance 10-50 % off. f64 stays f64.
        let wide = if dtype == DType::F64 {
            FloatDType::F64
        } else {
            FloatDType::F32
        };
        let x = input.cast(wide);
        let per_channel = x.shape().num_elements() / c;
        // [C, everything else]: each channel's values in one row.
        let rows = x.clone().swap_dims(0, 1).reshape([c, per_channel]);
        let sum = rows.clone().sum_dim(1).reshape([c]);
        let squares = (rows.clone() * rows).sum_dim(1).reshape([c]);
        let count = Tensor::<1>::from_data(
            TensorData::new(vec![per_channel as f64], [1]),
            TensorCreationOptions::new(device.clone()).with_dtype(wide.into()),
        );
        let stats = Tensor::cat(vec![sum, squares, count], 0);
        let global = allreduce_sum(sync, stats);
        let n = global.clone().narrow(0, 2 * c, 1);
        let mean = global.clone().narrow(0, 0, c) / n.clone();
        let var = (global.narrow(0, c, c) / n - mean.clone() * mean.clone()).clamp_min(0.0);

        let mut shape = [1usize; D];
        shape[1] = c;
        let inv_std = (var.clone() + self.epsilon).sqrt().recip();
        let out = (x - mean.clone().reshape(shape))
            * inv_std.reshape(shape)
            * self.gamma.val().cast(wide).reshape(shape)
            + self.beta.val().cast(wide).reshape(shape);

        let m = self.momentum;
        let running_mean = self.running_mean.value_sync().to_device(&device);
        let running_var = self.running_var.value_sync().to_device(&device);
        let (mean_dtype, var_dtype) = (running_mean.dtype(), running_var.dtype());
        let mean = mean.detach().cast(mean_dtype);
        let var = var.detach().cast(var_dtype);
        self.running_mean
            .update((running_mean.mul_scalar(1.0 - m) + mean.mul_scalar(m)).detach());
        self.running_var
            .update((running_var.mul_scalar(1.0 - m) + var.mul_scalar(m)).detach());
        out.cast(dtype)
    }
}

/// Sums `t` across `sync`'s ranks; on the host (the `2C + 1` statistics are small).
fn host_allreduce(sync: &Sync, name: String, t: Tensor<1>) -> Tensor<1> {
    if let Some(why) = &sync.refused {
        panic!("kolo_burn::SyncBatchNorm {}: {why}", sync.name);
    }
    let device = t.device();
    let dtype = t.dtype();
    let n = t.shape().num_elements();
    // f64 statistics travel as f64, every other type as f32 (the statistics are made
    // in f32 for f16 and bf16 inputs already).
    let result = if dtype == DType::F64 {
        sum_as::<f64>(sync, &name, t).map(|v| TensorData::new(v, [n]))
    } else {
        sum_as::<f32>(sync, &name, t).map(|v| TensorData::new(v, [n]))
    };
    match result {
        // In `dtype` itself: a device configured for f16 would make f16 of the sums.
        Ok(data) => {
            Tensor::<1>::from_data(data, TensorCreationOptions::new(device).with_dtype(dtype))
        }
        Err(e) => panic!("kolo_burn::SyncBatchNorm: the allreduce {name} failed: {e}"),
    }
}

/// `t`'s values read as `E` and summed across `sync`'s ranks.
fn sum_as<E>(sync: &Sync, name: &str, t: Tensor<1>) -> kolo::Result<Vec<E>>
where
    E: burn::tensor::Element + kolo::Element,
{
    let values: Vec<E> = t
        .into_data()
        .convert::<E>()
        .try_to_vec::<E>()
        .unwrap_or_else(|e| panic!("{name}: cannot read the statistics: {e:?}"));
    let n = values.len();
    let summed = sync
        .kolo
        .allreduce(name.to_string(), kolo::Tensor::from_vec(values, &[n])?)
        .op(ReduceOp::Sum)
        .wait()?;
    Ok(summed.into_vec::<E>()?)
}

/// `stats` summed across ranks, with a backward pass that sums their gradient across
/// ranks too. Where the backend cannot be hooked: the sum in the forward pass only
/// (each rank's own gradient in backward), warned once.
fn allreduce_sum(sync: &Sync, stats: Tensor<1>) -> Tensor<1> {
    macro_rules! with {
        ($name:ident, $B:ty, $C:ty) => {
            fn $name(sync: &Sync, stats: Tensor<1>) -> Option<Tensor<1>> {
                let p = stats.try_into_primitive::<Autodiff<$B, $C>>().ok()?;
                let (primitive, guard) = p.into_parts();
                let summed = host_allreduce(
                    sync,
                    format!("{}.stats", sync.name),
                    Tensor::<1>::from_primitive::<$B>(primitive),
                )
                .try_into_primitive::<$B>()
                .ok()?;
                let out = match SumAcrossRanks
                    .prepare::<$C>([guard])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(sync.clone(), summed),
                    OpsKind::UnTracked(prep) => prep.finish(summed),
                };
                Some(Tensor::from_primitive::<Autodiff<$B, $C>>(out))
            }
        };
    }
    with!(plain, Flex, NoCheckpointing);
    with!(balanced, Flex, BalancedCheckpointing);
    let hooked = plain(sync, stats.clone()).or_else(|| balanced(sync, stats.clone()));
    #[cfg(any(feature = "cuda", feature = "cpu"))]
    let hooked = hooked.or_else(|| {
        use burn::backend::Cube;
        with!(cube_plain, Cube, NoCheckpointing);
        with!(cube_balanced, Cube, BalancedCheckpointing);
        cube_plain(sync, stats.clone()).or_else(|| cube_balanced(sync, stats.clone()))
    });
    match hooked {
        Some(t) => t,
        None => {
            static UNHOOKED: Once = Once::new();
            UNHOOKED.call_once(|| {
                tracing::warn!(
                    "kolo-burn: SyncBatchNorm's backward pass needs Burn's CPU backend (flex) \
                     or, with kolo-burn's cuda/cpu feature, its CubeCL backend, with autodiff; \
                     here each rank's gradient keeps its own samples' part"
                );
            });
            let summed =
                host_allreduce(sync, format!("{}.stats", sync.name), stats.clone().detach());
            // The global values forward, the local gradient backward.
            stats.clone() + (summed - stats).detach()
        }
    }
}

/// The allreduce's backward: the gradient of the summed statistics, summed across the
/// same ranks, is the gradient of each rank's own statistics.
#[derive(Debug)]
struct SumAcrossRanks;

impl<B: burn::backend::Backend> Backward<B, 1> for SumAcrossRanks
where
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<B>,
{
    type State = Sync;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        let sync = ops.state;
        let summed = host_allreduce(
            &sync,
            format!("{}.grad", sync.name),
            Tensor::<1>::from_primitive::<B>(grad),
        );
        if let Some(parent) = parent {
            match summed.try_into_primitive::<B>() {
                Ok(p) => grads.register::<B>(parent.id, p),
                Err(e) => panic!("kolo_burn::SyncBatchNorm {}: {e:?}", sync.name),
            }
        }
    }
}
