//! Fully sharded parameters (DeepSpeed's ZeRO stage 3, PyTorch's FSDP) for Burn: each
//! rank keeps 1/N of every parameter of a wrapped sub-module, gathers the whole
//! parameters just for that sub-module's forward (and again for its backward), and
//! receives only its block of the averaged gradient.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use burn::module::Module;
use burn::tensor::{DType, Device, FloatDType, Tensor};
use kolo::{Kolo, ReduceOp};

use crate::convert;
use crate::error::{Error, Result};
use crate::layout::trains;
use crate::sharded::range_of;
use crate::sharded::shard::Shard;

mod ahead;
mod checkpoint;
mod module;
mod op;
mod overlap;
mod record;

pub use module::local_param_bytes;
pub(crate) use module::{has_units, on};
use module::{Fill, Take};

pub use checkpoint::{
    commit_fully_sharded, load_fully_sharded_checkpoint, resume_fully_sharded, save_fully_sharded,
};
pub use record::{consolidated_record, load_fully_sharded};

/// A grouped collective's pending result.
type Pending = kolo::Handle<Vec<kolo::Tensor>>;

/// Numbers the units of a process in the order they are made: every rank makes them
/// in the same order (making one is collective), so the number names the unit's
/// collectives alike everywhere.
static UNITS: AtomicU64 = AtomicU64::new(0);

/// A sub-module whose parameters are sharded across the ranks: FSDP's wrapping unit.
///
/// Each rank keeps block `rank` of every float parameter of the wrapped module,
/// flattened (the same contiguous, element-balanced blocks as
/// [`ShardedOptimizer`](crate::ShardedOptimizer): the first `n % N` ranks hold one
/// element more), as a 1-D parameter **under the parameter's own id and module
/// path**. A plain Burn optimizer steps these blocks, so its state is 1/N of the
/// whole by construction, and a model made of units is trained by the usual loop:
///
/// ```no_run
/// # use burn::module::Module;
/// # use burn::nn::{Linear, LinearConfig, Relu};
/// # use burn::tensor::{Device, Tensor};
/// use kolo_burn::FullyShard;
/// #[derive(Module, Debug)]
/// struct Mlp {
///     fc1: FullyShard<Linear>,
///     fc2: FullyShard<Linear>,
/// }
/// impl Mlp {
///     fn new(kolo: &kolo::Kolo, device: &Device) -> kolo_burn::Result<Self> {
///         // Built unit by unit: no rank holds the whole model at once.
///         Ok(Mlp {
///             fc1: FullyShard::new(kolo, LinearConfig::new(784, 512).init(device))?,
///             fc2: FullyShard::new(kolo, LinearConfig::new(512, 10).init(device))?,
///         })
///     }
///     fn forward(&self, x: Tensor<2>) -> Tensor<2> {
///         // The activation inside the unit: fc2 takes fc1's output as it is, so
///         // their communication overlaps in backward (see Overlap below).
///         let h = self.fc1.forward(x, |l, x| Relu::new().forward(l.forward(x)));
///         self.fc2.forward(h, |l, x| l.forward(x))
///     }
/// }
/// // the loop is plain Burn: backward, GradientsParams::from_grads, optim.step
/// ```
///
/// **Forward.** [`forward`](Self::forward) all-gathers the unit's blocks (one grouped
/// collective), rebuilds the wrapped module with the whole parameters, runs the given
/// function on it and drops the gathered copy (`reshard_after_forward`, the default).
/// The unit is one autodiff op: its **backward** gathers the parameters again,
/// recomputes the unit's forward under autodiff (the unit is checkpointed, so neither
/// its gathered parameters nor its activations are held between forward and
/// backward), takes the gradients of the parameters and of the input, and
/// reduce-scatters the parameters' gradients as one group (Average by default): this
/// rank's parameter blocks receive the averaged gradient of their elements, and the
/// input's gradient flows on to the earlier units. With
/// [`reshard_after_forward(false)`](Self::reshard_after_forward) the gathered
/// parameters and the unit's autodiff graph are kept from forward to backward
/// instead: no second gather and no recomputation, at the memory of an unsharded
/// unit.
///
/// **Overlap.** When a unit's output is the next unit's input as it is (a
/// transformer's blocks; layers with their activation inside the closure, as
/// `fc1.forward(x, |l, x| relu(l.forward(x)))`), the two are linked: the later
/// unit's backward submits the earlier one's all-gather before recomputing (FSDP's
/// backward prefetch, [`backward_prefetch`](Self::backward_prefetch)), and submits
/// its own gradients' reduce-scatter without waiting for it: the earlier unit's
/// backward, certain to run later in the same pass, waits for it after submitting its
/// own. [`forward_prefetch`](Self::forward_prefetch) also submits the next unit's
/// all-gather during a unit's forward. A unit whose input comes from anything else
/// (an activation outside the units, a residual sum) waits for its own collectives.
///
/// **Frozen parameters** (`require_grad = false`) are gathered and used, never
/// reduced, and a plain optimizer does not step them. Gradients must not be reduced
/// again (no [`GradientReducer`](crate::GradientReducer)): they arrive averaged.
///
/// **Start.** [`new`](Self::new) makes every rank's unit equal to rank 0's (as
/// [`broadcast_parameters`](crate::broadcast_parameters)) and checks that the ranks'
/// units have the same parameters, failing on every rank naming the first that
/// differs.
///
/// **Checkpoints.** [`consolidated_record`] gives the whole model's record as a plain
/// unsharded Burn model of the same structure holds it (each unit's parameters
/// gathered), and [`load_fully_sharded`] loads such a record into a model of units at
/// any number of ranks.
///
/// **Mixed precision and offload.** [`compute_dtype`](Self::compute_dtype) computes
/// the unit in bf16 or f16 over f32 blocks; [`offload`](Self::offload) keeps the
/// blocks and the optimizer's state on the host while the unit computes on its
/// device.
///
/// **Backends.** Training (an autodiff device) needs Burn's CPU backend (`Flex`) or,
/// with the `cuda`/`cpu` feature, its CubeCL backend; on other backends
/// [`try_forward`](Self::try_forward) fails saying so. Without autodiff (evaluation,
/// `valid()`) every backend works: the parameters are gathered and the module run.
///
/// **Failures.** `forward` panics when a collective fails (a rank left), naming the
/// unit; so does the backward pass, which cannot return an error (as
/// [`SyncBatchNorm`](crate::SyncBatchNorm)); kolo's panic hook ends the job with the
/// message. Use [`try_forward`](Self::try_forward) to handle a failed forward.
pub struct FullyShard<M: Module> {
    shard: Shard,
    /// The generation of `shard` (see `ahead`).
    generation: u64,
    unit: Arc<Unit<M>>,
    settings: Settings,
}

