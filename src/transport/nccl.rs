//! The GPU data plane: NCCL collectives on CUDA device memory (feature `nccl`).
//!
//! Negotiation stays on MPI. The communicator is created on the engine thread the
//! first time a CUDA op runs: every rank reports over MPI whether it can use NCCL on
//! its device, rank 0 adds the NCCL unique id, and only when every rank is ready do all
//! of them call `ncclCommInitRank` — so a rank without a GPU or without libnccl makes
//! the op fail on every rank with that rank named, instead of leaving the others
//! blocked in NCCL's bootstrap. All NCCL work is enqueued on one stream owned here.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use super::Transport;
use crate::device;
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::vocab::ReduceOp;

/// Bytes in an NCCL unique id.
const ID_BYTES: usize = 128;

/// What a rank tells the others before the communicator is created.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Setup {
    /// `Err(reason)` when this rank cannot use NCCL on its device.
    pub(crate) ready: std::result::Result<(), String>,
    /// The NCCL unique id (rank 0 only).
    pub(crate) id: Option<Vec<u8>>,
}

/// Every rank's [`Setup`], in rank order → rank 0's id, or an error naming every rank
/// that is not ready. Identical on every rank, so either all create the communicator
/// or none does.
pub(crate) fn decide(setups: &[Setup]) -> Result<[u8; ID_BYTES]> {
    let failed: Vec<String> = setups
        .iter()
        .enumerate()
        .filter_map(|(r, s)| s.ready.as_ref().err().map(|why| format!("rank {r}: {why}")))
        .collect();
    if !failed.is_empty() {
        return Err(Error::CudaUnavailable(format!(
            "cannot start NCCL: {}",
            failed.join("; ")
        )));
    }
    let id = setups
        .first()
        .and_then(|s| s.id.as_deref())
        .ok_or_else(|| Error::Internal("rank 0 sent no NCCL unique id".into()))?;
    id.try_into().map_err(|_| {
        Error::Internal(format!(
            "NCCL unique id from rank 0 has {} bytes, not {ID_BYTES}",
            id.len()
        ))
    })
}

fn nccl_err(call: &'static str) -> impl Fn(nccl::NcclError) -> Error {
    move |e| Error::Cuda {
        call,
        message: describe(&e),
    }
}

/// NCCL's own words for an error: the result code, its description and the last
/// error message NCCL logged on this thread (e.g. "Duplicate GPU detected").
fn describe(e: &nccl::NcclError) -> String {
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: NCCL returns NUL-terminated static or thread-local strings.
            unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .trim()
                .to_string()
        }
    };
    // SAFETY: plain lookups; the library is loaded (we got an error from it).
    let (what, last) = unsafe {
        (
            text(sys::ncclGetErrorString(e.0)),
            text(sys::ncclGetLastError(std::ptr::null_mut())),
        )
    };
    let mut msg = format!("{:?}: {what}", e.0);
    if !last.is_empty() {
        msg.push_str(&format!(" ({last})"));
    }
    msg
}

fn data_type(dtype: DType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match dtype {
        DType::U8 => T::ncclUint8,
        DType::I8 => T::ncclInt8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
    }
}

fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t as O;
    match op {
        ReduceOp::Average | ReduceOp::Sum => O::ncclSum,
        ReduceOp::Min => O::ncclMin,
        ReduceOp::Max => O::ncclMax,
        ReduceOp::Product => O::ncclProd,
    }
}

/// Whether NCCL itself can apply a scale factor `f` to a reduction of `dtype` with
/// `op`: a sum of floats multiplied by `f` first (`ncclRedOpCreatePreMulSum`). Other
/// cases are scaled by the engine on the host.
pub(crate) fn can_scale(dtype: DType, op: ReduceOp, f: f64) -> bool {
    f == 1.0 || (dtype.is_float() && matches!(op, ReduceOp::Sum | ReduceOp::Average))
}

/// A device pointer and a count, for the calls below.
pub(crate) type DevicePtr = cudarc::driver::sys::CUdeviceptr;

/// One NCCL communicator over every rank of the job, with its stream.
#[derive(Debug)]
pub(crate) struct Nccl {
    comm: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
}

