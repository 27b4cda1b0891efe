//! A unit as one autodiff op. Its parents are the unit's input and one of its
//! trainable blocks (or a one-element stand-in: the op must be tracked on every rank,
//! also where the input is not); its output is the wrapped module's output, computed
//! without autodiff (or, keeping the graph, with a graph of its own). Its backward runs
//! the wrapped module's forward and backward on whole parameters — a graph of its own,
//! separate from the caller's, which Burn 0.22 allows inside a backward step —,
//! reduce-scatters the parameters' gradients and registers each block's part on the
//! block's own leaf, and the input's gradient on the input.

use std::sync::{Arc, Mutex, PoisonError};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::{Device, Tensor};

use super::ahead::Prefetch;
use super::overlap::{self, Deferred, Link};
use super::FullyShard;
use crate::convert;
use crate::error::{Error, Result};

/// The unit's forward as an autodiff op: `f` on the whole parameters, the op attached
/// to `input` and the trainable blocks.
pub(super) fn run<M, const I: usize, const O: usize, F>(
    unit: &FullyShard<M>,
    input: Tensor<I>,
    f: F,
    trainable: Vec<usize>,
) -> Result<Tensor<O>>
where
    M: Module + 'static,
    F: Fn(&M, Tensor<I>) -> Tensor<O> + Send + Sync + 'static,
{
    let device = unit.compute_device();
    let f = Arc::new(f);
    let need_x = input.is_autodiff() && input.is_tracked();
    let x_inner = input.clone().inner();
    // Learn the order of units for forward prefetch: this one runs after the last.
    let me: Arc<dyn Prefetch> = unit.unit.clone();
    if let Some(prev) = Link::last_unit() {
        prev.then(Arc::downgrade(&me));
    }
    let whole = unit.forward_gather(&device)?;
    let (y, kept) = if unit.settings.reshard {
        // Whole parameters and the input without autodiff: nothing of the unit is
        // held for backward but its input.
        (unit.apply(&*f, whole, x_inner.clone()), None)
    } else {
        let graph = Graph::build(unit, whole, &x_inner, need_x, &trainable, &*f);
        (graph.y.clone().inner(), Some(graph))
    };
    // The blocks' gradients are registered on their leaves directly (no concatenated
    // copy).
    let blocks: Vec<Tensor<1>> = trainable
        .iter()
        .map(|&i| unit.shard.pieces[i].param.val())
        .collect();
    let anchor = anchor(unit, &trainable, &blocks, &device);
    // Overlap with the previous use when this one's input is its output (see
    // `overlap`).
    let prefetch = unit.settings.reshard && unit.settings.backward_prefetch;
    let start: Option<overlap::Start> = prefetch.then(|| {
        let unit = unit.clone();
        Box::new(move || unit.start_gather()) as overlap::Start
    });
    let link = Link::new(me, start);
    let prev = node_id(&input).and_then(Link::previous);
    let pending: Box<dyn Pending<I, O> + Send> = Box::new(Recompute {
        unit: unit.clone(),
        f,
        x_inner,
        need_x,
        trainable,
        kept,
        link: Arc::clone(&link),
        prev,
    });
    let out = attach(input, anchor, blocks, y, pending);
    if let Some(id) = out.as_ref().and_then(node_id) {
        Link::made(&link, id);
    }
    out.ok_or_else(|| Error::InvalidArgument {
        what: "FullyShard::forward",
        message: "training a fully sharded unit needs Burn's CPU backend (flex) or, with \
                  kolo-burn's cuda/cpu feature, its CubeCL backend, with autodiff"
            .into(),
    })
}

