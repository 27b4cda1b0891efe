//! The framework-agnostic distributed optimizer: Horovod's `DistributedOptimizer`
//! semantics on named gradient tensors.
//!
//! Gradients are submitted as they become ready (so reduction overlaps the rest of a
//! backward pass when a framework reports readiness); [`DistributedOptimizer::synchronize`]
//! waits for all of them; [`DistributedOptimizer::step`] synchronises and then runs the
//! wrapped optimizer on the reduced gradients.

use std::collections::{BTreeMap, HashMap};

use crate::compression::{compress, decompress, Compression};
use crate::error::{Error, Result};
use crate::handle::Handle;
use crate::runtime::Kolo;
use crate::submit_error::SubmitError;
use crate::tensor::{DType, Device, Tensor};
use crate::vocab::ReduceOp;

/// Reduced gradients by parameter name.
pub type Gradients = BTreeMap<String, Tensor>;

/// The local optimizer a [`DistributedOptimizer`] wraps: it updates the parameters it
/// owns from gradients that are already reduced across ranks.
pub trait GradientStep {
    /// Applies one update.
    ///
    /// # Errors
    /// Whatever the optimizer reports; it comes back as [`Error::Optimizer`].
    fn step(
        &mut self,
        gradients: &Gradients,
    ) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

#[derive(Debug, Clone)]
struct Param {
    shape: Vec<usize>,
    dtype: DType,
    group: Option<usize>,
    /// Where this parameter's gradients live, from its first gradient on this rank:
    /// a gradient missing from a window is replaced by zeros there.
    device: Option<Device>,
}

/// Builder for [`DistributedOptimizer`]: register every parameter (name, shape, dtype),
/// then set options.
#[derive(Debug)]
#[must_use = "call .build() to get the optimizer"]
pub struct DistributedOptimizerBuilder<O> {
    kolo: Kolo,
    inner: O,
    params: Vec<(String, Vec<usize>, DType)>,
    op: ReduceOp,
    passes: usize,
    predivide: f64,
    compression: Compression,
    groups: Vec<Vec<String>>,
    /// Why the process set given refuses this rank.
    refused: Option<String>,
}

impl<O: GradientStep> DistributedOptimizerBuilder<O> {
    /// Reduces gradients among the ranks of `set` only (Horovod's `process_set=`):
    /// Average divides by the set's size. On a rank outside the set, `build` fails
    /// naming the rank and the set.
    pub fn process_set(mut self, set: &crate::ProcessSet) -> Self {
        match set.engine() {
            Ok(k) => self.kolo = k.clone(),
            Err(m) => self.refused = Some(m),
        }
        self
    }

    /// Registers a parameter. Every rank must register the same parameters; a rank that
    /// produces no gradient for one still takes part (with zeros) so no rank hangs.
    pub fn param(mut self, name: impl Into<String>, shape: &[usize], dtype: DType) -> Self {
        self.params.push((name.into(), shape.to_vec(), dtype));
        self
    }

    /// [`ReduceOp::Average`] (default) or [`ReduceOp::Sum`].
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// Accumulates this many backward passes locally and reduces once per window.
    ///
    /// **Differs from Horovod:** the window's gradients are *averaged* (divided by
    /// `passes`), so two passes over batches `a` and `b` with a mean loss equal one
    /// pass over `a ∪ b`. Horovod's PyTorch `DistributedOptimizer` *sums* the passes
    /// and leaves the scaling to the loss; to get its behaviour, multiply the learning
    /// rate (or the loss) by `passes`.
    pub fn backward_passes_per_step(mut self, passes: usize) -> Self {
        self.passes = passes;
        self
    }

    /// Divides gradients by `factor` before the sum and multiplies by `factor / size`
    /// after it, to keep fp16 sums in range (Average only).
    pub fn gradient_predivide_factor(mut self, factor: f64) -> Self {
        self.predivide = factor;
        self
    }

