//! Runs negotiated ops on device tensors through the transport's device
//! communicator (`transport::device::DeviceComm`; NCCL in production): enqueues each
//! op, records a mark after it, and completes the op's handle once the mark is
//! reached — the engine never waits for the whole queue and keeps negotiating
//! meanwhile. Every buffer an op uses stays here until its mark is reached, or until
//! the device has settled after a failure.

use std::collections::VecDeque;
use std::time::Duration;

use super::layout::{
    allgather_layout, alltoall_layout, first_tensor, fused_inputs, local_or_zeros, post_factor,
    reducescatter_layout, take_tensor, AlltoallLayout,
};
use super::negotiate::Ready;
use super::request::{OpKind, RequestMeta, Tensors};
use crate::error::{Error, Result};
use crate::handle::{Completer, Output};
use crate::submit_error::SubmitError;
use crate::tensor::{Device, Tensor};
use crate::transport::device::{DeviceComm, Reduction};
use crate::transport::Transport;
use crate::vocab::AlltoallOutput;

/// A fusion batch member: the response, this rank's tensors and handle (none on a
/// joined rank).
pub(super) type Member<'a> = (&'a Ready, Option<Tensors>, Option<Completer>);

/// An enqueued op whose handles complete when `mark` is reached.
struct Inflight {
    mark: u64,
    finish: Vec<(Completer, Output)>,
    /// Device buffers the op reads that are not part of its output (inputs of
    /// allgather / alltoall / reducescatter, a joined rank's zeros): freed only after
    /// the mark, since the device may still read them.
    keep: Vec<Tensor>,
}

/// The GPU side of the engine.
#[derive(Default)]
pub(super) struct Gpu {
    comm: Option<Box<dyn DeviceComm>>,
    inflight: VecDeque<Inflight>,
    /// How long the communicator's set-up or a call that has not finished may take
    /// (None: [`device_timeout`] of the default).
    timeout: Option<Duration>,
}

/// The device communicator's limit for a collective timeout of `collective`: half of
/// it, so that a rank whose communicator never comes up is named before the watchdog
/// ends the job; 150 s when the collective timeout is off (0).
pub(super) fn device_timeout(collective: Duration) -> Duration {
    if collective.is_zero() {
        Duration::from_secs(150)
    } else {
        collective / 2
    }
}

/// The reduction `meta` asks for among `size` ranks.
fn reduction(meta: &RequestMeta, size: usize) -> Reduction {
    Reduction {
        op: meta.op,
        prescale: meta.prescale,
        postscale: post_factor(meta, size),
    }
}

impl Gpu {
    /// Bounds the communicator's set-up and calls by [`device_timeout`] of
    /// `collective_timeout`.
    pub(super) fn set_timeout(&mut self, collective_timeout: Duration) {
        self.timeout = Some(device_timeout(collective_timeout));
    }

    /// How long a device call may take ([`device_timeout`]).
    pub(super) fn limit(&self) -> Duration {
        self.timeout
            .unwrap_or_else(|| device_timeout(Duration::ZERO))
    }

    /// Whether a device communicator is open (its CUDA and NCCL calls then stay on
    /// the engine thread).
    pub(super) fn opened(&self) -> bool {
        self.comm.is_some()
    }

    /// Whether ops are still running on the device.
    pub(super) fn busy(&self) -> bool {
        !self.inflight.is_empty()
    }

    /// Completes, in order, every op whose mark has been reached.
    pub(super) fn poll(&mut self) {
        while let Some(front) = self.inflight.front() {
            let state = match self.comm.as_mut() {
                Some(c) => c.reached(front.mark),
                None => Err(Error::Internal("GPU op without a communicator".into())),
            };
            if matches!(state, Ok(false)) {
                return;
            }
            let Some(done) = self.inflight.pop_front() else {
                return;
            };
            match state {
                Ok(_) => {
                    drop(done.keep);
                    for (c, out) in done.finish {
                        c.complete(Ok(out));
                    }
                }
                Err(e) => {
                    // The device's state is unknown: wait for it before freeing.
                    self.settle(done.keep);
                    for (c, _) in done.finish {
                        c.complete(Err(e.clone()));
                    }
                }
            }
        }
    }

    /// Waits for every op on the device and completes their handles.
    pub(super) fn drain(&mut self) {
        if let Some(c) = self.comm.as_mut() {
            c.settle();
        }
        self.poll();
    }

