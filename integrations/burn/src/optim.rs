//! The per-tensor path: a Burn `Optimizer` that reduces each gradient across ranks
//! before the wrapped optimizer's step.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use burn::grad_clipping::{GradientClipping, GradientClippingConfig};
use burn::optim::{join_path, LearningRate, Optimizer, RecordState, StateSink, StateSource};
use burn::tensor::{Device, Tensor, TensorData};
use kolo::{Kolo, ReduceOp};

use crate::convert::{self, Copied};

/// Wraps any Burn [`Optimizer`] so that it goes wherever one goes
/// (`ModuleOptimizer::from`, burn-train's `Learner`) and averages each gradient across
/// ranks just before stepping that parameter.
///
/// **Names.** Burn calls the optimizer once per parameter, in module order, without
/// naming the parameter. The wrapper numbers each parameter by its position the first
/// time it is stepped and keeps that number in the parameter's optimizer state
/// ([`DistributedState`]), so every later step reduces it under the same name
/// (`kolo_burn.param.<position>`) and kolo's response cache serves it. A state restored
/// from a record (a checkpoint, [`broadcast_optimizer_state`](crate::broadcast_optimizer_state))
/// keeps its position, and positions handed out later in the process start above every
/// restored one, so a parameter stepped for the first time after a resume never takes
/// a restored parameter's name. Every rank must
/// step the same parameters in the same order: Burn skips a parameter that has no
/// gradient, so a parameter unused on one rank puts the ranks out of step (a shape
/// mismatch error, or for equal shapes wrong sums). Use
/// [`GradientReducer`](crate::GradientReducer) for models with unused parameters; it
/// also reduces a whole step in a few collectives instead of one blocking collective
/// per parameter.
///
/// **Copies.** As [`GradientReducer`](crate::GradientReducer): the gradient's buffer is
/// reduced in place and becomes the gradient handed to the wrapped optimizer; f16 and
/// bf16 travel as 2-byte values.
///
/// **Gradient clipping.** `ModuleOptimizer::from` does not carry a config's gradient
/// clipping over (only `SgdConfig::init()` and its siblings apply it, on the local
/// gradient). Set it here with [`grad_clipping`](Self::grad_clipping): the *averaged*
/// gradient is clipped, as one process training on the global batch would.
///
/// # Panics
/// Burn's `Optimizer::step` cannot return an error. A failed collective (a rank left,
/// models that differ between ranks) panics with a message naming the rank, the
/// parameter's position and kolo's error; kolo's panic hook then ends the job on every
/// rank within seconds (`MPI_Abort`) instead of letting the others hang.
#[derive(Clone)]
pub struct DistributedOptimizer<O> {
    inner: O,
    kolo: Kolo,
    op: ReduceOp,
    clipping: Option<GradientClipping>,
    /// The next position to hand out (shared by clones, which `ModuleOptimizer` keeps).
    positions: Arc<AtomicUsize>,
    copied: Arc<Copied>,
}

