//! Sharded optimizer state (ZeRO stages 1 and 2): each rank keeps the optimizer
//! state of 1/N of the parameters, and the same training results.

use std::ops::Range;
use std::sync::Arc;

use burn::grad_clipping::GradientClipping;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, LearningRate, ModuleOptimizer};
use burn::tensor::{DType, Device, Tensor};
use kolo::{Kolo, ReduceOp};

use crate::error::{Error, Result};
use crate::layout::Layout;

mod blocks;
mod consolidate;
mod flat;
mod record;
pub(crate) mod shard;
mod tensors;

use flat::{blocks, gathered, Flat, Gathered, WriteViews};
use shard::{segments, Piece, Shard};

/// A drop-in for Burn's `ModuleOptimizer` in a training loop that keeps only this
/// rank's share of the optimizer state (DeepSpeed's ZeRO stage 1, and stage 2 for the
/// reduced gradients; PyTorch's `ZeroRedundancyOptimizer`), across processes and
/// machines.
///
/// ```no_run
/// # use burn::module::Module;
/// # fn demo<M: Module>(model: M, loss: burn::tensor::Tensor<1>) -> kolo_burn::Result<()> {
/// use burn::optim::{AdamConfig, GradientsParams};
/// let kolo = kolo::init()?;
/// let mut model = kolo_burn::broadcast_parameters(&kolo, model, 0)?;
/// let mut optim = kolo_burn::ShardedOptimizer::new(&kolo, AdamConfig::new().init());
/// // each step, with the gradients straight from backward (not reduced):
/// let grads = GradientsParams::from_grads(loss.backward(), &model);
/// model = optim.step(1e-3, model, grads)?;
/// # Ok(()) }
/// ```
///
/// **How.** Every trainable float parameter, flattened, is cut into `N` contiguous blocks
/// balanced by elements (the first `n % N` ranks hold one more), the same on every
/// rank and every step; rank `r` holds block `r` of every parameter
/// ([`shard`](Self::shard)), so the state is split evenly however unevenly the
/// parameters are sized. Each step:
/// 1. the gradients are reduce-scattered as one group (kolo's
///    `grouped_reducescatter` through a [`GradientReducer`](crate::GradientReducer)
///    made to scatter, Average by default; each gradient lent as it is, small ones
///    fused): this rank receives the reduced gradient of its blocks only;
/// 2. the wrapped optimizer steps this rank's blocks, each a 1-D parameter viewing
///    the model's, so its state (Adam's two moments, momentum, …) exists for those
///    blocks only;
/// 3. the updated blocks are all-gathered as one group, and the gathered tensors
///    become every rank's parameters.
///
/// The wire volume per step equals one allreduce of the gradients. The result is the
/// same as [`GradientReducer`](crate::GradientReducer) followed by the same optimizer
/// for every element-wise optimizer (SGD with or without momentum, Adam, AdamW,
/// RMSprop, AdaGrad, Lion, weight decay): each element's update reads only its own
/// gradient and state.
///
/// **Devices.** The grouped reduce-scatter and all-gather run on the host: on a CUDA
/// device each step copies the gradients to the host and the gathered parameters back
/// (kolo's grouped collectives take no CUDA tensors yet).
///
/// **Clipping.** The wrapped optimizer's own gradient clipping gives the same result as
/// unsharded: clipping by value is element-wise, and clipping by norm per parameter
/// (Burn's `GradientClippingConfig::Norm`) uses each parameter's whole norm, summed
/// across the shards with one small allreduce of the squared norms per parameter (the
/// wrapped optimizer is then told to clip by an infinite value, which changes nothing,
/// so that it does not clip the shard as if it were one parameter).
/// [`clip_global_norm`](Self::clip_global_norm) clips by the norm of all gradients
/// together, as PyTorch's `clip_grad_norm_`, with the same allreduce.
///
/// **Accumulation and process sets.** Hand `step` the sum of several backward passes
/// and set [`backward_passes_per_step`](Self::backward_passes_per_step), as for
/// [`GradientReducer`](crate::GradientReducer); [`process_set`](Self::process_set)
/// shards among a set's ranks only.
///
/// **Optimizers that read a whole tensor** (LAMB's trust ratio, Muon's
/// orthogonalization, Adafactor's factored moments) would see a shard — pieces of
/// several parameters — as one tensor and step it differently; nothing in a
/// `ModuleOptimizer` tells them apart from element-wise ones, so wrap them with
/// [`by_tensors`](Self::by_tensors), which gives each parameter whole to one rank.
/// L-BFGS is not a `ModuleOptimizer` (it re-evaluates the loss) and cannot be wrapped.
///
/// **Precision.** Parameters of one float type — f32, f16 or bf16 — are sharded in it:
/// the shard, its gradients and the wrapped optimizer's state stay in the parameters'
/// precision, as the plain optimizer keeps them. Mixed float types are refused at the
/// first step; [`consolidate`](Self::consolidate) takes f32, f16 and bf16 state.
///
/// **Parameter groups.** The wrapped optimizer sees each block under its parameter's
/// id and module path, so `ModuleOptimizer::with_group` (e.g. no weight decay for
/// biases), per-parameter learning rates and the paths its record keeps apply to the
/// block as to the whole parameter. Norm clipping is taken over from the optimizer's
/// own (first) clipping setting only: one set on a group clips each rank's block by
/// the block's norm.
///
/// **The model may change between steps** (a frozen part unfrozen, parameters
/// loaded with new ids): the partition is made again, and the state of the
/// parameters that remain carries over, as in plain Burn. A wrapped optimizer
/// passed in with state (a plain optimizer loaded from a checkpoint) is taken as the
/// whole parameters' state, each rank keeping its share. Settings changed after the
/// first step (`op`, `backward_passes_per_step`, `bucket_bytes`) apply from the next
/// step; a process set must be chosen before the first one.
///
/// **Checkpoints.** [`consolidate`](Self::consolidate) gives the whole state as the
/// plain optimizer holds it (every rank's share gathered), which
/// [`save_checkpoint`](crate::save_checkpoint) and [`commit`](crate::commit) save like
/// any optimizer; [`load_consolidated`](Self::load_consolidated) takes this rank's share
/// back at any number of ranks, and the plain optimizer loads it as its own:
/// ```no_run
/// # use burn::module::Module;
/// # fn demo<M: Module>(kolo: &kolo::Kolo, model: M, optim: &mut kolo_burn::ShardedOptimizer, dir: &std::path::Path) -> kolo_burn::Result<()> {
/// use burn::optim::AdamConfig;
/// kolo_burn::save_checkpoint(kolo, dir, &model, &optim.consolidate(&model)?, 100)?;
/// // later, at any number of ranks:
/// if let Some(r) = kolo_burn::load_checkpoint(kolo, dir, model, AdamConfig::new().init())? {
///     optim.load_consolidated(&r.model, &r.optim)?;
/// }
/// # Ok(()) }
/// ```
///
/// **Gradients** must be this rank's own, straight from `backward`: gradients already
/// averaged by a [`GradientReducer`](crate::GradientReducer) would be averaged again,
/// which for Average leaves them unchanged (the same values on every rank) and for
/// Sum multiplies them by N — nothing can tell the two apart, so do not reduce them
/// first. A parameter without a gradient on this rank counts as zeros; one that no
/// rank has a gradient for in a step is not stepped (plain Burn skips it too).
///
/// **Frozen parameters** (`require_grad = false`: `no_grad()`, `freeze()`, LoRA's base
/// weights) are not sharded, reduced, stepped or given state, and stay bit-identical.
pub struct ShardedOptimizer {
    kolo: Kolo,
    inner: ModuleOptimizer,
    op: ReduceOp,
    prefix: String,
    /// The partition, learned and agreed on the first step.
    plan: Option<Arc<Plan>>,
    /// Backward passes summed into each step's gradients (they are divided by it).
    passes: usize,
    /// Clip all gradients together to this norm.
    global_norm: Option<f32>,
    /// Clip each parameter's gradient to this norm (the wrapped optimizer's clipping,
    /// taken over on the first step).
    param_norm: Option<f32>,
    /// Why the process set given refuses this rank.
    refused: Option<String>,
    /// Each parameter whole on one rank ([`by_tensors`](Self::by_tensors)).
    by_tensors: bool,
    /// Averages the gradients by whole tensors (after backward or during it); by
    /// element ranges, reduce-scatters them after backward, all in one bucket.
    reducer: Option<crate::GradientReducer>,
    /// By element ranges: reduce-scatters the gradients during backward
    /// ([`overlap`](Self::overlap)), in buckets of `bucket_bytes`.
    overlap_reducer: Option<crate::GradientReducer>,
    /// The overlap's bucket size ([`bucket_bytes`](Self::bucket_bytes)).
    bucket_bytes: Option<usize>,
}

