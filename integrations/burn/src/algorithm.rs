//! Issue 57's algorithms on Burn: ByteGrad and Adasum as the way
//! [`GradientReducer`](crate::GradientReducer) reduces its buckets, and decentralized weight averaging after
//! a step ([`decentralized_average`]). The algorithms themselves are kolo's
//! (`kolo::algorithms`), shared with the other integrations.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use kolo::{Algorithm, Kolo};

use crate::error::{Error, Result};
use crate::layout::{trains, Layout};

/// How a reducer reduces its buckets with an algorithm other than allreduce.
pub(crate) struct Reduce<'a> {
    pub(crate) kolo: &'a Kolo,
    pub(crate) algorithm: Algorithm,
    pub(crate) op: kolo::ReduceOp,
    /// Backward passes summed into the gradients (each bucket is divided by it).
    pub(crate) passes: usize,
    pub(crate) prefix: &'a str,
}

impl Reduce<'_> {
    /// Reduces every bucket of `tensors` (by slot) with the algorithm, one flat f32
    /// buffer per bucket: each bucket's result, in bucket order.
    ///
    /// # Errors
    /// On every rank alike, before any collective: an algorithm that does not reduce
    /// gradients, a slot that is not f32.
    pub(crate) fn buckets(
        &self,
        layout: &Layout,
        mut tensors: Vec<Option<kolo::Tensor>>,
    ) -> Result<Vec<kolo::Result<Vec<kolo::Tensor>>>> {
        let algorithm = self.algorithm;
        reduces_gradients(algorithm)?;
        // Same layout on every rank: every rank refuses alike.
        if let Some(s) = layout.slots.iter().find(|s| s.dtype != DType::F32) {
            return Err(Error::InvalidArgument {
                what: "GradientReducer::algorithm",
                message: format!(
                    "{algorithm} reduces f32 gradients; {} is {:?} (use the default allreduce)",
                    s.path, s.dtype
                ),
            });
        }
        let prescale = 1.0 / self.passes.max(1) as f32;
        layout
            .buckets
            .iter()
            .enumerate()
            .map(|(b, bucket)| {
                let members = bucket
                    .iter()
                    .map(|&i| match tensors[i].take() {
                        Some(t) => crate::convert::on_host(t),
                        None => Ok(kolo::Tensor::zeros(kolo::DType::F32, &layout.slots[i].dims)),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let name = format!("{}.{algorithm}.{b}", self.prefix);
                Ok(self
                    .kolo
                    .algorithm_allreduce(&name, algorithm, self.op, prescale, members))
            })
            .collect()
    }
}

/// Refuses an algorithm that exchanges weights, not gradients, in a reducer.
pub(crate) fn reduces_gradients(algorithm: Algorithm) -> Result<()> {
    if algorithm.reduces_gradients() {
        return Ok(());
    }
    let message = match algorithm {
        Algorithm::OneBitAdam => "onebit-adam is an optimizer of its own: step with \
                                  kolo_burn::OneBitAdam instead of a reducer and Adam"
            .to_string(),
        _ => format!(
            "{algorithm} exchanges weights, not gradients: step on this rank's own \
             gradients and call kolo_burn::decentralized_average after the step"
        ),
    };
    Err(Error::InvalidArgument {
        what: "GradientReducer::algorithm",
        message,
    })
}

/// Decentralized SGD's exchange (Bagua's, [`Algorithm::Decentralized`]): averages
/// `model`'s float parameters with this step's peer — `(mine + peer's) / 2`, the peer
/// at distance 2^(step mod ⌈log2 N⌉) — point to point, no collective. Call it after
/// each optimizer step that used this rank's own gradients (no reducer), with a step
/// counter every rank counts alike. The ranks' weights differ between steps; their
/// mean is kept.
///
/// # Errors
/// [`Error::Kolo`] when the exchange fails (a peer whose model has another number of
/// parameters is named).
pub fn decentralized_average<M: Module>(kolo: &Kolo, model: M, step: u64) -> Result<M> {
    let mut flat = Flatten(Vec::new(), None);
    model.visit(&mut flat);
    if let Some(message) = flat.1 {
        // Every rank's model is alike: every rank fails here, before any exchange.
        return Err(Error::InvalidArgument {
            what: "decentralized_average",
            message,
        });
    }
    let n = flat.0.len();
    let mixed = kolo
        .decentralized_average(
            "kolo_burn.decentralized",
            step,
            kolo::Tensor::from_vec(flat.0, &[n])?,
        )?
        .into_vec::<f32>()?;
    Ok(model.map(&mut Unflatten {
        values: &mixed,
        at: 0,
    }))
}

/// Every float parameter's values, as f32, in module order; the first that cannot
/// be read.
struct Flatten(Vec<f32>, Option<String>);

impl ModuleVisitor for Flatten {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val().inner().cast(FloatDType::F32);
        match t.into_data().try_to_vec::<f32>() {
            Ok(v) => self.0.extend(v),
            Err(e) => {
                self.1
                    .get_or_insert(format!("parameter {}: {e:?}", param.id));
            }
        }
    }
}

/// Puts values back into the float parameters, in module order, in each one's dtype
/// and device, keeping ids and whether each trains.
struct Unflatten<'a> {
    values: &'a [f32],
    at: usize,
}

impl ModuleMapper for Unflatten<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let trainable = trains(&param);
        let (id, t, mapper) = param.consume();
        let dims = t.dims();
        let n = t.shape().num_elements();
        let Some(values) = self.values.get(self.at..self.at + n) else {
            return Param::from_mapped_value(id, t, mapper);
        };
        self.at += n;
        let device = t.device();
        let dtype = t.dtype();
        let data = TensorData::new(values.to_vec(), dims.to_vec());
        let fresh = Tensor::<D>::from_data(data, (&device, dtype));
        let fresh = if device.is_autodiff() {
            fresh.set_require_grad(trainable)
        } else {
            fresh
        };
        Param::from_mapped_value(id, fresh, mapper)
    }
}
