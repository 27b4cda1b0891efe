//! The MPI transport.
//!
//! The control plane (the negotiation exchange, where a rank may wait a long time for
//! slower peers) uses non-blocking collectives polled with a back-off, so a waiting
//! rank leaves its CPU to training threads. The data plane runs only once every rank
//! is known to be ready, so it uses the blocking collectives: Open MPI's tuned
//! blocking algorithms were measured 1.7× faster than its non-blocking ones for a
//! 64 MiB allreduce here (see benches/). Large sums use a ring over non-blocking
//! point-to-point messages instead (`ring_allreduce`; pipelined in segments on one
//! host, one message per step when every hop crosses hosts): from 32 MiB
//! on one host (0.53–0.59× MPI_Allreduce's time there), from 1 MiB when the job spans
//! hosts (see `RING_MIN_BYTES_ONE_HOST` and `RING_MIN_BYTES_HOSTS` for the
//! measurements). The ring visits the ranks host
//! by host, so it crosses each host boundary once whatever the rank placement.

use std::ffi::{c_int, c_void};
use std::time::{Duration, Instant};

use mpi::collective::{CommunicatorCollectives, Root};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::Threading;

use super::{abort_requested, Awaited, Topology, Transport};
use crate::error::{Error, Result};
use crate::tensor::DType;
use crate::vocab::ReduceOp;

extern "C" {
    fn kolo_mpi_in_place() -> *mut c_void;
}

/// Owns MPI for the life of the engine: created on the engine thread, dropped there
/// after the last collective, which finalises MPI.
pub(crate) struct MpiTransport {
    topology: Topology,
    /// kolo's own duplicate of MPI_COMM_WORLD, so that an application (or a benchmark)
    /// can use MPI_COMM_WORLD itself without its messages mixing with kolo's.
    comm: SimpleCommunicator,
    /// User-defined reductions for f16 and bf16 (MPI has no half types).
    half_ops: HalfOps,
    /// The ranks on this host (shared memory), and the ranks with this local rank
    /// across hosts: the hierarchical allreduce's two levels.
    local: SimpleCommunicator,
    cross: SimpleCommunicator,
    /// Allreduce hierarchically (set once at start, the same on every rank).
    hierarchical: bool,
    /// Allgather hierarchically (set once at start, the same on every rank).
    hierarchical_allgather: bool,
    /// Large sums in groups through one ring (only where every hop crosses hosts;
    /// set once at start, the same on every rank).
    grouped_ring: bool,
    /// The ranks of every host.
    hosts: Hosts,
    /// The ring allreduce's reused segment buffers.
    ring_scratch: Vec<u8>,
    /// The hierarchical allreduce's reused shard.
    shard_scratch: Vec<u8>,
    /// The ring's order: `ring[i]` is the rank at position `i`, ranks of one host
    /// next to each other (hosts in order of their lowest rank).
    ring: Vec<usize>,
    /// This rank's position in `ring`.
    ring_pos: usize,
    /// Sums at least this large go through the ring: `RING_MIN_BYTES_HOSTS` when the
    /// job spans hosts, else `RING_MIN_BYTES_ONE_HOST` (the same on every rank).
    ring_min_bytes: usize,
    /// The ring's segment size: `RING_SEGMENT_BYTES`, or None (each step's chunk is one
    /// message, see `ring_allreduce`) when the job has one rank per host, so that
    /// every hop crosses the network.
    ring_segment: Option<usize>,
    /// The thread support MPI gave: process sets (an engine thread each) need
    /// `MPI_THREAD_MULTIPLE`.
    threading: Threading,
    /// Each rank of this transport's numbering in the job's (a process set's
    /// transport numbers its members from 0).
    job_ranks: Vec<usize>,
    /// The peer the cycle agreement is waiting for (job numbering).
    awaited: Awaited,
    // Dropped last: finalises MPI after the communicators are gone (the job's first
    // transport only; a process set's transport frees just its communicator).
    _universe: Option<mpi::environment::Universe>,
}

// SAFETY: a transport is used by one thread at a time: made on an engine thread and,
// for a process set, handed once to that set's new engine thread, which alone uses it
// from then on. MPI handles are plain values valid on any thread, and handing one
// between threads is allowed because process sets require MPI_THREAD_MULTIPLE
// (checked in `split` before a transport is ever handed over).
unsafe impl Send for MpiTransport {}

impl std::fmt::Debug for MpiTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiTransport")
            .field("topology", &self.topology)
            .finish_non_exhaustive()
    }
}

impl MpiTransport {
    /// Initialises MPI on the calling thread (the engine thread), asking for
    /// `MPI_THREAD_MULTIPLE`. Any level works because only this thread calls MPI, but
    /// MULTIPLE lets a panic hook abort the job from another thread.
    pub(crate) fn init() -> Result<MpiTransport> {
        let (universe, provided) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                Error::Init(
                    "MPI was already initialised in this process (kolo::init may run once per process)"
                        .into(),
                )
            })?;
        tracing::debug!(?provided, "MPI initialised");
        if provided != Threading::Multiple {
            tracing::debug!(
                ?provided,
                "MPI gives less than MPI_THREAD_MULTIPLE: process sets are not available"
            );
        }
        let world = universe.world();
        Self::on(&world, Some(universe), provided)
    }

    /// A transport on a duplicate of `parent` (kolo's own communicator), with its
    /// topology; `universe` is kept by the job's first transport only, so that MPI is
    /// finalised when that one goes.
    fn on(
        parent: &SimpleCommunicator,
        universe: Option<mpi::environment::Universe>,
        threading: Threading,
    ) -> Result<MpiTransport> {
        let rank = to_usize(parent.rank());
        let size = to_usize(parent.size());
        let local = parent.split_shared(parent.rank());
        let local_rank = to_usize(local.rank());
        let local_size = to_usize(local.size());
        let cross = parent
            .split_by_color_with_key(Color::with_value(local.rank()), parent.rank())
            .ok_or_else(|| {
                Error::Internal("cross-node communicator split returned no communicator".into())
            })?;
        let topology = Topology {
            rank,
            size,
            local_rank,
            local_size,
            cross_rank: to_usize(cross.rank()),
            cross_size: to_usize(cross.size()),
        };
        let comm = parent.duplicate();
        let half_ops = HalfOps::create()?;
        // Each host is named by its lowest rank (local rank 0, as `split_shared` keys by
        // rank); every rank learns every rank's host, which orders the ring.
        let mut host = parent.rank();
        local.process_at_rank(0).broadcast_into(&mut host);
        let mut hosts = vec![0 as c_int; size];
        parent.all_gather_into(&host, &mut hosts[..]);
        let hosts = Hosts::of(&hosts);
        let (ring, ring_pos) = hosts.ring(rank);
        let multi_host = hosts.members.len() > 1;
        let one_per_host = hosts.members.iter().all(|m| m.len() == 1);
        tracing::debug!(
            rank,
            ?ring,
            multi_host,
            "ring order (ranks grouped by host)"
        );
        Ok(MpiTransport {
            topology,
            comm,
            half_ops,
            local,
            cross,
            hierarchical: false,
            hierarchical_allgather: false,
            grouped_ring: false,
            hosts,
            ring_scratch: Vec::new(),
            shard_scratch: Vec::new(),
            ring,
            ring_pos,
            ring_min_bytes: if multi_host {
                RING_MIN_BYTES_HOSTS
            } else {
                RING_MIN_BYTES_ONE_HOST
            },
            // One message per step where every hop of the ring crosses hosts.
            ring_segment: if multi_host && one_per_host {
                None
            } else {
                Some(RING_SEGMENT_BYTES)
            },
            threading,
            job_ranks: (0..size).collect(),
            awaited: Awaited::default(),
            _universe: universe,
        })
    }

    fn comm(&self) -> ffi::MPI_Comm {
        self.comm.as_raw()
    }

    /// The rate between hosts, in bytes/s per rank: the slowest rank's best of two
    /// timed rings of [`PROBE_BYTES`] (after one that sets up the connections), the
    /// same on every rank. Collective.
    fn probe_link(&mut self) -> Result<f64> {
        let world = self.world();
        let mut buf = vec![0u8; PROBE_BYTES];
        let mut best = f64::INFINITY;
        for i in 0..3 {
            let start = Instant::now();
            ring_allreduce(
                world,
                &self.ring,
                self.ring_pos,
                &mut self.ring_scratch,
                &mut buf,
                DType::F32,
                self.ring_segment,
            )?;
            if i > 0 {
                best = best.min(start.elapsed().as_secs_f64());
            }
        }
        let n = self.topology.size as f64;
        // A ring allreduce sends 2 (n - 1) / n of the buffer from each rank.
        let mut rate = [PROBE_BYTES as f64 * 2.0 * (n - 1.0) / n / best.max(1e-9)];
        // SAFETY: a constant the MPI library defines, read after MPI_Init.
        let min = unsafe { ffi::RSMPI_MIN };
        allreduce_in_place(world, bytemuck::cast_slice_mut(&mut rate), DType::F64, min)?;
        Ok(rate[0])
    }

    /// Waits for `req` with a back-off: spin briefly (latency), then yield, then sleep
    /// with a growing interval capped at 1 ms (CPU).
    fn wait(
        &mut self,
        call: &'static str,
        mut req: ffi::MPI_Request,
        idle: &mut dyn FnMut(Duration),
    ) -> Result<()> {
        let start = Instant::now();
        let mut nap = Duration::from_micros(20);
        loop {
            let mut flag: c_int = 0;
            // SAFETY: `req` is a live request from an MPI_I* call whose buffers the caller
            // keeps alive until this returns.
            check(call, unsafe {
                ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE)
            })?;
            if flag != 0 {
                return Ok(());
            }
            if abort_requested() {
                self.abort(1);
            }
            let waited = start.elapsed();
            idle(waited);
            if waited < Duration::from_micros(50) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
    }
}

