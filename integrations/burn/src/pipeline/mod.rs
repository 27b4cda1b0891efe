//! Pipeline parallelism: a model cut into consecutive stages, one per rank, trained on
//! micro-batches that flow through the stages (GPipe's fill-drain schedule or
//! PipeDream's 1F1B), combined with data parallelism across replicas of the pipeline.

use std::ops::Range;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Device, Tensor};
use kolo::{Handle, Kolo, ProcessSet};

mod check;
mod checkpoint;
mod failure;

use crate::convert::{to_burn, to_kolo_host, Copied};
use crate::error::{Error, Result};
use crate::grads::GradientReducer;
use failure::Side;

/// The order in which a stage runs the forward and backward passes of a step's
/// micro-batches. Parsed from `1f1b` or `gpipe` (also `fill-drain`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// GPipe: every micro-batch forward, then every micro-batch backward. Each stage
    /// keeps the activations of all `M` micro-batches until the backward passes.
    FillDrain,
    /// PipeDream-flush (1F1B), the default: after a warm-up of `S − s − 1` forwards,
    /// stage `s` alternates one forward and one backward. The same idle time as
    /// fill-drain (the same `(S − 1)/(M + S − 1)` bubble) and the same gradients, but a
    /// stage keeps at most `S − s` micro-batches of activations instead of `M`, so
    /// memory stays flat as `M` grows.
    #[default]
    OneFOneB,
}

impl std::str::FromStr for Schedule {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "1f1b" | "one-f-one-b" => Ok(Schedule::OneFOneB),
            "gpipe" | "fill-drain" | "filldrain" => Ok(Schedule::FillDrain),
            other => Err(format!(
                "unknown pipeline schedule {other:?}: 1f1b (the default) or gpipe"
            )),
        }
    }
}

/// What [`Pipeline::step`] returns on each rank.
#[derive(Debug)]
pub struct StepOutput {
    /// This stage's parameter gradients for the whole batch (summed over the
    /// micro-batches, each micro-batch's loss weighted `1/M`), averaged over the
    /// stage's replicas: ready for the stage's own optimizer.
    pub grads: GradientsParams,
    /// On the last stage: the batch's loss (the mean of the micro-batches' losses, as
    /// the loss function returned them); `None` on every other stage.
    pub loss: Option<f64>,
}

/// One pass of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward(usize),
    Backward(usize),
}

/// Stage `stage`'s passes for one step of `micro` micro-batches among `stages`.
fn passes(schedule: Schedule, stages: usize, stage: usize, micro: usize) -> Vec<Pass> {
    match schedule {
        Schedule::FillDrain => (0..micro)
            .map(Pass::Forward)
            .chain((0..micro).map(Pass::Backward))
            .collect(),
        Schedule::OneFOneB => {
            let warm = (stages - stage - 1).min(micro);
            let mut v: Vec<Pass> = (0..warm).map(Pass::Forward).collect();
            for i in 0..micro - warm {
                v.push(Pass::Forward(warm + i));
                v.push(Pass::Backward(i));
            }
            v.extend((micro - warm..micro).map(Pass::Backward));
            v
        }
    }
}

