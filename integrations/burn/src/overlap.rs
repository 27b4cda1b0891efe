//! Reducing gradients while backward is still running, as PyTorch DDP and Horovod do
//! with per-parameter hooks.
//!
//! Burn 0.22 has no gradient hook, and its autodiff tape runs by depth (deepest nodes
//! first), so an identity op placed on a parameter alone would run last. Instead
//! [`Overlap::layer`] gives the layer a copy of its parameters passed through an
//! identity op whose second (gradient-less) parent is the layer's input: that puts the
//! op one level below the layer's own ops, so Burn runs it right after the layer's
//! backward, when the parameter's gradient is complete. Its backward takes the
//! gradient out of the tape instead of passing it on, lends its buffer to kolo and,
//! once every gradient of a bucket has arrived, submits the bucket while backward goes
//! on with the earlier layers. [`Overlap::finish`] waits for the buckets and returns
//! the averaged gradients.
//!
//! Burn's CPU backend (`Flex`) under autodiff is hooked, and with the `cuda` or `cpu`
//! feature Burn's CubeCL backend (CUDA, the CPU runtime) too; on other backends
//! `layer` returns the layer unchanged (one `tracing` warning) and `finish` reduces
//! everything after backward, as [`GradientReducer::reduce`] does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Once, PoisonError};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use crate::convert;
use crate::error::{Error, Result};
use crate::grads::{as_kolo, GradientReducer};
use crate::layout::{trains, Layout};

/// One overlapped step of a [`GradientReducer`]: made by
/// [`GradientReducer::overlap`] before the forward pass, used by the forward pass
/// ([`layer`](Self::layer)) and consumed after backward ([`finish`](Self::finish)).
///
/// ```no_run
/// # use burn::module::Module;
/// # use burn::nn::{Linear, Relu};
/// # use burn::tensor::Tensor;
/// # use burn::optim::GradientsParams;
/// # #[derive(Module, Debug)] struct Mlp { fc1: Linear, act: Relu, fc2: Linear }
/// # fn demo(model: Mlp, x: Tensor<2>, reducer: kolo_burn::GradientReducer) -> kolo_burn::Result<()> {
/// let sync = reducer.overlap(&model)?;
/// // forward, each layer through `sync.layer(&layer, &input)`:
/// let h = sync.layer(&model.fc1, &x).forward(x);
/// let h = model.act.forward(h);
/// let out = sync.layer(&model.fc2, &h).forward(h);
/// // backward reduces fc2's gradients while it computes fc1's
/// let grads = GradientsParams::from_grads(out.sum().backward(), &model);
/// let grads = sync.finish(&model, grads)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Overlap {
    step: Arc<Step>,
}

/// What the hooks and `finish` share during one step.
#[derive(Debug)]
struct Step {
    reducer: GradientReducer,
    layout: Arc<Layout>,
    slot_of: HashMap<ParamId, usize>,
    bucket_of: Vec<usize>,
    state: Mutex<StepState>,
    /// Gradients of earlier micro-steps, added to this step's before reducing.
    accumulated: Mutex<Option<GradientsParams>>,
}

#[derive(Debug, Default)]
struct StepState {
    /// Each slot's gradient as a kolo tensor until its bucket is submitted.
    tensors: Vec<Option<kolo::Tensor>>,
    devices: Vec<Option<Device>>,
    /// Whether this rank had each slot's gradient (a hook's, or one `finish` found).
    present: Vec<bool>,
    /// How many gradients of each bucket have arrived.
    arrived: Vec<usize>,
    handles: Vec<Option<kolo::Handle<Vec<kolo::Tensor>>>>,
    /// Buckets submitted while backward was running.
    early: usize,
    error: Option<Error>,
}