    /// Gradient compression for the wire.
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Explicit fusion groups: the parameters of a group are reduced together in one
    /// grouped allreduce once all of them are ready.
    pub fn groups(mut self, groups: Vec<Vec<String>>) -> Self {
        self.groups = groups;
        self
    }

    /// Validates the options and builds the optimizer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a duplicate parameter name, an unknown or repeated
    /// group member, zero passes, a non-positive predivide factor, a predivide factor
    /// with an op other than Average, or an op other than Average and Sum.
    pub fn build(self) -> Result<DistributedOptimizer<O>> {
        self.check()?;
        let params = registered(&self.params, &self.groups)?;
        Ok(DistributedOptimizer {
            kolo: self.kolo,
            inner: self.inner,
            params,
            groups: self.groups,
            op: self.op,
            passes: self.passes,
            predivide: self.predivide,
            compression: self.compression,
            counts: HashMap::new(),
            accum: HashMap::new(),
            held: HashMap::new(),
            handles: Vec::new(),
            reduced: Gradients::new(),
            skip_next_sync: false,
            device: None,
        })
    }

    /// The settings' own checks, before any parameter is looked at.
    fn check(&self) -> Result<()> {
        if let Some(m) = &self.refused {
            return Err(invalid("process_set", m.clone()));
        }
        if !matches!(
            self.op,
            ReduceOp::Average | ReduceOp::Sum | ReduceOp::Adasum
        ) {
            return Err(invalid(
                "op",
                format!("{:?} is not supported; use Average, Sum or Adasum", self.op),
            ));
        }
        if self.op == ReduceOp::Adasum && self.compression != Compression::None {
            return Err(invalid(
                "compression",
                format!(
                    "{:?} with ReduceOp::Adasum is not supported: Adasum reduces f32 as it is",
                    self.compression
                ),
            ));
        }
        if self.passes == 0 {
            return Err(invalid(
                "backward_passes_per_step",
                "must be at least 1".into(),
            ));
        }
        if !(self.predivide.is_finite() && self.predivide > 0.0) {
            return Err(invalid(
                "gradient_predivide_factor",
                format!("{} must be a positive number", self.predivide),
            ));
        }
        if self.predivide != 1.0 && self.op != ReduceOp::Average {
            return Err(invalid(
                "gradient_predivide_factor",
                "only applies to ReduceOp::Average".into(),
            ));
        }
        Ok(())
    }
}

/// The registered parameters by name, each with its group, checked: names unique,
/// groups naming registered parameters, a parameter in one group at most.
fn registered(
    list: &[(String, Vec<usize>, DType)],
    groups: &[Vec<String>],
) -> Result<BTreeMap<String, Param>> {
    let mut params = BTreeMap::new();
    for (name, shape, dtype) in list.iter().cloned() {
        if params.contains_key(&name) {
            return Err(invalid(
                &name,
                "duplicate parameter name: every parameter needs its own name".into(),
            ));
        }
        params.insert(
            name,
            Param {
                shape,
                dtype,
                group: None,
                device: None,
            },
        );
    }
    for (g, members) in groups.iter().enumerate() {
        for m in members {
            let p = params.get_mut(m).ok_or_else(|| {
                invalid(
                    m,
                    format!("group {g} names a parameter that was not registered"),
                )
            })?;
            if let Some(other) = p.group {
                return Err(invalid(
                    m,
                    format!(
                        "parameter is in groups {other} and {g}; a parameter may be in one group"
                    ),
                ));
            }
            p.group = Some(g);
        }
    }
    Ok(params)
}

/// A refused setting or parameter of the builder, by name.
fn invalid(name: &str, message: String) -> Error {
    Error::InvalidArgument {
        op: "DistributedOptimizer",
        name: name.to_string(),
        message,
    }
}

enum Pending {
    One(String, DType, Handle<Tensor>),
    Group(Vec<(String, DType)>, Handle<Vec<Tensor>>),
}

/// Horovod's `DistributedOptimizer` for any framework: wraps a [`GradientStep`] and
/// averages (or sums) named gradients across ranks before every step.
///
/// ```no_run
/// # use kolo::{DType, DistributedOptimizer, Gradients, GradientStep, Tensor};
/// struct Sgd { w: Vec<f32>, lr: f32 }
/// impl GradientStep for Sgd {
///     fn step(&mut self, g: &Gradients) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
///         for (w, g) in self.w.iter_mut().zip(g["w"].as_slice::<f32>()?) { *w -= self.lr * g; }
///         Ok(())
///     }
/// }
/// let kolo = kolo::init()?;
/// let mut opt = DistributedOptimizer::builder(kolo.clone(), Sgd { w: vec![0.0; 4], lr: 0.1 })
///     .param("w", &[4], DType::F32)
///     .build()?;
/// opt.submit_gradient("w", Tensor::from_vec(vec![1.0f32; 4], &[4])?)?;
/// opt.step()?;
/// # Ok::<(), kolo::Error>(())
/// ```
pub struct DistributedOptimizer<O> {
    kolo: Kolo,
    inner: O,
    params: BTreeMap<String, Param>,
    groups: Vec<Vec<String>>,
    op: ReduceOp,
    passes: usize,
    predivide: f64,
    compression: Compression,
    /// Backward passes seen per parameter in this window.
    counts: HashMap<String, usize>,
    /// Local sums while a window is incomplete.
    accum: HashMap<String, Tensor>,
    /// Ready gradients of explicit groups, waiting for the rest of their group.
    held: HashMap<usize, Vec<(String, Tensor)>>,
    handles: Vec<Pending>,
    reduced: Gradients,
    skip_next_sync: bool,
    /// The device of the last gradient handed in on this rank (any parameter): where
    /// zeros go for a parameter that never had a gradient here.
    device: Option<Device>,
}

impl<O> std::fmt::Debug for DistributedOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("params", &self.params.len())
            .field("op", &self.op)
            .field("backward_passes_per_step", &self.passes)
            .field("compression", &self.compression)
            .finish_non_exhaustive()
    }
}

