//! Runs negotiated ops on CUDA tensors (feature `nccl`): enqueues NCCL calls and
//! device-to-device copies on the NCCL stream, records a CUDA event after each op, and
//! completes the op's handle once its event has fired — the engine never waits for the
//! whole stream and keeps negotiating meanwhile.
//!
//! Scale factors NCCL can apply itself (float sums and averages, via PreMulSum) are
//! applied there; the rest (integer averages, scaled min/max/product) take a slow path
//! through host memory with the same rounding as CPU tensors.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result as cu, CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::layout::{
    allgather_layout, alltoall_layout, first_tensor, fused_inputs, local_or_zeros, post_factor,
    reducescatter_layout, scale_bytes, take_tensor,
};
use super::negotiate::Ready;
use super::request::{OpKind, RequestMeta, Tensors};
use crate::device::{self, cuda_err, CudaData};
use crate::error::{Error, Result};
use crate::handle::{Completer, Output};
use crate::tensor::{DType, Tensor};
use crate::transport::nccl::{can_scale, DevicePtr as Ptr, Nccl};
use crate::transport::Transport;
use crate::vocab::AlltoallOutput;

/// A fusion batch member: the response, this rank's tensors and handle (none on a
/// joined rank).
pub(super) type Member<'a> = (&'a Ready, Option<Tensors>, Option<Completer>);

/// An enqueued op whose handles complete when `event` has fired.
struct Inflight {
    event: CudaEvent,
    finish: Vec<(Completer, Output)>,
    /// Device buffers the op reads that are not part of its output (inputs of
    /// allgather / alltoall / reducescatter, a joined rank's zeros): freed only after
    /// the event, since their allocations are freed on their own streams.
    keep: Vec<Tensor>,
}

/// The GPU side of the engine.
#[derive(Default)]
pub(super) struct Gpu {
    nccl: Option<Nccl>,
    /// The persistent device fusion buffer (grown to the largest batch).
    fusion: Option<CudaSlice<u8>>,
    inflight: VecDeque<Inflight>,
    /// Completion events whose ops have finished, for reuse (creating one per op
    /// costs a driver call).
    spare_events: Vec<CudaEvent>,
    /// How long NCCL may take to create the communicator or to finish a call that
    /// returned `ncclInProgress` (None: [`nccl_timeout`] of the default).
    nccl_timeout: Option<Duration>,
}

/// NCCL's limit for a collective timeout of `collective`: half of it, so that a rank
/// whose NCCL never comes up is named before the watchdog ends the job; 150 s when
/// the collective timeout is off (0).
pub(super) fn nccl_timeout(collective: Duration) -> Duration {
    if collective.is_zero() {
        Duration::from_secs(150)
    } else {
        collective / 2
    }
}

impl Gpu {
    /// Bounds NCCL's setup and calls by [`nccl_timeout`] of `collective_timeout`.
    pub(super) fn set_timeout(&mut self, collective_timeout: Duration) {
        self.nccl_timeout = Some(nccl_timeout(collective_timeout));
    }

    /// Whether ops are still running on the device.
    pub(super) fn busy(&self) -> bool {
        !self.inflight.is_empty()
    }

