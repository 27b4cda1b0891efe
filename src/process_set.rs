//! [`ProcessSet`]: a subset of the job's ranks that runs collectives on its own.

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
