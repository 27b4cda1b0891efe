//! The seam between the engine and a device's collectives: what the engine's GPU
//! executor (`engine/gpu.rs`) asks of a communicator on device memory, with no
//! library named. The NCCL transport implements it (`transport/nccl/`, feature
//! `nccl`); the loopback transport's simulated device stands in for it in tests.
//!
//! Every op is enqueued and returns at once: its results are in the tensors only
//! once a [`mark`](DeviceComm::mark) recorded after it is
//! [`reached`](DeviceComm::reached). Until then every buffer an op reads or writes
//! must stay alive — the caller keeps them, and frees them only after the mark or
//! after [`settle`](DeviceComm::settle).

use crate::error::Result;
use crate::tensor::{DType, Tensor};
use crate::vocab::ReduceOp;

/// An allreduce's op and scale factors: every input multiplied by `prescale`, the
/// result by `postscale` (an average's division by the number of ranks included).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Reduction {
    pub(crate) op: ReduceOp,
    pub(crate) prescale: f64,
    pub(crate) postscale: f64,
}

/// A communicator over device memory, with one queue of work (a stream).
pub(crate) trait DeviceComm: Send {
    /// The device this communicator runs on.
    fn ordinal(&self) -> usize;
    /// This rank in the communicator.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Fails when an earlier failure left the communicator unusable.
    fn usable(&self) -> Result<()>;
    /// Makes the device current on the calling thread, and orders the queue after
    /// the work already enqueued on `tensors` elsewhere (so that ops read what the
    /// user wrote).
    fn prepare(&mut self, tensors: &[Tensor]) -> Result<()>;
    /// A zeroed tensor on the device (what a joined rank contributes).
    fn zeros(&mut self, dtype: DType, shape: &[usize]) -> Result<Tensor>;
    /// A tensor of uninitialised device memory, for an op's output (every element is
    /// written by the op).
    fn empty(&mut self, dtype: DType, shape: &[usize]) -> Result<Tensor>;
    /// Reduces each of `tensors` in place (one group of calls where the library
    /// allows).
    fn allreduce(&mut self, tensors: &[Tensor], r: Reduction) -> Result<()>;
    /// Reduces `tensors` (one dtype) as one buffer: copied into the communicator's
    /// fusion buffer, reduced once, copied back.
    fn allreduce_fused(&mut self, tensors: &[Tensor], r: Reduction) -> Result<()>;
    /// Broadcasts `tensor` from `root`, in place.
    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<()>;
    /// Gathers every rank's `tensor` (rank `i` sends `counts[i]` elements) into `out`.
    fn allgatherv(&mut self, tensor: &Tensor, out: &Tensor, counts: &[usize]) -> Result<()>;
    /// Sends `send[i]` elements of `tensor` to rank `i` and receives `recv[i]` from it
    /// into `out`.
    fn alltoallv(
        &mut self,
        tensor: &Tensor,
        send: &[usize],
        out: &Tensor,
        recv: &[usize],
    ) -> Result<()>;
    /// Reduces `tensor` over the ranks and leaves this rank's block (`counts[rank]`
    /// elements) in `out`; either may be scaled in place.
    fn reduce_scatter(
        &mut self,
        tensor: &mut Tensor,
        out: &mut Tensor,
        counts: &[usize],
        r: Reduction,
    ) -> Result<()>;
    /// Marks everything enqueued so far; the mark is reached once all of it has run.
    fn mark(&mut self) -> Result<u64>;
    /// Whether everything enqueued before `mark` has run. Marks are asked in order.
    fn reached(&mut self, mark: u64) -> Result<bool>;
    /// Waits until everything enqueued has run (or ended, after a failure that
    /// aborted the communicator), so that its buffers may be freed.
    fn settle(&mut self);
}
