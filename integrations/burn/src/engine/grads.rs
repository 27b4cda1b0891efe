//! The engine's gradient arithmetic over a module's parameters: scaling, and the
//! global norm (across ranks when each holds a share).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use kolo::{Kolo, ReduceOp};

use crate::error::Result;

/// Clips `grads` to the global norm `max` (PyTorch's `clip_grad_norm_`: times
/// `max / (norm + 1e-6)` when above): the norm of all of `model`'s gradients together, summed over
/// the ranks when `shared` (each rank holds a share: fully sharded units), this rank's
/// when the gradients are already the same everywhere.
pub(super) fn clip_global<M: Module>(
    kolo: &Kolo,
    model: &M,
    mut grads: GradientsParams,
    max: f64,
    shared: bool,
) -> Result<GradientsParams> {
    struct Squares<'a> {
        grads: &'a GradientsParams,
        sum: f64,
    }
    impl ModuleVisitor for Squares<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let s: f32 = (g.clone() * g).sum().into_scalar();
                self.sum += f64::from(s);
            }
        }
    }
    let mut sq = Squares {
        grads: &grads,
        sum: 0.0,
    };
    model.visit(&mut sq);
    let mut squares = sq.sum;
    if shared {
        squares = kolo
            .allreduce(
                "kolo_burn.engine.grad_norm",
                kolo::Tensor::from_vec(vec![squares], &[1])?,
            )
            .op(ReduceOp::Sum)
            .wait()?
            .into_vec::<f64>()?
            .first()
            .copied()
            .unwrap_or(0.0);
    }
    let coef = crate::sharded::global_clip(max as f32, squares);
    if coef < 1.0 {
        grads = scale(model, grads, coef);
    }
    Ok(grads)
}

/// Every gradient of `model` times `factor`.
pub(super) fn scale<M: Module>(
    model: &M,
    mut grads: GradientsParams,
    factor: f64,
) -> GradientsParams {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register(param.id, g * self.factor);
            }
        }
    }
    model.visit(&mut Scale {
        grads: &mut grads,
        factor,
    });
    grads
}
