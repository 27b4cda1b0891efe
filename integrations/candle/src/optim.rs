//! Horovod's `DistributedOptimizer` for candle.

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::{Optimizer, VarMap};
use kolo::algorithms::{AsyncPeriod, AveragerState, WeightAverager};
use kolo::{Algorithm, Kolo, ReduceOp};

use crate::convert::{check_dtype, from_kolo, to_kolo};
use crate::error::{Error, Result};
use crate::vars::{agreed, named_vars};

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
/// Variables are matched across ranks **by name** when their names are known: built
/// with [`from_varmap`](Self::from_varmap), or after
/// [`broadcast_parameters`](crate::broadcast_parameters) has seen their `VarMap`
/// (the usual start of a loop). Otherwise (a `Var` carries no name) by the order
/// candle created them (`VarMap` lists them in a different order in every process):
/// then build the model with the same code on every rank. [`new`](Self::new) checks
/// that every rank passed the same variables — names where known, shapes and dtypes
/// — and fails on every rank naming the first difference.
///
/// Each gradient goes to kolo as its own tensor, all submitted before any is waited
/// for, so kolo's engine fuses the small ones into one reduction. A variable without a
/// gradient on this rank (not used by this loss) contributes zeros, so that the ranks
/// stay in step; one that no rank has a gradient for gets none, so the wrapped
/// optimizer leaves it alone as in one process (AdamW's decay does not move an unused
/// head). The wrapped optimizer sees the reduced gradients of these variables only.
#[derive(Debug)]
pub struct DistributedOptimizer<O> {
    kolo: Kolo,
    inner: O,
    vars: Vec<Var>,
    /// Each variable's name where known (empty where not).
    names: Vec<String>,
    op: ReduceOp,
    passes: usize,
    /// Gradients summed over the passes of this step so far, by variable.
    accumulated: Vec<Option<Tensor>>,
    pass: usize,
    /// How the ranks synchronise (issue 57).
    algorithm: Algorithm,
    /// ByteGrad compresses only across hosts.
    hierarchical: bool,
    /// The weight exchange of decentralized, decentralized-8bit and async.
    averager: Option<WeightAverager>,
    /// Async averaging's period (kept for an averager made later).
    period: AsyncPeriod,
}

impl<O: Optimizer> DistributedOptimizer<O> {
    /// Wraps `inner`, reducing the gradients of `vars` (usually `varmap.all_vars()`,
    /// the variables `inner` was built with). Every rank must call it, with the same
    /// variables.
    ///
    /// # Errors
    /// The ranks' variables differ (count, shape, dtype, or name where known:
    /// [`Error::Mismatch`] on every rank, naming the first difference and the ranks); a
    /// dtype kolo does not carry; a rank left.
    pub fn new(kolo: &Kolo, inner: O, vars: Vec<Var>) -> Result<Self> {
        let (vars, names) = agreed(kolo, WHAT, "kolo_candle.optimizer.vars", vars)?;
        let built = DistributedOptimizer {
            kolo: kolo.clone(),
            inner,
            accumulated: vec![None; vars.len()],
            vars,
            names,
            op: ReduceOp::Average,
            passes: 1,
            pass: 0,
            algorithm: Algorithm::Allreduce,
            hierarchical: true,
            averager: None,
            period: AsyncPeriod::default(),
        };
        for (i, v) in built.vars.iter().enumerate() {
            check_dtype(WHAT, &built.label(i), v.dtype())?;
        }
        Ok(built)
    }