/// Pipeline-parallel training across the job's ranks: `S` stages × `N/S` replicas.
///
/// Rank `r` runs stage `r % S` of replica `r / S`: each replica's stages are
/// consecutive ranks (activations travel between neighbours, on one host when the
/// ranks of a host are consecutive), and the ranks of one stage — one per replica —
/// form a process set whose gradients are averaged by a [`GradientReducer`]. With 4
/// ranks and 2 stages:
///
/// | | stage 0 | stage 1 |
/// |---|---|---|
/// | replica 0 | rank 0 | rank 1 |
/// | replica 1 | rank 2 | rank 3 |
///
/// Each rank builds only its own stage (a Burn module from its input to its output;
/// the first stage takes the input batch, the last stage's output goes to the loss),
/// and calls [`step`](Self::step) every training step with its stage's forward
/// function:
///
/// ```no_run
/// # use burn::module::Module;
/// # use burn::nn::{Linear, LinearConfig};
/// # use burn::tensor::{Device, Int, Tensor};
/// # fn demo(x: Tensor<2>, y: Tensor<1, Int>, device: &Device) -> kolo_burn::Result<()> {
/// use burn::optim::{AdamConfig, Optimizer};
/// let kolo = kolo::init()?;
/// let mut pipe = kolo_burn::Pipeline::new(&kolo, 2)?.micro_batches(4);
/// let layer = LinearConfig::new(64, 64).init(device); // this rank's stage
/// let mut layer = pipe.broadcast_parameters(layer)?;
/// let mut optim = AdamConfig::new().init();
/// let loss = burn::nn::loss::CrossEntropyLossConfig::new().init(device);
/// // each step (the input batch matters on the first stage, the targets on the last):
/// let out = pipe.step(
///     &layer,
///     pipe.is_first().then(|| x.clone()),
///     |m, x: Tensor<2>| m.forward(x),
///     |out, rows| loss.forward(out, y.clone().slice(rows)),
/// )?;
/// layer = optim.step(1e-3, layer, out.grads);
/// # Ok(()) }
/// ```
///
/// **Equivalence.** A step gives each stage the gradients that one process computing
/// the whole model on the whole batch (all replicas' batches together) would give its
/// layers, when the loss is a mean over the batch's samples: every micro-batch's loss
/// is weighted `1/M`, and replicas average. So the parameters after any number of
/// steps match single-process training (the tests check 1e-5 after 20 steps).
///
/// **Checks before training.** The first step runs micro-batch 0 forward through every
/// stage once, catching a stage whose forward fails on what the previous stage sent
/// (a shape that does not fit, a tensor rank the stage does not take) and a batch that
/// `M` micro-batches do not divide; every rank then fails with the same
/// [`Error::InvalidArgument`] naming the stage and its ranks, instead of a panic on one
/// rank and a hang on the others.
pub struct Pipeline {
    kolo: Kolo,
    stages: usize,
    stage: usize,
    replicas: usize,
    replica: usize,
    micro: usize,
    schedule: Schedule,
    /// This stage's replicas.
    stage_set: ProcessSet,
    reducer: Option<GradientReducer>,
    steps: u64,
    infers: u64,
    copied: Copied,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("stages", &self.stages)
            .field("stage", &self.stage)
            .field("replicas", &self.replicas)
            .field("replica", &self.replica)
            .field("micro_batches", &self.micro)
            .field("schedule", &self.schedule)
            .finish_non_exhaustive()
    }
}

/// The text of a caught panic.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "it panicked".into())
}

/// Where this stage's tensors live: the input batch's device on the first stage, else
/// the model's (Burn's default device for a stage without parameters).
fn stage_device<M: Module, const D: usize>(model: &M, input: Option<&Tensor<D>>) -> Device {
    input
        .map(Tensor::device)
        .or_else(|| model.devices().into_iter().next())
        .unwrap_or_default()
}

/// Burn's element type for a kolo tensor received as activations or gradients.
fn burn_dtype(t: &kolo::Tensor) -> DType {
    match t.dtype() {
        kolo::DType::F64 => DType::F64,
        kolo::DType::F16 => DType::F16,
        kolo::DType::BF16 => DType::BF16,
        _ => DType::F32,
    }
}

impl Pipeline {
    /// Cuts the job's ranks into `stages` stages × `size / stages` replicas (see the
    /// type's docs for the layout). Every rank must call it, with the same `stages`;
    /// with more than one replica it makes one process set per stage.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on every rank when `stages` is 0 or does not divide
    /// the number of ranks; [`Error::Kolo`] when a process set cannot be made.
    pub fn new(kolo: &Kolo, stages: usize) -> Result<Self> {
        let size = kolo.size();
        if stages == 0 || !size.is_multiple_of(stages) {
            return Err(Error::InvalidArgument {
                what: "kolo_burn::Pipeline::new",
                message: format!(
                    "{stages} pipeline stages do not divide the {size} ranks of the job \
                     (each stage needs the same number of replicas; use a divisor of {size})"
                ),
            });
        }
        let replicas = size / stages;
        let (stage, replica) = (kolo.rank() % stages, kolo.rank() / stages);
        // One process set per stage (also of one rank: checkpoints go through it).
        let mut stage_set = None;
        for s in 0..stages {
            let ranks: Vec<usize> = (0..replicas).map(|r| r * stages + s).collect();
            let set = kolo.add_process_set(&ranks)?;
            if s == stage {
                stage_set = Some(set);
            }
        }
        let stage_set = stage_set.ok_or_else(|| Error::InvalidArgument {
            what: "kolo_burn::Pipeline::new",
            message: format!("rank {} is in no stage", kolo.rank()),
        })?;
        let reducer = (replicas > 1).then(|| GradientReducer::new(kolo).process_set(&stage_set));
        Ok(Pipeline {
            kolo: kolo.clone(),
            stages,
            stage,
            replicas,
            replica,
            micro: 4,
            schedule: Schedule::default(),
            stage_set,
            reducer,
            steps: 0,
            infers: 0,
            copied: Copied::default(),
        })
    }

