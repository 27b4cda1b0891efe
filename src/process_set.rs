//! [`ProcessSet`]: a subset of the job's ranks that runs collectives on its own.

use crate::engine::request::{self, Named, OpKind, Submission};
use crate::error::{Error, Result};
use crate::handle;
use crate::runtime::Kolo;

/// A subset of the job's ranks, made by [`Kolo::add_process_set`] (Horovod's process
/// sets). Pass it to any collective builder with `.process_set(&set)`: the op then
/// runs among the set's ranks only, negotiated, fused and checked for stalls on its
/// own, so that two sets progress independently and the same tensor name may be in
/// flight in two sets at once.
///
/// Inside a set, [`ReduceOp::Average`](crate::ReduceOp::Average) divides by the set's
/// size, allgather concatenates the set's ranks in order, alltoall splits are per set
/// rank, and a broadcast root is given as a job rank (it must be in the set). Error
/// messages from the set's engine number ranks within the set (see
/// [`ProcessSet::ranks`] for the job rank of each).
#[derive(Debug)]
pub struct ProcessSet {
    id: usize,
    ranks: Vec<usize>,
    /// The set's engine, on its ranks.
    engine: Option<Kolo>,
    /// This rank in the job, for error messages.
    job_rank: usize,
}

impl ProcessSet {
    pub(crate) fn new(id: usize, ranks: Vec<usize>, job_rank: usize, engine: Option<Kolo>) -> Self {
        ProcessSet {
            id,
            ranks,
            engine,
            job_rank,
        }
    }

    /// The set's id: 1 for the first set made, and so on (0 is the job itself), the
    /// same on every rank.
    pub fn id(&self) -> usize {
        self.id
    }

    /// This rank's rank within the set (`0..size()`), or `None` if it is not in it.
    pub fn rank(&self) -> Option<usize> {
        self.ranks.binary_search(&self.job_rank).ok()
    }

    /// The number of ranks in the set.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The set's ranks (job ranks, ascending): the set's rank `i` is `ranks()[i]`.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// Whether job rank `rank` is in the set.
    pub fn includes(&self, rank: usize) -> bool {
        self.ranks.binary_search(&rank).is_ok()
    }

    /// A handle whose collectives run in this set (`rank()` and `size()` within the
    /// set), for code that takes a [`Kolo`]; `None` on a rank outside the set.
    pub fn kolo(&self) -> Option<&Kolo> {
        self.engine.as_ref()
    }

    /// The set's engine, or why this rank cannot submit to it.
    pub(crate) fn engine(&self) -> Result<&Kolo, String> {
        self.engine.as_ref().ok_or_else(|| {
            format!(
                "rank {} is not in process set {} (ranks {:?}); only its ranks may submit to it",
                self.job_rank, self.id, self.ranks
            )
        })
    }

    /// The set rank of job rank `root`, or why it cannot be a root in this set.
    pub(crate) fn set_rank(&self, root: usize) -> Result<usize, String> {
        self.ranks.binary_search(&root).map_err(|_| {
            format!(
                "root {root} is not in process set {} (ranks {:?})",
                self.id, self.ranks
            )
        })
    }

    pub(crate) fn into_engine(self) -> Option<Kolo> {
        self.engine
    }
}

/// Process sets: made and removed on every rank.
impl Kolo {
    /// Makes a process set of `ranks` (Horovod's `add_process_set`): collectives given
    /// `.process_set(&set)` then run among those ranks only, negotiated, fused and
    /// checked for stalls on their own, so that sets progress independently. Every
    /// rank must call it, with the same ranks (in any order), in the same order
    /// relative to its other process set calls; ranks outside the set get a
    /// [`ProcessSet`] they cannot submit to.
    ///
    /// Each set runs its own engine thread on its own MPI communicator (this needs
    /// MPI_THREAD_MULTIPLE, which Open MPI and MPICH give). A set keeps the job's engine
    /// running while it lives; shutting kolo down stops every set first.
    ///
    /// ```no_run
    /// # let kolo = kolo::init()?;
    /// let evens = kolo.add_process_set(&[0, 2])?;
    /// if evens.includes(kolo.rank()) {
    ///     let t = kolo::Tensor::from_vec(vec![1.0f32], &[1])?;
    ///     let sum = kolo.allreduce("x", t).op(kolo::ReduceOp::Sum).process_set(&evens).wait()?;
    ///     assert_eq!(sum.into_vec::<f32>()?, vec![2.0]);
    /// }
    /// kolo.remove_process_set(evens)?;
    /// # Ok::<(), kolo::Error>(())
    /// ```
    ///
    /// # Errors
    /// On every rank: ranks that asked for different sets (naming them and their
    /// lists), an empty list, a rank out of range or listed twice; MPI without
    /// MPI_THREAD_MULTIPLE. The errors of a collective otherwise (a rank left).
    pub fn add_process_set(&self, ranks: &[usize]) -> Result<ProcessSet> {
        // Announced before the collective, so that a shutdown waits for this set's
        // engine to start (on every rank of the set, or fail on all) and then stops
        // it; once shutdown has begun, new sets are refused here, before any rank
        // could start one.
        let _starting = self.starting_set().ok_or_else(|| {
            Error::engine_stopped(
                "add_process_set",
                format!("{ranks:?}"),
                self.rank(),
                "kolo is shutting down on this rank",
            )
        })?;
        let id = self.next_set_id();
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        let mut s = Submission::new(
            OpKind::AddProcessSet,
            format!("{}process_set[{id}]", request::RESERVED_PREFIX).into(),
            Named::new(),
        );
        s.splits = Some(sorted.clone());
        let made = self.submit(s, handle::to_detached)?.wait()?;
        let transport = made
            .downcast::<Option<Box<dyn crate::transport::Transport>>>()
            .map_err(|_| {
                Error::Internal("add_process_set: the engine returned no transport".into())
            })?;
        let kolo = match *transport {
            Some(t) => Some(self.start_set_engine(id, &sorted, t)?),
            None => None,
        };
        Ok(ProcessSet::new(id, sorted, self.rank(), kolo))
    }

    /// Removes a process set: on its ranks, its engine stops (its pending ops fail) and
    /// its communicator is freed. Every rank should call it.
    ///
    /// # Errors
    /// [`Error::Internal`] if the set's engine thread had panicked.
    pub fn remove_process_set(&self, set: ProcessSet) -> Result<()> {
        let Some(engine) = set.into_engine() else {
            return Ok(());
        };
        self.forget_set(&engine);
        engine.shutdown()
    }
}