    /// Wraps `inner`, reducing the gradients of every variable of `varmap`, matched
    /// across ranks by name (so the order the model created them in may differ
    /// between ranks). Every rank must call it, with the same names.
    ///
    /// # Errors
    /// As [`new`](Self::new); the ranks' names differ ([`Error::Mismatch`], naming the
    /// first differing variable and what each rank holds).
    pub fn from_varmap(kolo: &Kolo, inner: O, varmap: &VarMap) -> Result<Self> {
        let vars = named_vars(WHAT, varmap)?
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        Self::new(kolo, inner, vars)
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

    /// How the ranks synchronise (issue 57): [`Algorithm::Allreduce`] (the default),
    /// [`Algorithm::ByteGrad`] (8-bit gradients; by default only across hosts, see
    /// [`hierarchical`](Self::hierarchical)), [`Algorithm::Adasum`], or one of the
    /// weight exchanges — [`Algorithm::Decentralized`],
    /// [`Algorithm::Decentralized8Bit`], [`Algorithm::Async`] — where each rank steps
    /// on its own gradients and then exchanges its variables
    /// ([`kolo::algorithms::WeightAverager`]; call [`finish`](Self::finish) before
    /// evaluating or saving). ByteGrad and Adasum reduce all gradients (f32) as one
    /// buffer. Collective: every rank calls it.
    ///
    /// # Errors
    /// The ranks chose different algorithms (on every rank, naming each rank's);
    /// [`Algorithm::OneBitAdam`] and [`Algorithm::QAdam`], optimizers of their own
    /// ([`OneBitAdam`](crate::OneBitAdam)).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Result<Self> {
        algorithm.agree(&self.kolo, "kolo_candle.algorithm")?;
        if algorithm.is_optimizer() {
            return Err(Error::InvalidArgument {
                what: "DistributedOptimizer::algorithm",
                message: format!(
                    "{algorithm} is an optimizer of its own: use kolo_candle::OneBitAdam \
                     (OneBitAdam::qadam for qadam) in place of this optimizer"
                ),
            });
        }
        self.averager = if algorithm.exchanges_weights() {
            Some(WeightAverager::new(algorithm)?.period(self.period))
        } else {
            None
        };
        self.algorithm = algorithm;
        Ok(self)
    }

    /// How often [`Algorithm::Async`] averages (default every 4 steps).
    pub fn async_period(mut self, period: AsyncPeriod) -> Self {
        self.period = period;
        self.averager = self.averager.take().map(|a| a.period(period));
        self
    }

    /// Completes the weight exchange for now (async averaging: every round any rank
    /// started, applied; a collective). Call it before evaluating, saving or stopping;
    /// nothing to do for the other algorithms.
    ///
    /// # Errors
    /// A variable that cannot be read or written as f32; a failed exchange.
    pub fn finish(&mut self) -> Result<()> {
        match &mut self.averager {
            Some(a) => crate::algorithm::average_weights(&self.kolo, a, &self.vars, true),
            None => Ok(()),
        }
    }

    /// The weight exchange's state, this rank's own, to checkpoint after
    /// [`finish`](Self::finish) (none for the gradient algorithms).
    pub fn averager_state(&self) -> Option<&AveragerState> {
        self.averager.as_ref().map(WeightAverager::state)
    }

    /// Restores a checkpointed weight-exchange state (ignored by the gradient
    /// algorithms).
    pub fn set_averager_state(&mut self, state: AveragerState) {
        if let Some(a) = &mut self.averager {
            a.set_state(state);
        }
    }

    /// Whether ByteGrad compresses only what crosses hosts (`true`, the default, as
    /// Bagua's `hierarchical=True`: one host reduces in full precision); `false`
    /// compresses on one host too.
    pub fn hierarchical(mut self, on: bool) -> Self {
        self.hierarchical = on;
        self
    }

    /// The algorithm the gradients go through in this job: hierarchical ByteGrad on
    /// one host is allreduce.
    fn effective_algorithm(&self) -> Algorithm {
        match self.algorithm {
            Algorithm::ByteGrad if self.hierarchical && self.kolo.cross_size() == 1 => {
                Algorithm::Allreduce
            }
            a => a,
        }
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
        if let Some(averager) = &mut self.averager {
            // This rank's own gradients (the mean over the passes), then its
            // variables exchanged.
            let mut own = GradStore::default();
            for (v, g) in self.vars.iter().zip(local) {
                if let Some(g) = g {
                    own.insert(v.as_tensor(), (g / self.passes as f64)?);
                }
            }
            self.inner.step(&own)?;
            return crate::algorithm::average_weights(&self.kolo, averager, &self.vars, false);
        }
        let reduced = self.reduce_local(local, self.passes)?;
        Ok(self.inner.step(&reduced)?)
    }