/// `acc &= x`, word by word.
fn and_into(acc: &mut [u64], x: &[u64]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a &= *b;
    }
}

/// The tag of the cycle agreement's messages (the ring uses 7).
const AGREE_TAG: c_int = 11;

impl MpiTransport {
    /// Sends `send` to and/or receives `recv` from `peer` (non-blocking, completed
    /// together through [`MpiTransport::wait`], so the engine stays responsive).
    fn swap_words(
        &mut self,
        call: &'static str,
        peer: usize,
        send: Option<&[u64]>,
        recv: Option<&mut [u64]>,
        idle: &mut dyn FnMut(Duration),
    ) -> Result<()> {
        let peer = count(call, peer)?;
        let comm = self.comm();
        let mut reqs = [null_request(), null_request()];
        if let Some(buf) = recv {
            let len = count(call, buf.len())?;
            // SAFETY: `buf` outlives the request, which is completed below before
            // this returns (also on error: `wait` is called for both requests).
            check(call, unsafe {
                ffi::MPI_Irecv(
                    buf.as_mut_ptr().cast(),
                    len,
                    ffi::RSMPI_UINT64_T,
                    peer,
                    AGREE_TAG,
                    comm,
                    &mut reqs[0],
                )
            })?;
        }
        if let Some(buf) = send {
            let len = count(call, buf.len())?;
            // SAFETY: as for the receive.
            let rc = unsafe {
                ffi::MPI_Isend(
                    buf.as_ptr().cast(),
                    len,
                    ffi::RSMPI_UINT64_T,
                    peer,
                    AGREE_TAG,
                    comm,
                    &mut reqs[1],
                )
            };
            if let Err(e) = check(call, rc) {
                self.wait(call, reqs[0], idle)?;
                return Err(e);
            }
        }
        self.awaited
            .set(self.job_ranks.get(to_usize(peer)).copied());
        let first = self.wait(call, reqs[0], idle);
        let second = self.wait(call, reqs[1], idle);
        self.awaited.set(None);
        first.and(second)
    }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading MPI's constant null request handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

fn to_c_int(v: usize) -> c_int {
    c_int::try_from(v).unwrap_or(c_int::MAX)
}

fn to_usize(v: c_int) -> usize {
    usize::try_from(v).unwrap_or(0)
}

fn count(call: &'static str, n: usize) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::Transport {
        call,
        message: format!("{n} elements exceed MPI's count limit of {}", c_int::MAX),
    })
}

fn counts(call: &'static str, counts: &[usize]) -> Result<(Vec<c_int>, Vec<c_int>)> {
    let mut c = Vec::with_capacity(counts.len());
    let mut displs = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &n in counts {
        c.push(count(call, n)?);
        displs.push(count(call, at)?);
        at += n;
    }
    Ok((c, displs))
}

/// Checks that a buffer of `len` bytes holds exactly `elems` elements of `dtype`
/// before MPI reads or writes it through a raw pointer sized by counts.
fn sized(call: &'static str, what: &str, len: usize, elems: usize, dtype: DType) -> Result<()> {
    let want = elems.checked_mul(dtype.size_of());
    if want == Some(len) {
        return Ok(());
    }
    Err(Error::Internal(format!(
        "{call}: the {what} buffer holds {len} bytes, but the counts need {elems} {dtype:?} \
         elements ({} bytes)",
        want.map_or_else(|| "too many".to_string(), |w| w.to_string())
    )))
}

/// Checks that `counts` has one entry per rank.
fn per_rank(call: &'static str, counts: &[usize], size: usize) -> Result<()> {
    if counts.len() == size {
        return Ok(());
    }
    Err(Error::Internal(format!(
        "{call}: {} counts for {size} ranks",
        counts.len()
    )))
}

fn check(call: &'static str, rc: c_int) -> Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: MPI_MAX_ERROR_STRING is 256 in Open MPI and MPICH; the buffer is larger.
    unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(to_usize(len));
    Err(Error::Transport {
        call,
        message: String::from_utf8_lossy(&buf).into_owned(),
    })
}

/// The MPI datatype used to move and reduce `dtype`.
fn datatype(dtype: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading MPI's predefined datatype handles, constant after MPI_Init.
    unsafe {
        match dtype {
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::I8 => ffi::RSMPI_INT8_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            // 16-bit words, reduced by kolo's own ops (see `HalfOps`).
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
        }
    }
}

/// MPI's predefined op for `op` (for every dtype but f16/bf16).
fn predefined_op(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading MPI's predefined op handles, constant after MPI_Init.
    unsafe {
        match op {
            // Average is a sum followed by a postscale in the engine.
            ReduceOp::Sum | ReduceOp::Average => ffi::RSMPI_SUM,
            ReduceOp::Min => ffi::RSMPI_MIN,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Product => ffi::RSMPI_PROD,
        }
    }
}

/// User-defined MPI ops reducing f16 or bf16 words: each pairwise combine widens to
/// f32, combines, and rounds back, so the wire carries 2 bytes per element (what
/// gradient compression is for) while every step is computed in f32.
struct HalfOps {
    /// [sum, min, max, product] for f16, then for bf16.
    ops: [ffi::MPI_Op; 8],
}

macro_rules! half_op {
    ($name:ident, $t:ty, |$a:ident, $b:ident| $body:expr) => {
        unsafe extern "C" fn $name(
            invec: *mut c_void,
            inoutvec: *mut c_void,
            len: *mut c_int,
            _datatype: *mut ffi::MPI_Datatype,
        ) {
            use half::slice::HalfFloatSliceExt;
            // SAFETY: MPI passes `*len` elements of the 16-bit datatype the op was used
            // with (kolo only uses these ops on f16/bf16 buffers), both aligned for u16.
            let (input, inout) = unsafe {
                let n = usize::try_from(*len).unwrap_or(0);
                (
                    std::slice::from_raw_parts(invec as *const $t, n),
                    std::slice::from_raw_parts_mut(inoutvec as *mut $t, n),
                )
            };
            // Blocks through f32 scratch, so that half's vectorised conversions (F16C
            // where the CPU has it) do the widening and rounding.
            const BLOCK: usize = 1024;
            let (mut x, mut y) = ([0f32; BLOCK], [0f32; BLOCK]);
            for (o, i) in inout.chunks_mut(BLOCK).zip(input.chunks(BLOCK)) {
                let n = o.len();
                i.convert_to_f32_slice(&mut x[..n]);
                o.convert_to_f32_slice(&mut y[..n]);
                for (yv, &xv) in y[..n].iter_mut().zip(&x[..n]) {
                    let ($a, $b) = (xv, *yv);
                    *yv = $body;
                }
                o.convert_from_f32_slice(&y[..n]);
            }
        }
    };
}

