//! The NCCL communicator as the engine sees it ([`DeviceComm`]): ops on CUDA
//! tensors enqueued on its stream, a persistent device fusion buffer, and completion
//! marks that are CUDA events.
//!
//! Scale factors NCCL can apply itself (float sums and averages, via PreMulSum) are
//! applied there; the rest (integer averages, scaled min/max/product) take a slow path
//! through host memory with the same rounding as CPU tensors.

use std::collections::VecDeque;

use cudarc::driver::{result as cu, CudaEvent, CudaSlice, CudaStream, DevicePtr as _};

use super::{can_scale, DevicePtr as Ptr, Nccl};
use crate::error::{Error, Result};
use crate::tensor::device::{cuda_err, CudaData};
use crate::tensor::{scale_bytes, DType, Tensor};
use crate::transport::device::{DeviceComm, Reduction};
use crate::transport::Transport;

/// An NCCL communicator with what the engine's ops need beside it.
pub(crate) struct NcclDevice {
    nccl: Nccl,
    /// The persistent device fusion buffer (grown to the largest batch).
    fusion: Option<CudaSlice<u8>>,
    /// Recorded marks not yet reached, oldest first.
    marks: VecDeque<(u64, CudaEvent)>,
    /// Events of reached marks, for reuse (creating one costs a driver call).
    spare: Vec<CudaEvent>,
    next_mark: u64,
}

/// Opens the job's NCCL communicator on `ordinal` (None: this rank's local rank
/// modulo the devices it sees). Collective over every rank of `mpi`.
pub(crate) fn open(
    mpi: &mut dyn Transport,
    ordinal: Option<usize>,
    timeout: std::time::Duration,
) -> Result<Box<dyn DeviceComm>> {
    let ordinal = match ordinal {
        Some(i) => i,
        None => mpi.topology().local_rank % crate::tensor::device::device_count()?.max(1),
    };
    Ok(Box::new(NcclDevice {
        nccl: Nccl::connect(mpi, ordinal, timeout)?,
        fusion: None,
        marks: VecDeque::new(),
        spare: Vec::new(),
        next_mark: 0,
    }))
}

impl NcclDevice {
    fn stream(&self) -> &std::sync::Arc<CudaStream> {
        self.nccl.stream()
    }

    /// Allreduce of `count` elements at `ptr`.
    fn allreduce_ptr(&self, ptr: Ptr, count: usize, dtype: DType, r: Reduction) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let total = r.prescale * r.postscale;
        if can_scale(dtype, r.op, total) {
            // SAFETY: `ptr` is a live allocation of `count` elements on the NCCL device,
            // kept alive by the caller until the op's mark is reached.
            return unsafe { self.nccl.allreduce(ptr, count, dtype, r.op, total) };
        }
        let bytes = count * dtype.size_of();
        host_scale_ptr(self.stream(), ptr, bytes, dtype, r.prescale)?;
        // SAFETY: as above.
        unsafe { self.nccl.allreduce(ptr, count, dtype, r.op, 1.0) }?;
        host_scale_ptr(self.stream(), ptr, bytes, dtype, r.postscale)
    }
}

impl DeviceComm for NcclDevice {
    fn ordinal(&self) -> usize {
        self.nccl.ordinal()
    }

    fn rank(&self) -> usize {
        self.nccl.rank()
    }

    fn size(&self) -> usize {
        self.nccl.size()
    }

    fn usable(&self) -> Result<()> {
        self.nccl.usable()
    }