    /// Completes, in order, every op whose event has fired.
    pub(super) fn poll(&mut self) {
        while let Some(front) = self.inflight.front() {
            let state = front.event.try_is_complete();
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
                    self.spare_events.push(done.event);
                }
                Err(e) => {
                    for (c, _) in done.finish {
                        c.complete(Err(cuda_err("cuEventQuery")(e)));
                    }
                }
            }
        }
    }

    /// Waits for every op on the device and completes their handles.
    pub(super) fn drain(&mut self) {
        for f in &self.inflight {
            if let Err(e) = f.event.synchronize() {
                tracing::warn!(error = %e, "waiting for a GPU op failed");
            }
        }
        self.poll();
    }

    /// Completes `finish` (and frees `keep`) once everything enqueued so far has run.
    fn finish_later(&mut self, finish: Vec<(Completer, Output)>, keep: Vec<Tensor>) {
        let spare = self.spare_events.pop();
        let recorded = self.nccl.as_ref().map(|n| match spare {
            Some(e) => e.record(n.stream()).map(|()| e),
            None => n.stream().record_event(None),
        });
        let event = match recorded {
            Some(Ok(e)) => e,
            Some(Err(e)) => {
                let message = e.to_string();
                for (c, _) in finish {
                    c.complete(Err(Error::Cuda {
                        call: "cuEventRecord",
                        message: message.clone(),
                    }));
                }
                return;
            }
            None => {
                for (c, _) in finish {
                    c.complete(Err(Error::Internal("GPU op without a communicator".into())));
                }
                return;
            }
        };
        self.inflight.push_back(Inflight {
            event,
            finish,
            keep,
        });
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
                    Some(c) => c.complete(Err(e)),
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
                    c.complete(Err(e.replicate()));
                }
            }
        }
    }

    /// After a failed op: waits for whatever it enqueued before freeing its buffers. A
    /// failed or timed-out NCCL call has aborted the communicator already, which ends
    /// its kernels, so this wait cannot hang on a peer that never comes.
    fn settle(&mut self, keep: Vec<Tensor>) {
        if let Some(n) = &self.nccl {
            if let Err(e) = n.stream().synchronize() {
                tracing::warn!(error = %e, "waiting for the NCCL stream after a failed op");
            }
        }
        drop(keep);
    }

    /// The communicator, created on first use on the device of `local`'s tensors (or,
    /// on a joined rank, the device of this rank's local rank).
    fn comm(&mut self, mpi: &mut dyn Transport, local: Option<&[Tensor]>) -> Result<&Nccl> {
        let wanted = match local.and_then(|l| l.first()) {
            Some(t) => match t.device() {
                crate::tensor::Device::Cuda(i) => Some(i),
                other => {
                    return Err(Error::Internal(format!(
                        "CPU tensor on the GPU path ({other})"
                    )))
                }
            },
            None => None,
        };
        if self.nccl.is_none() {
            let ordinal = match wanted {
                Some(i) => i,
                None => mpi.topology().local_rank % device::device_count()?.max(1),
            };
            let timeout = self
                .nccl_timeout
                .unwrap_or_else(|| nccl_timeout(Duration::ZERO));
            self.nccl = Some(Nccl::connect(mpi, ordinal, timeout)?);
        }
        let nccl = self
            .nccl
            .as_ref()
            .ok_or_else(|| Error::Internal("NCCL communicator missing".into()))?;
        nccl.usable()?;
        if let Some(i) = wanted {
            if i != nccl.ordinal() {
                return Err(Error::WrongDevice {
                    what: "NCCL collective",
                    expected: crate::tensor::Device::Cuda(nccl.ordinal()),
                    actual: crate::tensor::Device::Cuda(i),
                    tensors: Vec::new(),
                });
            }
        }
        nccl.stream()
            .context()
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        Ok(nccl)
    }

    fn run(
        &mut self,
        mpi: &mut dyn Transport,
        ready: &Ready,
        local: Option<Tensors>,
        keep: &mut Vec<Tensor>,
    ) -> Result<Output> {
        let nccl = self.comm(mpi, local.as_deref())?;
        let stream = nccl.stream().clone();
        let first = ready.first();
        let mut inputs = local_or_zeros(ready, local, |m| zeros(&stream, m.dtype, &m.shape))?;
        order_after(&stream, &inputs)?;
        let size = nccl.size();
        let take = |inputs: &mut Tensors| take_tensor(ready, inputs);
        match ready.kind {
            OpKind::Allreduce => {
                let tensor = take(&mut inputs)?;
                let ptr = ptr_of(&tensor)?;
                allreduce(nccl, ptr, tensor.len(), tensor.dtype(), first, size)?;
                Ok(Output::Tensor(tensor))
            }
            OpKind::GroupedAllreduce => Ok(Output::Tensors(grouped_allreduce(
                nccl,
                inputs.into_vec(),
                first,
                size,
            )?)),
            OpKind::Broadcast => Ok(Output::Tensor(broadcast(nccl, take(&mut inputs)?, first)?)),
            OpKind::Allgather => {
                let tensor = take(&mut inputs)?;
                let out = allgather(nccl, &stream, &tensor, ready)?;
                keep.push(tensor);
                Ok(Output::Tensor(out))
            }
            OpKind::Alltoall => {
                let tensor = take(&mut inputs)?;
                let out = alltoall(nccl, &stream, &tensor, ready)?;
                keep.push(tensor);
                Ok(Output::Alltoall(out))
            }
            OpKind::Reducescatter => {
                let tensor = take(&mut inputs)?;
                let (out, tensor) = reducescatter(nccl, &stream, tensor, first, size)?;
                keep.push(tensor);
                Ok(Output::Tensor(out))
            }
            OpKind::Barrier | OpKind::Join | OpKind::AddProcessSet => Err(Error::Internal(
                format!("{} reached the GPU executor", ready.kind.name()),
            )),
        }
    }

    fn run_fused(
        &mut self,
        mpi: &mut dyn Transport,
        members: Vec<(&Ready, Option<Tensors>)>,
        keep: &mut Vec<Tensor>,
    ) -> Result<Vec<Option<Tensor>>> {
        let Some((first_ready, _)) = members.first() else {
            return Ok(Vec::new());
        };
        let meta = first_ready.first().clone();
        // The device is that of the first member this rank holds.
        let local_first: Option<&[Tensor]> = members
            .iter()
            .find_map(|(_, l)| l.as_deref())
            .filter(|l| !l.is_empty())
            .map(|l| &l[..1]);
        let nccl = self.comm(mpi, local_first)?;
        let stream = nccl.stream().clone();
        let size = nccl.size();
        let on = crate::tensor::Device::Cuda(nccl.ordinal());
        let dtype = first_tensor(&meta, 0)?.dtype;
        let (tensors, mine) = fused_inputs(members, |m| zeros(&stream, m.dtype, &m.shape))?;
        // The copies below are device-to-device on the communicator's device: every
        // member must be there, not only the first.
        if let Some(t) = tensors.iter().find(|t| t.device() != on) {
            return Err(Error::WrongDevice {
                what: "fused NCCL allreduce",
                expected: on,
                actual: t.device(),
                tensors: Vec::new(),
            });
        }
        order_after(&stream, &tensors)?;
        let ptrs = tensors.iter().map(ptr_of).collect::<Result<Vec<_>>>()?;
        let total: usize = tensors.iter().map(Tensor::num_bytes).sum();
        let grow = self.fusion.as_ref().is_none_or(|b| b.len() < total);
        if grow {
            self.fusion = None;
            // SAFETY: every byte used is written by the copies below first.
            self.fusion =
                Some(unsafe { stream.alloc::<u8>(total.max(1)) }.map_err(cuda_err("cuMemAlloc"))?);
        }
        let nccl = self
            .nccl
            .as_ref()
            .ok_or_else(|| Error::Internal("NCCL communicator missing".into()))?;
        let buf = self
            .fusion
            .as_ref()
            .ok_or_else(|| Error::Internal("fusion buffer missing".into()))?;
        let (base, _record) = buf.device_ptr(&stream);
        let mut at = 0u64;
        for (t, &p) in tensors.iter().zip(&ptrs) {
            let n = t.num_bytes();
            // SAFETY: both ranges lie inside their allocations; same device.
            unsafe { cu::memcpy_dtod_async(base + at, p, n, stream.cu_stream()) }
                .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
            at += n as u64;
        }
        allreduce(nccl, base, total / dtype.size_of(), dtype, &meta, size)?;
        let mut at = 0u64;
        for (t, &p) in tensors.iter().zip(&ptrs) {
            let n = t.num_bytes();
            // SAFETY: as above.
            unsafe { cu::memcpy_dtod_async(p, base + at, n, stream.cu_stream()) }
                .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
            at += n as u64;
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
}

impl Drop for Gpu {
    fn drop(&mut self) {
        self.drain();
    }
}

/// Allreduce of `count` elements at `ptr` with `meta`'s op and scale factors.
/// Reduces every member of a group in place. When NCCL applies the scale factors
/// itself, the calls form one NCCL group (launched together); integer scaling goes
/// through the host, which waits on the stream, so those members are reduced one by
/// one.
fn grouped_allreduce(
    nccl: &Nccl,
    tensors: Vec<Tensor>,
    meta: &RequestMeta,
    size: usize,
) -> Result<Vec<Tensor>> {
    let total = meta.prescale * post_factor(meta, size);
    let native = tensors.iter().all(|t| can_scale(t.dtype(), meta.op, total));
    let each = || -> Result<()> {
        for t in &tensors {
            allreduce(nccl, ptr_of(t)?, t.len(), t.dtype(), meta, size)?;
        }
        Ok(())
    };
    if native {
        nccl.group(each)?;
    } else {
        each()?;
    }
    Ok(tensors)
}

fn broadcast(nccl: &Nccl, tensor: Tensor, meta: &RequestMeta) -> Result<Tensor> {
    if !tensor.is_empty() {
        // SAFETY: the tensor's own allocation of `len` elements, kept alive in the
        // output until the op's event has fired.
        unsafe { nccl.broadcast(ptr_of(&tensor)?, tensor.len(), tensor.dtype(), meta.root) }?;
    }
    Ok(tensor)
}

/// Gathers every rank's `tensor` into a new one; `tensor` must stay alive until the
/// op's event has fired.
fn allgather(
    nccl: &Nccl,
    stream: &Arc<CudaStream>,
    tensor: &Tensor,
    ready: &Ready,
) -> Result<Tensor> {
    let (counts, shape) = allgather_layout(ready, tensor.shape())?;
    let out = empty(stream, tensor.dtype(), &shape)?;
    if !out.is_empty() {
        // SAFETY: `out` holds the sum of `counts`, `tensor` this rank's count.
        unsafe { nccl.allgatherv(ptr_of(tensor)?, ptr_of(&out)?, &counts, tensor.dtype()) }?;
    }
    Ok(out)
}

/// Exchanges `tensor`'s row blocks; `tensor` must stay alive until the op's event
/// has fired.
fn alltoall(
    nccl: &Nccl,
    stream: &Arc<CudaStream>,
    tensor: &Tensor,
    ready: &Ready,
) -> Result<AlltoallOutput> {
    let l = alltoall_layout(ready, nccl.rank(), tensor.shape())?;
    let out = empty(stream, tensor.dtype(), &l.shape)?;
    // SAFETY: the buffers hold the sums of their counts.
    unsafe {
        nccl.alltoallv(
            ptr_of(tensor)?,
            &l.send_counts,
            ptr_of(&out)?,
            &l.recv_counts,
            tensor.dtype(),
        )
    }?;
    Ok(AlltoallOutput {
        tensor: out,
        received_splits: l.recv_rows,
    })
}

/// Reduces `tensor` and scatters the result: returns this rank's block and the
/// (prescaled) input, which must stay alive until the op's event has fired. NCCL
/// applies both scale factors when it can; otherwise the host does.
fn reducescatter(
    nccl: &Nccl,
    stream: &Arc<CudaStream>,
    mut tensor: Tensor,
    meta: &RequestMeta,
    size: usize,
) -> Result<(Tensor, Tensor)> {
    let (counts, shape) = reducescatter_layout(tensor.shape(), size, nccl.rank());
    let mut out = empty(stream, tensor.dtype(), &shape)?;
    let dtype = tensor.dtype();
    let total = meta.prescale * post_factor(meta, size);
    let (in_nccl, pre, post) = if can_scale(dtype, meta.op, total) {
        (total, 1.0, 1.0)
    } else {
        (1.0, meta.prescale, post_factor(meta, size))
    };
    scale_on_host(stream, &mut tensor, pre)?;
    // SAFETY: as for allgather.
    unsafe {
        nccl.reduce_scatter(
            ptr_of(&tensor)?,
            ptr_of(&out)?,
            &counts,
            dtype,
            meta.op,
            in_nccl,
        )
    }?;
    scale_on_host(stream, &mut out, post)?;
    Ok((out, tensor))
}

fn allreduce(
    nccl: &Nccl,
    ptr: Ptr,
    count: usize,
    dtype: DType,
    meta: &RequestMeta,
    size: usize,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let total = meta.prescale * post_factor(meta, size);
    if can_scale(dtype, meta.op, total) {
        // SAFETY: `ptr` is a live allocation of `count` elements on the NCCL device,
        // kept alive until the op's event has fired.
        return unsafe { nccl.allreduce(ptr, count, dtype, meta.op, total) };
    }
    let stream = nccl.stream();
    host_scale_ptr(stream, ptr, count * dtype.size_of(), dtype, meta.prescale)?;
    // SAFETY: as above.
    unsafe { nccl.allreduce(ptr, count, dtype, meta.op, 1.0) }?;
    host_scale_ptr(
        stream,
        ptr,
        count * dtype.size_of(),
        dtype,
        post_factor(meta, size),
    )
}

/// The slow path for factors NCCL cannot apply: copy to the host, scale like a CPU
/// tensor, copy back (waits for the stream).
fn host_scale_ptr(
    stream: &Arc<CudaStream>,
    ptr: Ptr,
    bytes: usize,
    dtype: DType,
    f: f64,
) -> Result<()> {
    if f == 1.0 || bytes == 0 {
        return Ok(());
    }
    let mut host = vec![0u8; bytes];
    // SAFETY: `ptr` holds `bytes` bytes; the stream is synchronised before `host` is
    // read and before it is dropped.
    unsafe {
        cu::memcpy_dtoh_async(&mut host, ptr, stream.cu_stream())
            .map_err(cuda_err("cuMemcpyDtoHAsync"))?;
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
    }
    scale_bytes(&mut host, dtype, f);
    // SAFETY: as above.
    unsafe {
        cu::memcpy_htod_async(ptr, &host, stream.cu_stream())
            .map_err(cuda_err("cuMemcpyHtoDAsync"))?;
        stream
            .synchronize()
            .map_err(cuda_err("cuStreamSynchronize"))?;
    }
    Ok(())
}

fn scale_on_host(stream: &Arc<CudaStream>, t: &mut Tensor, f: f64) -> Result<()> {
    let (bytes, dtype) = (t.num_bytes(), t.dtype());
    host_scale_ptr(stream, ptr_of(t)?, bytes, dtype, f)
}

/// The device address of a CUDA tensor.
fn ptr_of(t: &Tensor) -> Result<Ptr> {
    let data = t
        .cuda_data()
        .ok_or_else(|| Error::Internal("CPU tensor on the GPU path".into()))?;
    Ok(data.ptr(data.stream()))
}

/// Makes `stream` wait for the work already enqueued on the streams `tensors` were
/// made on (one event per distinct stream), so that NCCL reads what the user wrote.
fn order_after(stream: &CudaStream, tensors: &[Tensor]) -> Result<()> {
    let mut seen = vec![stream.cu_stream()];
    for data in tensors.iter().filter_map(Tensor::cuda_data) {
        let theirs = data.stream();
        if seen.contains(&theirs.cu_stream()) {
            continue;
        }
        seen.push(theirs.cu_stream());
        let event = theirs
            .record_event(None)
            .map_err(cuda_err("cuEventRecord"))?;
        stream.wait(&event).map_err(cuda_err("cuStreamWaitEvent"))?;
    }
    Ok(())
}

/// A tensor of uninitialised device memory (every element is written by the op).
fn empty(stream: &Arc<CudaStream>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product::<usize>() * dtype.size_of();
    let data = CudaData::alloc(stream, dtype, n)?;
    Ok(Tensor::from_cuda_parts(dtype, data, shape.to_vec()))
}

/// Zeros on the device (what a joined rank contributes).
fn zeros(stream: &Arc<CudaStream>, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product::<usize>() * dtype.size_of();
    let data = CudaData::zeros(stream, dtype, n)?;
    Ok(Tensor::from_cuda_parts(dtype, data, shape.to_vec()))
}