half_op!(f16_sum, half::f16, |a, b| a + b);
half_op!(f16_min, half::f16, |a, b| a.min(b));
half_op!(f16_max, half::f16, |a, b| a.max(b));
half_op!(f16_prod, half::f16, |a, b| a * b);
half_op!(bf16_sum, half::bf16, |a, b| a + b);
half_op!(bf16_min, half::bf16, |a, b| a.min(b));
half_op!(bf16_max, half::bf16, |a, b| a.max(b));
half_op!(bf16_prod, half::bf16, |a, b| a * b);

impl HalfOps {
    fn create() -> Result<Self> {
        let fns: [ffi::MPI_User_function; 8] = [
            Some(f16_sum),
            Some(f16_min),
            Some(f16_max),
            Some(f16_prod),
            Some(bf16_sum),
            Some(bf16_min),
            Some(bf16_max),
            Some(bf16_prod),
        ];
        // Placeholders, each overwritten by MPI_Op_create below (rsmpi exports no
        // MPI_OP_NULL). SAFETY: reading a constant handle.
        let mut ops = [unsafe { ffi::RSMPI_SUM }; 8];
        for (op, f) in ops.iter_mut().zip(fns) {
            // SAFETY: `f` is a valid MPI user function; commutative (1).
            check("MPI_Op_create", unsafe { ffi::MPI_Op_create(f, 1, op) })?;
        }
        Ok(HalfOps { ops })
    }

    fn get(&self, dtype: DType, op: ReduceOp) -> Option<ffi::MPI_Op> {
        let base = match dtype {
            DType::F16 => 0,
            DType::BF16 => 4,
            _ => return None,
        };
        let i = match op {
            ReduceOp::Sum | ReduceOp::Average => 0,
            ReduceOp::Min => 1,
            ReduceOp::Max => 2,
            ReduceOp::Product => 3,
        };
        Some(self.ops[base + i])
    }
}

impl Drop for MpiTransport {
    fn drop(&mut self) {
        // Before MPI_Finalize, which runs when `_universe` drops after this.
        for op in &mut self.half_ops.ops {
            // SAFETY: each op was created by MPI_Op_create and is freed once.
            unsafe { ffi::MPI_Op_free(op) };
        }
    }
}

/// Sums at least this large use the segmented ring instead of MPI_Allreduce, on one
/// host. Measured there (Open MPI 4.1.4, 2 cores), ten in-place f32 sums per size,
/// both ways in the same run, ring time / MPI_Allreduce time: np 2: 1.01–1.08 at
/// 1 MiB, 0.98–1.06 from 2.25 to 28 MiB, 0.58–0.59 at 32 MiB; np 4: 0.91–0.98 at
/// 1 MiB, 0.94–1.25 from 2.25 to 20 MiB, 1.00–1.06 at 24–28 MiB, 0.53–0.55 at 32 MiB.
/// Open MPI's own algorithm slows down between 28 and 32 MiB here; below that the ring
/// gains nothing.
const RING_MIN_BYTES_ONE_HOST: usize = 32 << 20;

/// The same threshold when the job spans hosts. Measured across 2 emulated hosts × 1
/// rank (TCP over veth, `scripts/multinode`), ResNet-50 gradient set, kolo with the
/// ring from this size / plain MPI program's per-tensor loop: at 10 Gbit/s, 0.90–0.93
/// from 256 KiB or 1 MiB, 1.07–1.10 from 4 MiB, 1.26–1.38 from 32 MiB (blocking
/// segment exchanges); the windowed ring below from 1 MiB: 0.95–0.98 at 10 Gbit/s,
/// 0.94–1.02 at 1 Gbit/s. Open MPI's TCP allreduce leaves the link idle between its
/// phases; the ring keeps both directions busy.
const RING_MIN_BYTES_HOSTS: usize = 1 << 20;

/// Segment size of the ring on one host: bounds the reused scratch buffers and
/// pipelines copies. Across hosts each step's chunk is one message instead (scratch of
/// one chunk). Measured across 2 emulated hosts × 1 rank, one 64 MiB f32 sum, ring ÷
/// a plain MPI program's MPI_Allreduce (alternating launches): at 1 Gbit/s, one
/// message per chunk 1.00 (570 ms, line rate); 256 KiB segments, 4 in flight: 1.42–1.46
/// (820–834 ms), and no better with 32 or 64 KiB segments 32 or 64 in flight, or
/// 2, 4, 8 MiB segments one at a time (1.25–1.83). At 10 Gbit/s every variant beat
/// MPI_Allreduce: one message 0.82–0.93 (68–71 ms), 256 KiB × 4 0.87 (66–67 ms). So
/// do the hierarchical allreduce's cross-host ring and a flat ring of one rank per host
/// (2 × 2 hierarchical, ResNet-50 set at 10 Gbit/s: 195–201 ms vs 219–224 with
/// segments). A flat ring with several ranks per host keeps the segments: at 2 × 2 its
/// one-message form was 8–13 % slower at 10 Gbit/s (196–210 vs 179–186 ms) and level
/// at 1 Gbit/s (1321–1327 vs 1344–1381 ms). Each
/// message is a rendezvous whose acknowledgement queues behind the other direction's
/// data; a TCP link with a short queue (the emulation's tbf: 5 ms) then idles between
/// segments or drops packets when many are in flight.
const RING_SEGMENT_BYTES: usize = 256 << 10;

/// Segments received ahead of the one being added (scratch buffers in use): the
/// network keeps receiving while a segment is summed.
const RING_WINDOW: usize = 4;

/// Non-blocking requests of one ring step, completed together.
struct Requests(Vec<ffi::MPI_Request>);

impl Requests {
    const CALL: &'static str = "MPI_Waitall (ring allreduce)";

    /// Waits for every request (blocking: the data plane runs once all ranks are ready).
    fn wait_all(&mut self) -> Result<()> {
        if self.0.is_empty() {
            return Ok(());
        }
        let n = count(Self::CALL, self.0.len())?;
        // SAFETY: every request came from MPI_Isend/MPI_Irecv on buffers the ring keeps
        // alive and untouched until this returns.
        let rc = unsafe { ffi::MPI_Waitall(n, self.0.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) };
        self.0.clear();
        check(Self::CALL, rc)
    }

    fn post(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut ffi::MPI_Request) -> c_int,
    ) -> Result<()> {
        let mut req = null_request();
        check(call, f(&mut req))?;
        self.0.push(req);
        Ok(())
    }

    /// Waits for request `i` only (then MPI_REQUEST_NULL, which wait_all skips).
    fn wait(&mut self, i: usize) -> Result<()> {
        // SAFETY: as in `wait_all`.
        check(Self::CALL, unsafe {
            ffi::MPI_Wait(&mut self.0[i], ffi::RSMPI_STATUS_IGNORE)
        })
    }
}

impl Drop for Requests {
    /// A step left early (an MPI error) must not let MPI write into a buffer the caller
    /// gets back: finish what is in flight first.
    fn drop(&mut self) {
        let _ = self.wait_all();
    }
}

