//! What framework threads put on the engine's queue, and what ranks tell each other
//! about it during negotiation.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::handle::Completer;
use crate::tensor::{DType, Tensor};
use crate::vocab::ReduceOp;

/// A negotiation key (the tensor name, or a group's key): shared, not copied, between
/// the submitting thread's pending set, the engine's maps and the responses.
pub(crate) use crate::vocab::Key;

/// The negotiation key of [`OpKind::Join`] requests.
pub(crate) const JOIN_KEY: &str = "@join";

/// Keys kolo makes itself (join, barrier, groups) start with this; user tensor names
/// may not, so the two never collide.
pub(crate) const RESERVED_PREFIX: char = '@';

/// The negotiation key of [`OpKind::Barrier`] requests.
pub(crate) const BARRIER_KEY: &str = "@barrier";

/// The kind of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum OpKind {
    Allreduce,
    GroupedAllreduce,
    Allgather,
    /// Several allgathers as one unit (a group key, members as tensors).
    GroupedAllgather,
    /// Several reducescatters as one unit.
    GroupedReducescatter,
    Broadcast,
    Alltoall,
    Reducescatter,
    Barrier,
    Join,
    /// Makes a process set's communicator (its ranks are in the request's `splits`).
    AddProcessSet,
    /// Point to point: this rank's tensor to the rank in `root`.
    Send,
    /// Point to point: a tensor from the rank in `root` (shape and dtype from the send).
    Recv,
    /// A process set's engine asks the job's engine for this rank's turn to enqueue
    /// device work (the set's job ranks are in `splits`; see `engine::turn`).
    DeviceTurn,
}

impl OpKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::Allreduce => "allreduce",
            OpKind::GroupedAllreduce => "grouped_allreduce",
            OpKind::Allgather => "allgather",
            OpKind::GroupedAllgather => "grouped_allgather",
            OpKind::GroupedReducescatter => "grouped_reducescatter",
            OpKind::Broadcast => "broadcast",
            OpKind::Alltoall => "alltoall",
            OpKind::Reducescatter => "reducescatter",
            OpKind::Barrier => "barrier",
            OpKind::Join => "join",
            OpKind::AddProcessSet => "add_process_set",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::DeviceTurn => "device_turn",
        }
    }

    /// Whether the op is point to point (two ranks, not all).
    pub(crate) fn is_p2p(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Recv)
    }

    /// Whether the op is negotiated among some of the ranks only (see
    /// [`RequestMeta::participants`]).
    pub(crate) fn is_partial(self) -> bool {
        self == OpKind::DeviceTurn
    }

    /// Whether the op can run while some ranks have joined (they contribute zeros).
    pub(crate) fn runs_with_joined_ranks(self) -> bool {
        matches!(
            self,
            OpKind::Allreduce | OpKind::GroupedAllreduce | OpKind::Barrier
        )
    }
}

/// Where a request's tensors live, as negotiated: ranks must agree on the kind of
/// device (each rank uses its own GPU, so ordinals may differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Device {
    Cpu,
    Cuda,
}

impl Device {
    pub(crate) fn of(d: crate::tensor::Device) -> Device {
        if d.is_cuda() {
            Device::Cuda
        } else {
            Device::Cpu
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// A tensor's shape, inline up to four dimensions.
pub(crate) type Shape = SmallVec<[usize; 4]>;

/// One tensor of a request, as the other ranks see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct TensorMeta {
    /// Shared with the request's key when the request has one tensor of that name.
    pub(crate) name: Key,
    pub(crate) dtype: DType,
    pub(crate) shape: Shape,
}

impl TensorMeta {
    /// Bytes of the tensor.
    pub(crate) fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_of()
    }
}

/// A request as the other ranks see it: everything but the data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RequestMeta {
    /// The negotiation key: the tensor name (a group's key lists its members).
    pub(crate) key: Key,
    pub(crate) kind: OpKind,
    pub(crate) tensors: SmallVec<[TensorMeta; 1]>,
    pub(crate) op: ReduceOp,
    pub(crate) prescale: f64,
    pub(crate) postscale: f64,
    pub(crate) root: usize,
    pub(crate) splits: Option<Vec<usize>>,
    pub(crate) device: Device,
}

impl RequestMeta {
    /// Bytes of all its tensors.
    pub(crate) fn bytes(&self) -> usize {
        self.tensors.iter().map(TensorMeta::bytes).sum()
    }

    /// The ranks a request needs, when not every rank: a device turn's process set
    /// (job ranks, sorted). Sends and receives are never negotiated (`engine/p2p.rs`).
    pub(crate) fn participants(&self) -> Option<&[usize]> {
        match self.kind {
            OpKind::DeviceTurn => Some(self.splits.as_deref().unwrap_or_default()),
            _ => None,
        }
    }
}

#[cfg(any(test, feature = "sim"))]
impl RequestMeta {
    /// A one-tensor request for the engine's unit tests and the simulator (CPU, no scaling, root 0).
    pub(crate) fn for_test(
        key: &str,
        kind: OpKind,
        dtype: DType,
        shape: &[usize],
        op: ReduceOp,
    ) -> Self {
        RequestMeta {
            key: key.into(),
            kind,
            tensors: smallvec::smallvec![TensorMeta {
                name: key.into(),
                dtype,
                shape: shape.into(),
            }],
            op,
            prescale: 1.0,
            postscale: 1.0,
            root: 0,
            splits: None,
            device: Device::Cpu,
        }
    }
}

/// The tensors of a request with their names: one inline, as most requests have.
pub(crate) type Named = SmallVec<[(Key, Tensor); 1]>;

