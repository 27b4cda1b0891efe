//! The flat parameter sequence of the element-range sharding: gradients flattened into
//! it, this rank's range read out of the model, the gathered sequence written back —
//! in the parameters' own float type (f32, f16 or bf16).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorData};
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

/// Every parameter's gradient from `grads`, flattened in module order (zeros for a
/// parameter without one).
pub(super) fn flat_gradients<T: Flat, M: Module>(
    module: &M,
    grads: &mut GradientsParams,
    plan: &Plan,
    mut out: Vec<T>,
) -> Vec<T> {
    struct Flatten<'a, T> {
        grads: &'a mut GradientsParams,
        out: Vec<T>,
    }
    impl<T: Flat> ModuleVisitor for Flatten<'_, T> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let n = param.val().shape().num_elements();
            let data = self.grads.remove::<D>(param.id).map(Tensor::into_data);
            // Borrowed, not `try_into_vec`: Burn's buffers are 16-byte aligned, so
            // taking them as a `Vec` copies them first.
            match data.as_ref().and_then(|d| d.as_slice::<T>().ok()) {
                Some(v) if v.len() == n => self.out.extend_from_slice(v),
                _ => self.out.resize(self.out.len() + n, T::default()),
            }
        }
    }
    out.clear();
    out.reserve(plan.total);
    let mut f = Flatten { grads, out };
    module.visit(&mut f);
    f.out
}

/// The values of this rank's range of the flat parameter sequence (only the
/// parameters that overlap it are read).
pub(super) fn read_range<T: Flat, M: Module>(module: &M, plan: &Plan) -> Vec<T> {
    struct Read<'a, T> {
        plan: &'a Plan,
        next: usize,
        out: Vec<T>,
    }
    impl<T: Flat> ModuleVisitor for Read<'_, T> {
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
            if lo >= hi {
                return;
            }
            // Only the overlapping elements are copied out of the parameter.
            let part = param
                .val()
                .reshape([end - start])
                .slice(lo - start..hi - start);
            if let Ok(v) = part.into_data().as_slice::<T>() {
                self.out.extend_from_slice(v);
            }
        }
    }
    let mut r = Read {
        plan,
        next: 0,
        out: Vec::with_capacity(plan.range.len()),
    };
    module.visit(&mut r);
    r.out
}

/// Puts the gathered flat parameters back into the model, parameter by parameter in
/// module order, keeping each one's id, device and `require_grad`.
pub(super) struct WriteBack<'a, T> {
    pub(super) all: &'a [T],
    pub(super) offsets: &'a [usize],
    pub(super) next: usize,
    /// The parameters' float type.
    pub(super) dtype: DType,
}

impl<T: Flat> ModuleMapper for WriteBack<'_, T> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let i = self.next;
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let n = shape.num_elements();
        let Some(values) = self
            .offsets
            .get(i)
            .and_then(|&start| self.all.get(start..start + n))
        else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let mut updated = Tensor::<D>::from_data(
            TensorData::new(values.to_vec(), shape),
            (&tensor.device(), self.dtype),
        );
        if tensor.is_require_grad() {
            updated = updated.require_grad();
        }
        Param::from_mapped_value(id, updated, mapper)
    }
}