impl MpiTransport {
    /// Allreduce in three steps: reduce-scatter among this host's ranks (shared
    /// memory), allreduce of this rank's shard among the ranks with its local rank
    /// (one per host: only shards cross the network), allgather of the shards within
    /// the host. Each element is reduced once, by one cross-host allreduce, and
    /// copied everywhere else, so every rank ends with the same bits. Large sums take
    /// kolo's rings for all three steps; other ops and small sums MPI's collectives.
    fn hierarchical_allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let width = dtype.size_of();
        let n = buf.len() / width;
        let (l, me) = (self.topology.local_size, self.topology.local_rank);
        let mpi_op = self.reduce_op(op, dtype);
        let (local, cross) = self.levels();
        let sum = matches!(op, ReduceOp::Sum | ReduceOp::Average);
        let mut scratch = std::mem::take(&mut self.shard_scratch);
        // Large sums: a ring inside the host whose reduce-scatter leaves each local
        // rank one chunk summed over the host, in place; that chunk is summed across
        // hosts by kolo's ring (the same chunk on every host for the same local rank;
        // on TCP the ring beats MPI_Allreduce called from the engine thread), and the
        // local ring's allgather spreads it. MPI_Reduce_scatter, which this replaced,
        // allocates a scratch of the message on every call: at 2 hosts × 2 ranks,
        // 1 Gbit/s, it took 120-480 ms of a 890 ms allreduce of 64 MiB. The choice
        // depends on nothing rank-specific, so every rank of the job makes it alike.
        if sum && cross.size > 1 && n / l * width >= RING_MIN_BYTES_HOSTS {
            let local_order: Vec<usize> = (0..l).collect();
            let cross_order: Vec<usize> = (0..cross.size).collect();
            let result = ring_allreduce_with(
                local,
                &local_order,
                me,
                &mut self.ring_scratch,
                buf,
                dtype,
                Some(RING_SEGMENT_BYTES),
                &mut |mine| {
                    ring_allreduce(
                        cross,
                        &cross_order,
                        cross.rank,
                        &mut scratch,
                        mine,
                        dtype,
                        None,
                    )
                },
            );
            self.shard_scratch = scratch;
            return result;
        }
        let shards: Vec<usize> = (0..l).map(|i| n / l + usize::from(i < n % l)).collect();
        scratch.clear();
        scratch.resize(shards[me] * width, 0);
        let result = reduce_scatter_on(local, buf, &mut scratch, &shards, dtype, mpi_op)
            .and_then(|()| allreduce_in_place(cross, &mut scratch, dtype, mpi_op))
            .and_then(|()| allgatherv_on(local, &scratch, buf, &shards, dtype));
        self.shard_scratch = scratch;
        result
    }

    /// kolo's own communicator with this rank's place in it.
    fn world(&self) -> Group {
        Group {
            comm: self.comm(),
            size: self.topology.size,
            rank: self.topology.rank,
        }
    }

    /// The hierarchical allreduce's levels: this host's ranks, and this local rank's
    /// ranks across hosts.
    fn levels(&self) -> (Group, Group) {
        let t = &self.topology;
        let local = Group {
            comm: self.local.as_raw(),
            size: t.local_size,
            rank: t.local_rank,
        };
        let cross = Group {
            comm: self.cross.as_raw(),
            size: t.cross_size,
            rank: t.cross_rank,
        };
        (local, cross)
    }

    fn reduce_op(&self, op: ReduceOp, dtype: DType) -> ffi::MPI_Op {
        self.half_ops
            .get(dtype, op)
            .unwrap_or_else(|| predefined_op(op))
    }
}

impl Transport for MpiTransport {
    fn topology(&self) -> Topology {
        self.topology
    }

    fn abort(&mut self, code: i32) -> ! {
        // SAFETY: MPI_Abort on the world communicator; it does not return.
        unsafe { ffi::MPI_Abort(self.comm(), code) };
        std::process::exit(code)
    }

    fn exchange(&mut self, local: &[u8], idle: &mut dyn FnMut(Duration)) -> Result<Vec<Vec<u8>>> {
        let size = self.topology.size;
        let my_len = local.len() as u64;
        let mut lens = vec![0u64; size];
        let mut req = null_request();
        // SAFETY: `my_len` and `lens` outlive the request, which `wait` completes.
        check("MPI_Iallgather", unsafe {
            ffi::MPI_Iallgather(
                (&my_len as *const u64).cast(),
                1,
                ffi::RSMPI_UINT64_T,
                lens.as_mut_ptr().cast(),
                1,
                ffi::RSMPI_UINT64_T,
                self.comm(),
                &mut req,
            )
        })?;
        self.wait("MPI_Iallgather", req, idle)?;
        let lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
        let total: usize = lens.iter().sum();
        let mut all = vec![0u8; total];
        if total > 0 {
            let (c, displs) = counts("MPI_Iallgatherv", &lens)?;
            let mut req = null_request();
            // SAFETY: buffers and count arrays outlive the request, which `wait` completes.
            check("MPI_Iallgatherv", unsafe {
                ffi::MPI_Iallgatherv(
                    local.as_ptr().cast(),
                    count("MPI_Iallgatherv", local.len())?,
                    ffi::RSMPI_UINT8_T,
                    all.as_mut_ptr().cast(),
                    c.as_ptr(),
                    displs.as_ptr(),
                    ffi::RSMPI_UINT8_T,
                    self.comm(),
                    &mut req,
                )
            })?;
            self.wait("MPI_Iallgatherv", req, idle)?;
        }
        let mut out = Vec::with_capacity(size);
        let mut at = 0;
        for len in lens {
            out.push(all[at..at + len].to_vec());
            at += len;
        }
        Ok(out)
    }

    fn split(&mut self, ranks: &[usize]) -> Result<Option<Box<dyn Transport>>> {
        if self.threading != Threading::Multiple {
            return Err(Error::Init(format!(
                "process sets need MPI_THREAD_MULTIPLE (each set has its own engine thread), \
                 but this MPI library gives only {:?}",
                self.threading
            )));
        }
        let member = ranks.contains(&self.topology.rank);
        let color = if member {
            Color::with_value(0)
        } else {
            Color::undefined()
        };
        let Some(sub) = self
            .comm
            .split_by_color_with_key(color, to_c_int(self.topology.rank))
        else {
            return Ok(None);
        };
        let mut t = MpiTransport::on(&sub, None, self.threading)?;
        // Members are numbered in the order of their rank here (the split's key).
        t.job_ranks = ranks
            .iter()
            .map(|&r| self.job_ranks.get(r).copied().unwrap_or(r))
            .collect();
        Ok(Some(Box::new(t)))
    }

    /// The AND of every rank's words by recursive doubling over point-to-point
    /// messages (log2(n) rounds; ranks beyond the largest power of two fold their
    /// words into a partner first and get the result back last). Open MPI's
    /// MPI_Iallreduce, which this replaced, took 57 µs per cycle's agreement across
    /// two emulated hosts against 41–48 µs for a blocking allreduce; point-to-point
    /// messages keep the wait non-blocking (idle callbacks, abort checks) at about
    /// the blocking cost.
    fn agree_bits(
        &mut self,
        words: &mut [u64],
        sum: &mut [f32],
        idle: &mut dyn FnMut(Duration),
    ) -> Result<()> {
        const CALL: &str = "MPI_Isend/MPI_Irecv (cycle agreement)";
        let (n, me) = (self.topology.size, self.topology.rank);
        if n == 1 {
            return Ok(());
        }
        // One message per step: the words, then the f32 values two to a word.
        let nw = words.len();
        let mut mine = vec![0u64; nw + sum.len().div_ceil(2)];
        mine[..nw].copy_from_slice(words);
        bytemuck::cast_slice_mut::<u64, f32>(&mut mine[nw..])[..sum.len()].copy_from_slice(sum);
        let mut theirs = vec![0u64; mine.len()];
        let combine = |mine: &mut [u64], theirs: &[u64]| {
            and_into(&mut mine[..nw], &theirs[..nw]);
            let acc = bytemuck::cast_slice_mut::<u64, f32>(&mut mine[nw..]);
            // Both partners add the same two values (x + y == y + x exactly), so every
            // rank ends with the same bits.
            for (a, b) in acc
                .iter_mut()
                .zip(bytemuck::cast_slice::<u64, f32>(&theirs[nw..]))
            {
                *a += *b;
            }
        };
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        if me >= p {
            self.swap_words(CALL, me - p, Some(&mine), None, idle)?;
            self.swap_words(CALL, me - p, None, Some(&mut mine), idle)?;
        } else {
            if me + p < n {
                self.swap_words(CALL, me + p, None, Some(&mut theirs), idle)?;
                combine(&mut mine, &theirs);
            }
            let mut mask = 1;
            while mask < p {
                // `swap_words` completes the send before returning, so `mine` is only
                // changed once the peer has it.
                self.swap_words(CALL, me ^ mask, Some(&mine), Some(&mut theirs), idle)?;
                combine(&mut mine, &theirs);
                mask <<= 1;
            }
            if me + p < n {
                self.swap_words(CALL, me + p, Some(&mine), None, idle)?;
            }
        }
        words.copy_from_slice(&mine[..nw]);
        sum.copy_from_slice(&bytemuck::cast_slice::<u64, f32>(&mine[nw..])[..sum.len()]);
        Ok(())
    }

