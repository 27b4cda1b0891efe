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

/// Every parameter's gradient from `grads` copied into `out` — the flat sequence — at
/// the parameter's offset; zeros for a parameter without a gradient (or of another
/// type).
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
            let n = param.val().shape().num_elements();
            let Some(dst) = self.out.get_mut(start..start + n) else {
                return;
            };
            let data = self.grads.remove::<D>(param.id).map(Tensor::into_data);
            // Borrowed, not `try_into_vec`: Burn's buffers are 16-byte aligned, so
            // taking them as a `Vec` copies them first.
            match data.as_ref().and_then(|d| d.as_slice::<T>().ok()) {
                Some(v) if v.len() == n => dst.copy_from_slice(v),
                _ => dst.fill(T::default()),
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
    struct Read {
        parts: std::iter::Peekable<std::vec::IntoIter<super::Part>>,
        next: usize,
        out: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for Read {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let i = self.next;
            self.next += 1;
            if let Some(part) = self.parts.next_if(|p| p.param == i) {
                let n = param.val().shape().num_elements();
                self.out.push(param.val().reshape([n]).slice(part.in_param));
            }
        }
    }
    let mut r = Read {
        parts: plan.parts().into_iter().peekable(),
        next: 0,
        out: Vec::new(),
    };
    module.visit(&mut r);
    match r.out.len() {
        0 => None,
        1 => r.out.pop(),
        _ => Some(Tensor::cat(r.out, 0)),
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

/// The flat gradients' memory, lent to the reduce-scatter: when kolo is done with it
/// (it drops the input), the memory goes back to `home` for the next step's gradients
/// — a fresh buffer of this size comes from `mmap` and faults page by page otherwise.
/// Words of 4 bytes keep it aligned for f32, f16 and bf16.
pub(super) struct Recycled {
    words: Vec<u32>,
    bytes: usize,
    home: Home,
}

/// Where a [`Recycled`] buffer goes back to.
pub(super) type Home = std::sync::Arc<std::sync::Mutex<Option<Vec<u32>>>>;

impl Recycled {
    /// A buffer of `bytes` bytes (contents left from its last use), from `home` when it
    /// holds one large enough.
    pub(super) fn take(home: &Home, bytes: usize) -> Recycled {
        let back = home
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let words_needed = bytes.div_ceil(4);
        let words = match back {
            Some(w) if w.len() >= words_needed => w,
            _ => vec![0u32; words_needed],
        };
        Recycled {
            words,
            bytes,
            home: home.clone(),
        }
    }

    /// The buffer as elements of `T`.
    pub(super) fn as_mut_slice<T: Flat>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(
            &mut bytemuck::cast_slice_mut::<u32, u8>(&mut self.words)[..self.bytes],
        )
    }
}

impl kolo::HostBuffer for Recycled {
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u32, u8>(&self.words)[..self.bytes]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u32, u8>(&mut self.words)[..self.bytes]
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let words = std::mem::take(&mut self.words);
        *self
            .home
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(words);
    }
}