/// The overlapped reduce-scatter's default bucket size. Measured on the 10 M-parameter
/// MLP at np 2 (two 16 MiB weights, one 6 MiB, small ones), overlapped steps/s, 2–4
/// alternating launches each: 1 MiB 10.3–10.7, 2 MiB 10.8–11.0, 4 MiB 10.4–11.5,
/// 8 MiB 9.8–11.2, 16 MiB 10.5–10.7, 25 MiB (`GradientReducer`'s default) 8.8–8.9
/// (a 22 MiB last bucket, sent only when backward ends, behind a full one); not
/// overlapped 10.2–11.0, the reducer 10.6–11.6.
const OVERLAP_BUCKET_BYTES: usize = 4 << 20;

impl std::fmt::Debug for ShardedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedOptimizer")
            .field("op", &self.op)
            .field("shard", &self.plan.as_ref().map(|p| p.blocks.clone()))
            .finish_non_exhaustive()
    }
}

/// A step's gradients: straight from backward, or being reduced by an overlap.
enum Gradients {
    Local(GradientsParams),
    Overlapped(crate::Overlap, GradientsParams),
}

/// The model's float parameters and this rank's block of each.
struct Plan {
    layout: Layout,
    /// Each parameter's elements, in module order.
    sizes: Vec<usize>,
    total: usize,
    /// This rank's block of each parameter (empty by whole tensors).
    blocks: Vec<Range<usize>>,
    /// The id under which the wrapped optimizer keeps each block's state: the
    /// parameter's own, so that state, groups and learning rates bound to it apply to
    /// its block, and state carries over when the plan is made again.
    piece_ids: Vec<ParamId>,
    /// The collective name of each parameter's gathered values.
    param_names: Vec<String>,
    /// Sharded by whole tensors: who owns each parameter.
    owners: Option<tensors::Owners>,
    /// The parameters' float type (by element ranges, all parameters share it).
    dtype: DType,
}

