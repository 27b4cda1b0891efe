//! Horovod's `DistributedOptimizer` for candle.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::Optimizer;
use kolo::{Kolo, ReduceOp};

use crate::convert::{check_dtype, from_kolo, to_kolo};
use crate::error::{Error, Result};
use crate::vars::{agree, describe, in_creation_order};

const WHAT: &str = "kolo_candle::DistributedOptimizer";

/// Wraps a candle optimizer: each [`step`](Optimizer::step) (or `backward_step`)
/// averages the gradients of its variables across ranks, then steps the wrapped
/// optimizer with them. It is itself a `candle_nn::Optimizer`, so a training loop
/// changes only where the optimizer is built:
///
/// ```no_run
/// # use candle_nn::{Optimizer, VarMap, SGD};
/// # fn f(kolo: &kolo::Kolo, varmap: &VarMap, loss: &candle_core::Tensor) -> anyhow::Result<()> {
/// let mut opt = kolo_candle::DistributedOptimizer::new(
///     kolo,
///     SGD::new(varmap.all_vars(), 0.05)?,
///     varmap.all_vars(),
/// )?;
/// opt.backward_step(loss)?;
/// # Ok(()) }
/// ```
///
/// Variables are matched across ranks by the order candle created them (`VarMap`
/// lists them in a different order in every process): build the model with the same
/// code on every rank. [`new`](Self::new) checks that every rank passed the same
/// number of variables with the same shapes and dtypes.
///
/// Each gradient goes to kolo as its own tensor, all submitted before any is waited
/// for, so kolo's engine fuses the small ones into one reduction. A variable without a
/// gradient on this rank (not used by this loss) contributes zeros, so that the ranks
/// stay in step. The wrapped optimizer sees the reduced gradients of these variables
/// only.
#[derive(Debug)]
pub struct DistributedOptimizer<O> {
    kolo: Kolo,
    inner: O,
    vars: Vec<Var>,
    op: ReduceOp,
    passes: usize,
    /// Gradients summed over the passes of this step so far, by variable.
    accumulated: Vec<Option<Tensor>>,
    pass: usize,
}

impl<O: Optimizer> DistributedOptimizer<O> {
    /// Wraps `inner`, reducing the gradients of `vars` (usually `varmap.all_vars()`,
    /// the variables `inner` was built with). Every rank must call it, with the same
    /// variables.
    ///
    /// # Errors
    /// The ranks' variables differ (count, shape or dtype: [`Error::Mismatch`] on every
    /// rank, naming the first difference and the ranks); a dtype kolo does not carry;
    /// a rank left.
    pub fn new(kolo: &Kolo, inner: O, vars: Vec<Var>) -> Result<Self> {
        let vars = in_creation_order(WHAT, vars)?;
        let described = vars.iter().map(|v| describe("", v.as_tensor())).collect();
        agree(kolo, WHAT, "kolo_candle.optimizer.vars", described)?;
        for (i, v) in vars.iter().enumerate() {
            check_dtype(WHAT, &format!("#{i} in creation order"), v.dtype())?;
        }
        Ok(DistributedOptimizer {
            kolo: kolo.clone(),
            inner,
            accumulated: vec![None; vars.len()],
            vars,
            op: ReduceOp::Average,
            passes: 1,
            pass: 0,
        })
    }

    /// How gradients combine across ranks: [`ReduceOp::Average`] (the default) or
    /// [`ReduceOp::Sum`].
    ///
    /// # Errors
    /// Any other op (a minimum of gradients is not a gradient).
    pub fn op(mut self, op: ReduceOp) -> Result<Self> {
        if !matches!(op, ReduceOp::Average | ReduceOp::Sum) {
            return Err(Error::InvalidArgument {
                what: "DistributedOptimizer::op",
                message: format!("{op:?} is not a way to combine gradients: use Average or Sum"),
            });
        }
        self.op = op;
        Ok(self)
    }