    fn set_hierarchical_allreduce(&mut self, on: bool) {
        self.hierarchical = on;
    }

    fn awaited(&self) -> Awaited {
        self.awaited.clone()
    }

    fn set_hierarchical_allgather(&mut self, on: bool) {
        self.hierarchical_allgather = on;
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        if self.hierarchical && buf.len() / dtype.size_of() >= self.topology.local_size {
            return self.hierarchical_allreduce(buf, dtype, op);
        }
        let sum = matches!(op, ReduceOp::Sum | ReduceOp::Average);
        if sum && buf.len() >= self.ring_min_bytes && self.topology.size > 1 {
            let world = self.world();
            return ring_allreduce(
                world,
                &self.ring,
                self.ring_pos,
                &mut self.ring_scratch,
                buf,
                dtype,
                self.ring_segment,
            );
        }
        allreduce_in_place(self.world(), buf, dtype, self.reduce_op(op, dtype))
    }

    fn in_place_group_bytes(&self) -> usize {
        // Where every hop of the ring crosses hosts (one rank per host), each tensor's
        // ring pays the link's start-up at every step; moving a group's steps together
        // streams like one message. Elsewhere the segmented per-tensor ring and
        // MPI_Allreduce stay (the hierarchical path has its own steps).
        if self.grouped_ring && !self.hierarchical {
            IN_PLACE_GROUP_BYTES
        } else {
            0
        }
    }

    fn allreduce_many(&mut self, bufs: &mut [&mut [u8]], dtype: DType, op: ReduceOp) -> Result<()> {
        let sum = matches!(op, ReduceOp::Sum | ReduceOp::Average);
        if !sum || bufs.len() < 2 || self.in_place_group_bytes() == 0 {
            for buf in bufs.iter_mut() {
                self.allreduce(buf, dtype, op)?;
            }
            return Ok(());
        }
        let world = self.world();
        ring_allreduce_many(
            world,
            &self.ring,
            self.ring_pos,
            &mut self.ring_scratch,
            bufs,
            dtype,
        )
    }

    fn choose_grouped_ring(&mut self, choice: Option<bool>) -> Result<()> {
        // Only where every hop of the ring crosses hosts (one rank per host): there
        // each tensor's ring pays the link's start-up at every step.
        if self.ring_segment.is_some() || self.topology.size < 2 {
            return Ok(());
        }
        self.grouped_ring = match choice {
            Some(on) => on,
            None => {
                let rate = self.probe_link()?;
                let on = rate < GROUPED_RING_BELOW_BYTES_PER_S;
                if self.topology.rank == 0 {
                    tracing::debug!(
                        gbit_per_s = rate * 8e-9,
                        grouped_ring = on,
                        "link between hosts timed"
                    );
                }
                on
            }
        };
        if self.topology.rank == 0 && self.grouped_ring {
            tracing::debug!("grouped ring across hosts on");
        }
        Ok(())
    }

    fn allgatherv(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts_: &[usize],
        dtype: DType,
    ) -> Result<()> {
        if self.hierarchical_allgather {
            let (local, cross) = self.levels();
            let mut scratch = std::mem::take(&mut self.shard_scratch);
            let result = self.hosts.allgatherv(
                local,
                cross,
                self.topology.rank,
                (send, recv),
                counts_,
                dtype,
                &mut scratch,
            );
            self.shard_scratch = scratch;
            return result;
        }
        allgatherv_on(self.world(), send, recv, counts_, dtype)
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize, dtype: DType) -> Result<()> {
        const CALL: &str = "MPI_Bcast";
        // SAFETY: `buf` is valid for the call.
        check(CALL, unsafe {
            ffi::MPI_Bcast(
                buf.as_mut_ptr().cast(),
                count(CALL, buf.len() / dtype.size_of())?,
                datatype(dtype),
                count(CALL, root)?,
                self.comm(),
            )
        })
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
        dtype: DType,
    ) -> Result<()> {
        const CALL: &str = "MPI_Alltoallv";
        let size = self.topology.size;
        per_rank(CALL, send_counts, size)?;
        per_rank(CALL, recv_counts, size)?;
        sized(CALL, "send", send.len(), send_counts.iter().sum(), dtype)?;
        sized(CALL, "receive", recv.len(), recv_counts.iter().sum(), dtype)?;
        let (sc, sd) = counts(CALL, send_counts)?;
        let (rc, rd) = counts(CALL, recv_counts)?;
        // SAFETY: the buffers hold exactly what the counts say (checked above) and the
        // count arrays outlive the call.
        check(CALL, unsafe {
            ffi::MPI_Alltoallv(
                send.as_ptr().cast(),
                sc.as_ptr(),
                sd.as_ptr(),
                datatype(dtype),
                recv.as_mut_ptr().cast(),
                rc.as_ptr(),
                rd.as_ptr(),
                datatype(dtype),
                self.comm(),
            )
        })
    }

    fn reduce_scatter(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        counts_: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let op = self.reduce_op(op, dtype);
        reduce_scatter_on(self.world(), send, recv, counts_, dtype, op)
    }
}

/// In-place segmented ring allreduce (sum) over non-blocking point-to-point
/// messages, with reused scratch segments: Open MPI allocates about half the
/// message as scratch on every large MPI_Allreduce; this allocates nothing after
/// the first call. With `segment` bytes, in each reduce-scatter step up to
/// `RING_WINDOW` segments are in flight each way: a segment is summed while the next
/// ones arrive, and a new send and receive are posted as each completes (posting
/// every send at once was slower: the receiver then handles unexpected rendezvous
/// messages). With None (across hosts) each step's chunk is one message, received
/// into a chunk of scratch (see `RING_SEGMENT_BYTES`). The allgather receives
/// straight into the buffer.
///
/// `order[i]` is the rank of `g` at ring position `i`; this rank is at `pos`.
/// `scratch` is kept between calls.
fn ring_allreduce(
    g: Group,
    order: &[usize],
    pos: usize,
    scratch: &mut Vec<u8>,
    buf: &mut [u8],
    dtype: DType,
    segment: Option<usize>,
) -> Result<()> {
    ring_allreduce_with(g, order, pos, scratch, buf, dtype, segment, &mut |_| Ok(()))
}