impl GradientReducer {
    /// Starts an overlapped step for `model` (see [`Overlap`]): gradients are reduced
    /// during backward, bucket by bucket, as they become complete. The result equals
    /// [`reduce`](Self::reduce)'s.
    ///
    /// # Errors
    /// As [`reduce`](Self::reduce) when the layout is learned (first step, changed
    /// model): a bucket size of 0, no parameters, models that differ between ranks;
    /// [`Error::InvalidArgument`] for a reducer with another
    /// [`algorithm`](Self::algorithm) than allreduce (those run after backward, in
    /// `reduce`).
    pub fn overlap<M: Module>(&self, model: &M) -> Result<Overlap> {
        if self.algorithm != kolo::Algorithm::Allreduce {
            return Err(Error::InvalidArgument {
                what: "GradientReducer::overlap",
                message: format!(
                    "the {} algorithm reduces after backward, not during it: call reduce                      instead of overlap",
                    self.algorithm
                ),
            });
        }
        let layout = self.layout_of(model)?;
        let slot_of = layout
            .slots
            .iter()
            .enumerate()
            .map(|(i, s)| (s.id, i))
            .collect();
        let mut bucket_of = vec![0; layout.slots.len()];
        for (b, bucket) in layout.buckets.iter().enumerate() {
            for &i in bucket {
                bucket_of[i] = b;
            }
        }
        let n = layout.slots.len();
        let state = StepState {
            tensors: (0..n).map(|_| None).collect(),
            devices: vec![None; n],
            present: vec![false; n],
            arrived: vec![0; layout.buckets.len()],
            handles: (0..layout.buckets.len()).map(|_| None).collect(),
            early: 0,
            error: None,
        };
        Ok(Overlap {
            step: Arc::new(Step {
                reducer: self.clone(),
                layout,
                slot_of,
                bucket_of,
                state: Mutex::new(state),
                accumulated: Mutex::new(None),
            }),
        })
    }
}

impl Overlap {
    /// `module` (a layer of the model given to [`GradientReducer::overlap`]) with its
    /// parameters hooked so that their gradients are reduced as soon as backward has
    /// computed them; call its forward on `input`, the tensor given here. The returned
    /// copy shares the parameters' memory and ids; use it for this step only.
    ///
    /// A parameter that is not part of the model is left unhooked (and `finish`
    /// reports it); so is every parameter on a backend other than Burn's CPU backend
    /// under autodiff.
    pub fn layer<M: Module, const I: usize>(&self, module: &M, input: &Tensor<I>) -> M {
        let anchor = input.clone();
        module.clone().map(&mut Hooker {
            step: &self.step,
            anchor: &anchor,
        })
    }

    /// Gradient accumulation: `earlier` is the sum of the step's earlier micro-steps
    /// (e.g. `GradientsAccumulator::grads()`, run without `Overlap`, so they
    /// communicate nothing); each gradient of this last micro-step is added to it
    /// before being reduced. Set [`GradientReducer::backward_passes_per_step`] to the
    /// number of micro-steps to average them.
    pub fn accumulated(self, earlier: GradientsParams) -> Self {
        *self.step.earlier() = Some(earlier);
        self
    }

    /// Buckets submitted while backward was still running (so far). For diagnostics.
    pub fn early_buckets(&self) -> usize {
        self.step.lock().early
    }

    /// After backward: reduces the gradients no hook has taken (layers not passed
    /// through [`layer`](Self::layer), parameters without a gradient on this rank:
    /// zeros), waits for every bucket and returns the averaged gradients of `model`.
    ///
    /// # Errors
    /// A hook or collective failed ([`Error::Kolo`], [`Error::Data`]), a layer given to
    /// [`layer`](Self::layer) is not part of the model or was hooked twice, or `model`
    /// is not the model the step was made for ([`Error::InvalidArgument`]). Such a
    /// failure on one rank fails the step on every rank: the failing rank still submits
    /// every bucket, and the others return [`Error::OtherRank`] naming it and the cause
    /// (as [`GradientReducer::reduce`]).
    pub fn finish<M: Module>(self, model: &M, grads: GradientsParams) -> Result<GradientsParams> {
        let reducer = self.step.reducer.clone();
        let layout = Arc::clone(&self.step.layout);
        let (reduced, devices) = self.settle(model, grads)?;
        reducer.give(&layout, model, reduced, &devices)
    }