    /// Cuts each batch into `m` micro-batches (default 4; at least 1). More
    /// micro-batches shrink the pipeline's idle time, `(S − 1)/(M + S − 1)`, at the cost
    /// of smaller matrix products. The batch must be a multiple of `m`.
    pub fn micro_batches(mut self, m: usize) -> Self {
        self.micro = m.max(1);
        self
    }

    /// The schedule (default [`Schedule::OneFOneB`]).
    pub fn schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// This rank's stage (0 takes the input batch).
    pub fn stage(&self) -> usize {
        self.stage
    }

    /// The number of stages.
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// This rank's replica of the pipeline.
    pub fn replica(&self) -> usize {
        self.replica
    }

    /// The number of replicas (data-parallel copies of the pipeline).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The rank that runs `stage` of `replica`.
    pub fn rank_of(&self, stage: usize, replica: usize) -> usize {
        replica * self.stages + stage
    }

    /// Whether this rank runs the first stage (it passes the input batch to `step`).
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    /// Whether this rank runs the last stage (its `loss` function is called).
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// The ranks running this rank's stage (one per replica).
    pub fn stage_ranks(&self) -> Vec<usize> {
        (0..self.replicas)
            .map(|r| self.rank_of(self.stage, r))
            .collect()
    }

    /// Makes this stage's module equal on every replica to replica 0's (Burn draws
    /// parameters at random per process). Call it on every rank before the first step.
    ///
    /// # Errors
    /// As [`broadcast_parameters`](crate::broadcast_parameters).
    pub fn broadcast_parameters<M: Module>(&self, module: M) -> Result<M> {
        if self.replicas == 1 {
            return Ok(module);
        }
        crate::broadcast_parameters(self.stage_kolo()?, module, 0)
    }

    /// The process set of this stage's ranks (one per replica) as a [`Kolo`]: its rank
    /// 0 is replica 0. Collectives among the replicas of a stage go through it.
    ///
    /// # Errors
    /// [`Error::Kolo`] when the set's engine has stopped.
    pub fn stage_kolo(&self) -> Result<&Kolo> {
        self.stage_set.kolo().ok_or_else(|| {
            Error::Kolo(kolo::Error::InvalidArgument {
                op: "pipeline",
                name: format!("stage {}", self.stage),
                message: "this rank's stage has no process set".into(),
            })
        })
    }

    /// A forward pass of `input` through the whole pipeline, without gradients (for
    /// evaluation): the first stage passes `input`, the last gets the model's output;
    /// every other stage gets `None`. Every rank of the job calls it.
    ///
    /// # Errors
    /// As [`step`](Self::step): the first stage got no input, a tensor of another
    /// rank arrived, a send or receive failed.
    pub fn infer<M, const DI: usize, const DO: usize>(
        &mut self,
        model: &M,
        input: Option<Tensor<DI>>,
        forward: impl Fn(&M, Tensor<DI>) -> Tensor<DO>,
    ) -> Result<Option<Tensor<DO>>>
    where
        M: Module,
    {
        let device = stage_device(model, input.as_ref());
        let n = self.infers;
        self.infers += 1;
        let key = format!("kolo_burn.pipeline.infer.{n}");
        let me = self.kolo.rank();
        let x = if self.is_first() {
            let x = input.ok_or_else(|| {
                self.failure("the first stage got no input (pass Some(batch) to infer)".into())
            });
            match x {
                Ok(x) => x,
                Err(e) => {
                    self.pass_failure(&key, &e.to_string())?;
                    return Err(e);
                }
            }
        } else {
            let t = self.receive(&key, me - 1)?;
            match self.as_burn::<DI>(&key, t, &device, "activations") {
                Ok(x) => x,
                Err(e) => {
                    // The stages after this one wait for this key: tell them.
                    self.pass_failure(&key, &e.to_string())?;
                    return Err(e);
                }
            }
        };
        let out = forward(model, x).detach();
        if self.is_last() {
            return Ok(Some(out));
        }
        let t = to_kolo_host(&key, out, &self.copied)?;
        self.kolo.send(key, t, me + 1).wait()?;
        Ok(None)
    }