/// [`ring_allreduce`] that hands the chunk this rank has summed to `between` once the
/// reduce-scatter is done (no message in flight then), before the allgather passes it
/// on: the hierarchical allreduce sums it across hosts there.
#[allow(clippy::too_many_arguments)]
fn ring_allreduce_with(
    g: Group,
    order: &[usize],
    pos: usize,
    scratch: &mut Vec<u8>,
    buf: &mut [u8],
    dtype: DType,
    segment: Option<usize>,
    between: &mut dyn FnMut(&mut [u8]) -> Result<()>,
) -> Result<()> {
    use super::ring::{add_into, chunk, send_chunk};
    const SEND: &str = "MPI_Isend (ring allreduce)";
    const RECV: &str = "MPI_Irecv (ring allreduce)";
    let n = g.size;
    let r = pos;
    let (right, left) = ring_neighbours(order, r, SEND, RECV)?;
    let es = dtype.size_of();
    let len = buf.len() / es;
    // Checked once here, so that no count fails once messages are in flight: the
    // first chunk is the largest.
    let (c0, c1) = chunk(len, n, 0);
    count(SEND, c1 - c0)?;
    let (seg, window) = match segment {
        Some(bytes) => ((bytes / es).max(1), RING_WINDOW),
        None => ((c1 - c0).max(1), 1),
    };
    scratch.resize(window * seg * es, 0);
    let ty = datatype(dtype);
    let comm = g.comm;
    // From here on the buffer is reached only through `base`: in-flight sends read
    // one chunk while the sum writes another.
    let base = buf.as_mut_ptr();
    let slots = scratch.as_mut_ptr();
    let slot = |k: usize| slots.wrapping_add((k % window) * seg * es);
    // Element ranges [a, b) of a chunk cut into segments.
    let segments = |(a, b): (usize, usize)| {
        (a..b)
            .step_by(seg)
            .map(move |s| (s, (s + seg).min(b)))
            .collect::<Vec<_>>()
    };
    let isend = |reqs: &mut Requests, (a, b): (usize, usize)| {
        // SAFETY: [a, b) lies in `buf` (a chunk range), which nothing writes until
        // this request completes; b - a fits in c_int (the largest chunk does).
        reqs.post(SEND, |req| unsafe {
            ffi::MPI_Isend(
                base.add(a * es).cast_const().cast(),
                (b - a) as c_int,
                ty,
                right,
                7,
                comm,
                req,
            )
        })
    };
    let irecv = |reqs: &mut Requests, into: *mut u8, elems: usize| {
        // SAFETY: `into` is valid for `elems` elements (a scratch slot, or a chunk
        // range of `buf`) and nothing reads or writes it until this request
        // completes; `elems` fits in c_int (at most one chunk).
        reqs.post(RECV, |req| unsafe {
            ffi::MPI_Irecv(into.cast(), elems as c_int, ty, left, 7, comm, req)
        })
    };
    (|| {
        let mut sends = Requests(Vec::new());
        let mut recvs = Requests(Vec::new());
        // Reduce-scatter: after n - 1 steps this rank holds the full sum of one chunk.
        // The left neighbour sends, segment by segment, the chunk received here.
        for step in 0..n - 1 {
            let out = segments(chunk(len, n, send_chunk(r, step, n)));
            let inc = segments(chunk(len, n, send_chunk(r, step + 1, n)));
            for k in 0..window {
                if let Some(&s) = out.get(k) {
                    isend(&mut sends, s)?;
                }
                if let Some(&(a, b)) = inc.get(k) {
                    irecv(&mut recvs, slot(k), b - a)?;
                }
            }
            for k in 0..out.len().max(inc.len()) {
                if let Some(&(a, b)) = inc.get(k) {
                    recvs.wait(k)?;
                    let bytes = (b - a) * es;
                    // SAFETY: the slot holds the segment just received and no
                    // receive into it is posted until after the sum; [a, b) is in
                    // the incoming chunk, which no in-flight send reads.
                    let (acc, got) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(base.add(a * es), bytes),
                            std::slice::from_raw_parts(slot(k), bytes),
                        )
                    };
                    add_into(acc, got, dtype);
                    if let Some(&(na, nb)) = inc.get(k + window) {
                        irecv(&mut recvs, slot(k + window), nb - na)?;
                    }
                }
                if k < out.len() {
                    sends.wait(k)?;
                    if let Some(&s) = out.get(k + window) {
                        isend(&mut sends, s)?;
                    }
                }
            }
            recvs.0.clear();
            sends.wait_all()?;
        }
        let (oa, ob) = chunk(len, n, send_chunk(r, n - 1, n));
        // SAFETY: [oa, ob) is this rank's chunk of `buf`; every request has completed.
        between(unsafe { std::slice::from_raw_parts_mut(base.add(oa * es), (ob - oa) * es) })?;
        // Allgather: each summed chunk travels once around the ring.
        for step in 0..n - 1 {
            let (ra, rb) = chunk(len, n, send_chunk(r, step + n, n));
            irecv(&mut recvs, base.wrapping_add(ra * es), rb - ra)?;
            isend(&mut sends, chunk(len, n, send_chunk(r, step + n - 1, n)))?;
            recvs.wait_all()?;
            sends.wait_all()?;
        }
        Ok(())
    })()
}

/// The ranks this ring position sends to (the next position) and receives from (the
/// previous one), as MPI counts; `send` and `recv` name the calls in an error.
fn ring_neighbours(
    order: &[usize],
    pos: usize,
    send: &'static str,
    recv: &'static str,
) -> Result<(c_int, c_int)> {
    let n = order.len();
    Ok((
        count(send, order[(pos + 1) % n])?,
        count(recv, order[(pos + n - 1) % n])?,
    ))
}

/// Below this rate between hosts (bytes/s per rank, as [`MpiTransport::probe_link`]
/// times it) large sums go through the ring in groups. Across 2 emulated hosts with one
/// rank each, ResNet-50 gradient set: at 1 Gbit/s (timed at 0.65-0.93 Gbit/s) grouping
/// is 1.3× faster (870 vs 1120-1180 ms per step, as fast as one pre-packed
/// MPI_Allreduce); at 10 Gbit/s (timed at 7.1-7.9; unshaped, 9.5-9.7) it is 1.2-1.4×
/// slower, because MPI gathers each step's message from the tensors with copies, and
/// the emulated hosts share two cores with their TCP stacks.
const GROUPED_RING_BELOW_BYTES_PER_S: f64 = 2e9 / 8.0;

/// The bytes each rank sends per probe of the link between hosts.
const PROBE_BYTES: usize = 4 << 20;

/// The most bytes of large tensors one [`ring_allreduce_many`] takes (Horovod's fusion
/// threshold); its scratch is the group's size over the number of ranks.
const IN_PLACE_GROUP_BYTES: usize = 128 << 20;

