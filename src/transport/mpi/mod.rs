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
//!
//! Here: the cycle exchange and the `Transport` ops. Beside it: `setup.rs` (start-up
//! and the link probe), `agree.rs` (the cycle agreement's messages), `rings.rs`
//! (kolo's sum rings and the measured thresholds that choose them), `group.rs` (a
//! communicator and the blocking collectives on it), `hosts.rs` (the ranks of each
//! host, the hierarchical allreduce and its levels) and `types.rs` (MPI datatypes and
//! ops, checked counts).

mod agree;
use agree::{and_into, pack_sparse, sparse_capacity, unpack_sparse, Words};
mod group;
mod halving;
mod hosts;
mod p2p;
mod pipeline;
mod rings;
mod setup;
mod types;

use smallvec::SmallVec;
use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;
use std::time::{Duration, Instant};

use mpi::collective::{CommunicatorCollectives, Root};
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::Threading;

use crate::transport::choice::{flat_sum, FlatSum};
use group::{
    allgatherv_fresh_on, allgatherv_on, allreduce_in_place, reduce_scatter_fresh_on, Group,
};
use hosts::Hosts;
use rings::{
    ring_allreduce, ring_allreduce_many, ring_reduce_scatter, GROUPED_RING_BELOW_BYTES_PER_S,
    IN_PLACE_GROUP_BYTES, PROBE_BYTES, RING_MIN_BYTES_HOSTS, RING_MIN_BYTES_ONE_HOST,
    RING_REDUCE_SCATTER_MIN_BYTES, RING_SEGMENT_BYTES,
};
use types::{
    check, count, counts, datatype, null_request, per_rank, predefined_op, sized, to_c_int,
    to_usize, HalfOps, MAX_ELEMS_PER_CALL,
};