    /// Completes `finish` (and frees `keep`) once everything enqueued so far has run.
    fn finish_later(&mut self, finish: Vec<(Completer, Output)>, keep: Vec<Tensor>) {
        let mark = match self.comm.as_mut() {
            Some(c) => c.mark(),
            None => Err(Error::Internal("GPU op without a communicator".into())),
        };
        match mark {
            Ok(mark) => self.inflight.push_back(Inflight { mark, finish, keep }),
            Err(e) => {
                self.settle(keep);
                for (c, _) in finish {
                    c.complete(Err(e.clone()));
                }
            }
        }
    }

    /// Enqueues one op; its handle completes when the device has run it.
    pub(super) fn respond(
        &mut self,
        mpi: &mut dyn Transport,
        ready: &Ready,
        local: Option<Tensors>,
        done: Option<Completer>,
    ) {
        let mut keep = Vec::new();
        match self.run(mpi, ready, local, &mut keep) {
            Ok(out) => {
                let finish = done.map(|c| (c, out)).into_iter().collect();
                self.finish_later(finish, keep);
            }
            Err(e) => {
                self.settle(keep);
                match done {
                    Some(c) => {
                        let (e, back) = e.into_parts();
                        c.fail(e, back);
                    }
                    None => {
                        tracing::warn!(key = %ready.key, error = %e, "GPU op for a joined rank failed")
                    }
                }
            }
        }
    }

    /// Enqueues a fused allreduce of `members` (same dtype, op and scale factors).
    pub(super) fn respond_fused(&mut self, mpi: &mut dyn Transport, members: Vec<Member<'_>>) {
        let mut dones = Vec::with_capacity(members.len());
        let mut inputs = Vec::with_capacity(members.len());
        for (ready, local, done) in members {
            dones.push(done);
            inputs.push((ready, local));
        }
        let mut keep = Vec::new();
        match self.run_fused(mpi, inputs, &mut keep) {
            Ok(outputs) => {
                let finish = dones
                    .into_iter()
                    .zip(outputs)
                    .filter_map(|(d, t)| Some((d?, Output::Tensor(t?))))
                    .collect();
                self.finish_later(finish, keep);
            }
            Err(e) => {
                self.settle(keep);
                // Every request of the batch gets the error as it is (its kind too).
                for c in dones.into_iter().flatten() {
                    c.complete(Err(e.clone()));
                }
            }
        }
    }

    /// After a failed op: waits for whatever it enqueued before freeing its buffers. A
    /// failed or timed-out call has aborted the communicator already, which ends its
    /// kernels, so this wait cannot hang on a peer that never comes.
    fn settle(&mut self, keep: Vec<Tensor>) {
        if let Some(c) = self.comm.as_mut() {
            c.settle();
        }
        drop(keep);
    }

    /// The communicator, opened on first use on the device of `local`'s tensors (or,
    /// on a joined rank, the transport's choice), made current, and checked to be on
    /// that device.
    fn comm(
        &mut self,
        mpi: &mut dyn Transport,
        local: Option<&[Tensor]>,
    ) -> Result<&mut dyn DeviceComm> {
        let wanted = match local.and_then(|l| l.first()) {
            Some(t) => match t.device() {
                Device::Cuda(i) => Some(i),
                other => {
                    return Err(Error::Internal(format!(
                        "CPU tensor on the GPU path ({other})"
                    )))
                }
            },
            None => None,
        };
        if self.comm.is_none() {
            let timeout = self
                .timeout
                .unwrap_or_else(|| device_timeout(Duration::ZERO));
            self.comm = Some(mpi.open_device(wanted, timeout)?);
        }
        let comm = self.comm_opened()?;
        comm.usable()?;
        if let Some(i) = wanted {
            if i != comm.ordinal() {
                return Err(Error::WrongDevice {
                    what: "NCCL collective",
                    expected: Device::Cuda(comm.ordinal()),
                    actual: Device::Cuda(i),
                });
            }
        }
        Ok(comm)
    }

    /// Prepares the op on this rank, agrees with every rank that all of them can run
    /// it, and only then enqueues it: a failure on one rank before its enqueue (a
    /// tensor on another device, an allocation that fails) fails the op on every rank,
    /// naming that rank, instead of leaving the others' enqueued ops waiting for it
    /// until the watchdog ends the job (issue 31, item 20).
    fn run(
        &mut self,
        mpi: &mut dyn Transport,
        ready: &Ready,
        local: Option<Tensors>,
        keep: &mut Vec<Tensor>,
    ) -> Result<Output, SubmitError> {
        let prepared = self.prepare(mpi, ready, local);
        let prepared = agree(mpi, ready, prepared, |p| p.inputs.into_vec())?;
        let comm = self.comm_opened()?;
        Ok(enqueue(comm, ready, prepared, keep)?)
    }

