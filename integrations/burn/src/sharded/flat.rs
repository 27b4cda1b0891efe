//! The flat parameter sequence of the element-range sharding: gradients flattened into
//! it, this rank's range read out of the model, the gathered sequence written back —
//! in the parameters' own float type (f32, f16 or bf16).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use half::{bf16, f16};

use super::Plan;

/// A float type the flat sequence may hold: the parameters' own, which the wrapped
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

/// Every parameter's gradient from `grads` copied into `out` — the flat sequence,
/// zeros already — at the parameter's offset; a parameter without a gradient (or of
/// another type) stays zeros.
pub(super) fn fill_gradients<T: Flat, M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    plan: &Plan,
    out: &mut [T],
) {
    struct Fill<'a, T> {
        grads: &'a mut GradientsParams,
        offsets: &'a [usize],
        next: usize,
        out: &'a mut [T],
    }
    impl<T: Flat> ModuleVisitor for Fill<'_, T> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let i = self.next;
            self.next += 1;
            let Some(&start) = self.offsets.get(i) else {
                return;
            };
            let data = self.grads.remove::<D>(param.id).map(Tensor::into_data);
            // Borrowed, not `try_into_vec`: Burn's buffers are 16-byte aligned, so
            // taking them as a `Vec` copies them first.
            if let Some(v) = data.as_ref().and_then(|d| d.as_slice::<T>().ok()) {
                if let Some(dst) = self.out.get_mut(start..start + v.len()) {
                    dst.copy_from_slice(v);
                }
            }
        }
    }
    module.visit(&mut Fill {
        grads,
        offsets: &plan.offsets,
        next: 0,
        out,
    });
}

/// This rank's range of the flat parameter sequence as one tensor on the parameters'
/// device: the overlapping parts of the parameters concatenated there (one copy, no
/// trip through host memory); `None` for an empty range.
pub(super) fn range_tensor<M: Module>(module: &M, plan: &Plan) -> Option<Tensor<1>> {
    struct Read<'a> {
        plan: &'a Plan,
        next: usize,
        parts: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for Read<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let i = self.next;
            self.next += 1;
            let (Some(&start), Some(slot)) =
                (self.plan.offsets.get(i), self.plan.layout.slots.get(i))
            else {
                return;
            };
            let end = start + slot.dims.iter().product::<usize>();
            let (lo, hi) = (
                start.max(self.plan.range.start),
                end.min(self.plan.range.end),
            );
            if lo < hi {
                self.parts.push(
                    param
                        .val()
                        .reshape([end - start])
                        .slice(lo - start..hi - start),
                );
            }
        }
    }
    let mut r = Read {
        plan,
        next: 0,
        parts: Vec::new(),
    };
    module.visit(&mut r);
    match r.parts.len() {
        0 => None,
        1 => r.parts.pop(),
        _ => Some(Tensor::cat(r.parts, 0)),
    }
}

/// Puts the gathered flat sequence back into the model without copying it: each
/// parameter becomes a slice of `all`, reshaped, keeping its id and `require_grad`.
pub(super) struct WriteViews<'a> {
    pub(super) all: Tensor<1>,
    pub(super) offsets: &'a [usize],
    pub(super) next: usize,
}

impl ModuleMapper for WriteViews<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let i = self.next;
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let n = shape.num_elements();
        let Some(&start) = self.offsets.get(i) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let mut updated: Tensor<D> = self.all.clone().slice(start..start + n).reshape(shape);
        if tensor.is_require_grad() {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}