impl ShardedOptimizer {
    /// Wraps `inner` (e.g. `AdamConfig::new().init()`), averaging gradients across all
    /// ranks.
    pub fn new(kolo: &Kolo, inner: ModuleOptimizer) -> Self {
        ShardedOptimizer {
            kolo: kolo.clone(),
            inner,
            op: ReduceOp::Average,
            prefix: "kolo_burn.zero".into(),
            plan: None,
            passes: 1,
            global_norm: None,
            param_norm: None,
            refused: None,
            by_tensors: false,
            reducer: None,
            overlap_reducer: None,
            bucket_bytes: None,
        }
    }

    /// Wraps `inner`, sharding by whole parameters instead of element ranges: each
    /// parameter's state lives on one rank (the largest parameters first, each to the
    /// rank holding the fewest elements so far), which steps it as itself — for
    /// optimizers and clipping that read a whole tensor (LAMB, Muon, Adafactor, norm
    /// clipping). Each step averages every gradient as
    /// [`GradientReducer`](crate::GradientReducer) does (an allreduce: twice the wire
    /// volume of the element ranges' reduce-scatter), steps this rank's parameters and
    /// all-gathers them. The balance is only as even as the parameters allow: a layer
    /// that holds most of the model puts most of the state on one rank.
    /// [`consolidate`](Self::consolidate) joins every rank's state (any dtype), and
    /// [`load_consolidated`](Self::load_consolidated) keeps the state of the parameters
    /// this rank owns at this job's rank count.
    pub fn by_tensors(kolo: &Kolo, inner: ModuleOptimizer) -> Self {
        let mut s = Self::new(kolo, inner);
        s.by_tensors = true;
        s
    }