    /// Everything the op needs on this rank before it is enqueued: the communicator,
    /// its tensors (zeros on a joined rank) and its output, allocated.
    fn prepare(
        &mut self,
        mpi: &mut dyn Transport,
        ready: &Ready,
        local: Option<Tensors>,
    ) -> Result<Prepared> {
        let comm = self.comm(mpi, local.as_deref())?;
        let inputs = local_or_zeros(ready, local, |m| comm.zeros(m.dtype, &m.shape))?;
        comm.prepare(&inputs)?;
        let plan = match (ready.kind, inputs.last()) {
            (OpKind::Allgather, Some(t)) => {
                let (counts, shape) = allgather_layout(ready, t.shape())?;
                Plan::Gather(counts.to_vec(), comm.empty(t.dtype(), &shape)?)
            }
            (OpKind::Alltoall, Some(t)) => {
                let l = alltoall_layout(ready, comm.rank(), t.shape())?;
                let out = comm.empty(t.dtype(), &l.shape)?;
                Plan::Alltoall(l, out)
            }
            (OpKind::Reducescatter, Some(t)) => {
                let (counts, shape) = reducescatter_layout(t.shape(), comm.size(), comm.rank());
                Plan::Scatter(counts, comm.empty(t.dtype(), &shape)?)
            }
            (OpKind::Allreduce | OpKind::GroupedAllreduce | OpKind::Broadcast, _) => Plan::InPlace,
            (kind, _) => {
                return Err(Error::Internal(format!(
                    "{} reached the GPU executor without a tensor",
                    kind.name()
                )))
            }
        };
        Ok(Prepared { inputs, plan })
    }

    /// The communicator [`Self::comm`] opened.
    fn comm_opened(&mut self) -> Result<&mut dyn DeviceComm> {
        let comm = self
            .comm
            .as_deref_mut()
            .ok_or_else(|| Error::Internal("device communicator missing".into()))?;
        Ok(comm)
    }

    fn run_fused(
        &mut self,
        mpi: &mut dyn Transport,
        members: Vec<(&Ready, Option<Tensors>)>,
        keep: &mut Vec<Tensor>,
    ) -> Result<Vec<Option<Tensor>>> {
        let Some(&(first_ready, _)) = members.first() else {
            return Ok(Vec::new());
        };
        let prepared = self.prepare_fused(mpi, members);
        // A batch's members each have their own handle: each gets a clone of the
        // batch's error, without tensors.
        let (tensors, mine) = agree(mpi, first_ready, prepared, |_| Vec::new())?;
        let comm = self.comm_opened()?;
        let r = reduction(first_ready.first(), comm.size());
        if let Err(e) = comm.allreduce_fused(&tensors, r) {
            // The copies into the fusion buffer may be enqueued: keep the members.
            keep.extend(tensors);
            return Err(e);
        }
        let mut outputs = Vec::with_capacity(tensors.len());
        for (t, m) in tensors.into_iter().zip(mine) {
            if m {
                outputs.push(Some(t));
            } else {
                keep.push(t);
                outputs.push(None);
            }
        }
        Ok(outputs)
    }

    /// A fused batch's members on this rank (zeros where it has joined), and which
    /// are its own, checked to be on the communicator's device.
    fn prepare_fused(
        &mut self,
        mpi: &mut dyn Transport,
        members: Vec<(&Ready, Option<Tensors>)>,
    ) -> Result<(Vec<Tensor>, Vec<bool>)> {
        let Some(&(first_ready, _)) = members.first() else {
            return Ok((Vec::new(), Vec::new()));
        };
        first_tensor(first_ready.first(), 0)?;
        // The device is that of the first member this rank holds.
        let local_first: Option<&[Tensor]> = members
            .iter()
            .find_map(|(_, l)| l.as_deref())
            .filter(|l| !l.is_empty())
            .map(|l| &l[..1]);
        let comm = self.comm(mpi, local_first)?;
        let on = Device::Cuda(comm.ordinal());
        let (tensors, mine) = fused_inputs(members, |m| comm.zeros(m.dtype, &m.shape))?;
        // The copies are device-to-device on the communicator's device: every member
        // must be there, not only the first.
        if let Some(t) = tensors.iter().find(|t| t.device() != on) {
            return Err(Error::WrongDevice {
                what: "fused NCCL allreduce",
                expected: on,
                actual: t.device(),
            });
        }
        comm.prepare(&tensors)?;
        Ok((tensors, mine))
    }
}