/// The op's second parent: one of the trainable blocks, which makes the op tracked
/// when the input is not (the first unit). A rank that holds no element of the
/// trainable parameters (a unit smaller than the ranks) still runs the op's backward,
/// which every rank's reduce-scatter needs: a one-element leaf stands in; so it does
/// for offloaded blocks, which live on another backend than the op.
fn anchor<M: Module>(
    unit: &FullyShard<M>,
    trainable: &[usize],
    blocks: &[Tensor<1>],
    device: &Device,
) -> Tensor<1> {
    let len = |i: usize| unit.shard.pieces[i].param.lazy_shape().num_elements();
    let held: usize = trainable.iter().map(|&i| len(i)).sum();
    let offloaded = unit.settings.compute_device.is_some();
    if trainable.is_empty() {
        Tensor::<1>::zeros([0], device)
    } else if held == 0 || offloaded {
        Tensor::<1>::zeros([1], device).require_grad()
    } else {
        trainable
            .iter()
            .zip(blocks)
            .find(|(&i, _)| len(i) > 0)
            .map_or_else(|| Tensor::zeros([0], device), |(_, b)| b.clone())
    }
}

/// `y` as the output of the unit op whose parents are `input` and `anchor`, whose
/// backward gives `blocks` their gradients; `None` when the tensors are not Flex (or,
/// with the `cuda`/`cpu` feature, Cube) autodiff tensors.
fn attach<const I: usize, const O: usize>(
    input: Tensor<I>,
    anchor: Tensor<1>,
    blocks: Vec<Tensor<1>>,
    y: Tensor<O>,
    pending: Box<dyn Pending<I, O> + Send>,
) -> Option<Tensor<O>> {
    // One copy per checkpointing strategy: Burn's conversion is implemented for each
    // concrete strategy only.
    macro_rules! with {
        ($name:ident, $B:ty, $C:ty) => {
            fn $name<const I: usize, const O: usize>(
                input: &Tensor<I>,
                anchor: &Tensor<1>,
                blocks: &[Tensor<1>],
                y: &Tensor<O>,
                pending: &Job<I, O>,
            ) -> Option<Tensor<O>> {
                let x = input
                    .clone()
                    .try_into_primitive::<Autodiff<$B, $C>>()
                    .ok()?;
                let anchor = anchor
                    .clone()
                    .try_into_primitive::<Autodiff<$B, $C>>()
                    .ok()?;
                let targets = blocks.iter().map(node_id).collect::<Option<Vec<_>>>()?;
                let y = y.clone().try_into_primitive::<$B>().ok()?;
                let job = Job {
                    pending: Arc::clone(&pending.pending),
                    targets: Arc::new(targets),
                };
                let out = match UnitOp::<I, O>
                    .prepare::<$C>([x.node(), anchor.node()])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => prep.finish(job, y),
                    OpsKind::UnTracked(prep) => prep.finish(y),
                };
                Some(Tensor::from_primitive::<Autodiff<$B, $C>>(out))
            }
        };
    }
    with!(plain, Flex, NoCheckpointing);
    with!(balanced, Flex, BalancedCheckpointing);
    let job = Job {
        pending: Arc::new(Mutex::new(Some(pending))),
        targets: Arc::new(Vec::new()),
    };
    let args = (&input, &anchor, &blocks[..], &y, &job);
    let out = plain(args.0, args.1, args.2, args.3, args.4)
        .or_else(|| balanced(args.0, args.1, args.2, args.3, args.4));
    #[cfg(any(feature = "cuda", feature = "cpu"))]
    let out = out.or_else(|| {
        use burn::backend::Cube;
        with!(cube_plain, Cube, NoCheckpointing);
        with!(cube_balanced, Cube, BalancedCheckpointing);
        cube_plain(args.0, args.1, args.2, args.3, args.4)
            .or_else(|| cube_balanced(args.0, args.1, args.2, args.3, args.4))
    });
    out
}

