//! Creating the communicator: what every rank reports before `ncclCommInitRank`, the
//! unique id from rank 0, the non-blocking init and its verdict on every rank.

use super::*;

/// Bytes in an NCCL unique id.
pub(super) const ID_BYTES: usize = 128;

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

/// NCCL's `ncclConfig_t` as NCCL 2.17 defined it: the fields every later version
/// starts with. `version` tells a newer library to give the fields it added their
/// defaults, and `size` to read no further, so this works with any NCCL from 2.17 on
/// whatever cudarc's bindings were generated from.
#[repr(C)]
pub(super) struct ConfigV217 {
    pub(super) size: usize,
    pub(super) magic: std::ffi::c_uint,
    pub(super) version: std::ffi::c_uint,
    pub(super) blocking: std::ffi::c_int,
    pub(super) cga_cluster_size: std::ffi::c_int,
    pub(super) min_ctas: std::ffi::c_int,
    pub(super) max_ctas: std::ffi::c_int,
    pub(super) net_name: *const std::ffi::c_char,
    pub(super) split_share: std::ffi::c_int,
}

impl ConfigV217 {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`.
    pub(super) fn non_blocking() -> Self {
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
pub(super) fn exchange_outcome(
    mpi: &mut dyn Transport,
    outcome: &std::result::Result<(), String>,
) -> Result<Vec<std::result::Result<(), String>>> {
    let bytes = postcard::to_stdvec(outcome)
        .map_err(|e| Error::Internal(format!("encoding NCCL init outcome: {e}")))?;
    let all = mpi.exchange(&bytes, &mut |_: Duration| {})?;
    all.iter()
        .map(|b| postcard::from_bytes::<std::result::Result<(), String>>(b))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Internal(format!("decoding NCCL init outcome: {e}")))
}

/// Creates this rank's communicator without blocking and waits at most `timeout` for
/// it; on failure or timeout the half-made communicator is aborted.
pub(super) fn init_comm(
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
pub(super) fn wait_for(comm: sys::ncclComm_t, call: &'static str, timeout: Duration) -> Result<()> {
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