/// An op ready to enqueue on this rank.
struct Prepared {
    inputs: Tensors,
    plan: Plan,
}

/// What an op writes besides its inputs, allocated before it is enqueued.
enum Plan {
    /// In place: allreduce, grouped allreduce, broadcast.
    InPlace,
    /// Elements from each rank, into the output.
    Gather(Vec<usize>, Tensor),
    /// The exchange's counts, into the output.
    Alltoall(AlltoallLayout, Tensor),
    /// Elements reduced into each rank, this rank's block into the output.
    Scatter(Vec<usize>, Tensor),
}

/// Shares every rank's outcome of preparing the op `ready` (one exchange over the
/// engine's transport, in the same place of the same cycle on every rank): this
/// rank's own error, or [`Error::PeerFailed`] naming the first other rank that could
/// not run it (with what `hand_back` gives of this rank's prepared op: its tensors,
/// which were never sent), or the prepared op when every rank can.
fn agree<T>(
    mpi: &mut dyn Transport,
    ready: &Ready,
    mine: Result<T>,
    hand_back: impl FnOnce(T) -> Vec<Tensor>,
) -> Result<T, SubmitError> {
    let why = match &mine {
        Ok(_) => String::new(),
        Err(e) => e.to_string(),
    };
    let all = mpi.exchange(why.as_bytes(), &mut |_: Duration| {})?;
    let me = mpi.topology().rank;
    let failed = all
        .iter()
        .enumerate()
        .find(|(r, why)| *r != me && !why.is_empty());
    match (mine, failed) {
        (Err(e), _) => Err(e.into()),
        (Ok(p), Some((rank, why))) => {
            let e = Error::PeerFailed {
                op: ready.kind.name(),
                name: ready.key.to_string(),
                rank,
                message: String::from_utf8_lossy(why).into_owned(),
            };
            Err(SubmitError::new(e, hand_back(p)))
        }
        (Ok(p), None) => Ok(p),
    }
}

/// Enqueues a prepared op. Its tensors go to `keep` whatever happens once it may have
/// been (partly) enqueued: on an error the device may still use them until it has
/// settled (issue 31, item 23).
fn enqueue(
    comm: &mut dyn DeviceComm,
    ready: &Ready,
    p: Prepared,
    keep: &mut Vec<Tensor>,
) -> Result<Output> {
    let first = ready.first();
    let r = reduction(first, comm.size());
    let mut inputs = p.inputs;
    let take = |inputs: &mut Tensors| take_tensor(ready, inputs);
    match p.plan {
        Plan::InPlace if ready.kind == OpKind::GroupedAllreduce => {
            let tensors = inputs.into_vec();
            if let Err(e) = comm.allreduce(&tensors, r) {
                keep.extend(tensors);
                return Err(e);
            }
            Ok(Output::Tensors(tensors))
        }
        Plan::InPlace => {
            let tensor = take(&mut inputs)?;
            let done = if ready.kind == OpKind::Broadcast {
                comm.broadcast(&tensor, first.root)
            } else {
                comm.allreduce(std::slice::from_ref(&tensor), r)
            };
            Ok(Output::Tensor(kept(keep, tensor, done)?))
        }
        Plan::Gather(counts, out) => {
            let tensor = take(&mut inputs)?;
            let done = comm.allgatherv(&tensor, &out, &counts);
            keep.push(tensor);
            Ok(Output::Tensor(kept(keep, out, done)?))
        }
        Plan::Alltoall(l, out) => {
            let tensor = take(&mut inputs)?;
            let done = comm.alltoallv(&tensor, &l.send_counts, &out, &l.recv_counts);
            keep.push(tensor);
            Ok(Output::Alltoall(AlltoallOutput {
                tensor: kept(keep, out, done)?,
                received_splits: l.recv_rows,
            }))
        }
        Plan::Scatter(counts, mut out) => {
            let mut tensor = take(&mut inputs)?;
            let done = comm.reduce_scatter(&mut tensor, &mut out, &counts, r);
            keep.push(tensor);
            Ok(Output::Tensor(kept(keep, out, done)?))
        }
    }
}

/// `tensor` if `done` succeeded; otherwise the error, with `tensor` moved into `keep`
/// (the device may still use it).
fn kept(keep: &mut Vec<Tensor>, tensor: Tensor, done: Result<()>) -> Result<Tensor> {
    match done {
        Ok(()) => Ok(tensor),
        Err(e) => {
            keep.push(tensor);
            Err(e)
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        self.drain();
    }
}
