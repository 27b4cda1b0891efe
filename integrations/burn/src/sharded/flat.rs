//! The element-range sharding's moves between the model and kolo (the gradients go
//! through the scattering `GradientReducer`): this rank's block of each parameter read
//! as a view, the gathered parameters put back — in the parameters' own float type
//! (f32, f16 or bf16), nothing copied on the way.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use half::{bf16, f16};

use super::Plan;
use crate::convert;
use crate::error::{Error, Result};
use crate::layout::trains;

/// A float type the shard may hold: the parameters' own, which the wrapped
/// optimizer's state keeps.
pub(super) trait Flat: burn::tensor::Element + kolo::Element + Default {
    /// The value as f64 (for norms).
    fn to_f64(self) -> f64;
    /// The value times `c`, computed in f32 and rounded to this type (as Burn's norm
    /// clipping multiplies in f32 and casts back).
    fn times(self, c: f32) -> Self;
}

impl Flat for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn times(self, c: f32) -> Self {
        self * c
    }
}

impl Flat for f16 {
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn times(self, c: f32) -> Self {
        f16::from_f32(self.to_f32() * c)
    }
}

impl Flat for bf16 {
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn times(self, c: f32) -> Self {
        bf16::from_f32(self.to_f32() * c)
    }
}

/// This rank's block of each parameter, flattened — a view of the parameter, not a
/// copy — in module order (frozen parameters left out, as in the plan); `None` for an
/// empty block.
pub(super) fn blocks<M: Module>(module: &M, plan: &Plan) -> Vec<Option<Tensor<1>>> {
    struct Read<'a> {
        plan: &'a Plan,
        out: Vec<Option<Tensor<1>>>,
    }
    impl ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !trains(param) {
                return;
            }
            let i = self.out.len();
            let block = self.plan.blocks.get(i).filter(|b| !b.is_empty());
            self.out.push(block.map(|b| {
                let n = param.val().shape().num_elements();
                param.val().reshape([n]).slice(b.clone())
            }));
        }
    }
    let mut r = Read {
        plan,
        out: Vec::with_capacity(plan.sizes.len()),
    };
    module.visit(&mut r);
    r.out
}

/// The all-gathered parameters (one flat tensor each, in module order) as Burn
/// tensors on `device`: kolo's buffers taken over, not copied.
pub(super) fn gathered(
    all: Vec<kolo::Tensor>,
    plan: &Plan,
    device: &Device,
) -> Result<Vec<Option<Tensor<1>>>> {
    all.into_iter()
        .zip(&plan.sizes)
        .map(|(t, &n)| {
            if t.len() != n {
                return Err(Error::Kolo(kolo::Error::Internal(format!(
                    "a gathered parameter holds {} elements where the model's has {n}",
                    t.len()
                ))));
            }
            convert::to_burn::<1>("the gathered parameters", t, plan.dtype, device).map(Some)
        })
        .collect()
}

/// Where the gathered parameters are: one flat tensor per parameter (element ranges),
/// or one sequence with each parameter at an offset (whole tensors).
pub(super) enum Gathered<'a> {
    /// Parameter `i`'s values, in module order (taken as they are used).
    Each(Vec<Option<Tensor<1>>>),
    /// Every parameter in one tensor, parameter `i` from `offsets[i]`.
    One {
        /// The gathered sequence.
        all: Box<Tensor<1>>,
        /// Where each parameter starts in it.
        offsets: &'a [usize],
    },
}

/// Puts gathered parameters back into the model without copying them: each parameter
/// becomes its gathered values (or a slice of the one sequence) reshaped, keeping its
/// id and `require_grad`. Frozen parameters are not in the plan and stay as they are.
pub(super) struct WriteViews<'a> {
    pub(super) all: Gathered<'a>,
    pub(super) next: usize,
}

impl ModuleMapper for WriteViews<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !trains(&param) {
            return param;
        }
        let i = self.next;
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let n = shape.num_elements();
        let flat = match &mut self.all {
            Gathered::One { all, offsets } => offsets
                .get(i)
                .map(|&start| (**all).clone().slice(start..start + n)),
            Gathered::Each(each) => each.get_mut(i).and_then(Option::take),
        };
        let Some(flat) = flat else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let mut updated: Tensor<D> = flat.reshape(shape);
        if tensor.is_require_grad() {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}