use super::{abort_requested, Awaited, Idle, Topology, Transport};
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
    /// ... from this many bytes on (smaller allreduces stay flat).
    hierarchical_min_bytes: usize,
    /// Allgather hierarchically (set once at start, the same on every rank).
    hierarchical_allgather: bool,
    /// Large sums in groups through one ring (only where every hop crosses hosts;
    /// set once at start, the same on every rank).
    grouped_ring: bool,
    /// How host sums that are not hierarchical travel (set once at start, the same on
    /// every rank).
    algorithm: crate::vocab::AllreduceAlgorithm,
    /// The job spans hosts.
    multi_host: bool,
    /// The hierarchical allreduce's pipeline pieces (None: by size and hosts; set
    /// once at start, the same on every rank).
    piece_bytes: Option<usize>,
    /// The ranks of every host.
    hosts: Hosts,
    /// The leading steps of the flat halving-doubling butterfly that stay inside
    /// hosts (`Hosts::near_steps`, the same on every rank).
    near_steps: u32,
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
    /// Point to point, on a communicator of its own (`p2p.rs`), until the engine
    /// takes it.
    p2p: Option<p2p::P2p>,
    /// Test-only fault: every broadcast names a root outside the communicator
    /// (`KOLO_FAULT_MPI_BAD_ROOT=1`).
    #[cfg(feature = "fault-injection")]
    fault_bad_root: bool,
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
    fn comm(&self) -> ffi::MPI_Comm {
        self.comm.as_raw()
    }

    /// Waits for `req` with a back-off: spin briefly (latency), then yield, then nap
    /// (through `idle`) with a growing interval capped at 1 ms (CPU).
    fn wait(
        &mut self,
        call: &'static str,
        mut req: ffi::MPI_Request,
        idle: &mut dyn Idle,
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
                self.abort(super::abort_code());
            }
            let waited = start.elapsed();
            idle.poll(waited);
            if waited < Duration::from_micros(50) {
                std::hint::spin_loop();
            } else if waited < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                idle.nap(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
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

impl MpiTransport {
    /// kolo's own communicator with this rank's place in it.
    fn world(&self) -> Group {
        Group {
            comm: self.comm(),
            size: self.topology.size,
            rank: self.topology.rank,
        }
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

    fn exchange(&mut self, local: &[u8], idle: &mut dyn Idle) -> Result<Vec<Vec<u8>>> {
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
        idle: &mut dyn Idle,
    ) -> Result<()> {
        const CALL: &str = "MPI_Isend/MPI_Irecv (cycle agreement)";
        let (n, me) = (self.topology.size, self.topology.rank);
        if n == 1 {
            return Ok(());
        }
        // One message per step: the words, then the f32 values two to a word, sent
        // sparse (`agree::pack_sparse`).
        let nw = words.len();
        let len = nw + sum.len().div_ceil(2);
        let mut mine: Words = smallvec::smallvec![0u64; len];
        mine[..nw].copy_from_slice(words);
        bytemuck::cast_slice_mut::<u64, f32>(&mut mine[nw..])[..sum.len()].copy_from_slice(sum);
        let mut theirs: Words = smallvec::smallvec![0u64; len];
        let mut packed = Words::new();
        let mut msg: Words = smallvec::smallvec![0u64; sparse_capacity(len)];
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
            pack_sparse(&mine, &mut packed);
            self.swap_words(CALL, me - p, Some(&packed), None, idle)?;
            self.swap_words(CALL, me - p, None, Some(&mut msg), idle)?;
            unpack_sparse(&msg, &mut mine);
        } else {
            if me + p < n {
                self.swap_words(CALL, me + p, None, Some(&mut msg), idle)?;
                unpack_sparse(&msg, &mut theirs);
                combine(&mut mine, &theirs);
            }
            let mut mask = 1;
            while mask < p {
                // `swap_words` completes the send before returning, so `packed` is
                // only changed once the peer has it.
                pack_sparse(&mine, &mut packed);
                self.swap_words(CALL, me ^ mask, Some(&packed), Some(&mut msg), idle)?;
                unpack_sparse(&msg, &mut theirs);
                combine(&mut mine, &theirs);
                mask <<= 1;
            }
            if me + p < n {
                pack_sparse(&mine, &mut packed);
                self.swap_words(CALL, me + p, Some(&packed), None, idle)?;
            }
        }
        words.copy_from_slice(&mine[..nw]);
        sum.copy_from_slice(&bytemuck::cast_slice::<u64, f32>(&mine[nw..])[..sum.len()]);
        Ok(())
    }

    fn set_hierarchical_min_bytes(&mut self, bytes: usize) {
        self.hierarchical_min_bytes = bytes;
    }

    fn set_hierarchical_allreduce(&mut self, on: bool) {
        self.hierarchical = on;
    }

    fn awaited(&self) -> Awaited {
        self.awaited.clone()
    }

    fn any_thread(&self) -> bool {
        // MPI_THREAD_SERIALIZED is enough: the engine's lock keeps calls one at a time.
        matches!(self.threading, Threading::Serialized | Threading::Multiple)
    }

    fn set_hierarchical_allgather(&mut self, on: bool) {
        self.hierarchical_allgather = on;
    }

    #[cfg(feature = "nccl")]
    fn open_device(
        &mut self,
        ordinal: Option<usize>,
        timeout: Duration,
    ) -> Result<Box<dyn super::device::DeviceComm>> {
        super::nccl::comm::open(self, ordinal, timeout)
    }

    fn allreduce(&mut self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        if self.hierarchical
            && buf.len() >= self.hierarchical_min_bytes
            && buf.len() / dtype.size_of() >= self.topology.local_size
        {
            return self.hierarchical_allreduce(buf, dtype, op);
        }
        let sum = matches!(op, ReduceOp::Sum | ReduceOp::Average);
        let n = self.topology.size;
        let way = if sum && n > 1 {
            flat_sum(
                self.algorithm,
                n,
                buf.len(),
                self.multi_host,
                self.ring_min_bytes,
            )
        } else {
            FlatSum::Mpi
        };
        let world = self.world();
        match way {
            FlatSum::Ring => ring_allreduce(
                world,
                &self.ring,
                self.ring_pos,
                &mut self.ring_scratch,
                buf,
                dtype,
                self.ring_segment,
            ),
            FlatSum::HalvingDoubling => halving::halving_doubling(
                world,
                self.near_steps,
                &mut self.ring_scratch,
                buf,
                dtype,
            ),
            FlatSum::Mpi => allreduce_in_place(world, buf, dtype, self.reduce_op(op, dtype)),
        }
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

    fn set_allreduce_algorithm(&mut self, algorithm: crate::vocab::AllreduceAlgorithm) {
        self.algorithm = algorithm;
    }

    fn set_hierarchical_piece_bytes(&mut self, bytes: Option<usize>) {
        self.piece_bytes = bytes;
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

    fn p2p_port(&mut self) -> Option<Box<dyn crate::transport::P2pPort>> {
        self.p2p
            .take()
            .map(|p| Box::new(p) as Box<dyn crate::transport::P2pPort>)
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize, dtype: DType) -> Result<()> {
        const CALL: &str = "MPI_Bcast";
        // Test-only (feature fault-injection): a root no rank has, so that MPI itself
        // fails the call and the error must reach the handle.
        #[cfg(feature = "fault-injection")]
        let root = if self.fault_bad_root {
            self.topology.size
        } else {
            root
        };
        let root = count(CALL, root)?;
        // MPI counts are C ints: a buffer of 2^31 elements or more goes in chunks (the
        // same chunks on every rank, since every rank has the same length).
        for chunk in buf.chunks_mut(MAX_ELEMS_PER_CALL * dtype.size_of()) {
            // SAFETY: `chunk` is valid for the call.
            check(CALL, unsafe {
                ffi::MPI_Bcast(
                    chunk.as_mut_ptr().cast(),
                    count(CALL, chunk.len() / dtype.size_of())?,
                    datatype(dtype),
                    root,
                    self.comm(),
                )
            })?;
        }
        Ok(())
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
                types::addr(send),
                sc.as_ptr(),
                sd.as_ptr(),
                datatype(dtype),
                types::addr_mut(recv),
                rc.as_ptr(),
                rd.as_ptr(),
                datatype(dtype),
                self.comm(),
            )
        })
    }

    fn reduce_scatter(
        &mut self,
        send: &mut [u8],
        recv: &mut [u8],
        counts_: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_fresh(send, group::as_uninit(recv), counts_, dtype, op)
    }

    fn allgatherv_fresh(
        &mut self,
        send: &[u8],
        recv: &mut [MaybeUninit<u8>],
        counts_: &[usize],
        dtype: DType,
    ) -> Result<()> {
        if self.hierarchical_allgather {
            return self.allgatherv(send, crate::transport::zero_fill(recv), counts_, dtype);
        }
        allgatherv_fresh_on(self.world(), send, recv, counts_, dtype)
    }

    fn reduce_scatter_fresh(
        &mut self,
        send: &mut [u8],
        recv: &mut [MaybeUninit<u8>],
        counts_: &[usize],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let sum = matches!(op, ReduceOp::Sum | ReduceOp::Average);
        // On one host only: across hosts it was not measured.
        let one_host = self.topology.local_size == self.topology.size;
        if sum && one_host && send.len() >= RING_REDUCE_SCATTER_MIN_BYTES && self.topology.size > 1
        {
            let world = self.world();
            return ring_reduce_scatter(
                world,
                &mut self.ring_scratch,
                send,
                recv,
                counts_,
                dtype,
                self.ring_segment,
            );
        }
        let op = self.reduce_op(op, dtype);
        reduce_scatter_fresh_on(self.world(), send, recv, counts_, dtype, op)
    }
}