    fn prepare(&mut self, tensors: &[Tensor]) -> Result<()> {
        let stream = self.stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(cuda_err("cuCtxSetCurrent"))?;
        // One event per distinct stream the tensors were made on.
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

    fn zeros(&mut self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n = crate::tensor::checked_len(shape, dtype)? * dtype.size_of();
        let data = CudaData::zeros(self.stream(), dtype, n)?;
        Ok(Tensor::from_cuda_parts(dtype, data, shape.to_vec()))
    }

    fn empty(&mut self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n = crate::tensor::checked_len(shape, dtype)? * dtype.size_of();
        let data = CudaData::alloc(self.stream(), dtype, n)?;
        Ok(Tensor::from_cuda_parts(dtype, data, shape.to_vec()))
    }

    /// When NCCL applies the scale factors itself, the calls form one NCCL group
    /// (launched together); integer scaling goes through the host, which waits on the
    /// stream, so those tensors are reduced one by one.
    fn allreduce(&mut self, tensors: &[Tensor], r: Reduction) -> Result<()> {
        let total = r.prescale * r.postscale;
        let each = || -> Result<()> {
            for t in tensors {
                self.allreduce_ptr(ptr_of(t)?, t.len(), t.dtype(), r)?;
            }
            Ok(())
        };
        let native = tensors.iter().all(|t| can_scale(t.dtype(), r.op, total));
        if native && tensors.len() > 1 {
            self.nccl.group(each)
        } else {
            each()
        }
    }

    fn allreduce_fused(&mut self, tensors: &[Tensor], r: Reduction) -> Result<()> {
        let Some(dtype) = tensors.first().map(Tensor::dtype) else {
            return Ok(());
        };
        let ptrs = tensors.iter().map(ptr_of).collect::<Result<Vec<_>>>()?;
        let total: usize = tensors.iter().map(Tensor::num_bytes).sum();
        if self.fusion.as_ref().is_none_or(|b| b.len() < total) {
            self.fusion = None;
            // SAFETY: every byte used is written by the copies below first.
            let buf = unsafe { self.stream().alloc::<u8>(total.max(1)) };
            self.fusion = Some(buf.map_err(cuda_err("cuMemAlloc"))?);
        }
        let stream = self.stream().clone();
        let buf = self
            .fusion
            .as_ref()
            .ok_or_else(|| Error::Internal("fusion buffer missing".into()))?;
        let (base, _record) = buf.device_ptr(&stream);
        let copy = |into_buffer: bool| -> Result<()> {
            let mut at = 0u64;
            for (t, &p) in tensors.iter().zip(&ptrs) {
                let n = t.num_bytes();
                let (dst, src) = if into_buffer {
                    (base + at, p)
                } else {
                    (p, base + at)
                };
                // SAFETY: both ranges lie inside their allocations; same device.
                unsafe { cu::memcpy_dtod_async(dst, src, n, stream.cu_stream()) }
                    .map_err(cuda_err("cuMemcpyDtoDAsync"))?;
                at += n as u64;
            }
            Ok(())
        };
        copy(true)?;
        self.allreduce_ptr(base, total / dtype.size_of(), dtype, r)?;
        copy(false)
    }

    fn broadcast(&mut self, tensor: &Tensor, root: usize) -> Result<()> {
        if tensor.is_empty() {
            return Ok(());
        }
        // SAFETY: the tensor's own allocation of `len` elements, kept alive by the
        // caller until the op's mark is reached.
        unsafe {
            self.nccl
                .broadcast(ptr_of(tensor)?, tensor.len(), tensor.dtype(), root)
        }
    }

    fn allgatherv(&mut self, tensor: &Tensor, out: &Tensor, counts: &[usize]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: `out` holds the sum of `counts`, `tensor` this rank's count; both
        // kept alive by the caller until the op's mark is reached.
        unsafe {
            self.nccl
                .allgatherv(ptr_of(tensor)?, ptr_of(out)?, counts, tensor.dtype())
        }
    }

    fn alltoallv(
        &mut self,
        tensor: &Tensor,
        send: &[usize],
        out: &Tensor,
        recv: &[usize],
    ) -> Result<()> {
        // SAFETY: the buffers hold the sums of their counts, kept alive as above.
        unsafe {
            self.nccl
                .alltoallv(ptr_of(tensor)?, send, ptr_of(out)?, recv, tensor.dtype())
        }
    }

    fn reduce_scatter(
        &mut self,
        tensor: &mut Tensor,
        out: &mut Tensor,
        counts: &[usize],
        r: Reduction,
    ) -> Result<()> {
        let dtype = tensor.dtype();
        let total = r.prescale * r.postscale;
        let (in_nccl, pre, post) = if can_scale(dtype, r.op, total) {
            (total, 1.0, 1.0)
        } else {
            (1.0, r.prescale, r.postscale)
        };
        scale_on_host(self.stream(), tensor, pre)?;
        // SAFETY: as for allgatherv.
        unsafe {
            self.nccl
                .reduce_scatter(ptr_of(tensor)?, ptr_of(out)?, counts, dtype, r.op, in_nccl)
        }?;
        scale_on_host(self.stream(), out, post)
    }

    fn mark(&mut self) -> Result<u64> {
        let event = match self.spare.pop() {
            Some(e) => e.record(self.stream()).map(|()| e),
            None => self.stream().record_event(None),
        }
        .map_err(cuda_err("cuEventRecord"))?;
        let mark = self.next_mark;
        self.next_mark += 1;
        self.marks.push_back((mark, event));
        Ok(mark)
    }

    fn reached(&mut self, mark: u64) -> Result<bool> {
        while let Some((m, event)) = self.marks.front() {
            if *m > mark {
                break;
            }
            if !event.try_is_complete().map_err(cuda_err("cuEventQuery"))? {
                return Ok(false);
            }
            if let Some((_, e)) = self.marks.pop_front() {
                self.spare.push(e);
            }
        }
        Ok(true)
    }

    fn settle(&mut self) {
        if let Err(e) = self.stream().synchronize() {
            tracing::warn!(error = %e, "waiting for the NCCL stream failed");
        }
    }
}

/// The slow path for factors NCCL cannot apply: copy to the host, scale like a CPU
/// tensor, copy back (waits for the stream).
fn host_scale_ptr(
    stream: &std::sync::Arc<CudaStream>,
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

fn scale_on_host(stream: &std::sync::Arc<CudaStream>, t: &mut Tensor, f: f64) -> Result<()> {
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
