//! The vocabulary every layer shares — how tensors are combined and what an alltoall
//! returns — kept in a leaf module (it depends on `tensor` only), so that the
//! transport, the engine and the handles need not import the request builders (which
//! depend on the runtime).

use serde::{Deserialize, Serialize};

use crate::tensor::Tensor;

/// A request's negotiation key: its tensor's name, or a key kolo makes (join, barrier,
/// groups: see `engine::request::RESERVED_PREFIX`).
pub(crate) type Key = std::sync::Arc<str>;

/// How allreduce and reducescatter combine the ranks' tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ReduceOp {
    /// The sum divided by the number of ranks (the default, as in Horovod). Integer
    /// results are computed in f64 and rounded.
    #[default]
    Average,
    /// The elementwise sum.
    Sum,
    /// The elementwise minimum.
    Min,
    /// The elementwise maximum.
    Max,
    /// The elementwise product.
    Product,
    /// Horovod's adaptive summation ([`Kolo::adasum_allreduce`](crate::Kolo::adasum_allreduce)):
    /// orthogonal parts add, common parts average. An allreduce of one f32 host
    /// tensor only (`Kolo::allreduce(..).op(ReduceOp::Adasum)`), run as point to
    /// point exchanges over the engine rather than fused: grouped allreduces,
    /// reducescatter and the integrations' gradient reducers refuse it (their
    /// reducers take `Algorithm::Adasum`).
    Adasum,
}

/// How a host sum (`Sum` or `Average` of tensors in host memory) travels between the
/// ranks when it is not hierarchical (`Config::allreduce_algorithm`,
/// `KOLO_ALLREDUCE_ALGORITHM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum AllreduceAlgorithm {
    /// By size and job: kolo's ring for large sums (on one host from 32 MiB; across
    /// hosts from 1 MiB, and from 8 ranks only while a ring step moves at least
    /// 256 KiB), recursive halving and doubling across hosts from 8 ranks for the
    /// sums between 10 kB and that (where the ring's 2(N−1) message start-ups
    /// dominate), MPI's own allreduce for the rest.
    #[default]
    Auto,
    /// kolo's ring for every sum.
    Ring,
    /// Recursive halving then doubling (Rabenseifner) for every sum.
    HalvingDoubling,
    /// MPI's `MPI_Allreduce` for every sum.
    Mpi,
}

impl AllreduceAlgorithm {
    /// The name `KOLO_ALLREDUCE_ALGORITHM` takes.
    pub fn name(self) -> &'static str {
        match self {
            AllreduceAlgorithm::Auto => "auto",
            AllreduceAlgorithm::Ring => "ring",
            AllreduceAlgorithm::HalvingDoubling => "halving-doubling",
            AllreduceAlgorithm::Mpi => "mpi",
        }
    }
}

/// The result of an alltoall: the received rows and how many came from each rank.
#[derive(Debug, Clone, PartialEq)]
pub struct AlltoallOutput {
    /// Rows received, concatenated in rank order on dim 0.
    pub tensor: Tensor,
    /// `received_splits[r]` rows came from rank `r`.
    pub received_splits: Vec<usize>,
}