/// The sum ring of [`ring_allreduce`] over several buffers at once, each in place: at
/// every step one message carries the chunk of every buffer (an MPI datatype of blocks
/// at their addresses, so nothing is copied into a fusion buffer first), and the
/// received chunks land end to end in scratch before they are added in. Where each
/// hop crosses hosts, a tensor's own ring leaves the link idle between its steps and
/// between tensors; a group's ring streams like one pre-packed message. One message
/// per step rather than one per buffer: with many rendezvous messages in flight both
/// ways, each side's clear-to-send replies queue behind its own data, and the two
/// directions can end up taking turns (measured: the ResNet-50 set at 1 Gbit/s took
/// 860 or 1700 ms per step from one launch to the next). Each buffer's chunks and
/// summation order are those of its own ring, so all ranks end bit-identical.
fn ring_allreduce_many(
    g: Group,
    order: &[usize],
    pos: usize,
    scratch: &mut Vec<u8>,
    bufs: &mut [&mut [u8]],
    dtype: DType,
) -> Result<()> {
    use super::ring::{add_into, chunk, send_chunk};
    const SEND: &str = "MPI_Isend (grouped ring allreduce)";
    const RECV: &str = "MPI_Irecv (grouped ring allreduce)";
    let n = g.size;
    let r = pos;
    let (right, left) = ring_neighbours(order, r, SEND, RECV)?;
    let es = dtype.size_of();
    let lens: Vec<usize> = bufs.iter().map(|b| b.len() / es).collect();
    // A buffer's first chunk is its largest: their sum bounds every step's message,
    // checked once here so that no count fails once messages are in flight.
    let largest: usize = lens.iter().map(|&len| chunk(len, n, 0).1).sum();
    count(RECV, largest)?;
    scratch.resize(largest * es, 0);
    let ty = datatype(dtype);
    let comm = g.comm;
    // From here on the buffers are reached only through `bases`: an in-flight send
    // reads one chunk of a buffer while the sum writes another.
    let bases: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
    let origin = bases.iter().copied().min().unwrap_or(std::ptr::null_mut());
    let slots = scratch.as_mut_ptr();
    // Chunk `c(len)` of every buffer as one datatype at `origin`.
    let blocks = |call: &'static str, c: &dyn Fn(usize) -> (usize, usize)| {
        let parts: Vec<(usize, usize)> = bases
            .iter()
            .zip(&lens)
            .map(|(&base, &len)| {
                let (a, b) = c(len);
                (base as usize - origin as usize + a * es, b - a)
            })
            .collect();
        Blocks::new(call, ty, &parts)
    };
    (|| {
        let mut sends = Requests(Vec::new());
        let mut recvs = Requests(Vec::new());
        for step in 0..n - 1 {
            let incoming = |len| chunk(len, n, send_chunk(r, step + 1, n));
            let outgoing = blocks(SEND, &|len| chunk(len, n, send_chunk(r, step, n)))?;
            let elems: usize = lens
                .iter()
                .map(|&len| incoming(len))
                .map(|(a, b)| b - a)
                .sum();
            // SAFETY: the scratch holds `largest` >= `elems` elements and nothing
            // touches it until the receive completes; `elems` fits in c_int.
            recvs.post(RECV, |req| unsafe {
                ffi::MPI_Irecv(slots.cast(), elems as c_int, ty, left, 7, comm, req)
            })?;
            // SAFETY: the datatype's blocks are chunks of the buffers, which nothing
            // writes until this send completes.
            sends.post(SEND, |req| unsafe {
                ffi::MPI_Isend(
                    origin.cast_const().cast(),
                    1,
                    outgoing.0,
                    right,
                    7,
                    comm,
                    req,
                )
            })?;
            recvs.wait_all()?;
            let mut at = 0;
            for (&base, &len) in bases.iter().zip(&lens) {
                let (a, b) = incoming(len);
                let bytes = (b - a) * es;
                // SAFETY: the scratch at `at` holds this buffer's incoming chunk, just
                // received; [a, b) is that chunk of the buffer, which no in-flight
                // send reads.
                let (acc, got) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(base.add(a * es), bytes),
                        std::slice::from_raw_parts(slots.add(at), bytes),
                    )
                };
                add_into(acc, got, dtype);
                at += bytes;
            }
            sends.wait_all()?;
        }
        // Allgather: each summed chunk travels once around the ring, straight into
        // its buffer.
        for step in 0..n - 1 {
            let into = blocks(RECV, &|len| chunk(len, n, send_chunk(r, step + n, n)))?;
            let from = blocks(SEND, &|len| chunk(len, n, send_chunk(r, step + n - 1, n)))?;
            // SAFETY: the datatype's blocks are the chunks of the buffers this step
            // fills, which nothing else reads or writes until the receive completes.
            recvs.post(RECV, |req| unsafe {
                ffi::MPI_Irecv(origin.cast(), 1, into.0, left, 7, comm, req)
            })?;
            // SAFETY: as for the reduce-scatter's send.
            sends.post(SEND, |req| unsafe {
                ffi::MPI_Isend(origin.cast_const().cast(), 1, from.0, right, 7, comm, req)
            })?;
            recvs.wait_all()?;
            sends.wait_all()?;
        }
        Ok(())
    })()
}

/// A committed MPI datatype of blocks of one element type at byte offsets (one
/// message over several buffers, without copying them together); freed on drop.
struct Blocks(ffi::MPI_Datatype);

impl Blocks {
    /// Blocks of `(byte offset, elements)` of `ty`.
    fn new(call: &'static str, ty: ffi::MPI_Datatype, parts: &[(usize, usize)]) -> Result<Blocks> {
        let n = count(call, parts.len())?;
        let lens = parts
            .iter()
            .map(|&(_, elems)| count(call, elems))
            .collect::<Result<Vec<c_int>>>()?;
        let offsets = parts
            .iter()
            .map(|&(at, _)| {
                ffi::MPI_Aint::try_from(at)
                    .map_err(|_| Error::Internal(format!("{call}: offset {at} out of range")))
            })
            .collect::<Result<Vec<ffi::MPI_Aint>>>()?;
        let mut t = ty;
        // SAFETY: `lens` and `offsets` hold `n` entries each; `t` receives the new type.
        check(call, unsafe {
            ffi::MPI_Type_create_hindexed(n, lens.as_ptr(), offsets.as_ptr(), ty, &mut t)
        })?;
        let mut blocks = Blocks(t);
        // SAFETY: a type just created, committed once.
        check(call, unsafe { ffi::MPI_Type_commit(&mut blocks.0) })?;
        Ok(blocks)
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        // SAFETY: a type this struct created; MPI lets operations that use it finish.
        unsafe {
            ffi::MPI_Type_free(&mut self.0);
        }
    }
}

/// The ranks of each host: `members[h]` lists host `h`'s ranks in local-rank order
/// (ascending, as `split_shared` keys by rank), hosts in order of their lowest rank.
/// They order the ring, and lay out the hierarchical allgather (which runs only when
/// every host has the same number of ranks).
#[derive(Debug, Clone, PartialEq)]
struct Hosts {
    members: Vec<Vec<usize>>,
}

impl Hosts {
    /// The hosts from every rank's host name (`hosts[r]`, any value shared by the
    /// ranks of one host).
    fn of(hosts: &[c_int]) -> Hosts {
        let mut members: Vec<Vec<usize>> = Vec::new();
        let mut ids: Vec<c_int> = Vec::new();
        for (r, &h) in hosts.iter().enumerate() {
            match ids.iter().position(|&x| x == h) {
                Some(i) => members[i].push(r),
                None => {
                    ids.push(h);
                    members.push(vec![r]);
                }
            }
        }
        Hosts { members }
    }

    /// The ring's order (ranks grouped by host, so that a round-robin placement
    /// crosses each host boundary once) and `rank`'s position in it.
    fn ring(&self, rank: usize) -> (Vec<usize>, usize) {
        let ring = self.members.concat();
        let pos = ring.iter().position(|&r| r == rank).unwrap_or(0);
        (ring, pos)
    }

    /// The host and local rank of `rank`.
    fn place(&self, rank: usize) -> (usize, usize) {
        self.members
            .iter()
            .enumerate()
            .find_map(|(h, m)| m.iter().position(|&r| r == rank).map(|i| (h, i)))
            .unwrap_or((0, 0))
    }