    /// Shards among the ranks of `set` only (Horovod's `process_set=`): each of its
    /// ranks holds 1/(set size) of the state, and Average divides by the set's size.
    /// On a rank outside the set, `step` fails naming the rank and the set.
    pub fn process_set(mut self, set: &kolo::ProcessSet) -> Self {
        if self.plan.is_some() {
            // The state is sharded among the first step's ranks: every rank refuses
            // alike, rather than some moving to the set and others not.
            self.refused = Some(
                "a process set must be chosen before the first step: the state is sharded \
                 among the ranks of the first step (consolidate it, make a new \
                 ShardedOptimizer with the set and load_consolidated the state)"
                    .into(),
            );
            return self;
        }
        match crate::grads::in_set(&self.kolo, set, "step in it") {
            Ok(k) => self.kolo = k,
            Err(why) => self.refused = Some(why),
        }
        self
    }

    /// The gradients handed to [`step`](Self::step) are the sum of `passes` backward
    /// passes (accumulated locally, e.g. with Burn's `GradientsAccumulator`): they are
    /// divided by `passes`, as
    /// [`GradientReducer::backward_passes_per_step`](crate::GradientReducer::backward_passes_per_step)
    /// does.
    pub fn backward_passes_per_step(mut self, passes: usize) -> Self {
        self.passes = passes.max(1);
        self.settings_changed();
        self
    }

    /// Scales all gradients (after the reduction, before the wrapped optimizer) by
    /// `max_norm / (norm + 1e-6)` when their norm — all parameters' gradients as one
    /// vector, across every shard — exceeds `max_norm`, as PyTorch's
    /// `clip_grad_norm_`. Costs one allreduce of one value per parameter per step.
    pub fn clip_global_norm(mut self, max_norm: f32) -> Self {
        self.global_norm = Some(max_norm);
        self
    }

