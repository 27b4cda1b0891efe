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
        Algorithm::OneBitAdam | Algorithm::QAdam => format!(
            "{algorithm} is an optimizer of its own: step with kolo_burn::OneBitAdam \
             (OneBitAdam::qadam for qadam) instead of a reducer and Adam"
        ),
        _ => format!(
            "{algorithm} exchanges weights, not gradients: step on this rank's own \
             gradients and call kolo_burn::WeightAverager::after_step after the step"
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
    let flat = flatten(&model, "decentralized_average")?;
    let n = flat.len();
    let mixed = kolo
        .decentralized_average(
            "kolo_burn.decentralized",
            step,
            kolo::Tensor::from_vec(flat, &[n])?,
        )?
        .into_vec::<f32>()?;
    Ok(model.map(&mut Unflatten {
        values: &mixed,
        at: 0,
    }))
}

/// The weight-exchanging algorithms of issue 57 for a Burn model: decentralized SGD in
/// full or low precision ([`Algorithm::Decentralized`], [`Algorithm::Decentralized8Bit`])
/// and asynchronous model averaging ([`Algorithm::Async`]); kolo's
/// [`kolo::algorithms::WeightAverager`] over the model's float parameters. Step with
/// this rank's own gradients (no reducer), then call [`after_step`](Self::after_step);
/// call [`finish`](Self::finish) before evaluating, saving or stopping. The state
/// ([`state`](Self::state), per rank: each rank's copies differ) goes into a
/// checkpoint after `finish`.
///
/// ```no_run
/// # fn f<M: burn::module::Module>(kolo: &kolo::Kolo, model: M) -> kolo_burn::Result<M> {
/// let mut avg = kolo_burn::WeightAverager::new(kolo, kolo_burn::Algorithm::Decentralized8Bit)?;
/// let model = avg.after_step(model)?; // after each optimizer step on local gradients
/// let model = avg.finish(model)?; // before evaluating or saving
/// # Ok(model) }
/// ```
#[derive(Debug)]
pub struct WeightAverager {
    kolo: Kolo,
    inner: kolo::algorithms::WeightAverager,
}

impl WeightAverager {
    /// An averager for `algorithm`.
    ///
    /// # Errors
    /// [`Error::Kolo`] for an algorithm that does not exchange weights.
    pub fn new(kolo: &Kolo, algorithm: Algorithm) -> Result<Self> {
        Ok(WeightAverager {
            kolo: kolo.clone(),
            inner: kolo::algorithms::WeightAverager::new(algorithm)?,
        })
    }

    /// How often async averaging runs (default every 4 steps).
    pub fn period(mut self, period: kolo::algorithms::AsyncPeriod) -> Self {
        self.inner = self.inner.period(period);
        self
    }

    /// The state to checkpoint (after [`finish`](Self::finish)).
    pub fn state(&self) -> &kolo::algorithms::AveragerState {
        self.inner.state()
    }

    /// Restores a checkpointed state (this rank's own).
    pub fn set_state(&mut self, state: kolo::algorithms::AveragerState) {
        self.inner.set_state(state);
    }

    /// The exchange after one optimizer step (collective in the algorithm's way:
    /// every rank calls it after every step).
    ///
    /// # Errors
    /// A parameter that cannot be read as f32 ([`Error::InvalidArgument`], on every
    /// rank alike); a failed exchange, or a peer whose model differs ([`Error::Kolo`]).
    pub fn after_step<M: Module>(&mut self, model: M) -> Result<M> {
        self.exchange(model, false)
    }

    /// Completes the exchange for now (async: every round any rank started; a
    /// collective).
    ///
    /// # Errors
    /// As [`after_step`](Self::after_step).
    pub fn finish<M: Module>(&mut self, model: M) -> Result<M> {
        self.exchange(model, true)
    }

    fn exchange<M: Module>(&mut self, model: M, finish: bool) -> Result<M> {
        let mut values = flatten(&model, "WeightAverager")?;
        let name = "kolo_burn.averaging";
        let changed = if finish {
            self.inner.finish(&self.kolo, name, &mut values)?
        } else {
            self.inner.after_step(&self.kolo, name, &mut values)?
        };
        if !changed {
            return Ok(model);
        }
        Ok(model.map(&mut Unflatten {
            values: &values,
            at: 0,
        }))
    }
}

/// Every float parameter's values of `model`, as f32, in module order.
///
/// # Errors
/// [`Error::InvalidArgument`] (for `what`) naming the first parameter that cannot be
/// read: every rank's model is alike, so every rank fails here, before any exchange.
fn flatten<M: Module>(model: &M, what: &'static str) -> Result<Vec<f32>> {
    let mut flat = Flatten(Vec::new(), None);
    model.visit(&mut flat);
    match flat.1 {
        Some(message) => Err(Error::InvalidArgument { what, message }),
        None => Ok(flat.0),
    }
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
