//! Start-up: MPI initialised on the engine thread, kolo's duplicate of the world
//! communicator with its topology, and the probe of the link between hosts.

use super::*;

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
    pub(super) fn on(
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
        let p2p_comm = parent.duplicate();
        errors_return(&[
            comm.as_raw(),
            local.as_raw(),
            cross.as_raw(),
            p2p_comm.as_raw(),
        ])?;
        let half_ops = HalfOps::create()?;
        let hosts = hosts_of(parent, &local, size);
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
            p2p: Some(super::p2p::P2p::new(p2p_comm)),
            half_ops,
            local,
            cross,
            hierarchical: false,
            hierarchical_min_bytes: 0,
            hierarchical_allgather: false,
            grouped_ring: false,
            algorithm: crate::vocab::AllreduceAlgorithm::Auto,
            multi_host,
            near_steps: hosts.near_steps(size),
            piece_bytes: None,
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
            #[cfg(feature = "fault-injection")]
            fault_bad_root: std::env::var("KOLO_FAULT_MPI_BAD_ROOT").is_ok_and(|v| v == "1"),
            _universe: universe,
        })
    }

    /// The rate between hosts, in bytes/s per rank: the slowest rank's best of two
    /// timed rings of [`PROBE_BYTES`] (after one that sets up the connections), the
    /// same on every rank. Collective.
    pub(super) fn probe_link(&mut self) -> Result<f64> {
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
}

/// Errors come back as return codes on kolo's communicators (and on the process sets'
/// split from them), so that `check` turns them into `Error::Transport` for the op's
/// handle instead of MPI aborting the job (the default handler, MPI_ERRORS_ARE_FATAL).
/// rsmpi's safe calls ignore return codes, so the parent keeps its handler.
fn errors_return(comms: &[ffi::MPI_Comm]) -> Result<()> {
    for &c in comms {
        // SAFETY: `c` is a valid communicator; MPI_ERRORS_RETURN is predefined.
        check("MPI_Comm_set_errhandler", unsafe {
            ffi::MPI_Comm_set_errhandler(c, ffi::RSMPI_ERRORS_RETURN)
        })?;
    }
    Ok(())
}

/// Every rank's host. Each host is named by its lowest rank (local rank 0, as
/// `split_shared` keys by rank); every rank learns every rank's host, which orders the
/// ring. Collective over `parent`.
fn hosts_of(parent: &SimpleCommunicator, local: &SimpleCommunicator, size: usize) -> Hosts {
    let mut host = parent.rank();
    local.process_at_rank(0).broadcast_into(&mut host);
    let mut hosts = vec![0 as c_int; size];
    parent.all_gather_into(&host, &mut hosts[..]);
    Hosts::of(&hosts)
}
