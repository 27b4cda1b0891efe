//! The only code that knows MPI or NCCL exists.
//!
//! The engine talks to a [`Transport`]: a control-plane exchange of negotiation
//! messages and data-plane collectives on raw buffers. Every method is called from the
//! engine thread only, so implementations need not be thread-safe, and MPI is
//! initialised on that same thread.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use crate::vocab::ReduceOp;

/// What a transport calls while it waits for other ranks, so that the engine keeps
/// taking in work and moving sends and receives along meanwhile. A closure of the
/// time waited is one that only looks.
pub(crate) trait Idle {
    /// One look, with the time waited so far (every turn of the wait).
    fn poll(&mut self, waited: Duration);

    /// The transport's back-off: sleep up to `d` before the next look. The engine
    /// naps on its own queue instead, so that a submit or a kick ends the nap.
    fn nap(&mut self, d: Duration) {
        std::thread::sleep(d);
    }
}

impl<F: FnMut(Duration)> Idle for F {
    fn poll(&mut self, waited: Duration) {
        self(waited);
    }
}

/// The longest name a send or receive may have, in bytes, and the most dimensions its
/// tensor may have: a header (name, dtype, shape) then fits the buffer a transport
/// keeps posted for the next one ([`P2P_HEADER_MAX`]).
pub(crate) const P2P_NAME_MAX: usize = 1024;
pub(crate) const P2P_NDIM_MAX: usize = 64;

/// The most bytes a point-to-point header takes (varints of at most 10 bytes).
pub(crate) const P2P_HEADER_MAX: usize = P2P_NAME_MAX + 10 * (P2P_NDIM_MAX + 2) + 16;

/// Point to point outside the cycles (see [`Transport::p2p_port`]).
pub(crate) trait P2pPort: Send {
    /// Posts `tensor` to rank `dest` under `name` (its name, dtype and shape, then its
    /// bytes) and returns at once with an id that [`P2pPort::poll`] reports once the
    /// send is done. The port keeps the tensor until then. A tensor on a device is
    /// staged through host memory (copied there first, waiting for the copy), and
    /// arrives marked as sent from a device.
    fn send(&mut self, dest: usize, name: &str, tensor: Tensor) -> Result<u64>;
    /// Reports the sends that are done and the tensors that arrived whole (from any
    /// rank, in the order each rank sent them). With `drain` false it takes at most
    /// one newly arrived tensor: a thread waiting for one returns sooner (looking for
    /// another that is not there may cost MPI a yield of the core).
    fn poll(&mut self, events: &mut Vec<P2pEvent>, drain: bool) -> Result<()>;
    /// The bytes posted to move and not yet moved: sends not done, and receives whose
    /// bytes are coming (after their header). 0 when the port cannot tell.
    fn in_flight(&self) -> usize {
        0
    }
}

/// What [`P2pPort::poll`] reports.
#[derive(Debug)]
pub(crate) enum P2pEvent {
    /// The send [`P2pPort::send`] numbered so is done (its tensor dropped).
    Sent(u64),
    /// A whole tensor arrived from `src` under `name` (in host memory; `from_device`:
    /// the sender's was on a device).
    Received {
        src: usize,
        name: String,
        tensor: Tensor,
        from_device: bool,
    },
}

pub(crate) mod butterfly;
pub(crate) mod choice;
pub(crate) mod device;
#[cfg(test)]
pub(crate) mod loopback;
pub(crate) mod mpi;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
pub(crate) mod ring;
pub(crate) mod schedule;
#[cfg(feature = "sim")]
pub(crate) mod sim;

/// Where this process sits in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Topology {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) local_rank: usize,
    pub(crate) local_size: usize,
    pub(crate) cross_rank: usize,
    pub(crate) cross_size: usize,
}

/// The job rank a transport is waiting for a message from, shared with the thread
/// that reports a stuck engine (nothing while it is not waiting on one peer).
#[derive(Debug, Clone)]
pub(crate) struct Awaited(Arc<AtomicUsize>);

impl Default for Awaited {
    fn default() -> Self {
        Awaited(Arc::new(AtomicUsize::new(usize::MAX)))
    }
}

