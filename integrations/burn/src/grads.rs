//! The fused path: every gradient of a step reduced in a few large collectives.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use kolo::{Kolo, ReduceOp};

use crate::error::{Error, Result};

/// Where one parameter's gradient sits in the fused buffer.
struct Slot {
    id: ParamId,
    name: String,
    dims: Vec<usize>,
    offset: usize,
    len: usize,
    device: Device,
    dtype: burn::tensor::DType,
}

/// Reduces all gradients of a step across ranks in a few fused allreduces, then hands
/// them back in a [`GradientsParams`] for Burn's optimizer.
///
/// Gradients are visited in module order (the same on every rank), flattened to f32
/// into one buffer, and reduced in chunks of at most `chunk_bytes` that are all in
/// flight at once. A parameter without a gradient on this rank contributes zeros, so
/// ranks whose graph skipped a parameter still take part.
///
/// Use it between `backward` and `ModuleOptimizer::step` in a hand-written loop, or
/// from an overridden `TrainStep::optimize` in burn-train's Learner. Prefer it to the
/// per-tensor [`DistributedOptimizer`](crate::DistributedOptimizer), which issues one
/// collective per parameter.
#[derive(Debug, Clone)]
pub struct GradientReducer {
    kolo: Kolo,
    op: ReduceOp,
    chunk_bytes: usize,
    prefix: String,
    passes: usize,
}

impl GradientReducer {
    /// Averages gradients across all ranks in chunks of 64 MiB.
    pub fn new(kolo: &Kolo) -> Self {
        GradientReducer {
            kolo: kolo.clone(),
            op: ReduceOp::Average,
            chunk_bytes: 64 << 20,
            prefix: "kolo_burn.grads".into(),
            passes: 1,
        }
    }

    /// [`ReduceOp::Average`] (default) or [`ReduceOp::Sum`].
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// The gradients handed to [`reduce`](Self::reduce) are the sum of `passes`
    /// backward passes (accumulated locally, e.g. with Burn's `GradientsAccumulator`):
    /// they are divided by `passes`, so that with a mean loss `n` passes over batches
    /// of `b` equal one pass over `n·b` — one reduction per `n` passes.
    pub fn backward_passes_per_step(mut self, passes: usize) -> Self {
        self.passes = passes.max(1);
        self
    }

    /// Largest collective in bytes (at least 4).
    pub fn chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes.max(4);
        self
    }

    /// Names the collectives `<prefix>.<chunk>`: give two reducers that run
    /// concurrently different prefixes.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Takes every gradient of `module` out of `grads`, reduces them across ranks and
    /// returns them registered under the same parameter ids.
    ///
    /// # Errors
    /// A gradient that cannot be read, or a failed collective (e.g. the ranks' models
    /// differ in size, reported as a shape mismatch naming the ranks).
    pub fn reduce<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let mut collect = Collect {
            grads: &mut grads,
            path: Vec::new(),
            slots: Vec::new(),
            buffer: Vec::new(),
            error: None,
        };
        module.visit(&mut collect);
        if let Some(e) = collect.error {
            return Err(e);
        }
        let Collect { slots, buffer, .. } = collect;
        let reduced = self.allreduce(buffer)?;
        let mut out = GradientsParams::new();
        let mut register = Register {
            slots: &slots,
            next: 0,
            reduced: &reduced,
            out: &mut out,
        };
        module.visit(&mut register);
        Ok(out)
    }

    fn allreduce(&self, buffer: Vec<f32>) -> Result<Vec<f32>> {
        let chunk = (self.chunk_bytes / 4).max(1);
        let mut handles = Vec::new();
        for (i, part) in buffer.chunks(chunk).enumerate() {
            let t = kolo::Tensor::from_vec(part.to_vec(), &[part.len()])?;
            handles.push(
                self.kolo
                    .allreduce(format!("{}.{i}", self.prefix), t)
                    .op(self.op)
                    .prescale(1.0 / self.passes as f64)
                    .submit()?,
            );
        }
        let mut out = Vec::with_capacity(buffer.len());
        for h in handles {
            out.extend_from_slice(h.wait()?.as_slice::<f32>()?);
        }
        Ok(out)
    }
}

struct Collect<'a> {
    grads: &'a mut GradientsParams,
    path: Vec<String>,
    slots: Vec<Slot>,
    buffer: Vec<f32>,
    error: Option<Error>,
}

impl ModuleVisitor for Collect<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.error.is_some() {
            return;
        }
        let name = self.path.join(".");
        let (values, dims, device, dtype) = match self.grads.remove::<D>(param.id) {
            Some(g) => {
                let device = g.device();
                let dims = g.dims().to_vec();
                let data = g.into_data();
                let dtype = data.dtype();
                match data.convert::<f32>().try_to_vec::<f32>() {
                    Ok(v) => (v, dims, device, dtype),
                    Err(e) => {
                        self.error = Some(Error::Data {
                            name,
                            message: format!("{e:?}"),
                        });
                        return;
                    }
                }
            }
            None => {
                let p = param.val();
                let dims = p.dims().to_vec();
                let n = dims.iter().product();
                (vec![0.0; n], dims, p.device().inner(), p.dtype())
            }
        };
        self.slots.push(Slot {
            id: param.id,
            name,
            dims,
            offset: self.buffer.len(),
            len: values.len(),
            device,
            dtype,
        });
        self.buffer.extend_from_slice(&values);
    }
}

struct Register<'a> {
    slots: &'a [Slot],
    next: usize,
    reduced: &'a [f32],
    out: &'a mut GradientsParams,
}

impl ModuleVisitor for Register<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(slot) = self.slots.get(self.next) else {
            return;
        };
        self.next += 1;
        debug_assert_eq!(slot.id, param.id, "{}", slot.name);
        let Some(values) = self.reduced.get(slot.offset..slot.offset + slot.len) else {
            return;
        };
        let data = TensorData::new(values.to_vec(), slot.dims.clone()).convert_dtype(slot.dtype);
        self.out
            .register(slot.id, Tensor::<D>::from_data(data, &slot.device));
    }
}