    /// The largest bucket of gradients reduced together during backward
    /// ([`overlap`](Self::overlap); default 4 MiB by element ranges, 25 MiB by whole
    /// tensors, as [`GradientReducer::chunk_bytes`](crate::GradientReducer::chunk_bytes)):
    /// a bucket is sent once backward has produced all of its gradients. After
    /// backward ([`step`](Self::step)) the element ranges' gradients go in one bucket;
    /// whole tensors' in these. Set before the first step; 0 makes the step fail.
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = Some(bytes);
        self.settings_changed();
        self
    }

    /// [`ReduceOp::Average`] (default) or [`ReduceOp::Sum`] of the gradients.
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self.settings_changed();
        self
    }

    /// A setting of the reduction changed (also after the first step: issue 53 item
    /// 27): the reducers made with the old one are made again at the next step.
    fn settings_changed(&mut self) {
        self.reducer = None;
        self.overlap_reducer = None;
    }

    /// The elements of each float parameter (flattened, in module order) whose
    /// optimizer state this rank holds; `None` before the first step. With
    /// [`by_tensors`](Self::by_tensors): `None`, see
    /// [`owned_parameters`](Self::owned_parameters).
    pub fn shard(&self) -> Option<Vec<Range<usize>>> {
        self.plan
            .as_ref()
            .filter(|p| p.owners.is_none())
            .map(|p| p.blocks.clone())
    }

    /// With [`by_tensors`](Self::by_tensors): the indices (in module order) of the
    /// float parameters this rank steps; `None` before the first step or when sharding
    /// by element ranges.
    pub fn owned_parameters(&self) -> Option<Vec<usize>> {
        let plan = self.plan.as_ref()?;
        let owners = plan.owners.as_ref()?;
        let rank = self.kolo.rank();
        Some(
            (0..owners.owner.len())
                .filter(|&i| owners.owner[i] == rank)
                .collect(),
        )
    }

    /// The bytes of optimizer state this rank holds: the size of the wrapped
    /// optimizer's record (its state tensors and a small header).
    pub fn local_state_bytes(&self) -> usize {
        self.inner.to_record().into_bytes().map_or(0, |b| b.len())
    }

    /// The wrapped optimizer, holding this rank's share of the state.
    pub fn inner(&self) -> &ModuleOptimizer {
        &self.inner
    }

    /// Reduce-scatters `grads`, steps this rank's range and all-gathers the updated
    /// parameters into `model` (see the type's docs). Every rank must call it with the
    /// same model (the first step checks, naming the first parameter that differs).
    ///
    /// # Errors
    /// [`Error::ModelMismatch`] on every rank when the ranks' models differ;
    /// [`Error::InvalidArgument`] for what is not supported (see the type's docs); a
    /// failed collective ([`Error::Kolo`]) on every rank.
    pub fn step<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        grads: GradientsParams,
    ) -> Result<M> {
        let plan = self.plan_for(&model)?;
        self.step_with(lr, model, Gradients::Local(grads), &plan)
    }

    /// Starts a step whose gradients are reduce-scattered while backward is still
    /// running, bucket by bucket, as [`GradientReducer::overlap`](crate::GradientReducer::overlap)
    /// all-reduces them: pass each layer through the returned
    /// [`Overlap::layer`](crate::Overlap::layer) in the forward pass, then hand it to
    /// [`step_overlapped`](Self::step_overlapped) with the gradients of backward. The
    /// result equals [`step`](Self::step)'s. (By whole tensors the gradients are
    /// all-reduced during backward.)
    ///
    /// ```no_run
    /// # use burn::module::Module;
    /// # use burn::nn::{Linear, Relu};
    /// # use burn::tensor::Tensor;
    /// # use burn::optim::GradientsParams;
    /// # #[derive(Module, Debug)] struct Mlp { fc1: Linear, act: Relu, fc2: Linear }
    /// # fn demo(model: Mlp, x: Tensor<2>, optim: &mut kolo_burn::ShardedOptimizer) -> kolo_burn::Result<Mlp> {
    /// let sync = optim.overlap(&model)?;
    /// let h = sync.layer(&model.fc1, &x).forward(x);
    /// let h = model.act.forward(h);
    /// let out = sync.layer(&model.fc2, &h).forward(h);
    /// let grads = GradientsParams::from_grads(out.sum().backward(), &model);
    /// optim.step_overlapped(1e-3, model, sync, grads)
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`step`](Self::step) (the partition is agreed here on the first step).
    pub fn overlap<M: Module>(&mut self, model: &M) -> Result<crate::Overlap> {
        // Before planning, which may refuse the model for another reason.
        self.check_buckets()?;
        let plan = self.plan_for(model)?;
        self.reducer_for(&plan, true)?.overlap(model)
    }

    /// Ends a step started by [`overlap`](Self::overlap): the gradients the hooks have
    /// not taken are reduced now, then the step goes on as [`step`](Self::step).
    ///
    /// # Errors
    /// As [`step`](Self::step) and [`Overlap::finish`](crate::Overlap::finish).
    pub fn step_overlapped<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        sync: crate::Overlap,
        grads: GradientsParams,
    ) -> Result<M> {
        let plan = self.plan_for(&model)?;
        self.step_with(lr, model, Gradients::Overlapped(sync, grads), &plan)
    }

    /// The reducer that averages the gradients by whole tensors, or reduce-scatters
    /// them by element ranges: during backward (`overlapped`) in buckets, after it all
    /// in one (one grouped reduce-scatter; in 4 MiB buckets the 10 M-parameter MLP's
    /// step ran 9.6–11.9 steps/s against 11.2–12.3 in one, np 2, 5 alternating
    /// launches).
    fn reducer_for(&mut self, plan: &Plan, overlapped: bool) -> Result<&crate::GradientReducer> {
        self.check_buckets()?;
        let by_tensors = plan.owners.is_some();
        let scatter_during = !by_tensors && overlapped;
        // Made once, on first use.
        let (kolo, op, passes) = (&self.kolo, self.op, self.passes);
        let (prefix, bucket_bytes) = (&self.prefix, self.bucket_bytes);
        let make = || {
            let base = crate::GradientReducer::new(kolo)
                .op(op)
                .backward_passes_per_step(passes);
            if by_tensors {
                let r = base.prefix(format!("{prefix}.grads"));
                match bucket_bytes {
                    Some(b) => r.chunk_bytes(b),
                    None => r,
                }
            } else if scatter_during {
                base.prefix(format!("{prefix}.overlap"))
                    .chunk_bytes(bucket_bytes.unwrap_or(OVERLAP_BUCKET_BYTES))
                    .scattering()
            } else {
                base.prefix(format!("{prefix}.grads"))
                    .chunk_bytes(usize::MAX)
                    .scattering()
            }
        };
        let slot = if scatter_during {
            &mut self.overlap_reducer
        } else {
            &mut self.reducer
        };
        Ok(slot.get_or_insert_with(make))
    }

    /// Refuses a bucket size of 0 (by its own name: the reducer's error would name
    /// `GradientReducer::chunk_bytes`).
    fn check_buckets(&self) -> Result<()> {
        if self.bucket_bytes == Some(0) {
            return Err(Error::InvalidArgument {
                what: "ShardedOptimizer::bucket_bytes",
                message: "a bucket of 0 bytes holds no gradient; use at least 1 (one bucket \
                          per parameter) or leave the default"
                    .into(),
            });
        }
        Ok(())
    }

    fn step_with<M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        grads: Gradients,
        plan: &Plan,
    ) -> Result<M> {
        if let Some(owners) = &plan.owners {
            let reduced = match grads {
                Gradients::Local(g) => self.reducer_for(plan, false)?.reduce(&model, g)?,
                Gradients::Overlapped(sync, g) => sync.finish(&model, g)?,
            };
            return self.step_by_tensors(lr, model, reduced, plan, owners);
        }
        match plan.dtype {
            DType::F16 => self.step_elements::<half::f16, M>(lr, model, grads, plan),
            DType::BF16 => self.step_elements::<half::bf16, M>(lr, model, grads, plan),
            _ => self.step_elements::<f32, M>(lr, model, grads, plan),
        }
    }

    /// [`step`](Self::step) by element ranges, the blocks in `T` (the parameters'
    /// type).
    fn step_elements<T: Flat, M: Module>(
        &mut self,
        lr: LearningRate,
        model: M,
        grads: Gradients,
        plan: &Plan,
    ) -> Result<M> {
        let device = first_device(&model)?;
        // The reducer's settling makes a rank that cannot hand over a gradient fail the
        // step on every rank (it still takes part, with zeros), so that none waits.
        // A block is `None` where no rank had a gradient for its parameter this step:
        // the wrapped optimizer gets none for it and leaves it (and its state) alone,
        // as plain Burn does.
        let mut mine = match grads {
            Gradients::Local(g) => {
                self.reducer_for(plan, false)?
                    .reduce_slots(&model, g)?
                    .slots
            }
            Gradients::Overlapped(sync, g) => sync.settle(&model, g)?.0,
        };
        let values = blocks(&model, plan);
        if mine.len() != plan.sizes.len() {
            return Err(Error::Kolo(kolo::Error::Internal(format!(
                "{} reduced gradient blocks for {} parameters",
                mine.len(),
                plan.sizes.len()
            ))));
        }
        self.clip::<T>(&mut mine)?;
        let mut pieces = Vec::new();
        let mut shard_grads = GradientsParams::new();
        for (((value, grad), &id), slot) in values
            .into_iter()
            .zip(mine)
            .zip(&plan.piece_ids)
            .zip(&plan.layout.slots)
        {
            if let Some(value) = value {
                pieces.push(Piece {
                    path: segments(&slot.path),
                    param: Param::initialized(id, value),
                });
                if let Some(grad) = grad {
                    shard_grads.register(
                        id,
                        crate::convert::to_burn::<1>(
                            "the shard's gradients",
                            grad,
                            plan.dtype,
                            &device,
                        )?,
                    );
                }
            }
        }
        let mut stepped = self
            .inner
            .step(lr, Shard { pieces }, shard_grads)
            .pieces
            .into_iter();
        // By value: each stepped block is its tensor's only owner, so its buffer is
        // lent to the all-gather as it is.
        let copied = crate::convert::Copied::default();
        let wire = crate::convert::kolo_dtype("the updated shard", plan.dtype)?;
        let mut updated = Vec::with_capacity(plan.sizes.len());
        for (block, name) in plan.blocks.iter().zip(&plan.param_names) {
            let t = if block.is_empty() {
                kolo::Tensor::zeros(wire, &[0])
            } else {
                let p = stepped.next().ok_or_else(|| Error::InvalidArgument {
                    what: "ShardedOptimizer::step",
                    message: "the wrapped optimizer returned fewer blocks than it was given".into(),
                })?;
                crate::convert::on_host(crate::convert::to_kolo(
                    "the updated shard",
                    p.param.into_value(),
                    &copied,
                )?)?
            };
            updated.push((name.clone(), t));
        }
        let all = self.kolo.grouped_allgather(updated).wait()?;
        // The parameters become the gathered tensors: nothing is copied.
        Ok(model.map(&mut WriteViews {
            all: Gathered::Each(gathered(all, plan, &device)?),
            next: 0,
        }))
    }

    /// The partition of `module`, learned and agreed by all ranks on the first step,
    /// checked (cheaply) on later ones.
    fn plan_for<M: Module>(&mut self, module: &M) -> Result<Arc<Plan>> {
        if let Some(message) = &self.refused {
            return Err(Error::InvalidArgument {
                what: "ShardedOptimizer::process_set",
                message: message.clone(),
            });
        }
        let old = match &self.plan {
            Some(p) if p.layout.fits(module, usize::MAX) => return Ok(p.clone()),
            old => old.clone(),
        };
        if !self.by_tensors {
            self.take_over_norm_clipping();
        }
        // The model's parameters changed (another set trains, a load gave them new
        // ids): the state of those that remain carries over, as in plain Burn (issue
        // 53 item 27). By element ranges it is kept under each parameter's id, whose
        // block depends only on its size; by whole tensors the owners are assigned
        // again, so the state moves (gathered here, kept by its new owner).
        let carried = match &old {
            Some(p) if p.owners.is_some() => Some(self.consolidate_by_tensors()?),
            _ => None,
        };
        // A wrapped optimizer that arrives with state (a plain optimizer loaded from a
        // checkpoint, passed as `inner`) holds the whole parameters' state: each rank
        // keeps its share instead of ignoring it.
        let loaded = if old.is_none() && record::has_state(&self.inner) {
            let full = self.inner.clone();
            self.inner = record::without_state(&full, "ShardedOptimizer::new")?;
            Some(full)
        } else {
            None
        };
        let plan = Arc::new(self.learn(module)?);
        self.plan = Some(plan.clone());
        self.settings_changed();
        if let Some(full) = carried.as_ref().or(loaded.as_ref()) {
            self.load_with(&plan, full)?;
        }
        Ok(plan)
    }

    /// A wrapped optimizer that clips each parameter's gradient by its norm would clip
    /// the shard as one parameter: the norms are taken here instead, across the shards
    /// (see [`clip`](Self::clip)), and the wrapped optimizer clips by an infinite value,
    /// which leaves every gradient as it is.
    fn take_over_norm_clipping(&mut self) {
        if let Some(GradientClipping::Norm(max)) = self.inner.grad_clipping() {
            self.param_norm = Some(*max);
            self.inner = self
                .inner
                .clone()
                .with_grad_clipping(GradientClipping::Value(f32::INFINITY));
        }
    }

    /// Clips this rank's reduced gradient blocks `mine` (one per parameter): all
    /// together to the global norm, then each parameter's to its norm, each norm summed
    /// across the blocks (one allreduce of the squared norm of every parameter's block).
    fn clip<T: Flat>(&self, mine: &mut [Option<kolo::Tensor>]) -> Result<()> {
        if self.global_norm.is_none() && self.param_norm.is_none() {
            return Ok(());
        }
        let mut squares = Vec::with_capacity(mine.len());
        for block in mine.iter() {
            let square = match block {
                Some(b) => b
                    .as_slice::<T>()?
                    .iter()
                    .map(|&g| g.to_f64() * g.to_f64())
                    .sum::<f64>(),
                None => 0.0,
            };
            squares.push(square);
        }
        let n = squares.len();
        let squares = self
            .kolo
            .allreduce(
                format!("{}.norms", self.prefix),
                kolo::Tensor::from_vec(squares, &[n])?,
            )
            .op(ReduceOp::Sum)
            .wait()?
            .into_vec::<f64>()?;
        let global = self
            .global_norm
            .map_or(1.0, |max| global_clip(max, squares.iter().sum()));
        for (block, &square) in mine.iter_mut().zip(&squares) {
            let mut coef = global;
            if let Some(max) = self.param_norm {
                // Burn's clip_by_norm: max / (norm + the smallest positive f32), at most 1.
                let norm = global * square.sqrt();
                coef *= (f64::from(max) / (norm + f64::from(f32::MIN_POSITIVE))).min(1.0);
            }
            if let (true, Some(block)) = (coef < 1.0, block.as_mut()) {
                let c = coef as f32;
                block
                    .as_mut_slice::<T>()?
                    .iter_mut()
                    .for_each(|g| *g = g.times(c));
            }
        }
        Ok(())
    }

    fn learn<M: Module>(&self, module: &M) -> Result<Plan> {
        let layout = Layout::learn(module, &self.kolo, &self.prefix, usize::MAX)?;
        self.plan_of(layout)
    }

    /// The partition of the parameters of `layout`.
    fn plan_of(&self, layout: Layout) -> Result<Plan> {
        // One float type for the flat sequence: the first parameter's.
        let dtype = layout.slots.first().map_or(DType::F32, |s| s.dtype);
        let supported = matches!(dtype, DType::F32 | DType::F16 | DType::BF16);
        if let Some(s) = layout.slots.iter().find(|s| !supported || s.dtype != dtype) {
            return Err(Error::InvalidArgument {
                what: "ShardedOptimizer::step",
                message: format!(
                    "parameter {:?} is {:?} where {:?} is {dtype:?}; the sharded optimizer \
                     takes parameters of one float type, f32, f16 or bf16 (use \
                     GradientReducer with the plain optimizer for others)",
                    s.path,
                    s.dtype,
                    layout
                        .slots
                        .first()
                        .map(|f| f.path.as_str())
                        .unwrap_or_default(),
                ),
            });
        }
        let sizes: Vec<usize> = layout
            .slots
            .iter()
            .map(|s| s.dims.iter().product())
            .collect();
        let total = sizes.iter().sum();
        let (rank, size) = (self.kolo.rank(), self.kolo.size());
        let largest = sizes.iter().copied().max().unwrap_or(0);
        if !self.by_tensors && largest < size {
            return Err(Error::InvalidArgument {
                what: "ShardedOptimizer::step",
                message: format!(
                    "the model's largest parameter has {largest} elements, fewer than the {size} \
                     ranks to share each parameter's elements: some rank would hold nothing \
                     (use ShardedOptimizer::by_tensors, or fewer ranks)"
                ),
            });
        }
        if self.by_tensors && total < size {
            return Err(Error::InvalidArgument {
                what: "ShardedOptimizer::step",
                message: format!(
                    "the model has {total} parameter elements, fewer than the {size} ranks \
                     to share them"
                ),
            });
        }
        let owners = self
            .by_tensors
            .then(|| tensors::Owners::assign(&sizes, size));
        let blocks = if owners.is_some() {
            vec![0..0; sizes.len()]
        } else {
            sizes.iter().map(|&n| range_of(n, size, rank)).collect()
        };
        Ok(Plan {
            piece_ids: layout.slots.iter().map(|s| s.id).collect(),
            param_names: layout.names.iter().map(|n| format!("{n}.value")).collect(),
            layout,
            sizes,
            total,
            blocks,
            owners,
            dtype,
        })
    }
}