/// What every copy of a unit shares.
struct Unit<M> {
    kolo: Kolo,
    /// The prefix of the unit's collective names: `kolo_burn.fsdp.<n>`.
    name: String,
    /// The wrapped module with each float parameter replaced by one element: its
    /// structure, settings and non-float state, filled with whole parameters to run.
    /// (A mutex: a module need not be `Sync`; it is only cloned.)
    skeleton: Mutex<M>,
    /// Each float parameter's whole shape and dtype, in module order.
    params: Vec<Full>,
    /// Forward prefetch: the latest blocks, the next unit, what was prefetched.
    ahead: ahead::Ahead,
}

impl<M> Unit<M> {
    /// Submits the all-gather of `shard`'s blocks.
    fn start_gather(&self, shard: &Shard) -> Result<kolo::Handle<Vec<kolo::Tensor>>> {
        let copied = convert::Copied::default();
        let members = shard
            .pieces
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let name = format!("{}.{i}.value", self.name);
                let t = convert::on_host(convert::to_kolo(&name, p.param.val().inner(), &copied)?)?;
                Ok((name, t))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self.kolo.grouped_allgather(members).submit()?)
    }
}

impl<M: Module> ahead::Prefetch for Unit<M> {
    fn prefetch(&self) {
        if let Some((generation, shard)) = self.ahead.to_prefetch() {
            self.ahead.keep(generation, self.start_gather(&shard));
        }
    }

    fn then(&self, next: std::sync::Weak<dyn ahead::Prefetch>) {
        self.ahead.then(next);
    }
}

/// A parameter's whole shape and dtype.
#[derive(Clone, Debug)]
pub(crate) struct Full {
    pub(crate) dims: Vec<usize>,
    pub(crate) dtype: DType,
}

