//! DeepSpeed's 1-bit Adam for Burn models: kolo's flat-vector optimizer
//! ([`kolo::algorithms::OneBitAdam`]) over every float parameter of a module.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{FloatDType, Tensor, TensorData};
use kolo::algorithms::{OneBitAdamConfig, OneBitState};
use kolo::Kolo;

use crate::error::{Error, Result};
use crate::layout::trains;

/// 1-bit Adam (issue 57, [`kolo::Algorithm::OneBitAdam`]): the optimizer *and* the
/// synchronisation — no [`GradientReducer`](crate::GradientReducer). For its first
/// `warmup` steps it is Adam on the ranks' averaged gradients (Burn's Adam formula);
/// then the variance is frozen and the ranks average their momenta through 1-bit
/// compression with error feedback (1/29 of f32's bytes). Its state (moments,
/// residuals, step) is [`state`](Self::state): checkpoint it beside the model, and
/// [`set_state`](Self::set_state) on resume.
///
/// ```no_run
/// # fn f(kolo: &kolo::Kolo, model: impl burn::module::Module, grads: burn::optim::GradientsParams) -> kolo_burn::Result<()> {
/// let mut optim = kolo_burn::OneBitAdam::new(kolo, kolo::algorithms::OneBitAdamConfig {
///     warmup: 20,
///     ..Default::default()
/// });
/// let model = optim.step(1e-3, model, grads)?; // grads: this rank's own
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct OneBitAdam {
    kolo: Kolo,
    inner: kolo::algorithms::OneBitAdam,
}

impl OneBitAdam {
    /// A fresh optimizer.
    pub fn new(kolo: &Kolo, config: OneBitAdamConfig) -> Self {
        OneBitAdam {
            kolo: kolo.clone(),
            inner: kolo::algorithms::OneBitAdam::new(config),
        }
    }

    /// Bagua's QAdam ([`kolo::Algorithm::QAdam`]): the same schedule, the momenta
    /// averaged 8-bit (ByteGrad's exchange, with error feedback).
    pub fn qadam(kolo: &Kolo, config: OneBitAdamConfig) -> Self {
        OneBitAdam {
            kolo: kolo.clone(),
            inner: kolo::algorithms::OneBitAdam::qadam(config),
        }
    }

    /// The state to checkpoint.
    pub fn state(&self) -> &OneBitState {
        self.inner.state()
    }

    /// Restores a checkpointed state.
    pub fn set_state(&mut self, state: OneBitState) {
        self.inner.set_state(state);
    }

    /// One step of `model` with this rank's gradients `grads` (not reduced):
    /// collective, every rank calls it. Parameters without a gradient count as zero
    /// gradients; frozen parameters are not changed.
    ///
    /// # Errors
    /// A gradient or parameter that cannot be read as f32 ([`Error::InvalidArgument`],
    /// on every rank alike); a model that changed since the state was made
    /// ([`Error::Kolo`]); a failed collective.
    pub fn step<M: Module>(&mut self, lr: f64, model: M, grads: GradientsParams) -> Result<M> {
        let mut read = ReadGrads {
            grads: &grads,
            values: Vec::new(),
            error: None,
        };
        model.visit(&mut read);
        if let Some(message) = read.error {
            return Err(Error::InvalidArgument {
                what: "OneBitAdam::step",
                message,
            });
        }
        let name = if self.inner.is_qadam() {
            "kolo_burn.qadam"
        } else {
            "kolo_burn.onebit"
        };
        let update = self.inner.step(&self.kolo, name, lr as f32, read.values)?;
        Ok(model.map(&mut Subtract {
            update: &update,
            at: 0,
        }))
    }
}

/// Every float parameter's gradient in `grads` (zeros where none), as f32, in module
/// order.
struct ReadGrads<'a> {
    grads: &'a GradientsParams,
    values: Vec<f32>,
    error: Option<String>,
}

impl ModuleVisitor for ReadGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let n = param.lazy_shape().num_elements();
        let Some(g) = self.grads.get::<D>(param.id) else {
            self.values.resize(self.values.len() + n, 0.0);
            return;
        };
        match g.cast(FloatDType::F32).into_data().try_to_vec::<f32>() {
            Ok(v) => self.values.extend(v),
            Err(e) => {
                self.error
                    .get_or_insert(format!("the gradient of parameter {}: {e:?}", param.id));
                self.values.resize(self.values.len() + n, 0.0);
            }
        }
    }
}

/// Subtracts the update from each trainable float parameter, in module order.
struct Subtract<'a> {
    update: &'a [f32],
    at: usize,
}

impl ModuleMapper for Subtract<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let trainable = trains(&param);
        let (id, t, mapper) = param.consume();
        let n = t.shape().num_elements();
        let range = self.at..self.at + n;
        self.at += n;
        let Some(values) = self.update.get(range).filter(|_| trainable) else {
            return Param::from_mapped_value(id, t, mapper);
        };
        let device = t.device();
        let inner = t.inner();
        let delta = Tensor::<D>::from_data(
            TensorData::new(values.to_vec(), inner.dims().to_vec()),
            (&inner.device(), inner.dtype()),
        );
        let fresh = inner - delta;
        let fresh = if device.is_autodiff() {
            fresh.autodiff().set_require_grad(true)
        } else {
            fresh
        };
        Param::from_mapped_value(id, fresh, mapper)
    }
}