    /// [`finish`](Self::finish) up to the reduced gradients, by slot, as kolo tensors
    /// (each rank's blocks when the reducer scatters), and the device of each.
    pub(crate) fn settle<M: Module>(
        self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<(Vec<Option<kolo::Tensor>>, Vec<Device>)> {
        let step = &self.step;
        let (reducer, layout) = (&step.reducer, &step.layout);
        let mut state = step.lock();
        // A failure on this rank (here or in a hook) does not return before the
        // buckets are submitted: `settle` makes the step fail on every rank instead.
        let mut local = state.error.take();
        if layout.fits(model, reducer.bucket_bytes()) {
            let mut earlier = step.earlier().take();
            let mut rest = Rest {
                grads: &mut grads,
                earlier: earlier.as_mut(),
                layout,
                state: &mut state,
                reducer,
                next: 0,
                error: None,
            };
            model.visit(&mut rest);
            if let Some(e) = rest.error {
                local.get_or_insert(e);
            }
        } else {
            local.get_or_insert(Error::InvalidArgument {
                what: "Overlap::finish",
                message: "the model differs from the one given to GradientReducer::overlap".into(),
            });
        }
        // Buckets the hooks submitted, and the rest now; zeros for any slot nothing
        // filled (a model that does not fit), so that this rank submits every bucket.
        let st = &mut *state;
        for (b, bucket) in layout.buckets.iter().enumerate() {
            if st.handles[b].is_some() {
                continue;
            }
            for &i in bucket {
                let zeros = || layout.wires[i].zeros(&layout.slots[i]);
                st.tensors[i].get_or_insert_with(zeros);
            }
        }
        let handles = (0..layout.buckets.len())
            .map(|b| match st.handles[b].take() {
                Some(h) => Ok(h),
                None => reducer.submit_bucket(layout, b, &mut st.tensors),
            })
            .collect::<Result<Vec<_>>>()?;
        let devices: Vec<Device> = state
            .devices
            .iter()
            .map(|d| d.clone().unwrap_or_default())
            .collect();
        let present = std::mem::take(&mut state.present);
        drop(state);
        Ok((reducer.settle(layout, handles, local, &present)?, devices))
    }
}

impl Step {
    fn lock(&self) -> std::sync::MutexGuard<'_, StepState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The sum of the step's earlier micro-steps, if given.
    fn earlier(&self) -> std::sync::MutexGuard<'_, Option<GradientsParams>> {
        self.accumulated
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Takes the gradients no hook has taken (or zeros), by slot.
struct Rest<'a, 'b> {
    grads: &'a mut GradientsParams,
    earlier: Option<&'a mut GradientsParams>,
    layout: &'a Layout,
    state: &'a mut std::sync::MutexGuard<'b, StepState>,
    reducer: &'a GradientReducer,
    next: usize,
    error: Option<Error>,
}

impl ModuleVisitor for Rest<'_, '_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !trains(param) {
            return;
        }
        let i = self.next;
        self.next += 1;
        if i >= self.layout.slots.len() || self.state.devices[i].is_some() {
            return; // a hook took it
        }
        let earlier = self.earlier.as_mut().and_then(|e| e.remove::<D>(param.id));
        let grad = match (self.grads.remove::<D>(param.id), earlier) {
            (Some(g), Some(e)) => Some(g + e),
            (g, e) => g.or(e),
        };
        self.state.present[i] = grad.is_some();
        let (device, t, error) = as_kolo(grad, param, self.layout, i, self.reducer.copied());
        self.state.devices[i] = Some(device);
        self.state.tensors[i] = Some(t);
        if let Some(e) = error {
            self.error.get_or_insert(e);
        }
    }
}

/// Passes each float parameter of a layer through the hook op.
struct Hooker<'a, const I: usize> {
    step: &'a Arc<Step>,
    anchor: &'a Tensor<I>,
}

static UNHOOKED: Once = Once::new();

impl<const I: usize> ModuleMapper for Hooker<'_, I> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !trains(&param) {
            return param; // frozen: no gradient to reduce
        }
        let Some(&slot) = self.step.slot_of.get(&param.id) else {
            let mut state = self.step.lock();
            state.error.get_or_insert(Error::InvalidArgument {
                what: "Overlap::layer",
                message: format!(
                    "parameter {} is not part of the model given to GradientReducer::overlap",
                    param.id
                ),
            });
            return param;
        };
        let step = Arc::clone(self.step);
        let anchor = self.anchor.clone();
        param.map(move |t| match hook::<D, I>(t.clone(), anchor, step, slot) {
            Some(hooked) => hooked,
            None => {
                UNHOOKED.call_once(|| {
                    tracing::warn!(
                        "kolo-burn: overlap needs Burn's CPU backend (flex), or its CubeCL \
                         backend with kolo-burn's cuda/cpu feature, with autodiff; these \
                         gradients are reduced after backward instead"
                    );
                });
                t
            }
        })
    }
}