    /// Reduces `local` (a gradient or none per variable) divided by `passes`.
    ///
    /// A step fails on every rank or on none: a rank that cannot hand a gradient over
    /// (a wrong shape, a dtype kolo does not carry) still submits every variable, with
    /// zeros in its place, and one small allreduce beside the gradients (`[failed,
    /// lacks]`, summed) tells every rank whether any rank failed, so nobody waits for
    /// names that were never submitted and nobody steps alone. The same allreduce
    /// counts the ranks that lack some gradient; only when one does, a second one says
    /// which variables nobody has, and those get no gradient (candle's optimizers then
    /// skip them, as in one process).
    fn reduce_local(&self, local: Vec<Option<Tensor>>, passes: usize) -> Result<GradStore> {
        let mut present = Vec::with_capacity(self.vars.len());
        let mut failed: Option<Error> = None;
        let mut grads = Vec::with_capacity(self.vars.len());
        for (i, (v, g)) in self.vars.iter().zip(local).enumerate() {
            present.push(g.is_some());
            grads.push(self.gradient(i, v, g).unwrap_or_else(|e| {
                failed.get_or_insert(e);
                // `new` refused a dtype kolo does not carry: F32 is never used.
                let d = crate::convert::kolo_dtype(v.dtype()).unwrap_or(kolo::DType::F32);
                kolo::Tensor::zeros(d, v.dims())
            }));
        }
        let handles = self.submit(grads, passes)?;
        let lacks = present.iter().any(|&p| !p);
        let flag = kolo::Tensor::from_vec(
            vec![
                f32::from(u8::from(failed.is_some())),
                f32::from(u8::from(lacks)),
            ],
            &[2],
        )?;
        // A Sum of a small cached f32 tensor rides in the engine's cycle agreement.
        let verdict = self
            .kolo
            .allreduce("kolo_candle.grad.verdict", flag)
            .op(ReduceOp::Sum)
            .submit();
        // Every submitted reduction is waited for, even after an error, so that no
        // name stays pending into the next step.
        let mut out: Vec<Option<(&Var, Tensor)>> = Vec::with_capacity(handles.len());
        let mut collective: Option<Error> = None;
        for (v, h) in handles {
            let reduced = h.wait().and_then(|t| from_kolo(t, v.device()));
            match reduced {
                Ok(g) => out.push(Some((v, g))),
                Err(e) => {
                    collective.get_or_insert(e);
                    out.push(None);
                }
            }
        }
        let counts = verdict
            .map_err(kolo::Error::from)
            .and_then(|h| h.wait())
            .and_then(|t| Ok(t.into_vec::<f32>()?));
        let counts = match counts {
            Ok(c) => c,
            Err(e) => return Err(failed.or(collective).unwrap_or(Error::Kolo(e))),
        };
        if counts.first().is_some_and(|&f| f > 0.0) {
            let mine = failed.as_ref().map(ToString::to_string);
            let all: Vec<Option<String>> = self
                .kolo
                .allgather_object("kolo_candle.grad.failures", mine)?;
            return Err(failed.unwrap_or_else(|| other_rank(all)));
        }
        if let Some(e) = collective {
            return Err(e);
        }
        if counts.get(1).is_some_and(|&f| f > 0.0) {
            self.drop_absent(&mut out, &present)?;
        }
        let mut store = GradStore::default();
        for (v, g) in out.into_iter().flatten() {
            store.insert(v.as_tensor(), g);
        }
        Ok(store)
    }