impl Full {
    pub(crate) fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

/// How the unit runs.
#[derive(Clone, Debug)]
struct Settings {
    /// Drop the gathered parameters after forward (gather again in backward).
    reshard: bool,
    /// Backward passes summed into a step's gradients (each reduce-scatter divides by it).
    passes: usize,
    op: ReduceOp,
    /// The float type the wrapped module computes in (its parameters and input cast
    /// to it; its output cast back); `None`: the parameters' own.
    compute: Option<FloatDType>,
    /// Where the unit computes when its blocks are offloaded to another device
    /// ([`FullyShard::offload`]); `None`: on the blocks' device.
    compute_device: Option<Device>,
    /// Submit the next unit's all-gather during this unit's forward.
    forward_prefetch: bool,
    /// Let the next unit's backward submit this unit's all-gather.
    backward_prefetch: bool,
}

impl<M: Module> Clone for FullyShard<M> {
    fn clone(&self) -> Self {
        FullyShard {
            shard: self.shard.clone(),
            generation: self.generation,
            unit: Arc::clone(&self.unit),
            settings: self.settings.clone(),
        }
    }
}

impl<M: Module> std::fmt::Debug for FullyShard<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShard")
            .field("unit", &self.unit.name)
            .field("params", &self.unit.params)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<M: Module> FullyShard<M> {
    /// Shards `module` (the same module on every rank; rank 0's values are taken):
    /// keeps this rank's block of each float parameter and drops the rest. Collective:
    /// every rank makes the same units in the same order.
    ///
    /// # Errors
    /// [`Error::ModelMismatch`] on every rank when the ranks' modules have different
    /// parameters (naming the first); [`Error::InvalidArgument`] for a module without
    /// float parameters; [`Error::Data`] for a parameter kolo cannot move (not a float
    /// dtype); a failed broadcast ([`Error::Kolo`], [`Error::Record`]).
    pub fn new(kolo: &Kolo, module: M) -> Result<Self> {
        let n = UNITS.fetch_add(1, Ordering::Relaxed);
        let name = format!("kolo_burn.fsdp.{n}");
        crate::layout::agree_module(&module, kolo, &format!("{name}.layout"))?;
        let module = crate::broadcast_parameters(kolo, module, 0)?;
        let mut take = Take {
            path: Vec::new(),
            size: kolo.size(),
            rank: kolo.rank(),
            pieces: Vec::new(),
            params: Vec::new(),
            error: None,
        };
        let skeleton = module.map(&mut take);
        if let Some(e) = take.error {
            return Err(e);
        }
        if take.params.is_empty() {
            return Err(Error::InvalidArgument {
                what: "FullyShard::new",
                message: "the module has no float parameters to shard".into(),
            });
        }
        for (p, full) in take.pieces.iter().zip(&take.params) {
            record::register(p.param.id, full.clone());
        }
        let shard = Shard {
            pieces: take.pieces,
        };
        let ahead = ahead::Ahead::default();
        let generation = ahead.renew(&shard);
        Ok(FullyShard {
            shard,
            generation,
            unit: Arc::new(Unit {
                kolo: kolo.clone(),
                name,
                skeleton: Mutex::new(skeleton),
                params: take.params,
                ahead,
            }),
            settings: Settings {
                reshard: true,
                passes: 1,
                op: ReduceOp::Average,
                compute: None,
                compute_device: None,
                forward_prefetch: false,
                backward_prefetch: true,
            },
        })
    }

    /// Whether the gathered parameters are dropped after forward and gathered again
    /// in backward (`true`, the default: the memory of the unit's block only between
    /// forward and backward, at the cost of a second all-gather and of recomputing the
    /// unit's forward) or kept until backward (`false`, FSDP's
    /// `reshard_after_forward=False`).
    pub fn reshard_after_forward(mut self, reshard: bool) -> Self {
        self.settings.reshard = reshard;
        self
    }

    /// Forward prefetch (FSDP's `forward_prefetch`; default off, as there): this
    /// unit's forward submits the all-gather of the unit that ran after it in the
    /// previous training step, which the engine then runs while this unit computes.
    /// Costs the memory of that unit's gathered parameters for the time.
    pub fn forward_prefetch(mut self, on: bool) -> Self {
        self.settings.forward_prefetch = on;
        self
    }

    /// Backward prefetch (FSDP's `BACKWARD_PRE`; default on): when this unit's output
    /// is the next unit's input as it is, the next unit's backward submits this
    /// unit's all-gather before recomputing, and this unit's backward finds it done.
    /// (Either way the next unit's reduce-scatter is then waited for by this unit's
    /// backward, not its own.) Off: one unit's parameters gathered at a time.
    pub fn backward_prefetch(mut self, on: bool) -> Self {
        self.settings.backward_prefetch = on;
        self
    }

    /// The gradients of a step are the sum of `passes` backward passes (accumulated,
    /// e.g. with Burn's `GradientsAccumulator`): each reduce-scatter divides by it, as
    /// [`GradientReducer::backward_passes_per_step`](crate::GradientReducer::backward_passes_per_step).
    pub fn backward_passes_per_step(mut self, passes: usize) -> Self {
        self.settings.passes = passes.max(1);
        self
    }

    /// [`ReduceOp::Average`] (default) or [`ReduceOp::Sum`] of the gradients.
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.settings.op = op;
        self
    }