    /// One training step of this rank's stage over one batch.
    ///
    /// - `model`: this rank's stage;
    /// - `input`: the whole batch (this replica's), on the first stage; ignored
    ///   elsewhere (pass `None`). It is cut along dimension 0 into the micro-batches;
    /// - `forward`: the stage's forward pass, from its input (the micro-batch on the
    ///   first stage, what the previous stage sent elsewhere) to its output;
    /// - `loss`: on the last stage, the loss of a micro-batch's output, given the rows of
    ///   the batch it holds (to slice the targets): a mean over its samples, as Burn's
    ///   losses return it. Not called on other stages.
    ///
    /// Returns the stage's gradients, reduced over its replicas (see [`StepOutput`]).
    /// Every rank of the job must call it once per step.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] on every rank of the replica: the first stage got
    ///   no input or a batch that is not a multiple of the micro-batches (any step),
    ///   or, at the first step, a stage's forward failed on what the previous stage
    ///   sent (naming the stage, its ranks and the panic's message; every rank of the
    ///   job then fails);
    /// - [`Error::Data`]: activations or gradients of a dtype kolo cannot carry;
    /// - [`Error::Kolo`]: a send, receive or reduction failed (a rank that left, …);
    /// - a step that fails on one rank (any of the above, on any stage or replica)
    ///   fails on every rank of the job: a failing stage passes its error to the
    ///   neighbours that wait for it (in place of the activations or gradients they
    ///   would receive), and before any replica reduces, the ranks agree whether the
    ///   step went through; the ranks that did not fail themselves return
    ///   [`Error::OtherRank`] naming the first that did. No stage or replica steps
    ///   alone, and the next step starts in step everywhere: every rank may call
    ///   `step` again.
    pub fn step<M, const DI: usize, const DO: usize>(
        &mut self,
        model: &M,
        input: Option<Tensor<DI>>,
        forward: impl Fn(&M, Tensor<DI>) -> Tensor<DO>,
        mut loss: impl FnMut(Tensor<DO>, Range<usize>) -> Tensor<1>,
    ) -> Result<StepOutput>
    where
        M: Module,
    {
        let device = stage_device(model, input.as_ref());
        let input = if self.is_first() { input } else { None };
        if self.steps == 0 {
            self.check(model, input.as_ref(), &device, &forward, &mut loss)?;
        }
        let step = self.steps;
        self.steps += 1;
        // The first stage's batch check, every step: on failure the stages after it
        // learn why through micro-batch 0 (nothing else of the step is in flight).
        let rows = if self.is_first() {
            match self.micro_rows(input.as_ref()) {
                Ok(rows) => rows,
                Err(e) => {
                    let e = match self.pass_failure(&self.act_key(step, 0), &e.to_string()) {
                        Ok(()) => e,
                        Err(sent) => sent,
                    };
                    return Err(self.agree_step(step, Err(e)).err().unwrap_or_else(|| {
                        Error::Kolo(kolo::Error::Internal("a failed step was agreed".into()))
                    }));
                }
            }
        } else {
            0
        };
        let mut state = StepState {
            step,
            rows,
            device,
            inputs: (0..self.micro).map(|_| None).collect(),
            outputs: (0..self.micro).map(|_| None).collect(),
            losses: (0..self.micro).map(|_| None).collect(),
            sends: Vec::new(),
            accumulated: GradientsAccumulator::new(),
            loss_sum: 0.0,
            acts_sent: 0,
            grads_sent: 0,
            failed_from: None,
            passed_on: None,
        };
        let passed = (|| -> Result<()> {
            for pass in passes(self.schedule, self.stages, self.stage, self.micro) {
                match pass {
                    Pass::Forward(m) => self.forward_pass(
                        &mut state,
                        m,
                        model,
                        input.as_ref(),
                        &forward,
                        &mut loss,
                    )?,
                    Pass::Backward(m) => self.backward_pass(&mut state, m, model)?,
                }
            }
            for h in state.sends.drain(..) {
                h.wait()?;
            }
            Ok(())
        })();
        if let Err(e) = &passed {
            let why = state.passed_on.take().unwrap_or_else(|| e.to_string());
            self.tell_neighbours(&state, &why);
        }
        self.agree_step(step, passed)?;
        let grads = state.accumulated.grads();
        let grads = match &self.reducer {
            Some(r) => r.reduce(model, grads)?,
            None => grads,
        };
        Ok(StepOutput {
            grads,
            loss: self.is_last().then_some(state.loss_sum),
        })
    }