/// `param` through the hook op with `anchor` as its second parent; `None` when the
/// tensors are not Flex (or, with the `cuda`/`cpu` feature, Cube) autodiff tensors.
fn hook<const D: usize, const I: usize>(
    param: Tensor<D>,
    anchor: Tensor<I>,
    step: Arc<Step>,
    slot: usize,
) -> Option<Tensor<D>> {
    // One copy per checkpointing strategy: Burn's conversion is implemented for each
    // concrete strategy only.
    macro_rules! with {
        ($name:ident, $B:ty, $C:ty) => {
            fn $name<const D: usize, const I: usize>(
                param: Tensor<D>,
                anchor: Tensor<I>,
                state: Ready,
            ) -> Option<Tensor<D>> {
                let p = param.try_into_primitive::<Autodiff<$B, $C>>().ok()?;
                let a = anchor.try_into_primitive::<Autodiff<$B, $C>>().ok()?;
                let (primitive, p_guard) = p.into_parts();
                let a_guard = a.node();
                let out = match ReduceWhenReady::<D>
                    .prepare::<$C>([p_guard, a_guard])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(state, primitive),
                    OpsKind::UnTracked(prep) => prep.finish(primitive),
                };
                Some(Tensor::from_primitive::<Autodiff<$B, $C>>(out))
            }
        };
    }
    with!(plain, Flex, NoCheckpointing);
    with!(balanced, Flex, BalancedCheckpointing);
    let state = Ready { step, slot };
    let flex = plain::<D, I>(param.clone(), anchor.clone(), state.clone())
        .or_else(|| balanced::<D, I>(param.clone(), anchor.clone(), state.clone()));
    #[cfg(any(feature = "cuda", feature = "cpu"))]
    let flex = flex.or_else(|| {
        use burn::backend::Cube;
        with!(cube_plain, Cube, NoCheckpointing);
        with!(cube_balanced, Cube, BalancedCheckpointing);
        cube_plain::<D, I>(param.clone(), anchor.clone(), state.clone())
            .or_else(|| cube_balanced::<D, I>(param, anchor, state))
    });
    flex
}

/// The hook's state: which step and slot its gradient belongs to.
#[derive(Clone)]
struct Ready {
    step: Arc<Step>,
    slot: usize,
}

impl std::fmt::Debug for Ready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ready").field("slot", &self.slot).finish()
    }
}

/// The identity op whose backward hands the parameter's gradient to kolo.
#[derive(Debug)]
struct ReduceWhenReady<const D: usize>;

impl<B: burn::backend::Backend, const D: usize> Backward<B, 2> for ReduceWhenReady<D>
where
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<B>,
{
    type State = Ready;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let Ready { step, slot } = ops.state;
        let grad = Tensor::<D>::from_primitive::<B>(grad);
        step.arrive(slot, grad);
        // Nothing goes to the parents: the parameter's gradient is kolo's now (finish
        // hands it back averaged) and the anchor only orders this op.
    }
}

impl Step {
    /// A hook's gradient for `slot`: kept as a kolo tensor; when its bucket is
    /// complete, the bucket is submitted.
    fn arrive<const D: usize>(&self, slot: usize, grad: Tensor<D>) {
        let path = &self.layout.slots[slot].path;
        let earlier = self
            .earlier()
            .as_mut()
            .and_then(|e| e.remove::<D>(self.layout.slots[slot].id));
        let grad = match earlier {
            Some(e) => grad + e,
            None => grad,
        };
        let device = grad.device();
        // A gradient this rank cannot hand over still arrives, as zeros: its bucket is
        // submitted as on every other rank, and `finish` fails the step everywhere.
        let (t, error) = match convert::to_kolo(path, grad, self.reducer.copied()) {
            Ok(t) => (t, None),
            Err(e) => (
                self.layout.wires[slot].zeros(&self.layout.slots[slot]),
                Some(e),
            ),
        };
        let mut state = self.lock();
        if state.devices[slot].is_some() {
            state.error.get_or_insert(Error::InvalidArgument {
                what: "Overlap::layer",
                message: format!(
                    "parameter {path} was hooked twice in one step (a layer used twice, or \
                     shared weights): pass such layers without Overlap::layer, their \
                     gradients are then reduced in finish"
                ),
            });
            return;
        }
        state.devices[slot] = Some(device);
        state.present[slot] = true;
        state.tensors[slot] = Some(t);
        if let Some(e) = error {
            state.error.get_or_insert(e);
        }
        let b = self.bucket_of[slot];
        state.arrived[b] += 1;
        if state.arrived[b] == self.layout.buckets[b].len() {
            match self
                .reducer
                .submit_bucket(&self.layout, b, &mut state.tensors)
            {
                Ok(h) => {
                    state.handles[b] = Some(h);
                    state.early += 1;
                }
                Err(e) => {
                    state.error.get_or_insert(e);
                }
            }
        }
    }
}