    /// Mixed precision: the wrapped module computes in `dtype` (bf16 or f16; f32 to
    /// turn it off) — the gathered parameters and the input are cast to it and the
    /// output back to the input's type — while the blocks (the master weights the
    /// optimizer steps, and its state) stay in the parameters' own type, and the
    /// gradients are reduce-scattered in it (f32 for f32 parameters). f16 gradients
    /// can underflow: scale the loss (e.g. by 2^16, dividing the learning rate or the
    /// gradients back) or prefer bf16.
    pub fn compute_dtype(mut self, dtype: FloatDType) -> Self {
        self.settings.compute = Some(dtype);
        self
    }

    /// Offloading (DeepSpeed's `offload_param` and `offload_optimizer`, ZeRO-Offload):
    /// keeps this rank's blocks — and so the optimizer's state for them, and its step —
    /// on `host` (e.g. `Device::flex()`, Burn's CPU backend; made an autodiff device
    /// when the unit trains), while the unit computes on the device it was made on
    /// (e.g. a GPU): the gathered parameters are made there for each forward and
    /// backward, and the blocks' averaged gradients come back to `host`. Call it after
    /// moving the model (`to_device` moves the blocks).
    pub fn offload(mut self, host: &Device) -> Self {
        let compute = self.compute_device();
        let host = if compute.is_autodiff() {
            host.clone().autodiff()
        } else {
            host.clone()
        };
        // A fresh leaf on the host, still requiring its gradient.
        self.shard = self.shard.fork(&host);
        self.generation = self.unit.ahead.renew(&self.shard);
        self.settings.compute_device = (host != compute).then_some(compute);
        self
    }

    /// The elements of each float parameter (flattened, in module order) this rank
    /// holds.
    pub fn shard(&self) -> Vec<std::ops::Range<usize>> {
        let (size, rank) = (self.unit.kolo.size(), self.unit.kolo.rank());
        self.unit
            .params
            .iter()
            .map(|p| range_of(p.numel(), size, rank))
            .collect()
    }

    /// The wrapped module with its whole parameters, gathered from every rank (each
    /// keeping its id): collective, every rank calls it.
    ///
    /// # Errors
    /// The all-gather failed ([`Error::Kolo`]) or a block cannot be moved
    /// ([`Error::Data`]).
    pub fn gathered(&self) -> Result<M> {
        let device = self.compute_device();
        let whole = self.gather(&device)?;
        Ok(self.rebuild(whole))
    }

    /// Runs `f` on the wrapped module with its whole parameters and `input` (see the
    /// type's docs); panics when a collective fails. `f` is called again in backward
    /// (with autodiff) unless [`reshard_after_forward(false)`](Self::reshard_after_forward).
    pub fn forward<const I: usize, const O: usize, F>(&self, input: Tensor<I>, f: F) -> Tensor<O>
    where
        F: Fn(&M, Tensor<I>) -> Tensor<O> + Send + Sync + 'static,
        M: 'static,
    {
        match self.try_forward(input, f) {
            Ok(t) => t,
            Err(e) => panic!("kolo_burn::FullyShard {}: {e}", self.unit.name),
        }
    }

