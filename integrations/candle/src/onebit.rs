//! DeepSpeed's 1-bit Adam and Bagua's QAdam for candle variables: kolo's flat-vector
//! optimizer ([`kolo::algorithms::OneBitAdam`]) over the values of a list of
//! variables, shared with kolo-burn.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use kolo::algorithms::{OneBitAdamConfig, OneBitState};
use kolo::Kolo;

use crate::error::Result;
use crate::vars::agreed;

const WHAT: &str = "kolo_candle::OneBitAdam";

/// 1-bit Adam ([`kolo::Algorithm::OneBitAdam`]) or QAdam ([`kolo::Algorithm::QAdam`])
/// over `vars`: the optimizer *and* the synchronisation, in place of a
/// [`DistributedOptimizer`](crate::DistributedOptimizer) around Adam. For `warmup`
/// steps it is Adam on the ranks' averaged gradients; then the variance is frozen and
/// the ranks average their momenta compressed (1 bit with error feedback, or 8 bits
/// for QAdam). Its state is [`state`](Self::state): checkpoint it (each rank its own:
/// the error-feedback residuals differ) and [`set_state`](Self::set_state) on resume.
///
/// ```no_run
/// # fn f(kolo: &kolo::Kolo, varmap: &candle_nn::VarMap, loss: &candle_core::Tensor) -> kolo_candle::Result<()> {
/// let mut optim = kolo_candle::OneBitAdam::new(kolo, varmap.all_vars(), Default::default())?;
/// optim.backward_step(1e-3, loss)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct OneBitAdam {
    kolo: Kolo,
    vars: Vec<Var>,
    inner: kolo::algorithms::OneBitAdam,
}

impl OneBitAdam {
    /// 1-bit Adam over `vars`. Every rank calls it with the same variables.
    ///
    /// # Errors
    /// The ranks' variables differ (on every rank, naming the first difference).
    pub fn new(kolo: &Kolo, vars: Vec<Var>, config: OneBitAdamConfig) -> Result<Self> {
        Self::build(kolo, vars, kolo::algorithms::OneBitAdam::new(config))
    }

    /// QAdam over `vars` (8-bit momenta).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn qadam(kolo: &Kolo, vars: Vec<Var>, config: OneBitAdamConfig) -> Result<Self> {
        Self::build(kolo, vars, kolo::algorithms::OneBitAdam::qadam(config))
    }

    fn build(kolo: &Kolo, vars: Vec<Var>, inner: kolo::algorithms::OneBitAdam) -> Result<Self> {
        let (vars, _) = agreed(kolo, WHAT, "kolo_candle.onebit.vars", vars)?;
        Ok(OneBitAdam {
            kolo: kolo.clone(),
            vars,
            inner,
        })
    }

    /// The state to checkpoint (this rank's).
    pub fn state(&self) -> &OneBitState {
        self.inner.state()
    }

    /// Restores a checkpointed state.
    pub fn set_state(&mut self, state: OneBitState) {
        self.inner.set_state(state);
    }

    /// One step with learning rate `lr` from this rank's gradients `grads` (not
    /// reduced; a variable without one counts as zeros). Collective: every rank calls
    /// it.
    ///
    /// # Errors
    /// A variable that cannot be read or written as f32; a model that changed since
    /// the state was made; a failed collective.
    pub fn step(&mut self, lr: f64, grads: &GradStore) -> Result<()> {
        let mut flat = Vec::new();
        for v in &self.vars {
            let t = v.as_tensor();
            match grads.get(t) {
                Some(g) => flat.extend(g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
                None => flat.resize(flat.len() + t.elem_count(), 0.0),
            }
        }
        let name = if self.inner.is_qadam() {
            "kolo_candle.qadam"
        } else {
            "kolo_candle.onebit"
        };
        let update = self.inner.step(&self.kolo, name, lr as f32, flat)?;
        let mut at = 0;
        for v in &self.vars {
            let t = v.as_tensor();
            let len = t.elem_count();
            let delta = Tensor::from_slice(&update[at..at + len], t.dims(), t.device())?
                .to_dtype(t.dtype())?;
            at += len;
            v.set(&(t - delta)?)?;
        }
        Ok(())
    }

    /// `loss.backward()` and [`step`](Self::step).
    ///
    /// # Errors
    /// As [`step`](Self::step); a failed backward pass.
    pub fn backward_step(&mut self, lr: f64, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        self.step(lr, &grads)
    }
}
