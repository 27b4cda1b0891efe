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
use crate::error::{Error, Result};
use crate::tensor::device;
use crate::tensor::DType;
use crate::vocab::ReduceOp;

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

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (NCCL
// documents it as not thread-safe, not as thread-bound). Only the engine thread calls
// it (the engine's lock; callers never drive an engine with a device communicator
// open), and before each call the communicator's CUDA context is made current there.
unsafe impl Send for Nccl {}

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
        let all = mpi.exchange(&bytes, &mut |_: Duration| {})?;
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
}

pub(crate) mod comm;
mod ops;
mod setup;
pub(crate) use ops::can_scale;
pub(crate) use setup::{decide, init_verdict, Setup};
use setup::{exchange_outcome, init_comm, wait_for, ID_BYTES};

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