/// The autodiff node of a tensor on any hooked backend (an offloaded block is on
/// another backend than its unit's op).
fn node_id<const D: usize>(t: &Tensor<D>) -> Option<NodeId> {
    macro_rules! try_as {
        ($B:ty, $C:ty) => {
            if let Ok(p) = t.clone().try_into_primitive::<Autodiff<$B, $C>>() {
                return Some(p.id());
            }
        };
    }
    try_as!(Flex, NoCheckpointing);
    try_as!(Flex, BalancedCheckpointing);
    #[cfg(any(feature = "cuda", feature = "cpu"))]
    {
        use burn::backend::Cube;
        try_as!(Cube, NoCheckpointing);
        try_as!(Cube, BalancedCheckpointing);
    }
    None
}

/// Registers `g` as the gradient of node `id`, in `B`'s primitive or, for a block on
/// another backend (offloaded), in that backend's; `false` when none takes it.
fn register<B: burn::backend::Backend>(grads: &mut Gradients, id: NodeId, g: Tensor<1>) -> bool
where
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<B>,
{
    // A failed conversion consumes the tensor: each try takes a clone (a handle).
    if let Ok(p) = g.clone().try_into_primitive::<B>() {
        grads.register::<B>(id, p);
        return true;
    }
    #[cfg(any(feature = "cuda", feature = "cpu"))]
    if let Ok(p) = g.clone().try_into_primitive::<burn::backend::Cube>() {
        grads.register::<burn::backend::Cube>(id, p);
        return true;
    }
    match g.try_into_primitive::<Flex>() {
        Ok(p) => {
            grads.register::<Flex>(id, p);
            true
        }
        Err(_) => false,
    }
}

/// What the op's backward runs, once.
trait Pending<const I: usize, const O: usize> {
    /// The unit's name, for messages.
    fn name(&self) -> String;

    /// From the output's gradient: the input's gradient (when `want_x`) and the
    /// averaged gradients of blocks to register: this use's (the blocks' nodes are
    /// `targets`), unless handed to the previous use, and those of later uses
    /// handed to this one.
    fn run(
        self: Box<Self>,
        grad: Tensor<O>,
        want_x: bool,
        targets: &Arc<Vec<NodeId>>,
    ) -> Result<Done<I>>;
}

/// What a use's backward computed: the input's gradient and blocks' gradients, each
/// group with its blocks' nodes.
type Done<const I: usize> = (Option<Tensor<I>>, Vec<(Arc<Vec<NodeId>>, Vec<Tensor<1>>)>);

/// The op's state: what the backward runs (taken by it: the gathered parameters and
/// graph, if kept, are freed with it) and the blocks' autodiff nodes.
struct Job<const I: usize, const O: usize> {
    pending: Arc<Mutex<Option<Box<dyn Pending<I, O> + Send>>>>,
    targets: Arc<Vec<NodeId>>,
}

impl<const I: usize, const O: usize> Clone for Job<I, O> {
    fn clone(&self) -> Self {
        Job {
            pending: Arc::clone(&self.pending),
            targets: Arc::clone(&self.targets),
        }
    }
}

impl<const I: usize, const O: usize> std::fmt::Debug for Job<I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FullyShardJob")
    }
}

impl<const I: usize, const O: usize> Job<I, O> {
    fn take(&self) -> Option<Box<dyn Pending<I, O> + Send>> {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// The wrapped module's forward under autodiff, on leaves of its own.
struct Graph<const I: usize, const O: usize> {
    y: Tensor<O>,
    x: Option<Tensor<I>>,
    /// The trainable parameters' leaves (flattened), in `trainable`'s order.
    leaves: Vec<Tensor<1>>,
}

impl<const I: usize, const O: usize> Graph<I, O> {
    fn build<M: Module>(
        unit: &FullyShard<M>,
        whole: Vec<Tensor<1>>,
        x_inner: &Tensor<I>,
        need_x: bool,
        trainable: &[usize],
        f: &dyn Fn(&M, Tensor<I>) -> Tensor<O>,
    ) -> Self {
        let mut leaves = Vec::with_capacity(trainable.len());
        let whole = whole
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let t = t.autodiff();
                if trainable.contains(&i) {
                    let t = t.require_grad();
                    leaves.push(t.clone());
                    t
                } else {
                    t
                }
            })
            .collect();
        let x = x_inner.clone().autodiff();
        let x = if need_x { x.require_grad() } else { x };
        let y = unit.apply(f, whole, x.clone());
        Graph {
            y,
            x: need_x.then_some(x),
            leaves,
        }
    }
}