    /// The hosts in the cross-host communicator of local rank `i`, in its rank order
    /// (it is split with the job rank as key).
    fn cross_order(&self, i: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.members.len()).collect();
        order.sort_by_key(|&h| self.members[h][i]);
        order
    }

    /// Elements of each share of a host block of `total` elements cut in `l`:
    /// (offset, length) of share `k`.
    fn share(total: usize, l: usize, k: usize) -> (usize, usize) {
        let (q, r) = (total / l, total % l);
        (k * q + k.min(r), q + usize::from(k < r))
    }

    /// Allgatherv in three steps: gather this host's block within the host; send
    /// share `local_rank` of it to the same local rank on every other host (so each
    /// byte crosses to each host once); gather those shares within the host; then
    /// lay the blocks out in job-rank order, as the flat allgather would.
    #[allow(clippy::too_many_arguments)]
    fn allgatherv(
        &self,
        local: Group,
        cross: Group,
        rank: usize,
        (send, recv): (&[u8], &mut [u8]),
        counts_: &[usize],
        dtype: DType,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        const CALL: &str = "MPI_Allgatherv (hierarchical)";
        per_rank(CALL, counts_, counts_.len())?;
        sized(CALL, "receive", recv.len(), counts_.iter().sum(), dtype)?;
        let w = dtype.size_of();
        let (me_host, me_local) = self.place(rank);
        let l = self.members[me_host].len();
        let block = |h: usize| -> usize { self.members[h].iter().map(|&r| counts_[r]).sum() };
        let blocks: Vec<usize> = (0..self.members.len()).map(block).collect();
        // Scratch: this host's block, this rank's shares of every host, all shares.
        let total: usize = blocks.iter().sum();
        let mine_len = blocks[me_host];
        let order = self.cross_order(me_local);
        let shares_len: usize = order
            .iter()
            .map(|&h| Self::share(blocks[h], l, me_local).1)
            .sum();
        scratch.clear();
        scratch.resize((mine_len + shares_len + total) * w, 0);
        let (host_block, rest) = scratch.split_at_mut(mine_len * w);
        let (my_shares, all) = rest.split_at_mut(shares_len * w);
        // 1. This host's block, in local-rank order.
        let local_counts: Vec<usize> = self.members[me_host].iter().map(|&r| counts_[r]).collect();
        allgatherv_on(local, send, host_block, &local_counts, dtype)?;
        // 2. Share `me_local` of every host's block, in this cross group's order.
        let (off, len) = Self::share(mine_len, l, me_local);
        let cross_counts: Vec<usize> = order
            .iter()
            .map(|&h| Self::share(blocks[h], l, me_local).1)
            .collect();
        allgatherv_on(
            cross,
            &host_block[off * w..(off + len) * w],
            my_shares,
            &cross_counts,
            dtype,
        )?;
        // 3. Every local rank's shares: local rank k's part lists share k of each host
        // in its cross group's order.
        let gathered: Vec<usize> = (0..l)
            .map(|k| {
                (0..self.members.len())
                    .map(|h| Self::share(blocks[h], l, k).1)
                    .sum()
            })
            .collect();
        allgatherv_on(local, my_shares, all, &gathered, dtype)?;
        // Where each rank's tensor starts in `recv` (job-rank order).
        let mut starts = Vec::with_capacity(counts_.len());
        let mut at = 0;
        for &c in counts_ {
            starts.push(at);
            at += c;
        }
        // Each share covers part of its host's block, which lists the host's ranks in
        // local order: copy the pieces to their ranks' places.
        let mut at = 0;
        for k in 0..l {
            for h in self.cross_order(k) {
                let (off, len) = Self::share(blocks[h], l, k);
                let piece = &all[at * w..(at + len) * w];
                at += len;
                let mut member_start = 0;
                for &r in &self.members[h] {
                    let (a, b) = (member_start, member_start + counts_[r]);
                    member_start = b;
                    let (from, to) = (a.max(off), b.min(off + len));
                    if from < to {
                        let dst = starts[r] + (from - a);
                        recv[dst * w..(dst + to - from) * w]
                            .copy_from_slice(&piece[(from - off) * w..(to - off) * w]);
                    }
                }
            }
        }
        Ok(())
    }
}

/// A communicator with this rank's place in it: what the data-plane collectives
/// below run on (kolo's own communicator, or the hierarchical allreduce's levels).
#[derive(Debug, Clone, Copy)]
struct Group {
    comm: ffi::MPI_Comm,
    size: usize,
    rank: usize,
}

/// In-place MPI_Allreduce of `buf` over `g`.
fn allreduce_in_place(g: Group, buf: &mut [u8], dtype: DType, op: ffi::MPI_Op) -> Result<()> {
    const CALL: &str = "MPI_Allreduce";
    let n = count(CALL, buf.len() / dtype.size_of())?;
    // SAFETY: `buf` is valid for the call; MPI_IN_PLACE comes from the MPI header
    // through the C shim.
    check(CALL, unsafe {
        ffi::MPI_Allreduce(
            kolo_mpi_in_place(),
            buf.as_mut_ptr().cast(),
            n,
            datatype(dtype),
            op,
            g.comm,
        )
    })
}

/// MPI_Allgatherv over `g`: rank `r` gives `counts_[r]` elements.
fn allgatherv_on(
    g: Group,
    send: &[u8],
    recv: &mut [u8],
    counts_: &[usize],
    dtype: DType,
) -> Result<()> {
    const CALL: &str = "MPI_Allgatherv";
    per_rank(CALL, counts_, g.size)?;
    sized(CALL, "send", send.len(), counts_[g.rank], dtype)?;
    sized(CALL, "receive", recv.len(), counts_.iter().sum(), dtype)?;
    let (c, displs) = counts(CALL, counts_)?;
    // SAFETY: the buffers hold exactly what the counts say (checked above) and the
    // count arrays outlive the call.
    check(CALL, unsafe {
        ffi::MPI_Allgatherv(
            send.as_ptr().cast(),
            c[g.rank],
            datatype(dtype),
            recv.as_mut_ptr().cast(),
            c.as_ptr(),
            displs.as_ptr(),
            datatype(dtype),
            g.comm,
        )
    })
}

/// MPI_Reduce_scatter over `g`: block `r` (`counts_[r]` elements) lands on rank `r`.
fn reduce_scatter_on(
    g: Group,
    send: &[u8],
    recv: &mut [u8],
    counts_: &[usize],
    dtype: DType,
    op: ffi::MPI_Op,
) -> Result<()> {
    const CALL: &str = "MPI_Reduce_scatter";
    per_rank(CALL, counts_, g.size)?;
    sized(CALL, "send", send.len(), counts_.iter().sum(), dtype)?;
    sized(CALL, "receive", recv.len(), counts_[g.rank], dtype)?;
    let (c, _) = counts(CALL, counts_)?;
    // SAFETY: the buffers hold exactly what the counts say (checked above) and the
    // count array outlives the call.
    check(CALL, unsafe {
        ffi::MPI_Reduce_scatter(
            send.as_ptr().cast(),
            recv.as_mut_ptr().cast(),
            c.as_ptr(),
            datatype(dtype),
            op,
            g.comm,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::err_text;

    #[test]
    fn hosts_list_their_ranks_and_shares_cover_each_block() {
        // Round-robin placement: 0 and 2 on host 0, 1 and 3 on host 1.
        let h = Hosts::of(&[0, 1, 0, 1]);
        assert_eq!(h.members, [vec![0, 2], vec![1, 3]]);
        assert_eq!(h.place(3), (1, 1));
        assert_eq!(h.place(2), (0, 1));
        assert_eq!(h.cross_order(1), [0, 1]);
        // Hosts named so that local rank 1's group orders them the other way.
        let h = Hosts::of(&[5, 5, 7, 7, 7, 5]);
        assert_eq!(h.members, [vec![0, 1, 5], vec![2, 3, 4]]);
        assert_eq!(h.cross_order(0), [0, 1]);
        assert_eq!(h.cross_order(2), [1, 0]);
        for (total, l) in [(0, 2), (1, 3), (10, 3), (7, 7)] {
            let mut next = 0;
            for k in 0..l {
                let (off, len) = Hosts::share(total, l, k);
                assert_eq!(
                    off,
                    next,
                    "{total} in {l}: share {k} starts where {} ends",
                    k.max(1) - 1
                );
                next += len;
            }
            assert_eq!(next, total);
        }
    }

    #[test]
    fn the_ring_visits_hosts_one_after_another() {
        // Ranks placed round-robin over two hosts (named by their lowest rank).
        assert_eq!(Hosts::of(&[0, 1, 0, 1]).ring(1), (vec![0, 2, 1, 3], 2));
        assert_eq!(Hosts::of(&[0, 1, 0, 1]).ring(2), (vec![0, 2, 1, 3], 1));
        // Filled host by host: the ring is the rank order.
        assert_eq!(Hosts::of(&[0, 0, 2, 2]).ring(3), (vec![0, 1, 2, 3], 3));
        // Uneven hosts, three of them.
        assert_eq!(
            Hosts::of(&[0, 1, 2, 0, 1, 0]).ring(4),
            (vec![0, 3, 5, 1, 4, 2], 4)
        );
        assert_eq!(Hosts::of(&[7]).ring(0), (vec![0], 0));
    }

    #[test]
    fn buffers_must_match_their_counts() {
        assert!(sized("MPI_Allgatherv", "receive", 12, 3, DType::F32).is_ok());
        let e = err_text(sized("MPI_Allgatherv", "receive", 8, 3, DType::F32));
        assert!(
            e.contains("MPI_Allgatherv: the receive buffer holds 8 bytes, but the counts need 3 F32 elements (12 bytes)"),
            "{e}"
        );
        assert!(sized("x", "send", 0, usize::MAX, DType::F64).is_err());
        assert!(per_rank("MPI_Alltoallv", &[1, 2], 2).is_ok());
        let e = err_text(per_rank("MPI_Alltoallv", &[1], 2));
        assert!(e.contains("MPI_Alltoallv: 1 counts for 2 ranks"), "{e}");
    }
}