/// The factor that clips gradients of squared norm `squares` to the norm `max`, as
/// PyTorch's `clip_grad_norm_`: `max / (norm + 1e-6)`, at most 1.
pub(crate) fn global_clip(max: f32, squares: f64) -> f64 {
    (f64::from(max) / (squares.sqrt() + 1e-6)).min(1.0)
}

/// The elements rank `rank` of `size` holds of a parameter of `total`: contiguous, the
/// first `total % size` ranks one more (kolo's reducescatter splits dim 0 the same
/// way).
pub(crate) fn range_of(total: usize, size: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (total / size, total % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// The device of the module's first float parameter.
fn first_device<M: Module>(module: &M) -> Result<Device> {
    struct First(Option<Device>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().device());
            }
        }
    }
    let mut f = First(None);
    module.visit(&mut f);
    f.0.ok_or_else(|| Error::InvalidArgument {
        what: "ShardedOptimizer::step",
        message: "the module has no float parameters".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::range_of;

    #[test]
    fn ranges_cover_everything_once_and_differ_by_at_most_one() {
        for total in [4usize, 5, 7, 100, 101] {
            for size in 1..=4 {
                let ranges: Vec<_> = (0..size).map(|r| range_of(total, size, r)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[size - 1].end, total);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let lens: Vec<usize> = ranges.iter().map(ExactSizeIterator::len).collect();
                let (lo, hi) = (lens.iter().min(), lens.iter().max());
                assert!(hi.zip(lo).is_some_and(|(h, l)| h - l <= 1), "{lens:?}");
            }
        }
    }
}