impl Awaited {
    /// Now waiting for `rank` (job numbering), or for no one in particular.
    pub(crate) fn set(&self, rank: Option<usize>) {
        self.0.store(rank.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    /// The rank waited for, if any.
    pub(crate) fn get(&self) -> Option<usize> {
        match self.0.load(Ordering::Relaxed) {
            usize::MAX => None,
            r => Some(r),
        }
    }
}

/// Collectives as the engine needs them. Buffers are raw native-endian bytes of
/// `dtype` elements; counts are in elements. Every dtype can be reduced; f16 and bf16
/// travel at their own width and each pairwise combine is computed in f32.
pub(crate) trait Transport: Send {
    /// This process's place in the job.
    fn topology(&self) -> Topology;

    /// Collective over this transport's ranks: a transport for the ranks listed
    /// (sorted, by this transport's numbering), or `None` on a rank not listed. A
    /// process set's engine runs on it.
    fn split(&mut self, ranks: &[usize]) -> Result<Option<Box<dyn Transport>>>;

    /// Ends every rank of the job at once (MPI_Abort), with `code` as exit status.
    fn abort(&mut self, code: i32) -> !;

    /// Control plane: every rank contributes one byte string, every rank gets all of
    /// them in rank order. `idle` is called, with the time waited so far, while other
    /// ranks have not yet contributed, so that the engine can keep accepting work; its
    /// `nap` does the transport's sleeping meanwhile.
    fn exchange(&mut self, local: &[u8], idle: &mut dyn Idle) -> Result<Vec<Vec<u8>>>;

    /// Control plane: bitwise AND of `words` across ranks, in place, and in the same
    /// messages the sum of `sum` across ranks, in place (the engine's speculative
    /// reduction of small ops; every rank gets a bit-identical sum). `sum` has the same
    /// length on every rank, possibly 0. `idle` as for [`Transport::exchange`].
    fn agree_bits(&mut self, words: &mut [u64], sum: &mut [f32], idle: &mut dyn Idle)
        -> Result<()>;

    /// From now on allreduce in three steps (within each host, across hosts, within
    /// each host) instead of flat. Every rank calls it with the same value, when its
    /// hosts have the same number of ranks each. A transport without hosts ignores it.
    fn set_hierarchical_allreduce(&mut self, _on: bool) {}

    /// While hierarchical, only allreduces of at least this many bytes take the three
    /// steps; smaller ones stay flat (0 at start: every size). Every rank calls it
    /// with the same value. A transport without hosts ignores it.
    fn set_hierarchical_min_bytes(&mut self, _bytes: usize) {}

    /// How host sums that are not hierarchical travel from now on. Every rank calls
    /// it with the same value. A transport with one way ignores it.
    fn set_allreduce_algorithm(&mut self, _algorithm: crate::vocab::AllreduceAlgorithm) {}

    /// The hierarchical allreduce's pipeline pieces from now on (None: by size and
    /// hosts, 0: none). Every rank calls it with the same value. A transport without
    /// the hierarchical allreduce ignores it.
    fn set_hierarchical_piece_bytes(&mut self, _bytes: Option<usize>) {}

    /// The rank this transport is waiting for a message from, kept up to date while it
    /// waits point to point (the cycle agreement), for the collective-timeout
    /// watchdog's message. A transport that never knows returns an [`Awaited`] that
    /// stays empty.
    fn awaited(&self) -> Awaited {
        Awaited::default()
    }

    /// Whether a thread other than the one that opened this transport may call it
    /// (one thread at a time, under the engine's lock): then a caller waiting on its
    /// own op may run the engine's cycles itself (`engine::Driver`).
    fn any_thread(&self) -> bool {
        false
    }

    /// From now on allgather in three steps (within each host, shares across hosts,
    /// within each host), with the same conditions as `set_hierarchical_allreduce`.
    fn set_hierarchical_allgather(&mut self, _on: bool) {}

    /// In-place allreduce of `buf`.
    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()>;

    /// Collective over this transport's ranks: opens the communicator for ops on
    /// device memory, on device `ordinal` (None: the one this rank's local rank picks
    /// among those it sees), whose set-up may take at most `timeout`. The default: no
    /// device collectives in this build.
    fn open_device(
        &mut self,
        ordinal: Option<usize>,
        timeout: Duration,
    ) -> Result<Box<dyn device::DeviceComm>> {
        let _ = (ordinal, timeout);
        Err(Error::CudaUnavailable(
            "kolo was built without the `nccl` feature".into(),
        ))
    }

    /// Whether large sums go through [`Transport::allreduce_many`] in groups where that
    /// can help (`Some`: as the user said; `None`: the transport decides, if need be by
    /// timing the link, which is collective). Every rank calls it at start with the
    /// same value. A transport without hosts ignores it.
    fn choose_grouped_ring(&mut self, _choice: Option<bool>) -> Result<()> {
        Ok(())
    }

    /// How many bytes of tensors too large to fuse the engine may hand to one
    /// [`Transport::allreduce_many`] call; 0 (the default): none, each goes alone
    /// through `allreduce`. The same on every rank.
    fn in_place_group_bytes(&self) -> usize {
        0
    }

    /// In-place allreduce of each buffer of `bufs` (all of `dtype`), with the result
    /// `allreduce` would give each; the default does exactly that, one by one. Every
    /// rank passes buffers of the same sizes in the same order.
    fn allreduce_many(&mut self, bufs: &mut [&mut [u8]], dtype: DType, op: ReduceOp) -> Result<()> {
        for buf in bufs.iter_mut() {
            self.allreduce(buf, dtype, op)?;
        }
        Ok(())
    }

    /// Rank `r` contributes `counts[r]` elements; `recv` receives them concatenated.
    fn allgatherv(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
    ) -> Result<()>;

    /// Broadcast of `buf` from `root`.
    fn broadcast(&mut self, buf: &mut [u8], root: usize, dtype: DType) -> Result<()>;

    /// Point to point, on a channel of its own that the engine keeps beside the
    /// transport (so that it can move sends and receives along while this transport
    /// waits for other ranks): taken once, at the engine's start. The default: none.
    fn p2p_port(&mut self) -> Option<Box<dyn P2pPort>> {
        None
    }

    /// Sends `send_counts[r]` elements to rank `r`, receives `recv_counts[r]` from it.
    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()>;

    /// Reduces `send` over all ranks and leaves block `r` (of `counts[r]` elements) on
    /// rank `r`. `send` may be used as scratch (its contents are undefined after).
    fn reduce_scatter(
        &mut self,
        send: &mut [u8],
        recv: &mut [u8],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;

    /// [`allgatherv`](Self::allgatherv) into fresh memory, so that a large output need
    /// not be zeroed first (zeroing 40 MB cost ~4 ms a call here). On `Ok` every byte
    /// of `recv` has been written: callers treat it as initialised then. The default
    /// zeroes `recv` and calls `allgatherv`.
    fn allgatherv_fresh(
        &mut self,
        send: &[u8],
        recv: &mut [MaybeUninit<u8>],
        counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        self.allgatherv(send, zero_fill(recv), counts, dtype)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) into fresh memory, with the contract
    /// of [`allgatherv_fresh`](Self::allgatherv_fresh).
    fn reduce_scatter_fresh(
        &mut self,
        send: &mut [u8],
        recv: &mut [MaybeUninit<u8>],
        counts: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter(send, zero_fill(recv), counts, dtype, op)
    }
}

/// `buf` zeroed, as initialised bytes.
pub(crate) fn zero_fill(buf: &mut [MaybeUninit<u8>]) -> &mut [u8] {
    buf.fill(MaybeUninit::new(0));
    // SAFETY: every byte was just written.
    unsafe { assume_written(buf) }
}

/// `buf` as initialised bytes.
///
/// # Safety
/// Every byte of `buf` must have been written.
pub(crate) unsafe fn assume_written(buf: &mut [MaybeUninit<u8>]) -> &mut [u8] {
    // SAFETY: same length and layout, and initialised (the caller's promise).
    unsafe { &mut *(std::ptr::from_mut::<[MaybeUninit<u8>]>(buf) as *mut [u8]) }
}

/// Connects this process to the job: initialises MPI (on the calling thread, which
/// must be the engine's) and returns the transport the engine runs on.
///
/// # Errors
/// MPI cannot start, or was already initialised in this process.
pub(crate) fn connect() -> Result<Box<dyn Transport>> {
    Ok(Box::new(mpi::MpiTransport::init()?))
}

/// The exit status of a requested abort; 0: none requested.
static ABORT_CODE: AtomicI32 = AtomicI32::new(0);

/// Asks the engine thread to abort the whole job with exit status `code` (from a panic
/// hook or the watchdog, on any thread; the first request's code stands). The engine
/// notices within one wait-loop iteration or one idle heartbeat.
pub(crate) fn request_abort(code: i32) {
    let code = if code == 0 { 1 } else { code };
    let _ = ABORT_CODE.compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
}

/// Whether [`request_abort`] was called.
pub(crate) fn abort_requested() -> bool {
    ABORT_CODE.load(Ordering::SeqCst) != 0
}

/// The exit status the requested abort asked for (1 when none was requested).
pub(crate) fn abort_code() -> i32 {
    match ABORT_CODE.load(Ordering::SeqCst) {
        0 => 1,
        c => c,
    }
}