    /// The rows of each micro-batch of the first stage's `input`.
    fn micro_rows<const DI: usize>(&self, input: Option<&Tensor<DI>>) -> Result<usize> {
        let Some(x) = input else {
            return Err(self
                .failure("the first stage got no input batch (pass Some(batch) to step)".into()));
        };
        let n = x.dims().first().copied().unwrap_or(0);
        if n == 0 || !n.is_multiple_of(self.micro) {
            return Err(self.failure(format!(
                "a batch of {n} rows cannot be cut into {} equal micro-batches \
                     (make the batch a multiple of --micro-batches, or drop the last \
                     partial batch)",
                self.micro
            )));
        }
        Ok(n / self.micro)
    }

    /// This stage's error.
    fn failure(&self, message: String) -> Error {
        Error::Pipeline {
            stage: self.stage,
            ranks: self.stage_ranks(),
            message,
        }
    }

    fn act_key(&self, step: u64, m: usize) -> String {
        format!("kolo_burn.pipeline.{step}.act.{m}")
    }

    fn grad_key(&self, step: u64, m: usize) -> String {
        format!("kolo_burn.pipeline.{step}.grad.{m}")
    }

    /// Sends `why` on to the next stage in place of activations `key` (the last stage
    /// has no one to tell).
    fn pass_failure(&self, key: &str, why: &str) -> Result<()> {
        if self.is_last() {
            return Ok(());
        }
        // Activations are never bytes: a byte tensor is a failure's text.
        let marker = kolo::Tensor::from_vec(why.as_bytes().to_vec(), &[why.len()])?;
        self.kolo.send(key, marker, self.kolo.rank() + 1).wait()?;
        Ok(())
    }

    /// Receives activations or gradients `key` from `from`: a failure passed on by an
    /// earlier stage (a byte tensor) is this stage's error too, after it passes it on.
    fn receive(&self, key: &str, from: usize) -> Result<kolo::Tensor> {
        let t = self.kolo.recv(key, from).wait()?;
        if t.dtype() != kolo::DType::U8 {
            return Ok(t);
        }
        let why = String::from_utf8_lossy(t.as_bytes()?).into_owned();
        self.pass_failure(key, &why)?;
        Err(self.failure(format!("an earlier stage failed: {why}")))
    }

    /// A received tensor as a Burn tensor of rank `D`, or an error naming the stages.
    fn as_burn<const D: usize>(
        &self,
        key: &str,
        t: kolo::Tensor,
        device: &Device,
        what: &str,
    ) -> Result<Tensor<D>> {
        if t.shape().len() != D {
            return Err(self.failure(format!(
                "it received {what} of shape {:?} (rank {}), but takes tensors of rank {D}",
                t.shape(),
                t.shape().len()
            )));
        }
        let dtype = burn_dtype(&t);
        to_burn::<D>(key, t, dtype, device)
    }