    /// [`forward`](Self::forward), returning an error instead of panicking.
    ///
    /// # Errors
    /// The all-gather failed ([`Error::Kolo`]); training on a backend the unit cannot
    /// hook ([`Error::InvalidArgument`]).
    pub fn try_forward<const I: usize, const O: usize, F>(
        &self,
        input: Tensor<I>,
        f: F,
    ) -> Result<Tensor<O>>
    where
        F: Fn(&M, Tensor<I>) -> Tensor<O> + Send + Sync + 'static,
        M: 'static,
    {
        let device = self.compute_device();
        let trainable = self.trainable();
        let tracked = input.is_autodiff() && input.is_tracked();
        if !device.is_autodiff() || (trainable.is_empty() && !tracked) {
            // Nothing to differentiate here: gather and run.
            let whole = self.forward_gather(&device)?;
            return Ok(self.apply(&f, whole, input));
        }
        op::run(self, input, f, trainable)
    }

    /// Indices of the parameters that train (require a gradient).
    fn trainable(&self) -> Vec<usize> {
        self.shard
            .pieces
            .iter()
            .enumerate()
            .filter(|(_, p)| trains(&p.param) && p.param.val().device().is_autodiff())
            .map(|(i, _)| i)
            .collect()
    }

    /// The device of the blocks.
    fn device(&self) -> Device {
        self.shard.pieces[0].param.lazy_device()
    }

    /// The device the unit computes on: the blocks', unless they are offloaded.
    fn compute_device(&self) -> Device {
        self.settings
            .compute_device
            .clone()
            .unwrap_or_else(|| self.device())
    }

    /// Every parameter whole, flattened, on `device` without autodiff: one grouped
    /// all-gather of this rank's blocks.
    fn gather(&self, device: &Device) -> Result<Vec<Tensor<1>>> {
        let all = self.start_gather()?.wait()?;
        self.finish_gather(all, device)
    }

    /// Submits the all-gather of this rank's blocks (their values now).
    fn start_gather(&self) -> Result<kolo::Handle<Vec<kolo::Tensor>>> {
        self.unit.start_gather(&self.shard)
    }

    /// [`gather`](Self::gather) in a forward pass: takes the all-gather prefetched
    /// for these blocks, if any, and prefetches the next unit's.
    fn forward_gather(&self, device: &Device) -> Result<Vec<Tensor<1>>> {
        let own = match self.unit.ahead.take(self.generation) {
            Some(gather) => gather?,
            None => self.start_gather()?,
        };
        if self.settings.forward_prefetch {
            if let Some(next) = self.unit.ahead.next() {
                next.prefetch();
            }
        }
        let all = own.wait()?;
        self.finish_gather(all, device)
    }

    /// The whole parameters on `device` from a finished all-gather.
    fn finish_gather(&self, all: Vec<kolo::Tensor>, device: &Device) -> Result<Vec<Tensor<1>>> {
        let inner = device.clone().inner();
        all.into_iter()
            .zip(&self.unit.params)
            .enumerate()
            .map(|(i, (t, full))| {
                let name = format!("{}.{i}.value", self.unit.name);
                convert::to_burn::<1>(&name, t, full.dtype, &inner).map(|t| on(t, &inner))
            })
            .collect()
    }

    /// `f` on the wrapped module holding `whole` and on `x`, in the compute dtype (see
    /// [`compute_dtype`](Self::compute_dtype)).
    fn apply<const I: usize, const O: usize>(
        &self,
        f: &dyn Fn(&M, Tensor<I>) -> Tensor<O>,
        whole: Vec<Tensor<1>>,
        x: Tensor<I>,
    ) -> Tensor<O> {
        match self.settings.compute {
            Some(dtype) => {
                let back = x.dtype();
                let whole = whole.into_iter().map(|t| t.cast(dtype)).collect();
                f(&self.rebuild(whole), x.cast(dtype)).cast(back)
            }
            None => f(&self.rebuild(whole), x),
        }
    }

    /// The wrapped module holding `whole` (flattened parameters, in module order),
    /// each parameter under its block's id.
    fn rebuild(&self, whole: Vec<Tensor<1>>) -> M {
        let skeleton = self
            .unit
            .skeleton
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        skeleton.map(&mut Fill {
            whole: whole.into_iter(),
            params: &self.unit.params,
            ids: self.shard.pieces.iter().map(|p| p.param.id).collect(),
            next: 0,
        })
    }
}