/// The backward of one use of a unit.
struct Recompute<M: Module, F, const I: usize, const O: usize> {
    unit: FullyShard<M>,
    f: Arc<F>,
    x_inner: Tensor<I>,
    need_x: bool,
    trainable: Vec<usize>,
    /// The forward's graph, when the unit keeps it (`reshard_after_forward(false)`).
    kept: Option<Graph<I, O>>,
    /// This use, as the next one's backward sees it.
    link: Arc<Link>,
    /// The previous use, whose backward runs after this one's.
    prev: Option<Arc<Link>>,
}

impl<M: Module, F, const I: usize, const O: usize> Recompute<M, F, I, O> {
    /// The trainable parameters' whole gradients (flattened) out of `grads` (zeros
    /// for one without), in `trainable`'s order. Every rank reduce-scatters, wanted
    /// here or not, so that none waits alone.
    fn take_grads(
        &self,
        mut grads: Option<&mut burn::tensor::Gradients>,
        leaves: &[Tensor<1>],
        device: &Device,
    ) -> Vec<Tensor<1>> {
        self.trainable
            .iter()
            .zip(leaves)
            .map(|(&i, leaf)| {
                // Taken out, so that its buffer is lent to the reduce-scatter as it is.
                grads
                    .as_deref_mut()
                    .and_then(|g| leaf.grad_remove(g))
                    .unwrap_or_else(|| {
                        let full = &self.unit.unit.params[i];
                        Tensor::zeros([full.numel()], (&device.clone().inner(), full.dtype))
                    })
            })
            .collect()
    }
}

impl<M, F, const I: usize, const O: usize> Pending<I, O> for Recompute<M, F, I, O>
where
    M: Module + 'static,
    F: Fn(&M, Tensor<I>) -> Tensor<O> + Send + Sync,
{
    fn name(&self) -> String {
        self.unit.unit.name.clone()
    }

    fn run(
        self: Box<Self>,
        grad: Tensor<O>,
        want_x: bool,
        targets: &Arc<Vec<NodeId>>,
    ) -> Result<Done<I>> {
        let mut this = *self;
        let device = this.unit.compute_device();
        // This use's all-gather (prefetched by the next use, or submitted now), then
        // the previous use's, which runs while this one computes.
        let prefetched = this.link.begin();
        let own = match (&this.kept, prefetched) {
            (Some(_), _) => None,
            (None, Some(h)) => Some(h?),
            (None, None) => Some(this.unit.start_gather()?),
        };
        if let Some(prev) = &this.prev {
            tracing::debug!(unit = %this.unit.unit.name, "backward prefetches the previous unit's all-gather");
            prev.prefetch();
        }
        let graph = match (this.kept.take(), own) {
            (Some(g), _) => g,
            (None, own) => {
                let all = own.map_or_else(|| this.unit.start_gather(), Ok)?.wait()?;
                let whole = this.unit.finish_gather(all, &device)?;
                Graph::build(
                    &this.unit,
                    whole,
                    &this.x_inner,
                    this.need_x,
                    &this.trainable,
                    &*this.f,
                )
            }
        };
        let grads = graph
            .y
            .is_tracked()
            .then(|| (graph.y * grad.autodiff()).sum().backward());
        let mut grads = grads;
        let gx = match (&mut grads, graph.x, want_x) {
            (Some(g), Some(x), true) => x.grad_remove(g),
            _ => None,
        };
        let mut done = Vec::new();
        if !this.trainable.is_empty() {
            let whole_grads = this.take_grads(grads.as_mut(), &graph.leaves, &device);
            let mine = this
                .unit
                .start_reduce_scatter(&this.trainable, whole_grads)?;
            let mine = Deferred {
                targets: Arc::clone(targets),
                ..mine
            };
            // Handed to the previous use's backward, which runs later in this pass;
            // waited for here when there is none.
            let mine = match &this.prev {
                Some(prev) => prev.defer(mine),
                None => Some(mine),
            };
            match mine {
                Some(mine) => done.push(mine.wait()?),
                None => tracing::debug!(
                    unit = %this.unit.unit.name,
                    "reduce-scatter handed to the previous unit's backward"
                ),
            }
        }
        // The later uses' gradients handed to this one.
        for d in this.link.take_deferred() {
            done.push(d.wait()?);
        }
        Ok((gx, done))
    }
}