    /// Sends `t` to rank `to` under `key`; the handle joins `sends`.
    fn send_tensor<const D: usize>(
        &self,
        sends: &mut Vec<Handle<()>>,
        key: String,
        t: Tensor<D>,
        to: usize,
    ) -> Result<()> {
        let t = to_kolo_host(&key, t, &self.copied)?;
        sends.push(self.kolo.send(key, t, to).submit()?);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_pass<M, const DI: usize, const DO: usize>(
        &self,
        state: &mut StepState<M, Tensor<DI>, Tensor<DO>>,
        m: usize,
        model: &M,
        input: Option<&Tensor<DI>>,
        forward: &impl Fn(&M, Tensor<DI>) -> Tensor<DO>,
        loss: &mut impl FnMut(Tensor<DO>, Range<usize>) -> Tensor<1>,
    ) -> Result<()> {
        let me = self.kolo.rank();
        let x = match input {
            Some(x) => x.clone().narrow(0, m * state.rows, state.rows),
            None => {
                let key = self.act_key(state.step, m);
                let t = self.receive_in_step(state, &key, Side::Prev)?;
                let x = self.as_burn::<DI>(&key, t, &state.device, "activations")?;
                let x = x.require_grad();
                state.inputs[m] = Some(x.clone());
                x
            }
        };
        let out = forward(model, x);
        if self.is_last() {
            let rows = out.dims().first().copied().unwrap_or(0);
            let l = loss(out, m * rows..(m + 1) * rows).div_scalar(self.micro as f64);
            state.loss_sum += scalar(&l);
            state.losses[m] = Some(l);
        } else {
            let key = self.act_key(state.step, m);
            self.send_tensor(&mut state.sends, key, out.clone().detach(), me + 1)?;
            state.acts_sent = m + 1;
            state.outputs[m] = Some(out);
        }
        Ok(())
    }

    fn backward_pass<M: Module, const DI: usize, const DO: usize>(
        &self,
        state: &mut StepState<M, Tensor<DI>, Tensor<DO>>,
        m: usize,
        model: &M,
    ) -> Result<()> {
        let me = self.kolo.rank();
        let mut grads = if self.is_last() {
            let l = state.losses[m].take().ok_or_else(|| missing("loss", m))?;
            l.backward()
        } else {
            let out = state.outputs[m]
                .take()
                .ok_or_else(|| missing("output", m))?;
            let key = self.grad_key(state.step, m);
            let g = self.receive_in_step(state, &key, Side::Next)?;
            let g = self.as_burn::<DO>(&key, g, &state.device, "gradients")?;
            // d(sum(out · g))/dθ is gᵀ ∂out/∂θ: the received gradient pulled back.
            (out * g).sum().backward()
        };
        if !self.is_first() {
            let x = state.inputs[m].take().ok_or_else(|| missing("input", m))?;
            let gx = x.grad_remove(&mut grads).ok_or_else(|| {
                self.failure(
                    "its output does not depend on its input: no gradient to send back".into(),
                )
            })?;
            let key = self.grad_key(state.step, m);
            self.send_tensor(&mut state.sends, key, gx, me - 1)?;
            state.grads_sent = m + 1;
        }
        let grads = GradientsParams::from_grads(grads, model);
        state.accumulated.accumulate(model, grads);
        Ok(())
    }
}

/// One step's micro-batches on this rank.
struct StepState<M, I, O> {
    step: u64,
    /// Rows of each micro-batch (first stage).
    rows: usize,
    device: Device,
    /// The received activations, leaves whose gradient goes back (not first stage).
    inputs: Vec<Option<I>>,
    /// The outputs sent on, kept for their backward pass (not last stage).
    outputs: Vec<Option<O>>,
    /// Each micro-batch's weighted loss (last stage).
    losses: Vec<Option<Tensor<1>>>,
    sends: Vec<Handle<()>>,
    accumulated: GradientsAccumulator<M>,
    loss_sum: f64,
    /// Activations sent to the next stage (micro-batches `0..acts_sent`, in order).
    acts_sent: usize,
    /// Gradients sent back to the previous stage (`0..grads_sent`, in order).
    grads_sent: usize,
    /// The neighbour whose failure this step received, if any.
    failed_from: Option<Side>,
    /// That failure's text, passed on unchanged.
    passed_on: Option<String>,
}

fn missing(what: &str, m: usize) -> Error {
    Error::InvalidArgument {
        what: "kolo_burn::Pipeline::step",
        message: format!("internal: no {what} kept for micro-batch {m}"),
    }
}

/// A one-element tensor's value.
fn scalar(t: &Tensor<1>) -> f64 {
    t.clone()
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .ok()
        .and_then(|v| v.first().copied())
        .unwrap_or(f64::NAN)
}