    /// Gradient accumulation: `passes` calls of `step` make one reduction and one step
    /// of the wrapped optimizer; the calls before the last only add their gradients
    /// up locally. The gradient stepped with is the mean over the passes (so `n`
    /// passes over batches of `b` with a mean loss equal one pass over `n·b`).
    ///
    /// # Errors
    /// `passes` is 0.
    pub fn backward_passes_per_step(mut self, passes: usize) -> Result<Self> {
        if passes == 0 {
            return Err(Error::InvalidArgument {
                what: "DistributedOptimizer::backward_passes_per_step",
                message: "passes must be at least 1".into(),
            });
        }
        self.passes = passes;
        Ok(self)
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, mutably.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// The wrapped optimizer, unwrapped.
    pub fn into_inner(self) -> O {
        self.inner
    }

    /// The variables whose gradients are reduced, in the order every rank uses.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// The gradients of this optimizer's variables in `grads`, combined across ranks
    /// (averaged by default), without stepping: for a loop that clips or inspects
    /// gradients before its own step. Every rank must call it.
    ///
    /// # Errors
    /// A rank left or failed; a gradient kolo cannot carry.
    pub fn reduce(&self, grads: &GradStore) -> Result<GradStore> {
        let local: Vec<Option<Tensor>> = self
            .vars
            .iter()
            .map(|v| grads.get(v.as_tensor()).cloned())
            .collect();
        self.reduce_local(local, 1)
    }

    /// Adds `grads` to this step's passes; after the last, reduces and steps.
    fn step_grads(&mut self, grads: &GradStore) -> Result<()> {
        for (acc, v) in self.accumulated.iter_mut().zip(&self.vars) {
            if let Some(g) = grads.get(v.as_tensor()) {
                *acc = Some(match acc.take() {
                    Some(a) => a.add(g)?.detach(),
                    None => g.detach(),
                });
            }
        }
        self.pass += 1;
        if self.pass < self.passes {
            return Ok(());
        }
        self.pass = 0;
        let local = std::mem::replace(&mut self.accumulated, vec![None; self.vars.len()]);
        let reduced = self.reduce_local(local, self.passes)?;
        Ok(self.inner.step(&reduced)?)
    }

    /// Reduces `local` (a gradient or none per variable) divided by `passes`.
    fn reduce_local(&self, local: Vec<Option<Tensor>>, passes: usize) -> Result<GradStore> {
        let mut handles = Vec::with_capacity(self.vars.len());
        let mut first_error: Option<Error> = None;
        for (i, (v, g)) in self.vars.iter().zip(local).enumerate() {
            let label = format!("#{i} in creation order");
            let g = match g {
                Some(g) => g,
                None => v.as_tensor().zeros_like()?,
            };
            if g.dims() != v.dims() {
                first_error.get_or_insert(Error::InvalidArgument {
                    what: WHAT,
                    message: format!(
                        "the gradient of variable {label} has shape {:?}, the variable {:?}",
                        g.dims(),
                        v.dims()
                    ),
                });
                break;
            }
            let t = match to_kolo(WHAT, &label, &g) {
                Ok(t) => t,
                Err(e) => {
                    first_error.get_or_insert(e);
                    break;
                }
            };
            let mut b = self
                .kolo
                .allreduce(format!("kolo_candle.grad.{i}"), t)
                .op(self.op);
            if passes > 1 {
                b = b.prescale(1.0 / passes as f64);
            }
            match b.submit() {
                Ok(h) => handles.push((v, h)),
                Err(e) => {
                    first_error.get_or_insert(Error::Kolo(e.into()));
                    break;
                }
            }
        }
        // Every submitted reduction is waited for, even after an error, so that no
        // name stays pending into the next step.
        let mut out = GradStore::default();
        for (v, h) in handles {
            match h
                .wait()
                .map_err(Error::from)
                .and_then(|t| from_kolo(t, v.device()))
            {
                Ok(g) => {
                    out.insert(v.as_tensor(), g);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(out), Err)
    }
}

impl<O: Optimizer> Optimizer for DistributedOptimizer<O> {
    /// The kolo handle and the wrapped optimizer's configuration.
    type Config = (Kolo, O::Config);

    /// Builds the wrapped optimizer on `vars` and wraps it (see
    /// [`DistributedOptimizer::new`]).
    fn new(vars: Vec<Var>, (kolo, config): Self::Config) -> candle_core::Result<Self> {
        let inner = O::new(vars.clone(), config)?;
        Ok(DistributedOptimizer::new(&kolo, inner, vars)?)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        Ok(self.step_grads(grads)?)
    }

    fn learning_rate(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr);
    }
}