impl<M: Module + 'static> FullyShard<M> {
    /// Submits the reduce-scatter of the trainable parameters' whole gradients
    /// (flattened) as one group; the result, when finished, is this rank's block of
    /// each, on the blocks' device without autodiff. (Its `targets` are left empty.)
    fn start_reduce_scatter(&self, trainable: &[usize], whole: Vec<Tensor<1>>) -> Result<Deferred> {
        let unit = &self.unit;
        let copied = convert::Copied::default();
        let members = trainable
            .iter()
            .zip(whole)
            .map(|(&i, g)| {
                let name = format!("{}.{i}.grad", unit.name);
                let t = convert::on_host(convert::to_kolo(&name, g, &copied)?)?;
                Ok((name, t))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut rs = unit
            .kolo
            .grouped_reducescatter(members)
            .op(self.settings.op);
        if self.settings.passes > 1 {
            rs = rs.postscale(1.0 / self.settings.passes as f64);
        }
        let handle = rs.submit()?;
        // Each block's gradient where the block is (the host, when offloaded).
        let this = self.clone();
        let trainable = trainable.to_vec();
        let finish: overlap::Finish = Box::new(move |blocks| {
            let inner = this.device().inner();
            let unit = &this.unit;
            blocks
                .into_iter()
                .zip(&trainable)
                .map(|(t, &i)| {
                    let name = format!("{}.{i}.grad", unit.name);
                    convert::to_burn::<1>(&name, t, unit.params[i].dtype, &inner)
                        .map(|t| super::on(t, &inner))
                })
                .collect()
        });
        Ok(Deferred {
            name: unit.name.clone(),
            handle,
            finish,
            targets: Arc::new(Vec::new()),
        })
    }
}

/// The unit op (see the module's docs).
#[derive(Debug)]
struct UnitOp<const I: usize, const O: usize>;

impl<B: burn::backend::Backend, const I: usize, const O: usize> Backward<B, 2> for UnitOp<I, O>
where
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<B>,
{
    type State = Job<I, O>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [px, _anchor] = ops.parents;
        let Some(pending) = ops.state.take() else {
            return;
        };
        let name = pending.name();
        let grad = Tensor::<O>::from_primitive::<B>(grad);
        let (gx, blocks) = match pending.run(grad, px.is_some(), &ops.state.targets) {
            Ok(g) => g,
            Err(e) => panic!("kolo_burn::FullyShard {name}: backward: {e}"),
        };
        if let (Some(p), Some(g)) = (px, gx) {
            match g.try_into_primitive::<B>() {
                Ok(g) => grads.register::<B>(p.id, g),
                Err(e) => panic!("kolo_burn::FullyShard {name}: the input's gradient: {e:?}"),
            }
        }
        // Each block's gradient straight onto the block's leaf (the second parent, one
        // of them or a stand-in, only made the op tracked).
        for (targets, blocks) in blocks {
            for (&id, g) in targets.iter().zip(blocks) {
                if !register::<B>(grads, id, g) {
                    panic!(
                        "kolo_burn::FullyShard {name}: a block's gradient is on no hooked backend"
                    );
                }
            }
        }
    }
}