impl<O: GradientStep> DistributedOptimizer<O> {
    /// Starts a builder wrapping `inner`.
    pub fn builder(kolo: Kolo, inner: O) -> DistributedOptimizerBuilder<O> {
        DistributedOptimizerBuilder {
            kolo,
            inner,
            params: Vec::new(),
            op: ReduceOp::Average,
            passes: 1,
            predivide: 1.0,
            compression: Compression::None,
            groups: Vec::new(),
            refused: None,
        }
    }

    /// The wrapped optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The wrapped optimizer, mutably (e.g. to change its learning rate).
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Hands in the gradient of `name` from one backward pass. When the parameter's
    /// window is complete its reduction starts at once, in the background.
    ///
    /// # Errors
    /// An unknown name, a shape, dtype or device other than registered or seen
    /// before, a gradient produced more often than `backward_passes_per_step` before
    /// `step`, a gradient that cannot be accumulated locally (with
    /// `backward_passes_per_step` > 1: f32 or f64 on the CPU only), or a submit error.
    /// The optimizer's state is unchanged by a refused gradient, and the gradient
    /// comes back in the error ([`SubmitError::into_tensors`]).
    pub fn submit_gradient(&mut self, name: &str, grad: Tensor) -> Result<(), SubmitError> {
        let invalid = |message: String, grad: Tensor| {
            let e = Error::InvalidArgument {
                op: "submit_gradient",
                name: name.to_string(),
                message,
            };
            SubmitError::new(e, vec![grad])
        };
        let Some(param) = self.params.get(name) else {
            return Err(invalid("not a registered parameter".into(), grad));
        };
        if grad.shape() != param.shape.as_slice() || grad.dtype() != param.dtype {
            let message = format!(
                "gradient is {} {:?} but the parameter was registered as {} {:?}",
                grad.dtype(),
                grad.shape(),
                param.dtype,
                param.shape
            );
            return Err(invalid(message, grad));
        }
        let device = grad.device();
        if let Some(d) = param.device.filter(|&d| d != device) {
            let message = format!(
                "gradient is on {device} but earlier gradients of this parameter were on {d}"
            );
            return Err(invalid(message, grad));
        }
        let count = self.counts.get(name).copied().unwrap_or(0);
        if count >= self.passes {
            let message = format!(
                "gradient produced {} times before step(); backward_passes_per_step is {}",
                count + 1,
                self.passes
            );
            return Err(invalid(message, grad));
        }
        if self.passes > 1 {
            if let Err(message) = accumulable(&grad) {
                return Err(invalid(message, grad));
            }
        }
        // Checked above: nothing below fails before the state is updated.
        if let Some(sum) = self.accum.get_mut(name) {
            if let Err(message) = add_into(sum, &grad) {
                return Err(invalid(message, grad));
            }
        } else {
            self.accum.insert(name.to_string(), grad);
        }
        if let Some(p) = self.params.get_mut(name) {
            p.device = Some(device);
        }
        self.device = Some(device);
        self.counts.insert(name.to_string(), count + 1);
        if count + 1 < self.passes {
            return Ok(());
        }
        match self.accum.remove(name) {
            Some(total) => Ok(self.dispatch(name.to_string(), total)?),
            None => Err(Error::Internal(format!("{name:?}: accumulated gradient missing")).into()),
        }
    }

