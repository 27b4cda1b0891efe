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
use std::time::{Duration, Instant};

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
    /// How long a call that returned `ncclInProgress` may take.
    timeout: Duration,
    /// Set when a call failed or timed out and the communicator was aborted: what
    /// went wrong. Every later call fails with it, and drop skips the teardown.
    aborted: std::cell::OnceCell<String>,
}

impl Nccl {
    /// Creates the communicator on device `ordinal`; collective over `mpi` (every rank
    /// must call it at the same point, which the engine's global order guarantees).
    ///
    /// The communicator is non-blocking: its creation, and any NCCL call that cannot
    /// finish at once (connections are made at the first collective), is polled for at
    /// most `timeout`; past it the communicator is aborted and the op fails, so a rank
    /// whose NCCL never comes up does not leave the others stuck inside NCCL.
    pub(crate) fn connect(
        mpi: &mut dyn Transport,
        ordinal: usize,
        timeout: Duration,
    ) -> Result<Nccl> {
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
        let rank = i32::try_from(topo.rank).map_err(|_| Error::Internal("rank > i32".into()))?;
        let size = i32::try_from(topo.size).map_err(|_| Error::Internal("size > i32".into()))?;
        let started = init_comm(id, size, rank, timeout);
        // Whatever happened here, every rank learns what happened everywhere, so that a
        // rank whose init failed is named on all of them (the others' inits could only
        // time out waiting for it).
        let outcome: std::result::Result<(), String> = match &started {
            Ok(_) => Ok(()),
            Err(e) => Err(e.to_string()),
        };
        let outcomes = exchange_outcome(mpi, &outcome);
        let verdict = outcomes.and_then(|all| init_verdict(&all));
        let comm = match (started, verdict) {
            (Ok(comm), Ok(())) => comm,
            (started, verdict) => {
                if let Ok(comm) = started {
                    // SAFETY: a finished communicator no op has used; another rank's
                    // init failed or the outcomes could not be shared, so it is
                    // never used.
                    if let Err(e) = unsafe { nccl::comm_abort(comm) } {
                        tracing::warn!(error = ?e, "ncclCommAbort failed");
                    }
                }
                return Err(verdict.err().unwrap_or_else(|| {
                    Error::Internal("NCCL init failed here but every rank reported success".into())
                }));
            }
        };
        tracing::debug!(rank = topo.rank, ordinal, "NCCL communicator ready");
        Ok(Nccl {
            comm,
            stream,
            rank: topo.rank,
            size: topo.size,
            timeout,
            aborted: std::cell::OnceCell::new(),
        })
    }

    /// Fails when an earlier call aborted the communicator.
    pub(crate) fn usable(&self) -> Result<()> {
        match self.aborted.get() {
            None => Ok(()),
            Some(why) => Err(Error::CudaUnavailable(format!(
                "the NCCL communicator was aborted after an earlier failure ({why}); GPU \
                 collectives cannot continue in this job: restart it"
            ))),
        }
    }

    /// Whether an earlier call aborted the communicator.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.get().is_some()
    }

    /// Aborts the communicator after `e`: NCCL stops its kernels (so the stream can
    /// be waited for and the buffers freed) and frees it; returns `e`.
    fn abort(&self, e: Error) -> Error {
        if self.aborted.set(e.to_string()).is_ok() {
            // SAFETY: the communicator is never used after this (`usable` fails,
            // drop skips it).
            if let Err(a) = unsafe { nccl::comm_abort(self.comm) } {
                tracing::warn!(error = ?a, "ncclCommAbort failed");
            }
            tracing::error!(error = %e, "NCCL call failed; communicator aborted");
        }
        e
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
        self.usable()?;
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
        if self.is_aborted() {
            // The abort freed it with the communicator.
            return Ok(());
        }
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
        let settled = self.settle("ncclAllReduce", r);
        let released = self.release_op(custom);
        settled.and(released)
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
        self.usable()?;
        let ptr = buf as *mut c_void;
        let root = i32::try_from(root).map_err(|_| Error::Internal("root > i32".into()))?;
        // SAFETY: the caller's contract.
        let r = unsafe {
            nccl::broadcast(
                ptr,
                ptr,
                count,
                data_type(dtype),
                root,
                self.comm,
                self.cu_stream(),
            )
        };
        self.settle("ncclBroadcast", r)
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
        let released = self.release_op(custom);
        r.and(released)
    }

    /// Runs `calls` between ncclGroupStart and ncclGroupEnd (the group is closed also
    /// when a call fails). No stream synchronisation may happen inside.
    pub(crate) fn group(&self, calls: impl FnOnce() -> Result<()>) -> Result<()> {
        self.usable()?;
        nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
        let r = calls();
        let end = nccl::group_end();
        match r {
            // The group is closed first; what it had enqueued is abandoned with the
            // communicator.
            Err(e) => Err(self.abort(e)),
            Ok(()) => self.settle("ncclGroupEnd", end),
        }
    }

    /// The outcome of a call on this (non-blocking) communicator: a call that returned
    /// `ncclInProgress` is polled until it has finished, for at most the timeout. A
    /// call that failed or did not finish aborts the communicator: its kernels may
    /// still be enqueued on the stream, waiting for a peer that will not come, and
    /// only the abort lets them end before the op's buffers are freed.
    fn settle(&self, call: &'static str, r: NcclResult) -> Result<()> {
        if self.is_aborted() {
            // An earlier call in this group aborted it already.
            return self.usable();
        }
        let outcome = match r {
            Ok(nccl::NcclStatus::InProgress) => wait_for(self.comm, call, self.timeout),
            Ok(_) => Ok(()),
            Err(e) => Err(nccl_err(call)(e)),
        };
        outcome.map_err(|e| self.abort(e))
    }
}