/// A request as the builders assemble it, before validation.
#[derive(Debug)]
pub(crate) struct Submission {
    pub(crate) kind: OpKind,
    pub(crate) key: Key,
    pub(crate) tensors: Named,
    pub(crate) op: ReduceOp,
    pub(crate) prescale: f64,
    pub(crate) postscale: f64,
    pub(crate) root: usize,
    pub(crate) splits: Option<Vec<usize>>,
    /// A group's members are submitted sorted by name, so that every rank negotiates
    /// and fuses them in one order whatever order each caller listed them in; this is
    /// the caller's order (`order[i]`: the sorted position of the caller's member `i`),
    /// restored when the results are handed back.
    pub(crate) order: Option<Box<[u32]>>,
}

impl Submission {
    pub(crate) fn new(kind: OpKind, key: Key, tensors: Named) -> Self {
        Submission {
            kind,
            key,
            tensors,
            op: ReduceOp::Average,
            prescale: 1.0,
            postscale: 1.0,
            root: 0,
            splits: None,
            order: None,
        }
    }

    /// A request on one tensor whose name is the key (every op but a group).
    pub(crate) fn single(kind: OpKind, name: String, tensor: Tensor) -> Self {
        let key = Key::from(name);
        Submission::new(kind, key.clone(), smallvec::smallvec![(key, tensor)])
    }

    /// Splits into what is negotiated and the data that stays on this rank.
    pub(crate) fn into_parts(self) -> (RequestMeta, Tensors) {
        let mut metas = SmallVec::with_capacity(self.tensors.len());
        let mut data = Tensors::with_capacity(self.tensors.len());
        // Validation made sure that every tensor of a request is on the same kind.
        let device = self
            .tensors
            .first()
            .map_or(Device::Cpu, |(_, t)| Device::of(t.device()));
        for (name, t) in self.tensors {
            metas.push(TensorMeta {
                name,
                dtype: t.dtype(),
                shape: Shape::from_slice(t.shape()),
            });
            data.push(t);
        }
        let meta = RequestMeta {
            key: self.key,
            kind: self.kind,
            tensors: metas,
            op: self.op,
            prescale: self.prescale,
            postscale: self.postscale,
            root: self.root,
            splits: self.splits,
            device,
        };
        (meta, data)
    }
}

/// A request's tensors on this rank, one inline.
pub(crate) type Tensors = SmallVec<[Tensor; 1]>;

/// A validated request on this rank's queue.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) meta: RequestMeta,
    pub(crate) tensors: Tensors,
    pub(crate) done: Completer,
    /// When it was submitted (for the stall inspector).
    pub(crate) submitted: std::time::Instant,
}

#[cfg(any(test, feature = "sim"))]
impl Request {
    /// A request for `meta` with one `tensor`, submitted now on rank `rank`, and the
    /// handle its result completes (its names released on `names`): for the engine's
    /// unit tests and the simulator.
    pub(crate) fn with_handle(
        meta: RequestMeta,
        tensor: Tensor,
        names: std::sync::Arc<dyn crate::handle::PendingNames>,
        rank: usize,
    ) -> (crate::handle::Handle<Tensor>, Request) {
        let (handle, done) = crate::handle::pair(
            smallvec::smallvec![meta.key.clone()],
            names,
            (meta.kind.name(), rank),
            crate::handle::to_tensor,
        );
        let request = Request {
            meta,
            tensors: smallvec::smallvec![tensor],
            done,
            submitted: std::time::Instant::now(),
        };
        (handle, request)
    }
}

impl Request {
    /// Fails a request that never ran: its tensors go back to the caller with
    /// `error` (nothing of them was sent, so the caller may use them again).
    pub(crate) fn fail(self, error: crate::error::Error) {
        self.done.fail(error, self.tensors.into_vec());
    }
}

/// Messages from framework threads to the engine.
///
/// A request is boxed, although a box costs every submit an allocation (freed on the
/// engine thread): the engine moves it from the queue into its pending map and on
/// into a batch, 336 bytes each time unboxed, and by pointer 1000 async 1 KiB
/// allreduces took 1.12-1.15 ms instead of 1.22-1.28 (np 2, alternating launches).
#[derive(Debug)]
pub(crate) enum Command {
    Submit(Box<Request>),
    Shutdown,
    /// Start writing the timeline to a path, or stop (None); the result is sent back.
    Timeline {
        path: Option<std::path::PathBuf>,
        reply: std::sync::mpsc::SyncSender<crate::error::Result<()>>,
    },
}

/// What a rank contributes to one negotiation cycle.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct CycleMsg {
    /// Requests submitted on this rank since its last cycle.
    pub(crate) requests: Vec<RequestMeta>,
    /// This rank is leaving: its last cycle.
    pub(crate) shutdown: bool,
    /// This rank's stall inspector found a stall older than the stall shutdown time:
    /// every rank fails its pending ops with the stall report.
    pub(crate) stall_abort: bool,
    /// New engine settings from rank 0's autotuner, applied by every rank at the end
    /// of this cycle.
    pub(crate) tuning: Option<Settings>,
}

/// Engine settings the tuner changes; identical on every rank once applied.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Settings {
    pub(crate) fusion_threshold: usize,
    /// Tensors above this many bytes are not fused.
    pub(crate) fusion_max_tensor: usize,
    /// Cycle time in microseconds.
    pub(crate) cycle_time_us: u64,
    pub(crate) cache: bool,
    /// Allreduce hierarchically (only ever on where it can run).
    pub(crate) hierarchical: bool,
    /// Allgather hierarchically (likewise).
    pub(crate) hierarchical_allgather: bool,
    /// The tuner is done: these are the settings it keeps.
    pub(crate) last: bool,
}

impl Settings {
    pub(crate) fn cycle_time(&self) -> Duration {
        Duration::from_micros(self.cycle_time_us)
    }
}
