//! The bucketed path: every gradient of a step reduced in a few grouped collectives,
//! in the gradients' own memory.

use std::sync::{Arc, Mutex, PoisonError};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use kolo::{Kolo, ReduceOp};

use crate::convert::{self, Copied};
use crate::error::{Error, Result};
use crate::layout::{trains, Layout};

mod settle;

/// Reduces all gradients of a step across ranks, then hands them back in a
/// [`GradientsParams`] for Burn's optimizer.
///
/// The first call learns the model's gradient layout (parameters in module order,
/// shapes, dtypes) and checks that every rank has the same one; later calls reuse it
/// and only check that the model has not changed. Gradients are grouped into buckets of
/// at most [`chunk_bytes`](Self::chunk_bytes) in the order backward produces them
/// (last layer first), each bucket one `grouped_allreduce` under stable names, all
/// buckets in flight at once, so kolo's response cache serves every step after the
/// first.
///
/// **Copies.** On Burn's CPU backend a gradient's buffer is handed to kolo as it is,
/// reduced in place and becomes the new gradient tensor: no copy and no allocation the
/// size of the model per step. Small gradients (≤ 64 KiB) of a bucket are packed into
/// kolo's persistent fusion buffer and copied back; a buffer Burn cannot give up is
/// copied once on the way in ([`copied_bytes`](Self::copied_bytes) counts those).
/// f16 and bf16 gradients travel as 2-byte values, f64 as f64.
///
/// **Frozen parameters** (`require_grad = false`: `no_grad()`, `freeze()`, LoRA's
/// base weights) are not reduced and get no gradient, as plain Burn leaves them: the
/// optimizer never steps them or keeps state for them. A parameter without a gradient
/// on this rank contributes zeros, so ranks whose graph skipped a parameter still take
/// part; one that no rank has a gradient for in a step gets none in the result (plain
/// Burn's optimizer then skips it, so weight decay and momentum do not move it). A
/// step fails on every rank or on none: a rank
/// that cannot hand a gradient over still takes part, and one tiny collective per step
/// (beside the buckets) tells every rank whether any failed.
///
/// Use it between `backward` and `ModuleOptimizer::step` in a hand-written loop, or
/// from an overridden `TrainStep::optimize` in burn-train's Learner. Clones share the
/// learned layout: use one reducer (or its clones) per model.
///
/// # Shutdown
/// Each reducer holds a [`Kolo`] clone, which keeps kolo's engine running until the
/// last clone is dropped or `shutdown` is called.
#[derive(Debug, Clone)]
pub struct GradientReducer {
    kolo: Kolo,
    op: ReduceOp,
    bucket_bytes: usize,
    prefix: String,
    passes: usize,
    shared: Arc<Shared>,
    /// Why the process set given refuses this rank.
    refused: Option<String>,
    /// Reduce-scatters each gradient, flattened, instead of all-reducing it: this rank
    /// gets its block of every gradient (the sharded optimizer's overlap).
    scatter: bool,
    /// How the buckets are reduced.
    pub(crate) algorithm: kolo::Algorithm,
    /// ByteGrad leaves traffic within a host uncompressed (Bagua's `hierarchical`).
    hierarchical: bool,
}

#[derive(Debug, Default)]
struct Shared {
    layout: Mutex<Option<Arc<Layout>>>,
    copied: Copied,
}

/// The default bucket size, as PyTorch DDP's `bucket_cap_mb`.
const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

impl GradientReducer {
    /// Averages gradients across all ranks in buckets of 25 MiB.
    pub fn new(kolo: &Kolo) -> Self {
        GradientReducer {
            kolo: kolo.clone(),
            op: ReduceOp::Average,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            prefix: "kolo_burn.grads".into(),
            passes: 1,
            shared: Arc::default(),
            refused: None,
            scatter: false,
            algorithm: kolo::Algorithm::Allreduce,
            hierarchical: true,
        }
    }