/// What cudarc's NCCL calls return.
type NcclResult = std::result::Result<nccl::NcclStatus, nccl::NcclError>;

/// NCCL's `ncclConfig_t` as NCCL 2.17 defined it: the fields every later version
/// starts with. `version` tells a newer library to give the fields it added their
/// defaults, and `size` to read no further, so this works with any NCCL from 2.17 on
/// whatever cudarc's bindings were generated from.
#[repr(C)]
struct ConfigV217 {
    size: usize,
    magic: std::ffi::c_uint,
    version: std::ffi::c_uint,
    blocking: std::ffi::c_int,
    cga_cluster_size: std::ffi::c_int,
    min_ctas: std::ffi::c_int,
    max_ctas: std::ffi::c_int,
    net_name: *const std::ffi::c_char,
    split_share: std::ffi::c_int,
}

impl ConfigV217 {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
    fn non_blocking() -> Self {
        const UNDEF: std::ffi::c_int = std::ffi::c_int::MIN;
        ConfigV217 {
            size: std::mem::size_of::<ConfigV217>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION(2, 17, 0)
            version: 2 * 10_000 + 17 * 100,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}

/// Shares this rank's outcome of creating its communicator; every rank's, in rank
/// order.
fn exchange_outcome(
    mpi: &mut dyn Transport,
    outcome: &std::result::Result<(), String>,
) -> Result<Vec<std::result::Result<(), String>>> {
    let bytes = postcard::to_stdvec(outcome)
        .map_err(|e| Error::Internal(format!("encoding NCCL init outcome: {e}")))?;
    let all = mpi.exchange(&bytes, &mut |_| {})?;
    all.iter()
        .map(|b| postcard::from_bytes::<std::result::Result<(), String>>(b))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Internal(format!("decoding NCCL init outcome: {e}")))
}

/// Creates this rank's communicator without blocking and waits at most `timeout` for
/// it; on failure or timeout the half-made communicator is aborted.
fn init_comm(
    id: sys::ncclUniqueId,
    size: i32,
    rank: i32,
    timeout: Duration,
) -> Result<sys::ncclComm_t> {
    let mut config = ConfigV217::non_blocking();
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    // SAFETY: `comm` is written by NCCL (also when the init continues in the
    // background); `config` is a valid NCCL 2.17 config, read during the call. Every
    // rank calls this with the same id and size, each with its own rank.
    let r = unsafe {
        nccl::comm_init_rank_config(
            &mut comm,
            size,
            id,
            rank,
            (&mut config as *mut ConfigV217).cast::<sys::ncclConfig_t>(),
        )
    };
    let waited = match r {
        Ok(nccl::NcclStatus::InProgress) => wait_for(comm, "ncclCommInitRankConfig", timeout),
        Ok(_) => Ok(()),
        Err(e) => Err(nccl_err("ncclCommInitRankConfig")(e)),
    };
    match waited {
        Ok(()) => Ok(comm),
        Err(e) => {
            if !comm.is_null() {
                // SAFETY: a communicator whose creation failed or is abandoned; never
                // used after this.
                if let Err(abort) = unsafe { nccl::comm_abort(comm) } {
                    tracing::warn!(error = ?abort, "ncclCommAbort failed");
                }
            }
            Err(e)
        }
    }
}

/// Polls `comm` until the call that returned `ncclInProgress` has finished; an error
/// when it fails or is still running after `timeout`.
fn wait_for(comm: sys::ncclComm_t, call: &'static str, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(10);
    loop {
        let mut state = sys::ncclResult_t::ncclInProgress;
        // SAFETY: `comm` is a communicator NCCL returned; `state` is written.
        let asked = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        match (asked.result(), state.result()) {
            (Err(e), _) => return Err(nccl_err("ncclCommGetAsyncError")(e)),
            (_, Err(e)) => return Err(nccl_err(call)(e)),
            (_, Ok(nccl::NcclStatus::InProgress)) => {}
            (_, Ok(_)) => return Ok(()),
        }
        if start.elapsed() >= timeout {
            return Err(Error::Cuda {
                call,
                message: format!(
                    "still in progress after {:.1} s: another rank's NCCL did not come up or \
                     cannot be reached (the limit is half of KOLO_COLLECTIVE_TIMEOUT_SECONDS)",
                    timeout.as_secs_f64()
                ),
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

/// Every rank's outcome of creating its communicator, in rank order → an error on
/// every rank when any failed, naming the ranks whose NCCL failed (before those that
/// only timed out waiting for them).
pub(crate) fn init_verdict(outcomes: &[std::result::Result<(), String>]) -> Result<()> {
    let failed: Vec<(usize, &String)> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(r, o)| o.as_ref().err().map(|why| (r, why)))
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    let (timed_out, broke): (Vec<_>, Vec<_>) = failed
        .into_iter()
        .partition(|(_, why)| why.contains("still in progress"));
    let mut parts: Vec<String> = broke
        .iter()
        .map(|(r, why)| format!("rank {r}: {why}"))
        .collect();
    if !timed_out.is_empty() {
        let ranks: Vec<String> = timed_out.iter().map(|(r, _)| r.to_string()).collect();
        parts.push(format!(
            "rank{} {} timed out waiting for the others",
            if ranks.len() == 1 { "" } else { "s" },
            ranks.join(", ")
        ));
    }
    Err(Error::CudaUnavailable(format!(
        "creating the NCCL communicator failed: {}",
        parts.join("; ")
    )))
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if self.is_aborted() {
            // The abort ended its kernels and freed it.
            return;
        }
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
mod tests;