    /// Sends a finished window's gradient, or holds it until its group is complete.
    fn dispatch(&mut self, name: String, grad: Tensor) -> Result<()> {
        let group = self.params.get(&name).and_then(|p| p.group);
        // ByteGrad and Adasum reduce each gradient on its own.
        let alone = self.compression == Compression::ByteGrad || self.op == ReduceOp::Adasum;
        let group = group.filter(|_| !alone);
        let Some(g) = group else {
            let dtype = grad.dtype();
            let wire = compress(grad, self.compression)?;
            let mut b = self.scaled(self.kolo.allreduce(format!("grad.{name}"), wire));
            if self.compression == Compression::ByteGrad {
                b = b.compression(Compression::ByteGrad);
            }
            let h = b.submit()?;
            self.handles.push(Pending::One(name, dtype, h));
            return Ok(());
        };
        let held = self.held.entry(g).or_default();
        held.push((name, grad));
        if held.len() < self.groups[g].len() {
            return Ok(());
        }
        let mut members = self.held.remove(&g).unwrap_or_default();
        // Same order on every rank, whatever order the gradients arrived in.
        members.sort_by(|a, b| a.0.cmp(&b.0));
        let dtypes = members
            .iter()
            .map(|(n, t)| (n.clone(), t.dtype()))
            .collect();
        let wire = members
            .into_iter()
            .map(|(n, t)| Ok((format!("grad.{n}"), compress(t, self.compression)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut b = self.kolo.grouped_allreduce(wire).op(self.op);
        let (pre, post) = self.factors();
        b = b.prescale(pre).postscale(post);
        self.handles.push(Pending::Group(dtypes, b.submit()?));
        Ok(())
    }

    fn factors(&self) -> (f64, f64) {
        (1.0 / (self.predivide * self.passes as f64), self.predivide)
    }

    fn scaled<'k>(&self, b: crate::ops::AllreduceBuilder<'k>) -> crate::ops::AllreduceBuilder<'k> {
        let (pre, post) = self.factors();
        b.op(self.op).prescale(pre).postscale(post)
    }

    /// Waits for every reduction of this window. Parameters with no gradient on this
    /// rank are reduced with zeros (so other ranks do not hang), and incomplete windows
    /// with what was accumulated. Afterwards [`gradients`](Self::gradients) holds the
    /// reduced gradients, e.g. for clipping before [`step`](Self::step).
    ///
    /// # Errors
    /// The first error of any reduction (all are waited for regardless).
    pub fn synchronize(&mut self) -> Result<()> {
        let missing: Vec<(String, Tensor)> = self
            .params
            .iter()
            .filter(|(n, _)| self.counts.get(*n).copied().unwrap_or(0) < self.passes)
            .map(|(n, p)| {
                let t = match self.accum.remove(n) {
                    Some(t) => t,
                    None => {
                        let device = p.device.or(self.device).unwrap_or(Device::Cpu);
                        zeros_on(p.dtype, &p.shape, device)?
                    }
                };
                Ok((n.clone(), t))
            })
            .collect::<Result<_>>()?;
        for (name, t) in missing {
            self.dispatch(name, t)?;
        }
        self.counts.clear();
        let mut first_err = None;
        for pending in std::mem::take(&mut self.handles) {
            let result = match pending {
                Pending::One(name, dtype, h) => h
                    .wait()
                    .and_then(|t| Ok(vec![(name, decompress(t, dtype)?)])),
                Pending::Group(members, h) => h.wait().and_then(|ts| {
                    members
                        .into_iter()
                        .zip(ts)
                        .map(|((n, d), t)| Ok((n, decompress(t, d)?)))
                        .collect::<Result<Vec<_>>>()
                }),
            };
            match result {
                Ok(v) => self.reduced.extend(v),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The reduced gradients after [`synchronize`](Self::synchronize).
    pub fn gradients(&self) -> &Gradients {
        &self.reduced
    }

    /// The reduced gradients, mutably (e.g. for clipping).
    pub fn gradients_mut(&mut self) -> &mut Gradients {
        &mut self.reduced
    }

    /// Makes the next [`step`](Self::step) use the gradients as they are, without
    /// synchronising again: call [`synchronize`](Self::synchronize), modify
    /// [`gradients_mut`](Self::gradients_mut), then `skip_synchronize().step()`.
    pub fn skip_synchronize(&mut self) -> &mut Self {
        self.skip_next_sync = true;
        self
    }

    /// Synchronises (unless skipped) and runs the wrapped optimizer's step.
    ///
    /// # Errors
    /// A reduction error, or [`Error::Optimizer`] from the wrapped optimizer.
    pub fn step(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.skip_next_sync) {
            self.synchronize()?;
        }
        let result = self.inner.step(&self.reduced);
        self.reduced.clear();
        result.map_err(|source| Error::Optimizer {
            source: source.into(),
        })
    }
}

mod arith;
use arith::{accumulable, add_into, zeros_on};

/// Broadcasts named parameters from `root` in sorted name order so that every rank
/// starts from the same values (Horovod's `broadcast_parameters`).
///
/// # Errors
/// The errors of [`Kolo::broadcast`]; shapes or dtypes that differ between ranks are
/// reported naming the parameter. Every broadcast is waited for before the first
/// error is returned, and no entry of `params` is lost: a parameter whose broadcast
/// failed before it ran (a mismatch, a refused submit, a rank that left) keeps its
/// own tensor. One that failed while running is left out, since its buffer may be
/// half-written; the error names it.
pub fn broadcast_parameters(
    kolo: &Kolo,
    params: &mut BTreeMap<String, Tensor>,
    root: usize,
) -> Result<()> {
    let names: Vec<String> = params.keys().cloned().collect();
    let mut handles = Vec::with_capacity(names.len());
    let mut first_err = None;
    // A failure that never ran hands the tensor back: it goes back into the map.
    let mut keep = |params: &mut BTreeMap<String, Tensor>, name: String, e: SubmitError| {
        let (e, mut back) = e.into_parts();
        if let Some(t) = back.pop() {
            params.insert(name, t);
        }
        first_err.get_or_insert(e);
    };
    for name in names {
        let Some(t) = params.remove(&name) else {
            continue;
        };
        match kolo.broadcast(format!("param.{name}"), t, root).submit() {
            Ok(h) => handles.push((name, h)),
            Err(e) => keep(params, name, e),
        }
    }
    for (name, h) in handles {
        match h.wait_or_return() {
            Ok(t) => {
                params.insert(name, t);
            }
            Err(e) => keep(params, name, e),
        }
    }
    first_err.map_or(Ok(()), Err)
}
