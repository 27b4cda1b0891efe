//! The per-tensor path: a Burn `Optimizer` that reduces each gradient across ranks
//! before the wrapped optimizer's step.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::optim::{LearningRate, Optimizer};
use burn::tensor::{Device, Tensor, TensorData};
use kolo::{Kolo, ReduceOp};

/// Wraps any Burn [`Optimizer`] so that it goes wherever one goes
/// (`ModuleOptimizer::from`, burn-train's `Learner`) and averages each gradient across
/// ranks just before stepping that parameter.
///
/// Burn calls the optimizer once per parameter, in module order, without naming the
/// parameter; the wrapper names each collective by its position in that sequence, so
/// every rank must step the same parameters in the same order (a parameter without a
/// gradient on one rank is skipped there by Burn and the ranks fall out of step: use
/// [`GradientReducer`](crate::GradientReducer) for models with unused parameters).
/// It costs one blocking collective per parameter; the fused `GradientReducer` is
/// faster and is what the examples use.
///
/// # Panics
/// Burn's `Optimizer::step` cannot return an error, so a failed collective (a rank
/// left, models that differ between ranks) panics with kolo's message.
#[derive(Clone, Debug)]
pub struct DistributedOptimizer<O> {
    inner: O,
    kolo: Kolo,
    op: ReduceOp,
    counter: Arc<AtomicU64>,
}

impl<O: Optimizer> DistributedOptimizer<O> {
    /// Wraps `inner`, averaging gradients across all ranks.
    pub fn new(kolo: &Kolo, inner: O) -> Self {
        DistributedOptimizer {
            inner,
            kolo: kolo.clone(),
            op: ReduceOp::Average,
            counter: Arc::new(AtomicU64::new(0)),
        }
    }

    /// [`ReduceOp::Average`] (default) or [`ReduceOp::Sum`].
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    fn reduce<const D: usize>(&self, grad: Tensor<D>) -> kolo::Result<Tensor<D>> {
        let n = self.counter.fetch_add(1, Ordering::SeqCst);
        let device = grad.device();
        let dims = grad.dims();
        let data = grad.into_data();
        let dtype = data.dtype();
        let values: Vec<f32> = data.convert::<f32>().try_to_vec::<f32>().map_err(|e| {
            kolo::Error::InvalidArgument {
                op: "allreduce",
                name: format!("kolo_burn.param.{n}"),
                message: format!("gradient cannot be read as f32: {e:?}"),
            }
        })?;
        let len = values.len();
        let t = kolo::Tensor::from_vec(values, &[len])?;
        let reduced = self
            .kolo
            .allreduce(format!("kolo_burn.param.{n}"), t)
            .op(self.op)
            .wait()?;
        let data = TensorData::new(reduced.into_vec::<f32>()?, dims).convert_dtype(dtype);
        Ok(Tensor::from_data(data, &device))
    }
}

impl<O: Optimizer> Optimizer for DistributedOptimizer<O> {
    type State<const D: usize> = O::State<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let grad = match self.reduce(grad) {
            Ok(g) => g,
            Err(e) => panic!(
                "kolo-burn: reducing a gradient on rank {} failed: {e}",
                self.kolo.rank()
            ),
        };
        self.inner.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        O::to_device(state, device)
    }
}