impl<O: fmt::Debug> fmt::Debug for DistributedOptimizer<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("inner", &self.inner)
            .field("op", &self.op)
            .field("clipping", &self.clipping.is_some())
            .field("positions", &self.positions.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// One past the highest position restored from an optimizer record in this process.
///
/// Burn restores a state through `RecordState::state_unflatten`, which sees neither the
/// optimizer nor its counter; new positions are handed out above this mark instead, so
/// that they never repeat a restored one. Process-wide, it only ever grows: a record
/// loaded for another optimizer leaves a gap in the numbers, which costs nothing. Every
/// rank loads the same records (`load_checkpoint` and the broadcasts load them on every
/// rank), so the mark, and the names, agree across ranks.
static RESTORED_ABOVE: AtomicUsize = AtomicUsize::new(0);

/// The wrapped optimizer's state of one parameter, and the parameter's position (its
/// collective's name). Saved and restored with the optimizer record, so a resumed run
/// keeps its names.
#[derive(Clone, Debug)]
pub struct DistributedState<S> {
    position: usize,
    inner: Option<S>,
}

impl<S: RecordState> RecordState for DistributedState<S> {
    fn state_flatten(&self, prefix: &str, out: &mut StateSink) {
        // Burn's scalar leaves use a type of a crate Burn does not re-export; a
        // one-element tensor carries the position instead.
        let position = TensorData::new(vec![self.position as i64], [1]);
        out.push_tensor(prefix, "kolo_position", position);
        if let Some(inner) = &self.inner {
            inner.state_flatten(&join_path(prefix, "inner"), out);
        }
    }

    fn state_unflatten(prefix: &str, src: &mut StateSource, device: &Device) -> Option<Self> {
        let position = src.take_tensor(prefix, "kolo_position")?;
        let position = usize::try_from(*position.as_slice::<i64>().ok()?.first()?).ok()?;
        RESTORED_ABOVE.fetch_max(position.saturating_add(1), Ordering::Relaxed);
        let inner = S::state_unflatten(&join_path(prefix, "inner"), src, device);
        Some(DistributedState { position, inner })
    }
}

impl<O: Optimizer> DistributedOptimizer<O> {
    /// Wraps `inner`, averaging gradients across all ranks.
    pub fn new(kolo: &Kolo, inner: O) -> Self {
        DistributedOptimizer {
            inner,
            kolo: kolo.clone(),
            op: ReduceOp::Average,
            clipping: None,
            positions: Arc::default(),
            copied: Arc::default(),
        }
    }

    /// [`ReduceOp::Average`] (default) or [`ReduceOp::Sum`].
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// Clips each reduced gradient before the wrapped optimizer's step (e.g.
    /// `GradientClippingConfig::Norm(1.0)`; Burn's norm clipping is per parameter).
    pub fn grad_clipping(mut self, config: GradientClippingConfig) -> Self {
        self.clipping = Some(config.init());
        self
    }

    /// The position of a parameter stepped for the first time: the next one of this
    /// optimizer (and its clones), above every position restored in this process.
    fn next_position(&self) -> usize {
        self.positions
            .fetch_max(RESTORED_ABOVE.load(Ordering::Relaxed), Ordering::Relaxed);
        self.positions.fetch_add(1, Ordering::Relaxed)
    }

    fn reduce<const D: usize>(&self, position: usize, grad: Tensor<D>) -> crate::Result<Tensor<D>> {
        let name = format!("kolo_burn.param.{position}");
        let device = grad.device();
        let dtype = grad.dtype();
        let t = convert::to_kolo(&name, grad, &self.copied)?;
        let reduced = self.kolo.allreduce(name.clone(), t).op(self.op).wait()?;
        let grad = convert::to_burn(&name, reduced, dtype, &device)?;
        Ok(match &self.clipping {
            Some(c) => c.clip_gradient(grad),
            None => grad,
        })
    }
}

impl<O: Optimizer> Optimizer for DistributedOptimizer<O> {
    type State<const D: usize> = DistributedState<O::State<D>>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<D>, Option<Self::State<D>>) {
        let (position, inner_state) = match state {
            Some(s) => {
                // A restored position: later ones go above it.
                self.positions
                    .fetch_max(s.position.saturating_add(1), Ordering::Relaxed);
                (s.position, s.inner)
            }
            None => (self.next_position(), None),
        };
        let dims = grad.dims();
        let grad = match self.reduce(position, grad) {
            Ok(g) => g,
            Err(e) => panic!(
                "kolo-burn: DistributedOptimizer could not reduce the gradient of parameter \
                 #{position} (shape {dims:?}) on rank {}: {e}",
                self.kolo.rank()
            ),
        };
        let (tensor, inner) = self.inner.step(lr, tensor, grad, inner_state);
        (tensor, Some(DistributedState { position, inner }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &Device) -> Self::State<D> {
        DistributedState {
            position: state.position,
            inner: state.inner.map(|s| O::to_device(s, device)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use burn::optim::{RecordState, StateSink, StateSource};
    use burn::tensor::Device;

    use std::sync::atomic::Ordering;

    use super::{DistributedState, RESTORED_ABOVE};

    /// The position survives a save and load of the optimizer record, so a resumed run
    /// reduces each parameter under the name it had.
    #[test]
    fn position_round_trips_through_the_record() {
        let state = DistributedState {
            position: 7,
            inner: Some(()),
        };
        let mut sink = StateSink::default();
        state.state_flatten("p", &mut sink);
        let mut source = StateSource::new(BTreeMap::new());
        for (name, data) in sink.tensors {
            source.insert_tensor(name, data);
        }
        let back = DistributedState::<()>::state_unflatten("p", &mut source, &Device::flex());
        let back = back.map(|s| (s.position, s.inner));
        assert_eq!(back, Some((7, Some(()))));
        // Positions handed out from now on start above the restored one (issue 31).
        assert!(RESTORED_ABOVE.load(Ordering::Relaxed) >= 8);
        let mut empty = StateSource::new(BTreeMap::new());
        assert!(
            DistributedState::<()>::state_unflatten("p", &mut empty, &Device::flex()).is_none()
        );
    }
}