impl Nccl {
    /// Creates the communicator on device `ordinal`; collective over `mpi` (every rank
    /// must call it at the same point, which the engine's global order guarantees).
    pub(crate) fn connect(mpi: &mut dyn Transport, ordinal: usize) -> Result<Nccl> {
        let topo = mpi.topology();
        let local = Self::prepare(ordinal, topo.rank == 0);
        let setup = match &local {
            Ok((_, id)) => Setup {
                ready: Ok(()),
                id: id.clone(),
            },
            Err(e) => Setup {
                ready: Err(e.to_string()),
                id: None,
            },
        };
        let bytes = postcard::to_stdvec(&setup)
            .map_err(|e| Error::Internal(format!("encoding NCCL setup: {e}")))?;
        let all = mpi.exchange(&bytes, &mut |_| {})?;
        let setups = all
            .iter()
            .map(|b| postcard::from_bytes::<Setup>(b))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Internal(format!("decoding NCCL setup: {e}")))?;
        let id = decide(&setups)?;
        let (stream, _) = local?;
        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
        for (dst, src) in internal.iter_mut().zip(id) {
            *dst = src as std::ffi::c_char;
        }
        let id = sys::ncclUniqueId { internal };
        let mut comm = MaybeUninit::uninit();
        let rank = i32::try_from(topo.rank).map_err(|_| Error::Internal("rank > i32".into()))?;
        let size = i32::try_from(topo.size).map_err(|_| Error::Internal("size > i32".into()))?;
        // SAFETY: `comm` is written by NCCL on success; every rank calls this with the
        // same id and size, each with its own rank.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), size, id, rank)
                .map_err(nccl_err("ncclCommInitRank"))?;
            comm.assume_init()
        };
        tracing::debug!(rank = topo.rank, ordinal, "NCCL communicator ready");
        Ok(Nccl {
            comm,
            stream,
            rank: topo.rank,
            size: topo.size,
        })
    }

    /// This rank's local checks: libnccl, the device and a stream; rank 0 also makes
    /// the unique id.
    fn prepare(ordinal: usize, root: bool) -> Result<(Arc<CudaStream>, Option<Vec<u8>>)> {
        let ctx: Arc<CudaContext> = device::context(ordinal)?;
        if !device::nccl_present() {
            return Err(Error::CudaUnavailable(
                "NCCL library not found (libnccl.so.2); install NCCL or put it on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let stream = ctx
            .new_stream()
            .map_err(device::cuda_err("cuStreamCreate"))?;
        let id = if root {
            let id = nccl::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
            Some(id.internal.iter().map(|&c| c as u8).collect())
        } else {
            None
        };
        Ok((stream, id))
    }

    /// The stream every NCCL call and copy of the engine is enqueued on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device the communicator was created on.
    pub(crate) fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    /// A reduction op for `op` with every input multiplied by `f` first (NCCL's
    /// PreMulSum); `None` when no scaling is needed. Destroy with [`Self::release_op`].
    fn scaled_op(&self, dtype: DType, op: ReduceOp, f: f64) -> Result<Option<sys::ncclRedOp_t>> {
        if f == 1.0 {
            return Ok(None);
        }
        if !can_scale(dtype, op, f) {
            return Err(Error::Internal(format!(
                "NCCL cannot scale {dtype} {op:?} by {f}"
            )));
        }
        let mut scalar = [0u8; 8];
        match dtype {
            DType::F16 => scalar[..2].copy_from_slice(&f16::from_f64(f).to_ne_bytes()),
            DType::BF16 => scalar[..2].copy_from_slice(&bf16::from_f64(f).to_ne_bytes()),
            DType::F32 => scalar[..4].copy_from_slice(&(f as f32).to_ne_bytes()),
            _ => scalar.copy_from_slice(&f.to_ne_bytes()),
        }
        let mut out = MaybeUninit::uninit();
        // SAFETY: the scalar is read immediately (host-immediate residence).
        unsafe {
            nccl::reduce_op_create_pre_mul_sum(
                out.as_mut_ptr(),
                scalar.as_mut_ptr().cast::<c_void>(),
                data_type(dtype),
                sys::ncclScalarResidence_t::ncclScalarHostImmediate,
                self.comm,
            )
            .map_err(nccl_err("ncclRedOpCreatePreMulSum"))?;
            Ok(Some(out.assume_init()))
        }
    }

    fn release_op(&self, op: Option<sys::ncclRedOp_t>) -> Result<()> {
        if let Some(op) = op {
            // SAFETY: `op` was created on this communicator and every call using it
            // has been enqueued, which is all NCCL requires before destroying it.
            unsafe { nccl::reduce_op_destroy(op, self.comm) }
                .map_err(nccl_err("ncclRedOpDestroy"))?;
        }
        Ok(())
    }

    /// In-place allreduce of `count` elements at `buf`, every input multiplied by
    /// `scale` first ([`can_scale`] must hold).
    ///
    /// # Safety
    /// `buf` must be a device allocation of at least `count` elements of `dtype` on
    /// this communicator's device, not freed before the stream has run the call.
    pub(crate) unsafe fn allreduce(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        scale: f64,
    ) -> Result<()> {
        let custom = self.scaled_op(dtype, op, scale)?;
        let ptr = buf as *mut c_void;
        // SAFETY: the caller's contract.
        let r = unsafe {
            nccl::all_reduce(
                ptr,
                ptr,
                count,
                data_type(dtype),
                custom.unwrap_or_else(|| red_op(op)),
                self.comm,
                self.cu_stream(),
            )
        };
        self.release_op(custom)?;
        r.map(|_| ()).map_err(nccl_err("ncclAllReduce"))
    }

    /// Broadcast of `count` elements at `buf` from `root`.
    ///
    /// # Safety
    /// As for [`Self::allreduce`].
    pub(crate) unsafe fn broadcast(
        &self,
        buf: DevicePtr,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        let ptr = buf as *mut c_void;
        let root = i32::try_from(root).map_err(|_| Error::Internal("root > i32".into()))?;
        // SAFETY: the caller's contract.
        unsafe {
            nccl::broadcast(
                ptr,
                ptr,
                count,
                data_type(dtype),
                root,
                self.comm,
                self.cu_stream(),
            )
        }
        .map(|_| ())
        .map_err(nccl_err("ncclBroadcast"))
    }

    /// Rank `r` contributes `counts[r]` elements (`send`); `recv` gets them
    /// concatenated. NCCL has no allgatherv: one broadcast per rank, in one group.
    ///
    /// # Safety
    /// `send` holds `counts[rank]` and `recv` the sum of `counts` elements of `dtype`,
    /// as for [`Self::allreduce`].
    pub(crate) unsafe fn allgatherv(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let width = dtype.size_of() as u64;
        self.group(|| {
            let mut at = 0u64;
            for (r, &n) in counts.iter().enumerate() {
                let dst = recv + at * width;
                let src = if r == self.rank { send } else { dst };
                // SAFETY: the caller's contract; offsets stay inside `recv`.
                unsafe {
                    nccl::broadcast(
                        src as *const c_void,
                        dst as *mut c_void,
                        n,
                        data_type(dtype),
                        r as i32,
                        self.comm,
                        self.cu_stream(),
                    )
                }
                .map_err(nccl_err("ncclBroadcast"))?;
                at += n as u64;
            }
            Ok(())
        })
    }

    /// Sends `send_counts[r]` elements to rank `r` and receives `recv_counts[r]` from
    /// it: grouped point-to-point calls.
    ///
    /// # Safety
    /// `send` and `recv` hold the sums of their counts, as for [`Self::allreduce`].
    pub(crate) unsafe fn alltoallv(
        &self,
        send: DevicePtr,
        send_counts: &[usize],
        recv: DevicePtr,
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        let width = dtype.size_of() as u64;
        self.group(|| {
            let (mut s, mut r) = (0u64, 0u64);
            for peer in 0..self.size {
                let (ns, nr) = (send_counts[peer], recv_counts[peer]);
                // SAFETY: the caller's contract; offsets stay inside the buffers.
                unsafe {
                    if ns > 0 {
                        nccl::send(
                            (send + s * width) as *const c_void,
                            ns,
                            data_type(dtype),
                            peer as i32,
                            self.comm,
                            self.cu_stream(),
                        )
                        .map_err(nccl_err("ncclSend"))?;
                    }
                    if nr > 0 {
                        nccl::recv(
                            (recv + r * width) as *mut c_void,
                            nr,
                            data_type(dtype),
                            peer as i32,
                            self.comm,
                            self.cu_stream(),
                        )
                        .map_err(nccl_err("ncclRecv"))?;
                    }
                }
                s += ns as u64;
                r += nr as u64;
            }
            Ok(())
        })
    }

    /// Reduces `send` over all ranks (each input multiplied by `scale` first) and
    /// leaves block `r` (`counts[r]` elements) in rank `r`'s `recv`: one reduce per
    /// block rooted at its owner, in one group (NCCL's reduce-scatter needs equal
    /// blocks).
    ///
    /// # Safety
    /// `send` holds the sum of `counts`, `recv` `counts[rank]` elements, as for
    /// [`Self::allreduce`].
    pub(crate) unsafe fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
        scale: f64,
    ) -> Result<()> {
        let width = dtype.size_of() as u64;
        let custom = self.scaled_op(dtype, op, scale)?;
        let nccl_op = custom.unwrap_or_else(|| red_op(op));
        let r = self.group(|| {
            let mut at = 0u64;
            for (root, &n) in counts.iter().enumerate() {
                let dst = if root == self.rank { recv } else { 0 };
                // SAFETY: the caller's contract; `recvbuff` is only used on the root.
                unsafe {
                    nccl::reduce(
                        (send + at * width) as *const c_void,
                        dst as *mut c_void,
                        n,
                        data_type(dtype),
                        nccl_op,
                        root as i32,
                        self.comm,
                        self.cu_stream(),
                    )
                }
                .map_err(nccl_err("ncclReduce"))?;
                at += n as u64;
            }
            Ok(())
        });
        self.release_op(custom)?;
        r
    }

    /// Runs `calls` between ncclGroupStart and ncclGroupEnd (the group is closed also
    /// when a call fails). No stream synchronisation may happen inside.
    pub(crate) fn group(&self, calls: impl FnOnce() -> Result<()>) -> Result<()> {
        nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let r = calls();
        let end = nccl::group_end().map_err(nccl_err("ncclGroupEnd"));
        r.and(end.map(|_| ()))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // Finish what was enqueued, then free the communicator.
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(error = %e, "waiting for NCCL work at shutdown failed");
        }
        // SAFETY: the communicator is not used after this.
        if let Err(e) = unsafe { nccl::comm_destroy(self.comm) } {
            tracing::warn!(error = ?e, "ncclCommDestroy failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(id: Option<Vec<u8>>) -> Setup {
        Setup { ready: Ok(()), id }
    }

    #[test]
    fn every_rank_ready_gives_rank_0s_id() {
        let id: Vec<u8> = (0..128).map(|i| i as u8).collect();
        let setups = vec![ready(Some(id.clone())), ready(None), ready(None)];
        assert_eq!(decide(&setups).unwrap().to_vec(), id);
    }

    #[test]
    fn a_rank_without_a_gpu_fails_everyone_naming_it() {
        let setups = vec![
            ready(Some(vec![7; 128])),
            Setup {
                ready: Err("no CUDA device".into()),
                id: None,
            },
            ready(None),
            Setup {
                ready: Err("NCCL library not found".into()),
                id: None,
            },
        ];
        let err = decide(&setups).unwrap_err().to_string();
        assert_eq!(
            err,
            "CUDA is not available: cannot start NCCL: rank 1: no CUDA device; rank 3: NCCL library not found"
        );
    }

    #[test]
    fn a_short_id_is_an_error_not_a_panic() {
        let err = decide(&[ready(Some(vec![1; 5]))]).unwrap_err().to_string();
        assert!(err.contains("has 5 bytes"), "{err}");
    }

    #[test]
    fn setup_survives_the_wire() {
        let s = Setup {
            ready: Err("x".into()),
            id: None,
        };
        let bytes = postcard::to_stdvec(&s).unwrap();
        assert_eq!(postcard::from_bytes::<Setup>(&bytes).unwrap(), s);
    }

    #[test]
    fn nccl_scales_only_float_sums() {
        assert!(can_scale(DType::F32, ReduceOp::Average, 0.5));
        assert!(can_scale(DType::BF16, ReduceOp::Sum, 2.0));
        assert!(!can_scale(DType::I32, ReduceOp::Average, 0.5));
        assert!(!can_scale(DType::F32, ReduceOp::Max, 2.0));
        assert!(can_scale(DType::I32, ReduceOp::Max, 1.0));
    }
}