    /// How gradients are reduced (issue 57): [`Algorithm::Allreduce`](kolo::Algorithm)
    /// (the default), [`ByteGrad`](kolo::Algorithm::ByteGrad) (8-bit on the wire,
    /// about a quarter of the bytes) or [`Adasum`](kolo::Algorithm::Adasum); each
    /// bucket (f32 gradients) goes through kolo's algorithm as one flat buffer.
    /// [`Decentralized`](kolo::Algorithm::Decentralized) exchanges weights, not
    /// gradients: `reduce` then fails saying to use
    /// [`decentralized_average`](crate::decentralized_average) after the step. The
    /// ranks' choices are checked against each other when the layout is learned.
    pub fn algorithm(mut self, algorithm: kolo::Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Whether ByteGrad compresses only what crosses hosts (`true`, the default, as
    /// Bagua's `hierarchical=True`): on a job whose ranks share one host it then reduces
    /// in full precision, as shared memory moves f32 faster than 8 bits can be made.
    /// Across hosts every rank compresses (a reduction within each host first is not
    /// built yet). `false` compresses on one host too (tests, emulated hosts).
    pub fn hierarchical(mut self, on: bool) -> Self {
        self.hierarchical = on;
        self
    }

    /// The algorithm this job runs: ByteGrad on one host, hierarchical, is allreduce.
    fn effective_algorithm(&self) -> kolo::Algorithm {
        let one_host = self.kolo.cross_size() == 1;
        match self.algorithm {
            kolo::Algorithm::ByteGrad if self.hierarchical && one_host => {
                kolo::Algorithm::Allreduce
            }
            a => a,
        }
    }

    /// A reducer that leaves each rank its block of every gradient, flattened (the
    /// first `n % N` ranks one element more), instead of the whole average: what
    /// [`ShardedOptimizer`](crate::ShardedOptimizer) steps.
    pub(crate) fn scattering(mut self) -> Self {
        self.scatter = true;
        self
    }

    /// Reduces among the ranks of `set` only (Horovod's `process_set=`): Average
    /// divides by the set's size. On a rank outside the set, `reduce` fails naming the
    /// rank and the set.
    pub fn process_set(mut self, set: &kolo::ProcessSet) -> Self {
        match in_set(&self.kolo, set, "reduce in it") {
            Ok(k) => self.kolo = k,
            Err(why) => self.refused = Some(why),
        }
        self
    }

    /// [`ReduceOp::Average`] (default) or [`ReduceOp::Sum`].
    pub fn op(mut self, op: ReduceOp) -> Self {
        self.op = op;
        self
    }

    /// The gradients handed to [`reduce`](Self::reduce) are the sum of `passes`
    /// backward passes (accumulated locally, e.g. with Burn's `GradientsAccumulator`):
    /// they are divided by `passes`, so that with a mean loss `n` passes over batches
    /// of `b` equal one pass over `n·b` — one reduction per `n` passes.
    ///
    /// **Differs from Horovod:** Horovod's PyTorch `DistributedOptimizer` does not
    /// divide: its gradients after `backward_passes_per_step` passes are the sum of the
    /// passes. For that behaviour leave this at 1 and hand `reduce` the accumulated sum.
    pub fn backward_passes_per_step(mut self, passes: usize) -> Self {
        self.passes = passes.max(1);
        self
    }

    /// Largest bucket in bytes (default 25 MiB, as PyTorch DDP). A gradient larger than
    /// this is a bucket of its own. A size of 0 makes [`reduce`](Self::reduce) fail.
    pub fn chunk_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Names the collectives `<prefix>.<parameter path>`: give two reducers that run
    /// concurrently different prefixes.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Bytes of gradient data this reducer (and its clones) had to copy because Burn
    /// could not hand a buffer over; 0 on Burn's CPU backend for uniquely owned
    /// gradients. For diagnostics and tests.
    pub fn copied_bytes(&self) -> u64 {
        self.shared.copied.get()
    }

    /// Takes every gradient of `module` out of `grads`, reduces them across ranks and
    /// returns them registered under the same parameter ids.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`]: a bucket size of 0, or a module with no float
    ///   parameters;
    /// - [`Error::ModelMismatch`] on every rank when the ranks' models differ (checked
    ///   when the layout is learned), naming the parameter and what each rank has;
    /// - [`Error::Data`]: a parameter of a dtype kolo cannot reduce (on every rank, when
    ///   the layout is learned), or a gradient this rank cannot hand over (e.g. a
    ///   quantized gradient): this rank still takes part in the step with zeros in its
    ///   place, and every other rank fails the step with [`Error::OtherRank`] naming
    ///   this rank and the cause, so nobody waits and nobody steps alone;
    /// - [`Error::Kolo`]: a failed collective (a rank that left, …).
    pub fn reduce<M: Module>(&self, module: &M, grads: GradientsParams) -> Result<GradientsParams> {
        let r = self.reduce_slots(module, grads)?;
        self.give(&r.layout, module, r.slots, &r.devices)
    }

    /// [`reduce`](Self::reduce) up to the reduced gradients, by slot, as kolo tensors
    /// (each rank's blocks when the reducer scatters), with the layout and each
    /// gradient's device.
    pub(crate) fn reduce_slots<M: Module>(
        &self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<Reduced> {
        let layout = self.layout_of(module)?;
        let mut take = Take {
            grads: &mut grads,
            layout: &layout,
            copied: &self.shared.copied,
            tensors: Vec::with_capacity(layout.slots.len()),
            devices: Vec::with_capacity(layout.slots.len()),
            present: Vec::with_capacity(layout.slots.len()),
            error: None,
        };
        module.visit(&mut take);
        let Take {
            tensors,
            devices,
            present,
            error,
            ..
        } = take;
        let slots = self.allreduce(&layout, tensors, error, &present)?;
        Ok(Reduced {
            layout,
            slots,
            devices,
        })
    }

    /// The reduced gradients, by slot, as Burn tensors registered under `module`'s
    /// parameter ids.
    pub(crate) fn give<M: Module>(
        &self,
        layout: &Layout,
        module: &M,
        reduced: Vec<Option<kolo::Tensor>>,
        devices: &[Device],
    ) -> Result<GradientsParams> {
        let mut out = GradientsParams::new();
        let mut give = Give {
            layout,
            reduced,
            devices,
            next: 0,
            out: &mut out,
            error: None,
        };
        module.visit(&mut give);
        match give.error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// The largest bucket, in bytes.
    pub(crate) fn bucket_bytes(&self) -> usize {
        self.bucket_bytes
    }

    /// The counter of copied gradient bytes.
    pub(crate) fn copied(&self) -> &Copied {
        &self.shared.copied
    }

    /// Submits bucket `b` of `layout`, taking its members out of `tensors`.
    pub(crate) fn submit_bucket(
        &self,
        layout: &Layout,
        b: usize,
        tensors: &mut [Option<kolo::Tensor>],
    ) -> Result<kolo::Handle<Vec<kolo::Tensor>>> {
        let members: Vec<(String, kolo::Tensor)> = layout.buckets[b]
            .iter()
            .filter_map(|&i| Some((layout.names[i].clone(), tensors[i].take()?)))
            .collect();
        let prescale = 1.0 / self.passes as f64;
        if !self.scatter {
            return Ok(self
                .kolo
                .grouped_allreduce(members)
                .op(self.op)
                .prescale(prescale)
                .submit()?);
        }
        // Flattened, so that each rank gets a block of elements, not of rows; on the
        // host, where grouped reduce-scatters run.
        let members = members
            .into_iter()
            .map(|(name, t)| {
                let mut t = crate::convert::on_host(t)?;
                t.reshape(&[t.len()])?;
                Ok((name, t))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self
            .kolo
            .grouped_reducescatter(members)
            .op(self.op)
            .prescale(prescale)
            .submit()?)
    }

    /// The layout of `module`, learned (and agreed by all ranks) on first use or when
    /// the module or the bucket size changed.
    pub(crate) fn layout_of<M: Module>(&self, module: &M) -> Result<Arc<Layout>> {
        if let Some(message) = &self.refused {
            return Err(Error::InvalidArgument {
                what: "GradientReducer::process_set",
                message: message.clone(),
            });
        }
        if self.bucket_bytes == 0 {
            return Err(Error::InvalidArgument {
                what: "GradientReducer::chunk_bytes",
                message: "a bucket size of 0 bytes holds no gradient; use at least the largest \
                          gradient's size, or leave the default (25 MiB)"
                    .into(),
            });
        }
        let mut slot = self
            .shared
            .layout
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = slot.as_ref().filter(|l| l.fits(module, self.bucket_bytes)) {
            return Ok(Arc::clone(l));
        }
        let layout = Arc::new(Layout::learn(
            module,
            &self.kolo,
            &self.prefix,
            self.bucket_bytes,
        )?);
        self.algorithm
            .agree(&self.kolo, &format!("{}.algorithm", self.prefix))?;
        *slot = Some(Arc::clone(&layout));
        Ok(layout)
    }

    /// Submits every bucket, then settles the step (see [`settle`](Self::settle)).
    fn allreduce(
        &self,
        layout: &Layout,
        mut tensors: Vec<Option<kolo::Tensor>>,
        local: Option<Error>,
        present: &[bool],
    ) -> Result<Vec<Option<kolo::Tensor>>> {
        let algorithm = self.effective_algorithm();
        crate::algorithm::reduces_gradients(algorithm)?;
        if algorithm != kolo::Algorithm::Allreduce && self.kolo.size() > 1 {
            let results = crate::algorithm::Reduce {
                kolo: &self.kolo,
                algorithm,
                op: self.op,
                passes: self.passes,
                prefix: &self.prefix,
            }
            .buckets(layout, tensors)?;
            let verdict = self.submit_verdict(local.is_some(), present);
            return self.conclude(layout, verdict, results, local, present);
        }
        let handles = (0..layout.buckets.len())
            .map(|b| self.submit_bucket(layout, b, &mut tensors))
            .collect::<Result<Vec<_>>>()?;
        self.settle(layout, handles, local, present)
    }
}

/// A parameter's gradient as a kolo tensor, and the device the reduced gradient goes
/// back to. Zeros stand in for a gradient this rank does not have (the caller records
/// that it had none), and for one it cannot convert (the error is returned beside
/// them: the rank must still take part).
pub(crate) fn as_kolo<const D: usize>(
    grad: Option<Tensor<D>>,
    param: &Param<Tensor<D>>,
    layout: &Layout,
    slot: usize,
    copied: &Copied,
) -> (Device, kolo::Tensor, Option<Error>) {
    let (s, wire) = (&layout.slots[slot], &layout.wires[slot]);
    match grad {
        Some(g) => {
            let device = g.device();
            match convert::to_kolo(&s.path, g, copied) {
                Ok(t) => (device, t, None),
                Err(e) => (device, wire.zeros(s), Some(e)),
            }
        }
        None => {
            let device = param.val().device().inner();
            // On a Cube device the zeros live where the other ranks' gradients do, so
            // that every rank hands kolo the same kind of tensor.
            #[cfg(any(feature = "cuda", feature = "cpu"))]
            if crate::cube::route(&device) != crate::cube::Route::Host {
                let zeros = param.val().inner().zeros_like();
                return match convert::to_kolo(&s.path, zeros, copied) {
                    Ok(t) => (device, t, None),
                    Err(e) => (device, wire.zeros(s), Some(e)),
                };
            }
            (device, wire.zeros(s), None)
        }
    }
}

/// A step's reduced gradients before they go back to Burn
/// ([`GradientReducer::reduce_slots`]).
pub(crate) struct Reduced {
    pub(crate) layout: Arc<Layout>,
    /// Each slot's reduced gradient (this rank's block of it when scattering).
    pub(crate) slots: Vec<Option<kolo::Tensor>>,
    /// The device each gradient came from.
    pub(crate) devices: Vec<Device>,
}

/// Takes each parameter's gradient (or zeros) as a kolo tensor, by slot.
struct Take<'a> {
    grads: &'a mut GradientsParams,
    layout: &'a Layout,
    copied: &'a Copied,
    tensors: Vec<Option<kolo::Tensor>>,
    devices: Vec<Device>,
    /// Whether this rank has each slot's gradient.
    present: Vec<bool>,
    error: Option<Error>,
}

impl ModuleVisitor for Take<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let slot = self.tensors.len();
        if slot >= self.layout.slots.len() || !trains(param) {
            return;
        }
        let grad = self.grads.remove::<D>(param.id);
        self.present.push(grad.is_some());
        let (device, t, error) = as_kolo(grad, param, self.layout, slot, self.copied);
        self.devices.push(device);
        self.tensors.push(Some(t));
        if let Some(e) = error {
            self.error.get_or_insert(e);
        }
    }
}

/// Registers each reduced gradient under its parameter's id.
struct Give<'a> {
    layout: &'a Layout,
    reduced: Vec<Option<kolo::Tensor>>,
    devices: &'a [Device],
    next: usize,
    out: &'a mut GradientsParams,
    error: Option<Error>,
}

impl ModuleVisitor for Give<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !trains(param) {
            return;
        }
        let i = self.next;
        self.next += 1;
        let (Some(slot), Some(t), Some(device)) = (
            self.layout.slots.get(i),
            self.reduced.get_mut(i).and_then(Option::take),
            self.devices.get(i),
        ) else {
            return;
        };
        match convert::to_burn::<D>(&slot.path, t, slot.dtype, device) {
            Ok(g) => self.out.register(param.id, g),
            Err(e) => {
                self.error.get_or_insert(e);
            }
        }
    }
}
/// `set`'s handle for this rank (`kolo`'s rank), or why this rank cannot `may` in it
/// (it is outside the set): the refusal kolo-burn's process-set options keep.
pub(crate) fn in_set(
    kolo: &Kolo,
    set: &kolo::ProcessSet,
    may: &str,
) -> std::result::Result<Kolo, String> {
    set.kolo().cloned().ok_or_else(|| {
        format!(
            "rank {} is not in process set {} (ranks {:?}); only its ranks may {may}",
            kolo.rank(),
            set.id(),
            set.ranks()
        )
    })
}