    /// Each variable's reduction of `grads` (divided by `passes`): submitted to kolo
    /// one by one, or done at once by the algorithm.
    fn submit(&self, grads: Vec<kolo::Tensor>, passes: usize) -> Result<Vec<(&Var, Reducing)>> {
        let algorithm = self.effective_algorithm();
        Ok(
            if algorithm != Algorithm::Allreduce && self.kolo.size() > 1 {
                let done =
                    crate::algorithm::reduce_flat(&self.kolo, algorithm, self.op, passes, grads)?;
                match done {
                    Ok(ts) => self
                        .vars
                        .iter()
                        .zip(ts)
                        .map(|(v, t)| (v, Reducing::Done(Ok(t))))
                        .collect(),
                    Err(e) => {
                        let mut e = Some(e);
                        self.vars
                            .iter()
                            .map(|v| {
                                (
                                    v,
                                    Reducing::Done(Err(e.take().unwrap_or_else(|| {
                                        kolo::Error::Internal(format!(
                                            "{algorithm} failed (see the first variable)"
                                        ))
                                    }))),
                                )
                            })
                            .collect()
                    }
                }
            } else {
                self.vars
                    .iter()
                    .zip(grads)
                    .enumerate()
                    .map(|(i, (v, t))| {
                        let mut b = self
                            .kolo
                            .allreduce(format!("kolo_candle.grad.{i}"), t)
                            .op(self.op);
                        if passes > 1 {
                            b = b.prescale(1.0 / passes as f64);
                        }
                        (v, Reducing::Pending(b.submit()))
                    })
                    .collect()
            },
        )
    }

    /// Drops the gradients no rank had (`present`: which this rank had): the ranks sum
    /// how many had each.
    fn drop_absent<T>(&self, out: &mut [Option<T>], present: &[bool]) -> Result<()> {
        let mine: Vec<f32> = present.iter().map(|&p| f32::from(u8::from(p))).collect();
        let n = mine.len();
        let have = self
            .kolo
            .allreduce(
                "kolo_candle.grad.present",
                kolo::Tensor::from_vec(mine, &[n])?,
            )
            .op(ReduceOp::Sum)
            .wait()?
            .into_vec::<f32>()?;
        for (slot, &count) in out.iter_mut().zip(&have) {
            if count == 0.0 {
                *slot = None;
            }
        }
        Ok(())
    }

    /// Variable `i`'s gradient (zeros where this rank has none) as a kolo tensor.
    fn gradient(&self, i: usize, v: &Var, g: Option<Tensor>) -> Result<kolo::Tensor> {
        let label = self.label(i);
        let g = match g {
            Some(g) => g,
            None => v.as_tensor().zeros_like()?,
        };
        if g.dims() != v.dims() {
            return Err(Error::InvalidArgument {
                what: WHAT,
                message: format!(
                    "the gradient of variable {label} has shape {:?}, the variable {:?}",
                    g.dims(),
                    v.dims()
                ),
            });
        }
        to_kolo(WHAT, &label, &g)
    }

    /// How errors name variable `i`: its name where known, else its place in creation
    /// order.
    fn label(&self, i: usize) -> String {
        match self.names.get(i).filter(|n| !n.is_empty()) {
            Some(n) => format!("\"{n}\""),
            None => format!("#{i} in creation order"),
        }
    }
}

/// The error of a rank whose own step went well while another's failed: the first
/// failing rank and its message.
fn other_rank(all: Vec<Option<String>>) -> Error {
    let (rank, message) = all
        .into_iter()
        .enumerate()
        .find_map(|(rank, m)| Some((rank, m?)))
        .unwrap_or((0, "(no message)".into()));
    Error::OtherRank { rank, message }
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

/// A variable's reduction: submitted to kolo, or done by an algorithm.
enum Reducing {
    Pending(std::result::Result<kolo::Handle<kolo::Tensor>, kolo::SubmitError>),
    Done(kolo::Result<kolo::Tensor>),
}

impl Reducing {
    fn wait(self) -> Result<kolo::Tensor> {
        match self {
            Reducing::Pending(h) => h
                .map_err(|e| Error::Kolo(e.into()))
                .and_then(|h| h.wait().map_err(Error::from)),
            Reducing::Done(r) => r.map_err(Error::from),
        }
    }
}
